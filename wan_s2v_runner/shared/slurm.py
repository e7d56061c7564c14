"""Slurm: the node layout of an ``srun`` step, read from the variables srun sets.

``srun --nodes N --ntasks-per-node 1 wan-s2v run --nproc 8 ...`` starts one launcher per node;
each reads here how many nodes the step has (``SLURM_STEP_NUM_NODES``), which one it is (its
host ``SLURMD_NODENAME`` in ``SLURM_STEP_NODELIST``, else ``SLURM_NODEID``) and the rendezvous
host (the step's first node). Only a job step counts: an ``salloc`` shell or a batch script has
the job's variables but is not on every node, so a plain ``wan-s2v run`` there stays a one-node
run. The values sit under explicit ``MASTER_ADDR``/``WORLD_SIZE``/``RANK`` (a cluster that sets
those means them) and under flags (``config.env_values``). Pure: reads a mapping, imports nothing
from the project.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

_GROUP_RE = re.compile(r"\[([^\]]*)\]")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur] if cur else out


def _expand_range(spec: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding kept)."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if not hi:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names (what ``scontrol show hostnames`` prints):
    'gpu[01-03,07],login' -> gpu01, gpu02, gpu03, gpu07, login; 'r[1-2]-n[1-2]' -> 4 hosts."""
    hosts = []
    for entry in _split_top(text.strip()):
        names = [""]
        pos = 0
        for m in _GROUP_RE.finditer(entry):
            names = [n + entry[pos:m.start()] + v for n in names for v in _expand_range(m.group(1))]
            pos = m.end()
        hosts.extend(n + entry[pos:] for n in names)
    return [h for h in hosts if h]


def step_values(env: Mapping[str, str]) -> dict[str, Any]:
    """{nnodes, node_rank, master_addr} of the srun step this process runs in ({} outside one,
    or when the variables do not parse)."""
    try:
        nnodes = int(env.get("SLURM_STEP_NUM_NODES", ""))
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST", ""))
    except ValueError:
        return {}
    if nnodes < 1 or len(hosts) != nnodes:
        return {}
    me = env.get("SLURMD_NODENAME")
    node: Optional[int] = hosts.index(me) if me in hosts else None
    if node is None:
        try:
            node = int(env.get("SLURM_NODEID", ""))
        except ValueError:
            return {}
        if not 0 <= node < nnodes:  # the job's node index, not the step's: unusable
            return {}
    return {"nnodes": nnodes, "node_rank": node, "master_addr": hosts[0]}


def tasks_and_nodes(env: Mapping[str, str]) -> Optional[tuple[int, int]]:
    """(tasks, nodes) of this srun step (one launcher per task), None outside a step. One task
    per node is the only right shape: ``tasks == nodes``."""
    try:
        return int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_STEP_NUM_NODES"])
    except (KeyError, ValueError):
        return None
