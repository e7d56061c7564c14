"""Checks as data: :class:`CheckResult`, the check registry, and :func:`run_checks`.

A check is a small function ``fn(ctx) -> CheckResult | list[CheckResult]`` registered with
``@check(group)``. It reads everything from the :class:`~.context.CheckContext` (recorded or live
machine facts, the run's settings, the files) and returns a status (ok/warn/fail/skip), a one-line
finding with the measured value and, unless ok, a one-line fix. Groups are the names modes
declare in ``runners/*.py`` (``RUNNER.checks``); :data:`GROUPS` lists them in display order.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Optional, Union

GROUPS = ("python_torch", "gpus", "communication", "attention", "engine", "media", "checkpoint",
          "inputs", "memory", "output", "ulysses_degree", "fsdp")


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
    group: str = ""
    data: dict = field(default_factory=dict)  # measured values, for --json
    ms: float = 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
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
#: group -> check functions, in registration (= display) order
REGISTRY: dict[str, list[CheckFn]] = {g: [] for g in GROUPS}


def check(group: str) -> Callable[[CheckFn], CheckFn]:
    if group not in REGISTRY:
        raise ValueError(f"unknown check group {group!r}")

    def deco(fn: CheckFn) -> CheckFn:
        REGISTRY[group].append(fn)
        return fn
    return deco


def _load_check_modules() -> None:
    # importing registers the checks (decorators); order here = display order within a group
    from . import (  # noqa: F401
        checks_checkpoint,
        checks_comm,
        checks_engine,
        checks_gpu,
        checks_inputs,
        checks_memory,
        checks_parallel,
        checks_python,
    )


def run_checks(ctx, groups: Iterable[str] = GROUPS) -> list[CheckResult]:
    """Run every check of ``groups`` (in :data:`GROUPS` order) against ``ctx``.

    A check that raises is reported as a warning naming the exception (a bug in a check must
    not block a run, nor hide the other results)."""
    _load_check_modules()
    wanted = set(groups)
    unknown = wanted - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown check groups: {sorted(unknown)}")
    out: list[CheckResult] = []
    for group in GROUPS:
        if group not in wanted:
            continue
        for fn in REGISTRY[group]:
            t0 = time.perf_counter()
            try:
                got = fn(ctx)
            except Exception as e:  # noqa: BLE001 - reported, not raised
                got = warn(f"{group}.{fn.__name__.removeprefix('check_')}",
                           f"the check itself crashed: {type(e).__name__}: {e}",
                           "report this as a wan-s2v bug; run with --skip-preflight only if sure")
            ms = (time.perf_counter() - t0) * 1000
            results = got if isinstance(got, list) else ([got] if got is not None else [])
            for r in results:
                r.group = group
                r.ms = round(ms / len(results), 2)
                out.append(r)
    return out


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
