"""The job stores' contract (``wan_s2v_runner/serve/store/contract.py``: every check, exported
beside the drivers), run against each driver with a harness of its own, as River runs its driver
tests: one server's SQLite file and the PostgreSQL queue servers share (a throwaway cluster,
tests/pg_cluster.py). A harness knows its driver's database from outside (a file's lock, a
cluster stopped, a lease run out by SQL on its own connection); the checks never reach into a store.
"""
from __future__ import annotations

import sqlite3
import time
from contextlib import contextmanager

import pytest

from wan_s2v_runner.serve.store import contract
from wan_s2v_runner.serve.store.protocol import DEFAULT_POOL, QueueUnavailable


class SqliteHarness:
    """One server's file: two stores on it are two keepers of one server; a server started again
    takes its running jobs back (``job_recover``); another process holding the file's write lock past
    the store's wait is its outage (reads still answer: WAL)."""

    def __init__(self, tmp_path):
        self.path, self.made = tmp_path / "jobs.sqlite", []

    def store(self, owner="a", pool=DEFAULT_POOL, lease_s=30):
        from wan_s2v_runner.serve.store.sqlite import SqliteJobStore

        s = SqliteJobStore(self.path, pool=pool, busy_timeout_s=2.0)  # its outage: a lock held longer
        self.made.append(s)
        return s

    def lose(self, holder, other, job_id):
        assert job_id in other.job_recover()

    @contextmanager
    def outage(self, s):
        other = sqlite3.connect(str(self.path), isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        try:
            yield (lambda: s.job_insert("k", {}, 10), s.job_claim_next)
        finally:
            other.execute("ROLLBACK")
            other.close()


class PostgresHarness:
    """A queue servers share, in a database of its own on the throwaway cluster: a lease run out
    (set so by SQL on the harness's own connection) is reaped by another server; the cluster
    stopped at once, every connection cut, is its outage (every operation: 'does not answer',
    within its timeouts)."""

    def __init__(self, cluster):
        self.cluster, self.url, self.made = cluster, cluster.database(), []

    def store(self, owner="a", pool=DEFAULT_POOL, lease_s=30):
        from wan_s2v_runner.serve.store.postgres import PgJobStore

        s = PgJobStore(self.url, owner, lease_s, pool)
        self.made.append(s)
        return s

    def lose(self, holder, other, job_id):
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute("UPDATE jobs SET lease_until = 0 WHERE id = %s", (job_id,))
        assert job_id in other.lease_reap().requeued

    @contextmanager
    def outage(self, s):
        t0 = time.time()

        def unanswered(op):  # each refused with the cause, all four within 20 s of the database going
            def run():
                try:
                    op()
                except QueueUnavailable as e:
                    assert "does not answer" in str(e) and time.time() - t0 < 20, (str(e), time.time() - t0)
                    raise
            return run

        self.cluster.halt()
        t0 = time.time()
        try:
            yield tuple(unanswered(op) for op in (lambda: s.job_insert("k", {}, 10), s.job_claim_next, s.job_counts,
                                                   lambda: s.job_get("j")))
        finally:
            self.cluster.start()


@pytest.fixture(params=("sqlite", "postgresql"))
def harness(request, tmp_path):
    h = SqliteHarness(tmp_path) if request.param == "sqlite" else PostgresHarness(request.getfixturevalue("cluster"))
    yield h
    for s in h.made:
        s.close()


@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_the_contract(harness, check):
    check(harness)


def test_every_check_is_listed():
    """The contract's checks, all of them run above (a check added to the module is run)."""
    names = [c.__name__ for c in contract.CHECKS]
    assert len(names) == 11 and names[0] == "check_submissions_reads_and_the_queue_limit", names
    assert names[-1] == "check_an_outage_is_queue_unavailable_and_passes", names
