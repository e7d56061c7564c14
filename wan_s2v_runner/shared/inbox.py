"""The inbox: how ``wan-s2v serve`` hands jobs to a resident rank group, and takes them back.

A served rank group is launched like any run, plus an ``inbox/`` folder in its run directory
(and ``"jobs_from": "inbox"`` in its spec.json: :mod:`wan_s2v_runner.shared.job_source`).
The server (launcher side) writes files there; rank 0 (rank side, on node 0, where the server
is) reads them and tells every other rank by a broadcast, so ranks on other nodes never need the
folder:

- ``job-<seq>.json``: the next :class:`~wan_s2v_runner.shared.jobs.Job` (written by temp name then
  rename, so rank 0 never reads half a file; rank 0 removes it when it takes it);
- ``cancel-<id>``: stop that job at the next denoising step boundary (the ranks stay up); rank 0
  removes it once the job ended;
- ``lease-<id>.json`` (a shared queue's job): how long the server's hold on the job is known to
  last (:class:`Lease`: its attempt, the time it is sure of, or that it is lost). Rank 0 writes
  into the shared directory only while it is :attr:`Verdict.CURRENT` (:mod:`wan_s2v_runner.rank.lease`);
  the server renews it after each heartbeat and removes it when the job ended;
- ``stop``: finish the job in progress, then exit cleanly.

While the inbox is empty the ranks wait in stage ``idle``: rank 0 looks every
:data:`IDLE_POLL_S` and broadcasts "nothing yet", so no rank sits in one collective long enough
to reach the process group's timeout.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import atomic

INBOX_DIR = "inbox"
STOP_FILE = "stop"
#: how often rank 0 looks at the inbox while idle (and the idle ranks hear from it)
IDLE_POLL_S = 0.5


def inbox_of(run_dir: Path) -> Path:
    return Path(run_dir) / INBOX_DIR


def post_job(run_dir: Path, seq: int, job_json: str) -> Path:
    path = inbox_of(run_dir) / f"job-{seq:08d}.json"
    atomic.write_text(path, job_json)
    return path


def take_job(run_dir: Path) -> Optional[str]:
    """The oldest posted job's JSON, removed from the inbox; None when there is none."""
    box = inbox_of(run_dir)
    for path in sorted(box.glob("job-*.json")):
        try:
            text = path.read_text(encoding="utf-8")
            path.unlink()
        except OSError:
            continue
        return text
    return None


def _cancel_file(run_dir: Path, job_id: str) -> Path:
    return inbox_of(run_dir) / f"cancel-{job_id}"


def cancel(run_dir: Path, job_id: str) -> None:
    atomic.write_text(_cancel_file(run_dir, job_id), "")


def cancelled(run_dir: Path, job_id: str) -> bool:
    return _cancel_file(run_dir, job_id).exists()


def job_ended(run_dir: Path, job_id: str) -> None:
    """What the inbox held for a job that ended goes (its cancel)."""
    _cancel_file(run_dir, job_id).unlink(missing_ok=True)


class Verdict(str, Enum):
    """What rank 0 may do with a job's files (:meth:`Lease.verdict`)."""

    CURRENT = "current"  # the server holds the job: write
    UNKNOWN = "unknown"  # the hold ran past what the server is sure of (a pause, an outage): wait
    LOST = "lost"  # another holder has it (or will): write nothing more


@dataclass(frozen=True)
class Lease:
    """The server's hold on a job, as it tells its ranks: the attempt (its fencing token; for the
    logs: a group runs one job at a time, so the job's id names the hold), the wall time until
    which it is sure no other server can take the job (its last heartbeat's send plus most of the
    lease), or that it lost the job."""

    attempt: int
    until: float
    lost: bool = False

    def verdict(self, now: Optional[float] = None) -> Verdict:
        if self.lost:
            return Verdict.LOST
        return Verdict.CURRENT if (time.time() if now is None else now) < self.until else Verdict.UNKNOWN


def _lease_file(run_dir: Path, job_id: str) -> Path:
    return inbox_of(run_dir) / f"lease-{job_id}.json"


def write_lease(run_dir: Path, job_id: str, lease: Lease) -> None:
    atomic.write_text(_lease_file(run_dir, job_id),
                      json.dumps({"attempt": lease.attempt, "until": lease.until, "lost": lease.lost}))


def read_lease(run_dir: Path, job_id: str) -> Optional[Lease]:
    """The job's lease, None when the job has none (a server's own queue, a run, a batch)."""
    try:
        data = json.loads(_lease_file(run_dir, job_id).read_text(encoding="utf-8"))
        return Lease(int(data["attempt"]), float(data["until"]), bool(data.get("lost")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: be sure of nothing
        return Lease(0, 0.0)


def drop_lease(run_dir: Path, job_id: str) -> None:
    _lease_file(run_dir, job_id).unlink(missing_ok=True)


def stop(run_dir: Path) -> None:
    atomic.write_text(inbox_of(run_dir) / STOP_FILE, "")


def stopping(run_dir: Path) -> bool:
    return (inbox_of(run_dir) / STOP_FILE).exists()
