"""Bounded storage: what a server keeps of the jobs that ended, and the space it needs to take more.

- **Retention** (``--keep-videos N``, ``--keep-hours H``; either, both, or neither: keep all):
  the newest ``N`` ended jobs stay, and none older than ``H`` hours (since it ended); the rest
  are deleted as ``DELETE /v1/videos/{id}`` deletes them (the mp4, its record, thumbnail, clip
  checkpoints, uploads, the row). The keeper sweeps after each job and once a minute; a video's
  ``expires_at`` says when the age rule will take it. Uploads and work folders of jobs the queue
  does not hold (a submission whose answer was lost with the database) go once an hour old.
- **Space** (``--min-free-mb``): a submission is refused with 507 while the server directory's
  filesystem has less free space than that, with the cause and the fix; the server goes on
  answering, and takes jobs again once there is space. A job whose writing fails for lack of
  space fails alone, with the cause (:class:`~wan_s2v_runner.rank.worker.JobFailed`).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from wan_s2v_runner.launcher.job_book import WORK_DIR

#: how often the keeper sweeps when no job ends, s
SWEEP_EVERY_S = 60.0


@dataclass(frozen=True)
class Retention:
    keep: Optional[int] = None  # the newest ended jobs kept (None: no count limit)
    max_age_s: Optional[float] = None  # ended jobs older than this go (None: no age limit)

    def expires_at(self, finished_at: Optional[float]) -> Optional[int]:
        if self.max_age_s is None or finished_at is None:
            return None
        return int(finished_at + self.max_age_s)

    def due(self, ended: list[tuple[str, float]], now: float) -> list[str]:
        """The ids to delete among ``ended`` ((id, finished_at), oldest first)."""
        out = []
        for index, (job_id, finished_at) in enumerate(ended):
            too_many = self.keep is not None and len(ended) - index > self.keep
            too_old = self.max_age_s is not None and now - finished_at > self.max_age_s
            if too_many or too_old:
                out.append(job_id)
        return out


#: how old the files of a job the queue no longer holds must be before they go (a submission may still
#: be storing its job)
ORPHANS_S = 3600.0


def sweep_orphans(queue, dirs, now: Optional[float] = None, min_age_s: float = ORPHANS_S) -> list[str]:
    """Remove the uploads and work folders of jobs the queue does not hold (a submission whose
    answer was lost with the database; a job whose row a lost answer removed), older than
    ``min_age_s``; one question to the queue for all of them. The ids whose files went."""
    now = time.time() if now is None else now
    folders: dict[str, list[Path]] = {}
    for parent in (dirs.uploads, dirs.videos / WORK_DIR):
        try:
            entries = [p for p in parent.iterdir() if p.is_dir()]
        except OSError:
            continue
        for folder in entries:
            try:
                if now - folder.stat().st_mtime > min_age_s:
                    folders.setdefault(folder.name, []).append(folder)
            except OSError:
                continue
    if not folders:
        return []
    gone = sorted(set(folders) - queue.job_known(list(folders)))
    for job_id in gone:
        for folder in folders[job_id]:
            shutil.rmtree(folder, ignore_errors=True)
    return gone


def sweep(retention: Retention, queue, dirs, now: Optional[float] = None) -> list[str]:
    """Delete the ended jobs :class:`Retention` says are due (and uploads no job names); returns
    the jobs' ids."""
    sweep_orphans(queue, dirs, now)
    if retention.keep is None and retention.max_age_s is None:
        return []
    due = retention.due(queue.job_list_ended(), time.time() if now is None else now)
    for job_id in due:
        if queue.job_delete(job_id) is not None:
            dirs.remove_job_files(job_id, video=True)
    return due


def free_mb(path: Path) -> float:
    return shutil.disk_usage(path).free / 2**20


def space_refusal(path: Path, min_free_mb: int) -> Optional[str]:
    """Why the server takes no job now for lack of space (None: it has enough)."""
    free = free_mb(path)
    if free >= min_free_mb:
        return None
    return (f"the server's disk is nearly full ({free:.0f} MB free, it needs {min_free_mb} MB to take a job). Fix: "
            "delete videos (DELETE /v1/videos/{id}), set --keep-videos / --keep-hours, or free space on that "
            "filesystem; then submit again")
