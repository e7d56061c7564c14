"""A server's rank groups side by side (``wan-s2v serve --replicas N``): this node's ranks split
into N groups. Each runs the server's mode and layout on ``nproc / N`` ranks with its own devices
(``CUDA_VISIBLE_DEVICES``: its share of the GPUs), its own CPUs on a CPU run (``--cpus``: its share
of the cores), its own rendezvous port and run directories; each is kept by its own
:class:`~.keeper.Keeper`, which takes the next job from the server's one queue when its group is
idle. Past a handful of GPUs, several narrow groups make more videos per hour than one wide one
(sequence parallelism loses efficiency as it widens); one wide group makes each video sooner.

:func:`split` is the one place that says what each replica runs; a layout it cannot split is
refused before anything starts, with the cause and the fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pydantic import ValidationError

from wan_s2v_runner.shared.spec import GroupSpec


class ReplicaError(ValueError):
    """The layout cannot be split into that many groups (one line: the cause and the fix)."""


@dataclass(frozen=True)
class Replica:
    """One rank group of a server: its spec (``nproc / N`` ranks), the environment its ranks
    start with, and what of the node it holds."""

    index: int
    spec: GroupSpec
    env: dict[str, str] = field(default_factory=dict)
    gpus: Optional[tuple[str, ...]] = None  # CUDA device ids (as CUDA_VISIBLE_DEVICES names them)
    cpus: Optional[tuple[int, ...]] = None  # a CPU run's cores

    @property
    def holds(self) -> str:
        """What of the node it runs on, in words (the status page, /health)."""
        if self.gpus is not None:
            return f"GPU {','.join(self.gpus)}"
        if self.cpus is not None:
            return f"CPU {cpu_text(self.cpus)}"
        return "all of the node"


def cpu_text(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the ``--cpus`` syntax)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def visible_gpus(count: Optional[int]) -> list[str]:
    """The GPU ids this process may use: ``CUDA_VISIBLE_DEVICES``' names, else 0 .. count-1."""
    names = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return names if names else [str(i) for i in range(count or 0)]


def split(group: GroupSpec, n: int, *, gpus: Sequence[str] = (), cpus: Sequence[int] = ()) -> list[Replica]:
    """``group`` as ``n`` groups side by side (see the module's docstring). ``gpus``: the GPU ids
    the node lets this server use (CUDA runs); ``cpus``: the cores it may use (CPU runs: each group
    gets an equal run of them, and each rank ``--threads`` of its group's)."""
    if n < 1:
        raise ReplicaError(f"--replicas {n}: at least 1. Fix: --replicas 1 (one group) or more")
    if n == 1:
        return [Replica(0, group)]
    if group.nnodes > 1:
        raise ReplicaError(f"--replicas {n} with --nnodes {group.nnodes}: replicas split one node's ranks. "
                           "Fix: run one server per node with --replicas, or one multi-node group without it")
    if group.nproc % n:
        raise ReplicaError(f"--replicas {n} does not divide --nproc {group.nproc} (each group gets the same "
                           f"number of ranks). Fix: --nproc {group.nproc - group.nproc % n or n} or --replicas "
                           f"{next(d for d in range(n, 0, -1) if group.nproc % d == 0)}")
    per = group.nproc // n
    port = group.master_port
    out = []
    for i in range(n):
        update: dict = {"nproc": per, "master_port": port + i if port is not None else None}
        env: dict[str, str] = {}
        held_gpus = held_cpus = None
        if group.device == "cuda":
            if len(gpus) < group.nproc:
                raise ReplicaError(f"--replicas {n} x {per} ranks needs {group.nproc} GPUs; {len(gpus)} are "
                                   "visible here. Fix: lower --nproc, or make the GPUs visible (CUDA_VISIBLE_DEVICES)")
            held_gpus = tuple(gpus[i * per:(i + 1) * per])
            env["CUDA_VISIBLE_DEVICES"] = ",".join(held_gpus)
        else:
            mine = list(group.cpu_list) if group.cpus else sorted(cpus)
            share = len(mine) // n
            if share < 1:
                raise ReplicaError(f"--replicas {n} on the CPU needs at least {n} cores; {len(mine)} are allowed "
                                   "here. Fix: fewer --replicas")
            held_cpus = tuple(mine[i * share:(i + 1) * share])
            update["cpus"] = cpu_text(held_cpus)
        try:
            spec = GroupSpec(**{**group.model_dump(), **update})
        except ValidationError as e:
            why = e.errors()[0]["msg"].removeprefix("Value error, ") if e.errors() else str(e)
            raise ReplicaError(f"--replicas {n}: a group of {per} rank{'s' if per > 1 else ''} is not a valid "
                               f"layout ({why}). Fix: fewer --replicas, or another --mode / no --cfg-parallel"
                               ) from None
        out.append(Replica(i, spec, env, held_gpus, held_cpus))
    return out
