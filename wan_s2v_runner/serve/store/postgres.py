"""The :class:`~.protocol.JobStore` several servers share: one PostgreSQL database
(``wan-s2v serve --queue postgresql://...``), through psycopg 3 and its connection pool.

Any number of servers on any machines use it at once. Each accepts submissions and answers for
every job; each keeper claims the next queued job of its pool under a row lock (``FOR UPDATE
SKIP LOCKED``: two keepers never take the same row, and never wait on each other), which makes
the job's ``attempt`` grow by one, and holds it with a lease (``lease_until``; every time in the
table is the database's clock) that its heartbeat renews every few seconds, storing the job's
live progress in the row for the other servers to show. A server that dies (kill -9, its
machine gone, a VM frozen past its lease) renews nothing: within ``--lease-s`` its jobs' leases
run out and any server puts them back in the queue (:meth:`PgJobStore.lease_reap`), first in line,
where the next keeper resumes each from its newest clip checkpoint in the shared directory.

Every write of a holder names the attempt it was given (its fencing token) and the row decides:
a heartbeat, an end, a failure of a stale attempt changes nothing, and :meth:`job_finish` moves the
job's files into place (its ``publish``) only inside the transaction that holds the row locked
with the token checked (the publish itself checks, before each file, that the holder's lease is
still sure: a holder frozen mid-publish, whose connection the database dropped, moves nothing
when it wakes). A lost connection (the database restarted or failed over) costs the request in
flight a :class:`~.protocol.QueueUnavailable`; the pool opens new connections, and what is safe
to repeat is repeated once (reads, an insert by its id, an end by its attempt). A claim is not
repeated: the next claim first looks for the one that may have landed (its ``claim_id``) and
renews its lease. What a DELETE returned is lost with a lost answer (the reap's and the restart's
purges are not repeated); the files of rows gone that way are swept as orphans
(:func:`~..retention.sweep_orphans`). Connections are kept alive on both sides (TCP keepalives,
and a limit on unacknowledged data), so a database behind a network that drops packets is
found out in seconds, not when the kernel gives up.

The API's connections come from a pool of their own (:data:`API_POOL`); each keeper has its own
connection (:meth:`store_for_keeper`). The schema is created and migrated at start (``wan_s2v_schema``:
one row, its version; each migration runs once, in order, under an advisory lock, so servers
starting together do not race).
"""
from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TypeVar

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

T = TypeVar("T")
#: the advisory lock keys: migrations; the queue's length check; the fleet's first join
_MIGRATE_LOCK, _ADD_LOCK, _JOIN_LOCK = 7_300_001, 7_300_002, 7_300_003
SCHEMA_VERSION = 2
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
    # fencing (the attempt), pools and the fleet's identity, idempotent submissions, reconciled claims
    2: ("ALTER TABLE jobs RENAME COLUMN runs TO attempt",
        "ALTER TABLE jobs ADD COLUMN pool TEXT NOT NULL DEFAULT 'default'",
        "ALTER TABLE jobs ADD COLUMN identity TEXT",
        "ALTER TABLE jobs ADD COLUMN idempotency_key TEXT",
        "ALTER TABLE jobs ADD COLUMN request_hash TEXT",
        "ALTER TABLE jobs ADD COLUMN claim_id TEXT",
        "DROP INDEX jobs_status_seq",
        "CREATE INDEX jobs_pool_status_seq ON jobs (pool, status, seq)",
        "CREATE UNIQUE INDEX jobs_idempotency ON jobs (idempotency_key) WHERE idempotency_key IS NOT NULL",
        "CREATE INDEX jobs_claim ON jobs (claim_id) WHERE claim_id IS NOT NULL",
        "CREATE TABLE fleet (id TEXT NOT NULL, marked BOOLEAN NOT NULL DEFAULT FALSE, "
        "created_at DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE pools (name TEXT PRIMARY KEY, digest TEXT NOT NULL, identity JSONB NOT NULL, "
        "joined_by TEXT NOT NULL, joined_at DOUBLE PRECISION NOT NULL)"),
}
_NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
#: a row held by this server or any of its keepers (rules.holder_of: OWNER#i), whatever its name holds
_MINE = "(owner = %s OR left(owner, length(%s) + 1) = %s || '#')"
_QUEUED, _RUNNING = JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value
#: the API's connections: at most this many at once (the rest of its threads wait up to POOL_WAIT_S)
API_POOL = 8
#: seconds a request waits for a connection, and to connect, before it is told the queue is unavailable
POOL_WAIT_S = 2.0
CONNECT_TIMEOUT_S = 2
#: how long the pool tries to replace a lost connection (backing off 1, 2, ... s) before it leaves the
#: next try to the next request: short, so the queue is back within seconds of the database
RECONNECT_S = 4.0
#: every statement's limit, and a lock's (a row held by a holder paused mid-end: the request is told, not stuck)
STATEMENT_TIMEOUT_MS, LOCK_TIMEOUT_MS = 10_000, 3_000
#: libpq's side of a connection: keepalives (idle, interval, count) and the most unacknowledged data waits, ms
CLIENT_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
                    "tcp_user_timeout": 30_000}


def _row(r: dict[str, Any]) -> JobRow:
    return JobRow(id=r["id"], status=JobStatus(r["status"]), spec=r["spec"], created_at=r["created_at"],
                  started_at=r["started_at"], finished_at=r["finished_at"], failures=r["failures"],
                  cancel_requested=r["cancel_requested"], attempt=r["attempt"], error=r["error"], record=r["record"],
                  deleting=r["deleting"], progress=r["progress"] if r["status"] == _RUNNING else None,
                  pool=r["pool"], identity=r["identity"], idempotency_key=r["idempotency_key"])


def describe(url: str) -> str:
    """A queue URL without its password (for the log and the shared directory's marker)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _cause(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return f"the queue's database does not answer ({type(e).__name__}: {first})"


class PgJobStore:
    """The :class:`~.protocol.JobStore` in PostgreSQL (see the module's docstring). ``owner``
    names this server in the leases it holds: the same server started again (same host and server
    directory) takes its own jobs back at once instead of waiting for their leases; ``lease_s``:
    how long its hold on a running job lasts without a heartbeat (``--lease-s``, whose default is
    the one place for it); ``connections``: the most it opens at once."""

    shared = True  # other servers use it too: nothing in it is this server's alone

    def __init__(self, url: str, owner: str, lease_s: float, pool: str = DEFAULT_POOL, *, connections: int = API_POOL,
                 migrate: bool = True, wait: bool = True):
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        self.url, self.owner, self.lease_s, self.pool = url, owner, float(lease_s), pool
        self.digest: Optional[str] = None  # the fleet identity this server joined with (join)
        self._unsure_claim: Optional[str] = None  # a claim whose answer was lost (reconciled at the next)
        self._claim_lock = threading.Lock()
        options = (f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c lock_timeout={LOCK_TIMEOUT_MS} "
                   "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3")
        self._pool = ConnectionPool(url, min_size=1, max_size=connections, timeout=POOL_WAIT_S, open=False,
                                    check=ConnectionPool.check_connection, name=f"wan-s2v {owner}",
                                    reconnect_timeout=RECONNECT_S,
                                    kwargs={"autocommit": True, "row_factory": dict_row, "options": options,
                                            "connect_timeout": CONNECT_TIMEOUT_S, **CLIENT_KEEPALIVE})
        try:
            self._pool.open(wait=wait, timeout=POOL_WAIT_S + CONNECT_TIMEOUT_S)
            if migrate:
                self.migrate()
        except BaseException:
            self._pool.close(timeout=0)
            raise

    def store_describe(self) -> str:
        return describe(self.url)

    def store_for_keeper(self, index: int) -> "PgJobStore":
        """The store keeper ``index`` claims through: its own connection and its own name in the
        leases (:func:`~.rules.holder_of`), its server's identity."""
        store = PgJobStore(self.url, rules.holder_of(self.owner, index), self.lease_s, self.pool, connections=1,
                           migrate=False, wait=False)
        store.digest = self.digest
        return store

    def close(self) -> None:
        self._pool.close(timeout=5)

    # ----- connections and errors -----
    def _run(self, op: Callable[[Any], T], *, repeat: bool) -> T:
        """``op(connection)``; the database's failures as :class:`QueueUnavailable`. ``repeat``:
        ``op`` is safe to make twice (it reads, or its write is recognised when it landed), so a
        connection lost under it is replaced and ``op`` made once more."""
        import psycopg
        from psycopg_pool import PoolTimeout

        tries = 2 if repeat else 1
        for attempt in range(tries):
            try:
                with self._pool.connection() as conn:
                    return op(conn)
            except PoolTimeout as e:  # no connection could be had: another try would wait as long for nothing
                raise QueueUnavailable(_cause(e)) from None
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:  # gone, timed out, locked: may pass
                if attempt + 1 == tries:
                    raise QueueUnavailable(_cause(e)) from None
            except psycopg.Error as e:  # it answered and refused: another try would be refused too
                text = str(e).strip()
                raise StoreRefused(f"the queue's database refused it ({type(e).__name__}: "
                                   f"{text.splitlines()[0] if text else ''})") from None
        raise AssertionError("unreachable")

    @contextmanager
    def _tx(self, conn) -> Iterator[Any]:
        with conn.transaction():
            yield conn

    def _all(self, sql: str, args: tuple = ()) -> list[dict]:
        return self._run(lambda c: c.execute(sql, args).fetchall(), repeat=True)

    def _one(self, sql: str, args: tuple = (), *, repeat: bool = True) -> Optional[dict]:
        return self._run(lambda c: c.execute(sql, args).fetchone(), repeat=repeat)

    def _changed(self, sql: str, args: tuple = ()) -> list[dict]:
        """The rows a write RETURNING changed; not repeated (a repeat after a lost answer would
        return nothing of what the first did)."""
        return self._run(lambda c: c.execute(sql, args).fetchall(), repeat=False)

    # ----- schema -----
    def migrate(self) -> int:
        """Create or bring the schema up to :data:`SCHEMA_VERSION`; the version it is at."""
        def op(conn):
            with self._tx(conn):
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
                conn.execute("CREATE TABLE IF NOT EXISTS wan_s2v_schema (version INTEGER NOT NULL)")
                r = conn.execute("SELECT version FROM wan_s2v_schema").fetchone()
                version = r["version"] if r else 0
                if r is None:
                    conn.execute("INSERT INTO wan_s2v_schema (version) VALUES (0)")
                if version > SCHEMA_VERSION:
                    return version
                for v in range(version + 1, SCHEMA_VERSION + 1):
                    for sql in MIGRATIONS[v]:
                        conn.execute(sql)
                    conn.execute("UPDATE wan_s2v_schema SET version = %s", (v,))
                return SCHEMA_VERSION
        version = self._run(op, repeat=True)
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"the queue's schema is version {version}; this wan-s2v knows up to "
                               f"{SCHEMA_VERSION}. Fix: upgrade wan-s2v on this server")
        return version

    # ----- submit -----
    def job_insert(self, job_id: str, spec: dict[str, Any], max_queued: int, *, pool: Optional[str] = None,
                   idempotency_key: Optional[str] = None, request_hash: Optional[str] = None) -> Added:
        from psycopg.types.json import Jsonb

        rules.check_storable(spec)

        def op(conn):  # made again after a lost answer: the row of this id (or key) is found, not doubled
            with self._tx(conn):
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADD_LOCK,))
                same = conn.execute("SELECT * FROM jobs WHERE id = %s OR (%s::text IS NOT NULL AND "
                                    "idempotency_key = %s)", (job_id, idempotency_key, idempotency_key)).fetchone()
                if same is not None:
                    if not rules.same_request(same["request_hash"], request_hash):
                        raise IdempotencyConflict(same["id"])
                    return Added(_row(same), created=False)
                (waiting,) = conn.execute("SELECT COUNT(*) AS n FROM jobs WHERE status = %s AND pool = %s",
                                          (_QUEUED, pool or self.pool)).fetchone().values()
                if waiting >= max_queued:
                    raise QueueFull(f"{waiting} jobs are queued (the server takes {max_queued})")
                r = conn.execute(f"INSERT INTO jobs (id, status, spec, created_at, pool, idempotency_key, "
                                 f"request_hash) VALUES (%s, %s, %s, {_NOW}, %s, %s, %s) RETURNING *",
                                 (job_id, _QUEUED, Jsonb(spec), pool or self.pool, idempotency_key,
                                  request_hash)).fetchone()
                return Added(_row(r), created=True)
        return self._run(op, repeat=True)

    # ----- read -----
    def store_ping(self) -> None:
        self._one("SELECT 1 AS one")

    def job_get(self, job_id: str) -> Optional[JobRow]:
        r = self._one("SELECT * FROM jobs WHERE id = %s", (job_id,))
        return _row(r) if r else None

    def job_list(self, limit: int = 1000) -> list[JobRow]:
        rows = self._all("SELECT * FROM (SELECT * FROM jobs WHERE NOT deleting ORDER BY seq DESC LIMIT %s) t "
                         "ORDER BY seq", (limit,))
        return [_row(r) for r in rows]

    def job_page(self, after: Optional[str] = None, limit: int = 20, order: str = "desc") -> tuple[list[JobRow], bool]:
        limit, desc = rules.page_size(limit), order == "desc"
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

    def job_positions(self, job_ids: list[str]) -> dict[str, int]:
        if not job_ids:
            return {}
        rows = self._all("SELECT id, pos FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY pool ORDER BY seq) AS pos "
                         "FROM jobs WHERE status = %s) t WHERE id = ANY(%s)", (_QUEUED, list(job_ids)))
        return {r["id"]: r["pos"] for r in rows}

    def job_counts(self, pool: Optional[str] = None) -> dict[str, int]:
        if pool is None:
            rows = self._all("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
        else:
            rows = self._all("SELECT status, COUNT(*) AS n FROM jobs WHERE pool = %s GROUP BY status", (pool,))
        return rules.counts_of((r["status"], r["n"]) for r in rows)

    def job_known(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        return {r["id"] for r in self._all("SELECT id FROM jobs WHERE id = ANY(%s)", (list(job_ids),))}

    def job_list_ended(self) -> list[tuple[str, float]]:
        rows = self._all("SELECT id, finished_at FROM jobs WHERE status = ANY(%s) AND NOT deleting "
                         "ORDER BY finished_at, seq", (list(rules.TERMINAL),))
        return [(r["id"], r["finished_at"] or 0.0) for r in rows]

    # ----- the keepers' moves -----
    def job_claim_next(self) -> Optional[JobRow]:
        """The oldest queued job of this server's pool (jobs put back first), now this holder's
        under a new attempt and a lease. A claim whose answer was lost is not made again: the next
        call returns the job it took, if it took one."""
        with self._claim_lock:
            if self._unsure_claim is not None:  # found again, its lease renewed from now (it dates from the claim)
                r = self._one(f"UPDATE jobs SET lease_until = {_NOW} + %s WHERE claim_id = %s AND owner = %s AND "
                              "status = %s RETURNING *", (self.lease_s, self._unsure_claim, self.owner, _RUNNING))
                self._unsure_claim = None
                if r is not None:
                    return _row(r)
            claim = uuid.uuid4().hex
            try:
                r = self._one(f"UPDATE jobs SET status = %s, owner = %s, lease_until = {_NOW} + %s, "
                              f"started_at = COALESCE(started_at, {_NOW}), attempt = attempt + 1, progress = NULL, "
                              f"identity = %s, claim_id = %s WHERE id = (SELECT id FROM jobs WHERE status = %s AND "
                              f"pool = %s ORDER BY {rules.CLAIM_ORDER} FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING *",
                              (_RUNNING, self.owner, self.lease_s, self.digest, claim, _QUEUED, self.pool),
                              repeat=False)
            except QueueUnavailable:
                self._unsure_claim = claim
                raise
        return _row(r) if r else None

    def lease_renew(self, running: dict[str, Held]) -> Beat:
        """Renew this holder's leases on ``running`` (job id -> its attempt and live progress,
        stored for the other servers): the ids among them someone asked to cancel, and those whose
        attempt is not the job's any more (the lease ran out and the job was reaped or taken)."""
        from psycopg.types.json import Jsonb

        def op(conn):
            asked, lost = set(), set()
            for job_id, held in running.items():
                r = conn.execute(f"UPDATE jobs SET lease_until = {_NOW} + %s, progress = %s WHERE id = %s AND "
                                 "owner = %s AND attempt = %s AND status = %s RETURNING cancel_requested",
                                 (self.lease_s, Jsonb(held.progress) if held.progress else None, job_id, self.owner,
                                  held.attempt, _RUNNING)).fetchone()
                if r is None:
                    lost.add(job_id)
                elif r["cancel_requested"]:
                    asked.add(job_id)
            return Beat(cancel=frozenset(asked), lost=frozenset(lost))
        return self._run(op, repeat=True)

    def lease_reap(self) -> Reaped:
        """Jobs whose holder's lease ran out (its server died, froze, or lost the database) back to
        the queue, first in line: they resume from their clip checkpoints wherever they are taken
        next. Those that were being deleted (and rows a dead server left marked deleting) go: their
        files are the caller's to remove. A row a holder has locked (it is ending the job) is left."""
        rows = self._changed(f"UPDATE jobs SET status = %s, owner = NULL, lease_until = NULL, progress = NULL WHERE "
                             f"id IN (SELECT id FROM jobs WHERE status = %s AND lease_until < {_NOW} AND NOT deleting "
                             "FOR UPDATE SKIP LOCKED) RETURNING id", (_QUEUED, _RUNNING))
        gone = self._changed(f"DELETE FROM jobs WHERE id IN (SELECT id FROM jobs WHERE deleting AND (status <> %s OR "
                             f"lease_until < {_NOW}) FOR UPDATE SKIP LOCKED) RETURNING id", (_RUNNING,))
        return Reaped(tuple(r["id"] for r in rows), tuple(r["id"] for r in gone))

    def job_finish(self, job_id: str, attempt: int, status: JobStatus, *, error: Optional[str] = None,
                   record: Optional[dict] = None, publish: Optional[Publish] = None) -> bool:
        """End a job this holder holds under ``attempt``, ``publish`` run first inside the
        transaction that holds the row locked; False when the attempt is not the job's any more
        (nothing published: the end, and the files, are the new holder's). The same end again is
        True (a repeat after a lost answer)."""
        from psycopg.types.json import Jsonb

        def op(conn):
            with self._tx(conn):
                r = conn.execute("SELECT status, attempt, owner FROM jobs WHERE id = %s FOR UPDATE",
                                 (job_id,)).fetchone()
                if r is None or r["attempt"] != attempt or r["owner"] != self.owner:
                    return False
                if r["status"] != _RUNNING:
                    return r["status"] == status.value
                if publish is not None:
                    publish()
                conn.execute(f"UPDATE jobs SET status = %s, finished_at = {_NOW}, error = %s, record = %s, "
                             "lease_until = NULL, progress = NULL WHERE id = %s",
                             (status.value, rules.storable_text(error), Jsonb(record) if record else None, job_id))
                return True
        return self._run(op, repeat=True)

    def job_attempt_failed(self, job_id: str, attempt: int, error: str, publish: Optional[Publish] = None) -> JobStatus:
        def op(conn):
            with self._tx(conn):
                r = conn.execute("SELECT status, attempt, owner, failures FROM jobs WHERE id = %s FOR UPDATE",
                                 (job_id,)).fetchone()
                if r is None:
                    return JobStatus.FAILED
                if r["attempt"] != attempt or r["owner"] != self.owner or r["status"] != _RUNNING:
                    return JobStatus(r["status"])  # not ours any more: its new holder decides
                status, why = rules.after_group_failure(r["failures"] + 1, error)
                if status.terminal and publish is not None:
                    publish()
                conn.execute(f"UPDATE jobs SET failures = failures + 1, error = %s, status = %s, "
                             f"finished_at = CASE WHEN %s THEN {_NOW} END, lease_until = NULL, progress = NULL, "
                             "owner = CASE WHEN %s THEN owner END WHERE id = %s",
                             (rules.storable_text(why or error), status.value, status.terminal, status.terminal,
                              job_id))
                return status
        return self._run(op, repeat=False)

    # ----- the API's moves -----
    def job_cancel(self, job_id: str) -> Optional[JobStatus]:
        def op(conn):
            with self._tx(conn):
                conn.execute(f"UPDATE jobs SET status = %s, finished_at = {_NOW} WHERE id = %s AND status = %s",
                             (JobStatus.CANCELLED.value, job_id, _QUEUED))
                conn.execute("UPDATE jobs SET cancel_requested = TRUE WHERE id = %s AND status = %s",
                             (job_id, _RUNNING))
                r = conn.execute("SELECT status FROM jobs WHERE id = %s", (job_id,)).fetchone()
                return JobStatus(r["status"]) if r else None
        return self._run(op, repeat=True)

    def job_delete(self, job_id: str) -> Optional[JobStatus]:
        def op(conn):
            with self._tx(conn):
                r = conn.execute("SELECT status FROM jobs WHERE id = %s AND NOT deleting FOR UPDATE",
                                 (job_id,)).fetchone()
                if r is None:
                    return None
                status = JobStatus(r["status"])
                if status is JobStatus.IN_PROGRESS:
                    conn.execute("UPDATE jobs SET deleting = TRUE, cancel_requested = TRUE WHERE id = %s", (job_id,))
                else:
                    conn.execute("DELETE FROM jobs WHERE id = %s", (job_id,))
                return status
        return self._run(op, repeat=False)

    def job_remove(self, job_id: str) -> None:
        self._one("DELETE FROM jobs WHERE id = %s RETURNING id", (job_id,))

    # ----- start -----
    def job_purge_deleting(self) -> list[str]:
        """After a restart: this server's jobs (any of its keepers') deleted while they ran go
        (others' are theirs)."""
        return [r["id"] for r in self._changed(f"DELETE FROM jobs WHERE deleting AND {_MINE} RETURNING id",
                                               (self.owner, self.owner, self.owner))]

    def job_recover(self) -> list[str]:
        """After a restart: this server's jobs (any of its keepers') left in progress go back to
        the queue at once (no need to wait for their leases)."""
        rows = self._changed(f"UPDATE jobs SET status = %s, owner = NULL, lease_until = NULL, progress = NULL "
                             f"WHERE status = %s AND {_MINE} AND NOT deleting RETURNING id",
                             (_QUEUED, _RUNNING, self.owner, self.owner, self.owner))
        return [r["id"] for r in rows]

    def pool_join(self, digest: str, identity: dict[str, Any], who: str) -> Joined:
        from psycopg.types.json import Jsonb

        def op(conn):
            with self._tx(conn):
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_JOIN_LOCK,))
                fleet = conn.execute("SELECT id, marked FROM fleet").fetchone()
                created_fleet = fleet is None
                if created_fleet:
                    fleet = conn.execute(f"INSERT INTO fleet (id, marked, created_at) VALUES (%s, FALSE, {_NOW}) "
                                         "RETURNING id, marked", (uuid.uuid4().hex,)).fetchone()
                r = conn.execute("SELECT * FROM pools WHERE name = %s", (self.pool,)).fetchone()
                created_pool = r is None
                if created_pool:
                    r = conn.execute(f"INSERT INTO pools (name, digest, identity, joined_by, joined_at) VALUES "
                                     f"(%s, %s, %s, %s, {_NOW}) RETURNING *",
                                     (self.pool, digest, Jsonb(identity), who)).fetchone()
                return fleet, created_fleet, r, created_pool
        fleet, created_fleet, r, created_pool = self._run(op, repeat=True)
        pool = PoolIdentity(r["name"], r["digest"], r["identity"], r["joined_by"], r["joined_at"])
        if pool.digest == digest:
            self.digest = digest
        return Joined(fleet["id"], created_fleet, fleet["marked"], pool, created_pool)

    def fleet_mark(self, fleet_id: str) -> None:
        self._one("UPDATE fleet SET marked = TRUE WHERE id = %s RETURNING id", (fleet_id,))

    def pool_reset(self, digest: str, identity: dict[str, Any], who: str) -> None:
        from psycopg.types.json import Jsonb

        self._one(f"UPDATE pools SET digest = %s, identity = %s, joined_by = %s, joined_at = {_NOW} WHERE name = %s "
                  "RETURNING name", (digest, Jsonb(identity), who, self.pool))
        self.digest = digest

    def pool_list(self) -> dict[str, str]:
        return {r["name"]: r["digest"] for r in self._all("SELECT name, digest FROM pools")}
