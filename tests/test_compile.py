"""``--compile`` (patches/compile_blocks.py): each DiT block is one compiled graph that serves all
blocks, within a stated bound of eager, and compiled layouts agree with the compiled one-process run.

Bounds (fp32, CPU, measured on the tiny model; asserted with a margin): a compiled DiT forward is
within ``FORWARD_BOUND`` of eager (measured 4.2e-7: inductor fuses the norms and elementwise work,
the matrix products stay the same library calls); a compiled run's frames within ``FRAMES_BOUND``
of eager's (measured 2.6e-6 after 2 clips of 2 steps and the VAE). The compiled layouts'
frames against the compiled one-process run: ``LAYOUT_BOUND`` (measured 0: Ulysses and CFG-parallel
at 2 ranks equal it bit for bit, and so do hybrid and fsdp-fixed with CFG-parallel, whose FSDP
units are wrapped with ``use_orig_params=True`` under --compile: dynamo refuses FSDP's flat
parameters otherwise).
Eager is never touched: applying and restoring the patch leaves a forward equal to the bit.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY_FLAGS, asset_flags, once_per_run, run_cli
from fault_worker import fault_env

from wan_s2v_runner.shared import exit_codes

FORWARD_BOUND = 1e-5
FRAMES_BOUND = 1e-4
LAYOUT_BOUND = 1e-4

SMALL = {"dim": 256, "ffn_dim": 512, "num_heads": 4, "num_layers": 4, "audio_inject_layers": [0, 2, 3],
         "audio_dim": 64}


@pytest.fixture
def wan_sdpa():
    from patches import attention, compile_blocks
    from wan_s2v_runner.loading.engine import import_wan
    wan = import_wan()
    attention.apply(wan, "sdpa")
    yield wan
    compile_blocks.restore(wan)


def test_real_rope_equals_the_engines_complex_rope(wan_sdpa):
    from patches.compile_blocks import rope_real
    rope_apply = wan_sdpa.modules.s2v.model_s2v.rope_apply
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 4, 64, generator=g)
    angles = torch.randn(2, 310, 1, 32, dtype=torch.float64, generator=g)  # a table longer than x, as upstream's
    freqs = torch.polar(torch.ones_like(angles), angles)
    assert torch.equal(rope_real(x, torch.view_as_real(freqs)), rope_apply(x, None, freqs))


def test_the_attention_op_runs_the_engines_attention(wan_sdpa):
    from patches.compile_blocks import CROSS, SELF, attention_op
    model_s2v = wan_sdpa.modules.s2v.model_s2v
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 40, 4, 16, generator=g) for _ in range(3))
    lens = torch.tensor([33])
    assert torch.equal(attention_op(q, k, v, lens, SELF, None),
                       model_s2v.flash_attention(q=q, k=k, v=v, k_lens=lens))
    assert torch.equal(attention_op(q, k, v, None, CROSS, None),
                       wan_sdpa.modules.model.flash_attention(q=q, k=k, v=v, k_lens=None))


def test_a_compiled_attention_runs_under_the_callers_autocast_as_eager_does(wan_sdpa):
    """A compiled graph calls its custom ops with autocast off; the op re-enters the caller's, so
    attention inside a compiled block runs in the loop's dtype as upstream's does (on an H200 it ran
    in fp32 without this, 4x slower). Shown with the CPU's bf16 autocast: the fp32 q/k the rope
    makes go to SDPA as bf16 in eager, and must in the compiled block too."""
    from patches.compile_blocks import SELF, attention_op
    model_s2v = wan_sdpa.modules.s2v.model_s2v
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 64, 4, 16, generator=g) for _ in range(3))
    lens = torch.tensor([64])

    def body(q, k, v, amp):
        return attention_op(q * 1.0, k, v, lens, SELF, amp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model_s2v.flash_attention(q=q, k=k, v=v, k_lens=lens)
        compiled = torch.compile(body, fullgraph=True, dynamic=False)(q, k, v, torch.bfloat16)
    fp32 = model_s2v.flash_attention(q=q, k=k, v=v, k_lens=lens)
    assert not torch.equal(eager, fp32)  # the autocast changes the result: the test can fail
    assert torch.equal(compiled, eager)


@pytest.mark.slow(seconds=60)
def test_each_block_is_one_graph_compiled_once_within_the_bound_of_eager(wan_sdpa):
    from torch._dynamo.utils import counters

    from patches import compile_blocks, context_cache
    from wan_s2v_runner.demo.random_weights import dit_kwargs, random_dit, random_dit_inputs
    from wan_s2v_runner.preflight.geometry import token_counts

    torch.manual_seed(0)
    model, _ = random_dit(wan_sdpa, torch.device("cpu"), torch.float32, **SMALL)
    context_cache.apply(model)  # as the runner loads it: cross-attention keys and values from the memo
    cfg = dit_kwargs(wan_sdpa, **SMALL)
    x, t, cond, _ = random_dit_inputs(int(cfg["audio_dim"]), int(cfg["motion_frames"]), token_counts(128, 128, 8), 8,
                                      torch.device("cpu"), torch.float32, False)
    seen = []
    with torch.no_grad():
        eager = model(x, t=t, **cond)
        compiled = compile_blocks.apply(wan_sdpa, torch.float32, on_compile=seen.append)
        counters.clear()
        first = model(x, t=t, **cond)  # fullgraph=True: a graph break inside the block would raise
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # 4 blocks, one compilation
        assert not counters["graph_break"], dict(counters["graph_break"])
        again = model(x, t=t, **cond)
        assert counters["stats"]["unique_graphs"] == 1  # the next step compiles nothing
        assert len(seen) == 1 and seen[0]["seconds"] > 0 and len(compiled.seen) == 1, seen
        # AOTAutograd keeps the block (its autocast regions marked cacheable): answered, not bypassed
        answered = seen[0]["cache"]
        assert answered.keys() & {"autograd_cache_hit", "autograd_cache_miss"}, answered
        assert "autograd_cache_bypass" not in answered, answered
        diff = max((a - b).abs().max().item() for a, b in zip(eager, first))
        assert 0 < diff <= FORWARD_BOUND or diff == 0, diff
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert context_cache.stats(model)["kv_hits"] > 0  # the memo served the compiled blocks' keys
        assert compile_blocks.restore(wan_sdpa)
        marked = torch._inductor.config.unsafe_marked_cacheable_functions
        assert not set(compile_blocks.AUTOCAST_NODES) & set(marked), marked  # unmarked again
        back = model(x, t=t, **cond)
    assert all(torch.equal(a, b) for a, b in zip(eager, back)), "eager changed by applying the patch"


def _frames(tmp_path, name):
    return torch.load(tmp_path / f"{name}.pt")


@pytest.fixture(scope="session")
def compiled_one(tiny_assets, inductor_cache, tmp_path_factory) -> dict:
    """The compiled one-process run of the shared tiny spec (``--nproc 1 --compile``), once per
    test run (conftest.once_per_run): its frames and its stage seconds. What every compiled layout
    and a compiled run resumed must equal."""
    def make():
        d = tmp_path_factory.mktemp("compiled-one")
        r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "1", "--compile",
                     "--frames-out", str(d / "one.pt"), "--output", str(d / "one.mp4"),
                     "--runs-root", str(d / "runs")], cwd=d, env=inductor_cache)
        assert r.returncode == 0, r.output
        manifest = json.loads(next((d / "runs").glob("*/run.json")).read_text())
        return {"frames": torch.load(d / "one.pt"), "stage_seconds": manifest["stage_seconds"]}
    return once_per_run(tmp_path_factory, "compiled_one", make)


@pytest.mark.slow(seconds=330)
def test_compiled_layouts_agree_and_a_batch_compiles_each_size_once(tiny_assets, reference_frames, inductor_cache,
                                                                    compiled_one, tmp_path):
    """A 2-rank Ulysses batch of two same-size jobs, compiled, against the compiled one-process run
    of the first job; the second job compiles nothing (no ``compile`` stage in its timings); a
    2-rank CFG-parallel run, a 2-rank hybrid run (FSDP-sharded DiT, Ulysses) and a 2-rank
    fsdp-fixed CFG-parallel run, compiled, against the same. Measured: all equal the compiled
    one-process frames bit for bit (2026-11-26, CPU); the bound is asserted."""
    cache = inductor_cache
    assert compiled_one["stage_seconds"].get("compile", 0) > 0, compiled_one["stage_seconds"]
    one_frames = compiled_one["frames"]
    eager_diff = (one_frames - reference_frames).abs().max().item()
    assert eager_diff <= FRAMES_BOUND, eager_diff

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps(j) + "\n" for j in (
        {"id": "first", "frames_out": str(tmp_path / "first.pt")},
        {"id": "second", "seed": 5, "prompt": "another person", "frames_out": str(tmp_path / "second.pt")})))
    out = tmp_path / "out"
    r = run_cli(["batch", str(jobs), *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", "--mode", "ulysses",
                 "--compile", "--output-dir", str(out), "--runs-root", str(tmp_path / "runs")], cwd=tmp_path, env=cache)
    assert r.returncode == 0, r.output
    layout_diff = (_frames(tmp_path, "first") - one_frames).abs().max().item()
    assert layout_diff <= LAYOUT_BOUND, layout_diff
    first, second = (json.loads((out / f"{n}.json").read_text())["stage_seconds"] for n in ("first", "second"))
    assert first.get("compile", 0) > 0, first
    assert "compile" not in second and second["denoise"] > 0, second
    diffs = {"ulysses": layout_diff}
    for name, layout in (("cfg", ["--mode", "ulysses", "--cfg-parallel"]), ("hybrid", ["--mode", "hybrid"]),
                         ("fsdp-cfg", ["--mode", "fsdp-fixed", "--cfg-parallel"])):
        r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", *layout, "--compile",
                     "--frames-out", str(tmp_path / f"{name}.pt"), "--output", str(tmp_path / f"{name}.mp4"),
                     "--runs-root", str(tmp_path / f"runs-{name}")], cwd=tmp_path, env=cache)
        assert r.returncode == 0, r.output
        diffs[name] = (_frames(tmp_path, name) - one_frames).abs().max().item()
        assert diffs[name] <= LAYOUT_BOUND, (name, diffs[name])
        if name == "cfg":  # whole sequences, as the one-process run compiled them: both caches answer from it
            for rank in (0, 1):
                events = (next((tmp_path / "runs-cfg").glob("*/events")) / f"rank{rank}.jsonl").read_text()
                answers = [json.loads(line)["cache"] for line in events.splitlines() if '"kind": "compile"' in line]
                assert answers and all(a.get("autograd_cache_hit") and not a.get("autograd_cache_miss")
                                       for a in answers), (rank, answers)
    print(f"compiled vs eager frames: {eager_diff:.3g}; compiled, 2 ranks vs 1: "
          + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))


def _random_lora(ckpt: Path, out: Path) -> Path:
    """A random peft-format LoRA (rank 4, alpha absent: scale 1) on every block's q, o and FFN."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(3)
    lora = {}
    with safe_open(str(ckpt / "diffusion_pytorch_model.safetensors"), "pt") as f:
        for name in f.keys():
            if re.fullmatch(r"blocks\.\d+\.(self_attn\.(q|o)|ffn\.0)\.weight", name):
                rows, cols = f.get_slice(name).get_shape()
                module = name[:-len(".weight")]
                lora[f"{module}.lora_A.weight"] = torch.randn(4, cols, generator=g) * 0.3
                lora[f"{module}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.3
    save_file(lora, str(out))
    return out


@pytest.mark.slow(seconds=90)
def test_lora_and_pose_compile_as_they_run_eager(tiny_assets, pose_reference_frames, inductor_cache, tmp_path):
    """A LoRA (merged into the weights the compiled block takes as inputs) and a pose video
    (conditioning made outside the blocks), compiled against the same run eager: within the
    frames bound; the LoRA changes the frames, so the bound is not met by a LoRA left out."""
    cache = inductor_cache
    lora = _random_lora(tiny_assets.ckpt_dir, tmp_path / "lora.safetensors")
    flags = [*TINY_FLAGS, "--nproc", "1", "--pose-video", str(tiny_assets.pose_video), "--lora", f"{lora}:0.8"]
    frames = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        d = tmp_path / name
        d.mkdir()
        r = run_cli(["run", *flags, *asset_flags(tiny_assets), *extra, "--output", str(d / "o.mp4"),
                     "--frames-out", str(d / "f.pt"), "--runs-root", str(d / "runs")], cwd=d, env=cache)
        assert r.returncode == 0, r.output
        frames[name] = torch.load(d / "f.pt")
    lora_effect = (frames["eager"] - pose_reference_frames).abs().max().item()
    assert lora_effect > 100 * FRAMES_BOUND, lora_effect  # the LoRA acts
    diff = (frames["compiled"] - frames["eager"]).abs().max().item()
    assert diff <= FRAMES_BOUND, diff
    print(f"compiled vs eager, LoRA + pose: {diff:.3g} (the LoRA moves the frames by {lora_effect:.3g})")


def test_a_compile_cache_path_inductor_cannot_use_is_refused_before_any_rank(tiny_assets, tmp_path):
    """Inductor's C++ build splits its command line on spaces: caught by preflight, not mid-run."""
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "1", "--compile",
                 "--output", str(tmp_path / "o.mp4"), "--runs-root", str(tmp_path / "runs")], cwd=tmp_path,
                env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "my cache")})
    assert r.returncode == exit_codes.PREFLIGHT, r.output
    assert "engine.compile" in r.output and "cannot use a cache path with spaces" in r.output, r.output
    assert not (tmp_path / "runs").exists()  # nothing spawned


def test_compile_is_a_group_setting_from_flags_toml_and_environment(tmp_path):
    from wan_s2v_runner.launcher import flags
    from wan_s2v_runner.shared.config import env_values, load_toml
    toml = tmp_path / "run.toml"
    toml.write_text("compile = true\n")
    assert load_toml(toml) == {"compile": True}
    assert env_values({"WAN_S2V_COMPILE": "1"}) == {"compile": True}
    assert env_values({"WAN_S2V_COMPILE": "0"}) == {"compile": False}
    for command in (flags.Command.RUN, flags.Command.BATCH, flags.Command.SERVE):
        parser = argparse.ArgumentParser()
        flags.add_spec_flags(parser, command)
        assert flags.flag_values(parser.parse_args(["--compile"]))["compile"] is True, command
        assert "compile" not in flags.flag_values(parser.parse_args([])), command  # unset: env/TOML/default decide


@pytest.mark.slow(seconds=100)
def test_a_compiled_run_resumes_to_the_uninterrupted_compiled_frames(tiny_assets, inductor_cache, compiled_one,
                                                                     tmp_path):
    """--compile and resume: a compiled run whose rank fails in clip 2 of 2, resumed (compiled: the
    group setting comes from the run), makes the uninterrupted compiled run's clip 2
    (``compiled_one``; within ``LAYOUT_BOUND``; measured: equal). Resume hands the loop clip 1's
    motion latents, made outside the compiled blocks."""
    cache = inductor_cache
    one_rank = [*TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "1", "--compile"]
    crash = tmp_path / "crash"
    crash.mkdir()
    r = run_cli(["run", *one_rank, "--frames-out", str(crash / "f.pt"), "--output", str(crash / "o.mp4"),
                 "--runs-root", str(crash / "runs")], cwd=crash,
                env={**cache, **fault_env("0:denoise@2:raise")})
    assert r.returncode == exit_codes.RANK_FAILED, r.output
    run_dir = next((crash / "runs").iterdir())
    r = run_cli(["resume", str(run_dir)], cwd=crash, env=cache)
    assert r.returncode == 0, r.output
    assert "at clip 2/2" in r.stderr
    resumed = [d for d in (crash / "runs").iterdir() if d != run_dir]
    assert len(resumed) == 1, resumed
    spec = json.loads((resumed[0] / "spec.json").read_text())
    assert spec["compile"] and spec["resume_from"] == str(run_dir), spec
    # the resumed run's raw frames are the clips it made: clip 2 (clip 1: 8 - 3 frames)
    diff = (torch.load(crash / "f.pt") - compiled_one["frames"][:, 5:]).abs().max().item()
    assert diff <= LAYOUT_BOUND, diff
