"""Patch: Ulysses sequence parallelism on the SP group, for any degree (uneven heads, padded tokens).

Upstream (``wan/distributed/{util,ulysses,sequence_parallel}.py``, ``wan/modules/s2v/model_s2v.py``):
  * ``get_rank``, ``get_world_size``, ``all_to_all`` and ``gather_forward`` use the default (WORLD)
    group and are imported by name into ``wan.distributed.ulysses``, ``.sequence_parallel`` and
    ``wan.modules.s2v.model_s2v``: Ulysses can only span every rank.
  * ``distributed_attention`` (imported by name into ``model_s2v``, called by
    ``sp_attn_forward_s2v``) trades the sequence for the heads with ``all_to_all``, which splits
    the heads with ``x.chunk(world)`` and receives into ``torch.empty_like`` of what it sends: the
    degree must divide the head count (40 for the 14B model) and every rank's token chunk must be
    the same length.
  * ``WanModel_S2V.forward`` splits the sequence with ``torch.chunk(x, world, dim=1)``, no padding:
    a token count the degree does not divide gives a shorter last chunk, and the all-to-all aborts
    inside gloo/NCCL ("Received data size doesn't match expected size"). So upstream runs on 1, 2,
    4 or 8 GPUs (5 for some sizes), never on 3, 6 or 7.

Change:
  1. Every SP helper is bound to the SP group (one ``DeviceMesh`` dimension; the world without
     ``--cfg-parallel``, one CFG branch with it): rank and size within the group, all-gather over it.
  2. ``distributed_attention`` splits the heads as evenly as possible (``layout.split_evenly``:
     40 heads on 3 ranks = 14/13/13) and moves them with ``all_to_all_single`` and per-rank split
     sizes. After the exchange a rank holds all tokens of its heads; the padding tokens (below) are
     cut off before the attention kernel, so it sees exactly the keys and queries one process
     sees (``k_lens`` = the real length, no mask needed), and their output rows come back as
     zeros.
  3. ``inject_motion`` (the call that returns the full sequence: noisy + reference + motion
     tokens) pads the sequence, its RoPE table and its token-type mask at the end to a multiple of
     the degree, so ``torch.chunk`` gives every rank the same ``ceil(L / degree)`` tokens.
     ``seq_lens`` keeps the real length (the attention uses it); the padded length is recorded
     for ``patches.local_audio`` (its chunk arithmetic). Padding rows sit past
     ``original_seq_len``: no audio is injected into them, and ``forward`` drops everything past
     ``original_seq_len`` after the final gather, so they never reach the output.
Per-token ops (norms, projections, FFN, text cross-attention) are row-wise, so padding rows do not
touch real rows; the self-attention is per head over the real tokens, as in one process.

Exactness (fp32, CPU): frames equal to one process bit for bit (3 ranks with 4 heads = 2/1/1 and a
64- and 88-token sequence padded to 66 and 90; CFG 2 x SP 3 at 6 ranks). The only arithmetic that
changes is a GEMM's row count (each rank's token chunk), as in upstream's own even split.

Proof: tests/test_any_degree.py (gloo ranks vs one process); the even-degree parity tests run
through this patch too (tests/test_parity.py, tests/test_generation.py).
"""
from __future__ import annotations

import functools
import importlib

import torch
import torch.distributed as dist

from patches.local_audio import SEQ_LEN_ATTR
from wan_s2v_runner.shared.layout import padded_length, split_evenly

_MARK = "_wan_s2v_ulysses_sp"
_HELPER_MODULES = ("wan.distributed.util", "wan.distributed.ulysses", "wan.distributed.sequence_parallel",
                   "wan.modules.s2v.model_s2v")


# --------------------------------------------------------------------------- the exchanges
def seq_to_heads(x: torch.Tensor, group, head_sizes: list[int]) -> torch.Tensor:
    """[B, s, H, d] (this rank's tokens, all heads) -> [B, world * s, h_me, d] (every rank's
    tokens in rank order, this rank's heads). Rank j receives the heads ``head_sizes[j]``."""
    world, me = len(head_sizes), dist.get_rank(group)
    b, s, _, d = x.shape
    send = x.permute(2, 0, 1, 3).contiguous()  # [H, B, s, d]: rank j's heads are consecutive rows
    recv = x.new_empty(world * head_sizes[me], b, s, d)
    dist.all_to_all_single(recv, send, [head_sizes[me]] * world, list(head_sizes), group=group)
    return recv.view(world, head_sizes[me], b, s, d).permute(2, 0, 3, 1, 4).reshape(
        b, world * s, head_sizes[me], d)


def heads_to_seq(x: torch.Tensor, group, head_sizes: list[int]) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: [B, world * s, h_me, d] -> [B, s, H, d]."""
    world = len(head_sizes)
    b, full, h_me, d = x.shape
    s = full // world
    send = x.reshape(b, world, s, h_me, d).transpose(0, 1).contiguous()  # [world, B, s, h_me, d]
    recv = x.new_empty(b * s * sum(head_sizes) * d)
    dist.all_to_all_single(recv, send.view(-1), [b * s * h * d for h in head_sizes],
                           [b * s * h_me * d] * world, group=group)
    parts = recv.split([b * s * h * d for h in head_sizes])
    return torch.cat([p.view(b, s, h, d) for p, h in zip(parts, head_sizes)], dim=2)


def helpers(group, ulysses_module) -> dict:
    """The engine's SP helpers bound to ``group``, and a ``distributed_attention`` for any degree.
    ``ulysses_module``: where the attention kernel is looked up at call time
    (``patches.attention`` rebinds ``flash_attention`` there)."""

    def get_rank():
        return dist.get_rank(group)

    def get_world_size():
        return dist.get_world_size(group)

    def all_to_all(x, scatter_dim, gather_dim, group=group, **kwargs):
        """Upstream's even all-to-all over the group (no S2V caller once distributed_attention
        is ours; bound so nothing reaches the WORLD group by this name)."""
        world = dist.get_world_size(group)
        if world > 1:
            inputs = [u.contiguous() for u in x.chunk(world, dim=scatter_dim)]
            outputs = [torch.empty_like(u) for u in inputs]
            dist.all_to_all(outputs, inputs, group=group, **kwargs)
            x = torch.cat(outputs, dim=gather_dim).contiguous()
        return x

    def gather_forward(input, dim):
        world = dist.get_world_size(group)
        if world == 1:
            return input
        output = [torch.empty_like(input) for _ in range(world)]
        dist.all_gather(output, input.contiguous(), group=group)
        return torch.cat(output, dim=dim).contiguous()

    def distributed_attention(q, k, v, seq_lens, window_size=(-1, -1)):
        """Upstream's Ulysses attention with uneven head groups and the padding tokens cut off."""
        if k.shape[2] != q.shape[2]:  # S2V has none; an uneven split would cut GQA groups apart
            raise NotImplementedError(f"Ulysses over {q.shape[2]} query / {k.shape[2]} key-value heads "
                                      "(grouped-query attention) is not supported by patches.ulysses_sp")
        heads = split_evenly(q.shape[2], dist.get_world_size(group))
        q, k, v = (seq_to_heads(t, group, heads) for t in (q, k, v))
        full, real = q.shape[1], int(seq_lens.max())
        if real < full:  # the padding of inject_motion: not a key, not a query
            q, k, v = q[:, :real], k[:, :real], v[:, :real]
        x = ulysses_module.flash_attention(q, k, v, k_lens=seq_lens, window_size=window_size)
        if real < full:
            x = torch.cat([x, x.new_zeros(x.shape[0], full - real, *x.shape[2:])], dim=1)
        return heads_to_seq(x, group, heads)

    fns = {"get_rank": get_rank, "get_world_size": get_world_size, "all_to_all": all_to_all,
           "gather_forward": gather_forward, "distributed_attention": distributed_attention}
    for f in fns.values():
        setattr(f, _MARK, True)
    return fns


# --------------------------------------------------------------------------- the padding
def pad_sequence(x, rope, mask, degree: int):
    """x [1, L, C], rope [1, L, ...], mask [1, L] lists padded at the end to a multiple of
    ``degree`` (zeros, ones, token type 2). Returns (x, rope, mask, padded length)."""
    length = x[0].shape[1]
    pad = padded_length(length, degree) - length
    if pad:
        x = [torch.cat([u, u.new_zeros(u.shape[0], pad, *u.shape[2:])], dim=1) for u in x]
        rope = [torch.cat([u, u.new_ones(u.shape[0], pad, *u.shape[2:])], dim=1) for u in rope]
        mask = [torch.cat([u, u.new_full((u.shape[0], pad), 2)], dim=1) for u in mask]
    return x, rope, mask, length + pad


def _patch_inject_motion(model_s2v) -> bool:
    cls = model_s2v.WanModel_S2V
    if getattr(cls.inject_motion, _MARK, False):
        return False
    inner = cls.inject_motion

    @functools.wraps(inner)
    def inject_motion(self, *args, **kwargs):
        x, seq_lens, rope, mask = inner(self, *args, **kwargs)
        if self.use_context_parallel:
            x, rope, mask, length = pad_sequence(x, rope, mask, model_s2v.get_world_size())
            setattr(self, SEQ_LEN_ATTR, length)  # patches.local_audio chunks the padded sequence
        return x, seq_lens, rope, mask

    setattr(inject_motion, _MARK, True)
    cls.inject_motion = inject_motion
    return True


def apply(group) -> list[str]:
    """Bind the SP helpers to ``group`` in every engine module that imported them and pad the
    S2V sequence (class level, once per process). Returns the 'module.name's rebound."""
    ulysses = importlib.import_module("wan.distributed.ulysses")
    fns = helpers(group, ulysses)
    done = []
    for mod_name in _HELPER_MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in fns.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)
                done.append(f"{mod_name}.{name}")
    model_s2v = importlib.import_module("wan.modules.s2v.model_s2v")
    if _patch_inject_motion(model_s2v):
        done.append("wan.modules.s2v.model_s2v.WanModel_S2V.inject_motion")
    return done
