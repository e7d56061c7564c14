"""Group ``memory``, the job's time: how long its denoising takes on this machine, from the plan.

``clips x steps x passes a step x seconds a pass`` (:func:`wan_s2v_runner.shared.job_time.job_seconds`):
the clips and size are the memory plan's (:func:`.memory.workload`: the speech, or ``--num-clips``),
a pass's seconds its operations (:mod:`.dit_flops`) at
:data:`~wan_s2v_runner.shared.dit_cost.ASSUMED_MFU` of the slowest of the ranks' GPUs' dense peak
(``shared.dit_cost.pass_seconds``) in the run's compute dtype (``shared.precision``: fp16 on
GPUs older than Ampere under ``--dtype auto``, emulated bf16 there under ``--dtype bf16``), split
over the layout as the parallel plans split it
(:func:`.plans.estimate_speedup`, with their calibrated all-to-all cost), at the copies' pace where
a streamed DiT's copies are slower. A live job (``--mode live``, :func:`live_job_time`): its blocks,
each through the recipe's 4 steps at a block forward's seconds, pipelined over the ranks. The VAE's
decode, the encoders and loading are not in it (a few seconds a clip against minutes of denoising
at the real size). Informational: it never fails.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from wan_s2v_runner.shared import cache_policy
from wan_s2v_runner.shared import live_recipe as recipe
from wan_s2v_runner.shared.dit_cost import ASSUMED_MFU, pass_seconds
from wan_s2v_runner.shared.job_time import job_seconds, passes_per_step, pipeline_seconds, step_passes
from wan_s2v_runner.shared.layout import MODES

from .core import ok, skip

ID = "job.time"


@dataclass(frozen=True)
class JobTime:
    gpu: str
    clips: int
    steps: int
    passes: int  # DiT passes a rank runs a step
    pass_s: float  # a later clip's pass on one rank (the layout's share; the copies' pace if slower)
    first_pass_s: float  # the first clip's (no motion tokens, unless it starts from the reference)
    seconds: float  # the job's denoising
    clip_s: float  # a later clip's denoising
    fewest_steps: Optional[int] = None  # --cache: the steps a clip computes at least
    dtype: str = "bf16"  # what the DiT computes in (shared.precision), whose peak the estimate takes
    peak_tflops: Optional[float] = None  # the slowest GPU's dense peak in that dtype
    #: what ``clips`` counts: "clip", or "block" (a live job: its steps pipelined over the ranks, a
    #: block's ``clip_s`` the busiest rank's ``steps_per_rank`` steps)
    unit: str = "clip"
    steps_per_rank: Optional[int] = None

    def to_json(self) -> dict:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def human_duration(s: float) -> str:
    """95 -> '1 min 35 s'; 3725 -> '1 h 2 min'; from two days on also in days: '177 h 33 min (7.4 days)'."""
    s = int(round(s))
    if s >= 3600:
        days = f" ({s / 86400:.1f} days)" if s >= 2 * 86400 else ""
        return f"{s // 3600} h {s % 3600 // 60} min{days}"
    if s >= 60:
        return f"{s // 60} min {s % 60} s"
    return f"{s} s"


def job_time(ctx) -> Optional[JobTime]:
    """The job's denoising time on this context's machine and layout; None on the CPU or on a GPU
    whose peak is not in :data:`.streaming.GPU_TFLOPS`."""
    from .checks_memory import current_plan, stream_timing
    from .dit_flops import forward_flops
    from .memory import compute_dtype, dit_dims, model_sizes, workload
    from .plans import SP_COMM_COST, estimate_speedup
    from .recommend import heads_of
    from .streaming import gpu_tflops

    spec = ctx.spec
    if MODES[ctx.mode].step_pipeline:
        return live_job_time(ctx)
    if not ctx.on_cuda or not ctx.local_gpus or spec.steps is None or spec.guide_scale is None:
        return None
    dtype = compute_dtype(ctx)[0]
    rated = [(gpu_tflops(g.get("name", ""), dtype), g) for g in ctx.local_gpus]
    if any(t is None for t, _ in rated):
        return None
    peak, gpu = min(rated, key=lambda tg: tg[0])
    sizes, wl = model_sizes(ctx), workload(ctx)
    dims = dit_dims(sizes)
    layout = ctx.layout
    heads = heads_of(ctx, sizes)
    split = estimate_speedup(layout, heads, dims.dim, dims.ffn_dim, wl.tokens.max_len) or 1.0
    # one GPU's guided step / the busiest rank's (``split``), over the passes each runs: a pass's
    # share of one GPU's pass on a rank, with the all-to-all's cost
    share = (step_passes(True) / step_passes(True, layout.cfg_degree) / split
             * (1 + SP_COMM_COST * (layout.sp_degree - 1 if layout.use_sp else 0)))
    passes = passes_per_step(spec.guide_scale, layout.cfg_degree)

    def seconds(with_motion: bool) -> float:
        return pass_seconds(forward_flops(dims, wl.tokens, with_motion=with_motion, text_cached=True).total * share,
                            peak)

    later = seconds(True)
    first = later if spec.start_from_ref else seconds(False)
    plan = current_plan(ctx)
    if plan.stream is not None:  # the step runs at the pace of the slower: compute or the copies
        copy_s = stream_timing(ctx, plan, gpu).copy_s
        later, first = max(later, copy_s), max(first, copy_s)
    steps = spec.steps
    fewest = None
    try:
        if cache_policy.parse(spec.cache).reuses:
            fewest = cache_policy.always_computed(steps)
    except ValueError:  # a draft's cache setting that does not parse (inputs.flags says why)
        pass
    total = job_seconds(wl.n_clips, steps, passes, later, first)
    return JobTime(gpu=str(gpu.get("name")), clips=wl.n_clips, steps=steps, passes=passes, pass_s=later,
                   first_pass_s=first, seconds=total, clip_s=steps * passes * later, fewest_steps=fewest,
                   dtype=dtype.value, peak_tflops=peak)


def live_job_time(ctx) -> Optional[JobTime]:
    """A live job's denoising (``--mode live``): its blocks (the live workload's), each through the
    recipe's steps (one pass each: no CFG) at :func:`.checks_live.block_timing`'s seconds a step,
    pipelined over the ranks (``shared.job_time.pipeline_seconds``); None where there is no estimate."""
    from .checks_live import block_timing, figures
    from .memory import compute_dtype, workload

    t = block_timing(ctx)
    if t is None:
        return None
    blocks, busiest = workload(ctx).n_clips, figures(ctx).steps_per_rank
    return JobTime(gpu=str(t.gpu.get("name")), clips=blocks, steps=recipe.STEPS, passes=step_passes(False),
                   pass_s=t.seconds, first_pass_s=t.seconds,
                   seconds=pipeline_seconds(blocks, recipe.STEPS, busiest, t.seconds), clip_s=busiest * t.seconds,
                   dtype=compute_dtype(ctx)[0].value, peak_tflops=t.peak_tflops, unit="block", steps_per_rank=busiest)


def describe(t: JobTime, world: int) -> str:
    ranks = f"{world} x " if world > 1 else ""
    dtype = f" in {t.dtype}" if t.dtype != "bf16" else ""
    if t.unit == "block":
        return (f"~{human_duration(t.seconds)} of denoising on {ranks}{t.gpu}{dtype}: {t.clips} block(s) of "
                f"{recipe.BLOCK_FRAMES} frames, each {t.steps} steps x ~{t.pass_s:.2f} s a step, pipelined: a block "
                f"every ~{t.clip_s:.2f} s ({t.steps_per_rank} step(s) on the busiest rank)")
    text = (f"~{human_duration(t.seconds)} of denoising on {ranks}{t.gpu}{dtype}: {t.clips} clip(s) x "
            f"{t.steps} steps x {t.passes} pass(es) x ~{t.pass_s:.1f} s a pass (~{human_duration(t.clip_s)} a clip)")
    if t.fewest_steps is not None and t.fewest_steps < t.steps:
        text += f"; --cache computes at least {t.fewest_steps} of the {t.steps} steps, so as little as " \
                f"~{human_duration(t.seconds * t.fewest_steps / t.steps)}"
    return text


def check_time(ctx):
    if not ctx.on_cuda:
        return skip(ID, "--device cpu: no estimate (the tiny demo's pace is not the real model's)")
    try:
        t = job_time(ctx)
    except ValueError as e:
        return skip(ID, f"no estimate ({e})")
    if t is None:
        names = ", ".join(sorted({str(g.get("name")) for g in ctx.local_gpus})) or "no GPU"
        return skip(ID, f"no estimate: the peak of {names} is not known (preflight/streaming.py)")
    return ok(ID, describe(t, ctx.layout.world_size),
              f"estimate: the DiT passes at {ASSUMED_MFU:.0%} of the GPU's {t.dtype} peak ({t.peak_tflops:g} TFLOPS; "
              "decode, encoders and loading not included)", **t.to_json())


def planned_clip_seconds(spec, facts) -> Optional[float]:
    """A complete run spec's seconds a clip on ``facts``' machine (the reference image's size read
    from its header), for the ETA before its first clip ends; None when there is no estimate.
    Never raises: a server asks it for each job it starts."""
    try:
        from .checks_inputs import check_image
        from .context import CheckContext
        ctx = CheckContext.for_spec(spec, facts)
        check_image(ctx)  # the image's size, as the memory plan reads it
        t = job_time(ctx)
        return t.clip_s if t is not None else None
    except Exception:  # noqa: BLE001 - an estimate, not a verdict
        return None
