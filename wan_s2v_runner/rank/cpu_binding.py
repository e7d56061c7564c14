"""Where a CPU rank runs on its node: ``--pin-cpus`` (one job; the worker applies it at start).

On CUDA a rank's place is its GPU (``LOCAL_RANK``); on CPU the OS places threads, and on a node
whose cores are all busy it moves a rank's gloo threads onto a core where another rank computes,
so a blocking exchange can wait for a time slice; ``--pin-cpus`` binds each rank to its own CPUs.
"""
from __future__ import annotations

from typing import Optional, Sequence


def cpu_binding(pin: bool, threads: int, local_rank: int, local_world: int,
                allowed: Sequence[int]) -> Optional[list[int]]:
    """The CPUs a CPU rank binds to (``--pin-cpus``), or None to leave it to the OS.

    Local rank r gets the r-th run of ``threads`` CPUs among ``allowed`` (the node's affinity
    mask) when ``pin`` asks for it and the node's ranks together need no more CPUs than that.
    Off by default: measured on 2 cores, binding cuts a small gloo exchange after compute from
    2.4-2.6 ms to 1.4-1.5 ms, but whole bench runs were the same within their noise (docs/bench.md).
    """
    if not pin or local_world * threads > len(allowed):
        return None
    cpus = sorted(allowed)
    return cpus[local_rank * threads:(local_rank + 1) * threads]
