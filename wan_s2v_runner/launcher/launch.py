"""The launcher: spawn ``python -m torch.distributed.run`` for a spec and supervise it.

One call, :func:`run`, does it all: make the run directory (``<runs_root>/<time>-<mode>/``),
write ``spec.json`` once, spawn torchrun with an argument list (per-rank logs and torch elastic
error files under ``logs/``), then watch the ranks' event files: live progress, the hang
watchdog (stage-aware limits; SIGUSR1 -> faulthandler stack dump per rank; then stop), fast stop
of every rank when one fails or on Ctrl-C/SIGTERM, a failure report (the *first* failing rank,
its stage, traceback, hint), and ``run.json``, the manifest. Returns an exit code from
:mod:`exit_codes`. See docs/supervision.md.

Processes of a run (torchrun in its own session with PR_SET_PDEATHSIG, workers in theirs) are
tracked by :mod:`proctree`; the verdicts are pure functions elsewhere: whether the run is stuck
and how to describe it (:mod:`watchdog`), which rank failed first and why (:mod:`diagnose`).
This module owns the processes and the loop that gathers their inputs and acts on them.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import atomic, exit_codes

from wan_s2v_runner.launcher import manifest
from wan_s2v_runner.launcher.console import Display
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
from wan_s2v_runner.shared.events import EventReader, RankState
from wan_s2v_runner.launcher.proctree import (
    ProcTable,
    cpu_s,
    descendants,
    hwm_mb,
    pdeathsig_preexec,
    pids_with_cmdline,
    ppid_map,
    proc_state,
    worker_rank,
)
from wan_s2v_runner.shared.spec import RunSpec
from wan_s2v_runner.shared.stages import Stage
from wan_s2v_runner.launcher.watchdog import Stuck, WatchdogLimits, describe_hang, stalled

PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: after the first failure, torchrun gets this long to tear the others down before we do
FAILURE_GRACE_S = 3.0
#: a worker found dead without an ``end`` record counts as failed after this long (its last
#: records may still be on their way through the file system)
DEATH_SETTLE_S = 0.3
#: how often the supervisor walks /proc for the run's processes (exits are seen at once anyway)
TREE_WALK_S = 1.0
#: rendezvous port of a multi-node run when none is given (torchrun's own default)
DEFAULT_MASTER_PORT = 29500


def make_run_dir(spec: RunSpec) -> Path:
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


def finalize_spec(spec: RunSpec) -> RunSpec:
    """Resolve what the launcher decides once: the seed, and the rendezvous port of a
    multi-node run (:data:`DEFAULT_MASTER_PORT` unless given). A one-node run without a port
    keeps ``master_port=None``: torchrun's rendezvous then binds port 0 and the OS picks
    (:func:`rendezvous_argv`)."""
    spec = spec.with_resolved_seed()
    if spec.master_port is None and spec.nnodes > 1:
        spec = spec.model_copy(update={"master_port": DEFAULT_MASTER_PORT})
    return spec


def rendezvous_argv(spec: RunSpec) -> list[str]:
    """torchrun's rendezvous flags.

    One node, no ``--master-port``: what ``torchrun --standalone`` does, a c10d rendezvous on
    ``localhost:0``. Its store binds port 0 and keeps the port the OS gave it (no port is picked
    first and bound later, so runs started together cannot collide); the agent then serves the
    store the ranks join, also on an OS-picked port, and hands every rank ``MASTER_ADDR``
    (``--local-addr``: this host) and ``MASTER_PORT`` for ``init_process_group("env://")``.
    Otherwise (a port given, or several nodes): the static rendezvous on
    ``--master-addr:--master-port``."""
    if spec.master_port is None and spec.nnodes == 1:
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                "--rdzv-id", uuid.uuid4().hex, "--local-addr", "127.0.0.1"]
    port = spec.master_port or DEFAULT_MASTER_PORT
    return ["--master-addr", spec.master_addr, "--master-port", str(port)]


def not_started_note(spec: RunSpec) -> str:
    """Why a rank of this node that never reported has no process: with several nodes, torchrun
    starts its workers only when every node has joined the rendezvous."""
    if spec.nnodes == 1:
        return "torchrun did not start it"
    return (f"torchrun on node {spec.node_rank} is still at the rendezvous on {spec.master_addr}:"
            f"{spec.master_port}, waiting for {other_nodes_text(spec)}: start the same command there "
            "with its --node-rank, or check that it can reach that address")


def expected_ranks(spec: RunSpec) -> list[int]:
    """Global ranks started on this node (node-major: one node's are 0..nproc-1)."""
    return list(range(spec.node_rank * spec.nproc, (spec.node_rank + 1) * spec.nproc))


def torchrun_argv(spec: RunSpec, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
            "--nproc-per-node", str(spec.nproc),
            *rendezvous_argv(spec),
            "--max-restarts", "0",
            "--log-dir", str(run_dir / "logs"), "--redirects", "3", "--tee", "3",
            "--local-ranks-filter", "0",
            "-m", "wan_s2v_runner.rank.worker", str(run_dir / "spec.json")]


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


def worker_env(spec: RunSpec, extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if spec.device == "cpu":
        env["OMP_NUM_THREADS"] = str(spec.threads)
        for k, v in CPU_MALLOC_ENV.items():
            env.setdefault(k, v)
    else:  # fragmentation is a common cause of OOM in long autoregressive runs; user value wins
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(extra or {})
    return env


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
    """Owns the torchrun process tree of one run."""

    def __init__(self, spec: RunSpec, run_dir: Path, display: Display, extra_env=None):
        self.spec, self.run_dir, self.display = spec, run_dir, display
        self.reader = EventReader(run_dir)
        self.log_path = run_dir / "torchrun.log"
        self.proc: Optional[subprocess.Popen] = None
        self.procs = ProcTable()
        self.extra_env = extra_env
        self.expected = expected_ranks(spec)
        self.limits = WatchdogLimits(load_s=spec.watchdog_load_s, step_s=spec.watchdog_step_s)
        self.signal_received: Optional[int] = None
        self.force = False  # a second signal: SIGKILL at once
        self.host_hwm_mb: dict[int, float] = {}  # rank -> VmHWM seen by the launcher
        self.torchrun_cpu_s: Optional[float] = None  # torchrun's agent, last seen alive
        self.t0 = time.time()
        self._pump_thread: Optional[threading.Thread] = None
        self._needle = str(run_dir / "spec.json").encode()
        self._host = os.uname().nodename

    # ----- process tree -----
    def start(self) -> None:
        argv = torchrun_argv(self.spec, self.run_dir)
        atomic.write_text(self.run_dir / "command.json", json.dumps(argv, indent=1))
        self.t0 = time.time()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=worker_env(self.spec, self.extra_env),
                                     start_new_session=True, cwd=os.getcwd(),
                                     preexec_fn=pdeathsig_preexec())
        self._pump_thread = threading.Thread(target=self._pump, daemon=True, name="wan-s2v-pump")
        self._pump_thread.start()

    def _pump(self) -> None:
        with open(self.log_path, "w", encoding="utf-8") as log:
            for raw in self.proc.stdout:  # type: ignore[union-attr]
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                try:
                    self.display.log_line(line)
                except Exception:  # the display must never stop the log
                    pass

    def join_pump(self, timeout: float = 3.0) -> None:
        if self._pump_thread is not None:
            self._pump_thread.join(timeout)

    def tree(self, full: bool = False) -> list[int]:
        """Live processes of the run (torchrun excluded): found from torchrun's and the known
        workers' children, the ranks' hello records, and (``full``) command lines naming our
        spec.json (catches a worker orphaned before it reported)."""
        for pid in self._local_rank_pids():
            self.procs.track(pid)
        roots = [p for p in self.procs.start if self.procs.alive(p)]
        if self.proc is not None and self.proc.poll() is None:
            roots.append(self.proc.pid)
        found = descendants(roots, ppid_map())
        if full:
            found |= pids_with_cmdline(b"wan_s2v_runner.rank.worker", self._needle)
        found.discard(os.getpid())
        if self.proc is not None:
            found.discard(self.proc.pid)
        for p in found:
            self.procs.track(p)
        return sorted(p for p in self.procs.start if self.procs.alive(p))

    def _local_rank_pids(self) -> list[int]:
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
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            for p in self.tree(full=True):
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
                dt = self.procs.death_t.get(st.pid)
                if dt is None and not self.procs.alive(st.pid):
                    dt = self.procs.death_t.get(st.pid)
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
            if tick % walk_every == 0 or not all(map(self.procs.known, self._local_rank_pids())):
                self.tree(full=tick % (10 * walk_every) == 0)
                self.sample_usage()
            tick += 1
            try:
                self.display.update(self.reader, new, now - self.t0)
            except Exception:  # a display glitch must never stop supervision
                pass
            if self.signal_received is not None:
                where = where_ranks_were(self.reader, self.expected)
                self.stop(grace_s=5.0)
                return Outcome(code=exit_codes.INTERRUPTED,
                               reason=f"interrupted by {signal.Signals(self.signal_received).name}"
                                      + (f" ({where})" if where else "") + "; every rank was stopped",
                               torchrun_rc=self.proc.poll())
            rc = self.proc.poll()
            if rc is not None:
                self.reader.poll()
                if rc == 0:
                    deadline = time.time() + 3.0
                    while self.tree() and time.time() < deadline:
                        time.sleep(0.05)
                    if self.tree():
                        self.stop(grace_s=2.0)
                    self.reader.poll()
                    if all(self.reader.ranks.get(r) and self.reader.ranks[r].end
                           and not self.reader.ranks[r].error for r in self.expected):
                        return Outcome(torchrun_rc=rc)
                # torchrun failed: make sure nothing of the run survives
                rank_failed = any(st.error or (st.end is None and st.pid and not self.procs.alive(st.pid))
                                  for st in self.reader.ranks.values())
                self.stop(grace_s=2.0)
                self.reader.poll()
                if rc < 0 and not rank_failed:
                    # torchrun itself was killed; its workers were still fine (we stopped them)
                    return Outcome(code=exit_codes.RANK_FAILED, torchrun_rc=rc,
                                   reason=f"torchrun (pid {self.proc.pid}) was {describe_exit(rc)} while "
                                          f"the ranks were running ({where_ranks_were(self.reader, self.expected)}); "
                                          "the launcher stopped the ranks",
                                   hint="Something outside the run killed torchrun (the OOM killer? a job "
                                        "scheduler? `kill`?): check `dmesg` and the scheduler's logs.")
                return self._failure(rc)
            if first_failure_t is None and self.failures_seen(now):
                first_failure_t = now
            if first_failure_t is not None and now - first_failure_t > FAILURE_GRACE_S:
                # torchrun normally tears the others down itself; don't wait for collectives to time out
                self.stop(grace_s=2.0)
                self.reader.poll()
                return self._failure(self.proc.poll())
            stuck = None if first_failure_t is not None else self.stalled(now)
            if stuck:
                return self._hang(stuck, now)
            time.sleep(poll_s)

    def _hang(self, stuck: Stuck, now: float) -> Outcome:
        """Read what is left of the stuck ranks (the processes of ranks that never reported,
        every rank's stacks), stop the run, and report it."""
        live = self.tree(full=True)
        never = stuck.get(Stage.START, [])
        silent = {}  # rank -> (pid, state) of workers that never reported, read before stopping
        for pid in live:
            r = worker_rank(pid)
            if r in never:
                silent[r] = (pid, proc_state(pid))
        stacks = self.dump_stacks()
        self.stop(grace_s=2.0)
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
                       torchrun_rc=self.proc.poll())

    def _failure(self, rc: Optional[int]) -> Outcome:
        """Gather what tells which rank failed first (events, error files, exit times, torchrun's
        exit codes, crash stacks), let :func:`diagnose.attribute_failures` decide, report it."""
        if self.proc is not None and self.proc.poll() is not None:
            self.join_pump(timeout=2.0)  # torchrun's failure summary (exit codes) into torchrun.log
        ranks = self.reader.ranks
        stacks = self.run_dir / "stacks"
        failures = attribute_failures(
            ranks, error_files=read_error_files(self.run_dir, self.spec.node_rank * self.spec.nproc),
            death_times=dict(self.procs.death_t), exit_codes=parse_torchrun_exits(self.log_path),
            crash_stacks={r: stacks / f"rank{r}.txt" for r in ranks if has_frame(stacks / f"rank{r}.txt")},
            spec=self.spec)
        if not failures:
            missing = sorted(set(self.expected) - set(ranks))
            return Outcome(code=exit_codes.RANK_FAILED, torchrun_rc=rc,
                           reason=f"torchrun exited with {rc}"
                           + (f"; ranks {missing} never started" if missing else ""),
                           traceback=tail_lines(self.log_path, 30),
                           hint="torchrun itself failed: see torchrun.log in the run directory "
                                "(rendezvous port in use? another node unreachable?)")
        cause = failures[0]
        return Outcome(code=exit_codes.RANK_FAILED, failed_rank=cause.rank, failed_stage=cause.stage,
                       error=cause.message, traceback=cause.traceback, reason=cause.headline(),
                       hint=cause.hint, details=[f.also_line() for f in failures[1:]], torchrun_rc=rc)

    def on_signal(self, signum, _frame) -> None:
        if self.signal_received is not None:
            self.force = True
        self.signal_received = signum

    def close(self) -> None:
        self.procs.close()
        if self.proc is not None and self.proc.stdout is not None:
            self.join_pump(timeout=2.0)


def _output_stamp(path: Path) -> Optional[tuple]:
    try:
        s = path.stat()
        return (s.st_ino, s.st_mtime_ns, s.st_size)
    except OSError:
        return None


def cleanup_partial_outputs(spec: RunSpec, pids: list[int]) -> list[Path]:
    """Remove temporary files the ranks left next to the output (a rank killed while saving);
    every writer names them by :func:`atomic.temp_name`."""
    removed = []
    patterns = []
    for pid in pids:
        for dest in (spec.output, spec.frames_out):
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


def run(spec: RunSpec, *, display: Optional[Display] = None, extra_env: Optional[dict] = None) -> int:
    """Spawn and supervise one run. Returns an exit code (see exit_codes)."""
    spec = finalize_spec(spec)
    display = display or Display.auto()
    run_dir = make_run_dir(spec)
    atomic.write_text(run_dir / "spec.json", spec.to_json())
    display.started(spec, run_dir)
    sup = Supervisor(spec, run_dir, display, extra_env)
    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
                continue  # under nohup: keep ignoring hangups
            old[s] = signal.signal(s, sup.on_signal)
    before = _output_stamp(spec.output)
    started = time.time()
    cpu_before = cpu_s(os.getpid()) or 0.0
    try:
        try:
            sup.start()
            outcome = sup.supervise()
        except BaseException:
            sup.force = True  # the launcher itself failed: leave nothing behind
            sup.stop(grace_s=0)
            raise
        finally:
            sup.close()
        rank_pids = [st.pid for st in sup.reader.ranks.values() if st.pid]
        cleanup_partial_outputs(spec, rank_pids)
        _remove_empty_stacks(run_dir)
        sup.reader.poll()
        if outcome.code == exit_codes.OK and spec.writes_output and \
                (not spec.output.is_file() or _output_stamp(spec.output) == before):
            outcome = Outcome(code=exit_codes.RANK_FAILED, torchrun_rc=outcome.torchrun_rc,
                              reason=f"the run ended but {spec.output} was not written")
        data = manifest.build(spec, run_dir, sup.reader, outcome, started, time.time(),
                              launcher={"pid": os.getpid(), "torchrun_pid": sup.proc.pid if sup.proc else None,
                                        "torchrun_exit_code": outcome.torchrun_rc,
                                        "host_peak_rss_mb_seen": {str(k): v for k, v in sup.host_hwm_mb.items()},
                                        "cpu_s": {"launcher": round((cpu_s(os.getpid()) or 0.0) - cpu_before, 3),
                                                  "torchrun": sup.torchrun_cpu_s},
                                        "rank_exit_codes": {str(k): v for k, v in
                                                            parse_torchrun_exits(sup.log_path).items()} or None,
                                        "signal": signal.Signals(sup.signal_received).name
                                        if sup.signal_received else None})
        atomic.write_text(run_dir / "run.json", json.dumps(data, indent=2, default=str))
        display.finished(spec, run_dir, outcome, data)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return outcome.code
