"""Processes of a run, from /proc: who belongs to it, whether they live, how to stop them.

The launcher tracks torchrun and its workers by pid *and* start time (so a recycled pid is never
signalled), finds them by parent links, by their command line and by the ranks' ``hello`` events,
and holds a pidfd per worker so each exit time is known to the millisecond (:class:`ProcTable`).
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared.node_agent import AGENT_MODULE
from wan_s2v_runner.shared.procfs import comm_rank


def pdeathsig_preexec():
    """A preexec_fn that makes the child get SIGTERM when the launcher dies (Linux), so a
    launcher killed with SIGKILL still takes torchrun (which then stops its workers) with it.
    prctl is resolved here, in the parent: the child only makes one foreign call."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG

    return preexec


# ----- processes, by /proc -----
def _stat_fields(pid: int) -> Optional[list[str]]:
    """/proc/<pid>/stat fields after the command name: [state, ppid, ..., starttime at [19]]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> Optional[int]:
    f = _stat_fields(pid)
    try:
        return int(f[19]) if f else None
    except (IndexError, ValueError):
        return None


def cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system) ``pid`` itself has used, its children excluded."""
    f = _stat_fields(pid)
    try:
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK") if f else None
    except (IndexError, ValueError):
        return None


def ppid_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            f = _stat_fields(int(d.name))
            if f:
                kids.setdefault(int(f[1]), []).append(int(d.name))
    return kids


def descendants(roots: list[int], kids: dict[int, list[int]]) -> set[int]:
    out: set[int] = set()
    todo = list(roots)
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def pids_with_cmdline(*needles: bytes) -> set[int]:
    """Processes whose command line contains every needle."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if all(n in cmd for n in needles):
                out.add(int(d.name))
    return out


def worker_rank(pid: int) -> Optional[int]:
    """The global rank of a run's worker process (same user), for workers that never reported: a
    rank names itself ``wan-s2v-rN`` (its ``comm``, :func:`~wan_s2v_runner.shared.procfs.rank_comm`)
    before anything else; None for any other process (the agent, a rank not that far yet)."""
    try:
        if AGENT_MODULE.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
        return comm_rank(Path(f"/proc/{pid}/comm").read_text().strip())
    except OSError:
        return None


def proc_state(pid: int) -> str:
    """'S (sleeping) in <wchan>' etc.: what a process that never reported is doing."""
    names = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O wait", "T": "stopped",
             "t": "stopped by a debugger", "Z": "a zombie"}
    f = _stat_fields(pid)
    state = f[0] if f else "?"
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return f"{names.get(state, state)}" + (f" in {wchan}" if wchan and wchan != "0" else "")


class ProcTable:
    """Processes of one run, each pinned by (pid, start time) and, when possible, a pidfd.

    A thread blocks on the pidfds (and a wake-up pipe that :meth:`track` and :meth:`close` write
    to), so the exit time of every tracked process is recorded as it happens (``death_t``) at no
    cost while nothing exits. Signals go through the pidfd (or after a start-time check), so a pid
    recycled by an unrelated process is never signalled.
    """

    def __init__(self):
        self.start: dict[int, int] = {}  # pid -> start time (clock ticks since boot)
        self.death_t: dict[int, float] = {}
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1  # the watch thread's wake-up pipe, made with it
        self._thread: Optional[threading.Thread] = None  # started with the first pidfd

    def known(self, pid: int) -> bool:
        """Whether ``pid`` was tracked (alive or dead since)."""
        return pid in self.start or pid in self.death_t

    def track(self, pid: int) -> None:
        if self.known(pid):
            return
        st = _start_time(pid)
        if st is None:
            self.death_t[pid] = time.time()
            return
        self.start[pid] = st
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                fd = None
            if fd is not None:
                if _start_time(pid) != st:  # recycled between the two reads
                    os.close(fd)
                    del self.start[pid]
                    return
                with self._lock:
                    self._fds[pid] = fd
                if self._thread is None:
                    self._wake_r, self._wake_w = os.pipe()
                    os.set_blocking(self._wake_w, False)
                    self._thread = threading.Thread(target=self._watch, daemon=True, name="wan-s2v-deathwatch")
                    self._thread.start()
                else:
                    self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # a full pipe wakes the thread all the same
            pass

    def _watch(self) -> None:
        """Block until a tracked process exits or the set changes; record each exit's time."""
        while not self._stop.is_set():
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            with self._lock:
                by_fd = {fd: pid for pid, fd in self._fds.items()}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            try:
                ready = poller.poll()
            except (OSError, ValueError):
                continue
            now = time.time()
            with self._lock:
                for fd, _ in ready:
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                        continue
                    pid = by_fd[fd]
                    self.death_t.setdefault(pid, now)
                    if self._fds.pop(pid, None) is not None:
                        os.close(fd)

    def alive(self, pid: int) -> bool:
        if pid not in self.start or pid in self.death_t:
            return False
        if pid in self._fds:  # watched: its exit lands in death_t as it happens
            return True
        f = _stat_fields(pid)
        if not f or f[0] in ("Z", "X") or _start_time(pid) != self.start[pid]:
            self.death_t.setdefault(pid, time.time())
            return False
        return True

    def kill(self, pid: int, sig: int) -> None:
        with self._lock:
            fd = self._fds.get(pid)
            try:
                if fd is not None and hasattr(signal, "pidfd_send_signal"):
                    signal.pidfd_send_signal(fd, sig)
                    return
            except ProcessLookupError:
                return
            except OSError:
                pass
        if self.alive(pid):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout=1)
        with self._lock:
            for fd in [*self._fds.values(), self._wake_r, self._wake_w]:
                try:
                    if fd >= 0:
                        os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self._wake_r, self._wake_w = -1, -1
