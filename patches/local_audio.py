"""Patch: under Ulysses SP, each rank injects the audio into its own tokens only (no all-gather).

Upstream (``wan/modules/s2v/model_s2v.py``, ``WanModel_S2V.after_transformer_block``): at every
audio-injection block, with ``use_context_parallel`` it ``gather_forward``-s the whole hidden
state (an all-gather of [B, L, C] at each injection block: 12 of the 14B model's 40), runs the
audio cross-attention (adain / pre-norm, then ``audio_injector.injector[id]``, a cross attention
batched per latent frame: frame f's n = original_seq_len // num_frames tokens attend only to frame
f's audio tokens) over the whole sequence on every rank, then keeps its own
``torch.chunk(hidden_states, get_world_size(), dim=1)[get_rank()]``. Every rank does the whole
injection and receives the whole sequence, to use 1/world of it.

Change: every injection op is per token (LayerNorm / AdaLayerNorm, the q projection, RMSNorm,
attention per query row, the output projection) given its frame's audio (and adain) embedding.
So a rank computes the injection for its own chunk only: it takes the frames its chunk touches
(a chunk may start or end mid-frame), fills them in as *whole* frames with zeros for the tokens it
does not hold (so the batch layout is upstream's: one batch item per frame, n queries each), runs
the same modules on that [B * frames, n, C] batch with those frames' audio embeddings, and adds
the residual of its own tokens only. Tokens at or past ``original_seq_len`` (reference and motion
tokens) get no injection, as upstream. No collective at all.

Chunk boundaries are those of ``forward`` (``torch.chunk(x, get_world_size(), dim=1)``, the
rule behind ``sq_start_size``), which needs the full sequence length L (noisy + reference +
motion tokens) that ``forward`` does not keep: the patched ``inject_motion`` (the call that
returns the full-length sequence) records it as ``self._wan_s2v_seq_len``. ``get_rank`` and
``get_world_size`` are looked up at call time from ``wan.modules.s2v.model_s2v``, so a patch that
rebinds them there (e.g. to a sub-group) is followed.

Applied on the class (``WanModel_S2V``: ``after_transformer_block`` and ``inject_motion``), once
per process, idempotent (``remove`` undoes it); it can run before any model exists. An instance
without ``use_context_parallel`` runs upstream's function unchanged (one process, SP off), and so
does any call this patch was not written for (no recorded length; a local chunk whose length is
not ``torch.chunk``'s for this rank; original_seq_len not a multiple of the frame count; an
AdaLayerNorm / cross-attention class whose forward is not upstream's): upstream's path then runs,
gather included, so the result is upstream's.

Exactness (fp32, CPU): bit-identical to one process. Measured (MKL sgemm, torch 2.13 CPU): a GEMM
row's bits depend on the GEMM's row count when that count is small (1-3 rows on 1 thread; rows
not a multiple of 4 below 12 on 2 threads; 17-19 and 25-27 on 16 threads), so two projections
with few rows differ by 1-2 ulp (max |diff| 2.4e-7 at the block output) if computed on a chunk's
frames only: the adain embedding projection (``AdaLayerNorm.linear``: one row per frame) and the
audio k/v projections (one row per audio token: 5 per frame). Both are therefore computed over
all frames, exactly as upstream, and this chunk's frames are taken from them (they are tiny: a few
rows per frame). What runs on the chunk's frames only are the per-token ops on whole frames (n rows
per frame; q and o GEMMs were bit-stable for every multiple of n >= 16 rows on 1-16 threads, and
the attention is per frame). On GPU (bf16) cuBLAS may choose another kernel for another row count,
so there the result is as close to one process as upstream SP is, not guaranteed bitwise.

Proof: tests/test_local_audio.py (tiny DiT, CPU, fp32, no process group) — the ranks' outputs
concatenated == upstream's one-process output (``torch.equal``) for 2, 3, 4 and 9 ranks (chunks
that start/end mid-frame, shorter than a frame, holding reference/motion tokens), adain and
pre-norm paths, batch 1 and 2, 1 and 2 torch threads; each rank's output == upstream's own SP
path's; ``gather_forward`` is called 0 times (upstream's SP path: once per rank and block). The
same test fails (2.4e-7) if the adain or k/v projections run on the chunk's frames only.
"""
from __future__ import annotations

import functools

import torch
from einops import rearrange

from patches.patch import Patch

_MARK = "__wan_s2v_patched__"
_ORIG = "__wan_s2v_original__"
SEQ_LEN_ATTR = "_wan_s2v_seq_len"


def chunk_span(seq_len: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``torch.chunk(x, world, dim=1)[rank]`` for x of length ``seq_len``
    (chunks of ceil(L / world), the last one shorter; ranks past the last chunk get (L, L))."""
    size = -(-seq_len // world)
    start = min(rank * size, seq_len)
    return start, min(start + size, seq_len)


def _per_frame(t: torch.Tensor, b: int, f0: int, f1: int) -> torch.Tensor:
    """Rows (b t) ... of ``t`` -> the rows of frames [f0, f1) of every item, (b t') ..."""
    t = t.reshape(b, -1, *t.shape[1:])[:, f0:f1]
    return t.reshape(-1, *t.shape[2:])


def local_injection(model, audio_attn_id: int, hidden_states: torch.Tensor, start: int):
    """Upstream's audio injection for the tokens [start, start + hidden_states.shape[1]) of the
    full sequence, computed from those tokens only. Returns the new local hidden states.

    Row-count-sensitive GEMMs are kept at upstream's row count: the adain embedding projection
    and the audio k/v projections run over all frames (a few rows each) and this chunk's frames
    are taken from them; only the per-token ops (norms, q, attention, o) run on the chunk's
    frames, in upstream's per-frame batch layout."""
    audio_emb = model.merged_audio_emb  # b f n_audio c
    num_frames = audio_emb.shape[1]
    orig = int(model.original_seq_len)
    n = orig // num_frames
    local = hidden_states.shape[1]
    a1 = min(start + local, orig)  # audio tokens of this chunk: [start, a1)
    if a1 <= start:
        return hidden_states
    f0, f1 = start // n, -(-a1 // n)  # frames the chunk touches
    lo, hi = start - f0 * n, a1 - f0 * n  # the chunk's tokens inside those frames
    b, c = hidden_states.shape[0], hidden_states.shape[2]

    if lo == 0 and hi == (f1 - f0) * n:
        frames = hidden_states[:, :a1 - start]
    else:  # partial first/last frame: whole frames, zeros for the tokens other ranks hold
        frames = hidden_states.new_zeros(b, (f1 - f0) * n, c)
        frames[:, lo:hi] = hidden_states[:, :a1 - start]
    input_hidden_states = rearrange(frames, "b (t n) c -> (b t) n c", t=f1 - f0)

    injector = model.audio_injector
    if model.enbale_adain and model.adain_mode == "attn_norm":
        adain = injector.injector_adain_layers[audio_attn_id]
        # AdaLayerNorm.forward (chunk_dim=1), its embedding projection over all frames.
        audio_emb_global = rearrange(model.audio_emb_global, "b t n c -> (b t) n c")
        temb = _per_frame(adain.linear(adain.silu(audio_emb_global[:, 0])), b, f0, f1)
        shift, scale = temb.chunk(2, dim=1)
        attn_hidden_states = adain.norm(input_hidden_states) * (1 + scale[:, None, :]) + shift[:, None, :]
    else:
        attn_hidden_states = injector.injector_pre_norm_feat[audio_attn_id](input_hidden_states)

    # WanCrossAttention.forward, k/v projected over all frames' audio tokens.
    attn = injector.injector[audio_attn_id]
    context = rearrange(audio_emb, "b t n c -> (b t) n c", t=num_frames)
    bt, heads, d = attn_hidden_states.shape[0], attn.num_heads, attn.head_dim
    q = attn.norm_q(attn.q(attn_hidden_states)).view(bt, -1, heads, d)
    k = _per_frame(attn.norm_k(attn.k(context)), b, f0, f1).view(bt, -1, heads, d)
    v = _per_frame(attn.v(context), b, f0, f1).view(bt, -1, heads, d)
    context_lens = torch.ones(bt, dtype=torch.long, device=q.device) * context.shape[1]
    flash_attention = type(attn).forward.__globals__["flash_attention"]  # as upstream resolves it
    residual_out = attn.o(flash_attention(q, k, v, k_lens=context_lens).flatten(2))
    residual_out = rearrange(residual_out, "(b t) n c -> b (t n) c", t=f1 - f0)

    out = hidden_states.clone()
    out[:, :a1 - start] = hidden_states[:, :a1 - start] + residual_out[:, lo:hi]
    return out


def _placement(model, hidden_states, model_s2v, adaln_forward, cross_forward):
    """The global index of this rank's first token for the local path, or None to run
    upstream's function (anything this patch was not written for)."""
    seq_len = getattr(model, SEQ_LEN_ATTR, None)
    if seq_len is None:
        return None
    world, rank = model_s2v.get_world_size(), model_s2v.get_rank()
    start, end = chunk_span(int(seq_len), world, rank)
    if end - start != hidden_states.shape[1] or end <= start:
        return None
    orig, num_frames = int(model.original_seq_len), model.merged_audio_emb.shape[1]
    if num_frames == 0 or orig % num_frames:
        return None  # upstream's rearrange raises; let it
    injector = model.audio_injector
    if model.enbale_adain and model.adain_mode == "attn_norm":
        if not all(type(a).forward is adaln_forward and a.emb is None and a.chunk_dim == 1
                   for a in injector.injector_adain_layers):
            return None
    if any(type(a).forward is not cross_forward for a in injector.injector):
        return None
    return start


def apply(wan_module) -> bool:
    """Patch ``WanModel_S2V.after_transformer_block`` and ``inject_motion`` (class level).
    Returns False if already applied."""
    model_s2v = wan_module.modules.s2v.model_s2v
    cls = model_s2v.WanModel_S2V
    if getattr(cls.after_transformer_block, _MARK, False):
        return False
    # the upstream forwards that local_injection re-implements
    adaln_forward = wan_module.modules.s2v.audio_utils.AdaLayerNorm.forward
    cross_forward = wan_module.modules.model.WanCrossAttention.forward
    upstream_after = cls.after_transformer_block
    upstream_inject = cls.inject_motion

    @functools.wraps(upstream_inject)
    def inject_motion(self, *args, **kwargs):
        out = upstream_inject(self, *args, **kwargs)
        setattr(self, SEQ_LEN_ATTR, int(out[0][0].shape[1]))  # x: list of [1, L, C]
        return out

    @functools.wraps(upstream_after)
    def after_transformer_block(self, block_idx, hidden_states):
        if not self.use_context_parallel or block_idx not in self.audio_injector.injected_block_id:
            return upstream_after(self, block_idx, hidden_states)
        start = _placement(self, hidden_states, model_s2v, adaln_forward, cross_forward)
        if start is None:
            return upstream_after(self, block_idx, hidden_states)
        return local_injection(self, self.audio_injector.injected_block_id[block_idx],
                               hidden_states, start)

    for fn, orig in ((inject_motion, upstream_inject), (after_transformer_block, upstream_after)):
        setattr(fn, _MARK, True)
        setattr(fn, _ORIG, orig)
    cls.inject_motion = inject_motion
    cls.after_transformer_block = after_transformer_block
    return True


def remove(wan_module) -> bool:
    """Undo :func:`apply` (restore upstream's two methods). Returns False if it was not applied."""
    cls = wan_module.modules.s2v.model_s2v.WanModel_S2V
    if not getattr(cls.after_transformer_block, _MARK, False):
        return False
    for name in ("after_transformer_block", "inject_motion"):
        setattr(cls, name, getattr(getattr(cls, name), _ORIG))
    return True


def _for_run(wan_module, ctx) -> str:
    apply(wan_module)
    return "audio injection on each rank's own tokens (no all-gather)"


PATCH = Patch("local_audio", applies=lambda ctx: ctx.spec.layout.use_sp, apply=_for_run, restore=remove)
