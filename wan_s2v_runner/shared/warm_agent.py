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
import struct
from pathlib import Path
from typing import Mapping, Optional

#: ``off`` (always spawn), or the warm agent's socket; unset: the default socket, when one listens
ENV = "WAN_S2V_WARM_AGENT"
OFF = "off"

#: environment variables read when the interpreter starts or a library is imported (torch, its
#: OpenMP and BLAS, glibc's malloc, CUDA, inductor's config, transformers, diffusers): the warm
#: agent's values are the ones its forks have
IMPORT_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_", "GLIBC_",
                   "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "TRITON_", "HF_", "TRANSFORMERS_", "DIFFUSERS_")
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
            continue
        def shown(v):
            return "unset" if v is None else repr(v if len(v) <= 60 else v[:57] + "...")
        return f"${name} is {shown(run.get(name))} for this run, {shown(warm.get(name))} in the warm agent"
    return None


# ----------------------------------------------------------------------------- the wire
# One request a connection: {"argv", "env", "cwd", "executable", "wan_repo"} with two file
# descriptors (the agent's stdin, and its stdout, stderr joining it); the answers:
# {"pid": N} (forked) or {"refused": WHY}, then, once the forked agent has ended, {"exit": CODE}
# (as Popen's returncode: -N for a signal). The connection stays open while the agent lives: the
# warm agent stops the agent (SIGTERM) when the launcher's end closes, as PR_SET_PDEATHSIG does.

def send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    """One message: its length (4 bytes), its JSON; ``fds`` travel with it (SCM_RIGHTS)."""
    body = json.dumps(message).encode()
    data = struct.pack("!I", len(body)) + body
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[Optional[dict], list[int]]:
    """The next message and the descriptors that came with it; ``(None, [])`` at the end of the
    connection. A malformed or oversized message raises ValueError."""
    fds: list[int] = []
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, 4, max_fds)
    else:
        head = sock.recv(4)
    while head and len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            break
        head += more
    if len(head) < 4:
        for fd in fds:
            os.close(fd)
        if head:
            raise ValueError("the connection ended inside a message")
        return None, []
    (n,) = struct.unpack("!I", head)
    if n > MAX_MESSAGE:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a message of {n} bytes (at most {MAX_MESSAGE})")
    body = b""
    while len(body) < n:
        more = sock.recv(n - len(body))
        if not more:
            for fd in fds:
                os.close(fd)
            raise ValueError("the connection ended inside a message")
        body += more
    message = json.loads(body)
    if not isinstance(message, dict):
        for fd in fds:
            os.close(fd)
        raise ValueError("a message that is not a JSON object")
    return message, fds
