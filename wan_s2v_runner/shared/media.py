"""Writing the result: frames -> H.264 mp4 -> AAC audio muxed in, atomically.

Uses the ffmpeg binary that imageio-ffmpeg ships (no system ffmpeg needed), always with argument
lists. Every step writes to a temporary name in the output directory and the final file appears
only by ``os.replace``: the output path holds a complete mp4 with audio, or nothing. Unlike
upstream (``save_video`` swallows errors, ``merge_video_audio`` logs and exits 0 with a silent
video), any failure raises :class:`MediaError`.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from wan_s2v_runner.shared import atomic
from wan_s2v_runner.shared.atomic import temp_name
from wan_s2v_runner.shared.stages import Stage


class MediaError(RuntimeError):
    pass


#: the engine's frame rate (its config's ``sample_fps``), and how many frames a video has fewer
#: than its clips (the first clip's motion frames): N clips of F frames make N * F - 3 frames
FPS = 16
FIRST_CLIP_DROPS = 3


def clips_for_seconds(seconds: float, infer_frames: int) -> int:
    """The fewest clips of ``infer_frames`` frames that make a video of at least ``seconds``."""
    return max(1, -(-(round(seconds * FPS) + FIRST_CLIP_DROPS) // infer_frames))


def ffmpeg_exe() -> str:
    try:
        import imageio_ffmpeg
        return imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as e:  # pragma: no cover - depends on install
        raise MediaError(f"no ffmpeg binary: {e}. Fix: pip install imageio-ffmpeg==0.8.1") from e


def frames_to_uint8(frames) -> np.ndarray:
    """(C, N, H, W) float in [-1, 1] (torch or numpy) -> (N, H, W, C) uint8."""
    arr = frames.detach().float().cpu().numpy() if hasattr(frames, "detach") else np.asarray(frames, dtype=np.float32)
    if arr.ndim != 4 or arr.shape[0] != 3:
        raise MediaError(f"expected frames shaped (3, N, H, W), got {tuple(arr.shape)}")
    arr = np.clip((arr + 1.0) * 127.5, 0, 255).round().astype(np.uint8)
    return np.ascontiguousarray(arr.transpose(1, 2, 3, 0))


#: x264's threads, fixed: its bitstream depends on its thread count, which by default follows the
#: CPUs the process may use, so the same frames made different mp4 bytes on machines (or rank
#: groups: ``serve --replicas`` gives each its own cores) with other core counts
X264_THREADS = 4


def write_h264(frames_u8: np.ndarray, fps: int, path: Path) -> None:
    import imageio_ffmpeg

    n, h, w, _ = frames_u8.shape
    if n == 0:
        raise MediaError("no frames to write")
    try:
        gen = imageio_ffmpeg.write_frames(
            str(path), (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv420p",
            macro_block_size=1, quality=8, ffmpeg_log_level="error",
            output_params=["-threads", str(X264_THREADS)])
        gen.send(None)
        for fr in frames_u8:
            gen.send(np.ascontiguousarray(fr))
        gen.close()
    except Exception as e:
        raise MediaError(f"writing H.264 video to {path.name} failed: {e}") from e


def mux_audio(video: Path, audio: Path, out: Path, duration_s: float) -> None:
    """Copy the video stream, encode the audio as AAC, cut both at the video's duration."""
    cmd = [ffmpeg_exe(), "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
           "-i", str(video), "-i", str(audio),
           "-map", "0:v:0", "-map", "1:a:0", "-c:v", "copy", "-c:a", "aac", "-b:a", "128k",
           "-t", f"{duration_s:.6f}", "-movflags", "+faststart", "-f", "mp4", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file() or out.stat().st_size == 0:
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        raise MediaError(f"muxing audio {audio.name!r} failed (ffmpeg exit {proc.returncode}): "
                         f"{' | '.join(tail) or 'no output'}")


def partial_path(output: Path) -> Path:
    """Where ``--preview`` keeps the video so far of ``output`` (``NAME.partial.mp4``)."""
    output = Path(output)
    return output.with_name(f"{output.stem}.partial.mp4")


def thumbnail_path(output: Path) -> Path:
    """Where a video's first frame goes (``NAME.thumbnail.jpg``)."""
    output = Path(output)
    return output.with_name(f"{output.stem}.thumbnail.jpg")


def first_frame_jpeg(video: Path, out: Path) -> Path:
    """``video``'s first frame as a JPEG at ``out`` (a thumbnail; temp name, then rename)."""
    def write(tmp: Path) -> None:
        cmd = [ffmpeg_exe(), "-nostdin", "-hide_banner", "-loglevel", "error", "-y", "-i", str(video),
               "-frames:v", "1", "-q:v", "3", "-f", "image2", "-c:v", "mjpeg", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise MediaError(f"a thumbnail of {video.name!r} failed (ffmpeg exit {proc.returncode}): "
                             f"{' | '.join(tail) or 'no output'}")

    return atomic.atomic_write(out, write)


def save_video_with_audio(frames, fps: int, audio: Path, output: Path, on_stage=None,
                          commit_if: atomic.CommitIf = None) -> Path:
    """frames (3, N, H, W) in [-1, 1] -> ``output`` (mp4: H.264 + AAC), all or nothing.
    ``on_stage`` (optional) is called with :attr:`Stage.SAVE`, then :attr:`Stage.MUX`;
    ``commit_if`` before the rename (:class:`~.atomic.NotCommitted`: ``output`` untouched)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    u8 = frames_to_uint8(frames)
    video_tmp, final_tmp = temp_name(output, "video"), temp_name(output, "mux")
    try:
        if on_stage:
            on_stage(Stage.SAVE)
        write_h264(u8, fps, video_tmp)
        if on_stage:
            on_stage(Stage.MUX)
        mux_audio(video_tmp, Path(audio), final_tmp, duration_s=u8.shape[0] / fps)
        atomic.replace(final_tmp, output, durable=True, commit_if=commit_if)  # on disk before anyone is told
    finally:
        for p in (video_tmp, final_tmp):
            p.unlink(missing_ok=True)
    return output


@dataclass(frozen=True)
class StreamInfo:
    video_codec: Optional[str]
    audio_codec: Optional[str]
    width: Optional[int]
    height: Optional[int]
    n_frames: int
    duration_s: float


def probe(path: Path) -> StreamInfo:
    """Codecs and frame count of a media file, via the bundled ffmpeg."""
    import imageio_ffmpeg

    proc = subprocess.run([ffmpeg_exe(), "-nostdin", "-hide_banner", "-i", str(path)],
                          capture_output=True, text=True)
    text = proc.stderr
    v = re.search(r"Stream #\S+.*?: Video: (\w+).*?, (\d+)x(\d+)", text)
    a = re.search(r"Stream #\S+.*?: Audio: (\w+)", text)
    try:
        n, secs = imageio_ffmpeg.count_frames_and_secs(str(path)) if v else (0, 0.0)
    except Exception:
        n, secs = 0, 0.0
    return StreamInfo(v.group(1) if v else None, a.group(1) if a else None,
                      int(v.group(2)) if v else None, int(v.group(3)) if v else None, n, secs)


def header_seconds(path: Path) -> Optional[float]:
    """A media file's duration as its header says it, without decoding it (None: unknown):
    libsndfile's header read (wav, flac, ogg), else ffmpeg's ``Duration:`` line."""
    try:
        import soundfile

        return float(soundfile.info(str(path)).duration)
    except Exception:  # not a format libsndfile reads: ask ffmpeg (it reads headers only here)
        pass
    proc = subprocess.run([ffmpeg_exe(), "-nostdin", "-hide_banner", "-i", str(path)], capture_output=True, text=True)
    m = re.search(r"Duration: (\d+):(\d+):(\d+(?:\.\d+)?)", proc.stderr)
    return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3)) if m else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
