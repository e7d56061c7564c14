"""One module per parallel mode; ``get(mode)`` returns its :class:`~runners.base.ModeRunner`.

A rank's plan is the rank's own (``rank.parallel``), given to :meth:`~runners.base.ModeRunner.prepare`.

May import: shared, loading, patches (folders of wan_s2v_runner, and patches/).
"""
from wan_s2v_runner.shared.layout import Mode

from . import fsdp_fixed, hybrid, live, ulysses
from .base import ModeRunner

RUNNERS: dict[Mode, ModeRunner] = {r.RUNNER.mode: r.RUNNER for r in (ulysses, fsdp_fixed, hybrid, live)}


def get(mode) -> ModeRunner:
    return RUNNERS[Mode(mode)]
