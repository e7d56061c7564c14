"""Group ``memory``: the memory plan of this mode (:mod:`.memory`) against free GPU memory per
rank and available host RAM for all local ranks (MemAvailable, capped by a cgroup limit), of every
rank group on the node (``serve --replicas``: the groups load at once, each within its share).
"""
from __future__ import annotations

from wan_s2v_runner.shared import encoder_placement
from wan_s2v_runner.shared.layout import DitOffload, DitQuant, LoadStrategy, Mode, dit_load_overlap

from .core import fail, gib, human_count, ok, skip, warn
from .memory import (
    GPU_FILL,
    GPU_RUNTIME,
    HOST_FILL,
    HostPhase,
    dit_dims,
    largest_fitting,
    model_sizes,
    plan_all,
    streamed_plan,
    t5_words,
    workload,
)

HOST_WARN = HOST_FILL


def more_gpus(ctx) -> bool:
    """Whether this machine has GPUs the run does not use (a fix may name more of them; never on a
    machine that has no more)."""
    return ctx.facts.gpu_count > ctx.spec.nproc * ctx.node_groups or ctx.spec.nnodes > 1


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
    if p.host_phases is not None:
        overlap, why = False, "after the encoders are let go (released encoders: they never coexist on the host)"
    t5_where = ", on the CPU" if p.t5_cpu and not ctx.layout.t5_cpu else ""
    return ok("memory.plan", f"{ctx.mode.value} x{p.world_size}: {gpu}host {gib(p.host_peak)}/rank "
              f"(DiT {human_count(sizes.dit_params)} params, {gib(p.parts['dit_weights'])}{_quant(ctx)}; "
              f"T5 {human_count(sizes.t5_params)} params{t5_where}; computed in {p.dtype}; "
              f"{wl.width}x{wl.height}, {wl.tokens.max_len} tokens{assumed}); the DiT loads {why}",
              "approximate: see docs/memory-plan.md", sizes_source=sizes.source, dit_load_overlap=overlap,
              dtype=p.dtype)


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
                "slightly, see docs/loading.md)" + (", or use more GPUs" if more_gpus(ctx) else ""))
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
        + ("; rank 0 decodes and holds no DiT (its GPU: the VAE, "
           f"{gib(p.gpu_phases['decode'] + GPU_RUNTIME)})" if "dit_weights_rank0" in p.parts else "")
    )
    w2v, w2v_why = audio_encoder_plan(ctx, p, free)
    size, at_size = largest_fitting(ctx, ctx.mode, int(GPU_FILL * free))
    smaller = f"--size {size}{t5_words(at_size)}" if size else "a smaller --size"
    if p.t5_cpu and not ctx.layout.t5_cpu:  # the plan's (settled for the launcher) or --t5-cpu's
        detail += f"; {p.t5_why}" if p.t5_settled else "; T5 encodes on the CPU (--t5-cpu)"
    elif p.host_phases is not None:
        detail += "; T5 encodes before the DiT's device part is placed (released encoders)"
    streamed = {"t5_cpu": True} if p.t5_settled else {}  # settled by the plan (GateReport.settled)
    if p.stream is not None:
        timing = stream_timing(ctx, p, worst)
        st = p.stream
        held = (f"{gib(st['pinned_bytes'])} pinned on the host" if st.get("source") != "page-cache" else
                f"from the page cache (its {gib(st['file_bytes'])} file mapped; {gib(st['pinned_bytes'])} of "
                "staging pinned)")
        detail += (f"; the DiT streamed: {st['resident_blocks']} of {len(model_sizes(ctx).dit_units)} blocks "
                   f"resident, {min(2, st['streamed_blocks'])} slot(s) of {gib(st['slot_bytes'])}, "
                   f"{held}; {timing.describe()}")
        streamed.update(resident_blocks=p.stream["resident_blocks"], copy_s=round(timing.copy_s, 3),
                        compute_s=None if timing.compute_s is None else round(timing.compute_s, 2))
    if need > free:
        # the same frames first (another mode, the streamed DiT), then fp8 (frames change slightly)
        fixes = (_stream_fits(ctx, free), _fp8_fits(ctx, free))
        better = _better_mode(ctx, free) or "; or ".join(f for f in fixes if f)
        if not better:
            at, at_plan = ("", None) if size or (ctx.spec.dit_offload is DitOffload.BLOCKS
                                                 and not ctx.layout.dit_fsdp) \
                else largest_fitting(ctx, Mode.ULYSSES, int(GPU_FILL * free), streamed=True)
            better = (f"use more GPUs (hybrid shards the DiT) or {smaller}" if more_gpus(ctx)
                      else f"use {smaller}" if size
                      else f"use --size {at} with --mode ulysses --dit-offload blocks (the DiT's blocks "
                           f"streamed){t5_words(at_plan)}" if at else _no_size(ctx, p, free))
        return _fail_or_warn(ctx)("memory.gpu", f"does not fit: {detail}", better, need=need, free=free,
                                  **streamed)
    if need > GPU_FILL * free:
        alt = "" if ctx.mode.value == "hybrid" or p.stream is not None else "--mode hybrid or "
        fp8 = _fp8_fits(ctx, free) if p.stream is not None else ""
        if fp8:
            alt = "--dit-quant fp8 or "
        return warn("memory.gpu", f"tight: {detail}; wav2vec2 {w2v_why}", "set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; "
                    f"if it runs out of memory use {alt}{smaller}", need=need, free=free, audio_encoder=w2v.value,
                    **streamed)
    if streamed.get("compute_s") is not None and streamed["copy_s"] > streamed["compute_s"]:
        return warn("memory.gpu", f"{detail}; wav2vec2 {w2v_why}", "nothing to do (it runs, slower than resident); "
                    "a larger --size or a faster slot hides the copies, --resident-blocks keeps more on the GPU",
                    need=need, free=free, audio_encoder=w2v.value, **streamed)
    return ok("memory.gpu", f"{detail}; wav2vec2 {w2v_why}", need=need, free=free, audio_encoder=w2v.value,
              **streamed)


def no_size_words(ctx, free: int) -> str:
    """Why no size fits this machine's GPU even with the DiT streamed: the smallest size's plan and
    what sets its floor (T5 on the GPU while it encodes, as a rule: no size lowers it)."""
    from wan_s2v_runner.shared.spec import parse_size

    from .memory import SIZES
    floor = streamed_plan(ctx.with_settings(max_area=parse_size(SIZES[-1])))
    if floor is None or not floor.gpu_peak:
        return "no size fits"
    phase = max(floor.gpu_phases, key=floor.gpu_phases.get)
    what = (f": T5 ({gib(floor.parts['t5_weights'])} in {floor.dtype}) encodes on the GPU, beside the VAE"
            if phase == "encode" and not floor.t5_cpu else
            ", with T5 on the CPU (the plan sets --t5-cpu)" if floor.t5_settled else "")
    tight = "" if floor.gpu_peak > free else f", past {GPU_FILL:.0%}"
    return (f"no size fits: even {SIZES[-1]} streamed needs est. {gib(floor.gpu_peak)} (peak in {phase}{what}) "
            f"of the {gib(free)} free{tight}")


def _no_size(ctx, p, free: int) -> str:
    """The fix where no size fits this machine's GPU, without more GPUs where the machine has none."""
    return (f"{no_size_words(ctx, free)}: a GPU with more free memory"
            + (" (or more GPUs, hybrid sharding the DiT)" if more_gpus(ctx) else ""))


def stream_timing(ctx, plan, gpu: dict):
    """The streamed DiT's copies against its compute per pass on ``gpu`` (:mod:`.streaming`), in the
    plan's compute dtype; from the page cache, at the disk's pace where the RAM cannot keep the file."""
    from .streaming import timing
    sizes, wl = model_sizes(ctx), workload(ctx)
    layout = ctx.layout_for(ctx.mode)
    return timing(gpu, plan.stream["bytes_per_pass"], dit_dims(sizes), wl.tokens,
                  layout.sp_degree if layout.use_sp else 1,
                  dtype=plan.dtype, disk_bytes=plan.stream.get("disk_bytes_per_pass") or 0, host=ctx.facts.host)


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
    chosen, groups = ctx.spec.load_waves, ctx.node_groups
    waves = chosen or p.waves_needed(avail // groups) or (n if p.host_load_transient else 1)
    need = p.node_total(waves) * groups
    how = f"{p.load.value} loading" + (f", {waves} waves" if waves > 1 else "")
    if p.host_phases is None:
        whole = HostPhase(p.host_rank0, p.host_others, p.host_text_extra, p.host_shared)
        detail = f"{ranks} x {_per_rank(p, whole)}"
    else:  # released encoders: the larger of two phases, never their sum
        enc, dit = (HostPhase(**{k: v for k, v in p.host_phases[ph].items() if k != "node"})
                    for ph in ("encode", "dit"))
        detail = (f"encoders released (T5 and wav2vec2 let go before the DiT is read): encode phase {ranks} x "
                  f"{_per_rank(p, enc)} = {gib(enc.node(n))}, DiT phase {ranks} x {_per_rank(p, dit)} = "
                  f"{gib(dit.node(n))}; the larger")
    detail = f"{detail} ({how})"
    detail = f"{groups} groups x ({detail}: {gib(need // groups)})" if groups > 1 else detail
    detail = (f"{detail} = {gib(need)} vs {gib(avail)} {src}; rank 0's video frames are "
              f"{gib(p.parts['video_frames_rank0'])} of it at any clip count")
    st = p.stream or {}
    if st.get("source") == "page-cache":
        room = st.get("cache_room")
        keeps = ("all of it" if room is not None and room >= st["file_bytes"] else
                 f"{gib(room)} of it: each pass reads it from the disk again" if room is not None else "what fits")
        detail += (f"; the DiT's {gib(st['file_bytes'])} file is page cache, not counted (the RAM left "
                   f"keeps {keeps})")
    if p.release_encoders and getattr(ctx, "served", False):
        detail += ("; a server's group builds T5 and wav2vec2 again beside the DiT for a new prompt and "
                   "speech, so they are counted beside it")
    data = dict(need=need, avail=avail, waves=waves)
    if p.host_phases is not None and p.release_why.startswith("released"):
        data["release_encoders"] = True  # settled by the plan (GateReport.settled)
    if st.get("source"):
        data["dit_stream_from"] = st["source"]
    if need > avail:
        lean = p.load is LoadStrategy.LEAN
        first = []
        if st.get("source") == "memory":
            first.append("--dit-stream-from page-cache (the DiT's bytes in a file on disk, memory-mapped: the "
                         "page cache keeps what fits)")
        if lean and ctx.on_cuda and not p.release_encoders and not getattr(ctx, "served", False):
            first.append("--release-encoders (T5 and wav2vec2 let go before the DiT is read)")
        fix = ("fewer ranks per node" + (" or fewer --replicas" if groups > 1 else "") + ", --mode hybrid or "
               "fsdp-fixed (each rank holds a shard of the DiT) or a machine with more RAM" if lean else
               "drop --load full (lean loading reads only each rank's shard and one copy per node)")
        if lean and n == 1 and groups == 1:
            fix = "a machine with more RAM"
        fix = ", ".join(first + [fix])
        return _fail_or_warn(ctx)("memory.host", f"host RAM exhausted at load: {detail}", fix, **data)
    if waves > 1 and chosen is None:
        return warn("memory.host", f"the node cannot load all its ranks at once; loading in {waves} waves: {detail}",
                    "nothing to do (slower loading); more RAM or fewer ranks per node would load at once", **data)
    if need > HOST_WARN * avail:
        return warn("memory.host", f"tight: {detail}", "close other programs; expect swapping risk", **data)
    return ok("memory.host", detail, **data)


def _per_rank(p, ph: HostPhase) -> str:
    """One phase's host bytes per rank as ``memory.host`` words them: every rank alike, or rank 0 /
    the text rank / the others; the node-shared DiT after."""
    shared = f" + {gib(ph.shared)} shared DiT" if ph.shared else ""
    if p.nproc == 1 or (ph.others == ph.rank0 and not ph.text_extra):
        return f"{gib(ph.rank0)}{shared}"
    text = f" / {gib(ph.others + ph.text_extra)} (rank {p.world_size - 1}: T5)" if ph.text_extra else ""
    return f"{gib(ph.rank0)} (rank 0){text} / {gib(ph.others)}{shared}"


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
    if p.stream.get("source") == "page-cache":
        return _page_cache_file(ctx, p, total, memlock)
    where = "once for the node's ranks" if ctx.spec.nproc > 1 else "by the rank"
    detail = f"{gib(pinned)} of the DiT pinned {where}, of {gib(total) if total else '?'} RAM; ulimit -l {memlock}"
    wsl = "microsoft" in str(ctx.facts.raw.get("os", "")).lower()
    if wsl and total and pinned > WSL_PIN_SHARE * total:
        return warn("memory.pinned", f"{detail}: WSL2's driver pins at most about half the RAM, so the copies "
                    "will be pageable (slower, not overlapped)", "add --dit-quant fp8 (half the bytes to pin), "
                    "or give WSL2 more memory (.wslconfig memory=)", pinned=pinned, total=total)
    return ok("memory.pinned", detail, pinned=pinned, total=total)


def _page_cache_file(ctx, p, total: int, memlock: str):
    """The page cache's side of ``memory.pinned``: the staging each rank pins, and the disk the DiT's
    file goes to (the cache directory's filesystem, where the facts record it) with its read speed."""
    from wan_s2v_runner.shared.stream_source import STAGING_SLOTS, cache_dir

    from .streaming import disk_mib_s
    st = p.stream
    size = st["file_bytes"]
    env = ctx.facts.env
    if ctx.facts.live:
        where = cache_dir(setting=ctx.spec.cache_dir)
        from .probe import filesystem
        fs = filesystem(where)
    else:  # recorded: the facts' environment (its HOME, else "~")
        where = cache_dir(env, setting=ctx.spec.cache_dir)
        fs = ctx.facts.filesystem(where)
    _, speed = disk_mib_s(ctx.facts.host)
    detail = (f"page cache: {gib(st['pinned_bytes'])} of staging pinned ({ctx.spec.nproc} rank(s) x "
              f"{STAGING_SLOTS} slots of {gib(st['slot_bytes'])}), of {gib(total) if total else '?'} RAM; "
              f"the DiT's {gib(size)} file under "
              f"{where} (written once, then mapped), read from {speed}; ulimit -l {memlock}")
    data = dict(pinned=st["pinned_bytes"], total=total, file_bytes=size)
    if fs is not None:
        free = fs["free_mib"] * 2**20
        detail += f"; {gib(free)} free on {fs['path']}"
        if free < size:
            return warn("memory.pinned", f"{detail}: the DiT's file does not fit there (it is reused once written)",
                        "free space there, or set WAN_S2V_DIT_CACHE_DIR to a local disk with room",
                        disk_free=free, **data)
    return ok("memory.pinned", detail, **data)
