"""Where a CPU rank runs on its node: ``--pin-cpus`` (one job; the worker applies it at start).

On CUDA a rank's place is its GPU (``LOCAL_RANK``); on CPU the OS places threads, and on a node
whose cores are all busy it moves a rank's gloo threads onto a core where another rank computes,
so every blocking exchange waits for a time slice. Binding each rank to its own CPUs avoids that.
"""
from __future__ import annotations

from typing import Optional, Sequence


def cpu_binding(pin: Optional[bool], threads: int, local_rank: int, local_world: int,
                allowed: Sequence[int]) -> Optional[list[int]]:
    """The CPUs a CPU rank binds to (``--pin-cpus``), or None to leave it to the OS.

    Local rank r gets the r-th run of ``threads`` CPUs among ``allowed`` (the node's affinity
    mask), when the node's ranks together need no more CPUs than that; ``pin`` None (auto) or
    True asks for it, False never. Why: on a busy node the OS moves a rank's gloo threads onto a
    core where the other rank computes, and every blocking exchange then waits for a time slice;
    measured on 2 cores: a small exchange after compute 2.4-2.6 ms unbound, 1.4-1.5 ms bound, and
    the split VAE's ~1,300 exchanges per 2-clip bench run are its largest overhead (docs/bench.md).
    """
    if pin is False or local_world * threads > len(allowed):
        return None
    cpus = sorted(allowed)
    return cpus[local_rank * threads:(local_rank + 1) * threads]
