"""The machine-facts schema: :class:`MachineFacts`, a read-only view of one facts document.

A facts document is the JSON the probe (:mod:`.probe`) collects on a live machine, or a recorded
one (``tests/data/machines/*.json``, loaded with :meth:`MachineFacts.load`). Top-level keys:
``schema`` (:data:`SCHEMA`), ``label``/``hostname``, ``live``, ``torch`` (build and CUDA/NCCL
versions, ``arch_list``), ``driver``, ``gpus`` (name, ``capability``, ``total_mib``/``free_mib``),
``p2p`` and ``links`` (GPU-pair matrices; links in ``nvidia-smi topo -m`` notation), ``host``
(RAM, cgroup limit, ``/dev/shm``, container; optional ``disk_read_mib_s``: the local disk's
sequential read, what a DiT streamed from the page cache is read again at: None or absent =
unknown, the plan then assumes an NVMe drive and says so), ``disks`` (filesystems: mount ``path``,
``free_mib``, ``total_mib``; the probe records its working directory's), ``packages``/``modules``,
``dep_conflicts``, ``attention`` (per flash-attn backend: ``installed``/``usable``/``reason``/
``import_error``, plus what ``auto`` picks; see :mod:`wan_s2v_runner.shared.attention_backends`)
and ``env``. Checks read only these facts (the disk check measures a live machine's filesystem
itself: a job's paths are known only then). Nothing here collects anything: importing it is cheap.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

SCHEMA = 1
MiB = 2**20


@dataclass
class MachineFacts:
    """Read-only view of a facts document (live or recorded)."""

    raw: dict

    @classmethod
    def load(cls, path) -> "MachineFacts":
        return cls(json.loads(Path(path).read_text(encoding="utf-8")))

    def to_json(self) -> str:
        return json.dumps(self.raw, indent=2, sort_keys=False)

    # convenience accessors (missing keys -> neutral values)
    @property
    def label(self) -> str:
        return self.raw.get("label") or self.raw.get("hostname") or "this machine"

    @property
    def live(self) -> bool:
        return bool(self.raw.get("live"))

    @property
    def torch(self) -> dict:
        return self.raw.get("torch") or {}

    @property
    def gpus(self) -> list[dict]:
        return list(self.raw.get("gpus") or [])

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def host(self) -> dict:
        return self.raw.get("host") or {}

    @property
    def env(self) -> dict:
        return self.raw.get("env") or {}

    @property
    def driver(self) -> dict:
        return self.raw.get("driver") or {}

    @property
    def attention(self) -> dict:
        return self.raw.get("attention") or {}

    def package(self, name: str) -> Optional[str]:
        return (self.raw.get("packages") or {}).get(name)

    def module(self, name: str) -> Optional[bool]:
        return (self.raw.get("modules") or {}).get(name)

    def p2p(self, i: int, j: int) -> Optional[bool]:
        m = self.raw.get("p2p")
        try:
            return None if m is None else bool(m[i][j])
        except (IndexError, TypeError):
            return None

    def link(self, i: int, j: int) -> Optional[str]:
        m = self.raw.get("links")
        try:
            return None if m is None else m[i][j]
        except (IndexError, TypeError):
            return None

    def nvlink(self, i: int, j: int) -> bool:
        return (self.link(i, j) or "").startswith("NV")

    def filesystem(self, path) -> Optional[dict]:
        """The recorded filesystem (``disks``: ``path`` its mount point, ``free_mib``,
        ``total_mib``) that holds ``path``: the entry with the longest mount point above it; None
        when none is recorded (a live machine is measured instead: ``probe.filesystem``)."""
        target = PurePosixPath(str(path))
        best = None
        for d in self.raw.get("disks") or []:
            mount = PurePosixPath(str(d.get("path") or "/"))
            if d.get("free_mib") is not None and (target == mount or mount in target.parents):
                if best is None or len(mount.parts) > len(PurePosixPath(best["path"]).parts):
                    best = {**d, "path": str(mount)}
        return best

    def host_available_bytes(self) -> Optional[int]:
        """Memory a new process may use: MemAvailable, capped by a cgroup limit minus usage."""
        h = self.host
        avail = h.get("mem_available_mib")
        lim, used = h.get("cgroup_limit_mib"), h.get("cgroup_usage_mib") or 0
        vals = [v for v in (avail, (lim - used) if lim else None) if v is not None]
        return int(min(vals) * MiB) if vals else None
