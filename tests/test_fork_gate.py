"""The node agent's fork gate (wan_s2v_runner/rank/fork_gate.py): a forked rank starts only once every
rank of its node is forked, so that none inherits a lock an agent thread held mid-lookup; a rank
whose siblings never come fails with that cause after the wait. (That every forked rank of a run
passes a gate for its node: tests/test_parity.py's demo test reads it from the ranks' ``hello``.)"""
from __future__ import annotations

import multiprocessing
import time

from wan_s2v_runner.rank import fork_gate

GAP_S = 0.3  # between two forks: what a child that did not wait would be ahead by


def _rank(out: str, wait_s: float) -> None:
    try:
        fork_gate.pass_when_all_forked(wait_s)
        result = "passed"
    except RuntimeError as e:
        result = f"failed {e}"
    with open(out, "w") as f:
        f.write(f"{time.monotonic()} {result}")


def _fork(n: int, forks: int, tmp_path, wait_s: float = 30.0) -> tuple[list[float], list[tuple[float, str]]]:
    """``forks`` children of a gate for ``n``, GAP_S apart: (the monotonic time before each fork,
    each child's (time past the gate, what it said))."""
    ctx = multiprocessing.get_context("fork")
    fork_gate.close(n)
    before, procs = [], []
    try:
        for i in range(forks):
            p = ctx.Process(target=_rank, args=(str(tmp_path / f"r{i}"), wait_s), daemon=True)
            before.append(time.monotonic())
            p.start()
            procs.append(p)
            time.sleep(GAP_S)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        fork_gate.close(1)
        for p in procs:
            if p.is_alive():
                p.kill()
    got = [(tmp_path / f"r{i}").read_text().split(" ", 1) for i in range(forks)]
    return before, [(float(t), said) for t, said in got]


def test_no_rank_starts_before_the_last_is_forked(tmp_path):
    before, passed = _fork(3, 3, tmp_path)
    assert [said for _, said in passed] == ["passed"] * 3
    assert min(t for t, _ in passed) >= before[-1], (before, passed)  # the first child waited ~2 gaps


def test_a_rank_whose_siblings_never_come_fails_after_the_wait(tmp_path):
    before, passed = _fork(3, 2, tmp_path, wait_s=1.0)
    assert all(said.startswith("failed the node's other ranks were not all forked within 1 s (3 expected)")
               for _, said in passed), passed
    assert min(t for t, _ in passed) >= before[0] + 1.0, (before, passed)  # held the whole wait


def test_one_rank_has_no_gate():
    fork_gate.close(1)
    assert fork_gate.parties() is None
    fork_gate.pass_when_all_forked(0.0)  # returns at once
    fork_gate.close(2)
    try:
        assert fork_gate.parties() == 2
    finally:
        fork_gate.close(1)
