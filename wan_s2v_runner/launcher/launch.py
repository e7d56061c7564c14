"""The launcher: spawn a rank group's agent (torch elastic's, :mod:`wan_s2v_runner.rank.agent`) and supervise it.

Three callers, one for each kind of group, of one core (:func:`_supervise`):

- :func:`run`: ``wan-s2v run`` (and ``resume``), a group with its one job, the run's own spec; its
  agent may have been spawned before the preflight (:func:`prepare`);
- :func:`run_batch`: ``wan-s2v batch``, a group that makes the jobs listed in ``jobs.jsonl``;
- :func:`run_served`: a server's group (``wan-s2v serve``), which makes whatever the server posts
  to its inbox until it says stop, and which the server may halt from its own thread.

Each makes the run directory (``<runs_root>/<time>-<mode>/``) and writes the group's ``spec.json``
once, with where its jobs come from (:mod:`wan_s2v_runner.shared.job_source`: what every rank
reads), then the core spawns the agent (:mod:`.spawn` builds the command), supervises it
(:class:`~.supervisor.Supervisor`: live progress, the hang watchdog, fast stop of every rank
when one fails or on Ctrl-C/SIGTERM, a failure report naming the *first* failing rank), removes
what a killed rank left half-written, and writes ``run.json``, the manifest. Each returns an exit
code from :mod:`wan_s2v_runner.shared.exit_codes`. See docs/supervision.md.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from wan_s2v_runner.launcher import full_disk, manifest
from wan_s2v_runner.launcher.console import Display
from wan_s2v_runner.launcher.diagnose import parse_torchrun_exits
from wan_s2v_runner.launcher.observer import Observers, RunObserver
from wan_s2v_runner.launcher.processes import EarlyAgent
from wan_s2v_runner.launcher.proctree import cpu_s
from wan_s2v_runner.launcher.spawn import finalize_spec, make_run_dir
from wan_s2v_runner.launcher.supervisor import Outcome, Supervisor
from wan_s2v_runner.shared import atomic, exit_codes, inbox, job_source
from wan_s2v_runner.shared.job_source import JobSource
from wan_s2v_runner.shared.jobs import Job, write_jobs
from wan_s2v_runner.shared.spec import GroupSpec, JobSpec, RunSpec
from wan_s2v_runner.shared.stages import Stage


def _output_stamp(path: Path) -> Optional[tuple]:
    try:
        s = path.stat()
        return (s.st_ino, s.st_mtime_ns, s.st_size)
    except OSError:
        return None


def cleanup_partial_outputs(jobs: Sequence[JobSpec], pids: list[int]) -> list[Path]:
    """Remove temporary files the ranks left next to the jobs' outputs (a rank killed while
    saving); every writer names them by :func:`atomic.temp_name`."""
    removed = []
    patterns = []
    for pid in pids:
        for dest in {d for job in jobs for d in (job.output, job.frames_out)}:
            if dest is not None:
                patterns.append((dest.parent, atomic.leftover_pattern(dest, pid)))
    for d, pat in patterns:
        for p in d.glob(pat):
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed


def _remove_empty_stacks(run_dir: Path) -> None:
    d = run_dir / "stacks"
    for f in d.glob("*.txt"):
        try:
            if f.stat().st_size == 0:
                f.unlink()
        except OSError:
            pass
    try:
        d.rmdir()  # only if empty
    except OSError:
        pass


@dataclass
class Prepared:
    """``wan-s2v run``'s head start (:func:`prepare`): the run directory and its spec, and the
    node's agent importing torch and the engine while the launcher's preflight runs."""

    spec: GroupSpec
    run_dir: Path
    agent: EarlyAgent
    made_root: bool  # the runs root did not exist before

    def abandon(self) -> None:
        """The run will not start (refused, or the launcher stopped): end the agent, remove the
        run directory (and the runs root, when it made that and it is empty): nothing is left."""
        self.agent.abandon()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.made_root:
            try:
                self.run_dir.parent.rmdir()
            except OSError:  # another run's directory is there now
                pass


def _new_run(spec: GroupSpec, source: JobSource, jobs: Optional[list[Job]] = None) -> tuple[GroupSpec, Path]:
    spec = finalize_spec(spec)
    run_dir = make_run_dir(spec)
    job_source.write_spec(run_dir, spec, source)
    if source is JobSource.LIST:
        write_jobs(run_dir, jobs or [])
    if source is JobSource.INBOX:
        inbox.inbox_of(run_dir).mkdir()
    return spec, run_dir


def prepare(spec: GroupSpec, extra_env: Optional[dict] = None) -> Prepared:
    """Make the run directory now and spawn its agent waiting (:class:`EarlyAgent`): the imports a
    rank needs (3-8 s) overlap the checks before it. Pass the result to :func:`run` (with the spec
    the checks settled on: :attr:`Prepared.spec`, updated) or :meth:`~Prepared.abandon` it."""
    made_root = not spec.runs_root.exists()
    spec, run_dir = _new_run(spec, JobSource.RUN)
    return Prepared(spec, run_dir, EarlyAgent(spec, run_dir, extra_env), made_root)


def run(spec: RunSpec, *, observers: Optional[list[RunObserver]] = None, extra_env: Optional[dict] = None,
        prepared: Optional[Prepared] = None) -> int:
    """``wan-s2v run``: one rank group that makes the run's own job (``spec``). ``prepared``: the
    run directory and waiting agent of :func:`prepare` (``spec``: its spec, as the checks left it).
    ``observers`` (default: the console) are told how it goes (:mod:`.observer`)."""
    if not isinstance(spec, RunSpec):
        raise TypeError("launch.run makes a run's own job: a RunSpec (a group's jobs: run_batch or run_served)")
    if prepared is None:
        spec, run_dir = _new_run(spec, JobSource.RUN)
    else:
        spec, run_dir = finalize_spec(spec), prepared.run_dir
        if spec != prepared.spec:  # the agent reads it once told to go
            job_source.write_spec(run_dir, spec, JobSource.RUN)
    return _supervise(spec, run_dir, observers, extra_env, outputs=[spec], own_job=spec,
                      agent=prepared.agent if prepared is not None else None)


def run_batch(group: GroupSpec, jobs: list[Job], *, observers: Optional[list[RunObserver]] = None,
              extra_env: Optional[dict] = None) -> int:
    """``wan-s2v batch``: one rank group of ``group`` that makes each of ``jobs`` in turn."""
    spec, run_dir = _new_run(group, JobSource.LIST, jobs)
    return _supervise(spec, run_dir, observers, extra_env, outputs=[job.spec for job in jobs])


def run_served(group: GroupSpec, *, observers: Optional[list[RunObserver]] = None,
               extra_env: Optional[dict] = None, halt: Optional[threading.Event] = None) -> int:
    """A server's rank group of ``group``: it loads once and makes whatever the server posts to
    its inbox (:mod:`wan_s2v_runner.shared.inbox`) until it says stop. ``halt`` set from another
    thread stops the ranks as a signal would."""
    spec, run_dir = _new_run(group, JobSource.INBOX)
    return _supervise(spec, run_dir, observers, extra_env, halt=halt)


def _supervise(spec: GroupSpec, run_dir: Path, observers: Optional[list[RunObserver]], extra_env: Optional[dict],
               *, outputs: Sequence[JobSpec] = (), own_job: Optional[RunSpec] = None,
               halt: Optional[threading.Event] = None, agent: Optional[EarlyAgent] = None) -> int:
    """Spawn (or tell ``agent`` to go) and supervise the rank group of ``spec`` in ``run_dir``;
    remove what a killed rank left of ``outputs``; for a run (``own_job``), an exit 0 that wrote
    no video is a failure; a failure a full disk caused (a rank's, or writing run.json) is
    ``disk-full``, in one line (:mod:`.full_disk`); write run.json. Returns an exit code (see
    exit_codes)."""
    watchers = Observers(observers if observers is not None else [Display.auto()], strict=spec.strict_observers)
    watchers.started(spec, run_dir)
    sup = Supervisor(spec, run_dir, watchers, extra_env, halt=halt)
    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
                continue  # under nohup: keep ignoring hangups
            old[s] = signal.signal(s, sup.on_signal)
    before = _output_stamp(own_job.output) if own_job else None
    started = time.time()
    cpu_before = cpu_s(os.getpid()) or 0.0
    try:
        try:
            sup.start(agent)
            outcome = sup.supervise()
        except BaseException:
            sup.processes.force = True  # the launcher itself failed: leave nothing behind
            sup.processes.stop(grace_s=0)
            raise
        finally:
            sup.processes.close()
        procs = sup.processes
        rank_pids = [st.pid for st in sup.reader.ranks.values() if st.pid]
        cleanup_partial_outputs(outputs, rank_pids)
        _remove_empty_stacks(run_dir)
        sup.reader.poll()
        if outcome.code == exit_codes.OK and own_job and spec.writes_output and \
                (not own_job.output.is_file() or _output_stamp(own_job.output) == before):
            failed = next((st for _, st in sorted(sup.reader.ranks.items()) if st.job_failed), None)
            outcome = Outcome(code=exit_codes.RANK_FAILED, torchrun_rc=outcome.torchrun_rc,
                              reason=f"the run ended but {own_job.output} was not written"
                              + (f": {failed.job_failed.get('error')}" if failed else ""),
                              failed_rank=failed.rank if failed else None,
                              failed_stage=Stage.coerce(failed.job_failed.get("stage", "?")) if failed else None,
                              error=failed.job_failed.get("error") if failed else None)
        served = own_job is None and not outputs
        facts = full_disk.facts_of(outcome, sup.reader.ranks)
        if facts is not None:
            outcome = full_disk.outcome(outcome, facts, run_dir, own_job, served)
        data = manifest.build(spec, run_dir, sup.reader, outcome, started, time.time(),
                              launcher={"pid": os.getpid(), "torchrun_pid": procs.proc.pid if procs.proc else None,
                                        "torchrun_exit_code": outcome.torchrun_rc,
                                        "agent": procs.origin.to_json() if procs.origin else None,
                                        "host_peak_rss_mb_seen": {str(k): v for k, v in procs.host_hwm_mb.items()},
                                        "cpu_s": {"launcher": round((cpu_s(os.getpid()) or 0.0) - cpu_before, 3),
                                                  "torchrun": procs.torchrun_cpu_s},
                                        "rank_exit_codes": {str(k): v for k, v in
                                                            parse_torchrun_exits(procs.log_path).items()} or None,
                                        "signal": signal.Signals(sup.signal_received).name
                                        if sup.signal_received else None})
        try:
            atomic.write_text(run_dir / "run.json", json.dumps(data, indent=2, default=str))
        except OSError as e:
            facts = full_disk.written_by_launcher(e)
            if facts is None:
                raise
            if outcome.code in (exit_codes.RANK_FAILED, exit_codes.HUNG):  # the disk filled under the run:
                outcome = full_disk.outcome(outcome, facts, run_dir, own_job, served)  # the likeliest cause
            elif outcome.code != exit_codes.DISK_FULL:  # made (only its manifest is missing), or interrupted
                outcome.details = [*outcome.details, f"run.json was not written: {e}"]
            data["exit"].update(code=outcome.code, status=exit_codes.NAMES[outcome.code], reason=outcome.reason)
        watchers.finished(spec, run_dir, outcome, data)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return outcome.code
