"""A node's forked ranks begin once every one of them is forked: none inherits a lock held mid-lookup.

The node agent (:mod:`~wan_s2v_runner.rank.agent`) forks its ranks one after another while torch
elastic's threads run in it, among them the TCPStore server the ranks connect to. That thread
accepts each rank's connection as it arrives and names its peer (``getnameinfo``: a reverse lookup
under glibc's resolver lock). A rank forked while the thread holds that lock inherits it held, with
no thread left to release it: its own first lookup, in its TCPStore client (``init_process_group``),
waits for ever, and every other rank waits in gloo's rendezvous for the address it never publishes.
Seen on this 2-core machine: rank 5 of 6 in ``resolv_conf.c: get_locked_global``, the run in
``init_pg`` until its 3600 s process-group timeout; 1 of ~55 six-rank runs with three such loops
at once, and once in the suite (docs/testing.md).

So no rank starts before the last one is forked (:func:`close` in the agent before it forks them,
:func:`pass_when_all_forked` first thing in each rank): no rank of this node connects while the
agent forks, so its store threads (the rendezvous's and the one the ranks use) accept nothing and
hold none of the locks that takes. Where the ranks are spawned (CUDA was initialised in the agent)
there is nothing to inherit and no gate. Several nodes: a rank of another node may still connect
to node 0's store while node 0 forks; this gate is per node. One gate serves one round of forks:
the agent runs its ranks once (``max_restarts=0``: a server restarts a group by starting a new
agent).

A rank that dies before the gate is seen by torch elastic, which stops the others (SIGTERM ends a
waiting rank at once). Where the rest never come (a fork that failed), a rank fails after
:data:`WAIT_S` with that cause instead of waiting out its process group's timeout.
"""
from __future__ import annotations

import multiprocessing
import threading
from typing import Optional

#: how long a forked rank waits for the node's other ranks to be forked (it takes milliseconds)
WAIT_S = 120.0

_gate: Optional["multiprocessing.synchronize.Barrier"] = None


def close(local_ranks: int) -> None:
    """In the agent, before it forks ``local_ranks`` ranks: they pass the gate together."""
    global _gate
    _gate = multiprocessing.get_context("fork").Barrier(local_ranks) if local_ranks > 1 else None


def parties() -> Optional[int]:
    """How many ranks this process's gate holds together (None: no gate); a rank reports it."""
    return None if _gate is None else _gate.parties


def pass_when_all_forked(wait_s: float = WAIT_S) -> None:
    """In a forked rank, first: wait until every rank of the node is forked. Past ``wait_s`` it
    raises :class:`RuntimeError` (the rank fails with that cause)."""
    if _gate is None:
        return
    try:
        _gate.wait(timeout=wait_s)
    except threading.BrokenBarrierError:
        raise RuntimeError(f"the node's other ranks were not all forked within {wait_s:.0f} s "
                           f"({_gate.parties} expected): this rank does not start without them") from None
