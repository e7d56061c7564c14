"""Rank 0's video so far (``--preview``; a server's jobs always): after each clip but the last,
``OUTPUT.partial.mp4`` holds every frame made so far with the matching span of the speech, and
after the first clip ``OUTPUT.thumbnail.jpg`` holds the first frame.

The partial video is written exactly as the final one (:func:`~wan_s2v_runner.shared.media.save_video_with_audio`:
temporary names, then an atomic rename) from exactly the frames the final video starts with
(the clips so far, concatenated as :meth:`~wan_s2v_runner.rank.generation.S2VGenerator.generate`
concatenates them), so it is byte for byte the final video's first clips encoded alone. It is
written on one background thread while the ranks go on with the next clip, at a lower CPU
priority (:data:`PREVIEW_NICE`; its ffmpeg inherits it): the ranks never wait for it, except at the
end of the job for the one write in flight, and it yields the CPU to them. A clip that ends while a write
is in flight replaces what waits (only the newest video so far is worth writing). After each
write rank 0 says so in its events (``preview``: clips, frames, seconds, the file's sha256), which
is how the launcher and the server learn that a playable video is there.

The last clip makes no partial video: the final one is written next. When the final video is in
place the partial one goes; a job that ends without it (cancelled, failed) keeps it. A served
job's ``gate`` (:class:`~wan_s2v_runner.rank.lease.LeaseGate`) is asked before each write and
before its rename: while the server is not sure it holds the job, the write is skipped (the next
clip's replaces it), and once it lost the job nothing more is written.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional

#: the writer thread's niceness (Linux: per thread; the ffmpeg it starts inherits it): the video so
#: far never takes CPU from the ranks (their Python, their CPU compute, the GPU feeding)
PREVIEW_NICE = 10


class PreviewWriter:
    """The video so far of one job, written off the ranks' path (see the module's docstring)."""

    def __init__(self, output: Path, speech: Path, fps: int, events, before: Optional[list] = None, gate=None):
        from wan_s2v_runner.rank.lease import ALWAYS
        from wan_s2v_runner.shared import media

        self.gate = gate or ALWAYS
        self.path, self.thumbnail = media.partial_path(output), media.thumbnail_path(output)
        self.speech, self.fps, self.events = Path(speech), fps, events
        self.clips: list = list(before or [])  # each clip's frames (1, 3, n, H, W), as generate() collects them
        self.error: Optional[str] = None
        self._next: Optional[tuple[Any, int, int]] = None  # the newest video so far, not yet written
        self._busy = False
        self._done = threading.Condition()
        self.written = 0  # partial videos written (a test reads it)

    def clip_done(self, clip: int, frames, num_clips: int) -> None:
        """Clip ``clip`` (0-based) of ``num_clips`` is decoded: hand its video so far to the writer."""
        self.clips.append(frames)
        if (clip == 0 or not self.thumbnail.is_file()) and self.gate.current():
            self._write_thumbnail(frames)
        if clip + 1 >= num_clips:  # the final video is next: nothing to preview
            return
        with self._done:
            self._next = (list(self.clips), clip + 1, num_clips)
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._drain, name="wan-s2v-preview", daemon=True).start()

    def _drain(self) -> None:
        try:  # below the ranks: the encoder (its ffmpeg inherits this) takes only CPU they leave
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREVIEW_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._done:
                item, self._next = self._next, None
                if item is None:
                    self._busy = False
                    self._done.notify_all()
                    return
            self._write(*item)

    def _write(self, clips: list, done: int, num_clips: int) -> None:
        import torch

        from wan_s2v_runner.shared import media
        from wan_s2v_runner.shared.atomic import NotCommitted

        if not self.gate.current():  # not sure the server holds the job: the next clip's replaces it
            return
        video = torch.cat(clips, dim=2)[0]
        try:
            media.save_video_with_audio(video, self.fps, self.speech, self.path, commit_if=self.gate.current)
            sha = media.sha256_file(self.path)
        except NotCommitted:
            return
        except Exception as e:  # a preview that cannot be written never fails the job
            self.error = f"{type(e).__name__}: {e}"
            self.events.emit("preview_failed", clips=done, error=self.error)
            return
        self.written += 1
        self.events.emit("preview", clips=done, of=num_clips, frames=int(video.shape[1]),
                         seconds=round(video.shape[1] / self.fps, 3), path=str(self.path), sha256=sha)

    def _write_thumbnail(self, frames) -> None:
        from PIL import Image

        from wan_s2v_runner.shared import atomic, media

        try:
            first = media.frames_to_uint8(frames[0][:, :1])[0]
            atomic.atomic_write(self.thumbnail, lambda p: Image.fromarray(first).save(p, format="JPEG", quality=90),
                                commit_if=self.gate.current)
            self.events.emit("thumbnail", path=str(self.thumbnail))
        except atomic.NotCommitted:
            pass
        except Exception as e:
            self.events.emit("preview_failed", clips=0, error=f"thumbnail: {type(e).__name__}: {e}")

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until no write is in flight or waiting."""
        with self._done:
            self._done.wait_for(lambda: not self._busy, timeout)

    def finish(self, completed: bool) -> None:
        """The job ended: wait for the write in flight; the final video in place, the partial goes."""
        if completed:
            with self._done:
                self._next = None  # the final video holds it all
        self.wait()
        if completed and self.gate.current():
            self.path.unlink(missing_ok=True)
