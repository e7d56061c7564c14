"""One cost model (issue #80): each rule the preflight, the bench and the rank share is written once
(``shared.dit_cost``, ``shared.job_time``, ``shared.video_budget``), and its users agree where they
disagreed: the live caches the plan counts are what the allocation holds, in the precision rule's
dtype; the live check's dims are the plan's; a live job is planned from the live recipe's
workload, not the clip flags it ignores."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from wan_s2v_runner.preflight.context import CheckContext
from wan_s2v_runner.preflight.facts import MachineFacts
from wan_s2v_runner.shared import live_recipe as recipe
from wan_s2v_runner.shared.dit_cost import (
    ASSUMED_MFU,
    S2V_14B,
    S2V_14B_INJECT_LAYERS,
    DitDims,
    achieved_mfu,
    clip_latent_frames,
    cond_kv_bytes,
    max_infer_frames,
    motion_latent_frames,
    pass_seconds,
    step_kv_bytes,
)
from wan_s2v_runner.shared.job_time import cfg_on, passes_per_step, pipeline_seconds, step_passes

MACHINES = os.path.join(os.path.dirname(__file__), "data", "machines")


def _ctx(machine: str, **values) -> CheckContext:
    from wan_s2v_runner.preflight.memory import REFERENCE

    ctx = CheckContext.for_values({"max_area": "704*384", **values}, MachineFacts.load(f"{MACHINES}/{machine}.json"))
    ctx.cache["sizes"] = replace(REFERENCE, source="checkpoint (test: Wan2.2-S2V-14B sizes)")
    return ctx


# --------------------------------------------------------------------------- the sizes
def test_the_14b_sizes_are_written_once():
    from wan_s2v_runner.preflight.checks_checkpoint import REQUIRED_CONFIG
    from wan_s2v_runner.preflight.memory import REFERENCE, ModelSizes, dit_dims

    assert DitDims() == S2V_14B == DitDims.of() == DitDims.of(0, None, 0, 0)
    assert (S2V_14B.dim, S2V_14B.ffn_dim, S2V_14B.num_heads, S2V_14B.num_layers, S2V_14B.audio_layers) == \
        (5120, 13824, 40, 40, 12)
    assert S2V_14B.head_dim == 128
    assert DitDims.of(dim=64, num_layers=2, audio_layers=0) == DitDims(dim=64, num_layers=2, audio_layers=0)
    assert dit_dims(REFERENCE) == S2V_14B  # the reference sizes' units give the 12 injection layers
    assert {k: REQUIRED_CONFIG[k] for k in ("dim", "ffn_dim", "num_heads", "num_layers")} == \
        dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
    assert REQUIRED_CONFIG["audio_inject_layers"] == list(S2V_14B_INJECT_LAYERS)
    # a checkpoint whose config gave no sizes: the 14B's, its injection layers from its units
    blank = ModelSizes(**{**REFERENCE.__dict__, "dim": 0, "ffn_dim": 0, "num_heads": 0, "num_layers": 0})
    assert dit_dims(blank) == S2V_14B


# --------------------------------------------------------------------------- the frames
def test_the_latent_frames_rule():
    from wan_s2v_runner.preflight.geometry import latent_frames
    from wan_s2v_runner.shared import video_budget
    from wan_s2v_runner.shared.spec import MAX_INFER_FRAMES

    assert motion_latent_frames() == motion_latent_frames(73) == video_budget.MOTION_LATENT_FRAMES == 19
    assert video_budget.motion_latent_frames is motion_latent_frames  # one rule, read where it was
    assert latent_frames(80) == clip_latent_frames(80) == 20
    assert clip_latent_frames(recipe.BLOCK_FRAMES) == recipe.BLOCK_LATENT_FRAMES  # a live block is a 12-frame clip
    assert MAX_INFER_FRAMES == max_infer_frames(1024) == 4096 and clip_latent_frames(MAX_INFER_FRAMES) == 1024


# --------------------------------------------------------------------------- the seconds
def test_the_seconds_a_pass_and_the_bench_mfu_are_one_rule():
    assert pass_seconds(989.4e12 * ASSUMED_MFU, 989.4) == pytest.approx(1.0)
    assert achieved_mfu(1e15, pass_seconds(1e15, 165.2), 165.2) == pytest.approx(ASSUMED_MFU)
    assert achieved_mfu(1e15, 1.0, None) is None


def test_a_live_block_is_counted_as_a_clip_pass_is():
    """The live block's forward and a clip's pass count the same terms for the same tokens; the
    block's self-attention reads its cached keys instead of its own tokens."""
    from wan_s2v_runner.preflight.dit_flops import forward_flops, live_block_flops
    from wan_s2v_runner.preflight.geometry import token_counts

    tokens = replace(token_counts(384, 704, recipe.BLOCK_FRAMES), ref=0, motion=0)
    clip = forward_flops(S2V_14B, tokens, with_motion=False, text_cached=True).terms
    block = live_block_flops(S2V_14B, tokens, keys=tokens.noisy).terms
    for term in ("self_attn_proj", "self_attn_scores", "cross_attn", "ffn", "audio_inject"):
        assert block[term] == clip[term], term
    wider = live_block_flops(S2V_14B, tokens, keys=5 * tokens.noisy).terms
    assert wider["self_attn_scores"] == 5 * block["self_attn_scores"] and wider["ffn"] == block["ffn"]


# --------------------------------------------------------------------------- the passes
def test_the_passes_a_step_rule():
    assert [cfg_on(g) for g in (4.5, 1.0, 0.5)] == [True, False, False]
    assert (step_passes(True), step_passes(True, 2), step_passes(False), step_passes(False, 2)) == (2, 1, 1, 1)
    assert passes_per_step(4.5) == 2 and passes_per_step(1.0) == 1 and passes_per_step(4.5, 2) == 1


def test_the_text_memo_holds_a_context_a_pass():
    """``patches.context_cache`` keeps the contexts the DiT's passes see: two with CFG, one at a
    guide scale of 1 or less (no unconditional pass), one a rank with the CFG split."""
    from wan_s2v_runner.preflight.checks_memory import current_plan

    def memo(**kw):
        return current_plan(_ctx("a100_8x_nvlink", nproc=2, mode="ulysses", **kw)).parts["text_kv_memo"]

    guided = memo(guide_scale=4.5)
    assert memo(guide_scale=1.0) * 2 == guided
    assert memo(guide_scale=4.5, cfg_parallel=True) * 2 == guided


# --------------------------------------------------------------------------- the live plan
def test_the_live_caches_the_plan_counts_are_what_the_allocation_holds():
    """``patches.live_kv``'s caches, allocated for small shapes, hold the bytes the rule gives; the
    plan counts the rule at the live workload's shapes, in the run's compute dtype."""
    from patches.live_kv import CondKV, StepKV
    from wan_s2v_runner.preflight.checks_live import figures
    from wan_s2v_runner.preflight.memory import workload

    layers, block, cond, heads, head_dim = 3, 6, 5, 2, 4
    for dtype in (torch.bfloat16, torch.float32):
        step = StepKV(layers)
        for layer in range(layers):
            for b in range(recipe.WINDOW_BLOCKS + 1):
                step.write(layer, b, torch.zeros(1, block, heads, head_dim, dtype=dtype),
                           torch.zeros(1, block, heads, head_dim, dtype=dtype))
        held = sum(t.nbytes for t in step.k + step.v)
        eb = torch.finfo(dtype).bits // 8
        assert held == step_kv_bytes(layers=layers, block_tokens=block, heads=heads, head_dim=head_dim,
                                     element_bytes=eb)
        c = CondKV(layers)
        c.k = [torch.zeros(1, cond, heads, head_dim, dtype=dtype) for _ in range(layers)]
        c.v = [torch.zeros(1, cond, heads, head_dim, dtype=dtype) for _ in range(layers)]
        assert sum(t.nbytes for t in c.k + c.v) == cond_kv_bytes(layers=layers, cond_tokens=cond, heads=heads,
                                                                  head_dim=head_dim, element_bytes=eb)

    ctx = _ctx("h100_1x", mode="live")
    f, wl = figures(ctx), workload(ctx)
    assert f.block_tokens == wl.tokens.noisy == recipe.BLOCK_LATENT_FRAMES * (wl.height // 16) * (wl.width // 16)
    shape = dict(layers=40, heads=40, head_dim=128, element_bytes=2)  # bf16 on the H100
    assert f.kv_per_step == step_kv_bytes(block_tokens=f.block_tokens, **shape)
    assert f.kv_cond == cond_kv_bytes(cond_tokens=wl.tokens.ref + wl.tokens.motion, **shape)
    # the values' dtype is the precision rule's, on the CPU too: fp32 under auto, bf16 when asked
    cpu = figures(_ctx("h100_1x", mode="live", device="cpu"))
    cpu_bf16 = figures(_ctx("h100_1x", mode="live", device="cpu", dtype="bf16"))
    assert cpu.kv_per_step == 2 * f.kv_per_step and cpu_bf16.kv_per_step == f.kv_per_step


def test_a_live_job_is_planned_from_the_live_recipe():
    """The recipe ignores --infer-frames, --num-clips and --guide-scale: so does its plan (blocks of
    12 frames, a block's tokens, no CFG), its time (pipelined blocks) and its passes."""
    from wan_s2v_runner.preflight.checks_live import block_seconds
    from wan_s2v_runner.preflight.checks_time import job_time
    from wan_s2v_runner.preflight.core import find
    from wan_s2v_runner.preflight.memory import workload
    from wan_s2v_runner.preflight.registry import run_checks

    plain = workload(_ctx("h100_1x", mode="live"))
    flagged = workload(_ctx("h100_1x", mode="live", infer_frames=40, num_clips=3, guide_scale=4.5))
    assert plain == flagged
    assert (plain.unit, plain.infer_frames, plain.tokens.latent_frames, plain.cfg) == ("block", 12, 3, False)
    assert plain.n_clips == recipe.blocks_for(5 * 16)  # 5 s of speech assumed
    clip = workload(_ctx("h100_1x", mode="ulysses", infer_frames=40))
    assert (clip.unit, clip.infer_frames, clip.cfg) == ("clip", 40, True)

    one, five = _ctx("h100_1x", mode="live"), _ctx("a100_8x_nvlink", mode="live", nproc=5)
    for ctx, busiest in ((one, 4), (five, 1)):
        t, s = job_time(ctx), block_seconds(ctx)
        assert (t.unit, t.clips, t.steps, t.passes, t.steps_per_rank) == ("block", plain.n_clips, 4, 1, busiest)
        assert t.pass_s == s and t.clip_s == pytest.approx(busiest * s)
        assert t.seconds == pytest.approx(pipeline_seconds(t.clips, 4, busiest, s))
    assert pipeline_seconds(7, 4, 4, 1.0) == 28.0 and pipeline_seconds(7, 4, 1, 1.0) == 10.0
    passes = find(run_checks(one, ["inputs"]), "inputs.passes")
    assert passes.data["most"] == 4 and "live recipe" in passes.finding
