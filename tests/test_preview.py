"""``wan-s2v run --preview``: after each clip but the last, ``OUTPUT.partial.mp4`` is the video so
far. Real 2-rank runs on the tiny checkpoint, 2 clips (ulysses: the session's companion run of
conftest.hybrid_run) and 3 clips (CFG-parallel):

- every video so far rank 0 wrote (its ``preview`` events, each with the file's sha256) is byte
  for byte the final video's first clips encoded alone (the same writer run by the test on the
  first frames of the run's own final frames): it holds exactly the final video's first frames;
- the final frames equal one process's (the 2-clip run) and the final mp4 is the encode of
  them: the preview changes nothing in the video;
- the partial video goes once the final one is written; the first frame stays as the thumbnail.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_FLAGS, run_frames

from wan_s2v_runner.shared import media

FPS = 16


def _previews(run_dir) -> list[dict]:
    lines = (run_dir / "events" / "rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == "preview"]


def _encoded(frames: torch.Tensor, audio, dest) -> str:
    media.save_video_with_audio(frames, FPS, audio, dest)
    return media.sha256_file(dest)


def _check(frames, run_dir, out, clips, audio, tmp_path):
    previews = _previews(run_dir)
    assert [p["clips"] for p in previews] == list(range(1, clips)), previews  # every clip but the last
    for p in previews:
        n = p["frames"]
        assert p["of"] == clips and 0 < n < frames.shape[1]
        want = _encoded(frames[:, :n], audio, tmp_path / f"prefix{n}.mp4")
        assert p["sha256"] == want, f"the video so far after clip {p['clips']} is not the final's first {n} frames"
    assert media.sha256_file(out) == _encoded(frames, audio, tmp_path / "whole.mp4")
    assert not media.partial_path(out).exists()  # the final video holds it all
    thumb = media.thumbnail_path(out)
    from PIL import Image

    with Image.open(thumb) as im:
        assert im.format == "JPEG" and im.size == (frames.shape[3], frames.shape[2])


@pytest.mark.slow
def test_the_video_so_far_of_2_clips_in_ulysses(hybrid_run, tiny_assets, reference_frames, tmp_path):
    """The session's companion run (conftest.hybrid_run: the shared tiny spec, 2 ranks, ulysses,
    ``--preview``, 2 clips)."""
    assert hybrid_run.other_result.returncode == 0, hybrid_run.other_result.output
    d = hybrid_run.other_dir
    frames = torch.load(d / "f.pt")
    assert torch.equal(frames, reference_frames)  # the frames are one process's: nothing changed them
    _check(frames, next((d / "runs").glob("*")), d / "out" / "o.mp4", 2, tiny_assets.audio, tmp_path)


@pytest.mark.slow
def test_the_video_so_far_of_3_clips_with_cfg_parallel(tiny_assets, tmp_path):
    frames, run_dir = run_frames(tiny_assets, tmp_path / "run", TINY_FLAGS, "--nproc", "2", "--cfg-parallel",
                                 "--infer-frames", "4", "--num-clips", "3", "--preview")
    _check(frames, run_dir, tmp_path / "run" / "o.mp4", 3, tiny_assets.audio, tmp_path)
