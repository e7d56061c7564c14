"""Group ``live`` (``--mode live``): the step pipeline, each DiT rank's key/value caches and the
frames per second the machine can give, planned before anything spawns.

* ``live.stages``: which rank runs which steps (:func:`~wan_s2v_runner.shared.live_recipe.stage_plan`).
* ``live.memory``: a DiT rank holds the mode's memory plan (the whole DiT, as ``ulysses`` at one
  rank, for the live workload: a block's tokens with the condition's, no CFG; an over-estimate of
  a block's activations) plus, per step it runs, a ring of
  :data:`~wan_s2v_runner.shared.live_recipe.WINDOW_BLOCKS` blocks' keys and values per layer, and the
  condition's once (:func:`figures`: ``shared.dit_cost.step_kv_bytes`` and ``cond_kv_bytes``, the
  rule ``patches.live_kv`` allocates by, in the run's compute dtype); against the GPU's free memory.
* ``live.fps``: a block's forward (:func:`.dit_flops.live_block_flops`: its tokens' projections,
  cross-attention, FFN and audio injection, attention over the window and the condition) at
  :data:`~wan_s2v_runner.shared.dit_cost.ASSUMED_MFU` of the GPU's peak in the run's dtype
  (``shared.dit_cost.pass_seconds``); the pipeline's pace is its busiest rank's (its steps), the
  first frame waits for all 4 steps. Informational: the VAE's decode and the sends are not in it.
* ``live.session``: whether a live session (``wan-s2v serve``'s ``/v1/videos/sessions``, speech as
  it is spoken) keeps up with real time at this size on this machine: ``live.fps``'s pace against
  the video's 16 frames a second, the largest of the usual sizes that does (the image's aspect
  kept), and the delay from a block's speech to its frames (its lookahead, the block itself, the
  pipeline's 4 steps): planned, the decode and the sends not in it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from wan_s2v_runner.shared import live_recipe as recipe
from wan_s2v_runner.shared.dit_cost import cond_kv_bytes, pass_seconds, step_kv_bytes
from wan_s2v_runner.shared.media import FPS as VIDEO_FPS
from wan_s2v_runner.shared.precision import element_bytes

from .core import fail, ok, skip, warn

#: the sizes ``live.session`` tries, largest first (areas, as ``--size``)
SESSION_SIZES = ("1280*720", "1024*704", "832*480", "704*384", "640*360", "512*288", "448*256", "384*224")


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


@dataclass(frozen=True)
class LiveFigures:
    block_tokens: int
    cond_tokens: int
    kv_per_step: int  # bytes, one step's ring over every layer
    kv_cond: int  # bytes, the condition's keys and values over every layer
    steps_per_rank: int

    @property
    def kv_rank(self) -> int:
        return self.steps_per_rank * self.kv_per_step + self.kv_cond


def figures(ctx) -> LiveFigures:
    """The caches of this context's live job: a block's tokens (the live workload's:
    :func:`.memory.workload`), the condition's (reference and motion), each cache's bytes by the
    allocation's rule (``shared.dit_cost``) in the run's compute dtype (``shared.precision``)."""
    from .memory import compute_dtype, dit_dims, model_sizes, workload

    dims, wl = dit_dims(model_sizes(ctx)), workload(ctx)
    block, cond = wl.tokens.noisy, wl.tokens.ref + wl.tokens.motion
    shape = dict(layers=dims.num_layers, heads=dims.num_heads, head_dim=dims.head_dim,
                 element_bytes=element_bytes(compute_dtype(ctx)[0]))
    plan = recipe.stage_plan(ctx.spec.world_size) or recipe.stage_plan(1)
    steps = max(len(s) for s in plan.rank_steps)
    return LiveFigures(block, cond, step_kv_bytes(block_tokens=block, **shape),
                       cond_kv_bytes(cond_tokens=cond, **shape), steps)


def check_stages(ctx):
    problem = recipe.stage_problem(ctx.spec.world_size)
    if problem:
        return fail("live.stages", problem.split(". Fix: ")[0], problem.split(". Fix: ")[-1])
    return ok("live.stages", recipe.stage_plan(ctx.spec.world_size).describe())


#: flags the live recipe decides instead (docs/live.md)
RECIPE_FLAGS = ("steps", "guide_scale", "solver", "shift", "infer_frames", "num_clips", "negative_prompt",
                "start_from_ref")


def check_recipe(ctx):
    """What the live recipe takes from the run: the LoRA it needs; the sampling flags it does not read."""
    from wan_s2v_runner.shared.spec import RunSpec, flag_name

    spec = ctx.spec
    unread = [f"{flag_name(k)} {getattr(spec, k)}" for k in RECIPE_FLAGS
              if k in RunSpec.model_fields and getattr(spec, k, None) not in (None, RunSpec.model_fields[k].default)]
    what = (f"{recipe.STEPS} steps of FlowMatchEuler (shift {recipe.SHIFT:g}), no CFG, blocks of {recipe.BLOCK_FRAMES} "
            f"frames" + (f"; not read: {', '.join(unread)}" if unread else ""))
    loras = list(getattr(spec, "lora", None) or [])
    if not loras:
        return warn("live.recipe", what + "; no --lora: the base S2V model is not distilled for 4 causal steps "
                    "(its frames will be poor)", "add LiveAvatar's LoRA: --lora liveavatar.safetensors:"
                    f"{recipe.lora_strength():g} (PEFT r={recipe.LORA_RANK}, alpha={recipe.LORA_ALPHA:g})")
    for ref in loras:
        rank, alpha = lora_rank(ref.path)
        if rank == recipe.LORA_RANK and not alpha and ref.strength == 1.0:
            return warn("live.recipe", what + f"; --lora {ref.path.name} is a rank-{rank} PEFT LoRA without an alpha "
                        f"at strength 1: LiveAvatar's (r={recipe.LORA_RANK}, alpha={recipe.LORA_ALPHA:g}) is trained "
                        f"at scale {recipe.lora_strength():g}",
                        f"give it as --lora {ref.path}:{recipe.lora_strength():g}")
    return ok("live.recipe", what)


def lora_rank(path) -> tuple[Optional[int], bool]:
    """A LoRA file's rank and whether it carries an alpha (:func:`~wan_s2v_runner.loading.lora.rank_and_alpha`
    on its safetensors header); (None, False) where it cannot be read (``lora.file`` says why)."""
    from wan_s2v_runner.loading.ckpt_tables import CheckpointFileError
    from wan_s2v_runner.loading.lora import file_shapes, rank_and_alpha

    try:
        return rank_and_alpha(file_shapes(path))
    except (CheckpointFileError, OSError):
        return None, False


def check_memory(ctx):
    from .checks_memory import current_plan

    f = figures(ctx)
    what = (f"per DiT rank: {f.steps_per_rank} step cache(s) of {_gib(f.kv_per_step)} ({recipe.WINDOW_BLOCKS} "
            f"blocks of {f.block_tokens} tokens) + the condition's {_gib(f.kv_cond)}")
    if not ctx.on_cuda:
        return ok("live.memory", what, kv_bytes=f.kv_rank)
    plan = current_plan(ctx)
    gpus = [g for g in ctx.local_gpus if g.get("free_mib") is not None]
    if plan.gpu_peak is None or not gpus:
        return skip("live.memory", what + "; no GPU memory figures to compare")
    worst = min(gpus, key=lambda g: g["free_mib"])
    free, need = worst["free_mib"] * 2**20, plan.gpu_peak + f.kv_rank
    text = f"{what}: est. {_gib(need)} a DiT rank vs {_gib(free)} free on GPU {worst['index']} ({worst['name']})"
    if need > free:
        return fail("live.memory", text, "use --dit-quant fp8 (LiveAvatar runs 48 GB cards so), a smaller --size, "
                    "or more ranks (fewer steps, so fewer caches, per rank)", kv_bytes=f.kv_rank, need_bytes=need)
    return ok("live.memory", text, kv_bytes=f.kv_rank, need_bytes=need)


@dataclass(frozen=True)
class BlockTiming:
    seconds: float  # one block's forward at one step
    gpu: dict  # the slowest GPU's facts
    peak_tflops: float  # its dense peak in the run's dtype


def block_timing(ctx) -> Optional[BlockTiming]:
    """One block's forward at one step on the slowest GPU (None: no estimate): its operations
    (:func:`.dit_flops.live_block_flops`, its keys the full window's and the condition's) at
    ``shared.dit_cost.pass_seconds``' share of the GPU's peak in the run's dtype."""
    from .dit_flops import live_block_flops
    from .memory import compute_dtype, dit_dims, model_sizes, workload
    from .streaming import gpu_tflops

    if not ctx.on_cuda or not ctx.local_gpus:
        return None
    rated = [(gpu_tflops(g.get("name", ""), compute_dtype(ctx)[0]), g) for g in ctx.local_gpus]
    if any(t is None for t, _ in rated):
        return None
    peak, gpu = min(rated, key=lambda tg: tg[0])
    f = figures(ctx)
    keys = recipe.WINDOW_BLOCKS * f.block_tokens + f.cond_tokens
    flops = live_block_flops(dit_dims(model_sizes(ctx)), workload(ctx).tokens, keys).total
    return BlockTiming(pass_seconds(flops, peak), gpu, peak)


def block_seconds(ctx) -> Optional[float]:
    """One block's forward at one step on the slowest GPU (None: no estimate)."""
    t = block_timing(ctx)
    return None if t is None else t.seconds


def check_fps(ctx):
    s = block_seconds(ctx)
    if s is None:
        return skip("live.fps", "no estimate (CPU, or a GPU whose peak is not known)")
    f = figures(ctx)
    pace = f.steps_per_rank * s
    fps = recipe.BLOCK_FRAMES / pace
    return ok("live.fps", f"~{fps:.1f} frames/s ({recipe.BLOCK_FRAMES} frames a block, {f.steps_per_rank} step(s) of "
              f"~{s * 1000:.0f} ms on the busiest rank); the first frame after ~{recipe.STEPS * s:.2f} s of denoising",
              "estimate from the block's operations; the decode and the sends are not in it",
              fps=round(fps, 2), block_step_s=round(s, 4))


def _fps(ctx) -> Optional[float]:
    s = block_seconds(ctx)
    return None if s is None else recipe.BLOCK_FRAMES / (figures(ctx).steps_per_rank * s)


def largest_realtime_size(ctx) -> Optional[str]:
    """The largest of :data:`SESSION_SIZES` whose planned pace is real time or better (None: none)."""
    from wan_s2v_runner.shared.spec import parse_size

    for size in SESSION_SIZES:
        fps = _fps(ctx.with_settings(max_area=parse_size(size)))
        if fps is not None and fps >= VIDEO_FPS:
            return size
    return None


def check_session(ctx):
    from wan_s2v_runner.shared.speech_windows import SpeechWindow

    s = block_seconds(ctx)
    if s is None:
        return skip("live.session", "no estimate (CPU, or a GPU whose peak is not known)")
    fps = _fps(ctx)
    lookahead = getattr(ctx.spec, "speech_lookahead", None) or SpeechWindow().lookahead_s
    delay = lookahead + recipe.BLOCK_FRAMES / VIDEO_FPS + recipe.STEPS * s
    best = largest_realtime_size(ctx)
    data = dict(fps=round(fps, 2), realtime=fps >= VIDEO_FPS, largest_realtime_size=best,
                speech_to_frames_s=round(delay, 3))
    where = f"a block's speech reaches its frames after ~{delay:.2f} s ({lookahead:g} s lookahead, the 0.75 s block, " \
            f"4 steps of ~{s * 1000:.0f} ms)"
    if fps >= VIDEO_FPS:
        return ok("live.session", f"keeps up with real time: ~{fps:.1f} of 16 frames/s at this size; {where}",
                  f"the largest usual size that keeps up here: {best}", **data)
    fix = (f"--size {best} (the largest usual size that keeps up here)" if best else
           "more GPUs (--nproc 5: one a step) or fp8 (--dit-quant fp8)")
    return warn("live.session", f"a live session falls behind real time here: ~{fps:.1f} of 16 frames/s at this size "
                "(the avatar's video would lag its speech more and more)", f"Fix: {fix}", **data)
