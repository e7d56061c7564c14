"""The :class:`~.queue.JobStore` several servers share: one PostgreSQL database
(``wan-s2v serve --queue postgresql://...``), through psycopg 3.

Any number of servers on any machines use it at once. Each accepts submissions and answers for
every job; each keeper claims the next queued job under a row lock (``FOR UPDATE SKIP LOCKED``:
two keepers never take the same row, and never wait on each other) and holds it with a lease
(``lease_until``; every time in the table is the database's clock) that its heartbeat renews
every few seconds, storing the job's live progress in the row for the other servers to show. A
server that dies (kill -9, its machine gone) renews nothing: within ``--lease-s`` its jobs'
leases run out and any server puts them back in the queue (:meth:`PgJobQueue.reap`), first in
line, where the next keeper resumes each from its last clip checkpoint in the shared directory.
Only the owner of a job's lease can end it (:meth:`finish` names the owner), so no job completes
twice, even when a server that was presumed dead comes back.

The schema is created and migrated at start (``wan_s2v_schema``: one row, its version; each
migration runs once, in order, under an advisory lock, so servers starting together do not race).
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from wan_s2v_runner.launcher.serve.queue import MAX_FAILURES, PAGE_MAX, Beat, JobRow, JobStatus, QueueFull, Reaped

#: the advisory lock keys: migrations; the queue's length check
_MIGRATE_LOCK, _ADD_LOCK = 7_300_001, 7_300_002
SCHEMA_VERSION = 1
#: version -> the statements that take the schema from version - 1 to it
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("""CREATE TABLE jobs (
            seq BIGSERIAL PRIMARY KEY,
            id TEXT UNIQUE NOT NULL,
            status TEXT NOT NULL,
            spec JSONB NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION,
            finished_at DOUBLE PRECISION,
            failures INTEGER NOT NULL DEFAULT 0,
            cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
            runs INTEGER NOT NULL DEFAULT 0,
            error TEXT,
            record JSONB,
            deleting BOOLEAN NOT NULL DEFAULT FALSE,
            owner TEXT,
            lease_until DOUBLE PRECISION,
            progress JSONB)""",
        "CREATE INDEX jobs_status_seq ON jobs (status, seq)",
        "CREATE INDEX jobs_lease ON jobs (lease_until) WHERE status = 'in_progress'"),
}
_NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
_QUEUED, _RUNNING = JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value
_TERMINAL = tuple(s.value for s in JobStatus if s.terminal)


def _row(r: dict[str, Any]) -> JobRow:
    return JobRow(id=r["id"], status=JobStatus(r["status"]), spec=r["spec"], created_at=r["created_at"],
                  started_at=r["started_at"], finished_at=r["finished_at"], failures=r["failures"],
                  cancel_requested=r["cancel_requested"], runs=r["runs"], error=r["error"], record=r["record"],
                  deleting=r["deleting"], progress=r["progress"] if r["status"] == _RUNNING else None)


class PgJobQueue:
    """The :class:`~.queue.JobStore` in PostgreSQL (see the module's docstring). ``owner`` names
    this server in the leases it holds: the same server started again (same host and server
    directory) takes its own jobs back at once instead of waiting for their leases; ``lease_s``:
    how long its hold on a running job lasts without a heartbeat (``--lease-s``, whose default is
    the one place for it)."""

    shared = True  # other servers use it too: nothing in it is this server's alone

    def __init__(self, url: str, owner: str, lease_s: float, migrate: bool = True):
        self.url, self.owner, self.lease_s = url, owner, float(lease_s)
        self._lock = threading.RLock()
        self._db = self._connect()
        if migrate:
            self.migrate()

    def _connect(self):
        import psycopg
        from psycopg.rows import dict_row

        return psycopg.connect(self.url, autocommit=True, row_factory=dict_row)

    def _again(self, op):
        """``op()``; once more on a new connection when the old one is gone (the database
        restarted or failed over): a server outlives its database's restarts."""
        import psycopg

        try:
            return op()
        except (psycopg.OperationalError, psycopg.InterfaceError):
            with self._lock:
                if not self._db.closed and not self._db.broken:
                    raise
                self._db = self._connect()
            return op()

    def for_keeper(self, index: int) -> "PgJobQueue":
        """The store keeper ``index`` claims through: its own connection and its own name in the
        leases (``OWNER#index``), so two groups of one server never both hold a job."""
        return PgJobQueue(self.url, f"{self.owner}#{index}", self.lease_s, migrate=False)

    # ----- schema -----
    def migrate(self) -> int:
        """Create or bring the schema up to :data:`SCHEMA_VERSION`; the version it is at."""
        with self._lock, self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
            self._db.execute("CREATE TABLE IF NOT EXISTS wan_s2v_schema (version INTEGER NOT NULL)")
            r = self._db.execute("SELECT version FROM wan_s2v_schema").fetchone()
            version = r["version"] if r else 0
            if r is None:
                self._db.execute("INSERT INTO wan_s2v_schema (version) VALUES (0)")
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"the queue's schema is version {version}; this wan-s2v knows up to "
                                   f"{SCHEMA_VERSION}. Fix: upgrade wan-s2v on this server")
            for v in range(version + 1, SCHEMA_VERSION + 1):
                for sql in MIGRATIONS[v]:
                    self._db.execute(sql)
                self._db.execute("UPDATE wan_s2v_schema SET version = %s", (v,))
        return SCHEMA_VERSION

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _all(self, sql: str, args: tuple = ()) -> list[dict]:
        def op():
            with self._lock:
                return self._db.execute(sql, args).fetchall()
        return self._again(op)

    def _one(self, sql: str, args: tuple = ()) -> Optional[dict]:
        def op():
            with self._lock:
                return self._db.execute(sql, args).fetchone()
        return self._again(op)

    def _count(self, sql: str, args: tuple = ()) -> int:
        """Rows an UPDATE or DELETE changed."""
        def op():
            with self._lock:
                return self._db.execute(sql, args).rowcount
        return self._again(op)

    # ----- submit -----
    def add(self, job_id: str, spec: dict[str, Any], max_queued: int) -> None:
        from psycopg.types.json import Jsonb

        def op():
            with self._lock, self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_ADD_LOCK,))
                (waiting,) = self._db.execute("SELECT COUNT(*) AS n FROM jobs WHERE status = %s",
                                              (_QUEUED,)).fetchone().values()
                if waiting >= max_queued:
                    raise QueueFull(f"{waiting} jobs are queued (the server takes {max_queued})")
                self._db.execute(f"INSERT INTO jobs (id, status, spec, created_at) VALUES (%s, %s, %s, {_NOW})",
                                 (job_id, _QUEUED, Jsonb(spec)))
        self._again(op)

    # ----- read -----
    def get(self, job_id: str) -> Optional[JobRow]:
        r = self._one("SELECT * FROM jobs WHERE id = %s", (job_id,))
        return _row(r) if r else None

    def all(self, limit: int = 1000) -> list[JobRow]:
        rows = self._all("SELECT * FROM (SELECT * FROM jobs WHERE NOT deleting ORDER BY seq DESC LIMIT %s) t "
                         "ORDER BY seq", (limit,))
        return [_row(r) for r in rows]

    def page(self, after: Optional[str] = None, limit: int = 20, order: str = "desc") -> tuple[list[JobRow], bool]:
        limit = max(1, min(int(limit), PAGE_MAX))
        desc = order == "desc"
        start = None
        if after is not None:
            r = self._one("SELECT seq FROM jobs WHERE id = %s", (after,))
            if r is None:
                raise KeyError(after)
            start = r["seq"]
        where = "NOT deleting" + ("" if start is None else (" AND seq < %s" if desc else " AND seq > %s"))
        rows = self._all(f"SELECT * FROM jobs WHERE {where} ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT %s",
                         ((start,) if start is not None else ()) + (limit + 1,))
        return [_row(r) for r in rows[:limit]], len(rows) > limit

    def position(self, job_id: str) -> Optional[int]:
        return self.positions([job_id]).get(job_id)

    def positions(self, job_ids: list[str]) -> dict[str, int]:
        if not job_ids:
            return {}
        rows = self._all("SELECT id, pos FROM (SELECT id, ROW_NUMBER() OVER (ORDER BY seq) AS pos FROM jobs "
                         "WHERE status = %s) t WHERE id = ANY(%s)", (_QUEUED, list(job_ids)))
        return {r["id"]: r["pos"] for r in rows}

    def counts(self) -> dict[str, int]:
        rows = self._all("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
        return {s.value: 0 for s in JobStatus} | {r["status"]: r["n"] for r in rows}

    def ended(self) -> list[tuple[str, float]]:
        rows = self._all("SELECT id, finished_at FROM jobs WHERE status = ANY(%s) AND NOT deleting "
                         "ORDER BY finished_at, seq", (list(_TERMINAL),))
        return [(r["id"], r["finished_at"] or 0.0) for r in rows]

    # ----- the keepers' moves -----
    def claim_next(self) -> Optional[JobRow]:
        """The oldest queued job (jobs put back first), now this server's, under a lease."""
        r = self._one(f"UPDATE jobs SET status = %s, owner = %s, lease_until = {_NOW} + %s, "
                      f"started_at = COALESCE(started_at, {_NOW}), runs = runs + 1, progress = NULL "
                      "WHERE id = (SELECT id FROM jobs WHERE status = %s ORDER BY started_at IS NULL, seq "
                      "FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING *",
                      (_RUNNING, self.owner, self.lease_s, _QUEUED))
        return _row(r) if r else None

    def heartbeat(self, running: dict[str, Optional[dict]]) -> Beat:
        """Renew this holder's leases on ``running`` (job id -> its live progress, stored for the
        other servers): the ids among them someone asked to cancel, and those it no longer holds
        (its lease ran out and another server took the job)."""
        from psycopg.types.json import Jsonb

        asked, lost = set(), set()
        for job_id, live in running.items():
            r = self._one(f"UPDATE jobs SET lease_until = {_NOW} + %s, progress = %s WHERE id = %s AND owner = %s "
                          "AND status = %s RETURNING cancel_requested",
                          (self.lease_s, Jsonb(live) if live else None, job_id, self.owner, _RUNNING))
            if r is None:
                lost.add(job_id)
            elif r["cancel_requested"]:
                asked.add(job_id)
        return Beat(cancel=frozenset(asked), lost=frozenset(lost))

    def reap(self) -> Reaped:
        """Jobs whose holder's lease ran out (its server died, or lost the database) back to the
        queue, first in line: they resume from their clip checkpoints wherever they are taken
        next. Those that were being deleted (and rows a dead server left marked deleting) go: their
        files are the caller's to remove."""
        rows = self._all(f"UPDATE jobs SET status = %s, owner = NULL, lease_until = NULL, progress = NULL "
                         f"WHERE status = %s AND lease_until < {_NOW} AND NOT deleting RETURNING id",
                         (_QUEUED, _RUNNING))
        gone = self._all(f"DELETE FROM jobs WHERE deleting AND (status <> %s OR lease_until < {_NOW}) RETURNING id",
                         (_RUNNING,))
        return Reaped(tuple(r["id"] for r in rows), tuple(r["id"] for r in gone))

    def finish(self, job_id: str, status: JobStatus, *, error: Optional[str] = None,
               record: Optional[dict] = None) -> bool:
        """End a job this holder holds; False when it does not (its lease ran out and another
        server took the job: the end is not ours to record, nor its files ours to remove)."""
        from psycopg.types.json import Jsonb

        return self._count(f"UPDATE jobs SET status = %s, finished_at = {_NOW}, error = %s, record = %s, "
                           "lease_until = NULL, progress = NULL WHERE id = %s AND owner = %s AND status = %s",
                           (status.value, error, Jsonb(record) if record else None, job_id,
                            self.owner, _RUNNING)) == 1

    def group_failed(self, job_id: str, error: str) -> JobStatus:
        r = self._one("UPDATE jobs SET failures = failures + 1, error = %s WHERE id = %s AND owner = %s "
                      "RETURNING failures", (error, job_id, self.owner))
        if r is None:  # not ours any more: its new holder decides
            row = self.get(job_id)
            return row.status if row else JobStatus.FAILED
        if r["failures"] >= MAX_FAILURES:
            self.finish(job_id, JobStatus.FAILED,
                        error=f"the rank group failed {r['failures']} times on this job; last: {error}")
            return JobStatus.FAILED
        self._one("UPDATE jobs SET status = %s, owner = NULL, lease_until = NULL, progress = NULL "
                  "WHERE id = %s AND status = %s AND owner = %s RETURNING id", (_QUEUED, job_id, _RUNNING, self.owner))
        return JobStatus.QUEUED

    def cancel(self, job_id: str) -> Optional[JobStatus]:
        def op():
            with self._lock, self._db.transaction():
                self._db.execute(f"UPDATE jobs SET status = %s, finished_at = {_NOW} WHERE id = %s AND status = %s",
                                 (JobStatus.CANCELLED.value, job_id, _QUEUED))
                self._db.execute("UPDATE jobs SET cancel_requested = TRUE WHERE id = %s AND status = %s",
                                 (job_id, _RUNNING))
        self._again(op)
        row = self.get(job_id)
        return row.status if row else None

    def delete(self, job_id: str) -> Optional[JobStatus]:
        def op():
            with self._lock, self._db.transaction():
                r = self._db.execute("SELECT status FROM jobs WHERE id = %s AND NOT deleting FOR UPDATE",
                                     (job_id,)).fetchone()
                if r is None:
                    return None
                status = JobStatus(r["status"])
                if status is JobStatus.IN_PROGRESS:
                    self._db.execute("UPDATE jobs SET deleting = TRUE, cancel_requested = TRUE WHERE id = %s",
                                     (job_id,))
                else:
                    self._db.execute("DELETE FROM jobs WHERE id = %s", (job_id,))
                return status
        return self._again(op)

    def remove(self, job_id: str) -> None:
        self._one("DELETE FROM jobs WHERE id = %s RETURNING id", (job_id,))

    def purge_deleting(self) -> list[str]:
        """After a restart: this server's jobs (any of its keepers') deleted while they ran go
        (others' are theirs)."""
        return [r["id"] for r in self._all("DELETE FROM jobs WHERE deleting AND (owner = %s OR owner LIKE %s) "
                                           "RETURNING id", (self.owner, f"{self.owner}#%"))]

    def recover(self) -> list[str]:
        """After a restart: this server's jobs (any of its keepers') left in progress go back to
        the queue at once (no need to wait for their leases)."""
        rows = self._all("UPDATE jobs SET status = %s, owner = NULL, lease_until = NULL, progress = NULL "
                         "WHERE status = %s AND (owner = %s OR owner LIKE %s) AND NOT deleting RETURNING id",
                         (_QUEUED, _RUNNING, self.owner, f"{self.owner}#%"))
        return [r["id"] for r in rows]


def describe(url: str) -> str:
    """A queue URL without its password (for the log)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url

