"""Linux /proc readings both sides take: a process's resident-set high-water mark, and the name (``comm``)
a rank gives itself so the launcher knows a silent one; and giving glibc's free heap pages back.

The launcher samples its ranks' (``launcher.processes``); a rank reads and resets its own per
stage (``rank.memory_peaks``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union


def hwm_mb(pid: Union[int, str] = "self") -> Optional[float]:
    """Peak resident set size (VmHWM) of a live process, MiB; None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def mem_available() -> Optional[int]:
    """The RAM this process may still take, bytes: the host's ``MemAvailable`` (/proc/meminfo),
    capped by what its memory cgroup has left (limit less usage, as the preflight's facts cap it);
    None where unreadable."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw, usage = Path(limit_path).read_text().strip(), int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw.isdigit() and int(raw) < 2**60:
            left = max(0, int(raw) - usage)
            avail = left if avail is None else min(avail, left)
        break
    return avail


#: how a rank names itself (its ``comm``, what ps and top show): ``wan-s2v-r`` and its global rank
RANK_COMM_PREFIX = "wan-s2v-r"


def rank_comm(rank: int) -> str:
    """The ``comm`` a rank gives itself (at most 15 bytes, the kernel's limit)."""
    return f"{RANK_COMM_PREFIX}{rank}"[:15]


def comm_rank(comm: str) -> Optional[int]:
    """The global rank a ``comm`` of :func:`rank_comm` names, or None."""
    tail = comm[len(RANK_COMM_PREFIX):] if comm.startswith(RANK_COMM_PREFIX) else ""
    return int(tail) if tail.isdigit() else None


def name_this_process(comm: str) -> None:
    """Set this process's ``comm`` (Linux ``prctl(PR_SET_NAME)``); nothing where that fails."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, comm.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


#: allocations from this size up are mapped on their own and given back when freed
#: (:func:`pin_mmap_threshold`): glibc's own ceiling for its moving threshold (32 MiB on 64-bit),
#: fixed from the start. 4 MiB (before issue #80) had every activation of a clip's VAE decode
#: mapped and zero-filled anew: the decode took 1.3-1.8x as long, and varied clip to clip (12
#: clips at 128x128 on one CPU thread: 6.4 and 8.5 s a clip against 4.8 and 4.8 at 64 MiB and 4.8
#: and 4.6 with glibc's moving threshold; docs/bench.md, "Long videos")
MMAP_THRESHOLD = 32 * 2**20


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> None:
    """Map every allocation of ``nbytes`` or more on its own, and keep that size (``mallopt
    M_MMAP_THRESHOLD``). glibc's default raises the size each time a mapped block is freed, up to
    32 MiB: the set of allocations that come from the heap then changes in the middle of a run,
    and a long run's heap grew in a step (measured: +430 MiB between clip 13 and 14 of 24,
    bench/bench_longform.py) though nothing it holds grows. Fixed at :data:`MMAP_THRESHOLD` from
    the start, a run is in one regime from its first clip; :func:`trim_heap` after each clip gives
    back what it freed. A no-op where the C library is not glibc."""
    import ctypes
    try:
        ctypes.CDLL(None).mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def trim_heap() -> None:
    """Give glibc's free heap pages back to the system (``malloc_trim(0)``: every arena, the middle
    of each heap too). Memory freed by a thread (the DiT's reader) stays in that thread's arena,
    where the main thread never reuses it: without this, it counts in the rank's resident set
    until the process ends. A no-op where the C library is not glibc."""
    import ctypes
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
