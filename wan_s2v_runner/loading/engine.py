"""Importing the official Wan2.2 engine (the ``wan`` package), unmodified.

Where it comes from is :mod:`wan_s2v_runner.shared.engine_source`. Two things must happen *before*
``import wan`` on a machine without CUDA; they live in ``patches/`` and are applied from here:
``patches.torchvision_cpu`` (a CUDA torchvision build on a CPU torch) and
``patches.t5_import_device`` (wan/modules/t5.py calls ``torch.cuda.current_device()`` at import).
``patches.attention.guard_flash_attn_imports`` also runs first, so a flash-attn built for another
torch ("undefined symbol") counts as absent instead of crashing ``import wan``.
Everything else is patched after import, per run, by ``patches.apply_for_run``.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

from wan_s2v_runner.shared.engine_source import EngineNotFound, locate


def imported() -> bool:
    """The engine is imported in this process already (a rank forked from its node's agent)."""
    return "wan" in sys.modules and hasattr(sys.modules["wan"], "WanS2V")


def import_wan(wan_repo: Optional[Path] = None) -> ModuleType:
    """Import the engine with the pre-import fixes this machine needs. Idempotent."""
    if imported():
        return sys.modules["wan"]
    loc = locate(wan_repo)
    if loc.source == "checkout" and str(loc.repo_root) not in sys.path:
        sys.path.insert(0, str(loc.repo_root))
    from patches import attention, t5_import_device, torchvision_cpu

    torchvision_cpu.apply()
    attention.guard_flash_attn_imports()  # a broken flash-attn must not crash `import wan`
    with t5_import_device.applied(), warnings.catch_warnings():
        # upstream decorates with the deprecated torch.cuda.amp.autocast; say it once in docs, not per import
        warnings.filterwarnings("ignore", message=r".*torch\.cuda\.amp\.autocast", category=FutureWarning)
        wan = importlib.import_module("wan")
    got = Path(wan.__file__).parent.resolve()
    if got != loc.package_dir.resolve():
        raise EngineNotFound(f"imported `wan` from {got}, expected {loc.package_dir}. "
                             "Fix: remove the other copy from PYTHONPATH or pass --wan-repo.")
    return wan
