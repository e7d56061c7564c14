"""The launcher's side of a node's warm agent (``wan-s2v warm``, which ``cli.cmd_warm`` becomes:
:mod:`wan_s2v_runner.rank.warm_agent`): a run's agent forked from it instead of spawned.

:func:`fork_agent` asks the warm agent named by ``$WAN_S2V_WARM_AGENT`` (unset: the per-user,
per-host default socket, when one listens) to fork the run's agent with the run's environment,
working directory, standard input and output pipe. It returns a :class:`ForkedAgent`, which the
launcher supervises as it does a :class:`subprocess.Popen` (pid, poll, wait, signals, the output
pipe), or None and why (none listens, ``off``, or the warm agent refused: the run's environment
or engine differ from what it imported) - and the launcher spawns the agent as it always did.
Either way run.json says which (``launcher.agent``).
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import warm_agent as wire

#: seconds to wait for the warm agent's answer (it checks the imported code's files first)
ANSWER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class AgentOrigin:
    """How a run's agent started: forked by the warm agent at ``socket``, or spawned (``why``)."""

    forked: bool
    socket: Optional[str] = None
    why: Optional[str] = None

    def to_json(self) -> dict:
        return {"forked_from_warm_agent": self.forked, "warm_agent_socket": self.socket, "why_spawned": self.why}


class ForkedAgent:
    """A run's agent forked by the warm agent: what the launcher uses of :class:`subprocess.Popen`.
    Its exit code comes over the connection (the warm agent is its parent); the connection is
    also how the warm agent knows the launcher is alive (it stops the agent when it closes). Its
    pidfd (sent with the answer) names it for signals and its end, whoever reaps it."""

    def __init__(self, sock: socket.socket, pid: int, pidfd: Optional[int], args: list[str], stdin, stdout):
        self._sock, self.pid, self._pidfd, self.args, self.stdin, self.stdout = sock, pid, pidfd, args, stdin, stdout
        self.returncode: Optional[int] = None
        self._orphaned = False  # the connection ended without the exit code

    @staticmethod
    def _ready(fd: int, timeout: Optional[float]) -> bool:
        p = select.poll()
        p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def _settle(self, timeout: Optional[float]) -> bool:
        """Read the exit message if it comes within ``timeout``; True once the code is known."""
        if self.returncode is not None:
            return True
        if not self._orphaned:
            if not self._ready(self._sock.fileno(), timeout):
                return False
            try:
                message, _ = wire.receive(self._sock, within_s=ANSWER_TIMEOUT_S)
            except ValueError:
                message = None
            if message is not None and isinstance(message.get("exit"), int):
                self.returncode = message["exit"]
                self.close()
                return True
            self._orphaned = True  # the warm agent ended first; its forks get SIGTERM then
            print(f"[wan-s2v] the warm agent ended before the run's agent (pid {self.pid}): its exit code is "
                  "unknown", file=sys.stderr, flush=True)
        if self._pidfd is not None and not self._ready(self._pidfd, timeout):  # the agent's end, if not its code
            return False
        self.returncode = 1
        self.close()
        return True

    def close(self) -> None:
        """Let go of the connection and the pidfd (the warm agent then stops a live agent)."""
        self._sock.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> Optional[int]:
        self._settle(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._settle(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:  # as Popen: an agent that ended meanwhile is not an error
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def fork_agent(argv: list[str], env: dict, cwd: str, stdin, wan_repo: Optional[Path]) \
        -> tuple[Optional[ForkedAgent], AgentOrigin]:
    """The run's agent (``argv``, as it would be spawned) forked by the warm agent, or None and
    why not. ``stdin``: ``subprocess.PIPE`` or ``subprocess.DEVNULL``, as for Popen; ``env``: the
    run's environment (it also names the warm agent: ``$WAN_S2V_WARM_AGENT``)."""
    path = wire.socket_path(env)
    if path is None:
        return None, AgentOrigin(False, why=f"${wire.ENV}={wire.OFF}")
    if not path.exists():
        return None, AgentOrigin(False, why=f"no warm agent listens on {path} (start one: wan-s2v warm)")
    problem = wire.socket_dir_problem(path)
    if problem:
        return None, AgentOrigin(False, str(path), f"not trusting the warm agent's socket: {problem}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(ANSWER_TIMEOUT_S)
    ours: list[int] = []
    theirs: list[int] = []
    fds: list[int] = []
    try:
        sock.connect(str(path))
        if wire.peer(sock)[1] != os.getuid():
            raise ValueError("it runs as another user")
        out_r, out_w = os.pipe()
        ours.append(out_r)
        theirs.append(out_w)
        if stdin == subprocess.PIPE:
            in_r, in_w = os.pipe()
            ours.append(in_w)
            theirs.insert(0, in_r)
        else:
            theirs.insert(0, os.open(os.devnull, os.O_RDONLY))
        wire.send(sock, {"argv": argv, "env": env, "cwd": cwd, "interpreter": wire.interpreter(),
                         "engine": str(engine_dir_of(wan_repo) or "") or None, "umask": umask(),
                         "affinity": sorted(os.sched_getaffinity(0))}, fds=tuple(theirs))
        for fd in theirs:
            os.close(fd)
        theirs.clear()
        answer, fds = wire.receive(sock, max_fds=1, within_s=ANSWER_TIMEOUT_S)
    except (OSError, ValueError) as e:
        for fd in ours + theirs:
            os.close(fd)
        sock.close()
        return None, AgentOrigin(False, str(path), f"the warm agent at {path} did not answer ({e})")
    if not answer or not isinstance(answer.get("pid"), int):
        for fd in ours + fds:
            os.close(fd)
        sock.close()  # a fork it made regardless ends when this closes
        why = (answer or {}).get("refused") or "it closed the connection"
        return None, AgentOrigin(False, str(path), f"the warm agent refused: {why}")
    sock.settimeout(None)
    stdout = os.fdopen(ours[0], "rb")
    stdin_file = os.fdopen(ours[1], "wb") if len(ours) > 1 else None
    pidfd = fds[0] if fds else None
    return ForkedAgent(sock, answer["pid"], pidfd, argv, stdin_file, stdout), AgentOrigin(True, str(path))


def engine_dir_of(wan_repo: Optional[Path]) -> Optional[Path]:
    """Where the run's agent would import the engine from (the spec's ``wan_repo``, which
    ``$WAN_REPO`` fills, else the installed package: :func:`~wan_s2v_runner.shared.engine_source.locate`),
    or None where it cannot be found (the agent is then spawned, and says why in its own words)."""
    from wan_s2v_runner.shared.engine_source import EngineNotFound, locate

    try:
        return locate(wan_repo).package_dir.resolve()
    except EngineNotFound:
        return None
