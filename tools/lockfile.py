"""``requirements.lock``, read: one :class:`Entry` a locked package (standard library only, so the
set-up's installer reads it with a bare venv's Python).

The lock is the output of ``uv pip compile --universal --generate-hashes`` (``tools/lock.py``
writes it; ``make lock``): a requirements file of ``name==version ; marker`` lines, each with the
sha256 of every file that version may install, and uv's ``# via`` annotations saying which
requirement pulled it in (``-r requirements.txt`` for a direct one). Those annotations are the
dependency graph the installer walks (:func:`needed`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

_HEAD = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)"
                   r"\s*(?:;\s*(?P<marker>[^\\]*?))?\s*\\?$")
_HASH = re.compile(r"--hash=(sha256:[0-9a-f]{64})")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503's normalised name (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """A version without its local label (``2.13.0+cpu`` -> ``2.13.0``)."""
    return version.split("+", 1)[0]


@dataclass
class Entry:
    """One locked ``name==version`` (a name may have several, under exclusive markers)."""

    name: str  # canonical
    version: str
    marker: Optional[str]
    hashes: set = field(default_factory=set)  # "sha256:<hex>"
    via: list = field(default_factory=list)  # canonical names, or "-r FILE" for a requirements file


def parse(text: str) -> list:
    """The entries of a lock's text, in file order."""
    entries: list[Entry] = []
    cur: Optional[Entry] = None
    in_via = False
    for raw in text.splitlines():
        line = raw.rstrip()
        m = _HEAD.match(line)
        if m:
            cur = Entry(canonical(m["name"]), m["version"], (m["marker"] or "").strip() or None)
            entries.append(cur)
            in_via = False
            continue
        if cur is None:
            continue
        stripped = line.strip()
        if stripped.startswith("--hash="):
            cur.hashes.update(_HASH.findall(stripped))
        elif stripped.startswith("# via"):
            rest = stripped[len("# via"):].strip()
            in_via = not rest
            if rest:
                cur.via.append(_via(rest))
        elif in_via and stripped.startswith("#   "):
            cur.via.append(_via(stripped[4:].strip()))
        elif not stripped.startswith("#"):
            in_via = False
    return entries


def _via(text: str) -> str:
    return text if text.startswith("-r ") else canonical(text.split()[0])


def requirement_name(req: str) -> str:
    """The canonical name a ``Requires-Dist`` string or a requirements line names."""
    m = _REQ_NAME.match(req)
    return canonical(m.group(1)) if m else ""


def needed(chosen: Mapping[str, Optional[Iterable[str]]], lock: Iterable[Entry]) -> set:
    """The names to install: what the lock's requirement files reach through its ``# via``
    graph, among ``chosen`` (the packages whose lock markers hold here, each with the
    ``Requires-Dist`` of the file pip picked for it, or None when unknown).

    An edge ``P -> C`` is followed only where the file chosen for ``P`` declares ``C``: the lock
    is resolved with PyPI's torch, the CUDA build, whose seventeen ``nvidia-*``/``triton``/``cuda-*``
    packages a CPU build of the same version does not declare, so a machine that installs the CPU
    build does not get them.
    """
    children: dict[str, set] = {}
    roots: set = set()
    for e in lock:
        for parent in e.via:
            if parent.startswith("-r "):
                roots.add(e.name)
            else:
                children.setdefault(parent, set()).add(e.name)
    declared = {name: None if reqs is None else {requirement_name(r) for r in reqs} for name, reqs in chosen.items()}
    seen: set = set()
    todo = [n for n in roots if n in chosen]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        decl = declared[name]
        for child in children.get(name, ()):
            if child in chosen and (decl is None or child in decl):
                todo.append(child)
    return seen
