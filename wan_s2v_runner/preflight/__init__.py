"""Preflight: catch every knowable failure before a process is spawned.

Checks are data (:class:`CheckResult`: status, one-line finding with the measured value, fix),
listed once in :mod:`.registry` by :class:`CheckGroup`; a run's groups follow from its mode's
layout. Hardware facts come from one injectable probe (:mod:`.facts` schema, :mod:`.probe`
collection; recorded machines in ``tests/data/machines/``). ``run`` calls :func:`gate_report`;
``wan-s2v doctor`` gets a :class:`DoctorReport` from :func:`doctor` and prints it with
:mod:`.render`; ``--mode auto`` uses :func:`recommend_mode`. Nothing here parses argv: the CLI
(:mod:`wan_s2v_runner.cli.main`) does. Checks and exit codes are listed in ``docs/preflight.md``;
the memory formula in ``docs/memory-plan.md``; the plan table (which layout is fastest for N
GPUs) is :mod:`.plans`. Preflight runs in the launcher's process, before any rank exists.

May import: shared, loading, patches.
"""
from .context import CheckContext, ModeSource
from .core import CheckGroup, CheckResult, Status
from .doctor import (
    DoctorReport,
    GateReport,
    check_group,
    check_run,
    diagnose,
    doctor,
    group_context,
    machine_facts,
)
from .facts import MachineFacts
from .recommend import Recommendation, recommend_mode
from .registry import groups_for, run_checks
from .render import gate, gate_report, group_gate_report

__all__ = [
    "gate",
    "gate_report",
    "check_run",
    "check_group",
    "group_context",
    "group_gate_report",
    "doctor",
    "diagnose",
    "machine_facts",
    "recommend_mode",
    "Recommendation",
    "run_checks",
    "groups_for",
    "CheckResult",
    "CheckGroup",
    "Status",
    "CheckContext",
    "ModeSource",
    "MachineFacts",
    "DoctorReport",
    "GateReport",
]
