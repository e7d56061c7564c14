"""One server per directory: ``SERVER_DIR/server.lock``, held with an OS lock (``flock``) for
the server's life, so a second ``wan-s2v serve`` on the same directory exits at once (code 3,
its one line naming the first server's pid) before it touches anything: two servers on one
directory would requeue each other's running job, stop each other's rank group and delete each
other's files. The kernel drops the lock when the server's process ends, however it ends
(kill -9 too): no stale lock to clean up. The lock's descriptor is not inherited by the rank
group.

The directory and what the server and its ranks write in it are the user's alone: the directory
is made ``0700`` and the server's umask ``077``.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "server.lock"


class DirectoryInUse(Exception):
    """Another server holds the directory (one line: cause and fix)."""


def hold(root: Path) -> int:
    """Lock ``root`` for this process (returns the lock's descriptor: keep it open) and make the
    directory private; :class:`DirectoryInUse` when another server holds it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DirectoryInUse(f"another wan-s2v serve (pid {holder}) uses the server directory {root}. Fix: stop "
                             "it, or give this server its own --server-dir") from None
    os.umask(0o077)  # what the server and its ranks write from now on: the user's alone
    root.chmod(0o700)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
