"""Patch: the Ulysses attention forward computes in the model's dtype.

Upstream: ``sp_attn_forward_s2v(self, x, ..., dtype=torch.bfloat16)`` casts q/k/v to bf16; with
an fp32 model (CPU) the bf16 attention output then meets the fp32 output projection and fails.
``WanS2V._configure_model`` binds it per block via the name ``sp_attn_forward_s2v`` imported into
``wan.speech2video``.
Change: rebind that name to the upstream function with ``dtype`` bound to the run's param dtype.
On GPU the param dtype is bf16, i.e. exactly upstream's default — the GPU path is unchanged.
Proof: Ulysses parity tests on CPU (fp32) — without it the 2-rank run raises a dtype error.
"""
from __future__ import annotations

import functools

import torch

from patches.patch import ORIGINAL, Patch, always, unbind


def apply(wan_module, param_dtype: torch.dtype) -> bool:
    s2v = wan_module.speech2video
    if getattr(s2v.sp_attn_forward_s2v, "__wan_s2v_patched__", False):
        return False
    upstream = wan_module.modules.s2v.model_s2v.sp_attn_forward_s2v
    before = s2v.sp_attn_forward_s2v

    @functools.wraps(upstream)
    def sp_attn_forward_s2v(self, x, seq_lens, grid_sizes, freqs, dtype=None):
        return upstream(self, x, seq_lens, grid_sizes, freqs, dtype=dtype or param_dtype)

    sp_attn_forward_s2v.__wan_s2v_patched__ = True
    setattr(sp_attn_forward_s2v, ORIGINAL, before)
    s2v.sp_attn_forward_s2v = sp_attn_forward_s2v
    return True


def restore(wan_module) -> bool:
    """Undo :func:`apply`: ``speech2video``'s own ``sp_attn_forward_s2v`` again."""
    return unbind(wan_module.speech2video, "sp_attn_forward_s2v")


def _for_run(wan_module, ctx) -> str:
    apply(wan_module, ctx.param_dtype)
    return str(ctx.param_dtype)


PATCH = Patch("sp_dtype", applies=always, apply=_for_run, restore=restore)
