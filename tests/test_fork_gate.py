"""The node agent's fork gate (wan_s2v_runner/rank/fork_gate.py): a forked rank starts only once every
rank of its node is forked, so that none inherits a lock an agent thread held mid-lookup; a rank
whose siblings never come goes on alone after the wait."""
from __future__ import annotations

import multiprocessing
import time

from wan_s2v_runner.rank import fork_gate

GAP_S = 0.3  # between two forks: what a child that did not wait would be ahead by


def _rank(out: str, wait_s: float) -> None:
    passed = fork_gate.pass_when_all_forked(wait_s)
    with open(out, "w") as f:
        f.write(f"{time.time()} {passed}")


def _fork(n: int, forks: int, tmp_path, wait_s: float = 30.0) -> tuple[list[float], list[tuple[float, bool]]]:
    """``forks`` children of a gate for ``n``, GAP_S apart: (the time each fork returned, each child's
    (time past the gate, whether all came))."""
    ctx = multiprocessing.get_context("fork")
    fork_gate.close(n)
    forked, procs = [], []
    try:
        for i in range(forks):
            p = ctx.Process(target=_rank, args=(str(tmp_path / f"r{i}"), wait_s))
            p.start()
            forked.append(time.time())
            procs.append(p)
            time.sleep(GAP_S)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        fork_gate.close(1)
    got = [(tmp_path / f"r{i}").read_text().split() for i in range(forks)]
    return forked, [(float(t), ok == "True") for t, ok in got]


def test_no_rank_starts_before_the_last_is_forked(tmp_path):
    forked, passed = _fork(3, 3, tmp_path)
    assert all(ok for _, ok in passed)
    assert min(t for t, _ in passed) >= forked[-1] - 0.05, (forked, passed)  # the first child waited ~2 gaps


def test_a_rank_whose_siblings_never_come_goes_on_after_the_wait(tmp_path):
    forked, passed = _fork(3, 2, tmp_path, wait_s=1.0)
    assert [ok for _, ok in passed] == [False, False]
    assert min(t for t, _ in passed) >= forked[0] + 0.9, (forked, passed)  # held the whole wait


def test_one_rank_or_spawned_ranks_have_no_gate():
    fork_gate.close(1)
    assert fork_gate.pass_when_all_forked(0.0)
