"""Step caching's setting (``--cache POLICY[:THRESHOLD]``, a job setting): which policy, its
threshold, and which steps it always computes. What a rank does with it is
:mod:`wan_s2v_runner.rank.step_cache`; this module is pure (the spec, preflight and the doctor read it).

* ``off`` (the default): every step runs the DiT, as upstream does.
* ``easycache[:THRESHOLD]`` (default threshold :data:`DEFAULT_THRESHOLD`): EasyCache's
  calibration-free whole-step reuse (Zhou et al., 2025, "Less is Enough: Training-Free Video
  Diffusion Acceleration via Runtime-Adaptive Caching"). A step whose DiT output is predicted to
  have changed, since the last computed step, by less than THRESHOLD (relative, accumulated over
  the steps reused in a row) reuses that step's transformation (output minus input) instead of
  running the DiT. The first :func:`warmup_steps` steps and the last step are always computed.
  Threshold 0 computes every step (the frames equal ``off``'s bit for bit).

The canonical text (``off``, ``easycache:0.05``) is what a spec holds, so ``easycache`` and
``easycache:0.05`` are the same job to a resume (its digest) and in run.json. (The server's
``Idempotency-Key`` compares requests as sent: the two spellings are two requests there.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

#: EasyCache's own default for Wan's image-to-video models (its Wan2.2 script: --thresh 0.05)
DEFAULT_THRESHOLD = 0.05
#: the largest threshold taken (a relative change; at 10, in practice, every step between the
#: warm-up and the last is reused)
MAX_THRESHOLD = 10.0
#: EasyCache's warm-up (its ret_steps 7 of Wan's 40 steps), as a share of the steps
WARMUP_SHARE = 7 / 40


class CachePolicy(str, Enum):
    OFF = "off"
    EASYCACHE = "easycache"


@dataclass(frozen=True)
class CacheSetting:
    policy: CachePolicy = CachePolicy.OFF
    threshold: float = 0.0

    @property
    def on(self) -> bool:
        return self.policy is not CachePolicy.OFF

    @property
    def reuses(self) -> bool:
        """Whether a step can be reused at all (threshold 0 computes every step)."""
        return self.on and self.threshold > 0

    @property
    def text(self) -> str:
        return self.policy.value if not self.on else f"{self.policy.value}:{self.threshold!r}"


OFF = CacheSetting()


def parse(text: str) -> CacheSetting:
    """``off``, ``easycache`` or ``easycache:THRESHOLD`` -> the setting; ValueError (one line,
    cause and fix) for anything else."""
    name, sep, value = str(text).strip().partition(":")
    try:
        policy = CachePolicy(name.strip().lower())
    except ValueError:
        raise ValueError(f"cache policy {name!r} is not one of {', '.join(p.value for p in CachePolicy)}. "
                         f"Fix: --cache easycache (threshold {DEFAULT_THRESHOLD:g}), --cache easycache:0.1, "
                         "or --cache off") from None
    if policy is CachePolicy.OFF:
        if sep:
            raise ValueError("--cache off takes no threshold. Fix: --cache off, or --cache easycache:THRESHOLD")
        return OFF
    if not sep:
        return CacheSetting(policy, DEFAULT_THRESHOLD)
    try:
        threshold = float(value)
    except ValueError:
        threshold = math.nan
    if not (math.isfinite(threshold) and 0 <= threshold <= MAX_THRESHOLD):
        raise ValueError(f"cache threshold {value!r} is not a number from 0 to {MAX_THRESHOLD:g}. "
                         f"Fix: e.g. --cache {policy.value}:{DEFAULT_THRESHOLD:g} (0 computes every step)")
    return CacheSetting(policy, threshold + 0.0)  # -0.0 -> 0.0: one text per setting


def canonical(text: str) -> str:
    """The one text of a setting (what a spec stores)."""
    return parse(text).text


def warmup_steps(steps: int) -> int:
    """Steps always computed at the start of a clip: EasyCache's share of them, at least 2 (the
    second gives the first measure of how the output follows the input)."""
    return max(2, math.ceil(steps * WARMUP_SHARE))


def always_computed(steps: int) -> int:
    """Steps of ``steps`` a cache policy never reuses: the warm-up and the last."""
    return min(steps, warmup_steps(steps) + 1)


def summary(setting_text: str, records: list[dict]) -> dict:
    """What a job's caching did (run.json's and a job record's ``step_cache``): its setting, each
    clip generated (:meth:`~wan_s2v_runner.rank.step_cache.StepCache.record`: the 1-based steps
    computed and reused) and the totals over them."""
    return {"policy": setting_text, "clips": records,
            "steps_computed": sum(len(r["computed"]) for r in records),
            "steps_reused": sum(len(r["reused"]) for r in records)}
