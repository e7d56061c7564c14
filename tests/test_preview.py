"""``wan-s2v run --preview``: the video grows clip by clip in ``OUTPUT.partial.mp4``, which becomes
the output when finished. Real 2-rank runs on the tiny checkpoint, 2 clips (ulysses: the session's
companion run of conftest.hybrid_run) and 3 clips (CFG-parallel):

- after each clip but the last rank 0 says how far the file is (its ``preview`` events: clips,
  frames, bytes); the final file cut at that length is what a player had then: it decodes to
  exactly those frames, with the speech;
- the final frames equal one process's (the 2-clip run) and the final mp4 is byte for byte the
  writer's encode of them (:func:`media.save_video_with_audio`, clip by clip): streaming changes
  nothing in the video;
- the partial name is gone once the final video is in place; the first frame is the thumbnail.
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


def _encoded(frames: torch.Tensor, audio, dest, infer_frames: int) -> str:
    media.save_video_with_audio(frames, FPS, audio, dest, media.clip_lengths(frames.shape[1], infer_frames))
    return media.sha256_file(dest)


def _check(frames, run_dir, out, clips, audio, tmp_path, infer_frames):
    previews = _previews(run_dir)
    assert [p["clips"] for p in previews] == list(range(1, clips)), previews  # every clip but the last
    lengths = media.clip_lengths(frames.shape[1], infer_frames)
    data = out.read_bytes()
    for p in previews:
        n = p["frames"]
        assert p["of"] == clips and n == sum(lengths[:p["clips"]]) and 0 < p["bytes"] < len(data)
        cut = tmp_path / f"so_far_{n}.mp4"  # the file as it was then (its fragments; the init segment's
        cut.write_bytes(data[:p["bytes"]])  # durations are written in at the end)
        info = media.probe(cut)
        assert (info.video_codec, info.audio_codec, info.n_frames) == ("h264", "aac", n), info
    assert media.sha256_file(out) == _encoded(frames, audio, tmp_path / "whole.mp4", infer_frames)
    assert not media.partial_path(out).exists()  # the final video is that file, finished
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
    _check(frames, next((d / "runs").glob("*")), d / "out" / "o.mp4", 2, tiny_assets.audio, tmp_path,
           8)  # conftest.TINY_FLAGS: --infer-frames 8


@pytest.mark.slow
def test_the_video_so_far_of_3_clips_with_cfg_parallel(tiny_assets, tmp_path):
    frames, run_dir = run_frames(tiny_assets, tmp_path / "run", TINY_FLAGS, "--nproc", "2", "--cfg-parallel",
                                 "--infer-frames", "4", "--num-clips", "3", "--preview")
    _check(frames, run_dir, tmp_path / "run" / "o.mp4", 3, tiny_assets.audio, tmp_path, 4)
