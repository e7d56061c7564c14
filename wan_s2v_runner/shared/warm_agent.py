"""What the launcher and a node's warm agent share (``wan-s2v warm``; the agent is
:mod:`wan_s2v_runner.rank.warm_agent`, the launcher's side :mod:`wan_s2v_runner.launcher.warm`):
where it listens, the one request and its answers, and which of a run's environment variables a
process forked from it can take on. Imports no torch.

A run's node agent imports torch and the engine before its ranks fork from it: ~4.4 CPU-s on the
2-core machine, every run. A warm agent has done that once and forks each run's agent from itself;
the forked agent then does what a spawned one does (``agent.main`` with the run's ``spec.json``).

What a fork cannot change is what the warm agent's interpreter and libraries read when they
started or were imported: the interpreter, the engine it imported, the code's files, and the
environment variables they read then (:data:`IMPORT_PREFIXES`). A run whose values differ is
refused (:func:`env_conflict`) and the launcher spawns its agent as it always did, saying why in
run.json. A few such variables a forked process can set for itself, and does
(:data:`TAKEN_ON`); the ones read when used, not when imported (:data:`READ_WHEN_USED`), are
simply the run's.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import struct
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

#: ``off`` (always spawn), or the warm agent's socket; unset: the default socket, when one listens
ENV = "WAN_S2V_WARM_AGENT"
OFF = "off"

#: environment variables read when the interpreter starts or a library is imported (torch, its
#: OpenMP and BLAS, glibc's malloc, CUDA, inductor's config, transformers, diffusers): the warm
#: agent's values are the ones its forks have
IMPORT_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_", "GLIBC_",
                   "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "TRITON_", "HF_", "TRANSFORMERS_", "DIFFUSERS_",
                   "LC_", "LANG", "TZ", "TMPDIR", "USE_TF", "USE_TORCH", "USE_JAX", "USE_FLAX")
#: of those, the ones a forked agent sets for itself from the run's values
#: (:func:`wan_s2v_runner.rank.warm_agent.take_on`): the CPU threads (``torch.set_num_threads``),
#: glibc's malloc thresholds (``mallopt``), unbuffered output (its streams are made anew), and
#: PYTHONPATH entries that hold none of the packages it imported
TAKEN_ON = ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
            "PYTHONUNBUFFERED", "PYTHONPATH")
#: of those, the ones read when used, after the fork (inductor's cache directory; the NCCL error
#: handling and CUDA allocator settings, read when the process group and CUDA start)
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTORCH_CUDA_ALLOC_CONF",
                  "CUDA_VISIBLE_DEVICES")

#: the longest message either side sends (a request carries the run's environment)
MAX_MESSAGE = 1 << 20


def socket_path(env: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """The warm agent's socket this environment names: ``$WAN_S2V_WARM_AGENT``, None where it is
    ``off``; unset: :func:`default_socket`."""
    env = os.environ if env is None else env
    given = env.get(ENV, "").strip()
    if given.lower() == OFF:
        return None
    return Path(given).expanduser() if given else default_socket(env)


def default_socket(env: Optional[Mapping[str, str]] = None) -> Path:
    """One per user and host: ``$XDG_RUNTIME_DIR/wan-s2v/warm-HOST.sock``, else
    ``/tmp/wan-s2v-UID/warm-HOST.sock`` (the host in the name: a home shared over NFS by several
    nodes holds one per node)."""
    env = os.environ if env is None else env
    base = Path(env["XDG_RUNTIME_DIR"]) / "wan-s2v" if env.get("XDG_RUNTIME_DIR") else \
        Path("/tmp") / f"wan-s2v-{os.getuid()}"
    return base / f"warm-{os.uname().nodename}.sock"


#: variables a library reads when it is loaded, by the library: where the warm agent has not loaded
#: it, a fork that loads it later reads the run's values, as a spawned agent would (Intel's OpenMP
#: runtime: joblib sets ``KMP_INIT_AT_FORK`` in every process that imports it, the launcher's too)
LIBRARY_PREFIXES = {"KMP_": "libiomp"}


def socket_dir_problem(path: Path) -> Optional[str]:
    """Why the directory of a warm agent's socket cannot be trusted, or None: a real directory (no
    symlink) where no other user can put their own file in place of the socket: this user's and
    writable by no one else, or sticky (``/tmp``: only a file's owner may replace it). Both ends
    also check who is at the other end of the socket (:func:`peer`)."""
    try:
        st = os.lstat(path.parent)
    except FileNotFoundError:
        return None  # the warm agent makes it (0700)
    except OSError as e:
        return f"{path.parent}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path.parent} is not a directory"
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_uid != os.getuid() and not sticky:
        return f"{path.parent} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022 and not sticky:
        return f"{path.parent} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def interpreter() -> dict:
    """What makes two processes the same Python: its executable as named (a venv's ``python`` is
    a link to its base interpreter: the prefix tells venvs apart), prefixes and version."""
    return {"executable": os.path.abspath(sys.executable), "prefix": sys.prefix, "exec_prefix": sys.exec_prefix,
            "version": sys.version}


def peer(sock: socket.socket) -> tuple[Optional[int], Optional[int]]:
    """The process id and user id at the other end of a Unix socket (SO_PEERCRED); Nones where
    unreadable."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None, None
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def import_time(name: str, dormant: tuple[str, ...] = ()) -> bool:
    """Read when a process starts or imports a library (so fixed in the warm agent's forks);
    ``dormant``: prefixes of :data:`LIBRARY_PREFIXES` whose library the warm agent has not loaded."""
    return name.startswith(IMPORT_PREFIXES) and name not in READ_WHEN_USED and not name.startswith(dormant)


def env_conflict(warm: Mapping[str, str], run: Mapping[str, str], warm_now: Optional[Mapping[str, str]] = None,
                 dormant: tuple[str, ...] = ()) -> Optional[str]:
    """Why a process forked from the warm agent (its environment ``warm``, as it started) cannot
    have the run's environment ``run``, or None: an import-time variable (:func:`import_time`) set
    differently, other than the ones it takes on from the run's value. A taken-on variable the run
    does not set but the warm agent did cannot be undone in a fork. A run's value that the warm
    agent's own imports gave the variable (``warm_now``: its environment now) is the same value:
    OpenCV prepends its library directory to ``LD_LIBRARY_PATH`` for its child processes, so a
    launcher that imported it passes that on."""
    warm_now = warm_now or {}
    for name in sorted({*warm, *run}):
        if not import_time(name, dormant) or run.get(name) in (warm.get(name), warm_now.get(name, warm.get(name))):
            continue
        if name in TAKEN_ON and name in run:
            problem = taken_on_problem(name, warm.get(name), run[name])
            if problem is None:
                continue
            return problem
        return f"${name} is {_shown(run.get(name))} for this run, {_shown(warm.get(name))} in the warm agent"
    return None


def _shown(value: Optional[str]) -> str:
    return "unset" if value is None else repr(value if len(value) <= 60 else value[:57] + "...")


def taken_on_problem(name: str, warm: Optional[str], run: str) -> Optional[str]:
    """Why a fork cannot set ``name`` to the run's value itself, or None."""
    if name == "OMP_NUM_THREADS" and not run.strip().isdigit():
        return f"$OMP_NUM_THREADS is {run!r} for this run: a fork sets a single number of threads"
    if name.startswith("MALLOC_") and not run.strip().isdigit():
        return f"${name} is {run!r} for this run: a fork sets a number"
    if name == "PYTHONPATH":
        missing = [e for e in (warm or "").split(os.pathsep) if e and e not in run.split(os.pathsep)]
        if missing:
            return f"$PYTHONPATH has {missing[0]} in the warm agent, not for this run (a fork cannot take it away)"
    return None


# ----------------------------------------------------------------------------- the wire
# One request a connection: {"argv", "env", "cwd", "interpreter", "engine", "umask", "affinity"}
# with two file descriptors (the agent's stdin, and its stdout, stderr joining it); the answers:
# {"pid": N} with the agent's pidfd (forked) or {"refused": WHY}, then, once the forked agent has
# ended, {"exit": CODE} (as Popen's returncode: -N for a signal). The connection stays open while
# the agent lives: the warm agent stops the agent (SIGTERM) when the launcher's end closes, as
# PR_SET_PDEATHSIG does.

def send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    """One message: its length (4 bytes), its JSON; ``fds`` travel with it (SCM_RIGHTS)."""
    body = json.dumps(message).encode()
    data = struct.pack("!I", len(body)) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv(sock: socket.socket, n: int, deadline: Optional[float]) -> bytes:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError("the message did not come whole in time")
        sock.settimeout(left)
    try:
        return sock.recv(n)
    except socket.timeout:
        raise ValueError("the message did not come whole in time") from None


def receive(sock: socket.socket, max_fds: int = 0, within_s: Optional[float] = None) \
        -> tuple[Optional[dict], list[int]]:
    """The next message and the descriptors that came with it; ``(None, [])`` at the end of the
    connection. A malformed or oversized message, or one not whole within ``within_s`` seconds,
    raises ValueError (and the descriptors that came with it are closed)."""
    deadline = None if within_s is None else time.monotonic() + within_s
    fds: list[int] = []
    try:
        if max_fds:
            if deadline is not None:
                sock.settimeout(within_s)
            head, fds, _, _ = socket.recv_fds(sock, 4, max_fds)
        else:
            head = _recv(sock, 4, deadline)
        while head and len(head) < 4:
            more = _recv(sock, 4 - len(head), deadline)
            if not more:
                break
            head += more
        if not head:
            return None, []
        if len(head) < 4:
            raise ValueError("the connection ended inside a message")
        (n,) = struct.unpack("!I", head)
        if n > MAX_MESSAGE:
            raise ValueError(f"a message of {n} bytes (at most {MAX_MESSAGE})")
        body = b""
        while len(body) < n:
            more = _recv(sock, n - len(body), deadline)
            if not more:
                raise ValueError("the connection ended inside a message")
            body += more
        message = json.loads(body)
        if not isinstance(message, dict):
            raise ValueError("a message that is not a JSON object")
        return message, fds
    except (ValueError, OSError, socket.timeout) as e:
        for fd in fds:
            os.close(fd)
        if isinstance(e, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise
        raise ValueError(str(e) or type(e).__name__) from None
