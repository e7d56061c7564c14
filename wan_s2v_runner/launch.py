"""The launcher: spawn ``python -m torch.distributed.run`` for a spec and supervise it.

One call, :func:`run`, does it all: make the run directory (``<runs_root>/<time>-<mode>/``),
write ``spec.json`` once, spawn torchrun with an argument list (per-rank logs and torch elastic
error files under ``logs/``), then watch the ranks' event files: live progress, the hang
watchdog (stage-aware limits; SIGUSR1 -> faulthandler stack dump per rank; then stop), fast stop
of every rank when one fails or on Ctrl-C/SIGTERM, a failure report (rank, stage, traceback,
hint), and ``run.json``, the manifest. Returns an exit code from :mod:`exit_codes`.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

from wan_s2v_runner import exit_codes, manifest
from wan_s2v_runner.console import Display
from wan_s2v_runner.events import EventReader
from wan_s2v_runner.spec import RunSpec

LOAD_STAGES = {"start", "init_pg", "engine_import", "load", "fingerprint", "shard"}
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def finalize_spec(spec: RunSpec) -> RunSpec:
    """Resolve what the launcher decides once: the seed and the rendezvous port."""
    spec = spec.with_resolved_seed()
    if spec.master_port is None:
        spec = spec.model_copy(update={"master_port": free_port() if spec.nnodes == 1 else 29500})
    return spec


def torchrun_argv(spec: RunSpec, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
            "--nproc-per-node", str(spec.nproc),
            "--master-addr", spec.master_addr, "--master-port", str(spec.master_port),
            "--max-restarts", "0",
            "--log-dir", str(run_dir / "logs"), "--redirects", "3", "--tee", "3",
            "--local-ranks-filter", "0",
            "-m", "wan_s2v_runner.worker", str(run_dir / "spec.json")]


def worker_env(spec: RunSpec, extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if spec.device == "cpu":
        env["OMP_NUM_THREADS"] = str(spec.threads)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(extra or {})
    return env


def _children(pid: int) -> list[int]:
    """All descendants of pid, from /proc (workers run in their own sessions)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Outcome:
    code: int = exit_codes.OK
    reason: str = ""
    failed_rank: Optional[int] = None
    failed_stage: Optional[str] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    hint: Optional[str] = None
    stuck: dict = field(default_factory=dict)


class Supervisor:
    """Owns the torchrun process tree of one run."""

    def __init__(self, spec: RunSpec, run_dir: Path, display: Display, extra_env=None):
        self.spec, self.run_dir, self.display = spec, run_dir, display
        self.reader = EventReader(run_dir)
        self.log_path = run_dir / "torchrun.log"
        self.proc: Optional[subprocess.Popen] = None
        self.known_pids: set[int] = set()
        self.extra_env = extra_env
        self.signal_received: Optional[int] = None
        self.t0 = time.time()

    # ----- process tree -----
    def start(self) -> None:
        argv = torchrun_argv(self.spec, self.run_dir)
        write_atomic(self.run_dir / "command.json", json.dumps(argv, indent=1))
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=worker_env(self.spec, self.extra_env),
                                     start_new_session=True, cwd=os.getcwd())
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        with open(self.log_path, "w", encoding="utf-8") as log:
            for raw in self.proc.stdout:  # type: ignore[union-attr]
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                self.display.log_line(line)

    def tree(self) -> list[int]:
        pids = set(_children(self.proc.pid)) if self.proc else set()
        pids |= {st.pid for st in self.reader.ranks.values() if st.pid}
        self.known_pids |= pids
        return sorted(p for p in self.known_pids if _alive(p))

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole tree, SIGKILL what is left after grace_s. Returns when all are gone."""
        if self.proc is None:
            return
        pids = self.tree()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            targets = ([self.proc.pid] if self.proc.poll() is None else []) + pids
            for p in targets:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + (grace_s if sig == signal.SIGTERM else 10)
            while time.time() < deadline:
                pids = self.tree()
                if self.proc.poll() is not None and not pids:
                    return
                time.sleep(0.1)
        self.proc.wait(timeout=10)

    def dump_stacks(self, wait_s: float = 3.0) -> list[Path]:
        for st in self.reader.ranks.values():
            if st.pid and _alive(st.pid):
                try:
                    os.kill(st.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(wait_s)
        self._pyspy()
        return sorted((self.run_dir / "stacks").glob("rank*.txt"))

    def _pyspy(self) -> None:
        import shutil
        exe = shutil.which("py-spy")
        if not exe:
            return
        for st in self.reader.ranks.values():
            if st.pid and _alive(st.pid):
                out = subprocess.run([exe, "dump", "--pid", str(st.pid)], capture_output=True, text=True, timeout=30)
                (self.run_dir / "stacks" / f"rank{st.rank}.py-spy.txt").write_text(out.stdout + out.stderr)

    # ----- watchdog -----
    def limit_for(self, stage: str) -> float:
        return self.spec.watchdog_load_s if stage in LOAD_STAGES else self.spec.watchdog_step_s

    def stalled(self, now: float) -> Optional[dict]:
        """{stage: [ranks]} when no rank progressed within its stage's limit, else None."""
        ranks = self.reader.ranks
        if len(ranks) < self.spec.nproc:  # ranks not yet reporting count as 'start'
            last = max([st.last_progress_t for st in ranks.values()] + [self.t0])
            lim = self.limit_for("start")
            if lim and now - last > lim:
                return {"start": sorted(set(range(self.spec.nproc)) - set(ranks))}
            return None
        live = [st for st in ranks.values() if st.end is None]
        if not live:
            return None
        limit = max(self.limit_for(st.stage) for st in live)
        if not limit or now - max(st.last_progress_t for st in live) <= limit:
            return None
        by_stage: dict = {}
        for st in live:
            by_stage.setdefault(st.stage, []).append(st.rank)
        return by_stage

    # ----- main loop -----
    def supervise(self, poll_s: float = 0.25) -> Outcome:
        outcome = Outcome()
        first_failure_t: Optional[float] = None
        while True:
            new = self.reader.poll()
            self.display.update(self.reader, new, time.time() - self.t0)
            self.tree()
            if self.signal_received is not None:
                self.stop()
                return Outcome(code=exit_codes.INTERRUPTED,
                               reason=f"interrupted by {signal.Signals(self.signal_received).name}")
            rc = self.proc.poll()
            if rc is not None:
                self.reader.poll()
                if rc == 0 and not self.tree():
                    return outcome
                # torchrun already failed; make sure nothing of the run survives
                self.stop(grace_s=2.0)
                return self._failure(rc)
            errors = [st for st in self.reader.ranks.values() if st.error]
            if errors and first_failure_t is None:
                first_failure_t = time.time()
            if first_failure_t is not None and time.time() - first_failure_t > 5.0:
                # torchrun normally tears the others down itself; don't wait for collectives to time out
                self.stop(grace_s=2.0)
                return self._failure(self.proc.poll() or 1)
            stuck = self.stalled(time.time())
            if stuck:
                stacks = self.dump_stacks()
                self.stop(grace_s=2.0)
                desc = "; ".join(f"{stage} on ranks {','.join(map(str, rs))}" for stage, rs in stuck.items())
                return Outcome(code=exit_codes.HUNG, stuck=stuck,
                               reason=f"stuck in {desc} (no progress for "
                                      f"{max(self.limit_for(s) for s in stuck):g}s); stacks in {self.run_dir / 'stacks'}",
                               hint=_hint("hang", list(stuck)),
                               traceback=None if stacks else "no stack dumps were written")
            time.sleep(poll_s)

    def _failure(self, rc: int) -> Outcome:
        ranks = self.reader.ranks
        errs = sorted((st for st in ranks.values() if st.error), key=lambda s: float(s.error["t"]))
        tb_by_rank = read_error_files(self.run_dir)
        if errs:
            st = errs[0]
            msg = f"{st.error.get('error_type')}: {st.error.get('message')}"
            return Outcome(code=exit_codes.RANK_FAILED, failed_rank=st.rank, failed_stage=st.stage,
                           error=msg, traceback=tb_by_rank.get(st.rank),
                           reason=f"rank {st.rank} failed in stage {st.stage}: {msg}", hint=_hint(msg, [st.stage]))
        gone = [st for st in ranks.values() if st.end is None]
        if gone:
            st = min(gone, key=lambda s: s.rank)
            died = ", ".join(f"rank {s.rank} (pid {s.pid}) in {s.stage}" for s in gone)
            return Outcome(code=exit_codes.RANK_FAILED, failed_rank=st.rank, failed_stage=st.stage,
                           error="exited without a report (killed by a signal, e.g. SIGKILL or the OOM killer?)",
                           traceback=tb_by_rank.get(st.rank),
                           reason=f"ranks stopped without finishing: {died}",
                           hint="Check `dmesg` for the OOM killer; host RAM per rank is in doctor's memory plan.")
        missing = sorted(set(range(self.spec.nproc)) - set(ranks))
        return Outcome(code=exit_codes.RANK_FAILED, reason=f"torchrun exited with {rc}"
                       + (f"; ranks {missing} never started" if missing else ""),
                       traceback=_tail(self.log_path, 30))

    def on_signal(self, signum, _frame) -> None:
        self.signal_received = signum


def read_error_files(run_dir: Path) -> dict[int, str]:
    """rank -> traceback text from torch elastic's per-rank error.json files."""
    out: dict[int, str] = {}
    for ef in (run_dir / "logs").glob("*/attempt_*/*/error.json"):
        try:
            data = json.loads(ef.read_text())
            msg = data.get("message", {})
            if isinstance(msg, dict):
                text = msg.get("message", "") + "\n" + msg.get("extraInfo", {}).get("py_callstack", "")
            else:
                text = str(msg)
            local = int(ef.parent.name)
            out[local] = text.strip()
        except (OSError, ValueError):
            continue
    return out


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


HINTS = [
    ("out of memory", "GPU out of memory: try --mode hybrid (FSDP DiT + T5 on CPU), more ranks, a smaller --size, or fewer --infer-frames."),
    ("cuda oom", "GPU out of memory: try --mode hybrid, more ranks, or a smaller --size."),
    ("timed out", "A collective timed out: one rank is far behind or dead. Check that rank's log; raise --pg-timeout for slow storage."),
    ("timeout", "A collective timed out: one rank is far behind or dead. Check that rank's log; raise --pg-timeout for slow storage."),
    ("no such file", "A file is missing: run `wan-s2v doctor` with the same flags to check the checkpoint and inputs."),
    ("filenotfound", "A file is missing: run `wan-s2v doctor` with the same flags to check the checkpoint and inputs."),
    ("undefined symbol", "flash-attn was built for another torch: rebuild it, or use --attention sdpa."),
    ("weightmismatch", "Give every node identical checkpoint files (compare their sha256)."),
    ("muxing audio", "The mp4 could not get its audio: check the audio file decodes (`wan-s2v doctor --audio ...`)."),
]


def _hint(text: str, stages: list) -> Optional[str]:
    if text == "hang":
        if any(s in LOAD_STAGES for s in stages):
            return "Stuck while starting/loading: check storage speed, NCCL_P2P_DISABLE=1 on consumer GPUs, and that every node reached the rendezvous."
        return "Stuck in a collective or step: look at the stack dumps; a rank waiting in all_to_all/all_gather is waiting for another."
    low = text.lower()
    for key, hint in HINTS:
        if key in low:
            return hint
    return None


def run(spec: RunSpec, *, display: Optional[Display] = None, extra_env: Optional[dict] = None) -> int:
    """Spawn and supervise one run. Returns an exit code (see exit_codes)."""
    spec = finalize_spec(spec)
    display = display or Display.auto()
    run_dir = make_run_dir(spec)
    write_atomic(run_dir / "spec.json", spec.to_json())
    display.started(spec, run_dir)
    sup = Supervisor(spec, run_dir, display, extra_env)
    old = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    started = time.time()
    try:
        sup.start()
        outcome = sup.supervise()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    sup.reader.poll()
    if outcome.code == exit_codes.OK and not spec.output.is_file():
        outcome = Outcome(code=exit_codes.RANK_FAILED, reason=f"the run ended but {spec.output} was not written")
    data = manifest.build(spec, run_dir, sup.reader, outcome, started, time.time())
    write_atomic(run_dir / "run.json", json.dumps(data, indent=2, default=str))
    display.finished(spec, run_dir, outcome, data)
    return outcome.code
