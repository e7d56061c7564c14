"""The processes of one run: the node's agent ("torchrun": torch elastic's agent,
:mod:`wan_s2v_runner.rank.agent`; its own session; it ends when the launcher dies) and every
worker it forks. :class:`RunProcesses` starts the agent (forked by the node's warm agent where
one listens, :mod:`.warm`, else spawned with PR_SET_PDEATHSIG), or adopts an :class:`EarlyAgent`
started before the preflight, with its output pumped to ``torchrun.log`` and the
observers, finds the run's processes (torchrun's descendants, the pids ranks report, command lines
naming the run's ``spec.json``), notes each exit as it happens (:class:`~.proctree.ProcTable`),
samples their memory and CPU, asks them for stack dumps, and stops them all. It decides nothing:
:class:`~.supervisor.Supervisor` does.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional, Union

from wan_s2v_runner.launcher.diagnose import has_frame
from wan_s2v_runner.launcher.observer import Observers
from wan_s2v_runner.launcher.proctree import (
    ProcTable,
    cpu_s,
    descendants,
    pdeathsig_preexec,
    pids_with_cmdline,
    ppid_map,
)
from wan_s2v_runner.launcher.spawn import agent_argv, worker_env
from wan_s2v_runner.launcher.warm import AgentOrigin, ForkedAgent, fork_agent
from wan_s2v_runner.shared import atomic
from wan_s2v_runner.shared.events import EventReader, RankState
from wan_s2v_runner.shared.node_agent import AGENT_MODULE
from wan_s2v_runner.shared.procfs import hwm_mb
from wan_s2v_runner.shared.spec import GroupSpec


def _start_agent(argv: list[str], spec: GroupSpec, extra_env: Optional[dict], stdin) \
        -> tuple[Union[subprocess.Popen, ForkedAgent], AgentOrigin]:
    """The node's agent in its own session (it dies with the launcher), its output on one pipe
    (the launcher's pump reads it): forked by the node's warm agent where one listens and can
    (:mod:`.warm`), else spawned (PR_SET_PDEATHSIG)."""
    env = worker_env(spec, extra_env)
    forked, origin = fork_agent(argv, env, os.getcwd(), stdin, spec.wan_repo)
    if forked is not None:
        return forked, origin
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=stdin, env=env,
                            start_new_session=True, cwd=os.getcwd(), preexec_fn=pdeathsig_preexec()), origin


class EarlyAgent:
    """A run's agent spawned before the launcher's preflight (``wan-s2v run``): it imports torch
    and the engine meanwhile, then waits for :meth:`go` (stdin ``go``); :meth:`abandon` (the run
    was refused) ends it before any rank starts. Its output waits in the pipe until the run's
    :class:`RunProcesses` adopts it."""

    def __init__(self, spec: GroupSpec, run_dir: Path, extra_env: Optional[dict] = None):
        self.argv = agent_argv(run_dir, wait=True)
        self.proc, self.origin = _start_agent(self.argv, spec, extra_env, stdin=subprocess.PIPE)

    def go(self) -> None:
        try:
            self.proc.stdin.write(b"go\n")  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:  # it died already: the supervisor sees its exit
            pass

    def abandon(self) -> None:
        """End the agent without starting a rank (end of its input), at once if it lingers."""
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class RunProcesses:
    """Owns the torchrun process tree of one run."""

    def __init__(self, spec: GroupSpec, run_dir: Path, reader: EventReader, observers: Observers, extra_env=None):
        self.spec, self.run_dir, self.reader, self.observers = spec, run_dir, reader, observers
        self.log_path = run_dir / "torchrun.log"
        self.proc: Optional[Union[subprocess.Popen, ForkedAgent]] = None
        self.origin: Optional[AgentOrigin] = None  # forked by the warm agent, or spawned (why)
        self.procs = ProcTable()
        self.extra_env = extra_env
        self.force = False  # stop with SIGKILL at once (a second signal, or the launcher failed)
        self.host_hwm_mb: dict[int, float] = {}  # rank -> VmHWM seen by the launcher
        self.torchrun_cpu_s: Optional[float] = None  # torchrun's agent, last seen alive
        self._pump_thread: Optional[threading.Thread] = None
        self.log_error: Optional[str] = None  # why torchrun.log stopped being written (a full disk)
        self._needle = str(run_dir / "spec.json").encode()
        self._host = os.uname().nodename

    def start(self, early: Optional["EarlyAgent"] = None) -> float:
        """Start the ranks: spawn the node's agent, or tell ``early`` (spawned before the
        launcher's preflight, preloaded since) to go; returns the time the ranks' start began
        (the watchdog counts a rank that never reports from it)."""
        argv = early.argv if early is not None else agent_argv(self.run_dir)
        atomic.write_text(self.run_dir / "command.json", json.dumps(argv, indent=1))
        t0 = time.time()
        self.proc, self.origin = (early.proc, early.origin) if early is not None else \
            _start_agent(argv, self.spec, self.extra_env, stdin=subprocess.DEVNULL)
        self._pump_thread = threading.Thread(target=self._pump, daemon=True, name="wan-s2v-pump")
        self._pump_thread.start()
        if early is not None:
            early.go()
        return t0

    def _pump(self) -> None:
        """torchrun's output into torchrun.log and to the observers, until it ends. A log that can
        no longer be written (a full disk) stops being written: the output still goes to the
        observers and is still read (a pipe left unread would stall the ranks' own output)."""
        log = open(self.log_path, "w", encoding="utf-8")
        try:
            for raw in self.proc.stdout:  # type: ignore[union-attr]
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if self.log_error is None:
                    try:
                        log.write(line + "\n")
                        log.flush()
                    except OSError as e:
                        self.log_error = f"{self.log_path} stopped being written: {e.strerror or e}"
                self.observers.log_line(line)  # an observer's error is logged there, never stops the log
        finally:
            try:
                log.close()
            except OSError:  # what a full disk left unwritten
                pass

    def join_pump(self, timeout: float = 3.0) -> None:
        if self._pump_thread is not None:
            self._pump_thread.join(timeout)

    def tree(self, full: bool = False) -> list[int]:
        """Live processes of the run (torchrun excluded): found from torchrun's and the known
        workers' children, the ranks' hello records, and (``full``) command lines naming our
        spec.json (catches a worker orphaned before it reported)."""
        for pid in self.local_rank_pids():
            self.procs.track(pid)
        roots = [p for p in self.procs.start if self.procs.alive(p)]
        if self.proc is not None and self.proc.poll() is None:
            roots.append(self.proc.pid)
        found = descendants(roots, ppid_map())
        if full:
            found |= pids_with_cmdline(AGENT_MODULE.encode(), self._needle)
        found.discard(os.getpid())
        if self.proc is not None:
            found.discard(self.proc.pid)
        for p in found:
            self.procs.track(p)
        return sorted(p for p in self.procs.start if self.procs.alive(p))

    def local_rank_pids(self) -> list[int]:
        """Pids the ranks of this node reported (never a pid of another machine)."""
        return [st.pid for st in self.reader.ranks.values() if st.pid and st.host in (None, self._host)]

    def rank_alive(self, st: RankState) -> bool:
        return bool(st.pid) and self.procs.alive(st.pid)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM torchrun and every process of the run, SIGKILL what is left after grace_s.
        Returns when none is left (or after a last 10 s of SIGKILL)."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if self.force:
                sig = signal.SIGKILL
            left_to_torchrun = self._left_to_torchrun(sig)
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            for p in self.tree(full=True):
                if p not in left_to_torchrun:
                    self.procs.kill(p, sig)
            deadline = time.time() + wait_s
            while time.time() < deadline:
                time.sleep(0.05)
                if self.proc.poll() is None:
                    continue
                if not self.tree(full=True):
                    return
                if self.force and sig == signal.SIGTERM:
                    break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _left_to_torchrun(self, sig: int) -> set[int]:
        """The workers that get ``sig`` from torchrun alone: on SIGTERM, while torchrun lives,
        its direct children (the ranks). Its agent passes SIGTERM on to each worker it started,
        and a second SIGTERM landing while a rank's faulthandler writes its at-stop stacks cuts
        that dump short (faulthandler chains with SA_NODEFER; the nested call's reentrancy guard
        skips the dump and goes straight to the default action: the file ends mid-line)."""
        if sig != signal.SIGTERM or self.proc is None or self.proc.poll() is not None:
            return set()
        return set(ppid_map().get(self.proc.pid, ()))

    def dump_stacks(self, wait_s: float = 3.0) -> list[Path]:
        """SIGUSR1 every live rank (faulthandler writes stacks/rank{r}.txt); wait until each
        file has a Python frame (or wait_s); then py-spy, if installed."""
        live = [st for st in self.reader.ranks.values() if self.rank_alive(st)]
        for st in live:
            self.procs.kill(st.pid, signal.SIGUSR1)
        deadline = time.time() + wait_s
        files = [self.run_dir / "stacks" / f"rank{st.rank}.txt" for st in live]
        while time.time() < deadline:
            if all(has_frame(f) for f in files):
                break
            time.sleep(0.05)
        self._pyspy(live)
        return [f for f in files if has_frame(f)]

    def _pyspy(self, live: list[RankState]) -> None:
        import shutil
        exe = shutil.which("py-spy")
        if not exe:
            return
        for st in live:
            try:
                out = subprocess.run([exe, "dump", "--pid", str(st.pid)], capture_output=True,
                                     text=True, timeout=20)
                (self.run_dir / "stacks" / f"rank{st.rank}.py-spy.txt").write_text(out.stdout + out.stderr)
            except (OSError, subprocess.SubprocessError):
                continue

    def sample_usage(self) -> None:
        """Peak RSS of each rank, and torchrun's own CPU seconds so far (for run.json)."""
        if self.proc is not None and self.proc.poll() is None:
            self.torchrun_cpu_s = cpu_s(self.proc.pid) or self.torchrun_cpu_s
        for st in self.reader.ranks.values():
            if st.pid and self.procs.alive(st.pid):
                hwm = hwm_mb(st.pid)
                if hwm is not None:
                    self.host_hwm_mb[st.rank] = max(hwm, self.host_hwm_mb.get(st.rank, 0.0))

    def close(self) -> None:
        self.procs.close()
        if self.proc is not None and self.proc.stdout is not None:
            self.join_pump(timeout=2.0)
        if isinstance(self.proc, ForkedAgent):  # its connection (an agent still alive then gets SIGTERM)
            self.proc.close()
