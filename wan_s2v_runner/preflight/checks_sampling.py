"""Group ``inputs``, the sampling: how many DiT passes a clip costs. ``steps`` steps run two
passes each (conditional and unconditional, combined as ``u + g * (c - u)``), or one where the
guidance scale is 1 or less (upstream skips the unconditional pass then, and so do we: the
few-step recipe's CFG 1 halves the passes). With ``--cache`` (:mod:`wan_s2v_runner.shared.cache_policy`)
the warm-up and the last step are always computed and the others as the run decides, so the
doctor gives the range: what is computed at least, and at most (every step). A live job
(``--mode live``): the recipe's steps, one pass each, a block."""
from __future__ import annotations

from wan_s2v_runner.shared import cache_policy
from wan_s2v_runner.shared import live_recipe as recipe
from wan_s2v_runner.shared.job_time import passes_per_step, step_passes
from wan_s2v_runner.shared.layout import MODES

from .core import ok, skip

ID = "inputs.passes"


def passes(steps: int, guide_scale: float, cache: str = "off") -> dict:
    """A clip's DiT passes: per step, at most (every step computed) and at least (a cache policy
    computes its warm-up and the last step; off: every step)."""
    per_step = passes_per_step(guide_scale)
    setting = cache_policy.parse(cache)
    fewest = cache_policy.always_computed(steps) if setting.reuses else steps
    return {"per_step": per_step, "most": steps * per_step, "fewest": fewest * per_step,
            "steps_always_computed": fewest}


def check_passes(ctx):
    spec = ctx.spec
    if MODES[ctx.mode].step_pipeline:  # the live recipe's steps, without CFG: the flags are not read
        per = step_passes(False)
        most = recipe.STEPS * per
        return ok(ID, f"the live recipe: {recipe.STEPS} steps x {per} (no CFG): {most} DiT passes a block",
                  per_step=per, most=most, fewest=most, steps_always_computed=recipe.STEPS)
    if spec.steps is None or spec.guide_scale is None:
        return skip(ID, "no sampling settings given")
    try:
        p = passes(spec.steps, spec.guide_scale, spec.cache)
    except ValueError as e:  # a draft's cache setting that does not parse (inputs.flags says why)
        return skip(ID, f"no valid --cache setting ({str(e).split('. Fix:')[0]})")
    branches = ("conditional + unconditional" if p["per_step"] == 2 else
                f"guide scale {spec.guide_scale:g}: the unconditional pass is skipped")
    finding = f"{spec.steps} steps x {p['per_step']} ({branches}): {p['most']} DiT passes a clip"
    if p["fewest"] < p["most"]:
        finding += (f"; --cache {spec.cache} computes at least {p['fewest']} of them (the warm-up and the last "
                    "step) and reuses others while the predicted change stays under its threshold")
    return ok(ID, finding, **p)
