"""The streaming video writer (rank/video_writer.py) without ranks: clips in, a growing fragmented
MP4 out. What a player sees after each clip (ffmpeg decodes exactly the frames so far, with the
speech), what the API may serve of a file a clip is being appended to (only complete fragments),
that the finished file is the writer's encode of the whole video (``media.save_video_with_audio``),
and that a writer continued from a clip checkpoint, after a crash left half a fragment behind,
finishes byte for byte the file an uninterrupted writer makes."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from wan_s2v_runner.rank.clip_steps import ClipState
from wan_s2v_runner.rank.video_writer import VideoWriter
from wan_s2v_runner.shared import fmp4, media, resume

FPS = 16
H, W = 48, 64
CLIPS = [5, 8, 8, 8]  # --infer-frames 8: the first clip drops 3 motion frames


class Events:
    def __init__(self):
        self.seen: list[tuple[str, dict]] = []

    def emit(self, kind: str, **data) -> None:
        self.seen.append((kind, data))


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    t = np.arange(int(16000 * 2.2)) / 16000  # longer than the video (29 frames: 1.8 s): cut at its end
    sf.write(path, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000)
    return path


def _clips(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(1, 3, n, H, W, generator=g) * 2 - 1 for n in CLIPS]


def _writer(tmp_path, speech, events, continued=None, run="run") -> VideoWriter:
    return VideoWriter(tmp_path / "out" / "o.mp4", speech, FPS, tmp_path / run, {"spec": "x"}, events,
                       thumbnail=True, continued=continued)


def _state(clip: int) -> ClipState:
    return ClipState(clip, torch.full((1, 16, 2, 2, 2), float(clip)), None)


def test_the_growing_file_plays_after_every_clip_and_finishes_as_the_whole_encode(tmp_path, speech):
    events, clips = Events(), _clips()
    w = _writer(tmp_path, speech, events)
    done = 0
    for r, frames in enumerate(clips):
        w.frames(r, frames, len(clips))
        w.clip_done(_state(r + 1), len(clips))
        done += frames.shape[2]
        snap = tmp_path / f"after_{r}.mp4"
        snap.write_bytes(w.path.read_bytes())
        info = media.probe(snap)
        assert (info.video_codec, info.audio_codec, info.n_frames, info.width, info.height) == \
            ("h264", "aac", done, W, H), info
        assert fmp4.playable_length(w.path) == w.path.stat().st_size  # every fragment complete
    previews = [d for k, d in events.seen if k == "preview"]
    assert [p["clips"] for p in previews] == [1, 2, 3]  # every clip but the last
    assert [p["frames"] for p in previews] == [5, 13, 21]
    out = w.finish()
    assert not w.path.exists() and out == tmp_path / "out" / "o.mp4"  # the same file, renamed
    whole = torch.cat(clips, dim=2)[0]
    media.save_video_with_audio(whole, FPS, speech, tmp_path / "whole.mp4", media.clip_lengths(29, 8))
    assert out.read_bytes() == (tmp_path / "whole.mp4").read_bytes()
    info = media.probe(out)
    assert info.n_frames == 29 and abs(info.duration_s - 29 / FPS) < 0.1, info
    assert media.thumbnail_path(out).is_file()


def test_only_complete_fragments_are_playable_while_one_is_appended(tmp_path, speech):
    clips = _clips(1)
    w = _writer(tmp_path, speech, Events())
    for r in range(2):
        w.frames(r, clips[r], len(clips))
        w.clip_done(_state(r + 1), len(clips))
    complete = w.path.stat().st_size
    data, _ = fmp4.fragment(fmp4.Fragment(media.encode_h264(media.frames_to_uint8(clips[2][0]), FPS)[1], []),
                            w.growing.at)
    with open(w.path, "ab") as f:  # half of the next fragment, as a reader may find it mid-append
        f.write(data[: len(data) // 2])
    assert fmp4.playable_length(w.path) == complete
    w.abandon()


def test_a_continued_writer_finishes_the_uninterrupted_file_byte_for_byte(tmp_path, speech):
    clips = _clips(2)
    first = _writer(tmp_path, speech, Events())
    for r in range(2):  # clips 0 and 1 committed; clip 2's fragment half-written when the run dies
        first.frames(r, clips[r], len(clips))
        first.clip_done(_state(r + 1), len(clips))
    first.frames(2, clips[2], len(clips))
    first._wait_idle()
    with open(first.path, "r+b") as f:  # the crash: clip 2's fragment cut in the middle
        f.truncate(first.path.stat().st_size - 100)
    first.abandon()

    progress = resume.read_progress(tmp_path / "run")
    assert progress.next_clip == 2 and progress.ends == (5, 13)
    assert torch.equal(resume.load(tmp_path / "run", progress)["motion_latents"], _state(2).motion_latents)
    w = _writer(tmp_path, speech, Events(), continued=resume.continued(progress), run="run2")
    for r in range(2, len(clips)):
        w.frames(r, clips[r], len(clips))
        w.clip_done(_state(r + 1), len(clips))
    out = w.finish()
    media.save_video_with_audio(torch.cat(clips, dim=2)[0], FPS, speech, tmp_path / "whole.mp4",
                                media.clip_lengths(29, 8))
    assert out.read_bytes() == (tmp_path / "whole.mp4").read_bytes()
    assert sorted(p.name for p in (tmp_path / "run2" / "clips").iterdir()) == ["state.json", "state_0004.pt"]


def test_a_resume_without_its_video_says_so(tmp_path, speech):
    w = _writer(tmp_path, speech, Events())
    clips = _clips(3)
    w.frames(0, clips[0], len(clips))
    w.clip_done(_state(1), len(clips))
    w.abandon()
    w.path.unlink()
    with pytest.raises(resume.ResumeError, match="is missing"):
        _writer(tmp_path, speech, Events(), continued=resume.continued(resume.read_progress(tmp_path / "run")))


def test_speech_shorter_than_the_video_ends_early_and_the_video_still_finishes(tmp_path):
    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(16000 // 2, dtype=np.float32), 16000)  # 0.5 s for a 1.8 s video
    clips = _clips(4)
    w = _writer(tmp_path, short, Events())
    for r, frames in enumerate(clips):
        w.frames(r, frames, len(clips))
        w.clip_done(_state(r + 1), len(clips))
    info = media.probe(w.finish())
    assert (info.n_frames, info.audio_codec) == (29, "aac"), info


def test_a_run_stopped_while_finishing_resumes_to_the_same_file(tmp_path, speech):
    """Every clip committed, the finishing never happened (a full disk at the end, a kill): the
    resume has nothing to generate and only finishes the file."""
    clips = _clips(5)
    w = _writer(tmp_path, speech, Events())
    for r, frames in enumerate(clips):
        w.frames(r, frames, len(clips))
        w.clip_done(_state(r + 1), len(clips))
    w.abandon()
    progress = resume.read_progress(tmp_path / "run")
    assert (progress.next_clip, progress.num_clips) == (4, 4)
    out = _writer(tmp_path, speech, Events(), continued=resume.continued(progress), run="run2").finish()
    media.save_video_with_audio(torch.cat(clips, dim=2)[0], FPS, speech, tmp_path / "whole.mp4",
                                media.clip_lengths(29, 8))
    assert out.read_bytes() == (tmp_path / "whole.mp4").read_bytes()


def test_a_run_stopped_after_finishing_but_before_its_record_resumes_to_the_same_file(tmp_path, speech):
    """Every clip committed and the file finished (renamed to the output), the run stopped before
    its record (a server stopped between the two; its job is taken again): the resume finds the
    finished file in the partial's place and finishes it to the same bytes, in another attempt's
    folder; without it, the resume says the video is missing."""
    clips = _clips(6)
    w = _writer(tmp_path, speech, Events())
    for r, frames in enumerate(clips):
        w.frames(r, frames, len(clips))
        w.clip_done(_state(r + 1), len(clips))
    first = w.finish()
    want = first.read_bytes()
    progress = resume.read_progress(tmp_path / "run")
    assert not media.partial_path(first).exists() and progress.next_clip == progress.num_clips == 4
    again = VideoWriter(tmp_path / "attempt-2" / "o.mp4", speech, FPS, tmp_path / "run2", {"spec": "x"}, Events(),
                        continued=resume.continued(progress)).finish()
    assert again.read_bytes() == want and first.read_bytes() == want
    first.unlink()
    with pytest.raises(resume.ResumeError, match="is missing"):
        _writer(tmp_path, speech, Events(), continued=resume.continued(progress), run="run3")


def test_frames_out_is_the_whole_tensor_written_as_it_came(tmp_path, speech):
    clips = _clips(6)
    w = VideoWriter(tmp_path / "o.mp4", speech, FPS, tmp_path / "run", {"spec": "x"}, Events(),
                    frames_out=tmp_path / "f.pt")
    for r, frames in enumerate(clips):
        w.frames(r, frames, len(clips))
        w.clip_done(_state(r + 1), len(clips))
    w.finish()
    assert torch.equal(torch.load(tmp_path / "f.pt"), torch.cat(clips, dim=2)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pt", "o.mp4", "run"]  # no raw file left
