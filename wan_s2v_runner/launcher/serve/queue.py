"""The server's job queue: :class:`JobStore`, what the API and the keepers ask of it, and
:class:`JobQueue`, the store in one SQLite file (``SERVER_DIR/jobs.sqlite``) in WAL mode with
``synchronous=FULL``, so a job the API answered "queued" survives a kill -9 of the server or a
power cut. Every change is one transaction; the states are :class:`JobStatus`.

A job moves ``queued -> in_progress -> completed | failed | cancelled`` (a queued job may be
cancelled directly). After a restart :meth:`JobQueue.recover` puts the jobs that were in progress
back in the queue, first in line: the server kill was not their fault, and they resume from
their clip checkpoints. A job whose rank group failed goes back too, with ``failures`` counted;
at :data:`MAX_FAILURES` it is failed for good.

The API and the keeper know only :class:`JobStore`: a keeper claims a job (``claim_next``, one
transaction) before it hands it to its group, so several keepers (several rank groups) can share
one store, and another store (a database several servers share) is one more class.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Protocol

#: a job that took its rank group down this many times is failed, not retried again
MAX_FAILURES = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    failures INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    runs INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    record TEXT,
    deleting INTEGER NOT NULL DEFAULT 0
)"""
#: columns added since the first schema (a queue file from before gets them, with their defaults)
_ADDED_COLUMNS = {"deleting": "INTEGER NOT NULL DEFAULT 0"}
_INDEXES = ("CREATE INDEX IF NOT EXISTS jobs_status_seq ON jobs (status, seq)",)
#: the most videos one page of ``GET /v1/videos`` holds (OpenAI's list: 20 by default, 100 at most)
PAGE_MAX = 100


class JobStatus(str, Enum):
    """A served job's state (the OpenAI video object's ``status`` values)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


class QueueFull(Exception):
    """More jobs are waiting than the server takes (``--max-queue``)."""


@dataclass(frozen=True)
class JobRow:
    id: str
    status: JobStatus
    spec: dict[str, Any]  # the job's JobSpec as JSON values (before the split: a whole RunSpec)
    created_at: float
    started_at: Optional[float]
    finished_at: Optional[float]
    failures: int
    cancel_requested: bool
    runs: int  # how many rank groups were handed this job (a resumed job: more than one)
    error: Optional[str]
    record: Optional[dict[str, Any]]  # the job's record (rank 0's ID.json) once completed
    deleting: bool = False  # DELETE asked while it ran: gone for the API; removed when it ends
    progress: Optional[dict[str, Any]] = None  # a shared queue: the live progress its server stored


@dataclass(frozen=True)
class Beat:
    """What a keeper's heartbeat learns of the jobs it runs: the ones someone asked to cancel, and
    (a shared queue) the ones it no longer holds (its lease ran out and another server took it:
    it stops them and leaves their files to the new holder)."""

    cancel: frozenset[str] = frozenset()
    lost: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Reaped:
    """What :meth:`JobStore.reap` did: jobs of a server that stopped renewing its leases put
    back in the queue, and those that were being deleted removed (their files are the caller's)."""

    requeued: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()


class JobStore(Protocol):
    """The jobs of a server: what its API and its keepers read and change (every change one
    transaction; ``spec`` is the job's :class:`~wan_s2v_runner.shared.spec.JobSpec` as JSON).
    ``shared``: other servers use the store too (:mod:`.pg_queue`); then a keeper holds each job
    it runs with a lease its ``heartbeat`` renews, and ``reap`` gives a dead server's jobs back."""

    shared: bool

    def add(self, job_id: str, spec: dict[str, Any], max_queued: int) -> None: ...
    def get(self, job_id: str) -> Optional[JobRow]: ...
    def all(self, limit: int = 1000) -> list[JobRow]: ...
    def position(self, job_id: str) -> Optional[int]: ...
    def positions(self, job_ids: list[str]) -> dict[str, int]: ...
    def counts(self) -> dict[str, int]: ...
    def claim_next(self) -> Optional[JobRow]: ...
    def heartbeat(self, running: dict[str, Optional[dict]]) -> Beat: ...
    def reap(self) -> Reaped: ...
    def for_keeper(self, index: int) -> JobStore: ...
    def finish(self, job_id: str, status: JobStatus, *, error: Optional[str] = None,
               record: Optional[dict] = None) -> bool: ...
    def group_failed(self, job_id: str, error: str) -> JobStatus: ...
    def cancel(self, job_id: str) -> Optional[JobStatus]: ...
    def page(self, after: Optional[str] = None, limit: int = 20, order: str = "desc") -> tuple[list[JobRow], bool]: ...
    def ended(self) -> list[tuple[str, float]]: ...
    def delete(self, job_id: str) -> Optional[JobStatus]: ...
    def remove(self, job_id: str) -> None: ...
    def purge_deleting(self) -> list[str]: ...
    def recover(self) -> list[str]: ...
    def close(self) -> None: ...


class JobQueue:
    """The :class:`JobStore` in the SQLite file ``path``; safe to use from the API's threads and the keeper at once."""

    shared = False  # one server's (its directory's lock says so): no leases

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(_SCHEMA)
            have = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
            for name, kind in _ADDED_COLUMNS.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
            for sql in _INDEXES:
                self._db.execute(sql)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # ----- submit -----
    def add(self, job_id: str, spec: dict[str, Any], max_queued: int) -> None:
        """Queue a job; :class:`QueueFull` when ``max_queued`` are already waiting."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (waiting,) = self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = ?",
                                              (JobStatus.QUEUED.value,)).fetchone()
                if waiting >= max_queued:
                    raise QueueFull(f"{waiting} jobs are queued (the server takes {max_queued})")
                self._db.execute("INSERT INTO jobs (id, status, spec, created_at) VALUES (?, ?, ?, ?)",
                                 (job_id, JobStatus.QUEUED.value, json.dumps(spec), time.time()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # ----- read -----
    @staticmethod
    def _row(r: sqlite3.Row) -> JobRow:
        return JobRow(id=r["id"], status=JobStatus(r["status"]), spec=json.loads(r["spec"]),
                      created_at=r["created_at"], started_at=r["started_at"], finished_at=r["finished_at"],
                      failures=r["failures"], cancel_requested=bool(r["cancel_requested"]), runs=r["runs"],
                      error=r["error"], record=json.loads(r["record"]) if r["record"] else None,
                      deleting=bool(r["deleting"]))

    def get(self, job_id: str) -> Optional[JobRow]:
        with self._lock:
            r = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return self._row(r) if r else None

    def all(self, limit: int = 1000) -> list[JobRow]:
        """The newest ``limit`` jobs, oldest first (none being deleted)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM (SELECT * FROM jobs WHERE deleting = 0 ORDER BY seq DESC LIMIT ?) "
                                    "ORDER BY seq", (limit,)).fetchall()
        return [self._row(r) for r in rows]

    def page(self, after: Optional[str] = None, limit: int = 20, order: str = "desc") -> tuple[list[JobRow], bool]:
        """One page of jobs (none being deleted) in submission order (``asc``) or newest first
        (``desc``), after the job ``after`` (KeyError: no such job); and whether more follow."""
        limit = max(1, min(int(limit), PAGE_MAX))
        desc = order == "desc"
        with self._lock:
            start = None
            if after is not None:
                r = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if r is None:
                    raise KeyError(after)
                start = r["seq"]
            where = "deleting = 0" + ("" if start is None else (" AND seq < ?" if desc else " AND seq > ?"))
            rows = self._db.execute(f"SELECT * FROM jobs WHERE {where} ORDER BY seq {'DESC' if desc else 'ASC'} "
                                    "LIMIT ?", ((start,) if start is not None else ()) + (limit + 1,)).fetchall()
        return [self._row(r) for r in rows[:limit]], len(rows) > limit

    def position(self, job_id: str) -> Optional[int]:
        """1-based place of a queued job in the queue (None when it is not queued)."""
        return self.positions([job_id]).get(job_id)

    def positions(self, job_ids: list[str]) -> dict[str, int]:
        """The 1-based places in the queue of those of ``job_ids`` that are queued, in one
        pass over the queued jobs (the status index), however many are asked."""
        if not job_ids:
            return {}
        marks = ",".join("?" * len(job_ids))
        with self._lock:
            rows = self._db.execute(f"SELECT id, pos FROM (SELECT id, ROW_NUMBER() OVER (ORDER BY seq) AS pos "
                                    f"FROM jobs WHERE status = ?) WHERE id IN ({marks})",
                                    (JobStatus.QUEUED.value, *job_ids)).fetchall()
        return {r[0]: r[1] for r in rows}

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return {s.value: 0 for s in JobStatus} | {r[0]: r[1] for r in rows}

    # ----- the keeper's moves -----
    def claim_next(self) -> Optional[JobRow]:
        """The oldest queued job (jobs put back after a restart first), now in progress."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                r = self._db.execute("SELECT * FROM jobs WHERE status = ? ORDER BY started_at IS NULL, seq LIMIT 1",
                                     (JobStatus.QUEUED.value,)).fetchone()
                if r is not None:
                    self._db.execute("UPDATE jobs SET status = ?, started_at = COALESCE(started_at, ?), "
                                     "runs = runs + 1 WHERE id = ?",
                                     (JobStatus.IN_PROGRESS.value, time.time(), r["id"]))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self.get(r["id"]) if r is not None else None

    def heartbeat(self, running: dict[str, Optional[dict]]) -> Beat:
        """The ids among ``running`` someone asked to cancel (one server: no leases to renew)."""
        if not running:
            return Beat()
        marks = ",".join("?" * len(running))
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM jobs WHERE cancel_requested = 1 AND id IN ({marks})",
                                    tuple(running)).fetchall()
        return Beat(cancel=frozenset(r[0] for r in rows))

    def reap(self) -> Reaped:
        """Nothing: one server's queue has no other server's jobs to take back."""
        return Reaped()

    def for_keeper(self, index: int) -> "JobQueue":
        """The store keeper ``index`` claims through (one server's: this one; its keepers never
        share a job, each claim being one transaction)."""
        return self

    def finish(self, job_id: str, status: JobStatus, *, error: Optional[str] = None,
               record: Optional[dict] = None) -> bool:
        """End a job; whether a row changed."""
        return bool(self._write("UPDATE jobs SET status = ?, finished_at = ?, error = ?, record = ? WHERE id = ?",
                    (status.value, time.time(), error, json.dumps(record) if record else None, job_id)))

    def group_failed(self, job_id: str, error: str) -> JobStatus:
        """The job's rank group failed under it: back to the queue, or failed at
        :data:`MAX_FAILURES`. Returns its new status."""
        with self._lock:
            self._db.execute("UPDATE jobs SET failures = failures + 1, error = ? WHERE id = ?", (error, job_id))
            (failures,) = self._db.execute("SELECT failures FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if failures >= MAX_FAILURES:
            self.finish(job_id, JobStatus.FAILED,
                        error=f"the rank group failed {failures} times on this job; last: {error}")
            return JobStatus.FAILED
        self._write("UPDATE jobs SET status = ? WHERE id = ? AND status = ?",
                    (JobStatus.QUEUED.value, job_id, JobStatus.IN_PROGRESS.value))
        return JobStatus.QUEUED

    def cancel(self, job_id: str) -> Optional[JobStatus]:
        """Cancel a job: a queued one is cancelled at once; a running one is marked (the keeper
        stops it at the next step). Returns the job's status after, None if there is no such job."""
        with self._lock:
            self._db.execute("UPDATE jobs SET status = ?, finished_at = ? WHERE id = ? AND status = ?",
                             (JobStatus.CANCELLED.value, time.time(), job_id, JobStatus.QUEUED.value))
            self._db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND status = ?",
                             (job_id, JobStatus.IN_PROGRESS.value))
        row = self.get(job_id)
        return row.status if row else None

    def ended(self) -> list[tuple[str, float]]:
        """(id, finished_at) of every ended job (none being deleted), oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT id, finished_at FROM jobs WHERE status IN (?, ?, ?) AND deleting = 0 "
                                    "ORDER BY finished_at, seq", tuple(s.value for s in JobStatus if s.terminal)
                                    ).fetchall()
        return [(r[0], r[1] or 0.0) for r in rows]

    def delete(self, job_id: str) -> Optional[JobStatus]:
        """Delete a job: one that is not running is gone at once (its row; its files are the
        caller's); a running one is cancelled and marked ``deleting`` (gone for the API; the
        keeper removes it when it ends). Returns its status before, None if there is no such job."""
        with self._lock:
            r = self._db.execute("SELECT status FROM jobs WHERE id = ? AND deleting = 0", (job_id,)).fetchone()
            if r is None:
                return None
            status = JobStatus(r["status"])
            if status is JobStatus.IN_PROGRESS:
                self._db.execute("UPDATE jobs SET deleting = 1, cancel_requested = 1 WHERE id = ?", (job_id,))
            else:
                self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        return status

    def remove(self, job_id: str) -> None:
        """The row goes (a job marked ``deleting``, once it ended)."""
        self._write("DELETE FROM jobs WHERE id = ?", (job_id,))

    def purge_deleting(self) -> list[str]:
        """After a restart: the jobs deleted while they ran go (their files are the caller's)."""
        with self._lock:
            ids = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE deleting = 1").fetchall()]
            self._db.execute("DELETE FROM jobs WHERE deleting = 1")
        return ids

    def recover(self) -> list[str]:
        """After a restart: jobs left in progress go back to the queue (first in line)."""
        with self._lock:
            ids = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE status = ?",
                                                  (JobStatus.IN_PROGRESS.value,)).fetchall()]
            self._db.execute("UPDATE jobs SET status = ? WHERE status = ?",
                             (JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value))
        return ids
