"""A node's warm agent: ``python -m wan_s2v_runner.rank.warm_agent --socket PATH`` (``wan-s2v warm``).

It imports once what every run's node agent imports before its ranks fork (torch, torch elastic,
the engine with our patches, the rank's modules: :func:`preload`), then listens on a Unix socket.
For each run the launcher asks (:mod:`wan_s2v_runner.launcher.warm`) it forks that run's agent
from itself: the child takes the run's output pipe, standard input, working directory (first on
its path, as ``python -m`` puts it), umask, CPU affinity and environment, takes a spawned agent's
command line (the launcher finds a run's processes in ``/proc`` by it; setproctitle writes it
where the environment was, so ``/proc/PID/environ`` reads empty), and runs
:func:`wan_s2v_runner.rank.agent.main` with the run's ``spec.json``. From there on it is the
run's agent: its ranks fork from it, it exits with the run's code, and the launcher supervises it
as it supervises a spawned one.

Why our own fork server rather than ``multiprocessing.forkserver``: the child here must become
another program's process (the launcher's pipes and environment, a new session, its command
line), be signalled and waited on by a process that is not its parent, and be refused when a fork
could not be what a spawn would be (:func:`refusal`); the forkserver hands out Python callables
to its own parent's pool.

A request is refused (and the launcher spawns the agent instead) when the fork would differ from
a spawned agent: another user, interpreter (venv) or engine; an import-time environment variable
set otherwise (:func:`wan_s2v_runner.shared.warm_agent.env_conflict`); a PYTHONPATH entry or
working directory holding a package imported here; the launcher's resource limits or control
group (a Slurm or Kubernetes job's) not the warm agent's; a file of the imported code changed
since (then it also exits: every later run would be refused for the same reason). It reads one
request at a time, each within 10 s (a launcher stopped mid-request holds the others that long).

What stays with the warm agent: it forks only from its main thread with no other thread running,
touches no GPU (the engine's CUDA-at-import spot patched, torch asked through NVML, as the agent
does), and keeps a forked agent's end: when the launcher's connection closes while the agent
lives, the agent gets SIGTERM (what PR_SET_PDEATHSIG did for a spawned one); a forked agent gets
SIGTERM too when the warm agent dies. SIGTERM or Ctrl-C: it stops listening and exits once its
forked agents have ended (a second one: at once).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import gc
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import warm_agent as wire
from wan_s2v_runner.shared.node_agent import AGENT_MODULE
from wan_s2v_runner.shared.procfs import name_this_process

PREFIX = "[wan-s2v warm]"
#: seconds a connected launcher has to send its request
REQUEST_TIMEOUT_S = 10.0


def say(text: str) -> None:
    print(f"{PREFIX} {text}", flush=True)


def preload(wan_repo: Optional[Path]) -> Path:
    """What a run's agent imports before its ranks fork (:func:`wan_s2v_runner.rank.agent.preload`
    with the default worker), and torch elastic's launcher; returns the engine's package directory."""
    from wan_s2v_runner.rank.agent import NVML_CHECK_ENV

    os.environ.setdefault(NVML_CHECK_ENV, "1")
    import setproctitle  # noqa: F401 - the forks name themselves with it
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    from torch.distributed.elastic.multiprocessing.errors import record  # noqa: F401
    from torch.distributed.launcher.api import elastic_launch  # noqa: F401

    from wan_s2v_runner.rank import agent  # noqa: F401
    from wan_s2v_runner.rank.worker import preload_modules

    preload_modules(wan_repo)
    return Path(sys.modules["wan"].__file__).parent.resolve()


def code_files() -> dict[str, tuple[int, int]]:
    """Every imported module's file and its (mtime, size): what a fork runs."""
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_mtime_ns, st.st_size)
    return out


def changed_file(files: dict[str, tuple[int, int]]) -> Optional[str]:
    for path, stamp in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != stamp:
            return path
    return None


def top_packages() -> dict[str, str]:
    """Top-level modules imported here -> where from (their directory)."""
    out = {}
    for name, module in list(sys.modules.items()):
        if "." in name:
            continue
        path = getattr(module, "__file__", None)
        if path:
            out[name] = str(Path(path).parent)
    return out


def shadowing(entries: list[str], tops: dict[str, str]) -> Optional[str]:
    """A PYTHONPATH entry (not on this process's path) holding a package imported here from
    elsewhere: a fresh agent would import that one."""
    for entry in entries:
        if not entry or entry in sys.path:
            continue
        base = Path(entry)
        for name, where in tops.items():
            for candidate in (base / name, base / f"{name}.py"):
                if candidate.exists() and str(candidate.parent if candidate.suffix else candidate) != where \
                        and str(base) != where:
                    return f"PYTHONPATH entry {entry} holds `{name}`, imported here from {where}"
    return None


def dormant_prefixes() -> tuple[str, ...]:
    """The prefixes of :data:`~wan_s2v_runner.shared.warm_agent.LIBRARY_PREFIXES` whose library this
    process has not loaded (its memory map names none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    return tuple(prefix for prefix, lib in wire.LIBRARY_PREFIXES.items() if lib not in maps)


# ----------------------------------------------------------------------------- the forked agent
_libc = ctypes.CDLL(None, use_errno=True)
#: mallopt parameters of glibc's MALLOC_*_ variables
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2}
#: what every process gets from the launcher as a spawn would inherit it, compared (refused
#: where it differs) rather than set: a fork cannot raise a limit or leave its cgroup
INHERITED = ("limits", "cgroup")


def inherited(pid) -> dict[str, str]:
    """A process's resource limits and control groups (``pid``: a number or ``self``)."""
    out = {}
    for name in INHERITED:
        try:
            out[name] = Path(f"/proc/{pid}/{name}").read_text()
        except OSError:
            out[name] = ""
    return out


def inherited_difference(mine: dict[str, str], theirs: dict[str, str]) -> Optional[str]:
    for name in INHERITED:
        if mine[name] != theirs[name]:
            a, b = mine[name].splitlines(), theirs[name].splitlines()
            line = next((y for x, y in zip(a, b) if x != y), None) or (b[len(a)] if len(b) > len(a) else "?")
            what = "resource limits (ulimit)" if name == "limits" else "control group (a job's cgroup)"
            return f"the launcher's {what} differ from the warm agent's: {' '.join(line.split())}"
    return None


def take_on(env: dict[str, str], started_with: dict[str, str]) -> None:
    """Set in this (forked) process what the run's environment would have set when a fresh
    interpreter started: :data:`wan_s2v_runner.shared.warm_agent.TAKEN_ON` (values checked by
    :func:`~wan_s2v_runner.shared.warm_agent.taken_on_problem`)."""
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads != started_with.get("OMP_NUM_THREADS"):
        import torch
        torch.set_num_threads(int(threads))
        if not env.get("OPENBLAS_NUM_THREADS"):  # numpy's OpenBLAS reads it too, when it loads
            try:
                from threadpoolctl import threadpool_limits
                threadpool_limits(int(threads), user_api="blas")
            except ImportError:
                pass
    for name, param in _MALLOPT.items():
        value = env.get(name)
        if value and value != started_with.get(name):
            _libc.mallopt(param, int(value))
    ours = started_with.get("PYTHONPATH", "").split(os.pathsep)
    new = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and e not in ours and e not in sys.path]
    sys.path[1:1] = new  # after the start directory, as PYTHONPATH entries stand
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=bool(env.get("PYTHONUNBUFFERED")))
        except (AttributeError, ValueError):
            pass


def _above_stdio(fd: int) -> int:
    """``fd`` moved above 0-2 (where the warm agent started with its streams closed, a received
    descriptor can be one of them)."""
    if fd > 2:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 3)
    os.close(fd)
    return moved


def _leave(code: int) -> None:
    """End the forked agent as its interpreter's exit would: other non-daemon threads joined,
    then :func:`~wan_s2v_runner.shared.prompt_exit.leave_now` (atexit, streams flushed, no
    teardown of the modules)."""
    from wan_s2v_runner.shared.prompt_exit import leave_now

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    leave_now(code)


def become_agent(request: dict, stdin_fd: int, out_fd: int, server_socks: list[socket.socket],
                 server_fds: list[int], warm_pid: int, started_with: dict[str, str], added: dict[str, str],
                 start_entry: str) -> None:
    """In the child: the run's agent, then its exit. Never returns. Its environment is the run's,
    with what the warm agent's imports added to theirs (``added``: a spawned agent's imports would
    have added it too). Signals arrive blocked (the warm agent blocks them around the fork)."""
    code = 1
    try:
        _detach(warm_pid)
        _take_streams(stdin_fd, out_fd, server_socks, server_fds)
        argv = _take_process(request, started_with, added, start_entry)
        from wan_s2v_runner.rank import agent

        sys.argv = [agent.__file__, *argv[3:]]
        print(f"[wan-s2v agent] forked from the warm agent (pid {warm_pid}): torch and the engine were "
              "imported there", file=sys.stderr, flush=True)
        code = agent.main(argv[3:])
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as an interpreter stopped by Ctrl-C ends: by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the agent's own error, as a spawned one would print it
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        try:
            _leave(code)
        finally:
            os._exit(1)


def _detach(warm_pid: int) -> None:
    """The child's own session, its end tied to the warm agent's, signals as a new interpreter's."""
    os.setsid()
    _libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: end with the warm agent
    if os.getppid() != warm_pid:  # it died before the line above
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as CPython sets them at start
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _take_streams(stdin_fd: int, out_fd: int, server_socks: list[socket.socket], server_fds: list[int]) -> None:
    """The warm agent's sockets closed; the run's standard streams in 0, 1 and 2."""
    for sock in server_socks:
        os.close(sock.detach())
    for fd in server_fds:
        os.close(fd)
    stdin_fd, out_fd = _above_stdio(stdin_fd), _above_stdio(out_fd)
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(stdin_fd)
    os.close(out_fd)
    if sys.stdin is None:  # the warm agent was started with its standard streams closed
        sys.stdin = open(0, "r", closefd=False)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)


def _take_process(request: dict, started_with: dict[str, str], added: dict[str, str], start_entry: str) -> list[str]:
    """The run's directory, umask, CPUs, environment and command line; returns the command line."""
    cwd = request["cwd"]
    os.chdir(cwd)
    if start_entry in sys.path:  # ``python -m``: the directory it started in, first on the path
        sys.path[sys.path.index(start_entry)] = cwd
    os.umask(int(request["umask"]))
    if request.get("affinity"):
        os.sched_setaffinity(0, request["affinity"])
    env = {**added, **{str(k): str(v) for k, v in request["env"].items()}}
    os.environ.clear()
    os.environ.update(env)
    take_on(env, started_with)
    argv = [str(a) for a in request["argv"]]
    import setproctitle

    setproctitle.setproctitle(" ".join(argv))  # the command line a spawned agent has
    if argv[-1].encode() not in Path("/proc/self/cmdline").read_bytes():
        print("[wan-s2v agent] could not take a spawned agent's command line: the launcher finds this "
              "run's processes by their parents alone", file=sys.stderr, flush=True)
    return argv


def free_socket_path(path: Path) -> None:
    """Make ``path``'s directory (0700) and make sure no warm agent listens there; a socket a dead
    one left is removed. A cause and a fix (SystemExit) where it cannot be used."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    problem = wire.socket_dir_problem(path)
    if problem:
        raise SystemExit(f"{PREFIX} error: {problem}. Fix: remove it, or pass --socket PATH in a directory "
                         "of your own (and set $WAN_S2V_WARM_AGENT=PATH for the runs)")
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SystemExit(f"{PREFIX} error: {path} exists and is not a socket. Fix: remove it, or pass "
                             "--socket PATH")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise SystemExit(f"{PREFIX} error: a warm agent listens on {path} already. Fix: stop it, "
                             "or pass --socket PATH (and set $WAN_S2V_WARM_AGENT=PATH for the runs)")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # a warm agent that died left it
        finally:
            probe.close()


# ----------------------------------------------------------------------------- the server
@dataclass
class Client:
    """One launcher's connection and, once forked, its agent."""

    sock: socket.socket
    since: float = field(default_factory=time.monotonic)
    pid: Optional[int] = None
    pidfd: Optional[int] = None
    gone: bool = False  # the launcher's end closed while its agent lives


class WarmAgent:
    def __init__(self, path: Path, engine_dir: Path, started_with: dict[str, str], start_entry: str,
                 idle_exit_s: float = 0.0):
        self.path, self.engine_dir, self.idle_exit_s = path, engine_dir, idle_exit_s
        self.start_entry = start_entry  # sys.path[0] as it started: its working directory (-m)
        #: the environment this process started with; what its imports added to it since
        self.started_with = started_with
        self.added = {k: v for k, v in os.environ.items() if k not in started_with}
        self.interpreter = wire.interpreter()
        self.files = code_files()
        self.tops = top_packages()
        self.clients: list[Client] = []
        self.listener: Optional[socket.socket] = None
        self.owner = os.getpid()
        self.stopping = 0
        self.last_busy = time.monotonic()

    # -- requests
    def refusal(self, client: Client, request: dict) -> Optional[str]:
        """Why this request cannot be forked here (None: it can)."""
        if self.stopping:
            return "the warm agent is stopping"
        if wire.peer(client.sock)[1] != os.getuid():
            return "another user's launcher"
        argv = request.get("argv")
        if not (isinstance(argv, list) and len(argv) >= 4 and argv[1:3] == ["-m", AGENT_MODULE]):
            return f"not a node agent's command ({argv!r:.80})"
        if not isinstance(request.get("env"), dict) or not isinstance(request.get("cwd"), str) or \
                not isinstance(request.get("umask"), int):
            return "a request without its environment, working directory or umask"
        theirs = request.get("interpreter") or {}
        for key, mine in self.interpreter.items():
            if theirs.get(key) != mine:
                return f"the run's Python ({key} {theirs.get(key)}) is not the warm agent's ({mine})"
        engine = request.get("engine")
        if engine is None or Path(engine).resolve() != self.engine_dir:
            return f"the run's engine is {engine or 'not found'}, the warm agent imported {self.engine_dir}"
        conflict = wire.env_conflict(self.started_with, request["env"], os.environ, dormant_prefixes())
        if conflict:
            return conflict
        entries = [request["cwd"], *str(request["env"].get("PYTHONPATH", "")).split(os.pathsep)]
        shadow = shadowing(entries, self.tops)
        if shadow:
            return shadow
        pid = wire.peer(client.sock)[0]
        different = inherited_difference(inherited("self"), inherited(pid)) if pid else "no launcher process"
        if different:
            return different
        changed = changed_file(self.files)
        if changed:
            self.stopping = max(self.stopping, 1)  # every later run would be refused too
            return f"{changed} changed since the warm agent started: start it again (it exits now)"
        if threading.active_count() != 1:
            return f"{threading.active_count()} threads run in the warm agent (it forks from one alone)"
        return None

    def handle_request(self, client: Client) -> None:
        fds: list[int] = []
        try:
            request, fds = wire.receive(client.sock, max_fds=2, within_s=REQUEST_TIMEOUT_S)
        except ValueError as e:
            say(f"a request failed: {e}")
            self.drop(client)
            return
        try:
            if request is None:
                self.drop(client)
                return
            why = "no standard input and output came with the request" if len(fds) != 2 else \
                self.refusal(client, request)
            if why:
                say(f"refused: {why}")
                with contextlib.suppress(OSError):
                    wire.send(client.sock, {"refused": why})
                self.drop(client)
                return
            self.fork(client, request, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def fork(self, client: Client, request: dict, fds: list[int]) -> None:
        socks = [c.sock for c in self.clients] + ([self.listener] if self.listener else [])
        pidfds = [c.pidfd for c in self.clients if c.pidfd is not None]
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
        try:
            pid = os.fork()
            if pid == 0:
                become_agent(request, fds[0], fds[1], socks, pidfds, self.owner, self.started_with, self.added,
                             self.start_entry)
            client.pid, client.pidfd = pid, os.pidfd_open(pid)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        client.sock.settimeout(None)
        try:
            wire.send(client.sock, {"pid": pid}, fds=(client.pidfd,))
        except OSError:  # the launcher went away meanwhile: its agent ends, as it would have
            self.launcher_gone(client)
            return
        say(f"forked the agent of {request['argv'][-1]} (pid {pid})")

    def reap(self, client: Client) -> None:
        _, status = os.waitpid(client.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if not client.gone:
            with contextlib.suppress(OSError):
                wire.send(client.sock, {"exit": code})
        say(f"agent {client.pid} ended ({code})")
        self.drop(client)

    def launcher_gone(self, client: Client) -> None:
        """The launcher's end closed: stop its agent, as PR_SET_PDEATHSIG would. (Anything it
        sends after its request is read and dropped.)"""
        if not client.gone:
            try:
                data = client.sock.recv(4096)
            except OSError:
                data = b""
            if data:
                return
        client.gone = True
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(client.pidfd, signal.SIGTERM)

    def drop(self, client: Client) -> None:
        if client.pidfd is not None:
            os.close(client.pidfd)
        client.sock.close()
        if client in self.clients:
            self.clients.remove(client)
        self.last_busy = time.monotonic()

    # -- the loop
    def on_signal(self, signum, frame) -> None:
        self.stopping += 1
        if self.stopping > 1:
            raise KeyboardInterrupt

    def listen(self) -> None:
        free_socket_path(self.path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.listener.bind(str(self.path))
        except OSError as e:
            raise SystemExit(f"{PREFIX} error: cannot listen on {self.path}: {e.strerror or e}. Fix: pass "
                             "--socket PATH") from None
        finally:
            os.umask(old)
        self.listener.listen(64)

    def stop_listening(self) -> None:
        if self.listener is not None and os.getpid() == self.owner:
            self.listener.close()
            self.listener = None
            with contextlib.suppress(OSError):
                self.path.unlink()

    def serve(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)
        try:
            while True:
                if self.stopping:
                    self.stop_listening()
                    if not any(c.pid for c in self.clients):
                        return 0
                busy = bool(self.clients)
                if not busy and self.idle_exit_s and time.monotonic() - self.last_busy > self.idle_exit_s:
                    say(f"idle for {self.idle_exit_s:g} s: exiting")
                    return 0
                waiting = {c.sock.fileno(): c for c in self.clients if not c.gone}
                pidfds = {c.pidfd: c for c in self.clients if c.pidfd is not None}
                readable = [self.listener] if self.listener else []
                try:
                    ready, _, _ = select.select(readable + list(waiting) + list(pidfds), [], [], 1.0)
                except InterruptedError:
                    continue
                for r in ready:
                    if r is self.listener and self.listener is not None:
                        sock, _ = self.listener.accept()
                        self.clients.append(Client(sock))
                    elif r in pidfds:
                        self.reap(pidfds[r])
                    elif r in waiting and waiting[r] in self.clients:
                        c = waiting[r]
                        if c.pid is None:
                            self.handle_request(c)
                        else:
                            self.launcher_gone(c)
                now = time.monotonic()
                for c in [c for c in self.clients if c.pid is None and now - c.since > REQUEST_TIMEOUT_S]:
                    self.drop(c)  # connected and said nothing
        except KeyboardInterrupt:
            return 1
        finally:
            self.stop_listening()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="wan-s2v warm", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", type=Path, default=None, help="where to listen (default: the per-user, per-host "
                   "socket runs look for)")
    p.add_argument("--wan-repo", type=Path, default=None, help="the engine checkout to import (default: the "
                   "installed wan22)")
    p.add_argument("--idle-exit", type=float, default=0.0, metavar="S",
                   help="exit after S seconds with no run (default: never)")
    a = p.parse_args(argv)
    started_with = dict(os.environ)
    start_entry = sys.path[0] if sys.path else ""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        print(f"{PREFIX} error: this kernel has no pidfd_open (Linux 5.3+): runs spawn their agents here",
              file=sys.stderr)
        return 1
    import setproctitle

    # claims the command line's memory (and the environment's after it) for the forks' titles now,
    # while the environment is still where the kernel put it: after a change to it, it cannot
    setproctitle.setproctitle(setproctitle.getproctitle())
    path = (a.socket or wire.default_socket()).absolute()
    name_this_process("wan-s2v-warm")
    t0 = time.monotonic()
    free_socket_path(path)  # before the imports: a second warm agent says so at once
    engine_dir = preload(a.wan_repo)
    gc.collect()
    gc.freeze()  # what the forks share stays shared: no collection touches these objects' pages
    server = WarmAgent(path, engine_dir, started_with, start_entry, a.idle_exit)
    server.listen()
    import torch
    say(f"ready on {path} (pid {os.getpid()}; torch {torch.__version__}, engine {engine_dir}; "
        f"imported in {time.monotonic() - t0:.1f} s)")
    return server.serve()


if __name__ == "__main__":
    from wan_s2v_runner.shared.prompt_exit import exit_now

    exit_now(main())
