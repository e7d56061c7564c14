"""What a job store is: the one interface the API and the keepers use (:class:`JobStore`), the
rows and answers it gives, and its typed failures. Two drivers implement it (:mod:`.sqlite`: one
server's file; :mod:`.postgres`: a queue servers share) and one contract suite runs against both
(``tests/test_store_contract.py``), as River does for its drivers.

**Names.** Each operation is named by the resource it acts on and its verb, as River's driver
interface is (``JobInsert``, ``JobGetByID``, ``LeaderAttemptElect``...): ``job_*`` for a job
(insert, get, list, page, claim_next, finish, cancel, delete...), ``lease_*`` for the holders'
leases (renew, reap), ``pool_*`` and ``fleet_*`` for the fleet's identity, ``store_*`` for the
store itself (ping, describe, for_keeper).

**Fencing.** Every claim makes a job's ``attempt`` grow by one; the attempt is the holder's token
(Kleppmann's fencing token). Every write a holder makes for a job carries it (:class:`Held` in a
heartbeat, ``attempt=`` in :meth:`JobStore.job_finish` and :meth:`JobStore.job_attempt_failed`), and a
store refuses a write whose attempt is no longer the job's (another claim moved it on, or the
lease was reaped). :meth:`JobStore.job_finish` runs the holder's ``publish`` (the files moved into
place) inside the same transaction, with the job's row locked and its token checked first: no
file is moved into place by a holder that lost the job, and none after another holder took it.

**Outages.** A store raises :class:`QueueUnavailable` (never a driver's own exception) when its
database cannot be reached or does not answer in time; what is safe to repeat it has already
repeated once on a fresh connection (reads; writes whose effect it can recognise: an insert by
its id, an end by its attempt), and a claim that may have landed is reconciled at the next claim.
A database that answers but refuses the operation (a value it cannot hold, a bug) raises
:class:`StoreRefused`: trying again would not help.

What fencing cannot close is a holder paused between its last check and a rename inside its
``publish``: the holder's ``publish`` checks, before each file it moves, that its lease is still
sure (:func:`~..dirs.publisher`), so only a pause of exactly that moment lets a move through.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Protocol

#: the pool a server takes jobs from unless ``--pool`` names another
DEFAULT_POOL = "default"


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


class QueueUnavailable(Exception):
    """The store's database cannot be reached, or did not answer in time (one line: the cause):
    the same operation may work once it answers again."""


class StoreRefused(Exception):
    """The store's database answered but refused the operation (one line: the cause): the same
    operation would be refused again."""


class IdempotencyConflict(Exception):
    """An ``Idempotency-Key`` already names a job made of another request."""


class NotStorable(ValueError):
    """A value no store may hold (a NUL character, which PostgreSQL's JSONB refuses): one line."""


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
    attempt: int  # claims so far: the fencing token of the job's holder (a resumed job: more than one)
    error: Optional[str]
    record: Optional[dict[str, Any]]  # the job's record (rank 0's ID.json) once completed
    deleting: bool = False  # DELETE asked while it ran: gone for the API; removed when it ends
    progress: Optional[dict[str, Any]] = None  # a shared queue: the live progress its holder stored
    pool: str = DEFAULT_POOL  # the servers that may take it (those started with this --pool)
    identity: Optional[str] = None  # the digest of the fleet identity that took it (fleet.py)
    idempotency_key: Optional[str] = None


@dataclass(frozen=True)
class Held:
    """A holder's claim on a running job, as its heartbeat carries it: the attempt it was given
    (its token) and the live progress to store for the other servers."""

    attempt: int
    progress: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class Beat:
    """What a keeper's heartbeat learns of the jobs it runs: the ones someone asked to cancel, and
    the ones it no longer holds (its token is stale: the lease ran out and the job was reaped or
    taken by another claim; it stops them and writes nothing more for them)."""

    cancel: frozenset[str] = frozenset()
    lost: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Reaped:
    """What :meth:`JobStore.lease_reap` did: jobs of a server that stopped renewing its leases put
    back in the queue, and those that were being deleted removed (their files are the caller's)."""

    requeued: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()


@dataclass(frozen=True)
class Added:
    """A submission stored: its row, and whether this call made it (False: the same id or
    ``Idempotency-Key`` was stored before, by an earlier try of the same request)."""

    row: JobRow
    created: bool


@dataclass(frozen=True)
class PoolIdentity:
    """What a pool of the fleet is: the identity its first server recorded (:mod:`..fleet`)."""

    pool: str
    digest: str
    identity: dict[str, Any]
    joined_by: str
    joined_at: float


@dataclass(frozen=True)
class Joined:
    """A server's join of its pool (:meth:`JobStore.pool_join`): the fleet's id (the shared
    directory's marker names it), whether this server made the fleet and whether it marked the
    shared directory before (``marked``), and the pool's identity (``pool.digest`` differs from
    the server's own: the server is refused)."""

    fleet_id: str
    created_fleet: bool
    marked: bool
    pool: PoolIdentity
    created_pool: bool = False

    def matches(self, digest: str) -> bool:
        return self.pool.digest == digest


#: what a holder's finish moves into place, inside the store's transaction (raises: nothing is recorded)
Publish = Callable[[], None]


class JobStore(Protocol):
    """The jobs of a server (every change one transaction; ``spec`` is the job's
    :class:`~wan_s2v_runner.shared.spec.JobSpec` as JSON). ``shared``: other servers use the store
    too; then a keeper holds each job it runs with a lease its heartbeat (``lease_renew``) renews,
    and ``lease_reap`` gives a dead server's jobs back. ``pool``: the pool this server claims from and submits to."""

    shared: bool
    pool: str
    lease_s: Optional[float]

    # ----- submit -----
    def job_insert(self, job_id: str, spec: dict[str, Any], max_queued: int, *, pool: Optional[str] = None,
                   idempotency_key: Optional[str] = None, request_hash: Optional[str] = None) -> Added: ...
    # ----- read -----
    def job_get(self, job_id: str) -> Optional[JobRow]: ...
    def job_list(self, limit: int = 1000) -> list[JobRow]: ...
    def job_page(self, after: Optional[str] = None, limit: int = 20,
                 order: str = "desc") -> tuple[list[JobRow], bool]: ...
    def job_positions(self, job_ids: list[str]) -> dict[str, int]: ...
    def job_counts(self, pool: Optional[str] = None) -> dict[str, int]: ...
    def job_list_ended(self) -> list[tuple[str, float]]: ...
    def job_known(self, job_ids: list[str]) -> set[str]: ...
    def store_ping(self) -> None: ...
    # ----- a holder's moves: each carries its attempt -----
    def job_claim_next(self) -> Optional[JobRow]: ...
    def lease_renew(self, running: dict[str, Held]) -> Beat: ...
    def job_finish(self, job_id: str, attempt: int, status: JobStatus, *, error: Optional[str] = None,
                   record: Optional[dict] = None, publish: Optional[Publish] = None) -> bool: ...
    def job_attempt_failed(self, job_id: str, attempt: int, error: str,
                           publish: Optional[Publish] = None) -> JobStatus: ...
    def lease_reap(self) -> Reaped: ...
    def store_for_keeper(self, index: int) -> "JobStore": ...
    # ----- the API's moves -----
    def job_cancel(self, job_id: str) -> Optional[JobStatus]: ...
    def job_delete(self, job_id: str) -> Optional[JobStatus]: ...
    def job_remove(self, job_id: str) -> None: ...
    # ----- start -----
    def job_purge_deleting(self) -> list[str]: ...
    def job_recover(self) -> list[str]: ...
    def pool_join(self, digest: str, identity: dict[str, Any], who: str) -> Joined: ...
    def fleet_mark(self, fleet_id: str) -> None: ...
    def pool_reset(self, digest: str, identity: dict[str, Any], who: str) -> None: ...
    def pool_list(self) -> dict[str, str]: ...
    def store_describe(self) -> str: ...
    def close(self) -> None: ...
