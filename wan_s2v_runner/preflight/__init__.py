"""Preflight: catch every knowable failure before a process is spawned.

Checks are data (:class:`CheckResult`: status, one-line finding with the measured value, fix),
grouped as the modes declare them (``runners/*.py`` ``RUNNER.checks``), and read hardware facts
from one injectable probe (:mod:`.probe`; recorded machines in ``tests/data/machines/``).
``run`` calls :func:`gate`; ``wan-s2v doctor`` calls :func:`cmd_doctor`; ``--mode auto`` uses
:func:`recommend_mode`. Checks and exit codes are listed in ``docs/preflight.md``; the memory
formula in ``docs/memory-plan.md``.
"""
from .context import CheckContext
from .core import GROUPS, CheckResult, Status, run_checks
from .doctor import cmd_doctor, diagnose, gate
from .probe import MachineFacts, probe_machine
from .recommend import Recommendation, recommend_mode

__all__ = ["gate", "recommend_mode", "Recommendation", "cmd_doctor", "run_checks", "CheckResult",
           "Status", "CheckContext", "MachineFacts", "probe_machine", "diagnose", "GROUPS"]
