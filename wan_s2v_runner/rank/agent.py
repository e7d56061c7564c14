"""The parent of one node's ranks: ``python -m wan_s2v_runner.rank.agent [--worker MODULE] [--wait] SPEC_JSON``.

It does what ``python -m torch.distributed.run`` did for us, through torch elastic's own launcher
API (:class:`~torch.distributed.launcher.api.elastic_launch`, the agent torchrun runs), with one
difference: the ranks are *forked* from this process after it has imported torch, the engine and
the rank's modules once (:func:`preload`), so a rank starts at its first line of work instead of
spending 3-8 s importing them (each rank of a node did, at once, on the same cores).

* The rendezvous, the per-rank logs (``logs/``, teed, rank 0 on the console), torch elastic's
  error files (``@record``), the torchrun environment of each rank (``RANK``, ``LOCAL_RANK``,
  ``MASTER_ADDR``...), its failure summary and its stopping of the others when one fails are
  torch elastic's, configured from the spec as the torchrun command line was (:func:`launch_config`).
* Nothing here touches CUDA before the fork: the engine is imported with its CUDA-at-import spot
  patched (:mod:`patches.t5_import_device`), torch elastic asks NVML rather than the CUDA runtime
  whether GPUs exist (``PYTORCH_NVML_BASED_CUDA_CHECK``), and if CUDA was initialised anyway the
  ranks are spawned fresh instead (``start_method``: a forked child could not use CUDA).
* The spec's ``rank_worker`` (``$WAN_S2V_RANK_WORKER``) is the module whose ``rank_main(spec_path)``
  each rank runs (default: :mod:`wan_s2v_runner.rank.worker`); the tests point it at their own
  worker modules.
* ``--wait``: preload, then wait for a line ``go`` on stdin before the rendezvous (end of input:
  exit without starting a rank). ``wan-s2v run`` starts the agent this way before its preflight
  where the preflight takes seconds (GPUs to measure, a CUDA torch to import), so the imports
  overlap the checks.

A forked rank's command line is this agent's: it names this module and the run's ``spec.json``,
which is how the launcher finds the run's processes in ``/proc``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Optional

from wan_s2v_runner.rank import fork_gate
from wan_s2v_runner.shared.node_agent import AGENT_MODULE, DEFAULT_MASTER_PORT
from wan_s2v_runner.shared.procfs import name_this_process, rank_comm

#: set before torch is imported here: torch.cuda.is_available() (torch elastic's launch config asks
#: it) then uses NVML and does not initialise the CUDA driver in the process the ranks are forked from
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def preload(spec) -> Optional[str]:
    """Import, in this process, what every rank imports before its first line of work: torch,
    torch.distributed, the worker module, and what the worker module's own ``preload(spec)``
    imports (the engine's worker: the engine with our patches and the modules that load and
    generate). Returns None, or why that failed (each rank then imports it itself and fails, if it
    must, in its own stage, with its own error)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    module = importlib.import_module(spec.rank_worker)
    if not hasattr(module, "preload"):
        return None
    try:
        module.preload(spec)
    except Exception as e:  # noqa: BLE001 - the rank reports it where it happens
        return f"{type(e).__name__}: {e}"
    return None


def rendezvous(spec) -> dict:
    """torch elastic's rendezvous settings: one node without ``--master-port``, what
    ``torchrun --standalone`` does (a c10d rendezvous on ``localhost:0``: the store binds port 0
    and keeps the port the OS gave it, so runs started together cannot collide; every rank gets
    ``MASTER_ADDR`` = this host and the store's ``MASTER_PORT``); otherwise the static rendezvous
    on ``--master-addr:--master-port`` with this node's rank."""
    if spec.master_port is None and spec.nnodes == 1:
        return {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "run_id": uuid.uuid4().hex,
                "local_addr": "127.0.0.1"}
    port = spec.master_port or DEFAULT_MASTER_PORT
    return {"rdzv_backend": "static", "rdzv_endpoint": f"{spec.master_addr}:{port}",
            "rdzv_configs": {"rank": spec.node_rank}, "run_id": "none"}


def start_method() -> str:
    """``fork`` (the ranks inherit this process's imports), or ``spawn`` where CUDA was
    initialised here after all: a forked child could not use it."""
    import torch

    return "spawn" if torch.cuda.is_initialized() else "fork"


def launch_config(spec, run_dir: Path, method: str):
    """The :class:`LaunchConfig` of this node's share of the group: ``nproc`` ranks, no restarts,
    per-rank logs under ``logs/`` (stdout and stderr redirected and teed, rank 0's on the console)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    logs = DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=Std.ALL, tee=Std.ALL, local_ranks_filter={0})
    return LaunchConfig(min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc,
                        logs_specs=logs, max_restarts=0, role="default", start_method=method, **rendezvous(spec))


def rank_entry(worker: str, spec_path: str) -> int:
    """What a rank runs (in the forked child): the signal dispositions of a fresh Python (the
    agent's own handlers raise in its main thread, which a rank blocked in a collective would
    never reach), its name (``wan-s2v-rN``), the node's :mod:`~wan_s2v_runner.rank.fork_gate`, then
    ``worker.rank_main(spec_path)``."""
    name_this_process(rank_comm(int(os.environ.get("RANK", 0))))  # how the launcher knows a silent rank
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fork_gate.pass_when_all_forked()  # no lock inherited mid-lookup (fork_gate)
    return importlib.import_module(worker).rank_main(spec_path)


def _wait_for_go() -> bool:
    """True when the launcher says ``go`` on stdin; False at the end of input (it refused the run,
    or died)."""
    for line in sys.stdin:
        if line.strip() == "go":
            return True
    return False


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault(NVML_CHECK_ENV, "1")
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def agent(a) -> int:
        from torch.distributed.launcher.api import elastic_launch

        from wan_s2v_runner.shared.spec import read_spec

        spec_path = Path(a.spec).absolute()
        spec = read_spec(spec_path)
        problem = preload(spec)
        if problem:
            print(f"[wan-s2v agent] the engine did not import here ({problem}); each rank imports it itself",
                  file=sys.stderr, flush=True)
        if a.wait:
            if not _wait_for_go():
                return 0
            spec = read_spec(spec_path)  # as the launcher left it (its preflight may have changed it)
        method = start_method()
        if method == "fork":
            fork_gate.close(spec.nproc)
        else:
            print("[wan-s2v agent] CUDA was initialised in the agent: spawning the ranks fresh (no preloaded imports)",
                  file=sys.stderr, flush=True)
        elastic_launch(launch_config(spec, spec_path.parent, method), rank_entry)(spec.rank_worker, str(spec_path))
        return 0

    p = argparse.ArgumentParser(prog=f"python -m {AGENT_MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--wait", action="store_true", help="preload, then wait for `go` on stdin")
    p.add_argument("spec", help="the run directory's spec.json")
    return agent(p.parse_args(argv))


if __name__ == "__main__":
    from wan_s2v_runner.shared.prompt_exit import exit_now

    exit_now(main())
