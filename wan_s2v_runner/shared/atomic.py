"""Nothing half-written: every file the runner produces appears by ``os.replace`` of a temporary.

One naming rule for temporaries, ``.<stem>.<pid>.<host>-<tag><suffix>`` next to the destination
(the suffix is kept so writers that pick a format from it — PIL, ffmpeg — still work; the host,
so two machines writing one file of a shared directory never share a temporary), so the
launcher can find and remove what a killed rank left behind (:func:`leftover_pattern`).

``durable`` writes (a job's mp4 and record: what a server's queue then calls ``completed``) are
also on disk before anyone is told: the temporary is fsynced before the rename, and the
directory after it (:func:`fsync_file`, :func:`fsync_dir`), so a power cut leaves the old state or
the whole new file, never a name pointing at nothing.

A write that fails on a full disk (or a spent quota) raises
:class:`~wan_s2v_runner.shared.disk.DiskError` (an ``OSError`` with the same errno), naming the
file and, for :func:`write_text`, the bytes it needed: the caller says it in one line
(:mod:`wan_s2v_runner.shared.disk`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from wan_s2v_runner.shared.disk import DiskError, is_disk_full

#: asked just before a temporary is renamed onto its destination: False (or a raise) leaves the
#: destination as it was (a served job's lease, :mod:`wan_s2v_runner.rank.lease`)
CommitIf = Optional[Callable[[], bool]]


class NotCommitted(Exception):
    """A write's ``commit_if`` said no: the temporary was removed, the destination is untouched."""


def _host() -> str:
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"


#: this machine, as temporaries name it
HOST = _host()


def temp_name(dest: Path, tag: str = "tmp", pid: int | None = None) -> Path:
    dest = Path(dest)
    return dest.with_name(f".{dest.stem}.{os.getpid() if pid is None else pid}.{HOST}-{tag}{dest.suffix}")


def is_temp(path: Path) -> bool:
    """Whether ``path`` is named as :func:`temp_name` names a temporary."""
    import re

    return re.match(rf"^\..+\.\d+\.{re.escape(HOST)}-[A-Za-z]+", Path(path).name) is not None


def leftover_pattern(dest: Path, pid: int) -> str:
    """Glob (relative to dest's directory) matching every temporary of ``dest`` made by ``pid``."""
    dest = Path(dest)
    return f".{dest.stem}.{pid}.*{dest.suffix}"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (the directory's entry on disk)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(tmp: Path, dest: Path, durable: bool = False, commit_if: CommitIf = None) -> None:
    """``os.replace``; ``durable``: the file's data before, the directory entry after;
    ``commit_if``: asked last (:class:`NotCommitted` when it says no)."""
    if durable:
        fsync_file(tmp)
    if commit_if is not None and not commit_if():
        raise NotCommitted(str(dest))
    os.replace(tmp, dest)
    if durable:
        fsync_dir(Path(dest).parent)


def atomic_write(dest: Path, write: Callable[[Path], object], durable: bool = False,
                 commit_if: CommitIf = None, need: Optional[int] = None) -> Path:
    """``write(tmp)`` then rename onto ``dest`` (when ``commit_if`` says so); on any error the
    temporary is removed. A full disk raises :class:`DiskError` (``need``: the bytes the write
    needed, when the caller knows them)."""
    dest = Path(dest)
    tmp = temp_name(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        replace(tmp, dest, durable, commit_if)
    except OSError as e:
        if isinstance(e, DiskError) or not is_disk_full(e):
            raise
        raise DiskError.of(e, f"writing {dest}", path=dest, need=need, then=None) from e
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def write_text(dest: Path, text: str, durable: bool = False, commit_if: CommitIf = None) -> Path:
    data = text.encode("utf-8")
    return atomic_write(dest, lambda p: p.write_bytes(data), durable, commit_if, need=len(data))
