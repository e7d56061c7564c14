"""Test-only fault injection, honoured only when ``WAN_S2V_TEST_FAULT`` is set.

Format: ``RANK:STAGE[@CLIP][#JOB]:ACTION`` (STAGE a :class:`~wan_s2v_runner.shared.stages.Stage` name; with
``@CLIP`` only while that 1-based clip is generated, with ``#JOB`` only in that 1-based job of the
rank group, or, when JOB is a word, only in jobs whose prompt contains it: served jobs have random
ids and a restarted group counts from 1 again) with ACTION
one of ``raise`` (RuntimeError), ``exit`` (os._exit 3), ``hang`` (sleep forever, still
heart-beating), ``enospc`` (OSError ENOSPC: the disk full at that point's write). Several faults:
separated by commas. Checked at every stage change and every denoising step of the given rank, and
as stage ``start`` before the rank writes any event (there ``hang`` is a rank that never
reports). Users never set it; the supervision tests do. ``WAN_S2V_TEST_CKPT_FOR_RANK`` gives one
rank other checkpoint files (the lean-loading fingerprint test). ``WAN_S2V_TEST_RANK_BODY``
(``module:function``) runs that function in place of the rank's engine work (:func:`rank_body`:
the supervisor's tests run a stub rank that speaks the event protocol without the engine).
"""
from __future__ import annotations

import errno
import os
import time
from typing import Optional

from wan_s2v_runner.shared.stages import Stage

ENV = "WAN_S2V_TEST_FAULT"
RANK_BODY_ENV = "WAN_S2V_TEST_RANK_BODY"


class InjectedFault(RuntimeError):
    pass


def parse(value: Optional[str]) -> Optional[tuple[int, Stage, str, Optional[int], Optional[int | str]]]:
    """``"1:denoise@2#3:raise"`` -> (1, Stage.DENOISE, "raise", 2, 3) (``#poison``: the word
    ``"poison"``); None when unset. A stage or
    action that does not exist raises ValueError (a misspelt fault would otherwise never fire)."""
    if not value:
        return None
    rank, stage, action = value.split(":")
    stage, _, job = stage.partition("#")
    stage, _, clip = stage.partition("@")
    if action not in ("raise", "exit", "hang", "enospc"):
        raise ValueError(f"{ENV}: unknown action {action!r}")
    found = Stage.lookup(stage)
    if found is None:
        raise ValueError(f"{ENV}: unknown stage {stage!r} (one of {', '.join(s.value for s in Stage)})")
    return int(rank), found, action, int(clip) if clip else None, (int(job) if job.isdigit() else job) or None


def parse_all(value: Optional[str]) -> list:
    """Every fault of a comma-separated ``WAN_S2V_TEST_FAULT`` (:func:`parse` each)."""
    return [parse(part.strip()) for part in (value or "").split(",") if part.strip()]


def maybe_fire(rank: int, stage: Stage, fault=None, clip: Optional[int] = None, job: Optional[int] = None,
               prompt: str = "") -> None:
    """Fire ``fault`` (a :func:`parse` result, or a list of them; default: the environment's)
    if it names this rank, stage (and clip, and job)."""
    if fault is None:
        fault = parse_all(os.environ.get(ENV))
    if isinstance(fault, list):
        for one in fault:
            maybe_fire(rank, stage, one, clip=clip, job=job, prompt=prompt)
        return
    if not fault or fault[0] != rank or fault[1] != stage:
        return
    which = fault[4]
    if (fault[3] is not None and fault[3] != clip) or (isinstance(which, int) and which != job) or \
            (isinstance(which, str) and which not in prompt):
        return
    action = fault[2]
    if action == "raise":
        raise InjectedFault(f"injected fault on rank {rank} in stage {stage}")
    if action == "exit":
        os._exit(3)
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected on rank {rank} in stage {stage})")
    while True:  # hang
        time.sleep(3600)


#: test-only: ``RANK:DIR`` gives that rank another checkpoint directory (a node whose files differ)
CKPT_ENV = "WAN_S2V_TEST_CKPT_FOR_RANK"


def checkpoint_for(rank: int) -> Optional[str]:
    """The checkpoint directory :data:`CKPT_ENV` gives ``rank``, or None."""
    value = os.environ.get(CKPT_ENV)
    if not value:
        return None
    r, _, path = value.partition(":")
    return path if int(r) == rank else None


def rank_body():
    """The function ``WAN_S2V_TEST_RANK_BODY`` names (``module:function``, called as
    ``run_rank(spec, run_dir, events)``), or None when unset."""
    value = os.environ.get(RANK_BODY_ENV)
    if not value:
        return None
    import importlib

    module, _, name = value.partition(":")
    return getattr(importlib.import_module(module), name)
