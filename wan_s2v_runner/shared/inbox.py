"""The inbox: how ``wan-s2v serve`` hands jobs to a resident rank group, and takes them back.

A served rank group is launched like any run, plus an ``inbox/`` folder in its run directory.
The server (launcher side) writes files there; rank 0 (rank side, on node 0, where the server
is) reads them and tells every other rank by a broadcast, so ranks on other nodes never need the
folder:

- ``job-<seq>.json``: the next :class:`~wan_s2v_runner.shared.jobs.Job` (written by temp name then
  rename, so rank 0 never reads half a file; rank 0 removes it when it takes it);
- ``cancel-<id>``: stop that job at the next denoising step boundary (the ranks stay up);
- ``stop``: finish the job in progress, then exit cleanly.

While the inbox is empty the ranks wait in stage ``idle``: rank 0 looks every
:data:`IDLE_POLL_S` and broadcasts "nothing yet", so no rank sits in one collective long enough
to reach the process group's timeout.
"""
from __future__ import annotations

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


def stop(run_dir: Path) -> None:
    atomic.write_text(inbox_of(run_dir) / STOP_FILE, "")


def stopping(run_dir: Path) -> bool:
    return (inbox_of(run_dir) / STOP_FILE).exists()
