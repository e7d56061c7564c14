"""Every cache wan-s2v keeps, as a list a person or a program reads, and its clearing: what
``wan-s2v cache`` shows and does, and what the doctor sums.

* **Entries** (:func:`list_caches`): each DiT page-cache file on its own (its path, size, last
  use, what it is for from its trailer, whether a running group maps it and which processes:
  ``shared.dit_files``), a writer's temporary (a stopped writer's is waste), and every other
  kind (``shared.cache_dirs.CacheKind``) as its one directory (its size, its newest file's time).
* **Clearing** (:func:`clear`): targets are ``all``, a kind's name, a path (a file or a kind's
  directory), a DiT file's name or a prefix of its key (at least :data:`KEY_PREFIX` hex digits).
  A DiT file a process maps is kept and said so (``shared.dit_files.remove``); ``all`` leaves a
  directory wan-s2v does not own (``$TORCHINDUCTOR_CACHE_DIR``'s) unless it is named.

Imports only other ``shared`` modules.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from wan_s2v_runner.shared import cache_budget, cache_dirs, dit_files
from wan_s2v_runner.shared.cache_budget import human
from wan_s2v_runner.shared.cache_dirs import CacheKind

#: the shortest key prefix that names a DiT file
KEY_PREFIX = 6
ALL = "all"


@dataclass
class CacheEntry:
    """One cache: a DiT file (``file``), or a kind's directory."""

    kind: CacheKind
    path: Path
    bytes: int
    last_use: Optional[float]
    what: str
    owned: bool = True
    file: Optional[dit_files.DitFile] = None

    @property
    def in_use(self) -> bool:
        return bool(self.file is not None and self.file.in_use)

    def to_json(self) -> dict:
        out = {"kind": self.kind.value, "path": str(self.path), "bytes": self.bytes,
               "last_use": iso(self.last_use), "what": self.what, "owned": self.owned, "in_use": self.in_use}
        if self.file is not None:
            f = self.file
            out.update(key=f.key, whole=f.meta is not None or f.temporary, about=f.about,
                       pids=list(f.pids), temporary=f.temporary, writer=f.writer)
        return out


def iso(t: Optional[float]) -> Optional[str]:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def _tree(path: Path) -> tuple[int, Optional[float]]:
    """(bytes of the files under ``path``, the newest one's mtime); symbolic links not followed."""
    total, newest = 0, None
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                    continue
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            total += st.st_size
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
    return total, newest


def list_caches(setting=None, env: Optional[Mapping[str, str]] = None) -> list[CacheEntry]:
    """Every cache (``setting``: the ``cache_dir`` setting; ``env``: this process's)."""
    out = []
    for kind in CacheKind:
        d = cache_dirs.directory(kind, setting, env)
        if kind is CacheKind.DIT:
            for f in dit_files.scan(d):
                out.append(CacheEntry(kind, f.path, f.bytes, f.last_use, f.describe(), file=f))
        elif d.is_dir():
            size, newest = _tree(d)
            out.append(CacheEntry(kind, d, size, newest, kind.what, owned=cache_dirs.owned(kind, env)))
    return out


@dataclass(frozen=True)
class Disk:
    """The filesystem a cache directory is on (measured at its nearest existing ancestor)."""

    path: Path
    free: int
    total: int

    def to_json(self) -> dict:
        return {"path": str(self.path), "free": self.free, "total": self.total}


def disk_of(path: Path) -> Optional[Disk]:
    """The filesystem ``path`` is (or would be created) on: its mount point, free and total bytes."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        u, dev = shutil.disk_usage(p), p.stat().st_dev
    except OSError:
        return None
    mount = p
    with contextlib.suppress(OSError):
        while mount != mount.parent and mount.parent.stat().st_dev == dev:
            mount = mount.parent
    return Disk(mount, u.free, u.total)


@dataclass
class Summary:
    """The caches in sum: where, how much of each kind, the DiT cache's budget, the disk's room."""

    root: Path
    entries: list
    dit_dir: Path
    budget: cache_budget.Budget
    disk: Optional[Disk]  # the DiT cache's disk

    @property
    def total(self) -> int:
        return sum(e.bytes for e in self.entries)

    def of(self, kind: CacheKind) -> list:
        return [e for e in self.entries if e.kind is kind]

    def line(self) -> str:
        """One line: the total, each kind, the DiT cache's budget and its disk's free space."""
        kinds = []
        for kind in CacheKind:
            es = self.of(kind)
            if es:
                n = f" in {len(es)} file{'s' if len(es) > 1 else ''}" if kind is CacheKind.DIT else ""
                kinds.append(f"{kind.value} {human(sum(e.bytes for e in es))}{n}")
        disk = (f"; {human(self.disk.free)} free of {human(self.disk.total)} on {self.disk.path}"
                if self.disk is not None else "; its disk's free space unknown")
        total = self.disk.total if self.disk is not None else None
        return (f"{human(self.total)} under {self.root}" + (f" ({', '.join(kinds)})" if kinds else " (none yet)")
                + f"; DiT cache budget {self.budget.describe(total)}{disk}")

    def to_json(self) -> dict:
        total = self.disk.total if self.disk is not None else None
        return {"root": str(self.root), "total_bytes": self.total,
                "by_kind": {k.value: sum(e.bytes for e in self.of(k)) for k in CacheKind},
                "dit_dir": str(self.dit_dir), "dit_budget": self.budget.describe(total),
                "dit_budget_bytes": self.budget.cap(total),
                "disk": self.disk.to_json() if self.disk is not None else None,
                "caches": [e.to_json() for e in self.entries]}


def summary(setting=None, budget=None, env: Optional[Mapping[str, str]] = None) -> Summary:
    """Every cache and the sums (``budget``: the ``dit_cache_max`` setting, else the environment's;
    an unreadable one reads as the default)."""
    e = os.environ if env is None else env
    text = budget if budget is not None else e.get(cache_budget.BUDGET_ENV)
    try:
        parsed = cache_budget.parse(text)
    except cache_budget.BudgetError:
        parsed = cache_budget.Budget()
    dit = cache_dirs.dit_dir(setting, env)
    return Summary(cache_dirs.root(setting, env), list_caches(setting, env), dit, parsed, disk_of(dit))


# --------------------------------------------------------------------------- clearing
class UnknownTarget(ValueError):
    """A target that names no cache (one line: what was given and how to name one)."""


@dataclass
class Cleared:
    removed: list = field(default_factory=list)  # CacheEntry
    kept: list = field(default_factory=list)  # (CacheEntry, why)

    @property
    def freed(self) -> int:
        return sum(e.bytes for e in self.removed)

    def to_json(self) -> dict:
        return {"removed": [e.to_json() for e in self.removed], "freed_bytes": self.freed,
                "kept": [{**e.to_json(), "why": why} for e, why in self.kept]}


def _names(e: CacheEntry, target: str) -> bool:
    """Whether ``target`` (a path, a file name, a key prefix) names ``e`` (a path of the DiT
    cache's directory names every DiT file)."""
    path = settle_path(target)
    if path is not None:
        return path == e.path.absolute() or (e.kind is CacheKind.DIT and path == e.path.parent.absolute())
    f = e.file
    return target == e.path.name or bool(f is not None and not f.temporary and f.key and len(target) >= KEY_PREFIX
                                          and f.key.startswith(target.lower()))


def select(entries: Sequence[CacheEntry], targets: Sequence[str]) -> list[CacheEntry]:
    """The entries ``targets`` name (in list order); raises :class:`UnknownTarget` for a target
    that names none (``all`` and a kind's name always name what there is)."""
    kinds = {k.value: k for k in CacheKind}
    chosen: set[int] = set()
    for t in targets:
        if t == ALL:
            found = [e for e in entries if e.owned]
        elif t in kinds:
            found = [e for e in entries if e.kind is kinds[t]]
        else:
            found = [e for e in entries if _names(e, t)]
            if not found:
                raise UnknownTarget(f"{t!r} names no cache. Fix: name one that `wan-s2v cache list` shows (its "
                                    f"path, its file name or key), a kind ({', '.join(kinds)}) or {ALL}")
        chosen.update(id(e) for e in found)
    return [e for e in entries if id(e) in chosen]


#: the name of the caches' root by the conventions (``$XDG_CACHE_HOME/wan-s2v``): a kind's directory
#: is removed whole only under it
ROOT_NAME = "wan-s2v"


def clear(entries: Sequence[CacheEntry]) -> Cleared:
    """Remove ``entries``: a DiT file unless a process maps it (or its writer is alive), a kind's
    directory whole where its root is named :data:`ROOT_NAME` (a root set to a shared directory,
    ``~/.cache`` say, may hold another program's ``demo`` or ``tests``: those are left, said so)."""
    out = Cleared()
    dit_dirs = set()
    for e in entries:
        if e.file is not None:
            dit_dirs.add(e.path.parent)
            if dit_files.remove(e.file):
                out.removed.append(e)
            else:
                pids = f" (pid {', '.join(map(str, e.file.pids))})" if e.file.pids else ""
                out.kept.append((e, ("being written" if e.file.temporary else "mapped by a running group")
                                 + pids + ": stop it first"))
            continue
        if e.path.parent.name != ROOT_NAME:  # a root of one's own (--cache-dir ~/.cache, say): maybe not all ours
            out.kept.append((e, f"not under a directory named {ROOT_NAME} (the root may hold other programs' "
                                f"{e.path.name}): remove it yourself if it is wan-s2v's"))
            continue
        try:
            shutil.rmtree(e.path)
            out.removed.append(e)
        except FileNotFoundError:
            out.removed.append(e)
        except OSError as err:
            out.kept.append((e, f"could not be removed: {err.strerror or err}"))
    for d in dit_dirs:
        dit_files.remove_stale_locks(d)
    return out


def settle_path(text: str) -> Optional[Path]:
    """``text`` as an absolute path when it reads as one (has a separator or exists), else None."""
    p = Path(text).expanduser()
    with contextlib.suppress(OSError):
        if os.sep in text or p.exists():
            return p.absolute()
    return None
