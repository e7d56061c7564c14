"""The DiT page-cache directory's files as files (no torch): their trailer, who uses them, when
they were last used, and their eviction. ``loading.dit_cache`` writes and maps them;
``preflight.checks_cache`` plans with them; ``wan-s2v cache`` lists and clears them.

* **A file**: ``dit-<key>.bin``, the packed parameters then a trailer: a JSON object (``format``,
  ``key``, ``nbytes``, ``layout``, fp8's ``scales``, ``at``; and ``about``: what a person needs
  to read it: the checkpoint, ``--dit-file``, the quantization, the LoRAs with their strengths
  and sha256, the dtype, when and where it was written), its length and :data:`MAGIC`
  (:func:`read_meta`). Beside it, its writers' lock ``.dit-<key>.lock`` and, while it is written,
  a temporary ``.dit-<key>.<pid>.<host>-tmp.bin`` (``shared.atomic``).
* **In use**: every process that maps a file holds a shared ``flock`` on it for as long as the
  mapping lives (:func:`mark`: the mapping keeps a duplicate of the locked descriptor). The
  kernel drops a dead process's lock with its descriptors, so a killed group's mark pins
  nothing; a live one's file is never evicted (:func:`busy`: an exclusive lock is refused).
  Which processes hold one: ``/proc/locks`` (:func:`holders`). ``flock`` is a local disk's: on
  NFS it is emulated by byte-range locks, which a process loses when it closes any descriptor of
  the file (the cache belongs on a local disk as a rule: what is read back).
* **Last use**: the file's atime, set by :func:`touch` each time a run finds or writes it
  (the mtime stays the write's; relatime and noatime mounts do not stop an explicit setting).
* **Eviction** (:func:`remove`): under the file's writers' lock, taken without waiting (a run
  finding or writing that file holds it), and an exclusive lock on the file (refused while any
  process maps it); the lock file goes with it (a writer that waited on it opens it again:
  :func:`key_lock`).

Imports only ``shared.atomic``.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from wan_s2v_runner.shared import atomic

#: bump when the file's layout changes: older files are then never matched
FORMAT = 1
MAGIC = b"wan-s2v-dit-v1\0\0"  # 16 bytes, the file's last
TAIL = struct.Struct("<Q16s")  # the trailer's JSON length, the magic
#: the trailer starts on a page boundary after the parameters
PAGE = 4096
_NAME = re.compile(r"^dit-([0-9a-f]{8,64})\.bin$")
_TEMP = re.compile(r"^\.dit-([0-9a-f]{8,64})\.(\d+)\.(.+)-[A-Za-z]+\.bin$")


#: what a file's write needs beyond its page-rounded bytes (its trailer, the filesystem's own)
WRITE_MARGIN = 64 * 2**20


def write_needs(nbytes: int) -> int:
    """The disk a DiT file of ``nbytes`` packed bytes needs while it is written: the bytes rounded
    up to a page, and :data:`WRITE_MARGIN` (the rule the preflight plans with and the writer checks)."""
    return -(-int(nbytes) // PAGE) * PAGE + WRITE_MARGIN


def path_for(directory: Path, key: str) -> Path:
    return Path(directory) / f"dit-{key}.bin"


def lock_path(directory: Path, key: str) -> Path:
    return Path(directory) / f".dit-{key}.lock"


def key_of(path: Path) -> Optional[str]:
    m = _NAME.match(Path(path).name)
    return m.group(1) if m else None


# --------------------------------------------------------------------------- the trailer
def read_meta(f, size: int) -> Optional[dict]:
    """The trailer's JSON of the open file ``f`` of ``size`` bytes (None: no whole trailer)."""
    if size < TAIL.size:
        return None
    f.seek(size - TAIL.size)
    meta_len, magic = TAIL.unpack(f.read(TAIL.size))
    if magic != MAGIC or meta_len > size - TAIL.size:
        return None
    f.seek(size - TAIL.size - meta_len)
    try:
        meta = json.loads(f.read(meta_len).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("at") != size - TAIL.size - meta_len:
        return None
    return meta


def _open_quietly(path: Path) -> int:
    """A read-only descriptor of ``path`` that leaves its atime (its last use) alone where this
    user owns it (``O_NOATIME``)."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def meta_of(path: Path) -> Optional[dict]:
    """:func:`read_meta` of the file at ``path`` (None: unreadable, or not a whole cache file);
    reading it is not a use (its atime is kept)."""
    try:
        with os.fdopen(_open_quietly(path), "rb") as f:
            return read_meta(f, os.fstat(f.fileno()).st_size)
    except OSError:
        return None


# --------------------------------------------------------------------------- locks and marks
@contextlib.contextmanager
def key_lock(directory: Path, key: str, wait: bool = True) -> Iterator[bool]:
    """Hold ``key``'s writers' lock (yields True), or, with ``wait`` False and another holder,
    yield False at once. The lock file may be removed by whoever holds it (an eviction): a
    lock taken on a file no longer under its name is taken again on the new one."""
    path = lock_path(directory, key)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # removed (or replaced) while we waited: lock the one under the name now
    try:
        yield True
    finally:
        os.close(fd)


def mark(fd: int) -> None:
    """Mark the open file ``fd`` as used by this process (a shared lock, held while any duplicate
    of ``fd`` is open: a mapping made from it keeps one)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def busy(path: Path) -> bool:
    """Whether a process marks ``path`` (maps it): an exclusive lock is refused."""
    try:
        fd = _open_quietly(path)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def holders(path: Path, locks_file: str = "/proc/locks") -> list[int]:
    """The processes holding a lock on ``path`` (``/proc/locks``; empty where it cannot be read)."""
    try:
        st = os.stat(path)
        text = Path(locks_file).read_text()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    out = []
    for line in text.splitlines():
        parts = line.split()
        if "->" in parts or len(parts) < 6:
            continue
        try:
            major, minor, ino = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want:
                out.append(int(parts[4]))
        except ValueError:
            continue
    return sorted(set(out))


def touch(path: Path) -> None:
    """Record a use of ``path`` now (its atime; its mtime kept). Best effort: a file another user
    owns keeps its time."""
    try:
        os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))
    except OSError:
        pass


# --------------------------------------------------------------------------- the directory
@dataclass
class DitFile:
    """A file of the DiT cache directory: a cache file (``key``; ``meta``: its trailer, None when
    it is not whole) or a writer's temporary (``writer``: its pid)."""

    path: Path
    bytes: int
    last_use: float  # a cache file's atime, a temporary's mtime
    key: Optional[str] = None
    meta: Optional[dict] = None
    writer: Optional[int] = None  # a temporary's writer
    writer_alive: bool = False
    in_use: bool = False
    pids: list = field(default_factory=list)

    @property
    def temporary(self) -> bool:
        return self.writer is not None

    @property
    def about(self) -> dict:
        return (self.meta or {}).get("about") or {}

    def describe(self) -> str:
        """What it is for, in words."""
        if self.temporary:
            return (f"half-written by pid {self.writer} " + ("(writing now)" if self.writer_alive
                                                             else "(stopped: removed by the next write or a clear)"))
        if self.meta is None:
            return "not a whole cache file (rewritten by its next run)"
        return describe_about(self.about, self.meta)


def describe_about(about: dict, meta: Optional[dict] = None) -> str:
    """A file's ``about`` in one line: the checkpoint (or ``--dit-file``), the dtype (``+ fp8``: its
    Linears in fp8), the LoRAs with their strengths."""
    if not about.get("checkpoint") and not about.get("dit_file"):
        return f"a DiT cache file whose trailer does not say what for (key {(meta or {}).get('key', '?')})"
    where = about.get("dit_file") or about.get("checkpoint") or "?"
    loras = about.get("loras") or []
    lora = ("no LoRA" if not loras else "LoRA " + ", ".join(f"{Path(x.get('path', '?')).name}:{x.get('strength', 1):g}"
                                                           for x in loras))
    fp8 = " + fp8" if about.get("quant") == "fp8" else ""
    return f"{where}; {about.get('dtype', '?')}{fp8}; {lora}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scan(directory: Path) -> list[DitFile]:
    """The cache files and writers' temporaries in ``directory`` (empty when it does not exist)."""
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for e in entries:
        key, temp = _NAME.match(e.name), _TEMP.match(e.name)
        if not (key or temp) or not e.is_file(follow_symlinks=False):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        path = Path(e.path)
        if key:
            meta = meta_of(path)
            pids = holders(path)
            out.append(DitFile(path, st.st_size, st.st_atime, key.group(1), meta, in_use=busy(path), pids=pids))
        else:
            pid, host = int(temp.group(2)), temp.group(3)
            alive = host != atomic.HOST or _alive(pid)  # another host's writer: not ours to judge
            out.append(DitFile(path, st.st_size, st.st_mtime, temp.group(1), writer=pid, writer_alive=alive,
                               in_use=alive))
    return sorted(out, key=lambda f: (f.last_use, f.path.name))


def remove(f: DitFile) -> bool:
    """Remove ``f`` unless a process uses it (a cache file: mapped, or its run finding or writing
    it; a temporary: its writer alive). Its lock file goes with a cache file. Whether it went."""
    if f.temporary:
        if f.writer_alive:
            return False
        with contextlib.suppress(FileNotFoundError):
            f.path.unlink()
        return True
    directory = f.path.parent
    with key_lock(directory, f.key, wait=False) as got:
        if not got:
            return False
        try:
            fd = os.open(f.path, os.O_RDONLY)
        except FileNotFoundError:
            fd = None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                f.path.unlink()
            with contextlib.suppress(FileNotFoundError):
                lock_path(directory, f.key).unlink()  # held: a waiter takes the new one (key_lock)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return False
            raise
        finally:
            if fd is not None:
                os.close(fd)
    return True


def remove_stale_locks(directory: Path) -> None:
    """Remove the writers' lock files of ``directory`` whose cache file is gone and that no one
    holds (an eviction or a clear leaves none; a file removed by hand leaves its lock)."""
    try:
        names = {e.name for e in os.scandir(directory)}
    except OSError:
        return
    for name in names:
        m = re.match(r"^\.dit-([0-9a-f]{8,64})\.lock$", name)
        if not m or f"dit-{m.group(1)}.bin" in names:
            continue
        with key_lock(directory, m.group(1), wait=False) as got:
            if got:
                with contextlib.suppress(FileNotFoundError):
                    lock_path(directory, m.group(1)).unlink()
