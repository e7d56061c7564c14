"""The DiT's operation count from shapes (preflight/dit_flops.py), against the engine's own model.

What MFU in bench/gpu_step.py and the plan table's speed-ups rest on: a pass of the engine's
``WanModel_S2V`` counted by ``torch.utils.flop_counter`` (every matmul, bmm and convolution it
really runs, attention in its unfused math form) equals the count from shapes, for a clip with
motion tokens and a first clip without them; and at the real S2V-14B size (built on meta, no
memory) the per-token term is twice the weights each token meets in a block.
"""
from __future__ import annotations

import math

import pytest
import torch

from wan_s2v_runner.preflight.dit_flops import DitDims, attention_flops, forward_flops, per_token_flops
from wan_s2v_runner.preflight.geometry import token_counts

SMALL = {"dim": 256, "ffn_dim": 512, "num_heads": 4, "num_layers": 4, "audio_inject_layers": [0, 2, 3],
         "audio_dim": 64}


@pytest.fixture(scope="module")
def wan():
    from patches import attention
    from wan_s2v_runner.loading.engine import import_wan

    w = import_wan()
    attention.apply(w, "sdpa")
    return w


@pytest.mark.parametrize("first_clip", [False, True], ids=["later-clip", "first-clip"])
def test_count_from_shapes_equals_flop_counter(wan, first_clip):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from wan_s2v_runner.demo.random_weights import dit_kwargs, random_dit, random_dit_inputs

    cpu = torch.device("cpu")
    model, _ = random_dit(wan, cpu, torch.float32, **SMALL)
    dims = DitDims.from_config(dit_kwargs(wan, **SMALL))
    tokens = token_counts(256, 320, 8)  # not square: rows and columns kept apart
    x, t, cond, _ = random_dit_inputs(SMALL["audio_dim"], 73, tokens, 8, cpu, torch.float32, first_clip)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel([SDPBackend.MATH]), counter, torch.no_grad():
        out = model(x, t=t, **cond)
    assert out[0].shape == x[0].shape
    expected = forward_flops(dims, tokens, with_motion=not first_clip)
    counted = counter.get_total_flops()
    # what the count from shapes leaves out: the audio encoder's causal convolutions (~0.3% here,
    # < 0.01% at real size); nothing it counts may be missing from the model
    assert expected.total <= counted <= expected.total * 1.006, (counted, expected.terms)
    blocks = counter.get_flop_counts()["WanModel_S2V.blocks.0"]
    per_block = (expected.terms["self_attn_proj"] + expected.terms["self_attn_scores"]
                 + expected.terms["cross_attn"] + expected.terms["ffn"]) // dims.num_layers
    assert sum(blocks.values()) == per_block


def test_real_size_terms_match_the_engine_blocks(wan):
    """S2V-14B on meta: per_token_flops is 2 x the weights of the matmuls every token meets in a
    block (self-attention q/k/v/o, cross-attention q/o, FFN); the config gives 12 audio layers."""
    from wan.modules.s2v.model_s2v import WanModel_S2V

    from wan_s2v_runner.demo.random_weights import dit_kwargs, on_meta

    cfg = dit_kwargs(wan)
    with on_meta():
        model = WanModel_S2V(**cfg)
    dims = DitDims.from_config(cfg)
    assert (dims.dim, dims.ffn_dim, dims.num_layers, dims.audio_layers) == (5120, 13824, 40, 12)
    blk = model.blocks[7]
    mats = [blk.self_attn.q, blk.self_attn.k, blk.self_attn.v, blk.self_attn.o,
            blk.cross_attn.q, blk.cross_attn.o, blk.ffn[0], blk.ffn[2]]
    assert per_token_flops(dims) == 2 * sum(m.weight.numel() for m in mats)
    total = sum(p.numel() for p in model.parameters())
    assert math.isclose(total, 16.3e9, rel_tol=0.01), total  # engine-facts: ~16.3 B parameters
    tokens = token_counts(704, 1024, 80)
    assert forward_flops(dims, tokens).length == 63_360
    assert attention_flops(dims, 63_360) == 4 * 63_360 ** 2 * 5120
