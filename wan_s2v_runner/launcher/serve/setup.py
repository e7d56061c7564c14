"""``wan-s2v serve``'s start: from the command's values to a running server.

The command's values (flags < ``--config`` < environment, as for ``run``) give the rank group's
settings (its :class:`~wan_s2v_runner.shared.spec.GroupSpec`: checkpoint, mode and layout, LoRAs,
device, attention: fixed for the server's life) and every job's defaults (steps, size, ...; a
default ``--image``/``--audio`` too, for a server that always animates one face). The group is
checked by preflight before anything spawns (:func:`~wan_s2v_runner.preflight.check_group`: the
machine, engine, checkpoint, LoRAs and the memory plan at the default size; the input checks
wait for a job's inputs); each job is checked whole when it is submitted.

On node 0 this starts the keeper and the HTTP API (:func:`.app.run_server`); on any other node
it only runs that node's ranks, relaunching them whenever the group ends (node 0 restarts it
after a failure), until interrupted.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.jobs import OUTPUT_FIELDS
from wan_s2v_runner.shared.spec import GroupSpec

#: the server directory's lock, held (open) for the process's life (:mod:`.lock`)
_lock_fd: Optional[int] = None


def _hold(fd: int) -> None:
    global _lock_fd
    _lock_fd = fd


def group_defaults(root: Path) -> dict[str, Any]:
    """What the group spec takes under the command's values: run directories under the server's
    directory unless ``--runs-root`` says otherwise."""
    return {"runs_root": root / "runs"}


def serve(args, group: GroupSpec, base: dict[str, Any], root: Path, extra_env: Optional[dict] = None) -> int:
    """Check the group, then serve (node 0) or compute (other nodes). ``group``: the group's
    spec; ``base``: the command's values (every job's defaults)."""
    from wan_s2v_runner.launcher.serve.http import check_bind
    from wan_s2v_runner.launcher.serve.token import TokenError, token_of

    try:
        token = token_of(args)
    except TokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    refusal = check_bind(args.host, token, args.insecure_no_auth)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return exit_codes.USAGE
    try:
        replicas = _replicas(group, args.replicas)
    except ValueError as e:  # replicas.ReplicaError: the cause and the fix
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    refusal = queue_refusal(args)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return exit_codes.USAGE
    if group.writes_output:  # node 0 owns the directory: one server on it at a time
        from wan_s2v_runner.launcher.serve import lock

        try:
            _hold(lock.hold(root))
        except lock.DirectoryInUse as e:
            print(f"error: {e}", file=sys.stderr)
            return exit_codes.PREFLIGHT
    if args.skip_preflight:
        print("WARNING: --skip-preflight: the group is not checked (each job still is, when submitted)",
              file=sys.stderr)
    else:
        from wan_s2v_runner import preflight

        # each group is checked as it will run (the groups differ only in what of the node they
        # hold), beside the others: they share the host RAM and hold all the node's GPUs between them
        report = preflight.group_gate_report(replicas[0].spec, base, root / "videos", json_mode=args.json,
                                             node_groups=len(replicas))
        if report.refused:
            return exit_codes.PREFLIGHT
        waves = report.data_of("memory.host").get("waves")
        if group.load_waves is None and waves and waves > 1:
            replicas = [replace(r, spec=r.spec.model_copy(update={"load_waves": waves})) for r in replicas]
    if not group.writes_output:
        return _compute_only(replicas[0].spec, extra_env)
    return _serve_node0(args, replicas, base, root, token, extra_env)


def open_queue(args, dirs):
    """The server's :class:`~.queue.JobStore`: ``--queue postgresql://...`` (shared, :mod:`.pg_queue`;
    this server's leases named by its host and directory), else SQLite in the server directory."""
    from wan_s2v_runner.launcher.serve.queue import JobQueue

    if not args.queue:
        return JobQueue(dirs.queue)
    import socket

    from wan_s2v_runner.launcher.serve.pg_queue import PgJobQueue, describe

    queue = PgJobQueue(args.queue, owner=f"{socket.gethostname()}:{dirs.root}", lease_s=float(args.lease_s))
    print(f"serve: the queue is {describe(args.queue)} (shared; leases {args.lease_s} s); shared directory "
          f"{dirs.shared}", flush=True)
    return queue


def queue_refusal(args) -> Optional[str]:
    """Why ``--queue``, ``--shared-dir`` and ``--lease-s`` do not go together (None: they do)."""
    if not args.queue:
        return ("--shared-dir is for a shared --queue (postgresql://...). Fix: drop it, or add --queue"
                if args.shared_dir else None)
    if not args.queue.startswith(("postgresql://", "postgres://")):
        return f"--queue {args.queue!r}: a postgresql:// URL. Fix: --queue postgresql://USER@HOST/DB, or drop it"
    if not args.shared_dir:
        return ("--queue postgresql://... needs --shared-dir DIR: the directory every server mounts for uploads, "
                "videos and clip checkpoints (docs/fleet.md)")
    if args.lease_s < 3:
        return f"--lease-s {args.lease_s}: at least 3 (the heartbeat renews it every third). Fix: --lease-s 30"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "--queue postgresql://... needs psycopg 3. Fix: pip install 'psycopg[binary]'"
    return None


def _replicas(group: GroupSpec, n: int):
    """The server's rank groups (:func:`.replicas.split` over the GPUs or CPUs this process may use)."""
    import os

    from wan_s2v_runner.launcher.serve import replicas

    if n == 1:
        return replicas.split(group, 1)
    if group.device == "cuda":
        from wan_s2v_runner.preflight import machine_facts

        return replicas.split(group, n, gpus=replicas.visible_gpus(machine_facts().gpu_count))
    return replicas.split(group, n, cpus=sorted(os.sched_getaffinity(0)))


def _compute_only(group: GroupSpec, extra_env: Optional[dict]) -> int:
    """Another node: its ranks join every group node 0 starts, until interrupted."""
    from wan_s2v_runner.launcher import launch
    from wan_s2v_runner.launcher.console import Display

    print(f"serve: node {group.node_rank} of {group.nnodes}: computing for the server on node 0 "
          f"({group.master_addr}:{group.master_port}); Ctrl-C to stop", flush=True)
    while True:
        code = launch.run(group, observers=[Display.auto()], extra_env=extra_env, served=True)
        if code == exit_codes.INTERRUPTED:
            return code
        time.sleep(1.0)


def _serve_node0(args, replicas: list, base: dict, root: Path, token: Optional[str],
                 extra_env: Optional[dict]) -> int:
    from wan_s2v_runner.launcher.job_book import job_defaults
    from wan_s2v_runner.launcher.serve.http import run_server
    from wan_s2v_runner.launcher.serve.keeper import Keeper, ServerDirs
    from wan_s2v_runner.launcher.serve.metrics import ServerMetrics
    from wan_s2v_runner.launcher.serve.requests import Policy
    from wan_s2v_runner.launcher.serve.retention import Retention
    from wan_s2v_runner.launcher.serve.state import Server
    from wan_s2v_runner.preflight import machine_facts

    dirs = ServerDirs(root, shared=args.shared_dir.expanduser().absolute() if args.shared_dir else None)
    dirs.videos.mkdir(parents=True, exist_ok=True)
    try:
        queue = open_queue(args, dirs)
    except Exception as e:  # psycopg.OperationalError: the database is not there, or refuses us
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: cannot open the queue: {first}. Fix: check that the database runs and the URL "
              "(user, host, port, database) is right", file=sys.stderr)
        return exit_codes.PREFLIGHT
    policy = Policy(allow_dirs=tuple(p.expanduser().resolve() for p in args.allow_dir),
                    max_upload_bytes=args.max_upload_mb * 2**20, max_audio_s=float(args.max_audio_s))
    metrics = ServerMetrics(queue)
    retention = Retention(keep=args.keep_videos,
                          max_age_s=args.keep_hours * 3600.0 if args.keep_hours is not None else None)
    keepers = [Keeper(r.spec, queue.for_keeper(r.index), dirs, {**(extra_env or {}), **r.env},
                      on_completed=metrics.job_completed, retention=retention, index=r.index, holds=r.holds)
               for r in replicas]
    metrics.attach(keepers)
    if len(keepers) > 1:
        print(f"serve: {len(keepers)} rank groups of {replicas[0].spec.nproc} rank(s): "
              + "; ".join(f"group {r.index} on {r.holds}" for r in replicas), flush=True)
    server = Server(queue=queue, keepers=keepers, dirs=dirs, metrics=metrics,
                    base={k: v for k, v in job_defaults(base).items() if k not in OUTPUT_FIELDS},
                    policy=policy, max_queue=args.max_queue, token=token, facts=machine_facts(),
                    allow_hosts=tuple(args.allow_host), retention=retention, min_free_mb=args.min_free_mb)
    return run_server(server, args.host, args.port)
