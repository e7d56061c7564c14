"""The sampling schedules upstream's UniPC scheduler cannot run (``shared/schedule.py``): our
timesteps are its scheduler's own, the refusal is exactly where its ``step`` fails, and a job
spec refuses such a schedule with a fix that runs, before anything starts."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from wan_s2v_runner.shared import schedule
from wan_s2v_runner.shared.spec import JobSpec

#: around the edges at shift 50 (21), 5 (250) and upstream's 3 (500); a step takes ~0.6 ms here
STEPS = (1, 2, 3, 21, 22, 40, 250, 251, 500, 501)
SHIFTS = (1e-6, 1.0, 3.0, 5.0, 50.0)


def _upstream(steps: int, shift: float):
    """Upstream's UniPC scheduler set up as our loop (and ``WanS2V.generate``) sets it up, stepped
    through its schedule on a one-element latent: its timesteps, and whether a step failed."""
    import torch

    from wan_s2v_runner.loading.engine import import_wan

    import_wan()
    from wan.utils.fm_solvers_unipc import FlowUniPCMultistepScheduler

    sched = FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
    sched.set_timesteps(steps, device="cpu", shift=shift)
    timesteps = sched.timesteps.tolist()
    x, g = torch.zeros(1, 1, 1, 1), torch.Generator().manual_seed(0)
    try:
        for t in sched.timesteps:
            x = sched.step(torch.zeros_like(x), t, x, return_dict=False, generator=g)[0]
    except AssertionError:
        return timesteps, True
    return timesteps, False


def test_the_timesteps_are_upstreams_and_the_rule_is_exactly_where_its_step_fails():
    failing = []
    for steps in STEPS:
        for shift in SHIFTS:
            timesteps, failed = _upstream(steps, shift)
            assert schedule.unipc_timesteps(steps, shift) == timesteps, (steps, shift)
            assert schedule.unipc_fails(steps, shift) is failed, (steps, shift)
            if failed:
                failing.append((steps, shift))
                fewer = schedule.most_unipc_steps(shift, steps)  # the fix the refusal names runs
                assert not _upstream(fewer, shift)[1] and (fewer == 1 or _upstream(fewer + 1, shift)[1])
    # both ends of the range fail somewhere, and upstream's own settings never do
    assert (40, 50.0) in failing and (251, 5.0) in failing and (501, 3.0) in failing and (2, 1e-6) in failing
    assert not any(steps <= 40 and 3.0 <= shift <= 5.0 for steps, shift in failing)


@pytest.mark.parametrize("steps, shift, words", [
    (40, 50.0, "--steps 21 or fewer at this shift, a smaller --shift"),
    (1000, 3.0, "starts on timestep 999 twice"),
    (4, 1e-6, "a larger --shift"),
])
def test_a_job_spec_refuses_a_schedule_unipc_fails_on_and_dpm_takes_it(steps, shift, words):
    base = {"image": "/in/face.png", "audio": "/in/voice.wav", "prompt": "p", "steps": steps, "shift": shift}
    with pytest.raises(ValidationError, match="upstream's UniPC scheduler fails") as e:
        JobSpec(**base)
    assert words in str(e.value) and "--solver dpm++" in str(e.value)
    assert JobSpec(**base, solver="dpm++").steps == steps
