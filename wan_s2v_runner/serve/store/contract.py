"""One contract, every job store driver: the checks each driver of :class:`~.protocol.JobStore`
must pass, exported beside the drivers as River exports its driver tests. A driver is proven by
running every check of :data:`CHECKS` with a :class:`Harness` of its own (how to make its stores
on one database, how a holder loses a job there, how its database goes away), never by reaching
into a driver's insides; ``tests/test_store_contract.py`` runs them for SQLite and PostgreSQL.

What every store promises: submissions stored once (by id and by ``Idempotency-Key``), a string
no store can hold refused alike; claims that never hand one job to two holders, in their pool's
order; fencing (a holder whose attempt is stale changes nothing: no heartbeat, no end, no
failure, and its ``publish`` is never run); ends that can be repeated; cancel, delete, the
failure policy; a server started again taking its jobs back; the fleet's join; and an outage
that raises :class:`~.protocol.QueueUnavailable`, never the driver's own error, and passes.

    from wan_s2v_runner.serve.store import contract
    for check in contract.CHECKS:
        check(MyHarness(...))    # each on a fresh database

Under pytest, register this module for assertion rewriting (``pytest.register_assert_rewrite``,
as ``tests/conftest.py`` does) to see the values of a failed check.
"""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol

from wan_s2v_runner.serve.store import rules
from wan_s2v_runner.serve.store.protocol import (
    DEFAULT_POOL,
    Beat,
    Held,
    IdempotencyConflict,
    JobStatus,
    JobStore,
    NotStorable,
    QueueFull,
    QueueUnavailable,
)


class Harness(Protocol):
    """What a driver gives the contract: its own helpers, over one fresh database."""

    def store(self, owner: str = "a", pool: str = DEFAULT_POOL, lease_s: float = 30) -> JobStore:
        """A store on the database: two made here are two servers (or keepers) on one queue
        (``owner`` names the server; a store made again with the same owner is that server
        started again)."""

    def lose(self, holder: JobStore, other: JobStore, job_id: str) -> None:
        """``holder``'s hold on ``job_id`` ends as it does for real, seen from ``other`` (a
        server started again takes its jobs back; a shared queue's lease runs out and another
        server reaps it): the job is queued again."""

    def outage(self, s: JobStore) -> AbstractContextManager[tuple[Callable[[], Any], ...]]:
        """The database unavailable to ``s`` while the block runs (another process holding a
        file's write lock past the store's wait; a database stopped, every connection cut): the
        context gives the operations of ``s`` that must raise ``QueueUnavailable`` meanwhile.
        After the block, the database is back."""


def _raises(kind: type[BaseException], call: Callable[[], Any], match: str = "") -> BaseException:
    try:
        call()
    except kind as e:
        assert re.search(match, str(e)), f"{kind.__name__} raised, but not matching {match!r}: {e}"
        return e
    raise AssertionError(f"{kind.__name__} was not raised")


def check_submissions_reads_and_the_queue_limit(h):
    s = h.store()
    for name in ("a", "b", "c"):
        assert s.job_insert(name, {"prompt": name}, max_queued=3).created
    _raises(QueueFull, lambda: s.job_insert("d", {}, max_queued=3))
    assert s.job_insert("a", {"prompt": "a"}, max_queued=3).created is False  # a repeat after a lost answer
    assert s.job_get("a").spec == {"prompt": "a"} and s.job_get("zz") is None
    assert [r.id for r in s.job_list()] == ["a", "b", "c"]
    rows, more = s.job_page(limit=2)
    assert [r.id for r in rows] == ["c", "b"] and more
    rows, more = s.job_page(after="b", limit=2)
    assert [r.id for r in rows] == ["a"] and not more
    assert [r.id for r in s.job_page(order="asc", limit=100)[0]] == ["a", "b", "c"]
    _raises(KeyError, lambda: s.job_page(after="nope"))
    assert s.job_positions(["a", "c", "zz"]) == {"a": 1, "c": 3}
    assert s.job_known(["a", "zz", "c"]) == {"a", "c"} and s.job_known([]) == set()
    assert s.job_counts() == {"queued": 3, "in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0}
    assert s.job_insert("p1", {}, max_queued=1, pool="other").created  # the limit is each pool's
    s.store_ping()


def check_idempotent_submissions_and_what_no_store_holds(h):
    s = h.store()
    first = s.job_insert("v1", {"prompt": "p"}, 10, idempotency_key="k-1", request_hash="h1")
    again = s.job_insert("v2", {"prompt": "p"}, 10, idempotency_key="k-1", request_hash="h1")  # the retry: another id
    assert first.created and not again.created and again.row.id == "v1" and s.job_get("v2") is None
    _raises(IdempotencyConflict,
            lambda: s.job_insert("v3", {"prompt": "other"}, 10, idempotency_key="k-1", request_hash="h2"))
    assert s.job_get("v1").idempotency_key == "k-1"
    _raises(NotStorable, lambda: s.job_insert("v4", {"prompt": "a\x00b"}, 10))
    _raises(NotStorable, lambda: s.job_insert("v5", {"lora": ["x\x00"]}, 10))
    _raises(NotStorable, lambda: s.job_insert("v6", {"prompt": "\ud800"}, 10))  # a lone surrogate: not UTF-8
    assert s.job_get("v4") is None and s.job_get("v5") is None and s.job_get("v6") is None
    held = s.job_claim_next()  # what the server writes itself (an error from anywhere) is kept as every store can
    assert s.job_finish(held.id, held.attempt, JobStatus.FAILED, error="rank 0: a\x00b \ud800")
    assert s.job_get(held.id).error.startswith("rank 0: a")


def check_claims_never_hand_one_job_to_two_holders(h):
    a, b = h.store("a"), h.store("b")
    for i in range(20):
        a.job_insert(f"j{i:02d}", {"n": i}, 100)
    claimed: dict[str, list[str]] = {"a": [], "b": []}

    def drain(s, name):
        while (row := s.job_claim_next()) is not None:
            claimed[name].append(row.id)

    threads = [threading.Thread(target=drain, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed["a"] + claimed["b"]) == [f"j{i:02d}" for i in range(20)]
    assert all(a.job_get(j).attempt == 1 for j in claimed["a"] + claimed["b"])


def check_pools_take_their_own_jobs_in_order(h):
    d, lora = h.store("a"), h.store("b", pool="lora")
    d.job_insert("d1", {}, 10)
    lora.job_insert("l1", {}, 10)
    d.job_insert("d2", {}, 10)
    d.job_insert("l2", {}, 10, pool="lora")
    assert d.job_positions(["d1", "d2", "l1", "l2"]) == {"d1": 1, "d2": 2, "l1": 1, "l2": 2}  # a place in its pool
    assert [lora.job_claim_next().id, lora.job_claim_next().id, lora.job_claim_next()] == ["l1", "l2", None]
    assert d.job_claim_next().id == "d1" and d.job_get("l1").pool == "lora" and d.job_get("d1").pool == "default"
    assert d.job_counts(pool="lora")["in_progress"] == 2 and d.job_counts(pool="default")["queued"] == 1


def check_fencing_a_stale_holder_changes_nothing(h):
    a, b = h.store("a", lease_s=30), h.store("b", lease_s=30)
    a.job_insert("j", {}, 10)
    held = a.job_claim_next()
    assert held.attempt == 1 and a.lease_renew({"j": Held(1, {"clip": 1})}).lost == frozenset()
    h.lose(a, b, "j")
    taken = b.job_claim_next()
    assert taken.id == "j" and taken.attempt == 2  # the token grew with the claim
    published = []
    # every write of the old holder carries attempt 1: refused, and its files never moved
    assert a.lease_renew({"j": Held(1, None)}).lost == {"j"}
    assert not a.job_finish("j", 1, JobStatus.COMPLETED, record={"x": 1}, publish=lambda: published.append("a"))
    assert a.job_attempt_failed("j", 1, "rank 1 died") is JobStatus.IN_PROGRESS
    row = b.job_get("j")
    assert row.status is JobStatus.IN_PROGRESS and row.failures == 0 and published == []
    # the holder's end: its files moved inside the transaction that checked its attempt
    assert b.lease_renew({"j": Held(2, {"clip": 2})}) == Beat()
    assert b.job_finish("j", 2, JobStatus.COMPLETED, record={"ok": 1}, publish=lambda: published.append("b"))
    assert published == ["b"] and b.job_get("j").status is JobStatus.COMPLETED and b.job_get("j").record == {"ok": 1}
    # the same end again (a retry after a lost answer) is the same answer, its files not moved twice
    assert b.job_finish("j", 2, JobStatus.COMPLETED, record={"ok": 1}, publish=lambda: published.append("again"))
    assert published == ["b"]
    assert not b.job_finish("j", 2, JobStatus.FAILED)  # another end is not a repeat


def check_a_publish_that_fails_records_nothing(h):
    s = h.store()
    s.job_insert("j", {}, 10)
    held = s.job_claim_next()

    def broken():
        raise OSError(28, "No space left on device")

    _raises(OSError, lambda: s.job_finish("j", held.attempt, JobStatus.COMPLETED, record={"x": 1}, publish=broken))
    assert s.job_get("j").status is JobStatus.IN_PROGRESS and s.job_get("j").record is None
    assert s.job_finish("j", held.attempt, JobStatus.FAILED, error="disk full")


def check_cancel_delete_and_the_failure_policy(h):
    s = h.store()
    for name in ("a", "b", "c", "d"):
        s.job_insert(name, {}, 10)
    a = s.job_claim_next()
    published = []
    assert s.job_attempt_failed("a", a.attempt, "rank 1 died", publish=lambda: published.append(1)) is JobStatus.QUEUED
    assert published == []  # back in the queue, first in line: nothing of it is published
    a = s.job_claim_next()
    assert a.id == "a" and a.attempt == 2
    failed = s.job_attempt_failed("a", a.attempt, "rank 1 died again", publish=lambda: published.append(2))
    assert failed is JobStatus.FAILED
    assert published == [2]  # failed for good: what it made so far published with the end
    assert f"failed {rules.MAX_FAILURES} times" in s.job_get("a").error and s.job_get("a").failures == 2
    assert s.job_cancel("c") is JobStatus.CANCELLED  # queued: dropped at once
    b = s.job_claim_next()
    assert b.id == "b" and s.job_cancel("b") is JobStatus.IN_PROGRESS and s.job_get("b").cancel_requested
    assert s.lease_renew({"b": Held(b.attempt)}).cancel == {"b"}
    assert s.job_cancel("nope") is None
    assert s.job_delete("d") is JobStatus.QUEUED and s.job_get("d") is None  # not running: gone at once
    assert s.job_delete("b") is JobStatus.IN_PROGRESS and s.job_get("b").deleting  # running: marked
    assert "b" not in [r.id for r in s.job_list()] and s.job_delete("b") is None
    assert s.job_finish("b", b.attempt, JobStatus.CANCELLED, error="cancelled")
    s.job_remove("b")
    assert s.job_get("b") is None
    assert [job_id for job_id, _ in s.job_list_ended()] == ["a", "c"]


def check_a_server_started_again_takes_its_jobs_back(h):
    s = h.store("a")
    s.job_insert("j", {}, 10)
    s.job_insert("k", {}, 10)
    j = s.job_claim_next()
    s.job_delete("k")
    s.job_insert("m", {}, 10)
    m = s.job_claim_next()
    assert m.id == "m" and s.job_delete("m") is JobStatus.IN_PROGRESS
    again = h.store("a")  # the same server (its name) again
    assert again.job_purge_deleting() == ["m"] and again.job_get("m") is None
    assert again.job_recover() == ["j"] and again.job_get("j").status is JobStatus.QUEUED
    taken = again.job_claim_next()
    assert taken.id == "j" and taken.attempt == j.attempt + 1
    assert not s.job_finish("j", j.attempt, JobStatus.COMPLETED)  # the old claim is fenced off


def check_the_fleet_join(h):
    a = h.store("a")
    joined = a.pool_join("d1", {"weights": {"dit": "x"}}, "host-a")
    assert joined.created_fleet and joined.created_pool and not joined.marked and joined.matches("d1")
    a.fleet_mark(joined.fleet_id)
    b = h.store("b")
    again = b.pool_join("d1", {"weights": {"dit": "x"}}, "host-b")
    assert not again.created_fleet and not again.created_pool and again.marked
    assert again.fleet_id == joined.fleet_id and again.pool.joined_by == "host-a"
    other = h.store("c").pool_join("d2", {"weights": {"dit": "y"}}, "host-c")
    assert not other.matches("d2") and other.pool.identity == {"weights": {"dit": "x"}}
    lora = h.store("d", pool="lora").pool_join("d2", {"weights": {"dit": "y"}}, "host-d")
    assert lora.created_pool and lora.matches("d2") and lora.fleet_id == joined.fleet_id
    assert a.pool_list() == {"default": "d1", "lora": "d2"}
    c = h.store("c")
    c.pool_reset("d3", {"weights": {"dit": "z"}}, "host-c")
    assert c.pool_join("d3", {}, "host-c").matches("d3")


def check_a_job_claimed_by_a_joined_server_records_its_identity(h):
    s = h.store()
    s.pool_join("digest-1", {}, "me")
    s.job_insert("j", {}, 10)
    assert s.job_claim_next().identity == "digest-1"


def check_an_outage_is_queue_unavailable_and_passes(h):
    s = h.store()
    s.job_insert("j", {}, 10)
    with h.outage(s) as operations:  # all at once, as a server's requests and keepers call them: each
        with ThreadPoolExecutor(len(operations)) as pool:  # waits out its own timeout, not the others'
            for done in [pool.submit(_raises, QueueUnavailable, op) for op in operations]:
                done.result()
    t0 = time.time()
    while True:  # back within seconds of the database: a store replaces its lost connections
        try:
            s.store_ping()
            break
        except QueueUnavailable:
            assert time.time() - t0 < 10, "the store did not come back within 10 s of its database"
            time.sleep(0.1)
    s.job_insert("k", {}, 10)  # answers again
    assert [r.id for r in s.job_list()] == ["j", "k"] and s.job_claim_next().id == "j"


#: every check, in the order they are listed here
CHECKS: tuple[Callable[[Harness], None], ...] = tuple(
    f for name, f in list(globals().items()) if name.startswith("check_") and callable(f))
