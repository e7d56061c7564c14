"""The :class:`~.protocol.JobStore` of one server: one SQLite file (``SERVER_DIR/jobs.sqlite``) in
WAL mode with ``synchronous=FULL``, so a job the API answered "queued" survives a kill -9 of the
server or a power cut. Every change is one transaction.

A job moves ``queued -> in_progress -> completed | failed | cancelled`` (a queued job may be
cancelled directly). After a restart :meth:`SqliteJobStore.job_recover` puts the jobs that were in
progress back in the queue, first in line: the server kill was not their fault, and they resume
from their clip checkpoints. One server holds the file (its directory's lock), so there are no
leases; the attempt still fences every holder's write, as in the shared store, so a rank group
that outlived its keeper's claim cannot end a job.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from wan_s2v_runner.serve.store import rules
from wan_s2v_runner.serve.store.protocol import (
    DEFAULT_POOL,
    Added,
    Beat,
    Held,
    IdempotencyConflict,
    JobRow,
    JobStatus,
    Joined,
    PoolIdentity,
    Publish,
    QueueFull,
    QueueUnavailable,
    Reaped,
    StoreRefused,
)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    failures INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    attempt INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    record TEXT,
    deleting INTEGER NOT NULL DEFAULT 0,
    pool TEXT NOT NULL DEFAULT 'default',
    identity TEXT,
    idempotency_key TEXT,
    request_hash TEXT)""",
    "CREATE TABLE IF NOT EXISTS fleet (id TEXT NOT NULL, marked INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL)",
    """CREATE TABLE IF NOT EXISTS pools (name TEXT PRIMARY KEY, digest TEXT NOT NULL, identity TEXT NOT NULL,
    joined_by TEXT NOT NULL, joined_at REAL NOT NULL)""",
)
#: columns renamed and added since the first schema (a queue file from before gets them)
_RENAMED = {"runs": "attempt"}
_ADDED_COLUMNS = {"deleting": "INTEGER NOT NULL DEFAULT 0", "pool": "TEXT NOT NULL DEFAULT 'default'",
                  "identity": "TEXT", "idempotency_key": "TEXT", "request_hash": "TEXT"}
_INDEXES = ("DROP INDEX IF EXISTS jobs_status_seq",
            "CREATE INDEX IF NOT EXISTS jobs_pool_status_seq ON jobs (pool, status, seq)",
            "CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (idempotency_key) "
            "WHERE idempotency_key IS NOT NULL")
_QUEUED, _RUNNING = JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value


class SqliteJobStore:
    """The :class:`~.protocol.JobStore` in the SQLite file ``path``; safe to use from the API's
    threads and the keepers at once."""

    shared = False  # one server's (its directory's lock says so): no leases
    lease_s = None

    def __init__(self, path: Path, pool: str = DEFAULT_POOL, *, busy_timeout_s: float = 30.0):
        """``busy_timeout_s``: how long an operation waits for another process's hold on the
        file before it raises :class:`QueueUnavailable`."""
        self.path, self.pool = Path(path), pool
        self.digest: Optional[str] = None  # the fleet identity this server joined with (join)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None,
                                       timeout=busy_timeout_s)
            self._db.row_factory = sqlite3.Row
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                for sql in _SCHEMA:
                    self._db.execute(sql)
                have = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
                for old, new in _RENAMED.items():
                    if old in have and new not in have:
                        self._db.execute(f"ALTER TABLE jobs RENAME COLUMN {old} TO {new}")
                        have = (have - {old}) | {new}
                for name, kind in _ADDED_COLUMNS.items():
                    if name not in have:
                        self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
                for sql in _INDEXES:
                    self._db.execute(sql)
        except sqlite3.Error as e:
            raise QueueUnavailable(f"the queue file {self.path} cannot be used: {e}") from None

    def store_describe(self) -> str:
        return str(self.path)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ----- transactions and errors -----
    @staticmethod
    def _failure(e: sqlite3.Error) -> Exception:
        """The store's own failure for a driver's error: busy, unreadable, full (the file may
        answer later), or refused (it never will)."""
        if isinstance(e, sqlite3.OperationalError):
            return QueueUnavailable(f"the queue file is busy, unreadable or full: {e}")
        return StoreRefused(f"the queue file refused the change: {e}")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``: the file's write lock from the start)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise self._failure(e) from None
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as e:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                if isinstance(e, sqlite3.Error):
                    raise self._failure(e) from None
                raise

    def _q(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            try:
                return self._db.execute(sql, args)
            except sqlite3.Error as e:
                raise self._failure(e) from None

    @staticmethod
    def _row(r: sqlite3.Row) -> JobRow:
        return JobRow(id=r["id"], status=JobStatus(r["status"]), spec=json.loads(r["spec"]),
                      created_at=r["created_at"], started_at=r["started_at"], finished_at=r["finished_at"],
                      failures=r["failures"], cancel_requested=bool(r["cancel_requested"]), attempt=r["attempt"],
                      error=r["error"], record=json.loads(r["record"]) if r["record"] else None,
                      deleting=bool(r["deleting"]), pool=r["pool"], identity=r["identity"],
                      idempotency_key=r["idempotency_key"])

    # ----- submit -----
    def job_insert(self, job_id: str, spec: dict[str, Any], max_queued: int, *, pool: Optional[str] = None,
                   idempotency_key: Optional[str] = None, request_hash: Optional[str] = None) -> Added:
        """Queue a job (:class:`QueueFull` when ``max_queued`` wait already); the same id or
        ``idempotency_key`` again gives the stored job (:class:`IdempotencyConflict` when the key
        names another request)."""
        rules.check_storable(spec)
        with self._tx() as db:
            same = db.execute("SELECT * FROM jobs WHERE id = ? OR (? IS NOT NULL AND idempotency_key = ?)",
                              (job_id, idempotency_key, idempotency_key)).fetchone()
            if same is not None:
                if not rules.same_request(same["request_hash"], request_hash):
                    raise IdempotencyConflict(same["id"])
                return Added(self._row(same), created=False)
            (waiting,) = db.execute("SELECT COUNT(*) FROM jobs WHERE status = ? AND pool = ?",
                                    (_QUEUED, pool or self.pool)).fetchone()
            if waiting >= max_queued:
                raise QueueFull(f"{waiting} jobs are queued (the server takes {max_queued})")
            db.execute("INSERT INTO jobs (id, status, spec, created_at, pool, idempotency_key, request_hash) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", (job_id, _QUEUED, json.dumps(spec), time.time(),
                                                        pool or self.pool, idempotency_key, request_hash))
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return Added(self._row(row), created=True)

    # ----- read -----
    def store_ping(self) -> None:
        self._q("SELECT 1").fetchone()

    def job_get(self, job_id: str) -> Optional[JobRow]:
        r = self._q("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return self._row(r) if r else None

    def job_list(self, limit: int = 1000) -> list[JobRow]:
        """The newest ``limit`` jobs, oldest first (none being deleted)."""
        rows = self._q("SELECT * FROM (SELECT * FROM jobs WHERE deleting = 0 ORDER BY seq DESC LIMIT ?) ORDER BY seq",
                       (limit,)).fetchall()
        return [self._row(r) for r in rows]

    def job_page(self, after: Optional[str] = None, limit: int = 20, order: str = "desc") -> tuple[list[JobRow], bool]:
        """One page of jobs (none being deleted) in submission order (``asc``) or newest first
        (``desc``), after the job ``after`` (KeyError: no such job); and whether more follow."""
        limit, desc = rules.page_size(limit), order == "desc"
        with self._lock:
            start = None
            if after is not None:
                r = self._q("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if r is None:
                    raise KeyError(after)
                start = r["seq"]
            where = "deleting = 0" + ("" if start is None else (" AND seq < ?" if desc else " AND seq > ?"))
            rows = self._q(f"SELECT * FROM jobs WHERE {where} ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?",
                           ((start,) if start is not None else ()) + (limit + 1,)).fetchall()
        return [self._row(r) for r in rows[:limit]], len(rows) > limit

    def job_positions(self, job_ids: list[str]) -> dict[str, int]:
        """The 1-based places in their pool's queue of those of ``job_ids`` that are queued, in
        one pass over the queued jobs (the status index), however many are asked."""
        if not job_ids:
            return {}
        marks = ",".join("?" * len(job_ids))
        rows = self._q(f"SELECT id, pos FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY pool ORDER BY seq) AS pos "
                       f"FROM jobs WHERE status = ?) WHERE id IN ({marks})", (_QUEUED, *job_ids)).fetchall()
        return {r[0]: r[1] for r in rows}

    def job_counts(self, pool: Optional[str] = None) -> dict[str, int]:
        """Jobs by status (of ``pool``: of every pool when None)."""
        if pool is None:
            return rules.counts_of(self._q("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())
        return rules.counts_of(self._q("SELECT status, COUNT(*) FROM jobs WHERE pool = ? GROUP BY status",
                                       (pool,)).fetchall())

    def job_known(self, job_ids: list[str]) -> set[str]:
        """Those of ``job_ids`` the store holds (deleting or not)."""
        if not job_ids:
            return set()
        marks = ",".join("?" * len(job_ids))
        return {r[0] for r in self._q(f"SELECT id FROM jobs WHERE id IN ({marks})", tuple(job_ids)).fetchall()}

    def job_list_ended(self) -> list[tuple[str, float]]:
        """(id, finished_at) of every ended job (none being deleted), oldest first."""
        rows = self._q(f"SELECT id, finished_at FROM jobs WHERE status IN ({','.join('?' * len(rules.TERMINAL))}) "
                       "AND deleting = 0 ORDER BY finished_at, seq", rules.TERMINAL).fetchall()
        return [(r[0], r[1] or 0.0) for r in rows]

    # ----- a holder's moves -----
    def job_claim_next(self) -> Optional[JobRow]:
        """The oldest queued job of this server's pool (jobs put back first), now in progress
        under a new attempt."""
        with self._tx() as db:
            r = db.execute(f"SELECT id FROM jobs WHERE status = ? AND pool = ? ORDER BY {rules.CLAIM_ORDER} LIMIT 1",
                           (_QUEUED, self.pool)).fetchone()
            if r is None:
                return None
            db.execute("UPDATE jobs SET status = ?, started_at = COALESCE(started_at, ?), attempt = attempt + 1, "
                       "identity = ? WHERE id = ?", (_RUNNING, time.time(), self.digest, r["id"]))
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (r["id"],)).fetchone()
        return self._row(row)

    def lease_renew(self, running: dict[str, Held]) -> Beat:
        """The ids among ``running`` someone asked to cancel, and those whose attempt is not the
        job's any more (one server: no leases to renew)."""
        asked, lost = set(), set()
        for job_id, held in running.items():
            r = self._q("SELECT status, attempt, cancel_requested FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if r is None or r["status"] != _RUNNING or r["attempt"] != held.attempt:
                lost.add(job_id)
            elif r["cancel_requested"]:
                asked.add(job_id)
        return Beat(cancel=frozenset(asked), lost=frozenset(lost))

    def lease_reap(self) -> Reaped:
        """Nothing: one server's queue has no other server's jobs to take back."""
        return Reaped()

    def store_for_keeper(self, index: int) -> "SqliteJobStore":
        """The store keeper ``index`` claims through (one server's: this one; its keepers never
        share a job, each claim being one transaction)."""
        return self

    def job_finish(self, job_id: str, attempt: int, status: JobStatus, *, error: Optional[str] = None,
                   record: Optional[dict] = None, publish: Optional[Publish] = None) -> bool:
        """End a job this attempt holds, ``publish`` run first inside the transaction; False when
        the attempt is not the job's (nothing published). The same end again is True."""
        with self._tx() as db:
            r = db.execute("SELECT status, attempt FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if r is None or r["attempt"] != attempt:
                return False
            if r["status"] != _RUNNING:
                return r["status"] == status.value  # this end, made before (a repeat)
            if publish is not None:
                publish()
            db.execute("UPDATE jobs SET status = ?, finished_at = ?, error = ?, record = ? WHERE id = ?",
                       (status.value, time.time(), rules.storable_text(error), json.dumps(record) if record else None,
                        job_id))
        return True

    def job_attempt_failed(self, job_id: str, attempt: int, error: str, publish: Optional[Publish] = None) -> JobStatus:
        """The job's rank group failed under it: back to the queue, or failed at
        :data:`~.rules.MAX_FAILURES` (:func:`~.rules.after_group_failure`; then ``publish`` runs
        first, inside the transaction). Returns its status."""
        with self._tx() as db:
            r = db.execute("SELECT status, attempt, failures FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if r is None:
                return JobStatus.FAILED
            if r["attempt"] != attempt or r["status"] != _RUNNING:
                return JobStatus(r["status"])  # not this holder's to decide
            status, why = rules.after_group_failure(r["failures"] + 1, error)
            if status.terminal and publish is not None:
                publish()
            db.execute("UPDATE jobs SET failures = failures + 1, error = ?, status = ?, finished_at = ? WHERE id = ?",
                       (rules.storable_text(why or error), status.value, time.time() if status.terminal else None,
                        job_id))
        return status

    # ----- the API's moves -----
    def job_cancel(self, job_id: str) -> Optional[JobStatus]:
        """Cancel a job: a queued one is cancelled at once; a running one is marked (its holder
        stops it at the next step). Returns its status after, None if there is no such job."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET status = ?, finished_at = ? WHERE id = ? AND status = ?",
                       (JobStatus.CANCELLED.value, time.time(), job_id, _QUEUED))
            db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND status = ?", (job_id, _RUNNING))
            r = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobStatus(r["status"]) if r else None

    def job_delete(self, job_id: str) -> Optional[JobStatus]:
        """Delete a job: one that is not running is gone at once (its row; its files are the
        caller's); a running one is cancelled and marked ``deleting`` (gone for the API; its
        holder removes it when it ends). Returns its status before, None if there is no such job."""
        with self._tx() as db:
            r = db.execute("SELECT status FROM jobs WHERE id = ? AND deleting = 0", (job_id,)).fetchone()
            if r is None:
                return None
            status = JobStatus(r["status"])
            if status is JobStatus.IN_PROGRESS:
                db.execute("UPDATE jobs SET deleting = 1, cancel_requested = 1 WHERE id = ?", (job_id,))
            else:
                db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        return status

    def job_remove(self, job_id: str) -> None:
        """The row goes (a job marked ``deleting``, once it ended)."""
        self._q("DELETE FROM jobs WHERE id = ?", (job_id,))

    # ----- start -----
    def job_purge_deleting(self) -> list[str]:
        """After a restart: the jobs deleted while they ran go (their files are the caller's)."""
        with self._tx() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE deleting = 1").fetchall()]
            db.execute("DELETE FROM jobs WHERE deleting = 1")
        return ids

    def job_recover(self) -> list[str]:
        """After a restart: jobs left in progress go back to the queue (first in line)."""
        with self._tx() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE status = ?", (_RUNNING,)).fetchall()]
            db.execute("UPDATE jobs SET status = ? WHERE status = ?", (_QUEUED, _RUNNING))
        return ids

    def pool_join(self, digest: str, identity: dict[str, Any], who: str) -> Joined:
        """This server joins its pool (:class:`~.protocol.Joined`): the fleet made on the first
        join, the pool's identity recorded by the first server of the pool."""
        with self._tx() as db:
            fleet = db.execute("SELECT id, marked FROM fleet").fetchone()
            created_fleet = fleet is None
            if created_fleet:
                fleet_id = uuid.uuid4().hex
                db.execute("INSERT INTO fleet (id, marked, created_at) VALUES (?, 0, ?)", (fleet_id, time.time()))
                marked = False
            else:
                fleet_id, marked = fleet["id"], bool(fleet["marked"])
            r = db.execute("SELECT * FROM pools WHERE name = ?", (self.pool,)).fetchone()
            created_pool = r is None
            if created_pool:
                db.execute("INSERT INTO pools (name, digest, identity, joined_by, joined_at) VALUES (?, ?, ?, ?, ?)",
                           (self.pool, digest, json.dumps(identity), who, time.time()))
                r = db.execute("SELECT * FROM pools WHERE name = ?", (self.pool,)).fetchone()
        pool = PoolIdentity(r["name"], r["digest"], json.loads(r["identity"]), r["joined_by"], r["joined_at"])
        if pool.digest == digest:
            self.digest = digest
        return Joined(fleet_id, created_fleet, marked, pool, created_pool)

    def fleet_mark(self, fleet_id: str) -> None:
        """The shared directory's marker is written (a later server finds it, or is refused)."""
        self._q("UPDATE fleet SET marked = 1 WHERE id = ?", (fleet_id,))

    def pool_reset(self, digest: str, identity: dict[str, Any], who: str) -> None:
        """This server's identity becomes its pool's (only when the pool holds no job that waits
        or runs: the caller checks)."""
        self._q("UPDATE pools SET digest = ?, identity = ?, joined_by = ?, joined_at = ? WHERE name = ?",
                (digest, json.dumps(identity), who, time.time(), self.pool))
        self.digest = digest

    def pool_list(self) -> dict[str, str]:
        return {r[0]: r[1] for r in self._q("SELECT name, digest FROM pools").fetchall()}
