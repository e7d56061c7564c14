"""Parity is the contract: every parallel mode at 2 ranks gives the frames of one process.

Real ``torch.distributed.run`` over gloo, fp32 on CPU: equality is exact (max abs diff 0).
Also: FSDP without ``sync_module_states`` refuses ranks holding different weights, and the demo
command writes an mp4 with H.264 video + AAC audio and the expected frame count.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_FLAGS, asset_flags, run_cli
from wan_s2v_runner import exit_codes, media


def _run_mode(mode, tiny_assets, tmp_path, extra_env=None, name="out"):
    out = tmp_path / f"{name} with space's.mp4"
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", "--mode", mode,
                 "--output", str(out), "--frames-out", str(tmp_path / f"{name}.pt"),
                 "--runs-root", str(tmp_path / "runs")], cwd=tmp_path, env=extra_env)
    return r, out


@pytest.mark.parametrize("mode", ["fsdp-fixed", "hybrid"])
def test_mode_equals_one_process(mode, tiny_assets, reference_frames, tmp_path):
    r, out = _run_mode(mode, tiny_assets, tmp_path)
    assert r.returncode == 0, r.output
    frames = torch.load(tmp_path / "out.pt")
    assert frames.shape == reference_frames.shape
    assert torch.equal(frames, reference_frames), f"max abs diff {(frames - reference_frames).abs().max()}"
    manifest = json.loads(next((tmp_path / "runs").glob("*/run.json")).read_text())
    assert manifest["layout"]["world_size"] == 2 and manifest["layout"]["dit_fsdp"] is True
    assert manifest["layout"]["t5_cpu"] is (mode == "hybrid")
    assert manifest["layout"]["use_sp"] is (mode == "hybrid")


def test_demo_writes_mp4_with_audio_and_equals_one_process(tiny_assets, reference_frames, tmp_path):
    """`wan-s2v demo` = ulysses at 2 CPU ranks on the tiny checkpoint (same spec as the reference)."""
    cache = tmp_path / "cache"
    # reuse the session's assets as the demo cache (ensure_demo_assets validates, doesn't rebuild)
    (cache).mkdir()
    (cache / "demo").symlink_to(tiny_assets.ckpt_dir.parent, target_is_directory=True)
    out = tmp_path / "demo out.mp4"
    r = run_cli(["demo", "--cache-dir", str(cache), "--output", str(out),
                 "--frames-out", str(tmp_path / "demo.pt"), "--runs-root", str(tmp_path / "runs"),
                 "--prompt", "a person talking"], cwd=tmp_path)
    assert r.returncode == 0, r.output
    frames = torch.load(tmp_path / "demo.pt")
    assert torch.equal(frames, reference_frames), f"max abs diff {(frames - reference_frames).abs().max()}"
    info = media.probe(out)
    assert info.video_codec == "h264" and info.audio_codec == "aac", info
    assert info.n_frames == frames.shape[1] == 13  # clip 1: 8 - 3 dropped motion frames, clip 2: 8
    assert (info.width, info.height) == (frames.shape[3], frames.shape[2])
    manifest = json.loads(next((tmp_path / "runs").glob("*/run.json")).read_text())
    assert manifest["mode"] == "ulysses" and manifest["layout"]["use_sp"] is True
    assert manifest["output"]["sha256"] == media.sha256_file(out)


def test_fsdp_refuses_ranks_with_different_weights(tiny_assets, tmp_path):
    r, out = _run_mode("fsdp-fixed", tiny_assets, tmp_path,
                       extra_env={"WAN_S2V_TEST_PERTURB_WEIGHTS_RANK": "1"})
    assert r.returncode == exit_codes.RANK_FAILED, r.output
    assert "WeightMismatch" in r.output and "rank(s) [1] do not match rank 0" in r.output
    assert "fingerprint" in r.output  # the stage it failed in
    assert not out.exists()
    assert not list(tmp_path.glob(".*.mp4")), "a temporary file was left behind"
