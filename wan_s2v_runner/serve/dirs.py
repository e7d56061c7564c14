"""Where a server keeps things (:class:`ServerDirs`), and the one rule for a job's files: each
attempt writes under its own folder, and only its holder moves them into place.

``--server-dir`` is the server's own (its lock, its rank groups' run directories, a SQLite
queue); ``--shared-dir`` (a shared queue) holds what every server of the fleet reads: uploads,
videos and each job's work. A job's attempt ``N`` (its fencing token,
:mod:`~.store.protocol`) writes only into ``videos/.work/ID/attempt-N/``: its clip
checkpoints (``clips/``), its speech, its video so far, its first frame, its mp4 and record.
The published names beside the other videos (``videos/ID.mp4``, ``ID.json``,
``ID.thumbnail.jpg``, and a cancelled or failed job's ``ID.partial.mp4``) are made only by the
holder's :func:`publisher`, inside the store's transaction that checks its attempt; a job that
ended keeps nothing else. While it runs, the API serves its video so far and first frame from
the newest attempt that has one (:meth:`ServerDirs.newest`).
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from wan_s2v_runner.launcher.job_book import WORK_DIR
from wan_s2v_runner.serve.store.protocol import JobStatus
from wan_s2v_runner.shared import atomic, media

#: an attempt's own folder under the job's work folder
ATTEMPT_PREFIX = "attempt-"
#: the shared directory's marker: which fleet and queue it belongs to (:mod:`.fleet`)
MARKER = ".wan-s2v-fleet.json"


@dataclass(frozen=True)
class ServerDirs:
    """Where a server keeps things (``--server-dir``, ``--shared-dir``)."""

    root: Path  # this server's own (its lock, its rank groups' run directories, a SQLite queue)
    shared: Optional[Path] = None  # --shared-dir: what every server of a shared queue reads (else root)

    @property
    def shared_root(self) -> Path:
        return self.shared or self.root

    @property
    def marker(self) -> Path:
        return self.shared_root / MARKER

    @property
    def videos(self) -> Path:  # the published ID.mp4 and ID.json: the only files the API serves once ended
        return self.shared_root / "videos"

    @property
    def uploads(self) -> Path:
        return self.shared_root / "uploads"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def queue(self) -> Path:
        return self.root / "jobs.sqlite"

    def work(self, job_id: str) -> Path:
        return self.videos / WORK_DIR / job_id

    def speech(self, job_id: str) -> Path:
        """A live session's speech folder: its server posts the speech there, in order, and the
        group that makes it reads it (:mod:`wan_s2v_runner.shared.inbox`)."""
        return self.work(job_id) / "speech"

    def attempt(self, job_id: str, attempt: int) -> Path:
        """Attempt ``attempt``'s own folder: everything its ranks write for the job."""
        return self.work(job_id) / f"{ATTEMPT_PREFIX}{attempt}"

    def attempts(self, job_id: str) -> list[Path]:
        """The job's attempt folders, oldest first."""
        found = []
        for path in self.work(job_id).glob(f"{ATTEMPT_PREFIX}*"):
            m = re.fullmatch(rf"{ATTEMPT_PREFIX}(\d+)", path.name)
            if m and path.is_dir():
                found.append((int(m[1]), path))
        return [p for _, p in sorted(found)]

    def video(self, job_id: str) -> Path:
        return self.videos / f"{job_id}.mp4"

    def record(self, job_id: str) -> Path:  # the job's record (ID.json), as published
        return self.videos / f"{job_id}.json"

    def partial(self, job_id: str) -> Path:  # the video so far, as published (a cancelled or failed job's)
        return media.partial_path(self.video(job_id))

    def thumbnail(self, job_id: str) -> Path:  # the first frame, as published
        return media.thumbnail_path(self.video(job_id))

    def newest(self, job_id: str, published: Path) -> Optional[Path]:
        """``published`` (one of the job's names in ``videos/``) if it is there, else the newest
        attempt's own copy of it (a running job's video so far and first frame); None: neither."""
        if published.is_file():
            return published
        for folder in reversed(self.attempts(job_id)):
            own = folder / published.name
            if own.is_file():
                return own
        return None

    def so_far(self, job_id: str) -> Optional[Path]:
        """The job's video so far: a running job's growing file (its newest attempt's), or a cancelled
        or failed one's as published; None: none yet."""
        return self.newest(job_id, self.partial(job_id))

    def remove_job_files(self, job_id: str, *, video: bool) -> None:
        """What a job left: its work (every attempt's folder) and uploads (a job that ended keeps
        nothing it could resume from); with ``video``, its published files too (deleted)."""
        shutil.rmtree(self.work(job_id), ignore_errors=True)
        shutil.rmtree(self.uploads / job_id, ignore_errors=True)
        if video:
            for path in (self.video(job_id), self.record(job_id), self.videos / f"{job_id}.speech.wav",
                         self.partial(job_id), self.thumbnail(job_id)):
                path.unlink(missing_ok=True)


def publisher(dirs: ServerDirs, job_id: str, attempt: int, status: JobStatus, record: Optional[dict] = None,
              sure: Optional[Callable[[], bool]] = None) -> Callable[[], None]:
    """What the holder of ``attempt`` moves into place when the job ends with ``status`` (run by
    the store inside the transaction that checked the attempt): a completed job's mp4 (its own
    attempt's); ``record`` as ``ID.json`` (rank 0's record, stamped by the holder: a completed
    job's names the published mp4, a failed one's says why); and what the job made so far: the
    newest video so far any attempt wrote (a job that did not complete) and its first frame.
    ``sure`` is asked before each file (:class:`~wan_s2v_runner.shared.atomic.NotCommitted` when
    the holder's lease is no longer sure: a holder frozen mid-publish moves nothing when it wakes).
    Made again after a lost answer, it moves what is left (a file already moved counts as moved)."""
    own = dirs.attempt(job_id, attempt)

    def publish() -> None:
        dirs.videos.mkdir(parents=True, exist_ok=True)
        if status is JobStatus.COMPLETED:  # the mp4 first, then the record naming it
            _move(own / dirs.video(job_id).name, dirs.video(job_id), sure)
        else:
            _move(dirs.newest(job_id, dirs.partial(job_id)), dirs.partial(job_id), sure)
        if record is not None:
            atomic.write_text(dirs.record(job_id), json.dumps(record, indent=1), durable=True, commit_if=sure)
        _move(dirs.newest(job_id, dirs.thumbnail(job_id)), dirs.thumbnail(job_id), sure)

    return publish


def keep_so_far(dirs: ServerDirs, job_id: str) -> None:
    """A job that ends without its ranks (cancelled while queued after an interrupted attempt):
    the newest video so far and first frame any attempt wrote stay beside the videos."""
    _move(dirs.newest(job_id, dirs.partial(job_id)), dirs.partial(job_id))
    _move(dirs.newest(job_id, dirs.thumbnail(job_id)), dirs.thumbnail(job_id))


def _move(src: Optional[Path], dest: Path, sure: Optional[Callable[[], bool]] = None) -> None:
    if src is not None and src != dest and src.is_file():
        atomic.replace(src, dest, durable=True, commit_if=sure)


def remove_partial_videos(videos: Path, job_id: Optional[str] = None) -> list[Path]:
    """What a killed writer left half-written among the published videos (every writer names
    its temporaries ``.NAME.PID.*``, :func:`~wan_s2v_runner.shared.atomic.temp_name`): ``job_id``'s,
    or, when no group runs, everyone's."""
    removed = []
    for path in videos.glob(f".{job_id}.*" if job_id else ".*.*"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
