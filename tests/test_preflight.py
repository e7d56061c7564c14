"""Preflight checks against real broken artifacts and recorded facts of real machines.

One tiny checkpoint is built per module (``tiny_checkpoint.build_tiny_checkpoint``) and copied
and broken per test. Hardware facts come from ``tests/data/machines/*.json`` (recorded) or the
live probe of this machine. Every test asserts the specific finding: check id + a substring.
"""
from __future__ import annotations

import copy
import json
import random
import shutil
import socket
import struct
import subprocess
import sys
import wave
from dataclasses import replace
from pathlib import Path

import pytest

from wan_s2v_runner.cli import main as cli
from wan_s2v_runner.demo.tiny_checkpoint import TINY_VAE_DIM
from wan_s2v_runner.preflight import CheckContext, MachineFacts, Status, gate, recommend_mode, run_checks
from wan_s2v_runner.preflight.core import find
from wan_s2v_runner.preflight.geometry import generation_size, token_counts
from wan_s2v_runner.preflight.memory import REFERENCE, model_sizes, plan_all
from wan_s2v_runner.preflight.probe import probe_machine
from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.ckpt_layout import DIT_WEIGHTS as DIT
from wan_s2v_runner.shared.spec import Layout, Mode

MACHINES = Path(__file__).parent / "data" / "machines"


# --------------------------------------------------------------------------- fixtures / helpers
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from wan_s2v_runner.demo.synthetic_inputs import make_reference_image, make_speech_audio
    from wan_s2v_runner.demo.tiny_checkpoint import build_tiny_checkpoint
    root = tmp_path_factory.mktemp("tiny")
    ckpt = build_tiny_checkpoint(root / "ckpt")
    image = make_reference_image(root / "ref.png", 64, 64)
    audio = make_speech_audio(root / "speech.wav", seconds=1.0)
    return {"ckpt": ckpt, "image": image, "audio": audio, "root": root}


@pytest.fixture
def ckpt_copy(tiny, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny["ckpt"], dst)
    return dst


def facts(name: str) -> MachineFacts:
    return MachineFacts.load(MACHINES / f"{name}.json")


def live() -> MachineFacts:
    return probe_machine()


def ctx_for(f: MachineFacts, **values) -> CheckContext:
    return CheckContext.for_values(values, f)


def result(ctx, group_or_groups, id):
    groups = [group_or_groups] if isinstance(group_or_groups, str) else group_or_groups
    r = find(run_checks(ctx, groups), id)
    assert r is not None, f"no result {id}"
    return r


def assert_finding(r, status: Status, *needles: str):
    text = f"{r.finding} || {r.fix}"
    assert r.status is status, f"{r.id}: expected {status.value}, got {r.status.value}: {text}"
    for n in needles:
        assert n in text, f"{r.id}: {n!r} not in {text!r}"


def tiny_ctx(tiny, ckpt=None, **kw):
    vals = dict(ckpt_dir=ckpt or tiny["ckpt"], image=tiny["image"], audio=tiny["audio"], prompt="a person talking",
                device="cpu", nproc=2, max_area=64 * 64, infer_frames=8, mode="ulysses",
                output=tiny["root"] / "out" / "x.mp4")
    vals.update(kw)
    return ctx_for(live(), **vals)


def split_into_shards(ckpt: Path) -> list[str]:
    """Rewrite the single-file DiT as 2 real shards + index (as diffusers save_pretrained does)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(ckpt / DIT))
    names = sorted(tensors)
    files = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    wm = {}
    for f, part in zip(files, halves):
        save_file({k: tensors[k] for k in part}, str(ckpt / f), metadata={"format": "pt"})
        wm.update(dict.fromkeys(part, f))
    (ckpt / f"{DIT}.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    (ckpt / DIT).unlink()
    return files


# --------------------------------------------------------------------------- checkpoint
def test_tiny_checkpoint_passes_every_checkpoint_check(tiny):
    results = run_checks(tiny_ctx(tiny), ["checkpoint"])
    assert [(r.id, r.status) for r in results if r.status is not Status.OK] == [("ckpt.dit_file", Status.SKIP),
                                                                               ("ckpt.t5_file", Status.SKIP)]
    assert_finding(find(results, "ckpt.config"), Status.OK, "dim 32, 4 heads, 2 layers")
    assert_finding(find(results, "ckpt.pth"), Status.OK, "T5 dim 4096", f"VAE width {TINY_VAE_DIM}")


def test_truncated_safetensors(tiny, ckpt_copy):
    p = ckpt_copy / DIT
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 1000)
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.safetensors")
    assert_finding(r, Status.FAIL, f"{DIT} is {size - 1000} bytes but its header describes {size}", "truncated")


def test_safetensors_header_length_beyond_file(tiny, ckpt_copy):
    p = ckpt_copy / DIT
    with open(p, "r+b") as f:
        f.write(struct.pack("<Q", 10**12))
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.safetensors")
    assert_finding(r, Status.FAIL, "header length field says 1000000000000 bytes")


def test_sharded_checkpoint_passes(tiny, ckpt_copy):
    split_into_shards(ckpt_copy)
    results = run_checks(tiny_ctx(tiny, ckpt_copy), ["checkpoint"])
    assert_finding(find(results, "ckpt.index"), Status.OK, "2 shards")
    assert_finding(find(results, "ckpt.safetensors"), Status.OK, "2 DiT file(s)")


def test_missing_shard(tiny, ckpt_copy):
    files = split_into_shards(ckpt_copy)
    (ckpt_copy / files[1]).unlink()
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.index")
    assert_finding(r, Status.FAIL, "names 2 shards; missing: diffusion_pytorch_model-00002-of-00002.safetensors")


def test_index_naming_an_absent_file(tiny, ckpt_copy):
    split_into_shards(ckpt_copy)
    idx = ckpt_copy / f"{DIT}.index.json"
    data = json.loads(idx.read_text())
    name = sorted(data["weight_map"])[0]
    data["weight_map"][name] = "diffusion_pytorch_model-00003-of-00003.safetensors"
    idx.write_text(json.dumps(data))
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.index")
    assert_finding(r, Status.FAIL, "missing: diffusion_pytorch_model-00003-of-00003.safetensors (1 tensors)")


def test_index_maps_tensor_to_wrong_shard(tiny, ckpt_copy):
    files = split_into_shards(ckpt_copy)
    idx = ckpt_copy / f"{DIT}.index.json"
    data = json.loads(idx.read_text())
    name = next(k for k, v in sorted(data["weight_map"].items()) if v == files[0])
    data["weight_map"][name] = files[1]
    idx.write_text(json.dumps(data))
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.safetensors")
    assert_finding(r, Status.FAIL, "1 tensors the index maps to a shard are not in it", name)


def test_corrupt_pth(tiny, ckpt_copy):
    vae = ckpt_copy / "Wan2.1_VAE.pth"
    data = vae.read_bytes()
    vae.write_bytes(data[: len(data) // 2])  # cut in the middle: the zip directory is gone
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.pth")
    assert_finding(r, Status.FAIL, "Wan2.1_VAE.pth does not load with torch.load(weights_only=True, mmap=True)")


def test_config_without_keys(tiny, ckpt_copy):
    cfg_p = ckpt_copy / "config.json"
    cfg = json.loads(cfg_p.read_text())
    del cfg["audio_dim"], cfg["enable_framepack"]
    cfg_p.write_text(json.dumps(cfg))
    ctx = tiny_ctx(tiny, ckpt_copy)
    r = result(ctx, ["engine", "checkpoint"], "ckpt.config")
    # the default is read from the engine's WanModel_S2V.__init__ (audio_dim=5120), real model has 1024
    assert_finding(r, Status.FAIL, "config.json lacks audio_dim, enable_framepack",
                   "WanModel_S2V would use its default 5120", "S2V-14B has 1024")


def test_config_disagrees_with_weights(tiny, ckpt_copy):
    cfg_p = ckpt_copy / "config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg["dim"], cfg["num_heads"] = 64, 4
    cfg_p.write_text(json.dumps(cfg))
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.config")
    assert_finding(r, Status.FAIL, "config.json says dim 64 x in_dim 16 but the weights' patch_embedding has 2048")


def test_missing_checkpoint_entry(tiny, ckpt_copy):
    (ckpt_copy / "wav2vec2-large-xlsr-53-english" / "vocab.json").unlink()
    r = result(tiny_ctx(tiny, ckpt_copy), "checkpoint", "ckpt.files")
    assert_finding(r, Status.FAIL, "1 expected entry missing: wav2vec2-large-xlsr-53-english/vocab.json")


def test_memory_plan_reads_param_counts_from_the_files(tiny):
    import math

    from safetensors import safe_open
    with safe_open(str(tiny["ckpt"] / DIT), framework="pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    ctx = tiny_ctx(tiny)
    sizes = model_sizes(ctx)
    assert sizes.source.startswith("checkpoint") and sizes.dit_params == n
    info = json.loads((tiny["ckpt"] / "tiny_checkpoint.json").read_text())
    assert (sizes.dim, sizes.num_heads, sizes.num_layers) == (info["dit"]["dim"], 4, 2)
    assert 0 < sizes.dit_root_params < sizes.dit_params and sizes.t5_params > 0 and sizes.vae_params > 0


# --------------------------------------------------------------------------- inputs / output
def test_mp3_that_is_really_a_png(tiny, tmp_path):
    fake = tmp_path / "speech.mp3"
    shutil.copy(tiny["image"], fake)
    r = result(tiny_ctx(tiny, audio=fake), "inputs", "inputs.audio")
    assert_finding(r, Status.FAIL, "speech.mp3 does not decode as audio: it is really a PNG image")


def test_zero_length_audio(tiny, tmp_path):
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    r = result(tiny_ctx(tiny, audio=empty), "inputs", "inputs.audio")
    assert_finding(r, Status.FAIL, "empty.wav is 0 bytes")


def test_wav_with_no_samples(tiny, tmp_path):
    p = tmp_path / "silent.wav"
    with wave.open(str(p), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"")
    r = result(tiny_ctx(tiny, audio=p), "inputs", "inputs.audio")
    assert_finding(r, Status.FAIL, "decodes to 0 samples")


def test_audio_clip_count(tiny):
    r = result(tiny_ctx(tiny, num_clips=5), "inputs", "inputs.audio")
    # 1.0 s * 16 / 8 + 1 = 3 clips; --num-clips 5 is capped by the engine
    assert_finding(r, Status.WARN, "1.00 s at 16000 Hz", "-> 3 clips of 8 frames = 21 frames",
                   "--num-clips 5 exceeds the 3")


def test_8x8_image_is_upscaled(tiny, tmp_path):
    """Measured: the engine does NOT fail on an 8x8 (or 1x1) image — get_size_less_than_area pads it
    to 64x64 and Resize upscales it. Preflight warns (a blurry face); it fails only on the real
    crash below (a 0-pixel side)."""
    from PIL import Image
    p = tmp_path / "tiny8.png"
    Image.new("RGB", (8, 8), (120, 100, 90)).save(p)
    results = run_checks(tiny_ctx(tiny, image=p), ["inputs"])
    assert_finding(find(results, "inputs.image"), Status.OK, "PNG 8x8 RGB")
    assert_finding(find(results, "inputs.size"), Status.WARN, "image 8x8 is upscaled 8.0x to the 64x64 frames")


def test_image_whose_size_fit_is_zero(tiny, tmp_path):
    from PIL import Image
    p = tmp_path / "sliver.png"
    Image.new("RGB", (3, 300), (120, 100, 90)).save(p)
    r = result(tiny_ctx(tiny, image=p), "inputs", "inputs.size")
    assert_finding(r, Status.FAIL, "image 3x300 at area 4096", "gives 0x128, which crashes in Resize")


def test_frames_wider_than_the_dits_rotary_table_are_refused(tiny, tmp_path):
    """A 30000x120 image at an area that keeps its size: over 20000 px a row, beyond the 1024 patches
    (16384 px) the DiT's rope_precompute can place (an IndexError in the ranks otherwise)."""
    from PIL import Image
    p = tmp_path / "banner.png"
    Image.new("RGB", (30000, 120), (120, 100, 90)).save(p)
    r = result(tiny_ctx(tiny, image=p, max_area=30000 * 120), "inputs", "inputs.size")
    assert_finding(r, Status.FAIL, "rotary position table holds 1024 patches (16384 px) a side",
                   "at most 16384 px a side")


def test_image_that_does_not_decode(tiny, tmp_path):
    p = tmp_path / "face.png"
    p.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 50)
    r = result(tiny_ctx(tiny, image=p), "inputs", "inputs.image")
    assert_finding(r, Status.FAIL, "face.png does not decode as an image")


def test_unwritable_output_dir(tiny, tmp_path):
    """Tests run as root, so chmod cannot make a directory unwritable. A parent that is a regular
    file cannot hold a directory for anyone (ENOTDIR), and /proc refuses new files even for root."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    r = result(tiny_ctx(tiny, output=blocker / "sub" / "out.mp4"), "output", "output.dir")
    assert_finding(r, Status.FAIL, "output directory not writable", f"{blocker} is a file")
    r = result(tiny_ctx(tiny, output=Path("/proc/wan-s2v-preflight-test/out.mp4")), "output", "output.dir")
    assert_finding(r, Status.FAIL, "cannot create files in /proc")
    assert not Path("/proc/wan-s2v-preflight-test").exists()


def test_writable_output_leaves_nothing_behind(tiny, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    r = result(tiny_ctx(tiny, output=out / "x.mp4"), "output", "output.dir")
    assert r.status is Status.OK and list(out.iterdir()) == []


# --------------------------------------------------------------------------- ulysses / comm
def test_ulysses_degree_above_the_tiny_heads_fails(tiny):
    r = result(tiny_ctx(tiny, nproc=3), ["checkpoint", "ulysses_degree"], "ulysses.heads")
    assert_finding(r, Status.OK, "4 heads over 3 ranks: 2/1/1", "(config.json)")
    r = result(tiny_ctx(tiny, nproc=5), ["checkpoint", "ulysses_degree"], "ulysses.heads")
    assert_finding(r, Status.FAIL, "Ulysses degree 5 exceeds the 4 attention heads (config.json)",
                   "use at most 4 ranks per CFG branch")
    # --cfg-parallel halves the degree: 6 ranks = CFG 2 x SP 3
    r = result(tiny_ctx(tiny, nproc=6, cfg_parallel=True), ["checkpoint", "ulysses_degree"], "ulysses.heads")
    assert_finding(r, Status.OK, "4 heads over 3 ranks: 2/1/1")


def test_ulysses_size_3_real_model_heads():
    ctx = ctx_for(facts("a100_8x_nvlink"), nproc=3, mode="ulysses")
    r = result(ctx, "ulysses_degree", "ulysses.heads")
    assert_finding(r, Status.OK, "40 heads over 3 ranks: 14/13/13", "1.05x the even share")
    assert r.data["head_split"] == [14, 13, 13]


def test_ulysses_degree_5_pads_the_tokens(tmp_path):
    from PIL import Image
    img = tmp_path / "landscape.png"
    Image.new("RGB", (1024, 704), (1, 2, 3)).save(img)
    ctx = ctx_for(facts("a100_8x_nvlink"), nproc=5, mode="ulysses", image=img)
    results = run_checks(ctx, ["inputs", "ulysses_degree"])
    assert_finding(find(results, "ulysses.heads"), Status.OK, "40 heads / 5 = 8 per rank")
    # clip 1: 20 latent frames x 44x64 + 44x64 ref = 59136 tokens (not a multiple of 5): 4 padding tokens
    r = find(results, "ulysses.tokens")
    assert_finding(r, Status.OK, "sequence 59136 and 63360 tokens", "padded by 4/0 token(s) to a multiple of 5")
    assert r.data["padding"] == [4, 0]


def test_token_counts_match_measured_engine_sequences():
    # measured by hooking WanModel_S2V.blocks[0] on the tiny checkpoint (128x128, 12 frames):
    # clip 1 (motion dropped) 256 tokens, clip 2 352 tokens; 64x64 / 8 frames: 48 and 72
    assert token_counts(128, 128, 12).lengths(2, False) == [256, 352]
    assert token_counts(64, 64, 8).lengths(2, False) == [48, 72]
    assert token_counts(704, 1024, 80).later_clips == 63360


def test_generation_size_equals_engine_function(tiny):
    from wan.speech2video import WanS2V  # already imported by the fixture's build
    rng = random.Random(1)
    cases = [(8, 8, 4096), (300, 3, 4096), (704, 1024, 1024 * 704), (1080, 1920, 832 * 480)]
    cases += [(rng.randint(1, 3000), rng.randint(1, 3000), rng.choice([4096, 832 * 480, 1024 * 704]))
              for _ in range(300)]
    for h, w, a in cases:
        assert generation_size(h, w, a) == tuple(WanS2V.get_size_less_than_area(None, h, w, target_area=a))


def test_master_port_in_use(tiny):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = result(tiny_ctx(tiny, master_port=port), "communication", "comm.master_port")
        assert_finding(r, Status.FAIL, f"--master-port {port} is already in use on this node")
    finally:
        s.close()
    r = result(tiny_ctx(tiny, master_port=port), "communication", "comm.master_port")
    assert_finding(r, Status.OK, f"port {port} is free")


def test_unresolvable_master_addr():
    ctx = ctx_for(facts("a100_8x_nvlink"), nnodes=2, node_rank=1, master_addr="node0.invalid")
    r = result(ctx, "communication", "comm.master_addr")
    assert_finding(r, Status.FAIL, "--master-addr 'node0.invalid' does not resolve")
    # loopback: right only when every node's launcher runs on this machine (a warning, not a stop)
    ctx = ctx_for(facts("a100_8x_nvlink"), nnodes=2, node_rank=1, master_addr="127.0.0.1")
    assert_finding(result(ctx, "communication", "comm.master_addr"), Status.WARN,
                   "is a loopback address (127.0.0.1) with 2 nodes")


# --------------------------------------------------------------------------- recorded machines
@pytest.mark.parametrize("machine, mode, needles", [
    ("h100_1x", Mode.ULYSSES, ["1 GPU", "H100", "holds the whole model"]),
    ("a100_8x_nvlink", Mode.ULYSSES, ["8 GPUs", "NVLink between all pairs", "fastest"]),
    ("v100s_2x_pcie", Mode.ULYSSES, ["31.7 GiB free", "hybrid needs est. 34.4 GiB/rank",
                                     "streamed from host memory it fits (--dit-offload blocks"]),
    ("rtx4090_4x_nop2p", Mode.HYBRID, ["does not fit per GPU", "23.5 GiB free", "without P2P"]),
    ("cpu_only", Mode.ULYSSES, ["no CUDA GPU visible", "demo"]),
])
def test_recommended_mode_per_machine(machine, mode, needles):
    rec = recommend_mode(ctx_for(facts(machine)))
    assert rec.mode is mode, rec.reason
    for n in needles:
        assert n in rec.reason, (n, rec.reason)


def test_recommendation_for_3_and_6_gpus_explains_the_plan():
    rec = recommend_mode(ctx_for(facts("a100_8x_nvlink"), nproc=3))
    assert rec.mode is Mode.ULYSSES and not rec.cfg_parallel
    assert "Plan: SP 3, heads 14/13/13 per rank" in rec.text and "CFG not split" in rec.text
    rec = recommend_mode(ctx_for(facts("a100_8x_nvlink"), nproc=6))
    assert rec.mode is Mode.ULYSSES and rec.cfg_parallel
    assert "Plan: CFG 2 x SP 3, heads 14/13/13 per rank" in rec.text and "CFG split (--cfg-parallel)" in rec.text
    assert rec.to_json()["plan"]["head_split"] == [14, 13, 13]
    # no unconditional pass to split off: guide scale 1
    assert not recommend_mode(ctx_for(facts("a100_8x_nvlink"), nproc=6, guide_scale=1.0)).cfg_parallel


def test_gpu_count_below_nproc_fails():
    r = result(ctx_for(facts("h100_1x"), nproc=2), "gpus", "gpus.count")
    assert_finding(r, Status.FAIL, "--nproc 2 ranks on this node but only 1 GPU visible")


def test_cc70_with_fa2_fails():
    r = result(ctx_for(facts("v100s_2x_pcie"), attention="fa2"), "attention", "attention.capability")
    assert_finding(r, Status.FAIL, "--attention fa2 needs compute capability >= 8.0; Tesla V100S-PCIE-32GB is 7.0",
                   "--attention sdpa")


def test_4090_without_p2p_ulysses_warns_about_pcie():
    r = result(ctx_for(facts("rtx4090_4x_nop2p"), mode="ulysses"), "communication", "comm.topology")
    assert_finding(r, Status.WARN, "no NVLink and no P2P between GPU 0 and 1", "Ulysses all-to-all",
                   "cross PCIe through host memory")


def test_a100_nvlink_topology_ok():
    r = result(ctx_for(facts("a100_8x_nvlink"), mode="ulysses"), "communication", "comm.topology")
    assert_finding(r, Status.OK, "NVLink between all 8 GPUs (NV12)")


def test_docker_default_shm_fails_multi_gpu():
    r = result(ctx_for(facts("rtx4090_4x_nop2p")), "communication", "comm.shm")
    assert_finding(r, Status.FAIL, "/dev/shm is 64 MiB (container)", "--shm-size=8g")


def test_deprecated_nccl_env():
    r = result(ctx_for(facts("a100_8x_nvlink")), "communication", "comm.env")
    assert_finding(r, Status.WARN, "NCCL_ASYNC_ERROR_HANDLING -> TORCH_NCCL_ASYNC_ERROR_HANDLING")


def test_flash_attn_abi_mismatch_names_the_symbol():
    raw = copy.deepcopy(facts("a100_8x_nvlink").raw)
    raw["attention"]["fa2"] = {
        "installed": "2.6.3", "usable": False,
        "import_error": "ImportError: /usr/local/lib/python3.10/dist-packages/flash_attn_2_cuda.cpython-310-"
                        "x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi",
        "reason": "flash-attn 2 (flash_attn) is not usable"}
    f = MachineFacts(raw)
    r = result(ctx_for(f), "attention", "attention.fa2")
    assert_finding(r, Status.WARN, "flash-attn 2.6.3 ABI mismatch", "undefined symbol _ZN3c104cuda9SetDeviceEi",
                   "rebuild flash-attn for torch 2.5.1+cu121", "--attention sdpa")
    r = result(ctx_for(f, attention="fa2"), "attention", "attention.fa2")
    assert r.status is Status.FAIL
    r = result(ctx_for(f), "attention", "attention.backend")
    assert_finding(r, Status.OK, "--attention auto -> sdpa")


def test_doctor_predicts_the_backend_the_run_picks_here():
    """The doctor (recorded availability + choose_backend) == the patch (live measurement) here."""
    from patches.attention import resolve_backend
    from wan_s2v_runner.preflight.checks_gpu import check_backend, predict_backend
    from wan_s2v_runner.shared.attention_backends import BackendUnavailable

    f = live()
    device = "cuda" if f.gpu_count else "cpu"
    for req in ("auto", "sdpa") + (("fa2", "fa3") if device == "cuda" else ()):
        predicted = predict_backend(ctx_for(f, device=device, attention=req))
        try:
            picked = resolve_backend(req, device)
        except BackendUnavailable as e:
            picked = ("", e.cause)
        assert predicted == picked, req
    backend, reason = resolve_backend("auto", device)
    r = check_backend(ctx_for(f, device=device))
    assert_finding(r, Status.OK, f"--attention auto -> {backend} ({reason})")


def test_dependency_pairing_diffusers_hub():
    raw = copy.deepcopy(facts("h100_1x").raw)
    raw["packages"]["diffusers"] = "0.42.1"  # with huggingface-hub 0.35.3 / transformers 4.56.2
    r = result(ctx_for(MachineFacts(raw)), "engine", "engine.deps")
    assert_finding(r, Status.FAIL, "diffusers 0.42.1 needs huggingface-hub >= 1.32, found 0.35.3", "transformers>=5")


def test_missing_decord_fails():
    raw = copy.deepcopy(facts("h100_1x").raw)
    raw["modules"]["decord"] = False
    r = result(ctx_for(MachineFacts(raw)), "engine", "engine.deps")
    assert_finding(r, Status.FAIL, "missing decord", "speech2video.py imports decord", "pip install decord")


def test_torchvision_mismatch():
    raw = copy.deepcopy(facts("rtx4090_4x_nop2p").raw)
    raw["packages"]["torchvision"] = "0.21.0+cu124"  # torch is 2.5.1
    r = result(ctx_for(MachineFacts(raw)), "python_torch", "torchvision.match")
    assert_finding(r, Status.FAIL, "torchvision 0.21.0+cu124 does not match torch 2.5.1+cu124", "0.20.x")


def test_driver_older_than_torch_cuda_major():
    raw = copy.deepcopy(facts("h100_1x").raw)
    raw["driver"] = {"nvml": True, "version": "470.256.02", "cuda": "11.4"}
    r = result(ctx_for(MachineFacts(raw)), "python_torch", "torch.cuda_driver")
    assert_finding(r, Status.FAIL, "driver 470.256.02 supports CUDA 11.4 but torch needs CUDA 12.8")


def test_torch_without_kernels_for_the_gpu():
    raw = copy.deepcopy(facts("v100s_2x_pcie").raw)
    raw["torch"]["arch_list"] = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # cu128 wheels
    raw["torch"]["version"] = "2.8.0+cu128"
    r = result(ctx_for(MachineFacts(raw)), "gpus", "gpus.arch")
    assert_finding(r, Status.FAIL, "has no kernels for Tesla V100S-PCIE-32GB (sm_70)")


def test_host_ram_eight_ranks_hybrid_real_sizes():
    raw = copy.deepcopy(facts("a100_8x_nvlink").raw)
    raw["host"]["mem_available_mib"] = 128 * 1024
    ctx = ctx_for(MachineFacts(raw), mode="hybrid", nproc=8, load="full")
    ctx.cache["sizes"] = replace(REFERENCE, source="checkpoint (test: Wan2.2-S2V-14B sizes)")
    r = result(ctx, "memory", "memory.host")
    # upstream's loading: every rank builds T5 (11.4 GB bf16) and the whole DiT (32.6 GB) on the
    # CPU before FSDP shards it
    assert_finding(r, Status.FAIL, "host RAM exhausted at load: 8 local ranks x 43.9 GiB (full loading)",
                   "128.0 GiB available", "drop --load full")
    ctx.cache["sizes"] = REFERENCE  # without a checkpoint the same finding only warns
    assert result(ctx, "memory", "memory.host").status is Status.WARN
    # lean loading (the default): the text rank (rank 7) holds T5 (it encodes on the CPU), rank 0
    # runs wav2vec2, then holds the video's frames (1.5 GiB at any length), and the others hold a
    # staging tensor
    lean = ctx_for(MachineFacts(raw), mode="hybrid", nproc=8)
    lean.cache["sizes"] = replace(REFERENCE, source="checkpoint (test: Wan2.2-S2V-14B sizes)")
    r = result(lean, "memory", "memory.host")
    assert_finding(r, Status.OK, "8 local ranks x 5.6 GiB (rank 0) / 13.7 GiB (rank 7: T5) / 3.1 GiB (lean loading)",
                   "= 38.1 GiB", "rank 0's video frames are 1.5 GiB of it at any clip count")
    assert r.data["need"] < 0.35 * 128 * 2**30


def test_host_ram_lean_loads_in_waves_only_when_it_must():
    raw = copy.deepcopy(facts("a100_8x_nvlink").raw)
    ctx = ctx_for(MachineFacts(raw), mode="fsdp-fixed", nproc=8)
    ctx.cache["sizes"] = replace(REFERENCE, source="checkpoint (test: Wan2.2-S2V-14B sizes)")
    p = plan_all(ctx)["fsdp-fixed"]
    assert p.host_load_transient > 0 and p.node_total(2) < p.node_total(1)
    raw["host"]["mem_available_mib"] = (p.node_total(1) - p.host_load_transient) / 2**20
    ctx2 = ctx_for(MachineFacts(raw), mode="fsdp-fixed", nproc=8)
    ctx2.cache["sizes"] = ctx.cache["sizes"]
    r = result(ctx2, "memory", "memory.host")
    assert_finding(r, Status.WARN, "cannot load all its ranks at once; loading in 2 waves")
    assert r.data["waves"] == 2
    raw["host"]["mem_available_mib"] = (p.node_total(8) - 1) / 2**20  # not even one rank at a time
    ctx3 = ctx_for(MachineFacts(raw), mode="fsdp-fixed", nproc=8)
    ctx3.cache["sizes"] = ctx.cache["sizes"]
    assert_finding(result(ctx3, "memory", "memory.host"), Status.FAIL, "host RAM exhausted at load", "8 waves")


def test_host_ram_and_gpus_of_replicas_count_every_group(tmp_path):
    """serve --replicas 4 on 8 GPUs: the four 2-rank groups load at once on one host, so each must
    fit its quarter of the RAM (in waves of its own when it must), and group 3 holds GPUs 6 and 7."""
    from wan_s2v_runner.preflight.doctor import group_context
    from wan_s2v_runner.shared.spec import GroupSpec
    raw = copy.deepcopy(facts("a100_8x_nvlink").raw)
    sizes = replace(REFERENCE, source="checkpoint (test: Wan2.2-S2V-14B sizes)")

    def host(groups: int, avail_bytes: float):
        raw["host"]["mem_available_mib"] = avail_bytes / 2**20
        ctx = ctx_for(MachineFacts(raw), mode="fsdp-fixed", nproc=2)
        ctx.node_groups, ctx.cache["sizes"] = groups, sizes
        return result(ctx, "memory", "memory.host")

    ctx = ctx_for(MachineFacts(raw), mode="fsdp-fixed", nproc=2)
    ctx.cache["sizes"] = sizes
    p = plan_all(ctx)["fsdp-fixed"]
    assert p.node_total(2) < p.node_total(1)
    room = 4 * p.node_total(1) - 1  # one group at once fits with room to spare; four at once do not
    assert host(1, room).status is Status.OK
    r = host(4, room)
    assert_finding(r, Status.WARN, "loading in 2 waves", "4 groups x (2 local ranks x")
    assert r.data["waves"] == 2 and r.data["need"] == 4 * p.node_total(2)
    r = host(4, 4 * p.node_total(2) - 1)  # not even one rank of each group at a time
    assert_finding(r, Status.FAIL, "host RAM exhausted at load", "fewer --replicas")
    # the GPUs: a busy GPU 7 is group 3's (the check reads every group's GPUs)
    raw["host"]["mem_available_mib"] = 1024 * 1024
    raw["gpus"][7]["free_mib"] = 1024
    group = GroupSpec(ckpt_dir=tmp_path, mode="fsdp-fixed", nproc=2, device="cuda")
    one = group_context(group, {}, facts=MachineFacts(raw))
    four = group_context(group, {}, facts=MachineFacts(raw), node_groups=4)
    for c in (one, four):
        c.cache["sizes"] = sizes
    assert result(one, "memory", "memory.gpu").status is Status.OK
    assert_finding(result(four, "memory", "memory.gpu"), Status.FAIL, "does not fit", "on GPU 7")


def test_lean_cpu_plan_counts_a_replicated_dit_once_per_node():
    from wan_s2v_runner.preflight.memory import plan_mode, workload
    from wan_s2v_runner.shared.layout import LoadStrategy, Mode
    ctx = ctx_for(facts("cpu_only"), device="cpu", nproc=2)
    sizes, wl = REFERENCE, workload(ctx)
    lean = plan_mode(ctx.layout_for(Mode.ULYSSES), sizes, wl, nproc=2, device="cpu", offload=False)
    full = plan_mode(ctx.layout_for(Mode.ULYSSES), sizes, wl, nproc=2, device="cpu", offload=False,
                     load=LoadStrategy.FULL)
    w_dit = sizes.dit_params * 4
    assert lean.host_shared == w_dit and full.host_shared == 0
    assert full.host_node_total - lean.host_node_total > 0.9 * w_dit  # one DiT copy fewer


def test_memory_plan_orders_modes_sensibly():
    ctx = ctx_for(facts("rtx4090_4x_nop2p"))
    plans = plan_all(ctx)
    assert plans["hybrid"].gpu_peak < plans["fsdp-fixed"].gpu_peak < plans["ulysses"].gpu_peak
    # lean loading: the DiT streams to the GPUs in every mode, so the host holds the same
    assert plans["ulysses"].host_peak == plans["hybrid"].host_peak
    full = plan_all(ctx_for(facts("rtx4090_4x_nop2p"), load="full"))  # hybrid: whole DiT on CPU per rank
    assert full["ulysses"].host_peak < full["hybrid"].host_peak
    h100 = plan_all(ctx_for(facts("h100_1x")))["ulysses"]
    assert 32.6e9 < h100.gpu_peak < 80e9


def test_t5_cpu_with_t5_fsdp_conflict(monkeypatch):
    ctx = ctx_for(facts("a100_8x_nvlink"), mode="hybrid")
    monkeypatch.setattr(CheckContext, "layout", property(
        lambda self: Layout(world_size=8, use_sp=True, dit_fsdp=True, t5_fsdp=True, t5_cpu=True)))
    r = result(ctx, "fsdp", "fsdp.t5")
    assert_finding(r, Status.FAIL, "T5 on CPU together with T5 FSDP")


# --------------------------------------------------------------------------- gate / cli / doctor
def test_gate_passes_a_good_tiny_run(tiny, capsys):
    from wan_s2v_runner.shared.spec import RunSpec
    spec = RunSpec(ckpt_dir=tiny["ckpt"], image=tiny["image"], audio=tiny["audio"], prompt="hi", device="cpu",
                   nproc=2, max_area=64 * 64, infer_frames=8, output=tiny["root"] / "out" / "a.mp4",
                   runs_root=tiny["root"] / "runs")
    assert gate(spec) is None
    err = capsys.readouterr().err
    assert err.startswith("preflight: ") and " ok, " in err and "fail" not in err


def test_cli_run_with_bad_audio_returns_3_and_spawns_nothing(tiny, tmp_path, capsys):
    fake = tmp_path / "speech.mp3"
    shutil.copy(tiny["image"], fake)
    runs = tmp_path / "runs"
    rc = cli.main(["run", "--ckpt-dir", str(tiny["ckpt"]), "--image", str(tiny["image"]), "--audio", str(fake),
                   "--prompt", "hello", "--device", "cpu", "--nproc", "2", "--size", "64*64",
                   "--infer-frames", "8", "--output", str(tmp_path / "out.mp4"), "--runs-root", str(runs)])
    assert rc == exit_codes.PREFLIGHT == 3
    err = capsys.readouterr().err
    assert "FAIL inputs.audio: speech.mp3 does not decode as audio: it is really a PNG image" in err
    assert "no rank was started" in err
    assert not runs.exists() or not any(runs.iterdir())  # no run directory = nothing launched
    assert not (tmp_path / "out.mp4").exists()


def test_doctor_json_environment_only(capsys):
    rc = cli.main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    fails = [r for r in report["results"] if r["status"] == "fail"]
    assert rc == (exit_codes.DOCTOR_FAILED if fails else exit_codes.OK) == report["exit_code"]
    ckpt = [r for r in report["results"] if r["group"] == "checkpoint"]
    assert ckpt and all(r["status"] == "skip" for r in ckpt)
    assert set(report["memory_plan"]["modes"]) == {"ulysses", "fsdp-fixed", "hybrid"}
    assert report["recommendation"]["mode"] in {"ulysses", "fsdp-fixed", "hybrid"}


def test_doctor_on_recorded_machine_with_tiny_checkpoint(tiny, monkeypatch, capsys):
    monkeypatch.setenv("WAN_S2V_FACTS", str(MACHINES / "rtx4090_4x_nop2p.json"))
    rc = cli.main(["doctor", "--ckpt-dir", str(tiny["ckpt"]), "--image", str(tiny["image"]),
                   "--audio", str(tiny["audio"]), "--prompt", "hi", "--size", "64*64", "--infer-frames", "8"])
    out = capsys.readouterr().out
    assert rc == exit_codes.DOCTOR_FAILED  # the 64 MiB /dev/shm of that container
    assert "comm.shm" in out and "memory plan per rank" in out and "recommended mode:" in out
    assert "fastest plan per GPU count (64x64, 48/72 tokens, 4 heads" in out
    assert "Ulysses degree 5 exceeds the 4 attention heads" in out  # 5 GPUs: no plan for 4 heads


def test_doctor_lists_plans_for_1_to_16_gpus(monkeypatch, capsys):
    """For a given size and model (the real 14B's 40 heads, a 1024x704 image): one plan per GPU
    count, each with its split (the tiny 4-head model's table is in the test above)."""
    monkeypatch.setenv("WAN_S2V_FACTS", str(MACHINES / "a100_8x_nvlink.json"))
    rc = cli.main(["doctor", "--json", "--nproc", "7"])
    plans = json.loads(capsys.readouterr().out)["parallel_plans"]
    assert rc in (exit_codes.OK, exit_codes.DOCTOR_FAILED)
    rows = plans["by_gpu_count"]
    assert [r["world_size"] for r in rows] == list(range(1, 17)) and all(r["valid"] for r in rows)
    assert plans["heads"] == 40 and plans["lengths"] == [59136, 63360]
    assert rows[6]["head_split"] == [6, 6, 6, 6, 6, 5, 5] and rows[6]["padding_tokens"] == [0, 4]
    assert rows[5]["cfg_parallel"] and rows[5]["sp_degree"] == 3
    rc = cli.main(["doctor", "--nproc", "7"])
    out = capsys.readouterr().out
    assert "fastest plan per GPU count (1024x704, 59136/63360 tokens, 40 heads" in out
    assert "CFG 2 x SP 3 (--cfg-parallel)" in out and "Plan: SP 7, heads 6/6/6/6/6/5/5 per rank" in out


def test_probe_reads_nvml_links_and_free_memory(monkeypatch):
    """The NVML path (no GPU here): a fake pynvml with 3 GPUs, NVLink between 0 and 1 only."""
    import types

    from wan_s2v_runner.preflight import probe

    fake = types.SimpleNamespace(
        NVML_P2P_CAPS_INDEX_NVLINK=2, NVML_NVLINK_MAX_LINKS=18,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "550.127.05", nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlDeviceGetHandleByUUID=lambda u: int(u[-1]),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(free=(20 + h) * 2**30, total=24 * 2**30),
        nvmlDeviceGetP2PStatus=lambda a, b, idx: 0 if {a, b} == {0, 1} else 4,
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 4 else 0,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 50 if 2 in (a, b) else 10)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    gpus = [{"index": i, "uuid": f"GPU-000{i}"} for i in range(3)]
    drv, links = probe._nvml(gpus)
    assert drv == {"nvml": True, "version": "550.127.05", "cuda": "12.4"}
    assert links == [["X", "NV4", "SYS"], ["NV4", "X", "SYS"], ["SYS", "SYS", "X"]]
    assert [g["free_mib"] for g in gpus] == [20480, 21504, 22528]
    f = MachineFacts({"gpus": gpus, "links": links, "p2p": [[True, True, False], [True, True, False],
                                                             [False, False, True]]})
    assert f.nvlink(0, 1) and not f.nvlink(0, 2) and f.p2p(2, 0) is False


def test_srun_with_one_task_per_gpu_is_refused():
    f = facts("a100_8x_nvlink")
    f.raw["env"] = {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[1-2]", "SLURMD_NODENAME": "gpu2",
                    "SLURM_STEP_NUM_TASKS": "16"}
    r = result(ctx_for(f, nproc=8), "communication", "comm.slurm")
    assert_finding(r, Status.FAIL, "srun started 16 tasks on 2 node(s)", "srun --ntasks-per-node=1")
    f.raw["env"]["SLURM_STEP_NUM_TASKS"] = "3"  # 2 launchers on one of the nodes
    assert result(ctx_for(f, nproc=8), "communication", "comm.slurm").status is Status.FAIL
    f.raw["env"]["SLURM_STEP_NUM_TASKS"] = "2"
    r = result(ctx_for(f, nproc=8), "communication", "comm.slurm")
    assert_finding(r, Status.OK, "2 node(s), this is node 1, rendezvous on gpu1")
    assert result(ctx_for(facts("a100_8x_nvlink"), nproc=8), "communication", "comm.slurm").status is Status.SKIP


def test_the_plan_fits_the_gpus_and_counts_past_the_heads_use_the_cfg_split():
    # 4 x 24 GB: hybrid; CFG 2 x SP 2 (est. 26 GiB/rank: a branch's tokens on 2 ranks) would not
    # fit, SP 4 (22 GiB) does, so the plan is SP 4 although both estimate 4x
    rec = recommend_mode(ctx_for(facts("rtx4090_4x_nop2p"), nproc=4))
    assert rec.mode is Mode.HYBRID and not rec.cfg_parallel and "Plan: SP 4" in rec.text
    # 6 nodes x 8 = 48 ranks: more than the 40 heads for one SP group, fine as CFG 2 x SP 24
    rec = recommend_mode(ctx_for(facts("a100_8x_nvlink"), nproc=8, nnodes=6, master_addr="10.0.0.1"))
    assert rec.mode is Mode.ULYSSES and rec.cfg_parallel and "CFG 2 x SP 24" in rec.text


# --------------------------------------------------------------------------- --compile
_TRITON_H200 = {"cxx_name": "g++", "cxx": "/usr/bin/g++", "triton": "3.6.0", "triton_required": "3.6.0"}  # 2026-11-26


def _compile_facts(name: str, **tools) -> MachineFacts:
    raw = copy.deepcopy(facts(name).raw)
    raw["compile"] = {**_TRITON_H200, **tools}
    return MachineFacts(raw)


def test_compile_not_asked_is_skipped():
    r = result(ctx_for(_compile_facts("h100_1x")), "engine", "engine.compile")
    assert_finding(r, Status.SKIP, "--compile not asked")


def test_compile_on_cpu_without_a_cpp_compiler_is_refused():
    r = result(ctx_for(_compile_facts("cpu_only", cxx=None), device="cpu", compile=True), "engine", "engine.compile")
    assert_finding(r, Status.FAIL, "needs a C++ compiler", "g++ not found", "apt-get install g++", "drop --compile")


def test_compile_on_cuda_needs_the_triton_torch_was_built_with():
    r = result(ctx_for(_compile_facts("h100_1x", triton="3.5.1"), compile=True), "engine", "engine.compile")
    assert_finding(r, Status.FAIL, "Triton 3.5.1 is installed, this torch was built with Triton 3.6.0",
                   "pip install triton==3.6.0")
    r = result(ctx_for(_compile_facts("h100_1x", triton=None), compile=True), "engine", "engine.compile")
    assert_finding(r, Status.FAIL, "needs Triton", "pip install triton==3.6.0")


def test_compile_cache_must_be_writable_and_free_of_spaces(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "my cache"))
    for machine, device in (("cpu_only", "cpu"), ("h100_1x", "cuda")):
        r = result(ctx_for(_compile_facts(machine), device=device, compile=True), "engine", "engine.compile")
        assert_finding(r, Status.FAIL, "cannot use a cache path with spaces", "TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    r = result(ctx_for(_compile_facts("h100_1x"), compile=True), "engine", "engine.compile")
    assert_finding(r, Status.OK, "Triton 3.6.0", str(tmp_path / "inductor"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "inductor"))
    r = result(ctx_for(_compile_facts("h100_1x"), compile=True), "engine", "engine.compile")
    assert_finding(r, Status.FAIL, "is not writable", "set TORCHINDUCTOR_CACHE_DIR to a writable directory")


def test_compile_on_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    r = result(ctx_for(live(), device="cpu", compile=True), "engine", "engine.compile")
    assert_finding(r, Status.OK, "C++ compiler", str(tmp_path / "inductor"))


def test_the_plan_puts_wav2vec2_on_the_gpu_where_memory_allows():
    """memory.gpu says where the encoding rank's wav2vec2 runs: on the GPU when what the plan
    leaves free at the encode (the GPU's free memory less the encode phase and the runtime) holds
    its weights and activations with the margin, else upstream's CPU; the rank applies the same
    rule (shared.encoder_placement) to its own free memory then."""
    from wan_s2v_runner.preflight.checks_memory import audio_encoder_plan
    from wan_s2v_runner.preflight.memory import GPU_RUNTIME, workload
    from wan_s2v_runner.shared import encoder_placement as ep

    ctx = ctx_for(facts("h100_1x"), dit_quant="fp8")
    r = result(ctx, "memory", "memory.gpu")
    assert r.status is Status.OK and r.data["audio_encoder"] == "cuda"
    assert "wav2vec2 on the GPU for the audio encode" in r.finding
    p = plan_all(ctx)["ulysses"]
    need = ep.encode_bytes(model_sizes(ctx).wav2vec_params, workload(ctx).audio_seconds)
    held = p.gpu_phases["encode"] + GPU_RUNTIME
    assert audio_encoder_plan(ctx, p, held + need + ep.MARGIN)[0] is ep.AudioEncoderDevice.GPU
    where, why = audio_encoder_plan(ctx, p, held + need + ep.MARGIN - 1)
    assert where is ep.AudioEncoderDevice.CPU and why.startswith("on the CPU, as upstream: its encode needs")
    assert ep.choose("cpu", 10**12, 1)[0] is ep.AudioEncoderDevice.CPU  # a CPU run: upstream's placement
    assert result(ctx_for(facts("cpu_only"), device="cpu"), "memory", "memory.gpu").status is Status.SKIP


def test_wav2vec2_encode_bytes():
    """The estimate grows with the speech: weights, 25 hidden states x3, one layer's scores."""
    from wan_s2v_runner.shared import encoder_placement as ep

    w = 317_000_000
    five, minute = ep.encode_bytes(w, 5.0), ep.encode_bytes(w, 60.0)
    assert w * 4 < five < w * 4 + 2**28 < minute
    frames = 60 * ep.FRAMES_PER_S + 1
    assert minute == w * 4 + 3 * 25 * frames * 1024 * 4 + 16 * frames * frames * 4
    # a ten-minute speech's scores in one pass alone pass 50 GiB: on a 48 GB card it would stay on
    # the CPU; encoded in windows (rank.long_audio) it needs one window's, and goes to the GPU
    assert ep.choose("cuda", 48 * 2**30, ep.encode_bytes(w, 600.0, windows=False))[0] is ep.AudioEncoderDevice.CPU
    assert ep.choose("cuda", 48 * 2**30, ep.encode_bytes(w, 600.0))[0] is ep.AudioEncoderDevice.GPU


def test_a_cpu_build_is_probed_from_its_files_as_importing_it_would():
    """probe.collect() in a fresh interpreter on this CPU-only build reads torch's build from its
    files without importing torch; its facts are those of the import path but for the two it
    cannot know (torch.distributed and gloo: None, which the checks take as not checked)."""
    from wan_s2v_runner.preflight import probe

    code = ("import json, sys\nfrom wan_s2v_runner.preflight import probe\n"
            "f = probe.collect()\nprint(json.dumps([f['torch'], 'torch' in sys.modules, f['gpus']]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    files, imported, gpus = json.loads(out.stdout)
    assert not imported and gpus == []
    assert files.pop("source") == "files"
    errors: list = []
    via_import = probe._torch_facts_imported({"probe_errors": errors})
    assert via_import.pop("source") == "import" and not errors
    assert via_import["distributed"] is True and via_import["gloo_available"] is True
    assert files == {**via_import, "distributed": None, "gloo_available": None}
    unknown = {**files, "distributed": None, "gloo_available": None}
    f = MachineFacts({**live().raw, "torch": unknown})
    assert_finding(result(ctx_for(f, device="cpu", nproc=2), "communication", "comm.backend"), Status.OK, "gloo")
    f = MachineFacts({**live().raw, "torch": {**unknown, "distributed": True, "gloo_available": False}})
    assert_finding(result(ctx_for(f, device="cpu", nproc=2), "communication", "comm.backend"), Status.FAIL, "gloo")


def test_pth_shapes_are_read_without_torch_as_torch_reads_them(tiny, tmp_path):
    """read_pth_shapes reads a state dict's record with its own narrow unpickler (no torch): the
    tiny T5 and VAE, and a file of every storage type a checkpoint holds, give what torch.load
    gives; what that unpickler does not know (torch's legacy format, a saved Parameter) is read
    by torch.load as before, with the same result or refusal."""
    import torch

    from wan_s2v_runner.loading import ckpt_tables

    def by_torch(p):
        sd = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}

    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64)
    mixed = tmp_path / "mixed.pth"
    torch.save({f"t{i}": torch.zeros(2, i + 1, 3, dtype=d) for i, d in enumerate(dtypes)} | {"view": torch.ones(6)[2:]},
               mixed)
    for p in (tiny["ckpt"] / "models_t5_umt5-xxl-enc-bf16.pth", tiny["ckpt"] / "Wan2.1_VAE.pth", mixed):
        fast = ckpt_tables._pth_record_shapes(str(p))
        assert fast is not None and fast == by_torch(p) == ckpt_tables.read_pth_shapes(p), p.name
    legacy, param = tmp_path / "legacy.pth", tmp_path / "param.pth"
    torch.save({"w": torch.zeros(3, 2)}, legacy, _use_new_zipfile_serialization=False)
    torch.save({"w": torch.nn.Parameter(torch.zeros(4, 5))}, param)
    assert ckpt_tables._pth_record_shapes(str(param)) is None  # torch reads it
    assert ckpt_tables.read_pth_shapes(param) == {"w": ((4, 5), "float32")}
    assert ckpt_tables._pth_record_shapes(str(legacy)) is None
    with pytest.raises(ckpt_tables.CheckpointFileError, match="mmap"):  # torch's finding, as before
        ckpt_tables.read_pth_shapes(legacy)
