"""Groups ``ulysses_degree`` and ``fsdp``: whether the run's layout fits the DiT's head count
(config.json; 40 for the real model) and every sequence length the DiT chunks (noisy + reference
tokens on clip 1, + FramePack motion tokens on later clips; see :mod:`.geometry`); FSDP layout
sanity (T5 on CPU vs T5 FSDP, one-rank FSDP). The rules themselves are the layout's
(:mod:`wan_s2v_runner.layout`); these checks only ask and word the answer.
"""
from __future__ import annotations

from wan_s2v_runner.layout import COMMON_GPU_COUNTS, valid_sp_degrees

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
        return ok("ulysses.degree", f"world size {ctx.world_size}: no sequence parallelism")
    where = f" ({ctx.spec.nnodes} nodes x {ctx.spec.nproc})" if ctx.spec.nnodes > 1 else ""
    return ok("ulysses.degree", f"Ulysses degree {lay.sp_degree} = world size {ctx.world_size}{where}",
              degree=lay.sp_degree)


def check_heads(ctx):
    lay = ctx.layout
    heads, src = num_heads(ctx)
    if not lay.use_sp:
        return skip("ulysses.heads", "no sequence parallelism")
    d = lay.sp_degree
    if not lay.divides_heads(heads):
        ok_d = valid_sp_degrees(heads, [], COMMON_GPU_COUNTS + ((16,) if d > 8 else ()))
        return fail("ulysses.heads", f"Ulysses degree {d} does not divide the {heads} attention heads ({src})",
                    f"use {', '.join(map(str, ok_d))} ranks (--nproc), or --mode fsdp-fixed for any GPU count",
                    degree=d, heads=heads)
    return ok("ulysses.heads", f"{heads} heads / {d} = {lay.heads_per_rank(heads)} per rank ({src})",
              degree=d, heads=heads)


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
    bad = lay.bad_lengths(lengths)
    desc = " and ".join(str(n) for n in lengths)
    if bad:
        heads, _ = num_heads(ctx)
        good = valid_sp_degrees(heads, lengths, range(2, 17))
        return fail("ulysses.tokens", f"Ulysses degree {d} does not divide the DiT sequence of {bad[0]} tokens "
                    f"({gw}x{gh}, {ctx.spec.infer_frames} frames: {tc.noisy} noisy + {tc.ref} ref"
                    f"{f' + {tc.motion} motion' if bad[0] == tc.later_clips else ''}); S2V does not pad",
                    (f"use {', '.join(map(str, good))} ranks" if good else "use fewer ranks")
                    + " or another --size/--infer-frames", lengths=lengths, degree=d)
    return ok("ulysses.tokens", f"{gw}x{gh}, {ctx.spec.infer_frames} frames: sequence {desc} tokens, "
              f"{lengths[-1] // d} per rank", lengths=lengths, degree=d)


def check_t5_placement(ctx):
    lay = ctx.layout
    if lay.t5_cpu and lay.t5_fsdp:
        return fail("fsdp.t5", lay.problems(1, [])[0],
                    "use --mode hybrid (T5 on CPU) or --mode fsdp-fixed (T5 sharded), not both")
    where = {"cpu": "on the CPU (every rank runs it)", "fsdp": "sharded with FSDP", "gpu": "on the GPU"}[lay.t5_placement]
    return ok("fsdp.t5", f"T5 {where}")


def check_fsdp_world(ctx):
    lay = ctx.layout
    if not lay.dit_fsdp:
        return skip("fsdp.world", "no FSDP in this mode")
    if ctx.world_size == 1:
        return warn("fsdp.world", f"--mode {ctx.mode.value} on 1 rank: FSDP shards nothing",
                    "use --mode ulysses on one GPU, or more ranks")
    return ok("fsdp.world", f"DiT sharded over {ctx.world_size} ranks; sync_module_states=False with a "
              "weight fingerprint check (patches.fsdp_no_sync)")
