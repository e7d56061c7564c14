"""Checks as data: :class:`CheckResult`, the :class:`CheckGroup` vocabulary and small helpers.

A check is a small function ``fn(ctx) -> CheckResult | list[CheckResult]`` in one of the
``checks_*`` modules. It reads everything from the :class:`~.context.CheckContext` (recorded or
live machine facts, the run's settings, the files) and returns a status (ok/warn/fail/skip), a
one-line finding with the measured value and, unless ok, a one-line fix. Which checks exist, in
which group and order, is listed once in :mod:`.registry`. This module imports nothing from the
checks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Optional, Union


class CheckGroup(str, Enum):
    """Check groups, in display order."""

    PYTHON_TORCH = "python_torch"
    GPUS = "gpus"
    COMMUNICATION = "communication"
    ATTENTION = "attention"
    ENGINE = "engine"
    MEDIA = "media"
    CHECKPOINT = "checkpoint"
    LORA = "lora"
    INPUTS = "inputs"
    MEMORY = "memory"
    OUTPUT = "output"
    ULYSSES_DEGREE = "ulysses_degree"
    FSDP = "fsdp"
    LIVE = "live"  # --mode live: the step pipeline, its caches, its frames per second




class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class CheckResult:
    id: str  # e.g. "ulysses.heads"
    status: Status
    finding: str  # one line, with the measured value
    fix: str = ""  # one line; empty when there is nothing to do
    group: Optional["CheckGroup"] = None  # set by the registry when the check runs
    data: dict = field(default_factory=dict)  # measured values, for --json
    ms: float = 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        d["group"] = self.group.value if self.group is not None else ""
        return d


def ok(id: str, finding: str, fix: str = "", **data) -> CheckResult:
    return CheckResult(id, Status.OK, finding, fix, data=data)


def warn(id: str, finding: str, fix: str, **data) -> CheckResult:
    return CheckResult(id, Status.WARN, finding, fix, data=data)


def fail(id: str, finding: str, fix: str, **data) -> CheckResult:
    return CheckResult(id, Status.FAIL, finding, fix, data=data)


def skip(id: str, finding: str, **data) -> CheckResult:
    return CheckResult(id, Status.SKIP, finding, "", data=data)


CheckFn = Callable[[Any], Union[CheckResult, list, None]]


def counts(results: Iterable[CheckResult]) -> dict[str, int]:
    c = {s.value: 0 for s in Status}
    for r in results:
        c[r.status.value] += 1
    return c


def find(results: Iterable[CheckResult], id: str) -> Optional[CheckResult]:
    """The result with this check id (first one), or None."""
    return next((r for r in results if r.id == id), None)


def gib(n_bytes: Optional[float]) -> str:
    return "?" if n_bytes is None else f"{n_bytes / 2**30:.1f} GiB"


def human_count(n: float) -> str:
    """16300000000 -> '16.3B', 3420000 -> '3.42M', 350 -> '350'."""
    for div, suf in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suf}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for div, suf in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.1f} {suf}"
    return f"{n:.0f} B"
