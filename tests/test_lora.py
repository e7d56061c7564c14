"""LoRA: the three public key formats map onto the DiT, a merged LoRA equals peft's un-merged
adapter on the same DiT, strength 0 is exactly no LoRA, and every format and layout gives the
same frames; a LoRA for another model is refused before anything is spawned.

LoRAs are built here from random A/B matrices with peft (on the tiny checkpoint's DiT)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import TINY_FLAGS, asset_flags, run_cli

from wan_s2v_runner.cli import main as cli
from wan_s2v_runner.loading.ckpt_tables import dit_shapes
from wan_s2v_runner.loading.lora import LoraFormat, LoraSource, merge, plan
from wan_s2v_runner.shared import exit_codes

TARGETS = (r"(blocks\.\d+\.(self_attn|cross_attn)\.(q|k|v|o)|blocks\.\d+\.ffn\.(0|2)"
           r"|audio_injector\.injector\.\d+\.(q|k|v|o))")
RANK = 4


@pytest.fixture(scope="module")
def wan():
    from patches import attention
    from wan_s2v_runner.loading.engine import import_wan
    w = import_wan()
    attention.apply(w, "sdpa")
    return w


def load_dit(ckpt: Path):
    from wan.modules.s2v.model_s2v import WanModel_S2V
    return WanModel_S2V.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()


def dit_inputs(seed=0):
    """One DiT call as WanS2V.generate makes it (64x64, 8 frames, tiny dims)."""
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g)
    x = r(1, 16, 2, 8, 8)
    return x, dict(t=torch.tensor([500.0]), context=[r(16, 4096)], seq_len=None, ref_latents=r(1, 16, 1, 8, 8),
                   motion_latents=r(1, 16, 19, 8, 8), cond_states=torch.zeros(1, 16, 2, 8, 8),
                   audio_input=r(1, 25, 32, 8), motion_frames=[73, 19], drop_motion_frames=False)


def peft_lora(ckpt: Path, alpha: int, seed: int):
    """The tiny DiT with a random (non-zero) peft LoRA adapter injected, un-merged."""
    from peft import LoraConfig, inject_adapter_in_model
    torch.manual_seed(seed)
    cfg = LoraConfig(r=RANK, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
    return inject_adapter_in_model(cfg, load_dit(ckpt))


def write_formats(state: dict, out: Path, alpha: float) -> dict[LoraFormat, Path]:
    """The same LoRA in the three key families (peft without alpha; kohya and ComfyUI with it)."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    peft, kohya, comfy = {}, {}, {}
    for k, v in state.items():
        module, ab = k.rsplit(".lora_", 1)
        part = "down" if ab.startswith("A") else "up"
        peft[k] = v
        kohya[f"lora_unet__{module.replace('.', '_')}.lora_{part}.weight"] = v
        comfy[f"diffusion_model.{module}.lora_{part}.weight"] = v
        if part == "down":
            kohya[f"lora_unet__{module.replace('.', '_')}.alpha"] = torch.tensor(alpha)
            comfy[f"diffusion_model.{module}.alpha"] = torch.tensor(alpha)
    paths = {}
    for fmt, sd in ((LoraFormat.PEFT, peft), (LoraFormat.KOHYA, kohya), (LoraFormat.COMFYUI, comfy)):
        paths[fmt] = out / f"lora-{fmt.value}.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(paths[fmt]))
    return paths


@pytest.fixture(scope="module")
def same_lora(tiny_assets, wan, tmp_path_factory):
    """One random LoRA (alpha = rank: scale 1) in all three formats."""
    from peft import get_peft_model_state_dict
    state = get_peft_model_state_dict(peft_lora(tiny_assets.ckpt_dir, alpha=RANK, seed=1))
    return write_formats(state, tmp_path_factory.mktemp("loras"), alpha=float(RANK))


# --------------------------------------------------------------------------- mapping (pure)
def test_formats_map_to_the_same_parameters(tiny_assets, same_lora):
    from wan_s2v_runner.loading.lora import file_shapes
    dit = dit_shapes(tiny_assets.ckpt_dir)
    plans = {f: plan(file_shapes(p), dit) for f, p in same_lora.items()}
    for f, p in plans.items():
        assert p.formats == [f] and p.ok, (f, p.problems())
        assert len(p.matched_modules) == 2 * (4 + 4 + 2) + 2 * 4  # 2 blocks x (self q/k/v/o, cross, ffn) + injector
    assert len({tuple(sorted(p.targets)) for p in plans.values()}) == 1


def test_unmatched_names_and_wrong_shapes_are_reported(tiny_assets):
    dit = dit_shapes(tiny_assets.ckpt_dir)
    p = plan({"transformer_blocks.0.attn1.to_q.lora_A.weight": (4, 32),
              "transformer_blocks.0.attn1.to_q.lora_B.weight": (32, 4),
              "blocks.0.self_attn.q.lora_A.weight": (4, 64), "blocks.0.self_attn.q.lora_B.weight": (32, 4),
              "some.other.tensor": (3,)}, dit)
    assert p.unmatched == ["transformer_blocks.0.attn1.to_q"] and p.unrecognised == ["some.other.tensor"]
    assert p.shape_errors == ["blocks.0.self_attn.q (LoRA [32, 4] @ [4, 64] vs weight [32, 32])"]
    assert not p.ok and "diffusers' naming" in p.likely_cause()


# --------------------------------------------------------------------------- merge == peft
def test_merged_dit_equals_peft_unmerged_adapter(tiny_assets, wan, tmp_path):
    """alpha = 2 x rank: peft scales by alpha/r; the kohya/ComfyUI files carry the alpha."""
    from peft import get_peft_model_state_dict
    x, kw = dit_inputs()
    with torch.no_grad():
        y_base = load_dit(tiny_assets.ckpt_dir)(x, **kw)[0]
    adapted = peft_lora(tiny_assets.ckpt_dir, alpha=2 * RANK, seed=2)
    with torch.no_grad():
        y_peft = adapted(x, **kw)[0]
    assert (y_peft - y_base).abs().max() > 1e-2  # the adapter does something
    paths = write_formats(get_peft_model_state_dict(adapted), tmp_path, alpha=float(2 * RANK))
    for fmt in (LoraFormat.KOHYA, LoraFormat.COMFYUI):
        dit = load_dit(tiny_assets.ckpt_dir)
        rec = merge(dit, [LoraSource(paths[fmt], 1.0)])
        assert rec[0]["format"] == fmt.value and rec[0]["matched_modules"] == 28
        with torch.no_grad():
            y = dit(x, **kw)[0]
        assert torch.allclose(y, y_peft, rtol=1e-5, atol=1e-5), (fmt, (y - y_peft).abs().max())


def test_strength_and_several_loras_accumulate_once(tiny_assets, same_lora, wan):
    """Every format at strength 0 leaves every weight bit for bit (so the frames are no LoRA's),
    recorded in the order given; strengths add up: 0.5 + 0.5 of the same LoRA == 1.0 once."""
    from wan_s2v_runner.loading.lora import describe
    from wan_s2v_runner.shared.spec import LoraRef

    base = load_dit(tiny_assets.ckpt_dir)
    zero = load_dit(tiny_assets.ckpt_dir)
    records = merge(zero, [LoraSource(p, 0.0) for p in same_lora.values()])
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), zero.state_dict().values()))
    order = [f.value for f in same_lora]
    assert [r["format"] for r in records] == order
    assert [r["format"] for r in describe([LoraRef.model_validate(f"{p}:0") for p in same_lora.values()],
                                                  tiny_assets.ckpt_dir)] == order
    half_twice = load_dit(tiny_assets.ckpt_dir)
    merge(half_twice, [LoraSource(same_lora[LoraFormat.PEFT], 0.5), LoraSource(same_lora[LoraFormat.KOHYA], 0.5)])
    once = load_dit(tiny_assets.ckpt_dir)
    merge(once, [LoraSource(same_lora[LoraFormat.COMFYUI], 1.0)])
    w = "blocks.0.self_attn.q.weight"
    assert not torch.equal(once.state_dict()[w], base.state_dict()[w])
    assert torch.allclose(half_twice.state_dict()[w], once.state_dict()[w], atol=1e-6)


def test_diff_and_diff_b_deltas(tiny_assets, wan, tmp_path):
    from safetensors.torch import save_file
    dit = load_dit(tiny_assets.ckpt_dir)
    w0 = dit.state_dict()["blocks.1.norm3.weight"].clone()
    b0 = dit.state_dict()["blocks.1.ffn.2.bias"].clone()
    dw, db = torch.randn_like(w0), torch.randn_like(b0)
    path = tmp_path / "diffs.safetensors"
    save_file({"diffusion_model.blocks.1.norm3.diff": dw, "diffusion_model.blocks.1.ffn.2.diff_b": db}, str(path))
    merge(dit, [LoraSource(path, 0.5)])
    assert torch.equal(dit.state_dict()["blocks.1.norm3.weight"], w0 + 0.5 * dw)
    assert torch.equal(dit.state_dict()["blocks.1.ffn.2.bias"], b0 + 0.5 * db)


# --------------------------------------------------------------------------- refusals before spawn
def test_lora_for_another_model_is_refused_before_spawn(tiny_assets, tmp_path, capsys):
    from safetensors.torch import save_file
    other = tmp_path / "flux-lora.safetensors"
    save_file({"transformer.single_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 3072),
               "transformer.single_blocks.0.attn.to_q.lora_B.weight": torch.zeros(3072, 4)}, str(other))
    runs = tmp_path / "runs"
    argv = ["run", *asset_flags(tiny_assets), "--prompt", "hi", "--device", "cpu", "--size", "64*64",
            "--infer-frames", "8", "--output", str(tmp_path / "o.mp4"), "--runs-root", str(runs)]
    rc = cli.main(argv + ["--lora", str(other)])
    err = capsys.readouterr().err
    assert rc == exit_codes.PREFLIGHT
    assert "FAIL lora.match: flux-lora.safetensors: peft format, 0 modules matched, 1 unmatched" in err
    assert "another model" in err and not runs.exists()
    rc = cli.main(argv + ["--lora", str(tmp_path / "missing.safetensors:0.7")])
    assert rc == exit_codes.PREFLIGHT and "missing.safetensors does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- frames, every layout
def _run(tiny_assets, d: Path, *extra) -> tuple[torch.Tensor, dict]:
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--output", str(d / "o.mp4"),
                 "--frames-out", str(d / "f.pt"), "--runs-root", str(d / "runs"), "--json", *extra], cwd=d)
    assert r.returncode == 0, r.output
    return torch.load(d / "f.pt"), json.loads(r.stdout)


@pytest.mark.slow
def test_frames_same_for_every_format_and_layout(tiny_assets, same_lora, reference_frames, tmp_path):
    """ComfyUI at 1 process == peft in fsdp-fixed x2 == kohya in hybrid x2 with --cfg-parallel
    (FSDP shards shared by the two CFG branches) (exact, fp32), and != no LoRA. (Strength 0 is
    no LoRA exactly: the weights are unchanged, test_strength_and_several_loras_accumulate_once.)"""
    layouts = (("one", LoraFormat.COMFYUI, ["--nproc", "1"]),
               ("fsdp", LoraFormat.PEFT, ["--mode", "fsdp-fixed", "--nproc", "2"]),
               ("hybrid", LoraFormat.KOHYA, ["--mode", "hybrid", "--nproc", "2", "--cfg-parallel"]))
    for name, _, _ in layouts:
        (tmp_path / name).mkdir()
    # the three runs at once (each its own launcher and OS-picked rendezvous port): on 2 cores
    # one run's imports and start-up overlap another's compute
    with ThreadPoolExecutor(len(layouts)) as pool:
        futures = {name: pool.submit(_run, tiny_assets, tmp_path / name, *layout, "--lora", f"{same_lora[fmt]}:0.8")
                   for name, fmt, layout in layouts}
        runs = {name: f.result() for name, f in futures.items()}
    frames = {k: v[0] for k, v in runs.items()}
    assert (frames["one"] - reference_frames).abs().max() > 1e-3  # the LoRA changes the video
    assert torch.equal(frames["one"], frames["fsdp"]) and torch.equal(frames["one"], frames["hybrid"])
    assert runs["hybrid"][1]["layout"]["cfg_degree"] == 2
    rec = runs["fsdp"][1]["loras"][0]
    assert rec["format"] == "peft" and rec["strength"] == 0.8 and rec["matched_modules"] == 28
    assert len(rec["sha256"]) == 64



def test_partial_lora_rule_is_the_same_in_preflight_and_merge(tiny_assets, wan, tmp_path):
    """Unmatched modules and stray keys: refused by both without --lora-allow-partial, merged
    (matching modules only) with it; wrong shapes: refused either way."""
    from safetensors.torch import save_file
    path = tmp_path / "partial.safetensors"
    save_file({"blocks.0.self_attn.q.lora_A.weight": torch.randn(RANK, 32),
               "blocks.0.self_attn.q.lora_B.weight": torch.randn(32, RANK),
               "blocks.9.self_attn.q.lora_A.weight": torch.randn(RANK, 32),
               "blocks.9.self_attn.q.lora_B.weight": torch.randn(32, RANK),
               "extra.note": torch.zeros(1)}, str(path))
    from wan_s2v_runner.loading.lora import file_shapes
    p = plan(file_shapes(path), dit_shapes(tiny_assets.ckpt_dir))
    assert p.refused(False) and not p.refused(True)
    with pytest.raises(ValueError, match="does not fit this DiT"):
        merge(load_dit(tiny_assets.ckpt_dir), [LoraSource(path, 1.0)])
    rec = merge(load_dit(tiny_assets.ckpt_dir), [LoraSource(path, 1.0)], allow_partial=True)
    assert rec[0]["matched_modules"] == 1 and rec[0]["unmatched_modules"] == 1
    bad = plan({"blocks.0.self_attn.q.lora_A.weight": (RANK, 64), "blocks.0.self_attn.q.lora_B.weight": (32, RANK)},
               dit_shapes(tiny_assets.ckpt_dir))
    assert bad.refused(True) and bad.refused(False)
