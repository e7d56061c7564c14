"""How long a job takes: the plan's estimate before it runs, and its ETA while it runs.

Pure arithmetic, no imports from the project: the doctor (``preflight.checks_time``) plans with
:func:`job_seconds`, the console (``launcher.console``) and the server (``serve.progress``) tell
the time left with :class:`ClipClock` and :func:`eta_s`.

* The plan: ``clips x steps x passes a step x seconds a pass``. A step runs two DiT passes
  (conditional and unconditional: CFG) unless the guide scale is 1 or less; with
  ``--cfg-parallel`` a rank runs one of the two (:func:`passes_per_step`, the one rule: the
  plan, the memory plan's text memo, the parallel plans and the rank's loop read it). The seconds
  a pass come from the pass's operations on the GPU (``preflight.dit_flops``,
  ``shared.dit_cost.pass_seconds``: ~66 s at 1024x704 on an RTX 4090); the first clip's pass is
  shorter (no motion tokens).
* The ETA: the clips left times the seconds a clip took so far in this attempt (a resumed run
  counts the clips it made itself), less the time already spent in the current clip; before the
  first clip ends, the plan's seconds a clip where there is one, else the pace of the current
  clip's steps; None when nothing is known yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def cfg_on(guide_scale: float) -> bool:
    """Whether a step runs classifier-free guidance's unconditional pass beside the conditional
    one: a guide scale above 1 (upstream skips it at 1 or less, and so do we). Where it does not,
    there is nothing for ``--cfg-parallel`` to split."""
    return guide_scale > 1


def step_passes(cfg: bool, cfg_degree: int = 1) -> int:
    """DiT passes one rank runs a step: 2 with CFG (``cfg``), 1 without; the CFG split
    (``--cfg-parallel``, ``cfg_degree`` 2) gives each of its two halves one."""
    return max(1, (2 if cfg else 1) // max(1, cfg_degree))


def passes_per_step(guide_scale: float, cfg_degree: int = 1) -> int:
    """DiT passes one rank runs a step at ``guide_scale``: :func:`step_passes` of :func:`cfg_on`."""
    return step_passes(cfg_on(guide_scale), cfg_degree)


def job_seconds(clips: int, steps: int, passes: int, pass_s: float, first_pass_s: Optional[float] = None) -> float:
    """The denoising of a job: ``clips x steps x passes x pass_s`` (the first clip's passes at
    ``first_pass_s`` where given: it has no motion tokens)."""
    if clips <= 0:
        return 0.0
    first = pass_s if first_pass_s is None else first_pass_s
    return steps * passes * (first + (clips - 1) * pass_s)


def pipeline_seconds(blocks: int, steps: int, busiest: int, step_s: float) -> float:
    """The denoising of a live job of ``blocks`` blocks whose ``steps`` steps are pipelined over
    its ranks, the busiest running ``busiest`` of them a block, each step ``step_s``: the first
    block goes through every step, each later one comes at the busiest rank's pace (the sends
    not counted). On one rank: ``blocks x steps x step_s``."""
    if blocks <= 0:
        return 0.0
    return steps * step_s + (blocks - 1) * busiest * step_s


def eta_s(clips_total: Optional[int], clips_done: int, *, made: int = 0, made_s: float = 0.0,
          in_clip_s: float = 0.0, plan_clip_s: Optional[float] = None,
          clip_fraction: Optional[float] = None) -> Optional[float]:
    """Seconds left of a job of ``clips_total`` clips with ``clips_done`` complete.

    ``made`` of them were made by this attempt in ``made_s`` seconds (a resumed run's earlier
    clips are not its pace); ``in_clip_s``: seconds spent in the current clip so far. The pace is
    ``made_s / made``; before this attempt has made a clip, ``plan_clip_s`` (the plan's seconds a
    clip), else ``in_clip_s / clip_fraction`` (the current clip's steps so far, a share of its
    steps); None when none of these is known. 0 once every clip is done."""
    if not clips_total:
        return None
    left = clips_total - clips_done
    if left <= 0:
        return 0.0
    if made > 0 and made_s > 0:
        per_clip = made_s / made
    elif plan_clip_s:
        per_clip = plan_clip_s
    elif clip_fraction and in_clip_s > 0:
        per_clip = in_clip_s / clip_fraction
    else:
        return None
    return max(0.0, left * per_clip - in_clip_s)


@dataclass
class ClipClock:
    """A running job's units from rank 0's events: when each began, how many are done. The unit is
    the job's own (:attr:`unit`, a ``shared.events.ProgressUnit`` value): a clip job's clips, a live
    job's blocks; the ``clip`` names below mean either.

    Call :meth:`clip` when a unit's first stage begins (its number, 1-based over the whole job, and
    the total), :meth:`step` on a denoising step, :meth:`made` when a unit is made before the next
    begins (a live block's ``progress``), :meth:`finished` when the units are over (saving, done);
    then :attr:`clips_done`, :attr:`clips_total` and :meth:`eta`. ``plan_clip_s``: the plan's
    seconds a unit."""

    plan_clip_s: Optional[float] = None
    unit: str = "clip"  # what it counts: "clip", or a live job's "block"
    clips_total: Optional[int] = None
    first: Optional[int] = None  # the first clip this attempt made (a resumed job: not 1)
    first_t: Optional[float] = None
    current: Optional[int] = None
    current_t: Optional[float] = None
    step_of: Optional[tuple[int, int]] = None  # (step, steps) of the current clip
    made_t: Optional[float] = None  # when the current unit was made (:meth:`made`), None while it is made
    done: bool = False

    def clip(self, clip: int, clips: Optional[int], t: float) -> None:
        if clips:
            self.clips_total = clips
        if clip == self.current:
            return
        if self.first is None:
            self.first, self.first_t = clip, t
        self.current, self.current_t, self.step_of, self.made_t, self.done = clip, t, None, None, False

    def step(self, clip: int, clips: Optional[int], step: int, steps: int, t: float) -> None:
        if clip != self.current:
            self.clip(clip, clips, t)
        self.step_of = (step, steps)

    def made(self, clip: int, clips: Optional[int], t: float) -> None:
        """Unit ``clip`` is made (a live block, decoded): done before the next one begins."""
        if clip != self.current:
            self.clip(clip, clips, t)
        self.made_t = t

    def finished(self) -> None:
        if self.current is not None:
            self.done = True

    @property
    def clips_done(self) -> int:
        if self.current is None:
            return 0
        if self.done:
            return self.clips_total or self.current
        return self.current if self.made_t is not None else self.current - 1

    def eta(self, now: float) -> Optional[float]:
        if self.current is None:
            return self.plan_clip_s * self.clips_total if self.plan_clip_s and self.clips_total else None
        if self.done:
            return 0.0
        if self.made_t is not None:  # the current unit is made: the pace counts it, the next has not begun
            return eta_s(self.clips_total, self.clips_done, made=self.current - self.first + 1,
                         made_s=self.made_t - self.first_t, in_clip_s=max(0.0, now - self.made_t),
                         plan_clip_s=self.plan_clip_s)
        step, steps = self.step_of or (0, 0)
        return eta_s(self.clips_total, self.clips_done, made=self.current - self.first,
                     made_s=self.current_t - self.first_t, in_clip_s=max(0.0, now - self.current_t),
                     plan_clip_s=self.plan_clip_s, clip_fraction=step / steps if steps else None)
