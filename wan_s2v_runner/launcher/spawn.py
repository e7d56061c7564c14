"""How a run is spawned: its run directory, its agent's command line and the workers' environment.

:func:`agent_argv` is the whole command (an argument list, no shell): ``python -m
wan_s2v_runner.rank.agent`` with the run's ``spec.json``, from which the agent (torch elastic's,
as torchrun runs it; see :mod:`wan_s2v_runner.rank.agent`) takes this node's share of the world,
the rendezvous and the rank body; per-rank logs and torch elastic error files go under ``logs/``.
The run's files keep torchrun's name for it (``torchrun.log``, run.json's ``torchrun_pid``):
formats that users' tools read, left as they are. :func:`finalize_spec` resolves what the
launcher decides once (seed, multi-node port) before the spec is written.
"""
from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared.node_agent import AGENT_MODULE, DEFAULT_MASTER_PORT
from wan_s2v_runner.shared.spec import GroupSpec, JobSpec

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def make_run_dir(spec: GroupSpec) -> Path:
    root = spec.runs_root
    root.mkdir(parents=True, exist_ok=True)
    base = f"{datetime.now():%Y%m%d-%H%M%S}-{spec.mode.value}"
    for i in range(1000):
        d = root / (base if i == 0 else f"{base}-{i}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run directory under {root}")


def finalize_spec(spec: GroupSpec) -> GroupSpec:
    """Resolve what the launcher decides once: the seed, and the rendezvous port of a
    multi-node run (:data:`DEFAULT_MASTER_PORT` unless given). A one-node run without a port
    keeps ``master_port=None``: the agent's rendezvous then binds port 0 and the OS picks
    (:func:`wan_s2v_runner.rank.agent.rendezvous`)."""
    if isinstance(spec, JobSpec):  # a run's spec carries its job's seed
        spec = spec.with_resolved_seed()
    if spec.master_port is None and spec.nnodes > 1:
        spec = spec.model_copy(update={"master_port": DEFAULT_MASTER_PORT})
    return spec


def expected_ranks(spec: GroupSpec) -> list[int]:
    """Global ranks started on this node (node-major: one node's are 0..nproc-1)."""
    return list(range(spec.node_rank * spec.nproc, (spec.node_rank + 1) * spec.nproc))


def agent_argv(run_dir: Path, wait: bool = False) -> list[str]:
    """The node agent's command (:mod:`wan_s2v_runner.rank.agent`: torch elastic's agent, as
    torchrun runs it, forking the ranks from a process that has imported torch and the engine);
    ``wait``: it preloads, then starts the ranks when told ``go`` on stdin."""
    return [sys.executable, "-m", AGENT_MODULE, *(["--wait"] if wait else []), str(run_dir / "spec.json")]


#: glibc malloc settings for CPU ranks (each kept if the user set it). By default glibc serves
#: large blocks (the VAE's and DiT's activations) with fresh mmap()s and returns them on free, so
#: every large tensor is page-faulted and zeroed again: measured, a 73-frame 256x256 VAE encode of
#: the bench preset took 17.2 s, 15.7 s of it system time, against 9.4-9.9 s with these (the heap
#: keeps and reuses freed blocks). Numerics are untouched; freed memory stays with the process.
CPU_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # blocks up to 32 MiB (glibc's maximum) from the heap
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),  # do not hand the heap's top back after each free
    "MALLOC_TOP_PAD_": str(1 << 30),  # grow the heap in 1 GiB steps (address space, not RSS)
}


def agent_env() -> dict:
    """This environment as every node agent gets it (a run's, :func:`worker_env`, and the warm
    agent's, ``wan-s2v warm``): unbuffered output, this project first on PYTHONPATH, NCCL's errors
    raised in the ranks."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def worker_env(spec: GroupSpec, extra: Optional[dict] = None) -> dict:
    env = agent_env()
    if spec.device == "cpu":
        env["OMP_NUM_THREADS"] = str(spec.threads)
        for k, v in CPU_MALLOC_ENV.items():
            env.setdefault(k, v)
    else:  # fragmentation is a common cause of OOM in long autoregressive runs; user value wins
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.update(extra or {})
    return env
