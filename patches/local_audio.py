"""Patch: under Ulysses SP, each rank injects the audio into its own tokens only (no all-gather).

Upstream (``wan/modules/s2v/model_s2v.py``, ``WanModel_S2V.after_transformer_block``): at every
audio-injection block, with ``use_context_parallel`` it ``gather_forward``-s the whole hidden
state (an all-gather of [B, L, C] per injection block: 20 of the 14B model's 40 blocks), runs the
audio cross-attention (adain / pre-norm, then ``audio_injector.injector[id]``, a cross attention
batched per latent frame: frame f's n = original_seq_len // num_frames tokens attend only to frame
f's audio tokens) over the whole sequence on every rank, then keeps its own
``torch.chunk(hidden_states, get_world_size(), dim=1)[get_rank()]``. Every rank does the whole
injection and receives the whole sequence, to use 1/world of it.

Change: every injection op is per token (LayerNorm / AdaLayerNorm, the q projection, RMSNorm,
attention per query row, the output projection) given its frame's audio (and adain) embedding.
So a rank computes the injection for its own chunk only: it takes the frames its chunk touches
(a chunk may start or end mid-frame), fills them in as *whole* frames with zeros for the tokens it
does not hold (so the batch layout per frame is upstream's: one batch item per frame, n queries),
runs the same modules on that [B * frames, n, C] batch with the same frames' audio embeddings,
and adds the residual of its own tokens only. Tokens at or past ``original_seq_len`` (reference
and motion tokens) get no injection, as upstream. No collective at all.

Chunk boundaries are those of ``forward`` (``torch.chunk(x, get_world_size(), dim=1)``, the
same rule as ``sq_start_size``), which needs the full sequence length L (noisy + reference +
motion tokens) that ``forward`` does not keep: the patched ``inject_motion`` (the call that
produces the full-length sequence) records it as ``self._wan_s2v_seq_len``. ``get_rank`` and
``get_world_size`` are looked up at call time from ``wan.modules.s2v.model_s2v``, so a patch that
rebinds them there (e.g. to a sub-group) is followed.

Applied on the class (``WanModel_S2V``), once per process, idempotent; it can run before the
model exists. An instance without ``use_context_parallel`` runs upstream's function unchanged
(one process, or SP off), and so does any call this patch cannot place (no recorded length, or a
local chunk whose length is not ``torch.chunk``'s for this rank): upstream's path then runs,
including its gather, so the result is still upstream's.

Exactness (fp32, CPU): bit-identical to upstream's full computation; see the test. The one
op whose bits depend on the number of rows is the adain embedding projection
(``AdaLayerNorm.linear``, a [frames, adain_dim] x [adain_dim, 2C] GEMM: BLAS takes another kernel
for a single row) — measured in tests/test_local_audio.py; so the adain embedding is computed
for all frames, as upstream, and the rows of this rank's frames are taken from it (frames x
adain_dim x 2C flops: nothing next to the injection itself). The per-token GEMMs (q, o: rows =
frames x n) were bit-stable under every row count measured. On GPU (bf16) cuBLAS may pick another
kernel for another row count, so there a run is as close to one process as upstream SP is, not
bitwise.

Proof: tests/test_local_audio.py — per-rank results concatenated == upstream's full result
(``torch.equal``, fp32) for 2 and 3 ranks, chunks that start mid-frame and chunks that hold
reference/motion tokens; ``gather_forward`` is not called.
"""
from __future__ import annotations

import functools

import torch
from einops import rearrange

_MARK = "__wan_s2v_patched__"
_ORIG = "__wan_s2v_original__"
SEQ_LEN_ATTR = "_wan_s2v_seq_len"


def chunk_span(seq_len: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``torch.chunk(x, world, dim=1)[rank]`` for x of length ``seq_len``
    (chunks of ceil(L / world), the last one shorter; ranks past the last chunk get (L, L))."""
    size = -(-seq_len // world)
    start = min(rank * size, seq_len)
    return start, min(start + size, seq_len)


def local_injection(model, audio_attn_id: int, hidden_states: torch.Tensor, start: int):
    """Upstream's audio injection for the tokens [start, start + hidden_states.shape[1]) of the
    full sequence, computed from those tokens only. Returns the new local hidden states."""
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

    frames = hidden_states.new_zeros(b, (f1 - f0) * n, c)
    frames[:, lo:hi] = hidden_states[:, :a1 - start]
    input_hidden_states = rearrange(frames, "b (t n) c -> (b t) n c", t=f1 - f0)

    injector = model.audio_injector
    if model.enbale_adain and model.adain_mode == "attn_norm":
        adain = injector.injector_adain_layers[audio_attn_id]
        if adain.emb is not None or adain.chunk_dim != 1:
            raise NotImplementedError("AdaLayerNorm with emb/chunk_dim != 1 (not Wan2.2-S2V's)")
        # AdaLayerNorm.forward, with its embedding projection over all frames (as upstream) and
        # this rank's frames taken from it: the GEMM's bits depend on its row count.
        audio_emb_global = rearrange(model.audio_emb_global, "b t n c -> (b t) n c")
        temb = adain.linear(adain.silu(audio_emb_global[:, 0]))
        temb = rearrange(temb, "(b t) d -> b t d", b=b)[:, f0:f1]
        temb = rearrange(temb, "b t d -> (b t) d")
        shift, scale = temb.chunk(2, dim=1)  # chunk_dim == 1 (AudioInjector_WAN)
        attn_hidden_states = adain.norm(input_hidden_states) * (1 + scale[:, None, :]) + shift[:, None, :]
    else:
        attn_hidden_states = injector.injector_pre_norm_feat[audio_attn_id](input_hidden_states)
    attn_audio_emb = rearrange(audio_emb[:, f0:f1], "b t n c -> (b t) n c")
    residual_out = injector.injector[audio_attn_id](
        x=attn_hidden_states,
        context=attn_audio_emb,
        context_lens=torch.ones(
            attn_hidden_states.shape[0], dtype=torch.long,
            device=attn_hidden_states.device) * attn_audio_emb.shape[1])
    residual_out = rearrange(residual_out, "(b t) n c -> b (t n) c", t=f1 - f0)

    out = hidden_states.clone()
    out[:, :a1 - start] = hidden_states[:, :a1 - start] + residual_out[:, lo:hi]
    return out


def _placement(model, hidden_states, model_s2v):
    """(audio_attn_id, start) for the local fast path, or None to run upstream's function."""
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
    return start


def apply(wan_module) -> bool:
    """Patch ``WanModel_S2V.after_transformer_block`` and ``inject_motion`` (class level).
    Returns False if already applied."""
    model_s2v = wan_module.modules.s2v.model_s2v
    cls = model_s2v.WanModel_S2V
    if getattr(cls.after_transformer_block, _MARK, False):
        return False
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
        start = _placement(self, hidden_states, model_s2v)
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
