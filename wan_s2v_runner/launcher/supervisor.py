"""The supervisor's decisions: what the ranks report and what their processes do, turned into
an :class:`Outcome` (an exit code with its reason, the failing rank and stage, a hint).

:meth:`Supervisor.supervise` is the loop: read the ranks' event files, keep the process table
fresh (:class:`~.processes.RunProcesses`), tell the observers (:mod:`.observer`), and act on what it sees: a signal
(stop every rank), torchrun's exit (success only when every rank ended cleanly), a rank's error or
death (torchrun gets :data:`FAILURE_GRACE_S` to tear the others down, then we do), a stall past
the watchdog's limits (stack dumps, then stop). The verdicts themselves are pure functions:
whether the run is stuck and how to say it (:mod:`.watchdog`), which rank failed first and why
(:mod:`.diagnose`).
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from wan_s2v_runner.launcher.diagnose import (
    analyse_stacks,
    attribute_failures,
    describe_exit,
    has_frame,
    other_nodes_text,
    parse_torchrun_exits,
    read_error_files,
    tail_lines,
    where_ranks_were,
)
from wan_s2v_runner.launcher.observer import Observers
from wan_s2v_runner.launcher.processes import RunProcesses
from wan_s2v_runner.launcher.proctree import proc_state, worker_rank
from wan_s2v_runner.launcher.spawn import expected_ranks
from wan_s2v_runner.launcher.watchdog import Stuck, WatchdogLimits, describe_hang, stalled
from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.events import EventReader
from wan_s2v_runner.shared.spec import GroupSpec
from wan_s2v_runner.shared.stages import Stage

#: after the first failure, torchrun gets this long to tear the others down before we do
FAILURE_GRACE_S = 3.0
#: a worker found dead without an ``end`` record counts as failed after this long (its last
#: records may still be on their way through the file system)
DEATH_SETTLE_S = 0.3
#: how often the supervisor walks /proc for the run's processes (exits are seen at once anyway)
TREE_WALK_S = 1.0
#: one node: once every rank ended cleanly, the node agent gets this long to exit (it takes about a
#: second); a frozen agent (SIGSTOP, a debugger) is then stopped with what is left of the run, and
#: the run ends with the ranks' verdict. Several nodes: torch elastic's own exit barrier bounds it
AGENT_EXIT_GRACE_S = 15.0


def not_started_note(spec: GroupSpec) -> str:
    """Why a rank of this node that never reported has no process: with several nodes, torchrun
    starts its workers only when every node has joined the rendezvous."""
    if spec.nnodes == 1:
        return "torchrun did not start it"
    return (f"torchrun on node {spec.node_rank} is still at the rendezvous on {spec.master_addr}:"
            f"{spec.master_port}, waiting for {other_nodes_text(spec)}: start the same command there "
            "with its --node-rank, or check that it can reach that address")


@dataclass
class Outcome:
    code: int = exit_codes.OK
    reason: str = ""
    failed_rank: Optional[int] = None
    failed_stage: Optional[Stage | str] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    hint: Optional[str] = None
    stuck: Stuck = field(default_factory=dict)
    details: list = field(default_factory=list)  # extra lines for the report (other ranks, stacks)
    torchrun_rc: Optional[int] = None


class Supervisor:
    """Watches one run's ranks and processes and decides how it ends."""

    def __init__(self, spec: GroupSpec, run_dir: Path, observers: Observers, extra_env=None,
                 halt: Optional[threading.Event] = None):
        self.spec, self.run_dir, self.observers = spec, run_dir, observers
        self.halt = halt  # set by another thread (a server shutting down): stop as on SIGTERM
        self.reader = EventReader(run_dir)
        self.processes = RunProcesses(spec, run_dir, self.reader, observers, extra_env)
        self.expected = expected_ranks(spec)
        self.limits = WatchdogLimits(load_s=spec.watchdog_load_s, step_s=spec.watchdog_step_s)
        self.signal_received: Optional[int] = None
        self.t0 = time.time()

    def start(self, early=None) -> None:
        """Start the ranks (``early``: tell the agent spawned before the preflight to go)."""
        self.t0 = self.processes.start(early)

    # ----- watchdog -----
    def stalled(self, now: float) -> Optional[Stuck]:
        """:func:`watchdog.stalled` for this run's ranks (spawned at ``t0``) and limits."""
        return stalled(self.reader.ranks, self.expected, self.t0, now, self.limits)

    # ----- failures -----
    def failures_seen(self, now: float) -> bool:
        """A rank recorded an error, or its process is gone without an ``end`` record."""
        for st in self.reader.ranks.values():
            if st.error:
                return True
            if st.end is None and st.pid:
                dt = self.processes.procs.death_t.get(st.pid)
                if dt is None and not self.processes.procs.alive(st.pid):
                    dt = self.processes.procs.death_t.get(st.pid)
                if dt is not None and now - dt > DEATH_SETTLE_S:
                    return True
        return False

    # ----- main loop -----
    def supervise(self, poll_s: float = 0.2) -> Outcome:
        first_failure_t: Optional[float] = None
        tick = 0
        # /proc walks take CPU from the ranks on a small node: every TREE_WALK_S (and when a rank
        # reports a pid not tracked yet), the command-line scan every tenth walk
        walk_every = max(1, round(TREE_WALK_S / poll_s))
        while True:
            now = time.time()
            new = self.reader.poll()
            if tick % walk_every == 0 or not all(map(self.processes.procs.known, self.processes.local_rank_pids())):
                self.processes.tree(full=tick % (10 * walk_every) == 0)
                self.processes.sample_usage()
            tick += 1
            self.observers.update(self.reader, new, now - self.t0)  # errors: logged (observer.py)
            self.observers.raise_if_strict()
            if self.halt is not None and self.halt.is_set() and self.signal_received is None:
                self.signal_received = signal.SIGTERM
            if self.signal_received is not None:
                where = where_ranks_were(self.reader, self.expected)
                self.processes.stop(grace_s=5.0)
                return Outcome(code=exit_codes.INTERRUPTED,
                               reason=f"interrupted by {signal.Signals(self.signal_received).name}"
                                      + (f" ({where})" if where else "") + "; every rank was stopped",
                               torchrun_rc=self.processes.proc.poll())
            rc = self.processes.proc.poll()
            if rc is not None:
                self.reader.poll()
                if rc == 0:
                    deadline = time.time() + 3.0
                    while self.processes.tree() and time.time() < deadline:
                        time.sleep(0.05)
                    if self.processes.tree():
                        self.processes.stop(grace_s=2.0)
                    self.reader.poll()
                    if all(self.reader.ranks.get(r) and self.reader.ranks[r].end
                           and not self.reader.ranks[r].error for r in self.expected):
                        return Outcome(torchrun_rc=rc)
                # torchrun failed: make sure nothing of the run survives
                rank_failed = any(st.error or (st.end is None and st.pid and not self.processes.procs.alive(st.pid))
                                  for st in self.reader.ranks.values())
                self.processes.stop(grace_s=2.0)
                self.reader.poll()
                if rc < 0 and not rank_failed:
                    # torchrun itself was killed; its workers were still fine (we stopped them)
                    return Outcome(code=exit_codes.RANK_FAILED, torchrun_rc=rc,
                                   reason=f"torchrun (pid {self.processes.proc.pid}) was {describe_exit(rc)} while "
                                          f"the ranks were running ({where_ranks_were(self.reader, self.expected)}); "
                                          "the launcher stopped the ranks",
                                   hint="Something outside the run killed torchrun (the OOM killer? a job "
                                        "scheduler? `kill`?): check `dmesg` and the scheduler's logs.")
                return self._failure(rc)
            if self._ended_but_the_agent(now):
                return self._agent_left_behind(now)
            if first_failure_t is None and self.failures_seen(now):
                first_failure_t = now
            if first_failure_t is not None and now - first_failure_t > FAILURE_GRACE_S:
                # torchrun normally tears the others down itself; don't wait for collectives to time out
                self.processes.stop(grace_s=2.0)
                self.reader.poll()
                return self._failure(self.processes.proc.poll())
            stuck = None if first_failure_t is not None else self.stalled(now)
            if stuck:
                return self._hang(stuck, now)
            time.sleep(poll_s)

    def _ended_but_the_agent(self, now: float) -> bool:
        """One node: every rank ended cleanly :data:`AGENT_EXIT_GRACE_S` ago or more, and the node
        agent is still there (it has never been that slow: it is frozen, and its ranks may wait on
        it, e.g. for the rendezvous store it holds, as they exit)."""
        if self.spec.nnodes != 1 or self.processes.proc is None or self.processes.proc.poll() is not None:
            return False
        ends = [self.reader.ranks[r].end for r in self.expected if r in self.reader.ranks]
        if len(ends) < len(self.expected) or not all(ends) or any(self.reader.ranks[r].error for r in self.expected):
            return False
        return now - max(float(e["t"]) for e in ends) >= AGENT_EXIT_GRACE_S

    def _agent_left_behind(self, now: float) -> Outcome:
        """The run ended with its ranks; the agent that did not follow is stopped with whatever is
        left (SIGTERM, then SIGKILL: a stopped process dies of it too), and the run says so."""
        pid, state = self.processes.proc.pid, proc_state(self.processes.proc.pid)
        self.processes.stop(grace_s=2.0)
        self.reader.poll()
        said = (f"every rank ended, but the node agent (pid {pid}, {state or 'state unknown'}) had not exited "
                f"{AGENT_EXIT_GRACE_S:g} s later; it and what was left of the run were stopped")
        return Outcome(torchrun_rc=self.processes.proc.poll(), details=[said])

    def _hang(self, stuck: Stuck, now: float) -> Outcome:
        """Read what is left of the stuck ranks (the processes of ranks that never reported,
        every rank's stacks), stop the run, and report it."""
        live = self.processes.tree(full=True)
        never = stuck.get(Stage.START, [])
        silent = {}  # rank -> (pid, state) of workers that never reported, read before stopping
        for pid in live:
            r = worker_rank(pid)
            if r in never:
                silent[r] = (pid, proc_state(pid))
        stacks = self.processes.dump_stacks()
        self.processes.stop(grace_s=2.0)
        self.reader.poll()
        stuck_ranks = sorted(r for rs in stuck.values() for r in rs)
        remote = other_nodes_text(self.spec) if self.spec.nnodes > 1 else None
        report = describe_hang(stuck, self.reader.ranks, now=now, limits=self.limits,
                               stacks_dir=self.run_dir / "stacks",
                               stack_lines=analyse_stacks(self.run_dir, stuck_ranks, remote=remote), silent=silent,
                               not_started=not_started_note(self.spec))
        return Outcome(code=exit_codes.HUNG, stuck=stuck, failed_stage=next(iter(stuck)),
                       reason=report.reason, hint=report.hint, details=list(report.details),
                       traceback=None if stacks else "no stack dumps were written",
                       torchrun_rc=self.processes.proc.poll())

    def _failure(self, rc: Optional[int]) -> Outcome:
        """Gather what tells which rank failed first (events, error files, exit times, torchrun's
        exit codes, crash stacks), let :func:`diagnose.attribute_failures` decide, report it."""
        if self.processes.proc is not None and self.processes.proc.poll() is not None:
            self.processes.join_pump(timeout=2.0)  # torchrun's failure summary (exit codes) into torchrun.log
        ranks = self.reader.ranks
        stacks = self.run_dir / "stacks"
        failures = attribute_failures(
            ranks, error_files=read_error_files(self.run_dir, self.spec.node_rank * self.spec.nproc),
            death_times=dict(self.processes.procs.death_t), exit_codes=parse_torchrun_exits(self.processes.log_path),
            crash_stacks={r: stacks / f"rank{r}.txt" for r in ranks if has_frame(stacks / f"rank{r}.txt")},
            spec=self.spec)
        if not failures:
            missing = sorted(set(self.expected) - set(ranks))
            return Outcome(code=exit_codes.RANK_FAILED, torchrun_rc=rc,
                           reason=f"torchrun exited with {rc}"
                           + (f"; ranks {missing} never started" if missing else ""),
                           traceback=tail_lines(self.processes.log_path, 30),
                           hint="torchrun itself failed: see torchrun.log in the run directory "
                                "(rendezvous port in use? another node unreachable?)")
        cause = failures[0]
        return Outcome(code=exit_codes.RANK_FAILED, failed_rank=cause.rank, failed_stage=cause.stage,
                       error=cause.message, traceback=cause.traceback, reason=cause.headline(),
                       hint=cause.hint, details=[f.also_line() for f in failures[1:]], torchrun_rc=rc)

    def on_signal(self, signum, _frame) -> None:
        if self.signal_received is not None:
            self.processes.force = True
        self.signal_received = signum
