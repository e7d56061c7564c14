"""A full disk: how every part of the runner recognises it and says it.

A write that fails because its filesystem is full (``ENOSPC``) or its quota is spent (``EDQUOT``)
is not a bug of the run: every clip committed before it is kept, and ``wan-s2v resume`` finishes
the video once there is room. So it is said in one line (the filesystem, what it needs when that
is known, what was kept, the fix), under an exit code of its own
(:data:`~wan_s2v_runner.shared.exit_codes.DISK_FULL`), never as a traceback.

* :func:`full_error`: the ENOSPC/EDQUOT error in an exception's cause chain, if any;
  :func:`says_full`: the same for an error's text (a rank's, read from its events);
* :class:`DiskError`: a write that failed, naming what was written and where (``path``) and, when
  known, the bytes it needed (``need``); :func:`~wan_s2v_runner.shared.atomic.atomic_write` raises
  it for a full disk, the video writer for its appends and checkpoints;
* :func:`describe`: an error's full-disk facts as an event's ``disk`` field (``path``, ``mount``,
  ``need_bytes``, ``why``), so a reader need not parse its text;
* :func:`mount_point`, :func:`free_bytes`, :func:`size_text`: the words of the one line.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Union

#: the errors that say "no room": the filesystem is full, or the user's quota on it is spent
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: the same in an error's text (a rank's error, as its events carry it)
_FULL_TEXT = re.compile(r"\[Errno (?:%d|%d)\]|No space left on device|Disk quota exceeded"
                        % (errno.ENOSPC, errno.EDQUOT))
#: a path an OSError's text names (``[Errno 28] No space left on device: '/x/y'``)
_PATH_IN_TEXT = re.compile(r"(?:No space left on device|Disk quota exceeded|\] [^:]*): '(/[^']+)'")


def full_error(e: Optional[BaseException]) -> Optional[OSError]:
    """The ENOSPC/EDQUOT ``OSError`` in ``e``'s cause chain (``e`` itself first), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None


def is_disk_full(e: Optional[BaseException]) -> bool:
    """Whether ``e`` (or what caused it) is a full disk or a spent quota."""
    return full_error(e) is not None


def says_full(text: Optional[str]) -> bool:
    """Whether an error's text says its disk was full (ENOSPC or EDQUOT, by number or words)."""
    return bool(text) and _FULL_TEXT.search(text) is not None


def path_in(text: Optional[str]) -> Optional[Path]:
    """The file an error's text names (``...: '/x/y'``), if it names one."""
    m = _PATH_IN_TEXT.search(text or "")
    return Path(m.group(1)) if m else None


#: what follows a full disk's fix where a run's video was being written
RESUME = "`wan-s2v resume` the run directory: every finished clip is kept"
#: the same for a served job: its server fails it, keeping the video so far
RESUBMIT = ("submit the job again (a server: delete videos, or set --keep-videos / --keep-hours); the video "
            "so far is kept")


class DiskError(OSError):
    """Writing ``path`` failed (a full disk above all): one line, cause and fix; every clip
    committed before it is kept for ``wan-s2v resume``. ``need``: the bytes the write needed,
    when known. Its ``errno`` is the failed write's, so ``except OSError`` still takes it."""

    path: Optional[Path] = None
    need: Optional[int] = None

    @classmethod
    def of(cls, e: OSError, what: str, path: Union[str, Path, None] = None, need: Optional[int] = None,
           then: Optional[str] = RESUME) -> "DiskError":
        """``e`` (the failed write of ``what``) in one line with its fix, ``then`` after it (None: the
        fix alone, for a write that is not a run's video)."""
        full = e.errno in FULL_ERRNOS
        fix = ("free space on that disk (or raise the quota)" if full else "check the output's directory and disk")
        where = Path(path) if path is not None else (Path(e.filename) if isinstance(e.filename, str) else None)
        on = f" (the filesystem at {mount_point(where)})" if full and where is not None else ""
        err = cls(e.errno, f"{what} failed: {e.strerror or e}{on}. Fix: {fix}" + (f", then {then}" if then else ""))
        err.path, err.need = where, need
        err.__cause__ = e
        return err


def describe(e: Optional[BaseException]) -> Optional[dict[str, Any]]:
    """A full disk's facts for an event record's ``disk`` field (``path``: the file whose write
    failed, ``mount``: its filesystem, ``need_bytes``: what the write needed; None where unknown;
    ``why``: the OS's words), or None when ``e`` is not a full disk."""
    full = full_error(e)
    if full is None:
        return None
    path = None
    for err in (e, full):
        if isinstance(err, DiskError) and err.path is not None:
            path = err.path
            break
    if path is None and isinstance(full.filename, str):
        path = Path(full.filename)
    need = next((err.need for err in (e, full) if isinstance(err, DiskError) and err.need), None)
    return {"path": str(path) if path else None, "mount": str(mount_point(path)) if path else None,
            "need_bytes": need, "why": why(full)}


def why(e: Union[BaseException, str, None]) -> str:
    """The OS's words for a full disk: ``No space left on device``, or ``Disk quota exceeded``
    (from an error, or an error's text)."""
    if isinstance(e, OSError):
        return os.strerror(e.errno) if e.errno in FULL_ERRNOS else (e.strerror or str(e))
    quota = re.search(r"\[Errno %d\]|Disk quota exceeded" % errno.EDQUOT, str(e or ""))
    return os.strerror(errno.EDQUOT if quota else errno.ENOSPC)


def mount_point(path: Union[str, Path]) -> Path:
    """The mount point of the filesystem that holds ``path`` (or would: the nearest existing
    directory above a path that does not exist yet)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Union[str, Path]) -> Optional[int]:
    """Free bytes (for this user) on the filesystem of ``path``, or None when it cannot be asked."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def size_text(n: Optional[float]) -> str:
    """Bytes in words: ``512 B``, ``3.4 MB``, ``12.0 GB`` (decimal units, as ``df -H``)."""
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
