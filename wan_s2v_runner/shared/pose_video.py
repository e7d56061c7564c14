"""Reading a pose video (``--pose-video``), as upstream's ``WanS2V.load_pose_cond`` reads it.

Upstream (``read_last_n_frames(pose_video, infer_frames * num_repeat, target_fps=16,
reverse=True)`` with decord) takes every ``round(fps / 16)``-th frame of the video from its first
(at least every frame), as many as the clips need, and stops at the video's end; the clips past
it are padded with -1 frames. :func:`sampled_indices` is that rule; :class:`PoseFrames` reads
the frames each clip needs. The frames come from the ffmpeg binary imageio-ffmpeg ships (the
project's media tool; decoded RGB equal to decord's on H.264 yuv420p, tests/test_pose.py), read
as a stream that stops after the last frame needed: a clip's frames, never the whole video, are
in memory. No torch here: the launcher's preflight reads the video's facts with
:func:`video_facts`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

#: the engine's frame rate (``WanS2V.fps``); pose frames are sampled at it
ENGINE_FPS = 16


class PoseVideoError(RuntimeError):
    pass


@dataclass(frozen=True)
class VideoFacts:
    """What preflight and the run need to know of a video before reading its frames."""

    width: int
    height: int
    fps: float
    frames: int  # decodable frames (counted by decoding, not estimated from the duration)

    def interval(self, target_fps: int = ENGINE_FPS) -> int:
        return sample_interval(self.fps, target_fps)

    def sampled(self, wanted: int, target_fps: int = ENGINE_FPS) -> int:
        """How many of ``wanted`` sampled frames the video has (the rest are padding)."""
        return len(sampled_indices(self.frames, self.fps, wanted, target_fps))


def sample_interval(fps: float, target_fps: int = ENGINE_FPS) -> int:
    """Upstream's step between sampled frames: ``max(1, round(fps / target_fps))``."""
    return max(1, round(fps / target_fps))


def sampled_indices(total_frames: int, fps: float, n_frames: int, target_fps: int = ENGINE_FPS) -> list[int]:
    """Upstream's ``read_last_n_frames(..., reverse=True)`` indices: from frame 0, every
    :func:`sample_interval`-th frame, at most ``n_frames``, none past the end."""
    interval = sample_interval(fps, target_fps)
    return [i * interval for i in range(n_frames) if i * interval < total_frames]


def video_header(path: Path) -> tuple[int, int, float]:
    """(width, height, fps) from the video's header (ffmpeg starts, nothing is decoded).
    Raises :class:`PoseVideoError` with ffmpeg's reason when it does not open."""
    import imageio_ffmpeg

    try:
        gen = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
        meta = next(gen)
        gen.close()
    except (OSError, RuntimeError, StopIteration) as e:
        raise PoseVideoError(_reason(e)) from None
    fps = float(meta.get("fps") or 0.0)
    if fps <= 0:
        raise PoseVideoError("it states no frame rate")
    width, height = (int(x) for x in meta["size"])
    return width, height, fps


def video_facts(path: Path) -> VideoFacts:
    """Size, frame rate and decodable frame count of a video (decodes it once, no frames kept).
    Raises :class:`PoseVideoError` with ffmpeg's reason when it does not decode."""
    import imageio_ffmpeg

    width, height, fps = video_header(path)
    try:
        frames, _ = imageio_ffmpeg.count_frames_and_secs(str(path))
    except (OSError, RuntimeError) as e:
        raise PoseVideoError(_reason(e)) from None
    return VideoFacts(width=width, height=height, fps=fps, frames=int(frames))


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    tail = [line for line in text if line.strip()][-1:] or [type(e).__name__]
    return re.sub(r"\s+", " ", tail[0])[:200]


def iter_frames(path: Path, stop: Optional[int] = None) -> Iterator[np.ndarray]:
    """The video's frames in order, RGB uint8 ``(H, W, 3)``; with ``stop``, frames 0..stop-1 only
    (ffmpeg is told to stop there: nothing after it is decoded)."""
    import imageio_ffmpeg

    args = ["-frames:v", str(stop)] if stop is not None else []
    gen = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24", output_params=args)
    try:
        meta = next(gen)
        w, h = (int(x) for x in meta["size"])
        for raw in gen:
            yield np.frombuffer(raw, dtype=np.uint8).reshape(h, w, 3)
    finally:
        gen.close()


class PoseFrames:
    """The frames each clip takes from a pose video, read in one pass as the clips go (a clip's
    frames, never the whole video, are in memory; a later clip continues the same ffmpeg
    stream, an earlier one restarts it). Where the video ends, a clip gets fewer frames, or
    none: the caller pads, as upstream does."""

    def __init__(self, path: Path, infer_frames: int, num_clips: int, target_fps: int = ENGINE_FPS):
        self.path, self.infer_frames = Path(path), infer_frames
        self.width, self.height, fps = video_header(self.path)
        self.indices = sampled_indices(2**62, fps, infer_frames * num_clips, target_fps)  # the end cuts them
        self._frames: Optional[Iterator[np.ndarray]] = None
        self._next = 0  # index of the frame the stream gives next

    def clip(self, clip: int) -> np.ndarray:
        """Clip ``clip``'s (0-based) video frames, ``(n, H, W, 3)`` uint8, ``n`` <=
        ``infer_frames`` (fewer, or none, where the video ends)."""
        mine = self.indices[clip * self.infer_frames:(clip + 1) * self.infer_frames]
        if self._frames is None or mine[0] < self._next:
            self.close()
            self._frames, self._next = iter_frames(self.path, stop=self.indices[-1] + 1), 0
        wanted, out = set(mine), []
        for frame in self._frames:
            i, self._next = self._next, self._next + 1
            if i in wanted:
                out.append(frame.copy())
            if i >= mine[-1]:
                break
        if not out:
            return np.zeros((0, self.height, self.width, 3), dtype=np.uint8)
        return np.stack(out)

    def close(self) -> None:
        if self._frames is not None:
            self._frames.close()  # type: ignore[attr-defined]
            self._frames = None
