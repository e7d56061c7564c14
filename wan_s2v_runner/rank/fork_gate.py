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
:func:`pass_when_all_forked` first thing in each rank): no rank connects, and so no lookup runs in
the agent, while it forks. Where the ranks are spawned (CUDA was initialised in the agent) there
is nothing to inherit and no gate. Several nodes: a rank of another node may still connect to
node 0's store while node 0 forks; this gate is per node.
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Optional

#: how long a forked rank waits for the node's other ranks to be forked before it goes on alone
#: (a rank that died before the gate would otherwise hold the others; forking takes milliseconds)
WAIT_S = 120.0

_gate: Optional["multiprocessing.synchronize.Barrier"] = None


def close(local_ranks: int) -> None:
    """In the agent, before it forks ``local_ranks`` ranks: they pass the gate together."""
    global _gate
    _gate = multiprocessing.get_context("fork").Barrier(local_ranks) if local_ranks > 1 else None


def pass_when_all_forked(wait_s: float = WAIT_S) -> bool:
    """In a forked rank, first: wait until every rank of the node is forked. False when the wait
    ran out (the rank goes on, as it did before the gate)."""
    if _gate is None:
        return True
    try:
        _gate.wait(timeout=wait_s)
        return True
    except threading.BrokenBarrierError:
        logging.getLogger("wan_s2v").warning(
            "the node's other ranks were not all forked within %.0f s; this rank starts without them", wait_s)
        return False
