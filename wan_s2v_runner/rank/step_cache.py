"""Step caching in the denoising loop (``--cache``, :mod:`wan_s2v_runner.shared.cache_policy`):
per clip, which steps run the DiT and which reuse the last computed step.

Whole-step reuse, after EasyCache: at a computed step the loop records the step's input ``x``
(the latents) and its noise prediction ``v`` (both CFG branches already combined, so one
record serves both, also under CFG-parallel), and from the last two computed steps the rate
``k = mean|v - v'| / mean|x - x'|`` at which the output follows the input. At a later step the
output's relative change since the last computed step is predicted as
``k * mean|x_now - x_previous step| / mean|v_last|``, accumulated over the steps reused in a
row; while the sum stays under the threshold the step's prediction is ``x_now + (v_last - x_last)``
(the last computed step's transformation) and the DiT does not run; else the step is computed and
the sum starts again from 0. The warm-up and the last step are always computed.

Why ours, not cache-dit (what vLLM-Omni wraps for S2V): cache-dit decides per process from the
residuals of the first blocks, under its own parallelism; our ranks hold shards of the sequence
(Ulysses), the two CFG branches on different ranks (CFG-parallel) or FSDP shards, and a rank that
skipped a pass its peers run would hang the group. Here the decision is made once per step, for
both branches, from tensors every rank holds whole (the latents and the combined prediction are
the same on every rank), and rank 0's measure travels in the loop's step message
(:mod:`~wan_s2v_runner.rank.step_control`: agreed at the end of the step before), so every rank
takes the same decision from the same float64 number. Whole-step reuse also leaves the DiT itself (the audio injection
after its blocks, ``--compile``'s graphs, fp8) untouched.

What it did is reported per clip (:attr:`StepCache.record`): the 1-based steps computed and reused.
"""
from __future__ import annotations

from typing import Optional

import torch

from wan_s2v_runner.shared.cache_policy import CacheSetting, warmup_steps


def mean_abs(t: torch.Tensor) -> float:
    """mean |t| in float64 (the measure every rank would compute alike)."""
    return float(t.detach().double().abs().mean().item())


class StepCache:
    """One clip's decisions (made afresh for every clip: each has its own noise and schedule).

    At the end of a step the measuring rank computes the next step's measure (:meth:`measure`;
    the others say -1); the loop agrees it with every rank and hands it back to :meth:`reuse` at
    the next step: a negative measure means "compute". ``measures``: this rank computes the
    measure (rank 0; the others only keep what a reused step's prediction needs). At threshold 0
    nothing can be reused: no measure, no copies; the steps are only recorded."""

    def __init__(self, setting: CacheSetting, steps: int, measures: bool = True):
        self.threshold, self.steps = setting.threshold, steps
        self.active = setting.reuses  # every rank has the same setting
        self.measures = measures
        self.warmup = warmup_steps(steps)
        self.prev_x: Optional[torch.Tensor] = None  # the previous step's input (computed or reused)
        self.last_x: Optional[torch.Tensor] = None  # the last computed step's input and output
        self.last_v: Optional[torch.Tensor] = None
        self.k: Optional[float] = None
        self.accumulated = 0.0
        self.computed_steps: list[int] = []
        self.reused_steps: list[int] = []

    @classmethod
    def for_clip(cls, setting: CacheSetting, steps: int, measures: bool) -> Optional["StepCache"]:
        """The clip's cache, or None when the setting is off."""
        if not setting.on:
            return None
        return cls(setting, steps, measures=measures)

    def measure(self, i: int, x: torch.Tensor) -> float:
        """The predicted relative change of step ``i``'s output (accumulated) for its input ``x``,
        or -1: compute it (every rank but the measuring one, the warm-up and the last step)."""
        if (not self.active or not self.measures or not (self.warmup <= i < self.steps - 1) or self.k is None
                or self.prev_x is None):
            return -1.0
        scale = mean_abs(self.last_v)
        if scale == 0.0:
            return -1.0
        predicted = self.accumulated + self.k * mean_abs(x - self.prev_x) / scale
        return predicted if predicted == predicted and predicted != float("inf") else -1.0

    def reuse(self, i: int, x: torch.Tensor, measure: float) -> Optional[torch.Tensor]:
        """Step ``i`` (0-based) with input ``x`` and the agreed ``measure`` (the measuring rank's
        :meth:`measure` of it): its prediction from the last computed step, or None (compute it,
        then call :meth:`computed`). Every rank calls it at every step."""
        if not self.active:
            return None
        if self.measures:
            self.prev_x = x.clone()
        if 0.0 <= measure < self.threshold:
            self.accumulated = measure
            self.reused_steps.append(i + 1)
            return x + (self.last_v - self.last_x)
        self.accumulated = 0.0
        return None

    def computed(self, i: int, x: torch.Tensor, v: torch.Tensor) -> None:
        """Step ``i`` ran the DiT on ``x`` and predicted ``v`` (the CFG-combined noise prediction)."""
        self.computed_steps.append(i + 1)
        if not self.active:
            return
        if self.measures and self.last_v is not None:
            dx = mean_abs(x - self.last_x)
            self.k = mean_abs(v - self.last_v) / dx if dx > 0 else None
        self.last_x, self.last_v = x.clone(), v.clone()

    def record(self, clip: int) -> dict:
        """What this clip did: its 1-based clip number, the steps computed and reused."""
        return {"clip": clip, "computed": list(self.computed_steps), "reused": list(self.reused_steps)}
