"""How much disk the DiT's page-cache files may take, and which go first: pure arithmetic, one
rule for the preflight (``preflight.checks_cache``: what a run would evict, or why it cannot
write its file) and the rank (``loading.dit_cache.ensure``: what it evicts before writing).

* **The budget** (``--dit-cache-max``, TOML ``dit_cache_max``, ``$WAN_S2V_DIT_CACHE_MAX``): a size
  (``200G``, ``1.5T``, ``500M``: binary units, ``G`` = GiB, a trailing ``B``/``iB`` allowed; a
  plain number is bytes) or a share of the disk the cache lives on (``20%``). Unset:
  :data:`DEFAULT_SHARE` of that disk, and never less than the one file a run needs (a run that
  fits the disk is never refused by the default budget: the other files go).
* **The disk**: a write always leaves :data:`DISK_FLOOR` free on the cache's disk, and the
  preflight also keeps the room the next video needs there (the ``output.disk`` plan): it
  settles the budget the rank gets to ``min(budget, cache + free - video - floor)``
  (:func:`room_budget`), so the rank's eviction is the one the preflight listed.
* **Eviction**: least recently used first (a file's last use: its atime, which the cache sets
  each time a run maps it), files a running group has mapped never (``shared.dit_files``: they
  hold a lock on them), until the kept files and the new one fit the budget and the disk keeps its
  floor (:func:`plan_room`).

Imports nothing from the project.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Sequence

GiB = 2**30
#: the DiT cache's share of its disk when no budget is set (a 1 TB disk: 250 GB, ~9 bf16 files or
#: ~17 fp8 ones at real size)
DEFAULT_SHARE = 0.25
#: what the cache's writes always leave free on its disk (the old check's 64 MiB margin, and room
#: for logs and a run directory's small files)
DISK_FLOOR = GiB
#: the budget's environment variable (also the setting's: ``GroupSpec.dit_cache_max``)
BUDGET_ENV = "WAN_S2V_DIT_CACHE_MAX"

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGTP]?)(?:I?B)?\s*$", re.I)


class BudgetError(ValueError):
    """A budget that does not read (one line: what was given and how to write it)."""


@dataclass(frozen=True)
class Budget:
    """A DiT cache budget: ``size`` bytes, or ``share`` of its disk; neither: the default."""

    size: Optional[int] = None
    share: Optional[float] = None

    @property
    def given(self) -> bool:
        return self.size is not None or self.share is not None

    def cap(self, disk_total: Optional[int]) -> Optional[int]:
        """The budget in bytes on a disk of ``disk_total`` bytes (None: a share of an unknown disk)."""
        if self.size is not None:
            return self.size
        share = DEFAULT_SHARE if self.share is None else self.share
        return None if disk_total is None else int(share * disk_total)

    def limit(self, disk_total: Optional[int], need: int = 0) -> Optional[int]:
        """What the files may take once a file of ``need`` bytes is written: :meth:`cap`, and at
        the default never less than ``need`` (the run's own file)."""
        cap = self.cap(disk_total)
        if cap is None or self.given:
            return cap
        return max(cap, int(need))

    def describe(self, disk_total: Optional[int] = None) -> str:
        cap = self.cap(disk_total)
        size = human(cap)
        if self.size is not None:
            return f"{size} (--dit-cache-max)"
        share = DEFAULT_SHARE if self.share is None else self.share
        return f"{size} ({share:.0%} of its disk{'' if self.given else ', the default'})"


def parse(text) -> Budget:
    """``200G``, ``1.5TiB``, ``20%``, a number of bytes; None or empty: the default. Raises
    :class:`BudgetError`."""
    if text is None or str(text).strip() == "":
        return Budget()
    if isinstance(text, int) and not isinstance(text, bool):
        return Budget(size=int(text))
    m = _SIZE.match(str(text))
    if not m:
        raise BudgetError(f"{text!r} is not a size: write one like 200G, 1.5T or 500M (binary units), or a share "
                          "of its disk like 20%")
    value, unit = float(m.group(1)), m.group(2).upper()
    if unit == "%":
        if not 0 < value <= 100:
            raise BudgetError(f"{text!r}: a share of the disk is above 0% and at most 100%")
        return Budget(share=value / 100)
    return Budget(size=int(value * _UNITS[unit]))


class Short(str, Enum):
    """What a room plan could not make room within."""

    NONE = "none"  # it fits
    BUDGET = "budget"  # the file alone, beside the files in use, exceeds the budget
    DISK = "disk"  # the disk cannot hold it (beside the floor and, for the preflight, the video)


@dataclass(frozen=True)
class Held:
    """A cache file as the plan sees it."""

    name: str
    bytes: int
    last_use: float  # seconds since the epoch
    in_use: bool = False  # mapped by a running group: never evicted


@dataclass
class RoomPlan:
    """What writing ``need`` bytes does: the files evicted (least recently used first) and what
    is left, or why it cannot (``short``)."""

    need: int
    budget: Optional[int]
    free: Optional[int]
    reserve: int
    evict: list = field(default_factory=list)  # Held, in eviction order
    kept_bytes: int = 0  # the files kept (in use ones included), before the new one
    short: Short = Short.NONE

    @property
    def fits(self) -> bool:
        return self.short is Short.NONE

    @property
    def evicted_bytes(self) -> int:
        return sum(h.bytes for h in self.evict)

    @property
    def free_after(self) -> Optional[int]:
        return None if self.free is None else self.free + self.evicted_bytes - self.need


def plan_room(files: Sequence[Held], need: int, budget: Optional[int], free: Optional[int],
              reserve: int = DISK_FLOOR) -> RoomPlan:
    """Evict the least recently used of ``files`` (never one in use) until the kept files and
    ``need`` fit ``budget`` (None: no budget known) and the disk keeps ``reserve`` of its ``free``
    bytes (None: unknown) after the write."""
    plan = RoomPlan(int(need), budget, free, int(reserve))
    kept = sum(h.bytes for h in files)
    gained = 0

    def over() -> Short:
        if budget is not None and kept + need > budget:
            return Short.BUDGET
        if free is not None and free + gained - need < reserve:
            return Short.DISK
        return Short.NONE

    for h in sorted((h for h in files if not h.in_use), key=lambda h: (h.last_use, h.name)):
        if over() is Short.NONE:
            break
        plan.evict.append(h)
        kept -= h.bytes
        gained += h.bytes
    plan.kept_bytes, plan.short = kept, over()
    return plan


def room_budget(budget: Optional[int], cache_bytes: int, free: Optional[int], video: int,
                floor: int = DISK_FLOOR) -> Optional[int]:
    """The budget the preflight settles for the rank: ``budget``, less what would leave the disk
    under ``video`` + ``floor`` free (the files now, ``cache_bytes``, plus the disk's ``free``)."""
    if free is None:
        return budget
    room = max(0, int(cache_bytes) + int(free) - int(video) - int(floor))
    return room if budget is None else min(int(budget), room)


def human(n: Optional[float]) -> str:
    """Bytes in binary units: ``232.8 GiB``, ``11.4 MiB``; None: ``?``."""
    if n is None:
        return "?"
    for div, suf in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.1f} {suf}"
    return f"{n:.0f} B"
