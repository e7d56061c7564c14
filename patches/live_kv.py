"""Patch: the DiT's self-attention with the live mode's key/value caches (a causal block, per
denoising step), for ``--mode live`` only.

Upstream (``wan/modules/s2v/model_s2v.py`` ``WanS2VSelfAttention.forward``): one call attends the
whole clip: the noisy tokens, the reference and the motion tokens, every token to every token,
RoPE applied to q and k from the positions ``freqs`` gives.

Why we change it: LiveAvatar's causal mode (``causal_model_s2v.py`` ``CausalWanS2VSelfAttention``)
denoises a video block by block (3 latent frames), each block's queries attending the keys of the
last few blocks **at the same denoising step** and the condition tokens' keys, which a sink pass
computed once. Recomputing those keys for every block would cost the whole window's forward per
block; the cache makes a block's forward cost one block's tokens.

Change, per model instance (:func:`apply`: each block's ``self_attn`` gets this forward, bound to
its layer index and to the model's :class:`LiveAttention`, which holds the call in progress; nothing
is stored on the engine's modules), driven by the live loop through that holder
(:meth:`LiveAttention.calling`), so upstream's block forward (modulation, cross-attention, FFN) runs
unchanged around it:

* a **sink** call (:class:`CondKV`): the condition tokens (reference, frame-packed motion) attend
  each other as upstream's forward would; their keys are stored **before** RoPE, their values
  as they are (the reference's position changes from block to block);
* a **block** call (:class:`StepKV` for the step being run, the block's index, the condition
  keys' RoPE for this call): q and k get RoPE at the block's absolute positions; the block's k
  (after RoPE) and v are written into its slot of the step's ring (:data:`WINDOW_BLOCKS` slots);
  the queries attend the window's blocks in time order, then the condition keys with their
  RoPE for this call, then the condition values.

Without a call set (the holder's ``call`` None) the forward is upstream's, line for line: a live group's
model is patched for its life, and nothing else runs on it.

Memory: per step, 2 x :data:`WINDOW_BLOCKS` x block tokens x dim values per layer (at 704x384 in
bf16: 4 blocks x 3024 tokens x 5120 x 2 x 2 bytes x 40 layers = 9.2 GiB per step), and the
condition's once per rank: ``shared.dit_cost.step_kv_bytes`` and ``cond_kv_bytes``, the rules the
plan counts with (``preflight.checks_live``); a step cache asserts it allocates what the rule says.

Proof: ``tests/test_live.py``: the cached block loop equals a full recomputation of every block
from its step latents with the block-causal window mask, exactly (CPU, fp32).
"""
from __future__ import annotations

import contextlib
import functools
import types
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from wan_s2v_runner.shared.dit_cost import step_kv_bytes
from wan_s2v_runner.shared.live_recipe import WINDOW_BLOCKS, window


class CondKV:
    """The condition tokens' keys (before RoPE) and values, per layer: the sink call fills it."""

    def __init__(self, layers: int):
        self.k: list[Optional[torch.Tensor]] = [None] * layers
        self.v: list[Optional[torch.Tensor]] = [None] * layers


class StepKV:
    """One denoising step's ring of the last :data:`WINDOW_BLOCKS` blocks' keys (after RoPE) and
    values, per layer; a block writes slot ``block % WINDOW_BLOCKS``. Allocated at the first write
    (its shape is the block's)."""

    def __init__(self, layers: int):
        self.k: list[Optional[torch.Tensor]] = [None] * layers
        self.v: list[Optional[torch.Tensor]] = [None] * layers
        self.block_tokens = 0
        #: slot -> the block whose keys it holds (the same on every layer)
        self.held: dict[int, int] = {}

    def write(self, layer: int, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        if self.k[layer] is None:
            self.block_tokens = n
            self.k[layer] = k.new_zeros((k.shape[0], WINDOW_BLOCKS * n, *k.shape[2:]))
            self.v[layer] = v.new_zeros((v.shape[0], WINDOW_BLOCKS * n, *v.shape[2:]))
            planned = step_kv_bytes(layers=1, block_tokens=n, heads=k.shape[2], head_dim=k.shape[3],
                                    element_bytes=k.element_size(), batch=k.shape[0])
            assert self.k[layer].nbytes + self.v[layer].nbytes == planned, "the step cache is not what the plan counts"
        if n != self.block_tokens:
            raise ValueError(f"a block of {n} tokens in a cache of {self.block_tokens}-token blocks")
        slot = block % WINDOW_BLOCKS
        self.k[layer][:, slot * n:(slot + 1) * n] = k
        self.v[layer][:, slot * n:(slot + 1) * n] = v
        if layer == 0:
            self.held[slot] = block

    def window(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``block`` attends at this step, oldest block first."""
        n = self.block_tokens
        ks, vs = [], []
        for b in window(block):
            slot = b % WINDOW_BLOCKS
            if self.held.get(slot) != b:
                raise RuntimeError(f"block {block} needs block {b}'s keys at this step; the cache holds "
                                   f"{self.held.get(slot)} there")
            ks.append(self.k[layer][:, slot * n:(slot + 1) * n])
            vs.append(self.v[layer][:, slot * n:(slot + 1) * n])
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


@dataclass
class Call:
    """What one forward of the live model needs in every self-attention."""

    cond: CondKV
    #: None: the sink call (the condition tokens alone)
    step: Optional[StepKV] = None
    block: int = 0
    #: the condition keys' RoPE for this call ([1, cond tokens, 1, head_dim / 2], complex)
    cond_freqs: Optional[torch.Tensor] = None


def _model_s2v():
    import wan.modules.s2v.model_s2v as m
    return m


class LiveAttention:
    """One model's live self-attentions: the call in progress (None: upstream's forward)."""

    def __init__(self, model: Any):
        self.call: Optional[Call] = None
        self.layers = len(model.blocks)
        for i, block in enumerate(model.blocks):
            attn = block.self_attn
            attn.forward = types.MethodType(functools.partial(forward, live=self, layer=i), attn)

    @contextlib.contextmanager
    def calling(self, call: Call):
        """Every block's self-attention sees ``call`` for the forward inside."""
        self.call = call
        try:
            yield
        finally:
            self.call = None


#: the models :func:`apply` patched, and their holders
_PATCHED: "weakref.WeakKeyDictionary[Any, LiveAttention]" = weakref.WeakKeyDictionary()


def forward(self, x, seq_lens, grid_sizes, freqs, *, live: LiveAttention, layer: int):
    """``WanS2VSelfAttention.forward`` with the live call's caches (module docstring)."""
    m = _model_s2v()
    call = live.call
    b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
    q = self.norm_q(self.q(x)).view(b, s, n, d)
    k = self.norm_k(self.k(x)).view(b, s, n, d)
    v = self.v(x).view(b, s, n, d)
    if call is None:  # upstream's
        out = m.flash_attention(q=m.rope_apply(q, grid_sizes, freqs), k=m.rope_apply(k, grid_sizes, freqs), v=v,
                                k_lens=seq_lens, window_size=self.window_size)
        return self.o(out.flatten(2))
    if call.step is None:  # the sink: the condition tokens attend each other; their keys kept before RoPE
        call.cond.k[layer], call.cond.v[layer] = k, v
        out = m.flash_attention(q=m.rope_apply(q, grid_sizes, freqs), k=m.rope_apply(k, grid_sizes, freqs), v=v,
                                k_lens=seq_lens, window_size=self.window_size)
        return self.o(out.flatten(2))
    # kept in the values' dtype (rope_apply returns fp32; the attention casts to it, as LiveAvatar's
    # ``type_as(v)``): bf16 keys, not fp32, in the cache on a GPU; the same values on the CPU's fp32
    roped_k = m.rope_apply(k, grid_sizes, freqs).type_as(v)
    call.step.write(layer, call.block, roped_k, v)
    keys, values = call.step.window(layer, call.block)
    cond_k = m.rope_apply(call.cond.k[layer], None, call.cond_freqs)
    out = m.flash_attention(q=m.rope_apply(q, grid_sizes, freqs), k=torch.cat([keys, cond_k.type_as(keys)], dim=1),
                            v=torch.cat([values, call.cond.v[layer]], dim=1), k_lens=None,
                            window_size=self.window_size)
    return self.o(out.flatten(2))


def apply(model: Any) -> LiveAttention:
    """Give every block's self-attention the live forward (once per model); its holder."""
    if model not in _PATCHED:
        _PATCHED[model] = LiveAttention(model)
    return _PATCHED[model]
