"""``--dit-file``: the DiT from one ComfyUI-style safetensors file (issue #47, part 1).

The files are built here from the tiny checkpoint's DiT, in each form users hold: bare names or
under ``model.diffusion_model.``; full precision; fp8 cast without scales; ComfyUI's older scaled
fp8 (``scaled_fp8`` marker, per-tensor ``scale_weight``); its newer form (``weight_scale``,
``comfy_quant`` records, per-tensor or per-row scales) and the same with the format in the
header's ``_quantization_metadata`` and the fp8 bytes in a uint8 container. A scaled weight's
value is ``fp8.to(float32) * scale``; the reference for each fp8 file is a full-precision file
holding exactly those values, which the fp8 file must equal to the bit.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY_FLAGS, asset_flags, cpu_engine, one_process_frames, run_cli
from wan_s2v_runner.loading import ckpt_read
from wan_s2v_runner.loading.dit_file import DitFileFormat, inspect
from wan_s2v_runner.preflight import CheckContext, Status, run_checks
from wan_s2v_runner.preflight.core import find
from wan_s2v_runner.preflight.probe import probe_machine
from wan_s2v_runner.shared.ckpt_layout import DIT_WEIGHTS

COMFY = "model.diffusion_model."
E4M3_MAX = 448.0


def dir_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / DIT_WEIGHTS))


def quantized(name: str, t: torch.Tensor) -> bool:
    """The Linears a ComfyUI fp8 file stores in fp8: 2-D weights of the blocks and the audio
    injection (Kijai's rule keeps embeddings, modulation, norms, biases, encoders, head)."""
    return t.dim() == 2 and name.endswith(".weight") and name.startswith(("blocks.", "audio_injector.injector."))


def fp8_file(tensors: dict[str, torch.Tensor], path: Path, form: str, *, per_row: bool = False,
             prefix: str = "") -> dict[str, torch.Tensor]:
    """Write ``tensors`` as an fp8 DiT file of ``form`` (``cast``, ``scale_weight``, ``comfy_quant``,
    ``metadata``); return the values it stands for (the dequantized reference, float32)."""
    out, ref, layers = {}, {}, {}
    for name, t in tensors.items():
        if not quantized(name, t):
            out[prefix + name], ref[name] = t, t.float()
            continue
        w = t.float()
        if form == "cast":
            q = w.to(torch.float8_e4m3fn)
            out[prefix + name], ref[name] = q, q.float()
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1)
        scale = (amax / E4M3_MAX).clamp_min(1e-12).float()
        q = (w / scale).to(torch.float8_e4m3fn)
        ref[name] = q.float() * scale
        module = prefix + name.removesuffix(".weight")
        if form == "scale_weight":
            out[prefix + name], out[f"{module}.scale_weight"] = q, scale
            out[f"{module}.scale_input"] = torch.ones(1)
        elif form == "comfy_quant":
            out[prefix + name] = q
            out[f"{module}.weight_scale"] = scale if per_row else scale.reshape(())
            out[f"{module}.input_scale"] = torch.ones(())
            out[f"{module}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                        dtype=torch.uint8)
        else:  # metadata: the format in the header, fp8 stored as uint8
            out[prefix + name] = q.view(torch.uint8)
            out[f"{module}.weight_scale"] = scale if per_row else scale.reshape(())
            layers[module] = {"format": "float8_e4m3fn"}
    if form == "scale_weight":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} if layers else None
    save_file(out, str(path), metadata=meta)
    return ref


def read_all(source) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint source, read whole into float32."""
    out = {}
    for name, (_, shape) in source.table().items():
        t = torch.empty(shape, dtype=torch.float32)
        source.read_flat(name, 0, t.view(-1))
        out[name] = t
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from wan_s2v_runner.demo.synthetic_inputs import make_reference_image, make_speech_audio
    from wan_s2v_runner.demo.tiny_checkpoint import build_tiny_checkpoint
    root = tmp_path_factory.mktemp("dit_file")
    return {"ckpt": build_tiny_checkpoint(root / "ckpt"), "root": root,
            "image": make_reference_image(root / "ref.png", 64, 64),
            "audio": make_speech_audio(root / "speech.wav", seconds=1.0)}


# --------------------------------------------------------------------------- names and dtypes
@pytest.mark.parametrize("prefix", ["", COMFY])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_single_file_reads_as_the_checkpoint_directory(tiny, tmp_path, prefix, dtype):
    """Bare or ComfyUI-prefixed names, stored in bf16 (the directory's dtype), fp32 or fp16: the
    file reads as the directory's DiT, under the same names. bf16 -> fp32 is exact, so the fp32
    file equals the directory to the bit; fp16 differs by its own rounding only."""
    tensors = dir_tensors(tiny["ckpt"])
    path = tmp_path / "wan2.2_s2v_14B.safetensors"
    save_file({prefix + k: v.to(dtype) for k, v in tensors.items()}, str(path))
    layout = inspect(path)
    assert layout.format is DitFileFormat.FULL and layout.prefix == prefix
    with ckpt_read.DitFileSource(path) as got, ckpt_read.SafetensorsFiles.in_dir(tiny["ckpt"]) as want:
        assert got.table().keys() == want.table().keys()
        a, b = read_all(got), read_all(want)
    for name in b:
        if dtype is torch.float16:
            assert torch.equal(a[name], b[name].half().float()), name
        else:
            assert torch.equal(a[name], b[name]), name


# --------------------------------------------------------------------------- fp8 forms
@pytest.mark.parametrize("form,per_row,fmt", [
    ("cast", False, DitFileFormat.FP8_CAST),
    ("scale_weight", False, DitFileFormat.SCALED_FP8),
    ("comfy_quant", False, DitFileFormat.COMFY_QUANT),
    ("comfy_quant", True, DitFileFormat.COMFY_QUANT),
    ("metadata", True, DitFileFormat.COMFY_QUANT),
])
def test_fp8_files_read_as_their_dequantized_values(tiny, tmp_path, form, per_row, fmt):
    """Each fp8 form reads as ``fp8.to(float32) * scale``, exactly, whole or in slices that
    start and end inside a row (as FSDP shards cut them); the scales, markers and records are
    not weights. The fp8 values are not the original weights (the quantization is real)."""
    tensors = dir_tensors(tiny["ckpt"])
    path = tmp_path / f"dit_{form}.safetensors"
    ref = fp8_file(tensors, path, form, per_row=per_row, prefix=COMFY)
    layout = inspect(path)
    assert layout.format is fmt and layout.prefix == COMFY
    assert set(layout.shapes) == set(tensors)
    with ckpt_read.DitFileSource(path) as src:
        got = read_all(src)
        name = "blocks.1.ffn.0.weight"  # [64, 32]: slices across rows
        for start, n in ((0, 2048), (5, 70), (31, 1), (33, 2000), (2047, 1)):
            part = torch.empty(n)
            src.read_flat(name, start, part)
            assert torch.equal(part, ref[name].reshape(-1)[start:start + n]), (start, n)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    moved = [k for k in ref if quantized(k, tensors[k]) and not torch.equal(ref[k], tensors[k].float())]
    assert len(moved) > 20


# --------------------------------------------------------------------------- refusals
def ctx(tiny, dit_file, **kw):
    vals = dict(ckpt_dir=tiny["ckpt"], image=tiny["image"], audio=tiny["audio"], prompt="a person talking",
                device="cpu", nproc=1, max_area=64 * 64, infer_frames=8, mode="ulysses",
                output=tiny["root"] / "out" / "x.mp4", dit_file=dit_file, **kw)
    return CheckContext.for_values(vals, probe_machine())


def dit_check(tiny, path):
    return find(run_checks(ctx(tiny, path), ["checkpoint"]), "ckpt.dit_file")


def test_a_good_file_passes_and_stands_in_for_the_directory(tiny, tmp_path):
    """With --dit-file, the directory needs no DiT weights, and the checks after read the file's
    table (config dims, sub-models)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny["ckpt"], ckpt)
    path = tmp_path / "s2v fp8 'scaled'.safetensors"
    fp8_file(dir_tensors(ckpt), path, "scale_weight", prefix=COMFY)
    (ckpt / DIT_WEIGHTS).unlink()
    results = run_checks(ctx({**tiny, "ckpt": ckpt}, path), ["checkpoint"])
    bad = [(r.id, r.finding) for r in results if r.status not in (Status.OK, Status.SKIP)]
    assert bad == []
    r = find(results, "ckpt.dit_file")
    assert r.status is Status.OK and "scaled fp8" in r.finding and "Wan S2V DiT: dim 32" in r.finding
    assert find(results, "ckpt.config").status is Status.OK
    assert find(results, "ckpt.submodels").status is Status.OK
    # the memory plan sizes the DiT from the file (the directory has none)
    from wan_s2v_runner.preflight.memory import model_sizes
    sizes = model_sizes(ctx({**tiny, "ckpt": ckpt}, path))
    assert sizes.source.startswith("checkpoint")
    assert sizes.dit_params == sum(v.numel() for v in dir_tensors(tiny["ckpt"]).values())
    assert sizes.dit_fp8_params > 0


def _without(tensors, *prefixes):
    return {k: v for k, v in tensors.items() if not k.startswith(prefixes)}


@pytest.mark.parametrize("case,needle", [
    ("t2v", "this is a Wan T2V DiT"),
    ("i2v", "this is a Wan I2V DiT"),
    ("layers", "num_layers 1, CKPT_DIR's config.json 2"),
    ("lora", "not a Wan DiT"),
    ("nvfp4", "quantized as 'nvfp4'; fp8 format not recognised"),
    ("int8", "stored as I8"),
    ("scale_without_fp8", "has a scale but is stored as BF16"),
    ("marker_only", "scaled_fp8 marker but no scale_weight"),
    ("truncated", "truncated"),
    ("gguf", "not a .safetensors file"),
    ("scale_per_column", "not one float per tensor or per output row"),
    ("full_checkpoint", "holds more than the DiT (first_stage_model, text_encoders"),
])
def test_preflight_refuses_a_file_it_cannot_use(tiny, tmp_path, case, needle):
    """Each refusal names the cause and a fix, before anything spawns."""
    t = dir_tensors(tiny["ckpt"])
    path = tmp_path / "dit.safetensors"
    audio = ("casual_audio_encoder.", "audio_injector.", "trainable_cond_mask", "frame_packer.", "cond_encoder.")
    if case == "t2v":
        save_file(_without(t, *audio), str(path))
    elif case == "i2v":
        save_file({**_without(t, *audio), "img_emb.proj.1.weight": torch.zeros(32, 32)}, str(path))
    elif case == "layers":
        save_file(_without(t, "blocks.1."), str(path))
    elif case == "lora":
        save_file({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(4, 32)}, str(path))
    elif case == "nvfp4":
        fp8_file(t, path, "comfy_quant", prefix=COMFY)
        raw = load_file(str(path))
        key = next(k for k in raw if k.endswith(".comfy_quant"))
        raw[key] = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
        save_file(raw, str(path))
    elif case == "int8":
        save_file({**t, "blocks.0.ffn.0.weight": torch.zeros(64, 32, dtype=torch.int8)}, str(path))
    elif case == "scale_without_fp8":
        save_file({**t, "blocks.0.ffn.0.scale_weight": torch.ones(1)}, str(path))
    elif case == "marker_only":
        save_file({**t, "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, str(path))
    elif case == "scale_per_column":  # [1, in] on a square weight: as many numbers as rows, not per row
        q = t["blocks.0.self_attn.q.weight"].float().to(torch.float8_e4m3fn)
        save_file({**t, "blocks.0.self_attn.q.weight": q, "blocks.0.self_attn.q.weight_scale": torch.ones(1, 32)},
                  str(path))
    elif case == "full_checkpoint":
        save_file({**{COMFY + k: v for k, v in t.items()}, "first_stage_model.decoder.conv_in.weight": torch.zeros(4),
                   "text_encoders.umt5xxl.shared.weight": torch.zeros(4)}, str(path))
    elif case == "truncated":
        save_file(t, str(path))
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path = tmp_path / "wan2.2_s2v_14B-Q8_0.gguf"
        path.write_bytes(b"GGUF" + bytes(100))
    r = dit_check(tiny, path)
    assert r.status is Status.FAIL, r.finding
    assert needle in r.finding, r.finding
    assert r.fix


def test_dit_file_needs_lean_loading():
    from pydantic import ValidationError

    from wan_s2v_runner.shared.spec import GroupSpec
    with pytest.raises(ValidationError, match="--dit-file is read by lean loading"):
        GroupSpec(ckpt_dir=Path("/x"), dit_file=Path("/x/dit.safetensors"), load="full")


def test_a_server_with_another_dit_file_is_another_identity(tiny, tmp_path):
    """The fleet's identity and the resume digest cover the DiT file: other weights there are
    other weights."""
    from wan_s2v_runner.serve.fleet import identity_of
    from wan_s2v_runner.shared.spec import GroupSpec
    t = dir_tensors(tiny["ckpt"])
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(t, str(a))
    save_file({**t, "head.head.bias": t["head.head.bias"] + 1}, str(b))
    ids = [identity_of(GroupSpec(ckpt_dir=tiny["ckpt"], device="cpu", dit_file=f)) for f in (None, a, b)]
    assert ids[0]["weights"]["dit"] == ids[1]["weights"]["dit"]  # the same tensors, named the same
    assert ids[1]["weights"]["dit"] != ids[2]["weights"]["dit"]
    assert ids[0]["checkpoint"] != ids[1]["checkpoint"]


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow(seconds=60)
def test_frames_from_an_fp8_file_equal_its_dequantized_weights(tiny_assets, tmp_path):
    """In this process (our loop, one rank): the demo checkpoint's DiT from a prefixed scaled-fp8
    file gives exactly the frames of a full-precision file of its dequantized values, and not
    the directory's frames (the fp8 weights are used)."""
    ref_file, fp8 = tmp_path / "dequantized.safetensors", tmp_path / "fp8.safetensors"
    ref = fp8_file(dir_tensors(tiny_assets.ckpt_dir), fp8, "comfy_quant", per_row=True, prefix=COMFY)
    save_file(ref, str(ref_file))
    with cpu_engine(tiny_assets) as engine:
        got = one_process_frames(engine, dit_file=fp8, num_clips=1)
        want = one_process_frames(engine, dit_file=ref_file, num_clips=1)
        directory = one_process_frames(engine, num_clips=1)
    assert torch.equal(got, want)
    assert not torch.equal(got, directory)


@pytest.mark.slow(seconds=150)
def test_fsdp_ranks_from_an_fp8_file_equal_one_process(tiny_assets, tmp_path):
    """Real ranks: a 2-rank ``fsdp-fixed`` run (``wan-s2v run --dit-file``, each rank filling its
    flat shards from slices of the per-row scaled fp8 file, in two waves) equals one process's frames from the
    dequantized full-precision file, exactly."""
    ref_file, fp8 = tmp_path / "dequantized.safetensors", tmp_path / "wan2.2 s2v fp8.safetensors"
    ref = fp8_file(dir_tensors(tiny_assets.ckpt_dir), fp8, "comfy_quant", per_row=True, prefix=COMFY)
    save_file(ref, str(ref_file))
    with cpu_engine(tiny_assets) as engine:
        want = one_process_frames(engine, dit_file=ref_file, num_clips=1)
    d = tmp_path / "run"
    d.mkdir()
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--num-clips", "1", "--nproc", "2",
                 "--mode", "fsdp-fixed", "--load-waves", "2", "--dit-file", str(fp8), "--output", str(d / "o.mp4"),
                 "--frames-out", str(d / "f.pt"), "--runs-root", str(d / "runs")], cwd=d)
    assert r.returncode == 0, r.output
    assert torch.equal(torch.load(d / "f.pt"), want)
    events = (next((d / "runs").glob("*")) / "events" / "rank1.jsonl").read_text()
    assert "ComfyUI quantized fp8 (weight_scale)" in events and "fsdp shards" in events
