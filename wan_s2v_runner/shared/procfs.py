"""Linux /proc readings both sides take: a process's resident-set high-water mark.

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
