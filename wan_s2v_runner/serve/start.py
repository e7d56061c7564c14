"""``wan-s2v serve``'s start: from the command's values to a running server.

The command's values (flags < ``--config`` < environment, as for ``run``) give the rank group's
settings (its :class:`~wan_s2v_runner.shared.spec.GroupSpec`: checkpoint, mode and layout, LoRAs,
device, attention: fixed for the server's life), every job's defaults (steps, size, ...; a
default ``--image``/``--audio`` too, for a server that always animates one face), and the
server's own settings (:class:`~.settings.ServerSettings`). The group is checked by preflight
before anything spawns (:func:`~wan_s2v_runner.preflight.check_group`: the machine, engine,
checkpoint, LoRAs and the memory plan at the default size; the input checks wait for a job's
inputs); each job is checked whole when it is submitted.

On node 0 the server then opens its queue, joins its pool of the fleet (its identity recorded, or
compared with the pool's: :mod:`.fleet`), makes sure its shared directory is the fleet's, and
starts the keepers and the HTTP API (:func:`.http.run_server`); on any other node it only runs
that node's ranks, relaunching them whenever the group ends (node 0 restarts it after a failure),
until interrupted.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.serve.settings import ServerSettings
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


def _error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def serve(settings: ServerSettings, group: GroupSpec, base: dict[str, Any], extra_env: Optional[dict] = None) -> int:
    """Check the group, then serve (node 0) or compute (other nodes). ``group``: the group's
    spec; ``base``: the command's values (every job's defaults)."""
    root = settings.server_dir
    try:
        replicas = _replicas(group, settings.replicas)
    except ValueError as e:  # replicas.ReplicaError: the cause and the fix
        return _error(str(e), exit_codes.USAGE)
    if group.writes_output:  # node 0 owns the directory: one server on it at a time
        from wan_s2v_runner.serve import lock

        try:
            _hold(lock.hold(root))
        except lock.DirectoryInUse as e:
            return _error(str(e), exit_codes.PREFLIGHT)
    if settings.skip_preflight:
        print("WARNING: --skip-preflight: the group is not checked (each job still is, when submitted)",
              file=sys.stderr)
    else:
        from wan_s2v_runner import preflight

        # each group is checked as it will run (the groups differ only in what of the node they
        # hold), beside the others: they share the host RAM and hold all the node's GPUs between them
        report = preflight.group_gate_report(replicas[0].spec, base, root / "videos",
                                             json_mode=settings.json_output, node_groups=len(replicas))
        if report.refused:
            return exit_codes.PREFLIGHT
        replicas = [replace(r, spec=r.spec.model_copy(update=report.settled(group))) for r in replicas]
    if not group.writes_output:
        return _compute_only(replicas[0].spec, extra_env)
    return _serve_node0(settings, replicas, base, extra_env)


def open_store(settings: ServerSettings, dirs):
    """The server's :class:`~.store.protocol.JobStore`: ``--queue postgresql://...`` (shared,
    :mod:`.store.postgres`; this server's leases named by its host and directory), else SQLite in
    the server directory."""
    if not settings.queue:
        from wan_s2v_runner.serve.store.sqlite import SqliteJobStore

        return SqliteJobStore(dirs.queue, pool=settings.pool)
    from wan_s2v_runner.serve.fleet import who_am_i
    from wan_s2v_runner.serve.store.postgres import PgJobStore

    store = PgJobStore(settings.queue, owner=who_am_i(dirs), lease_s=float(settings.lease_s), pool=settings.pool)
    print(f"serve: the queue is {store.store_describe()} (shared; pool {settings.pool!r}; "
          f"leases {settings.lease_s} s); shared directory {dirs.shared}", flush=True)
    return store


@dataclass(frozen=True)
class FleetPlace:
    """Where this server stands in its fleet: the fleet's id, its pool's identity digest, and what
    its records are stamped with."""

    fleet_id: str
    digest: str
    stamp: dict


def join_fleet(settings: ServerSettings, group: GroupSpec, store, dirs) -> FleetPlace | tuple[str, int]:
    """Join the pool (its identity recorded by its first server, else compared) and settle the
    shared directory (marked by the fleet's first server, else checked). Returns where the server
    stands, or (the refusal, its exit code)."""
    from wan_s2v_runner.serve import fleet
    from wan_s2v_runner.serve.store.protocol import JobStatus

    t0 = time.time()
    identity = fleet.identity_of(group)
    digest = fleet.digest_of(identity)
    joined = store.pool_join(digest, identity, fleet.who_am_i(dirs))
    print(f"serve: pool {settings.pool!r} of fleet {joined.fleet_id[:12]}: identity {digest[:12]} "
          f"({'recorded by this server' if joined.created_pool else 'checked'}; {time.time() - t0:.1f} s)", flush=True)
    if not joined.matches(digest):
        counts = store.job_counts(pool=settings.pool)
        idle = not counts[JobStatus.QUEUED.value] and not counts[JobStatus.IN_PROGRESS.value]
        if store.shared or not idle:  # one server's own pool with nothing waiting: it takes it over
            return fleet.mismatch(joined, identity, settings.pool), exit_codes.FLEET_MISMATCH
        what = ", ".join(fleet.differences(identity, joined.pool.identity))
        print(f"serve: pool {settings.pool!r} had another identity ({what}) and no job waiting: it is this "
              "server's now", flush=True)
        store.pool_reset(digest, identity, fleet.who_am_i(dirs))
    problem = fleet.settle_marker(dirs, joined, store.store_describe(), store)
    if problem is not None:
        return problem, exit_codes.SHARED_DIR
    return FleetPlace(joined.fleet_id, digest, {"pool": settings.pool, "fleet_identity": digest,
                                                "wan_s2v": fleet.runner_version()})


def _replicas(group: GroupSpec, n: int):
    """The server's rank groups (:func:`.replicas.split` over the GPUs or CPUs this process may use)."""
    import os

    from wan_s2v_runner.serve import replicas

    if n == 1:
        return replicas.split(group, 1)
    if group.device == "cuda":
        from wan_s2v_runner.preflight import machine_facts

        return replicas.split(group, n, gpus=replicas.visible_gpus(machine_facts().gpu_count))
    return replicas.split(group, n, cpus=sorted(os.sched_getaffinity(0)))


def _compute_only(group: GroupSpec, extra_env: Optional[dict]) -> int:
    """Another node: its ranks join every group node 0 starts, until interrupted."""
    from wan_s2v_runner.serve.group import compute_for_node0

    print(f"serve: node {group.node_rank} of {group.nnodes}: computing for the server on node 0 "
          f"({group.master_addr}:{group.master_port}); Ctrl-C to stop", flush=True)
    return compute_for_node0(group, extra_env)


def _serve_node0(settings: ServerSettings, replicas: list, base: dict, extra_env: Optional[dict]) -> int:
    from wan_s2v_runner.launcher.job_book import job_defaults
    from wan_s2v_runner.preflight import machine_facts
    from wan_s2v_runner.serve.dirs import ServerDirs
    from wan_s2v_runner.serve.fleet import shared_dir_problem
    from wan_s2v_runner.serve.keeper import Keeper
    from wan_s2v_runner.serve.listener import run_server
    from wan_s2v_runner.serve.metrics import ServerMetrics
    from wan_s2v_runner.serve.retention import Retention
    from wan_s2v_runner.serve.state import Server
    from wan_s2v_runner.serve.store.protocol import QueueUnavailable
    from wan_s2v_runner.serve.submissions import Policy
    from wan_s2v_runner.serve.watch import Watch

    dirs = ServerDirs(settings.server_dir, shared=settings.shared_dir)
    if dirs.shared is None:
        dirs.videos.mkdir(parents=True, exist_ok=True)  # a shared directory is the fleet's: never made here
    try:
        store = open_store(settings, dirs)
    except Exception as e:  # the database is not there, or refuses us
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _error(f"cannot open the queue: {first}. Fix: check that the database runs and the URL (user, host, "
                      "port, database) is right", exit_codes.PREFLIGHT)
    try:
        place = join_fleet(settings, replicas[0].spec, store, dirs)
    except QueueUnavailable as e:
        store.close()
        return _error(f"cannot join the fleet: {e}. Fix: check that the database runs", exit_codes.PREFLIGHT)
    if isinstance(place, tuple):
        store.close()
        return _error(*place)
    dirs.videos.mkdir(parents=True, exist_ok=True)
    watch = Watch(store, lambda: shared_dir_problem(dirs, place.fleet_id, store.store_describe()))
    policy = Policy(allow_dirs=settings.allow_dir, max_upload_bytes=settings.max_upload_mb * 2**20,
                    max_audio_s=float(settings.max_audio_s))
    metrics = ServerMetrics(store, watch)
    retention = Retention(keep=settings.keep_videos, max_age_s=settings.max_age_s)
    from wan_s2v_runner.preflight.checks_time import planned_clip_seconds
    from wan_s2v_runner.serve.sessions import Sessions
    facts = machine_facts()
    sessions = Sessions(idle_s=settings.session_idle_s)
    keepers = [Keeper(r.spec, store.store_for_keeper(r.index), dirs, {**(extra_env or {}), **r.env},
                      on_completed=metrics.job_completed, retention=retention, index=r.index, holds=r.holds,
                      may_claim=watch.claim_refusal, stamp=place.stamp,
                      plan_clip_s=lambda spec: planned_clip_seconds(spec, facts))
               for r in replicas]
    metrics.attach(keepers)
    if len(keepers) > 1:
        print(f"serve: {len(keepers)} rank groups of {replicas[0].spec.nproc} rank(s): "
              + "; ".join(f"group {r.index} on {r.holds}" for r in replicas), flush=True)
    server = Server(queue=store, keepers=keepers, dirs=dirs, metrics=metrics, watch=watch, settings=settings,
                    base={k: v for k, v in job_defaults(base).items() if k not in OUTPUT_FIELDS},
                    policy=policy, facts=facts, retention=retention, identity=place.digest, sessions=sessions)
    return run_server(server)
