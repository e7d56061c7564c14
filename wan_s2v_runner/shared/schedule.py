"""Which sampling schedules upstream's UniPC scheduler can run (no torch): read by the job spec's
validation, so a job it would fail on is refused before any rank starts (preflight, a batch
line, a server's 422), not at its last step after the model has loaded and denoised.

Upstream's ``FlowUniPCMultistepScheduler.set_timesteps`` truncates its timesteps to int64, and
its first ``step`` finds where it is by value: where the first timestep occurs twice, it takes
the second place. A schedule whose first two timesteps truncate to the same integer therefore
starts one step late and, at its last step, asserts ``this_order > 0`` (``fm_solvers_unipc.py``).
That happens at the extremes of the allowed range (a tiny shift: 0, 0, ...; a large one, or many
steps: 999, 999, ...), e.g. 40 steps at shift 50, or 1000 steps at shift 3. ``dpm++`` has no such
failure. :func:`unipc_timesteps` computes the timesteps as upstream does; a test checks them
against upstream's scheduler over a grid, and that the rule below is exactly when it fails.
"""
from __future__ import annotations

#: upstream's num_train_timesteps for Wan2.2 (``s2v_14B`` config), the scheduler's scale
NUM_TRAIN_TIMESTEPS = 1000


def unipc_timesteps(steps: int, shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> list[int]:
    """Upstream UniPC's timesteps for ``steps`` at ``shift``, computed as its constructor (shift 1,
    float32 sigmas) and ``set_timesteps`` (float64, truncated to int64) compute them."""
    import numpy as np

    alphas = np.linspace(1, 1 / num_train_timesteps, num_train_timesteps)[::-1].copy()
    sigmas = (1.0 - alphas).astype(np.float32)
    sigma_max, sigma_min = sigmas[0].item(), sigmas[-1].item()
    s = np.linspace(sigma_max, sigma_min, steps + 1).copy()[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    return (s * num_train_timesteps).astype(np.int64).tolist()


def unipc_fails(steps: int, shift: float) -> bool:
    """Whether upstream's UniPC scheduler fails on this schedule (its first timestep twice)."""
    t = unipc_timesteps(steps, shift)
    return len(t) > 1 and t[0] == t[1]


def most_unipc_steps(shift: float, below: int) -> int:
    """The most steps under ``below`` that UniPC runs at ``shift`` (one step always runs)."""
    return next((n for n in range(below - 1, 1, -1) if not unipc_fails(n, shift)), 1)
