"""Clip checkpoints and resume: a rank fails during clip 2 of 3; `wan-s2v resume` finishes the
run (on another layout) and the mp4 is byte-identical to an uninterrupted run's; a resume whose
inputs or frame settings differ is refused before anything is spawned."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import TINY_FLAGS, asset_flags, one_process_frames, run_cli
from fault_worker import fault_env

from wan_s2v_runner.shared import exit_codes, media
from wan_s2v_runner.shared.job_source import SPEC_KEY, JobSource, read_source

THREE_CLIPS = ["--infer-frames", "4", "--num-clips", "3"]


@pytest.mark.slow
def test_resume_after_a_failure_in_clip_2_gives_the_same_mp4(tiny_assets, engine_cpu, tmp_path):
    base = ["run", *TINY_FLAGS, *asset_flags(tiny_assets), *THREE_CLIPS]
    # the uninterrupted run's mp4: one process's frames (the loop a --nproc 1 worker runs, here in
    # this process) written the way rank 0 writes them
    whole = tmp_path / "whole.mp4"
    frames = one_process_frames(engine_cpu, infer_frames=4, num_clips=3)
    assert frames.shape[1] == 3 * 4 - 3  # three clips
    media.save_video_with_audio(frames, engine_cpu[1].sample_fps, tiny_assets.audio, whole, media.clip_lengths(9, 4))

    crash = tmp_path / "crash"
    crash.mkdir()
    out = crash / "o.mp4"
    r = run_cli([*base, "--nproc", "2", "--output", str(out), "--runs-root", str(crash / "runs")], cwd=crash,
                env=fault_env("1:denoise@2:raise"))
    assert r.returncode == exit_codes.RANK_FAILED, r.output
    assert not out.exists()
    run_dir = next((crash / "runs").iterdir())
    assert read_source(run_dir) is JobSource.RUN  # the run's own job, as its launcher recorded
    assert json.loads((run_dir / "spec.json").read_text())[SPEC_KEY] == "run"
    state = json.loads((run_dir / "clips" / "state.json").read_text())
    assert (state["next_clip"], state["num_clips"]) == (1, 3)  # clip 1 complete, clip 2 was lost

    # inputs that differ from the run that wrote the clips: refused, nothing spawned
    other_audio = tmp_path / "other.wav"
    shutil.copy(tiny_assets.audio, other_audio)
    with open(other_audio, "r+b") as f:
        f.seek(-2, 2)
        f.write(b"\x01\x02")
    r = run_cli(["resume", str(run_dir), "--audio", str(other_audio)], cwd=crash)
    assert r.returncode == exit_codes.USAGE and "inputs or frame settings" in r.stderr, r.output
    r = run_cli(["resume", str(run_dir), "--steps", "3"], cwd=crash)
    assert r.returncode == exit_codes.USAGE and "--steps cannot change" in r.stderr, r.output
    assert len(list((crash / "runs").iterdir())) == 1

    r = run_cli(["resume", str(run_dir), "--nproc", "1", "--json"], cwd=crash)  # another layout
    assert r.returncode == 0, r.output
    assert "resuming" in r.stderr and "at clip 2/3" in r.stderr
    manifest = json.loads(r.stdout)
    assert manifest["resume"] == {"from": str(run_dir), "at_clip": 2, "clips": 3}
    assert media.sha256_file(out) == media.sha256_file(whole)
    assert manifest["output"]["sha256"] == media.sha256_file(out)
