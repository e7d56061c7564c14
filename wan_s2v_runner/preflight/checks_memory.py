"""Group ``memory``: the memory plan of this mode (:mod:`.memory`) against free GPU memory per
rank and available host RAM for all local ranks (MemAvailable, capped by a cgroup limit), of every
rank group on the node (``serve --replicas``: the groups load at once, each within its share).
"""
from __future__ import annotations

from wan_s2v_runner.shared import encoder_placement
from wan_s2v_runner.shared.layout import DitOffload, DitQuant, LoadStrategy, Mode, dit_load_overlap

from .core import fail, gib, human_count, ok, skip, warn
from .memory import GPU_FILL, GPU_RUNTIME, largest_fitting_size, model_sizes, plan_all, streamed_plan, workload

HOST_WARN = 0.85


def current_plan(ctx):
    plans = plan_all(ctx)
    ctx.cache["plans"] = plans
    return plans[ctx.mode.value]


def check_plan(ctx):
    sizes, wl = model_sizes(ctx), workload(ctx)
    p = current_plan(ctx)
    overlap, why = dit_load_overlap(ctx.layout, "cuda" if ctx.on_cuda else "cpu", ctx.spec.load)
    gpu = f"GPU {gib(p.gpu_peak)}/rank, " if p.gpu_peak else ""
    assumed = f"; assumed {', '.join(wl.assumed)}" if wl.assumed else ""
    return ok("memory.plan", f"{ctx.mode.value} x{p.world_size}: {gpu}host {gib(p.host_peak)}/rank "
              f"(DiT {human_count(sizes.dit_params)} params, {gib(p.parts['dit_weights'])}{_quant(ctx)}; "
              f"T5 {human_count(sizes.t5_params)} params; "
              f"{wl.width}x{wl.height}, {wl.tokens.max_len} tokens{assumed}); the DiT loads {why}",
              "approximate: see docs/memory-plan.md", sizes_source=sizes.source, dit_load_overlap=overlap)


def _quant(ctx) -> str:
    return ", fp8 Linears" if DitQuant(ctx.spec.dit_quant) is DitQuant.FP8 else ""


def _fp8_fits(ctx, free: int) -> str:
    """``--dit-quant fp8`` when the DiT in fp8 would fit this mode where full precision does not
    (never chosen for the user: it changes the frames)."""
    spec = ctx.spec
    if DitQuant(spec.dit_quant) is DitQuant.FP8 or LoadStrategy(spec.load) is LoadStrategy.FULL \
            or (spec.compile and ctx.layout.dit_fsdp):  # combinations fp8 refuses (shared/spec.py)
        return ""
    need = plan_all(ctx.with_settings(dit_quant=DitQuant.FP8.value))[ctx.mode.value].gpu_peak
    if need and need <= GPU_FILL * free:
        return (f"add --dit-quant fp8 (the DiT's Linears in fp8: est. {gib(need)} per rank; frames change "
                "slightly, see docs/loading.md), or use more GPUs")
    return ""


def audio_encoder_plan(ctx, plan, free: int) -> tuple[encoder_placement.AudioEncoderDevice, str]:
    """Where the encoding rank's wav2vec2 will run (the rank's own rule, on what the plan says is
    free when it encodes: the GPU's free memory less the plan's encode phase, T5 or the VAE's
    workspace included, though wav2vec2 runs before them and goes back to the CPU after)."""
    sizes, wl = model_sizes(ctx), workload(ctx)
    need = encoder_placement.encode_bytes(sizes.wav2vec_params, wl.audio_seconds)
    held = plan.gpu_phases.get("encode", 0) + GPU_RUNTIME
    return encoder_placement.choose("cuda", max(0, free - held), need)


def check_gpu(ctx):
    if not ctx.on_cuda:
        return skip("memory.gpu", "--device cpu")
    gpus = [g for g in ctx.local_gpus if g.get("free_mib") is not None]
    if not gpus:
        return skip("memory.gpu", "no GPU memory facts")
    p = ctx.cache.get("plans", {}).get(ctx.mode.value) or current_plan(ctx)
    need = p.gpu_peak
    worst = min(gpus, key=lambda g: g["free_mib"])
    free = worst["free_mib"] * 2**20
    phase = max(p.gpu_phases, key=p.gpu_phases.get)
    detail = (
        f"est. {gib(need)} per rank (peak in {phase}) vs {gib(free)} free on GPU {worst['index']} ({worst['name']})"
    )
    w2v, w2v_why = audio_encoder_plan(ctx, p, free)
    size = largest_fitting_size(ctx, ctx.mode, int(GPU_FILL * free))
    smaller = f"--size {size}" if size else "a smaller --size"
    streamed = {}
    if p.stream is not None:
        timing = stream_timing(ctx, p, worst)
        st = p.stream
        detail += (f"; the DiT streamed: {st['resident_blocks']} of {len(model_sizes(ctx).dit_units)} blocks "
                   f"resident, {min(2, st['streamed_blocks'])} slot(s) of {gib(st['slot_bytes'])}, "
                   f"{gib(st['pinned_bytes'])} pinned on the host; {timing.describe()}")
        streamed = {"resident_blocks": p.stream["resident_blocks"], "copy_s": round(timing.copy_s, 3),
                    "compute_s": None if timing.compute_s is None else round(timing.compute_s, 2)}
    if need > free:
        # the same frames first (another mode, the streamed DiT), then fp8 (frames change slightly)
        fixes = (_stream_fits(ctx, free), _fp8_fits(ctx, free))
        better = _better_mode(ctx, free) or "; or ".join(f for f in fixes if f)
        return _fail_or_warn(ctx)("memory.gpu", f"does not fit: {detail}",
                                  better or f"use more GPUs (hybrid shards the DiT) or {smaller}",
                                  need=need, free=free, **streamed)
    if need > GPU_FILL * free:
        alt = "" if ctx.mode.value == "hybrid" or p.stream is not None else "--mode hybrid or "
        if p.stream is not None and DitQuant(ctx.spec.dit_quant) is DitQuant.NONE:
            alt = "--dit-quant fp8 or "
        return warn("memory.gpu", f"tight: {detail}; wav2vec2 {w2v_why}", "set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; "
                    f"if it runs out of memory use {alt}{smaller}", need=need, free=free, audio_encoder=w2v.value,
                    **streamed)
    if streamed and streamed["compute_s"] is not None and streamed["copy_s"] > streamed["compute_s"]:
        return warn("memory.gpu", f"{detail}; wav2vec2 {w2v_why}", "nothing to do (it runs, slower than resident); "
                    "a larger --size or a faster slot hides the copies, --resident-blocks keeps more on the GPU",
                    need=need, free=free, audio_encoder=w2v.value, **streamed)
    return ok("memory.gpu", f"{detail}; wav2vec2 {w2v_why}", need=need, free=free, audio_encoder=w2v.value,
              **streamed)


def stream_timing(ctx, plan, gpu: dict):
    """The streamed DiT's copies against its compute per pass on ``gpu`` (:mod:`.streaming`)."""
    from .dit_flops import DitDims
    from .streaming import timing
    sizes, wl = model_sizes(ctx), workload(ctx)
    units = sizes.dit_units
    inject = sum(1 for u in units if u > min(units)) if units else 12
    dims = DitDims(dim=sizes.dim or 5120, ffn_dim=sizes.ffn_dim or 13824, num_heads=sizes.num_heads or 40,
                   num_layers=sizes.num_layers or 40, audio_layers=inject)
    layout = ctx.layout_for(ctx.mode)
    return timing(gpu, plan.stream["bytes_per_pass"], dims, wl.tokens, layout.sp_degree if layout.use_sp else 1)


def _stream_fits(ctx, free: int) -> str:
    """``--dit-offload blocks`` (ulysses mode) when the streamed DiT fits where the resident one does
    not (the same frames: the fix to name first)."""
    if ctx.spec.dit_offload is DitOffload.BLOCKS and not ctx.layout.dit_fsdp:
        return ""
    plan = streamed_plan(ctx)
    need = plan.gpu_peak if plan is not None else None
    if need and need <= free:
        mode = "" if ctx.mode is Mode.ULYSSES else "--mode ulysses "
        tight = ", tight" if need > GPU_FILL * free else ""
        return (f"add {mode}--dit-offload blocks (the DiT's blocks stream from host memory: est. {gib(need)} per "
                f"rank{tight}, the same frames; docs/loading.md)")
    return ""


def _fail_or_warn(ctx):
    """Without a readable checkpoint the sizes are the reference model's: warn, don't refuse."""
    return fail if model_sizes(ctx).source.startswith("checkpoint") else _assumed_warn


def _assumed_warn(id, finding, fix, **data):
    return warn(id, finding + " (assuming the Wan2.2-S2V-14B sizes; pass --ckpt-dir to check)", fix, **data)


def _better_mode(ctx, free) -> str:
    plans = ctx.cache.get("plans") or plan_all(ctx)
    fits = [m for m, p in plans.items() if p.gpu_peak and p.gpu_peak <= GPU_FILL * free and m != ctx.mode.value]
    if fits:
        best = min(fits, key=lambda m: plans[m].gpu_peak)
        return f"use --mode {best} (est. {gib(plans[best].gpu_peak)} per rank)"
    return ""


def check_host(ctx):
    """The node's host RAM for all local ranks at load. Under lean loading, when all at once does
    not fit but reading in turns of local ranks does, the run loads in waves (``--load-waves``
    unset) and this says so; it fails only when even one rank at a time cannot fit. With several
    groups on the node (``serve --replicas``) they load at the same time: each group must fit
    its share of the RAM, and the waves are each group's."""
    avail = ctx.facts.host_available_bytes()
    if avail is None:
        return skip("memory.host", "host memory unknown")
    p = ctx.cache.get("plans", {}).get(ctx.mode.value) or current_plan(ctx)
    lim = ctx.facts.host.get("cgroup_limit_mib")
    src = f"available (cgroup limit {lim / 1024:.0f} GiB)" if lim else "available"
    n = ctx.spec.nproc
    ranks = f"{n} local rank{'s' if n > 1 else ''}"
    shared = f" + {gib(p.host_shared)} shared DiT" if p.host_shared else ""
    if n == 1 or p.host_others == p.host_rank0 == p.host_peak:
        per_rank = gib(p.host_peak - p.host_shared)
    else:
        text = f" / {gib(p.host_others + p.host_text_extra)} (rank {p.world_size - 1}: T5)" if p.host_text_extra else ""
        per_rank = f"{gib(p.host_rank0)} (rank 0){text} / {gib(p.host_others)}"
    chosen, groups = ctx.spec.load_waves, ctx.node_groups
    waves = chosen or p.waves_needed(avail // groups) or (n if p.host_load_transient else 1)
    need = p.node_total(waves) * groups
    how = f"{p.load.value} loading" + (f", {waves} waves" if waves > 1 else "")
    detail = f"{ranks} x {per_rank}{shared} ({how})"
    detail = f"{groups} groups x ({detail}: {gib(need // groups)})" if groups > 1 else detail
    detail = (f"{detail} = {gib(need)} vs {gib(avail)} {src}; rank 0's video frames are "
              f"{gib(p.parts['video_frames_rank0'])} of it at any clip count")
    if need > avail:
        lean = p.load is LoadStrategy.LEAN
        fix = ("fewer ranks per node" + (" or fewer --replicas" if groups > 1 else "") + ", --mode hybrid or "
               "fsdp-fixed (each rank holds a shard of the DiT) or a machine with more RAM" if lean else
               "drop --load full (lean loading reads only each rank's shard and one copy per node)")
        return _fail_or_warn(ctx)("memory.host", f"host RAM exhausted at load: {detail}", fix,
                                  need=need, avail=avail, waves=waves)
    if waves > 1 and chosen is None:
        return warn("memory.host", f"the node cannot load all its ranks at once; loading in {waves} waves: {detail}",
                    "nothing to do (slower loading); more RAM or fewer ranks per node would load at once",
                    need=need, avail=avail, waves=waves)
    if need > HOST_WARN * avail:
        return warn("memory.host", f"tight: {detail}", "close other programs; expect swapping risk",
                    need=need, avail=avail, waves=waves)
    return ok("memory.host", detail, need=need, avail=avail, waves=waves)


#: the share of the RAM a streamed DiT may pin on WSL2: its GPU driver pins at most about half the
#: RAM (its lock pool), less what else pins (torch's own pinned buffers, other programs)
WSL_PIN_SHARE = 0.45


def check_pinned(ctx):
    """A streamed DiT pins its host copy (``cudaHostRegister``): the pages are never swapped, so
    the host plan must fit the RAM (``memory.host`` counts them), and WSL2's driver pins at most
    about half the RAM; beyond, the rank copies from pageable memory (slower, not overlapped).
    CUDA's pinning is not charged to ``ulimit -l``, which is reported all the same."""
    if ctx.spec.dit_offload is not DitOffload.BLOCKS:
        return skip("memory.pinned", "the DiT is not streamed")
    if not ctx.on_cuda:
        return skip("memory.pinned", "--device cpu: nothing to pin")
    p = ctx.cache.get("plans", {}).get(ctx.mode.value) or current_plan(ctx)
    if p.stream is None:
        return skip("memory.pinned", f"{ctx.mode.value} mode does not stream the DiT")
    pinned = p.stream["pinned_bytes"]
    total = (ctx.facts.host.get("mem_total_mib") or 0) * 2**20
    limit = ctx.facts.host.get("memlock_limit_mib")
    memlock = "unlimited" if limit is None else f"{limit} MiB (not charged by CUDA's pinning)"
    where = "once for the node's ranks" if ctx.spec.nproc > 1 else "by the rank"
    detail = f"{gib(pinned)} of the DiT pinned {where}, of {gib(total) if total else '?'} RAM; ulimit -l {memlock}"
    wsl = "microsoft" in str(ctx.facts.raw.get("os", "")).lower()
    if wsl and total and pinned > WSL_PIN_SHARE * total:
        return warn("memory.pinned", f"{detail}: WSL2's driver pins at most about half the RAM, so the copies "
                    "will be pageable (slower, not overlapped)", "add --dit-quant fp8 (half the bytes to pin), "
                    "or give WSL2 more memory (.wslconfig memory=)", pinned=pinned, total=total)
    return ok("memory.pinned", detail, pinned=pinned, total=total)
