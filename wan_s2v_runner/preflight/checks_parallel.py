"""Groups ``ulysses_degree`` and ``fsdp``: how the run's layout splits the DiT's heads
(config.json; 40 for the real model; unevenly when the degree does not divide them) and every
sequence length the DiT chunks (noisy + reference tokens on clip 1, + FramePack motion tokens on
later clips, see :mod:`.geometry`; padded to a multiple of the degree); FSDP layout
sanity (T5 on CPU vs T5 FSDP, one-rank FSDP). The rules themselves are the layout's
(:mod:`wan_s2v_runner.shared.layout`); these checks only ask and word the answer.
"""
from __future__ import annotations

from .core import fail, ok, skip, warn
from .geometry import REAL_NUM_HEADS, generation_size, token_counts


def num_heads(ctx) -> tuple[int, str]:
    if "num_heads" in ctx.cache:
        return ctx.cache["num_heads"], "config.json"
    cfg = (ctx.cache.get("ckpt") or {}).get("config")
    if cfg and isinstance(cfg.get("num_heads"), int):
        return cfg["num_heads"], "config.json"
    return REAL_NUM_HEADS, "Wan2.2-S2V-14B default (no config.json read)"


def check_degree(ctx):
    lay = ctx.layout
    if not lay.use_sp:
        return ok("ulysses.degree", f"world size {lay.world_size}: no sequence parallelism")
    where = f" ({ctx.spec.nnodes} nodes x {ctx.spec.nproc})" if ctx.spec.nnodes > 1 else ""
    of = (f"world size {lay.world_size}{where} / {lay.cfg_degree} CFG branches" if lay.cfg_degree > 1
          else f"world size {lay.world_size}{where}")
    return ok("ulysses.degree", f"Ulysses degree {lay.sp_degree} = {of}", degree=lay.sp_degree)


def check_heads(ctx):
    lay = ctx.layout
    heads, src = num_heads(ctx)
    if not lay.use_sp:
        return skip("ulysses.heads", "no sequence parallelism")
    d = lay.sp_degree
    if not lay.splits_heads(heads):
        return fail("ulysses.heads", f"Ulysses degree {d} exceeds the {heads} attention heads ({src}): "
                    "every rank needs at least one",
                    f"use at most {heads} ranks per CFG branch (--nproc; --cfg-parallel halves the degree), "
                    "or --mode fsdp-fixed", degree=d, heads=heads)
    split = lay.head_split(heads)
    even = len(set(split)) == 1
    desc = (f"{heads} heads / {d} = {split[0]} per rank" if even else
            f"{heads} heads over {d} ranks: {'/'.join(map(str, split))} (uneven: the ranks with "
            f"{max(split)} set the pace, {max(split) * d / heads:.3g}x the even share)")
    return ok("ulysses.heads", f"{desc} ({src})", degree=d, heads=heads, head_split=split)


def check_tokens(ctx):
    lay = ctx.layout
    if not lay.use_sp:
        return skip("ulysses.tokens", "no sequence parallelism")
    d = lay.sp_degree
    img = ctx.cache.get("image_size")
    if img is None:
        return skip("ulysses.tokens", "needs a readable --image to know the frame size")
    gh, gw = generation_size(img[1], img[0], ctx.spec.max_area)
    if gh <= 0 or gw <= 0:
        return skip("ulysses.tokens", "no valid frame size (see inputs.size)")
    tc = token_counts(gh, gw, ctx.spec.infer_frames)
    n_clips = ctx.cache.get("n_clips") or (ctx.spec.num_clips or 2)
    lengths = tc.lengths(n_clips, ctx.spec.start_from_ref)
    desc = " and ".join(str(n) for n in lengths)
    data = dict(lengths=lengths, degree=d, padding=[lay.padding(n) for n in lengths])
    if lay.bad_lengths(lengths):
        return fail("ulysses.tokens", f"Ulysses degree {d} exceeds the DiT sequence of "
                    f"{min(lay.bad_lengths(lengths))} tokens ({gw}x{gh}): ranks would hold only padding",
                    "use fewer ranks or a larger --size/--infer-frames", **data)
    pad = lay.padded_lengths(lengths)
    tail = (f"; padded by {'/'.join(str(lay.padding(n)) for n in lengths)} token(s) to a multiple of {d} "
            f"({lay.padding_overhead(lengths) * 100:.3g}%; never attended to)" if pad else "")
    return ok("ulysses.tokens", f"{gw}x{gh}, {ctx.spec.infer_frames} frames: sequence {desc} tokens, "
              f"{-(-lengths[-1] // d)} per rank{tail}", **data)


def check_t5_placement(ctx):
    lay = ctx.layout
    if lay.t5_cpu and lay.t5_fsdp:
        return fail("fsdp.t5", lay.problems(1, [])[0],
                    "use --mode hybrid (T5 on CPU) or --mode fsdp-fixed (T5 sharded), not both")
    if ctx.spec.t5_cpu and lay.t5_fsdp:
        return fail("fsdp.t5", f"--t5-cpu keeps T5 whole on the CPU; --mode {ctx.mode.value} shards it over the GPUs",
                    "drop --t5-cpu, or use --mode hybrid (T5 on the CPU, the DiT sharded)")
    where = {"cpu": "on the CPU (every rank runs it)", "fsdp": "sharded with FSDP", "gpu": "on the GPU"}[
        lay.t5_placement
    ]
    return ok("fsdp.t5", f"T5 {where}")


def check_fsdp_world(ctx):
    lay = ctx.layout
    if not lay.dit_fsdp:
        return skip("fsdp.world", "no FSDP in this mode")
    if lay.world_size == 1:
        return warn("fsdp.world", f"--mode {ctx.mode.value} on 1 rank: FSDP shards nothing",
                    "use --mode ulysses on one GPU, or more ranks")
    return ok("fsdp.world", f"DiT sharded over {lay.world_size} ranks; sync_module_states=False with a "
              "weight fingerprint check (patches.fsdp_no_sync)")
