"""Media: the encoders a video is written with, the growing file, and reading media files.

* :func:`encode_h264`: a clip's frames -> H.264 samples (PyAV's libx264, a fresh encoder per clip,
  fixed threads and settings: the same frames give the same bytes on every machine and layout);
* :class:`SpeechEncoder`: the speech -> AAC, advanced clip by clip (one encoder for the video);
* :class:`GrowingMp4`: the fragmented MP4 (:mod:`~wan_s2v_runner.shared.fmp4`) they go into,
  durable fragment by fragment, renamed to the output when finished, all or nothing;
* :func:`save_video_with_audio`: whole frames -> the same bytes the streaming writer makes of them;
* probes (:func:`probe`, :func:`header_seconds`) through the ffmpeg binary imageio-ffmpeg ships.

Unlike upstream (``save_video`` swallows errors, ``merge_video_audio`` logs and exits 0 with a
silent video), any failure raises :class:`MediaError`.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from wan_s2v_runner.shared import atomic, encoder_placement
from wan_s2v_runner.shared.atomic import temp_name


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
#: x264's constant rate factor (what ``imageio-ffmpeg``'s quality 8 gave before the streaming writer)
X264_CRF = 10
#: the speech's AAC bit rate (the encoder lowers it where the sample rate allows less)
AUDIO_BIT_RATE = 128_000


def _av():
    try:
        import av
        return av
    except Exception as e:  # pragma: no cover - depends on install
        raise MediaError(f"PyAV does not load ({type(e).__name__}: {e}). Fix: make install "
                         "(requirements.lock: av)") from e


def encode_h264(frames_u8: np.ndarray, fps: int) -> tuple[bytes, list[tuple[bytes, bool]]]:
    """One clip's frames (N, H, W, 3) uint8 -> (the encoder's ``avcC``, each frame as an MP4
    sample: length-prefixed NAL units and whether it is a sync frame). A fresh encoder per clip,
    so a clip's bytes depend on its frames alone (a resumed run's clips equal an uninterrupted
    run's); its first frame is an IDR frame; no B-frames (decode order is presentation order:
    the file needs no composition offsets or video edit list)."""
    from fractions import Fraction

    from wan_s2v_runner.shared import fmp4

    av = _av()
    n, h, w, _ = frames_u8.shape
    if n == 0:
        raise MediaError("no frames to write")
    try:
        ctx = av.CodecContext.create("libx264", "w")
        ctx.width, ctx.height, ctx.pix_fmt = w, h, "yuv420p"
        ctx.time_base, ctx.framerate = Fraction(1, fps), Fraction(fps, 1)
        ctx.thread_count = X264_THREADS
        ctx.options = {"crf": str(X264_CRF), "bf": "0"}
        ctx.flags |= int(av.codec.context.Flags.global_header)  # SPS/PPS once, for the avcC
        ctx.open()
        packets = []
        for i, fr in enumerate(frames_u8):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(fr), format="rgb24")
            frame.pts = i
            packets += ctx.encode(frame)
        packets += ctx.encode(None)
        avcc = fmp4.avc_config(bytes(ctx.extradata))
    except Exception as e:
        raise MediaError(f"H.264 encoding failed: {type(e).__name__}: {e}") from e
    if len(packets) != n:
        raise MediaError(f"the H.264 encoder gave {len(packets)} frames for {n}")
    return avcc, [(fmp4.length_prefixed(bytes(p)), bool(p.is_keyframe)) for p in packets]


class SpeechEncoder:
    """The speech as AAC, encoded as the video grows: :meth:`until` feeds the encoder the samples
    up to a video frame and returns the AAC frames it has made (it holds back up to two of them);
    :meth:`end` feeds the rest up to the video's end (the speech is cut there, or ends sooner)
    and flushes. One encoder for the whole video, so its priming comes once (the file's edit
    list drops it) and clip boundaries make no gap. Everything is a function of the speech and the
    frame counts asked for: a resumed run replays it up to its first new clip."""

    def __init__(self, speech: Path, fps: int):
        from fractions import Fraction

        av = _av()
        self.fps, self.fed, self.made = fps, 0, 0
        try:
            self.container = av.open(str(speech))
            stream = self.container.streams.audio[0]
        except Exception as e:
            raise MediaError(f"the speech {Path(speech).name!r} does not open as audio: {type(e).__name__}: {e}") from e
        self.rate = stream.codec_context.sample_rate or stream.rate
        layout = "mono" if stream.codec_context.channels == 1 else "stereo"
        self.channels = 1 if layout == "mono" else 2
        self.frames = self.container.decode(stream)
        self.resampler = av.AudioResampler(format="fltp", layout=layout, rate=self.rate)
        self.fifo = av.AudioFifo()
        self.exhausted = False
        self.ctx = av.CodecContext.create("aac", "w")
        self.ctx.sample_rate, self.ctx.layout, self.ctx.format = self.rate, layout, "fltp"
        self.ctx.bit_rate, self.ctx.time_base = AUDIO_BIT_RATE, Fraction(1, self.rate)
        self.ctx.flags |= int(av.codec.context.Flags.global_header)
        self.ctx.open()
        self.priming: Optional[int] = None

    def format(self):
        from wan_s2v_runner.shared import fmp4
        return fmp4.AudioFormat(self.rate, self.channels, bytes(self.ctx.extradata), self.priming or 0,
                                int(self.ctx.bit_rate))

    def _samples_at(self, frames: int) -> int:
        return frames * self.rate // self.fps

    def _fill(self, need: int) -> None:
        while not self.exhausted and self.fifo.samples < need:
            try:
                frame = next(self.frames)
            except StopIteration:
                self.exhausted = True
                for out in self.resampler.resample(None):  # what it still holds
                    self.fifo.write(out)
                break
            except Exception as e:
                raise MediaError(f"decoding the speech failed: {type(e).__name__}: {e}") from e
            frame.pts = None
            for out in self.resampler.resample(frame):
                self.fifo.write(out)

    def _encode(self, frame) -> list[bytes]:
        out = []
        for p in self.ctx.encode(frame):
            if self.priming is None:
                self.priming = max(0, -int(p.pts or 0))
            out.append(bytes(p))
        self.made += len(out)
        return out

    def _feed(self, until: int, last: bool) -> list[bytes]:
        """Encoder frames of the speech's samples up to ``until``: whole ones only, and with
        ``last`` the shorter one that ends it."""
        from wan_s2v_runner.shared import fmp4

        out = []
        while self.fed < until:
            want = min(fmp4.AAC_FRAME, until - self.fed)
            if want < fmp4.AAC_FRAME and not last:
                break
            self._fill(want)
            n = min(want, self.fifo.samples)
            if n == 0 or (n < fmp4.AAC_FRAME and not last):
                break  # the speech ended before the video: its rest comes at the end
            frame = self.fifo.read(n)
            frame.pts = self.fed
            self.fed += n
            out += self._encode(frame)
            if n < fmp4.AAC_FRAME:
                break
        return out

    def until(self, frames: int) -> list[bytes]:
        """The AAC frames made once the speech up to video frame ``frames`` is fed (whole encoder frames only)."""
        return self._feed(self._samples_at(frames), last=False)

    def end(self, frames: int) -> list[bytes]:
        """The rest: the speech up to video frame ``frames`` (the video's end) and the encoder's flush."""
        out = self._feed(self._samples_at(frames), last=True)
        return out + self._encode(None)

    def close(self) -> None:
        try:
            self.container.close()
        except Exception:
            pass


class PushedSpeech(SpeechEncoder):
    """A :class:`SpeechEncoder` whose speech is handed to it as it is made (a live session's, block by
    block: mono float32 samples at ``rate``) instead of read from a file."""

    def __init__(self, fps: int, rate: int = encoder_placement.RATE):
        from fractions import Fraction

        av = _av()
        self.fps, self.fed, self.made = fps, 0, 0
        self.rate, self.channels = rate, 1
        self.container = None
        self.fifo = av.AudioFifo()
        self.exhausted = True  # nothing to read: what is pushed is all there is
        self.ctx = av.CodecContext.create("aac", "w")
        self.ctx.sample_rate, self.ctx.layout, self.ctx.format = rate, "mono", "fltp"
        self.ctx.bit_rate, self.ctx.time_base = AUDIO_BIT_RATE, Fraction(1, rate)
        self.ctx.flags |= int(av.codec.context.Flags.global_header)
        self.ctx.open()
        self.priming: Optional[int] = None

    def push(self, samples: np.ndarray) -> None:
        """The next samples of the speech (mono float32 at :attr:`rate`)."""
        av = _av()
        samples = np.ascontiguousarray(np.asarray(samples, dtype=np.float32).reshape(1, -1))
        if samples.shape[1] == 0:
            return
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = None
        self.fifo.write(frame)

    def _fill(self, need: int) -> None:
        pass

    def close(self) -> None:
        pass


class GrowingMp4:
    """A fragmented MP4 being written (:mod:`~wan_s2v_runner.shared.fmp4`): the init segment, then
    one fragment per :meth:`append`, each made durable (fsync) before it counts; :meth:`finish`
    writes the durations into the init segment and renames the file to its final name. Reopened
    at a :class:`~wan_s2v_runner.shared.fmp4.Position` (a resume), it is cut back to that length:
    whatever a crash left after the last counted fragment goes."""

    def __init__(self, path: Path, init: Optional[bytes] = None, at=None):
        from wan_s2v_runner.shared import fmp4

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if at is None:  # a new file: its init segment now
            with open(self.path, "wb") as f:
                f.write(init)
                f.flush()
                os.fsync(f.fileno())
            at = fmp4.Position(size=len(init))
        else:
            with open(self.path, "r+b") as f:
                f.truncate(at.size)
        self.at = at

    def append(self, frag) -> None:
        from wan_s2v_runner.shared import fmp4

        data, after = fmp4.fragment(frag, self.at)
        with open(self.path, "r+b") as f:
            f.seek(self.at.size)
            f.write(data)
            f.truncate(after.size)
            f.flush()
            os.fsync(f.fileno())
        self.at = after

    def init_segment(self) -> bytes:
        from wan_s2v_runner.shared import fmp4

        with open(self.path, "rb") as f:
            head = f.read(1 << 16)
        moov = fmp4._find(head, [b"moov"])
        if not moov:
            raise MediaError(f"{self.path.name} has no init segment")
        return head[:moov[0] + int.from_bytes(head[moov[0]:moov[0] + 4], "big")]

    def finish(self, output: Path, fps: int, audio_rate: Optional[int], commit_if: atomic.CommitIf = None) -> Path:
        """The durations written in, then the file becomes ``output`` (one rename, durable)."""
        from wan_s2v_runner.shared import fmp4

        init = self.init_segment()
        done = fmp4.finished(init, self.at.frames, fps, self.at.audio_samples if audio_rate else None, audio_rate)
        with open(self.path, "r+b") as f:
            f.seek(0)
            f.write(done)
            f.flush()
            os.fsync(f.fileno())
        atomic.replace(self.path, Path(output), durable=True, commit_if=commit_if)
        return Path(output)


def clip_lengths(frames: int, infer_frames: int) -> list[int]:
    """How a video of ``frames`` frames splits into its clips' fragments: the first clip's frames
    (``infer_frames`` less the dropped motion frames), then ``infer_frames`` each."""
    first = min(frames, infer_frames - FIRST_CLIP_DROPS)
    out = [first] if first > 0 else []
    rest = frames - first
    while rest > 0:
        out.append(min(infer_frames, rest))
        rest -= out[-1]
    return out


def save_video_with_audio(frames, fps: int, audio: Path, output: Path, clips: list[int],
                          commit_if: atomic.CommitIf = None) -> Path:
    """frames (3, N, H, W) in [-1, 1] -> ``output``, byte for byte what the video writer makes of the
    same frames in clips of ``clips`` frames (:func:`clip_lengths`): all or nothing."""
    from wan_s2v_runner.shared import fmp4

    output = Path(output)
    if sum(clips) != frames.shape[1]:
        raise MediaError(f"clips of {sum(clips)} frames for a video of {frames.shape[1]}")
    speech = SpeechEncoder(Path(audio), fps)
    tmp = temp_name(output, "video")
    try:
        done, growing = 0, None
        for n in clips:
            avcc, video = encode_h264(frames_to_uint8(frames[:, done:done + n]), fps)
            done += n
            sound = speech.until(done) if done < frames.shape[1] else speech.end(done)
            if growing is None:
                h, w = frames.shape[2], frames.shape[3]
                growing = GrowingMp4(tmp, fmp4.init_segment(fmp4.VideoFormat(w, h, fps, avcc), speech.format()))
            growing.append(fmp4.Fragment(video, sound))
        growing.finish(output, fps, speech.rate, commit_if=commit_if)
    finally:
        speech.close()
        tmp.unlink(missing_ok=True)
    return output


def partial_path(output: Path) -> Path:
    """Where ``--preview`` keeps the video so far of ``output`` (``NAME.partial.mp4``)."""
    output = Path(output)
    return output.with_name(f"{output.stem}.partial.mp4")


def finished_path(partial: Path) -> Path:
    """The output a video so far (``NAME.partial.mp4``, :func:`partial_path`) becomes when finished."""
    partial = Path(partial)
    return partial.with_name(partial.name.removesuffix(".partial.mp4") + ".mp4")


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
