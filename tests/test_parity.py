"""Parity is the contract: every parallel mode at 2 ranks gives the frames of one process.

Real ``torch.distributed.run`` over gloo, fp32 on CPU: equality is exact (max abs diff 0).
Also: FSDP without ``sync_module_states`` refuses ranks holding different weights (full loading:
weights perturbed in memory; lean loading: a rank given other checkpoint files), under lean
loading (the default) each FSDP rank reads only its slices of the files and the Ulysses ranks of
a node share one DiT, and the demo command writes an mp4 with H.264 video + AAC audio and the
expected frame count.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TINY_FLAGS, asset_flags, run_cli
from fault_worker import fault_env

from wan_s2v_runner.shared import exit_codes, media


def _run_mode(mode, tiny_assets, tmp_path, extra_env=None, name="out", extra=()):
    out = tmp_path / f"{name} with space's.mp4"
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", "--mode", mode,
                 "--output", str(out), "--frames-out", str(tmp_path / f"{name}.pt"),
                 "--runs-root", str(tmp_path / "runs"), *extra], cwd=tmp_path, env=extra_env)
    return r, out


def _loaded(runs_root) -> dict[int, dict]:
    """rank -> what its loading read, and how (run.json ``ranks.N.load``)."""
    manifest = json.loads(next(runs_root.glob("*/run.json")).read_text())
    return {int(r): info["load"] for r, info in manifest["ranks"].items()}


def assert_cpu_binding(manifest, pinned: bool) -> None:
    """run.json ``ranks.N.cpus``: with ``--pin-cpus``, each of the 2 one-thread ranks on its own
    allowed CPU when there are 2; else (the default, or one CPU) unbound."""
    cpus = {int(r): info["cpus"] for r, info in manifest["ranks"].items()}
    allowed = sorted(os.sched_getaffinity(0))
    if pinned and len(allowed) >= 2:
        assert cpus == {0: [allowed[0]], 1: [allowed[1]]}, cpus
    else:
        assert cpus == {0: None, 1: None}, cpus


def _tensor_bytes(ckpt) -> dict[str, int]:
    from wan_s2v_runner.loading.ckpt_read import PthFile, SafetensorsFiles
    with SafetensorsFiles.in_dir(ckpt) as dit, PthFile(ckpt / "models_t5_umt5-xxl-enc-bf16.pth") as t5:
        return {"dit": dit.tensor_bytes(), "t5": t5.tensor_bytes()}


def _assert_fsdp_mode_equals_one_process(mode, extra, r, out, frames_pt, runs, tiny_assets, reference_frames):
    assert r.returncode == 0, r.output
    assert out.is_file()
    frames = torch.load(frames_pt)
    assert frames.shape == reference_frames.shape
    assert torch.equal(frames, reference_frames), f"max abs diff {(frames - reference_frames).abs().max()}"
    manifest = json.loads(next(runs.glob("*/run.json")).read_text())
    assert manifest["layout"]["world_size"] == 2 and manifest["layout"]["dit_fsdp"] is True
    assert manifest["layout"]["t5_cpu"] is (mode == "hybrid")
    assert manifest["layout"]["use_sp"] is (mode == "hybrid")
    # lean loading: every byte of the sharded files read exactly once over the ranks, half each
    loaded, size = _loaded(runs), _tensor_bytes(tiny_assets.ckpt_dir)
    read = {rank: e["bytes_read"]["weights"] for rank, e in loaded.items()}
    assert loaded[1]["strategy"]["dit"] == "fsdp shards"
    assert "dit_load" not in loaded[1]["strategy"]  # an FSDP-sharded DiT loads before the encoders
    assert loaded[1]["waves"] == (2 if "--load-waves" in extra else 1)
    assert_cpu_binding(manifest, pinned="--pin-cpus" in extra)
    if mode == "fsdp-fixed":  # DiT and T5 sharded
        assert read[0] + read[1] == size["dit"] + size["t5"]
        assert max(read.values()) <= 0.51 * (size["dit"] + size["t5"])
    else:  # DiT sharded; T5 read whole by rank 1 alone (the text rank: it encodes the prompts on the CPU)
        assert read[0] + read[1] == size["dit"] + size["t5"]
        assert read[0] <= 0.51 * size["dit"] and read[1] >= size["t5"]


@pytest.mark.slow
def test_fsdp_fixed_equals_one_process(tiny_assets, pose_reference_frames, tmp_path):
    """With the demo's pose video (the split VAE encodes each clip's pose condition)."""
    extra = ("--pin-cpus", "--pose-video", str(tiny_assets.pose_video))
    r, out = _run_mode("fsdp-fixed", tiny_assets, tmp_path, extra=extra)
    _assert_fsdp_mode_equals_one_process("fsdp-fixed", extra, r, out, tmp_path / "out.pt",
                                         tmp_path / "runs", tiny_assets, pose_reference_frames)


@pytest.mark.slow
def test_hybrid_equals_one_process(tiny_assets, pose_reference_frames, hybrid_run):
    """The session's shared hybrid run (conftest.hybrid_run: ``--load-waves 2``, a pose video)."""
    _assert_fsdp_mode_equals_one_process("hybrid", ("--load-waves", "2"), hybrid_run.result, hybrid_run.output,
                                         hybrid_run.frames, hybrid_run.dir / "runs", tiny_assets, pose_reference_frames)
    manifest = json.loads(next((hybrid_run.dir / "runs").glob("*/run.json")).read_text())
    assert manifest["stage_seconds"].get("pose_encode", 0) > 0, manifest["stage_seconds"]


@pytest.mark.slow
def test_demo_writes_mp4_with_audio_and_equals_one_process(tiny_assets, pose_reference_frames, tmp_path):
    """`wan-s2v demo --pose` = ulysses at 2 CPU ranks on the tiny checkpoint, the body driven by the
    demo's pose video (same spec as the reference)."""
    cache = tmp_path / "cache"
    # reuse the session's assets as the demo cache (ensure_demo_assets validates, doesn't rebuild)
    (cache).mkdir()
    (cache / "demo").symlink_to(tiny_assets.ckpt_dir.parent, target_is_directory=True)
    out = tmp_path / "demo out.mp4"
    r = run_cli(["demo", "--pose", "--cache-dir", str(cache), "--output", str(out),
                 "--frames-out", str(tmp_path / "demo.pt"), "--runs-root", str(tmp_path / "runs"),
                 "--prompt", "a person talking"], cwd=tmp_path)
    assert r.returncode == 0, r.output
    frames = torch.load(tmp_path / "demo.pt")
    assert torch.equal(frames, pose_reference_frames), f"max abs diff {(frames - pose_reference_frames).abs().max()}"
    info = media.probe(out)
    assert info.video_codec == "h264" and info.audio_codec == "aac", info
    assert info.n_frames == frames.shape[1] == 13  # clip 1: 8 - 3 dropped motion frames, clip 2: 8
    assert (info.width, info.height) == (frames.shape[3], frames.shape[2])
    manifest = json.loads(next((tmp_path / "runs").glob("*/run.json")).read_text())
    assert manifest["mode"] == "ulysses" and manifest["layout"]["use_sp"] is True
    loaded = _loaded(tmp_path / "runs")  # one DiT per node: rank 0 reads it, rank 1 maps rank 0's copy
    assert loaded[0]["strategy"]["dit"] == loaded[1]["strategy"]["dit"] == "node-shared"
    # ...read while the encoders ran (its thread's collectives on a process group of its own)
    assert all(e["strategy"]["dit_load"].startswith("while the encoders ran") for e in loaded.values()), loaded
    # the encoders on both ranks at once: rank 1 (the text rank) loads T5 and encodes the prompts
    # while rank 0 encodes the speech; the frames above equal one process's all the same
    stages = {int(r): info["stage_seconds"] for r, info in manifest["ranks"].items()}
    assert "t5" in loaded[1]["strategy"] and "t5" not in loaded[0]["strategy"], loaded
    assert "text_encode" in stages[1] and "text_encode" not in stages[0] and "audio_encode" in stages[0], stages
    assert manifest["output"]["sha256"] == media.sha256_file(out)
    assert_cpu_binding(manifest, pinned=False)  # off by default
    # each forked rank started once both were forked (rank/fork_gate.py: its hello says for how many)
    hellos = [next(e for e in map(json.loads, f.read_text().splitlines()) if e["kind"] == "hello")
              for f in sorted(next((tmp_path / "runs").glob("*")).glob("events/rank*.jsonl"))]
    assert [h["fork_gate"] for h in hellos] == [2, 2], hellos


@pytest.mark.slow
def test_fsdp_refuses_ranks_with_different_weights(tiny_assets, tmp_path):
    r, out = _run_mode("fsdp-fixed", tiny_assets, tmp_path, extra=("--load", "full"),
                       extra_env=fault_env(WAN_S2V_TEST_PERTURB_WEIGHTS_RANK="1"))
    assert r.returncode == exit_codes.RANK_FAILED, r.output
    assert "WeightMismatch" in r.output and "rank(s) [1] do not match rank 0" in r.output
    assert "fingerprint" in r.output  # the stage it failed in
    assert not out.exists()
    assert not list(tmp_path.glob(".*.mp4")), "a temporary file was left behind"


@pytest.mark.slow
def test_lean_fsdp_refuses_a_rank_whose_checkpoint_differs(tiny_assets, tmp_path):
    """Lean loading fingerprints the files (each rank holds only shards): rank 1's node has a
    checkpoint where one DiT tensor differs; the run stops before generating and names rank 1."""
    from safetensors.torch import load_file, save_file
    other = tmp_path / "other ckpt"
    other.mkdir()
    for f in tiny_assets.ckpt_dir.iterdir():
        if f.name != "diffusion_pytorch_model.safetensors":
            (other / f.name).symlink_to(f, target_is_directory=f.is_dir())
    tensors = load_file(str(tiny_assets.ckpt_dir / "diffusion_pytorch_model.safetensors"))
    key = "blocks.0.self_attn.q.weight"
    tensors[key] = tensors[key] * 1.01
    save_file(tensors, str(other / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    r, out = _run_mode("fsdp-fixed", tiny_assets, tmp_path,
                       extra_env=fault_env(WAN_S2V_TEST_CKPT_FOR_RANK=f"1:{other}"))
    assert r.returncode == exit_codes.RANK_FAILED, r.output
    assert "WeightMismatch" in r.output and "DiT checkpoint differs between ranks: rank(s) [1]" in r.output
    assert "fingerprint" in r.output
    assert not out.exists()
