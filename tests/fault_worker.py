"""The tests' rank worker (``WAN_S2V_RANK_WORKER=tests.fault_worker``): the product's
(:func:`wan_s2v_runner.rank.worker.main`) with the faults the supervision tests inject, read from
this process's environment here, in test code:

* ``WAN_S2V_TEST_FAULT=RANK:STAGE[@CLIP][#JOB]:ACTION`` (several: comma-separated). STAGE a
  :class:`~wan_s2v_runner.shared.stages.Stage` name, or ``start`` (before the rank writes any
  event: ``hang`` there is a rank that never reports); ``@CLIP`` only while that 1-based clip is
  generated; ``#JOB`` only in that 1-based job of the rank group, or, when JOB is a word, only in
  jobs whose prompt contains it (served jobs have random ids, and a restarted group counts from 1
  again). ACTION: ``raise`` (RuntimeError), ``exit`` (os._exit 3), ``hang`` (sleep forever, still
  heart-beating), ``enospc`` (OSError ENOSPC: the disk full at that point's write), ``wait`` (hold
  there, still heart-beating, until the file ``WAN_S2V_TEST_RELEASE`` names exists, or, in a
  served group, until the server cancels a job: a test keeps a job in hand until the moment it
  needs it to run, or running until it cancels it, however fast the machine; the step after a
  cancel stops the job as it would have), ``nonfinite`` (this rank's next read of fp16's guard
  says DiT block 1 held inf or NaN: what the loop's step message then carries, in any dtype),
  ``diskfull`` (the video writer's next append, on its thread, meets ENOSPC: a disk that fills while
  the video grows).
  Checked at every stage change of the given rank; ``@CLIP`` is the stage's clip, or a live job's
  block.
* ``WAN_S2V_TEST_CKPT_FOR_RANK=RANK:DIR``: that rank reads another checkpoint directory (a node
  whose files differ).
* ``WAN_S2V_TEST_PERTURB_WEIGHTS_RANK=RANK``: that rank's weights change a little just before
  FSDP's cross-rank fingerprint (full loading: ranks whose weights differ).

:func:`fault_env` builds the environment a test passes; :func:`rank_main` is what each rank runs.
"""
from __future__ import annotations

import errno
import os
import time
from typing import Optional

from wan_s2v_runner.rank import worker
from wan_s2v_runner.shared.stages import Stage

FAULT_ENV = "WAN_S2V_TEST_FAULT"
CKPT_ENV = "WAN_S2V_TEST_CKPT_FOR_RANK"
PERTURB_ENV = "WAN_S2V_TEST_PERTURB_WEIGHTS_RANK"
RELEASE_ENV = "WAN_S2V_TEST_RELEASE"
#: the spec's environment layer for ``$WAN_S2V_RANK_WORKER``
RANK_WORKER_ENV = "WAN_S2V_RANK_WORKER"
MODULE = "tests.fault_worker"


def fault_env(fault: str = "", **more: str) -> dict:
    """The environment of a command whose ranks run this worker with ``fault`` (and ``more``)."""
    return {RANK_WORKER_ENV: MODULE, **({FAULT_ENV: fault} if fault else {}), **more}


class InjectedFault(RuntimeError):
    pass


#: this rank's run directory (:func:`rank_main`): where a served group's inbox is
_run_dir: list = [None]


def _released() -> bool:
    """A ``wait`` ends: ``WAN_S2V_TEST_RELEASE``'s file exists, or the server cancelled a job
    (a cancel file in the group's inbox)."""
    from wan_s2v_runner.shared import inbox

    release = os.environ.get(RELEASE_ENV)
    if release and os.path.exists(release):
        return True
    box = inbox.inbox_of(_run_dir[0]) if _run_dir[0] else None
    return bool(box and box.is_dir() and any(box.glob("cancel-*")))


def parse(value: Optional[str]) -> Optional[tuple[int, Stage, str, Optional[int], Optional[int | str]]]:
    """``"1:denoise@2#3:raise"`` -> (1, Stage.DENOISE, "raise", 2, 3) (``#poison``: the word
    ``"poison"``); None when unset. A stage or action that does not exist raises ValueError (a
    misspelt fault would otherwise never fire)."""
    if not value:
        return None
    rank, stage, action = value.split(":")
    stage, _, job = stage.partition("#")
    stage, _, clip = stage.partition("@")
    if action not in ("raise", "exit", "hang", "enospc", "wait", "nonfinite", "diskfull"):
        raise ValueError(f"{FAULT_ENV}: unknown action {action!r}")
    found = Stage.lookup(stage)
    if found is None:
        raise ValueError(f"{FAULT_ENV}: unknown stage {stage!r} (one of {', '.join(s.value for s in Stage)})")
    return int(rank), found, action, int(clip) if clip else None, (int(job) if job.isdigit() else job) or None


def parse_all(value: Optional[str]) -> list:
    """Every fault of a comma-separated ``WAN_S2V_TEST_FAULT`` (:func:`parse` each)."""
    return [parse(part.strip()) for part in (value or "").split(",") if part.strip()]


def maybe_fire(rank: int, stage: Stage, faults: list, clip: Optional[int] = None, job: Optional[int] = None,
               prompt: str = "") -> None:
    """Fire each of ``faults`` (:func:`parse` results) that names this rank, stage (and clip, and job)."""
    for fault in faults:
        if not fault or fault[0] != rank or fault[1] != stage:
            continue
        which = fault[4]
        if (fault[3] is not None and fault[3] != clip) or (isinstance(which, int) and which != job) or \
                (isinstance(which, str) and which not in prompt):
            continue
        action = fault[2]
        if action == "raise":
            raise InjectedFault(f"injected fault on rank {rank} in stage {stage}")
        if action == "exit":
            os._exit(3)
        if action == "enospc":
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected on rank {rank} in stage {stage})")
        if action == "wait":
            while not _released():
                time.sleep(0.05)
            continue
        if action == "nonfinite":
            _overflow_once()
            continue
        if action == "diskfull":
            _full_disk_once()
            continue
        while True:  # hang
            time.sleep(3600)


def _overflow_once() -> None:
    """The rank's next guard read (``rank.step_control.guard_fault``) says DiT block 1 overflowed."""
    from wan_s2v_runner.rank import step_control

    read = step_control.guard_fault

    def overflowed(guard):
        step_control.guard_fault = read
        read(guard)
        return 1
    step_control.guard_fault = overflowed


def _full_disk_once() -> None:
    """The video writer's next append (``shared.media.GrowingMp4.append``, on its thread) fails
    with ENOSPC, as a disk that filled does."""
    from wan_s2v_runner.shared import media

    append = media.GrowingMp4.append

    def full(self, fragment):
        media.GrowingMp4.append = append
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
    media.GrowingMp4.append = full


class FaultyEvents(worker.RankEvents):
    """The rank's events, firing the environment's faults at every stage change."""

    faults: list = []

    @classmethod
    def starting(cls, rank: int) -> None:
        cls.faults = parse_all(os.environ.get(FAULT_ENV))
        maybe_fire(rank, Stage.START, cls.faults)

    def stage(self, stage: Stage, **data) -> None:
        super().stage(stage, **data)
        if self.faults:
            maybe_fire(self.rank, self.current_stage, self.faults, clip=data.get("clip", data.get("block")),
                       job=self.job, prompt=self.job_prompt)


def spec_for_rank(spec, rank: int):
    """``WAN_S2V_TEST_CKPT_FOR_RANK``: this rank's node has other checkpoint files."""
    from pathlib import Path

    r, _, path = (os.environ.get(CKPT_ENV) or "").partition(":")
    return spec.model_copy(update={"ckpt_dir": Path(path)}) if r and int(r) == rank else spec


def _perturb_before_fingerprint() -> None:
    """``WAN_S2V_TEST_PERTURB_WEIGHTS_RANK``: that rank adds 1e-3 to its first weight just before
    FSDP's cross-rank fingerprint check (:func:`patches.fsdp_no_sync.check_same_weights`)."""
    which = os.environ.get(PERTURB_ENV)
    if which is None:
        return
    import torch
    import torch.distributed as dist

    from patches import fsdp_no_sync

    check = fsdp_no_sync.check_same_weights

    def perturbed_then_checked(module, what, group=None):
        if dist.is_initialized() and dist.get_rank() == int(which):
            with torch.no_grad():
                next(module.parameters()).add_(1e-3)
        return check(module, what, group)

    fsdp_no_sync.check_same_weights = perturbed_then_checked


def rank_main(spec_path: str, body=None) -> int:
    from pathlib import Path

    _run_dir[0] = Path(spec_path).parent
    _perturb_before_fingerprint()
    return worker.main([spec_path], body=body, events_cls=FaultyEvents, spec_for_rank=spec_for_rank)


#: the agent imports what the product's worker needs before it forks the ranks
preload = worker.preload
