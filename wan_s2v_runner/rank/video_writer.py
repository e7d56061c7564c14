"""The decoding rank's clip sink: each clip's frames leave the rank as they are made.

A job's video grows clip by clip in one fragmented MP4 (:mod:`~wan_s2v_runner.shared.fmp4`),
``OUTPUT.partial.mp4`` beside the output: the init segment with the first clip, then one fragment
per clip (its H.264 frames, encoded by a fresh encoder, and the AAC frames of its span of the
speech from the job's one audio encoder: :mod:`~wan_s2v_runner.shared.media`). A player opens it
at any moment; the finished video is the same file, its durations written in and renamed to the
output: there is no second encode, and nothing at the end grows with the video.

How a clip flows (:class:`VideoWriter`, driven by the loop through
:class:`~wan_s2v_runner.rank.job_contract.FrameSink`):

1. :meth:`VideoWriter.frames`: the clip is decoded; its float frames go to the writer's thread,
   which converts them to uint8, encodes them and appends the fragment (durable: fsync), while
   the rank goes on with the clip's motion re-encode. The rank keeps only the last frames the
   next clip needs (as float, as upstream: never read back from the encoded video). At most one
   clip is in the writer's hands: rank 0's host memory does not depend on the number of clips.
2. :meth:`VideoWriter.clip_done`: the next clip's state is known; once the clip's fragment is in
   the file, the clip checkpoint is committed (:class:`~wan_s2v_runner.shared.resume.Checkpoint`:
   the small carried state, then ``state.json`` naming the file's length after the clip). A clip
   counts as done only once it is in the file: a fault right after never loses it.
3. :meth:`VideoWriter.finish`: the last fragment is in; the durations are written into the init
   segment and the file becomes the output (one rename). A job that fails keeps its partial file:
   it holds every finished clip, and ``wan-s2v resume`` continues it from the last one.

A resumed job (:class:`~wan_s2v_runner.shared.resume.Continued`) reopens the file its run made
(or copies it, when the output moved), cut back to the last committed clip, and replays the audio
encoder up to there: its video is byte for byte the uninterrupted run's.

``--frames-out`` (raw frames, for checks) is written here too, as the frames come, to a raw file
on disk (a memory map turns it into the ``.pt`` at the end), never gathered in memory.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from wan_s2v_runner.shared import atomic, disk, fmp4, media, resume
from wan_s2v_runner.shared.disk import DiskError
from wan_s2v_runner.shared.events import EventKind
from wan_s2v_runner.shared.latency import Latencies
from wan_s2v_runner.shared.speech_windows import BLOCK_SAMPLES

log = logging.getLogger("wan_s2v.video_writer")

#: the writer thread's niceness (Linux: per thread; the encoder's threads inherit it): encoding
#: never takes CPU from the ranks' compute
WRITER_NICE = 10


class FramesFile:
    """``--frames-out``: every clip's frames appended raw to a file beside PATH, then one
    ``torch.save`` of the whole tensor, read through a memory map (page cache, not the rank's
    heap) and renamed into place."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.raw = atomic.temp_name(self.path, "raw")
        self.shape: Optional[tuple] = None
        self.dtype: Optional[torch.dtype] = None
        self.frames = 0

    def add(self, frames: torch.Tensor) -> None:  # (1, 3, n, H, W)
        t = frames[0].permute(1, 0, 2, 3).contiguous()  # frame-major: clips append along the file
        self.shape, self.dtype = tuple(t.shape[1:]), t.dtype
        with open(self.raw, "ab") as f:
            f.write(t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes())
        self.frames += t.shape[0]

    def finish(self, commit_if=None) -> None:
        n = self.frames * int(torch.Size(self.shape).numel())
        t = torch.from_file(str(self.raw), shared=False, size=n, dtype=self.dtype)
        # (3, N, H, W), as generate() returns them: a view of the file's frame-major storage, saved as
        # it is (torch.save writes the storage and the strides: no copy of the video in memory)
        video = t.view(self.frames, *self.shape).permute(1, 0, 2, 3)
        try:
            atomic.atomic_write(self.path, lambda p: torch.save(video, p), commit_if=commit_if)
        finally:
            self.discard()

    def discard(self) -> None:
        self.raw.unlink(missing_ok=True)


class VideoWriter:
    """One job's video on the decoding rank (see the module's docstring). ``gate``: a served job's
    lease (:class:`~wan_s2v_runner.rank.lease.LeaseGate`): a checkpoint or the final rename happens
    only while the server is sure it holds the job; the fragments go to the attempt's own file."""

    def __init__(self, output: Path, speech: Optional[Path], fps: int, run_dir: Path, identity: dict, events,
                 gate=None, thumbnail: bool = False, frames_out: Optional[Path] = None,
                 continued: Optional[resume.Continued] = None, served: bool = False):
        from wan_s2v_runner.rank.lease import ALWAYS

        self.output, self.fps, self.events = Path(output), fps, events
        self.run_dir = Path(run_dir)
        #: a served job's: a write's error is kept (:attr:`error`) for the job's source to see at the
        #: next step or block (every rank then ends the job there: ``rank.step_control``'s FAILED),
        #: not raised on this rank alone while its peers are in a collective
        self.served = served
        #: what a full disk's one line says to do after freeing space: resume the run, or (served)
        #: submit the job again
        self.then = disk.RESUBMIT if served else disk.RESUME
        self.path = media.partial_path(self.output)
        self.gate = gate or ALWAYS
        self.checkpoint = resume.Checkpoint(run_dir, identity, self.path)
        self.thumbnail = media.thumbnail_path(self.output) if thumbnail else None
        self.frames_file = FramesFile(frames_out) if frames_out else None
        #: the speech the video plays: its file's, or (a live session: ``speech`` None) each block's span
        #: as the loop hands it (:meth:`frames`)
        self.speech = media.SpeechEncoder(Path(speech), fps) if speech is not None else media.PushedSpeech(fps)
        self.growing: Optional[media.GrowingMp4] = None
        self.continued = continued
        self.ends: list[int] = []  # the frame each clip in the file ends at
        self.size: tuple[int, int] = (0, 0)  # (height, width) of the video
        self.avcc: Optional[bytes] = None  # the first clip's H.264 headers (every clip's must equal them)
        self.error: Optional[BaseException] = None
        #: a live session's blocks: seconds from the arrival of the last sample each needed to its
        #: fragment in the file (where a stream or a viewer can take it)
        self.latencies = Latencies()
        #: a served job whose server lost it: nothing more is written (its attempt's folder may be gone)
        self.lost = False
        self._work: Optional[tuple] = None  # (clip, frames, num_clips) handed to the thread
        self._busy = False
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        if continued is not None:
            self._continue(continued)

    # ----- a resume
    def _continue(self, c: resume.Continued) -> None:
        """Reopen the run's file at its last committed clip (a copy when the output moved), and
        replay the speech's encoder through the clips already in it."""
        video = c.video
        finished = media.finished_path(c.video)
        if not video.is_file() and c.complete and finished.is_file():
            # every clip was in and the file was finished (renamed) before the run stopped, its record
            # not yet written (a server stopped between the two): its bytes, finished again the same way
            video = finished
        if not video.is_file():
            raise resume.ResumeError(f"the video so far {c.video} is missing: its clips cannot be continued. "
                                     "Fix: put the file back, or start the run again with `wan-s2v run`.")
        if video.stat().st_size < c.at.size:
            raise resume.ResumeError(f"the video so far {video} is shorter ({video.stat().st_size} bytes) than "
                                     f"its last clip's end ({c.at.size}). Fix: start the run again with `wan-s2v run`.")
        if video.resolve() != self.path.resolve():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = atomic.temp_name(self.path, "copy")
            with open(video, "rb") as src, open(tmp, "wb") as dst:
                left = c.at.size
                while left:
                    chunk = src.read(min(left, 1 << 24))
                    if not chunk:
                        break
                    dst.write(chunk)
                    left -= len(chunk)
            os.replace(tmp, self.path)
        self.growing = media.GrowingMp4(self.path, at=c.at)
        init = self.growing.init_segment()
        self.avcc, self.ends, self.size = fmp4.video_config(init), list(c.ends), fmp4.video_size(init)
        if c.complete:  # every clip is in it (the run stopped while finishing it): nothing to append
            return
        made = 0
        for done in self.ends:
            made += len(self.speech.until(done))
        if made * fmp4.AAC_FRAME != c.at.audio_samples:
            raise resume.ResumeError(f"the speech's encoder made {made} AAC frames for the clips in {c.video}, the "
                                     f"file holds {c.at.audio_samples // fmp4.AAC_FRAME}: the speech or the encoder "
                                     "differs. Fix: start the run again with `wan-s2v run`.")
        if self.frames_file is not None:
            log.warning("--frames-out on a resumed run holds the resumed clips' frames only")

    # ----- the loop's side
    def frames(self, clip: int, frames: torch.Tensor, num_clips: Optional[int], speech=None) -> None:
        """Clip ``clip`` (0-based) of ``num_clips`` (None: not known yet) is decoded: (1, 3, n, H, W)
        on the CPU; ``speech``: a live session's block's span of its speech. Handed to the writer's
        thread once it holds no other clip (a served job whose write failed: kept from it; the job
        ends at its next step)."""
        self._wait_idle(raise_error=not self.served)
        if self.error is not None:
            return
        with self._cond:
            self._work, self._busy = (clip, frames, num_clips, speech), True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wan-s2v-video", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def clip_done(self, state, num_clips: int) -> None:
        """The state after clip ``state.clip - 1`` (the next clip's motion latents): once its
        fragment is in the file, the clip checkpoint is committed."""
        self._wait_idle(raise_error=not self.served)
        if self.lost or self.error is not None:  # the step message stops the job (JobLost, FAILED)
            return
        if self.growing is None:
            raise RuntimeError("a clip ended before its frames reached the video writer")
        try:
            self.checkpoint.commit(state, num_clips, self.growing.at, self.ends, self.gate)
        except OSError as e:
            error = DiskError.of(e, f"the checkpoint of clip {state.clip}", path=self.run_dir, then=self.then)
            if not self.served:
                raise error from e
            self.error = error

    def drain(self) -> None:
        """Wait until the writer's thread holds no block or clip (its error, if any, raised here):
        a live job hands its last block without a checkpoint after it."""
        self._wait_idle()

    def finish(self) -> Path:
        """The last clip is in: the video becomes the output (the gate asked first)."""
        self._wait_idle()
        self._stop()
        self.speech.close()
        if self.frames_file is not None:
            self.frames_file.finish(commit_if=self.gate.wait)
        return self.growing.finish(self.output, self.fps, self.speech.rate, commit_if=self.gate.wait)

    def abandon(self) -> None:
        """The job ended without its video: the fragment in flight is finished (the file keeps
        every clip made), nothing else is written."""
        try:
            self._wait_idle(raise_error=False)
        finally:
            self._stop()
            self.speech.close()
            if self.frames_file is not None:
                self.frames_file.discard()

    @property
    def total_frames(self) -> int:
        return self.growing.at.frames if self.growing is not None else 0

    # ----- the thread
    def _wait_idle(self, raise_error: bool = True) -> None:
        """Wait until the thread holds nothing; raise (and clear) its error, or keep it."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
            err = self.error
            if raise_error:
                self.error = None
        if err is not None and raise_error:
            raise err

    def _stop(self) -> None:
        with self._cond:
            if self._thread is not None:
                self._work = None
                self._thread, thread = None, self._thread
                self._cond.notify_all()
            else:
                thread = None
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        try:  # below the ranks: the encoder's threads (started from this one) inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._work is not None or self._thread is None)
                if self._work is None:
                    return
                work = self._work
            try:
                self._write(*work)
            except OSError as e:  # the loop raises it at its next call
                self.error = DiskError.of(e, f"appending clip {work[0] + 1} to {self.path}", path=self.path,
                                          then=self.then)
            except BaseException as e:
                self.error = e
            with self._cond:
                self._work, self._busy = None, False
                self._cond.notify_all()

    def _write(self, clip: int, frames: torch.Tensor, num_clips: Optional[int], speech=None) -> None:
        if self.lost or self.gate.lost():
            self.lost = True
            return
        last = num_clips is not None and clip + 1 >= num_clips
        if speech is not None and isinstance(self.speech, media.PushedSpeech):
            self.speech.push(speech.samples)
        if self.frames_file is not None:
            self.frames_file.add(frames)
        u8 = media.frames_to_uint8(frames[0])
        del frames  # the float frames go; the loop holds none either
        if clip == 0 and self.thumbnail is not None:
            self._write_thumbnail(u8[0])
        avcc, video = media.encode_h264(u8, self.fps)
        end = (self.growing.at.frames if self.growing is not None else 0) + len(video)
        sound = self.speech.end(end) if last else self.speech.until(end)
        if self.growing is None:
            h, w = u8.shape[1], u8.shape[2]
            self.growing = media.GrowingMp4(self.path, fmp4.init_segment(fmp4.VideoFormat(w, h, self.fps, avcc),
                                                                          self.speech.format()))
            self.avcc, self.size = avcc, (h, w)
        elif avcc != self.avcc:
            raise media.MediaError("this clip's H.264 headers differ from the video's first clip's (another encoder "
                                   "build?): it cannot continue the file")
        try:
            before = b""
            if speech is not None and speech.runs is not None:  # a session's block: its speech's runs
                before = fmp4.speech_runs_box(clip * BLOCK_SAMPLES, BLOCK_SAMPLES, speech.runs)
            self.growing.append(fmp4.Fragment(video, sound, before))
        except OSError:
            if self.gate.current():
                raise
            # not sure the server still holds the job: another holder may have finished it and
            # removed this attempt's folder; nothing more is written, the job stops at its next
            # step or at its end (JobLost) once the server knows
            self.lost = True
            return
        at = self.growing.at
        self.ends.append(at.frames)
        latency = None
        if speech is not None and speech.ready_at is not None:  # a live session's block: its frames can leave now
            latency = round(time.time() - speech.ready_at, 4)
            self.latencies.add(latency)
        if not last:
            self.events.emit(EventKind.PREVIEW, clips=clip + 1, of=num_clips, frames=at.frames,
                             seconds=round(at.frames / self.fps, 3), path=str(self.path), bytes=at.size,
                             **({"latency_s": latency} if latency is not None else {}),
                             **({"spoken": bool(speech.samples.any())} if speech is not None else {}))

    def _write_thumbnail(self, first) -> None:
        from PIL import Image

        try:
            atomic.atomic_write(self.thumbnail, lambda p: Image.fromarray(first).save(p, format="JPEG", quality=90),
                                commit_if=self.gate.current)
            self.events.emit(EventKind.THUMBNAIL, path=str(self.thumbnail))
        except atomic.NotCommitted:
            pass
        except Exception as e:  # a thumbnail never fails the job
            self.events.emit(EventKind.PREVIEW_FAILED, clips=0, error=f"thumbnail: {type(e).__name__}: {e}")

