"""The live mode's reference: every block recomputed from scratch at a step, with no cache.

For blocks 0..g at one denoising step (each at its latents of that step), one forward of the whole
token sequence through upstream's blocks, whose self-attention applies the **block-causal window
mask** (a block's queries see its own and the previous ``WINDOW_BLOCKS - 1`` blocks' keys, and the
condition keys with the RoPE of its own reference position). Nothing is carried from an earlier
call: every key is recomputed from the latents, layer by layer (the audio injection, which has no
term across frames, block by block: :func:`_inject`). The mask is applied by handing each
query block the keys its mask row allows, in sequence order (what a masked kernel computes; a
-inf additive mask changes only how the kernel blocks its sums, so it is checked against this to
1e-6 apart). The condition's keys come from a sink pass run here again.

tests/test_live.py: the live loop's noise prediction of every block at every step equals this
reference's, exactly (CPU, fp32).
"""
from __future__ import annotations

import types

import torch

from wan_s2v_runner.shared.live_recipe import BLOCK_LATENT_FRAMES, window


def _attention(cond_kv, cond_freqs: list, tokens: int, masked_kernel: bool):
    """A self-attention forward over every block's tokens with the window mask."""
    import wan.modules.s2v.model_s2v as m

    def forward(self, x, seq_lens, grid_sizes, freqs):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)
        layer = self._ref_layer
        rq, rk = m.rope_apply(q, grid_sizes, freqs), m.rope_apply(k, grid_sizes, freqs)
        blocks = s // tokens
        outs = []
        for j in range(blocks):
            ck = m.rope_apply(cond_kv.k[layer], None, cond_freqs[j]).type_as(rk)
            qj = rq[:, j * tokens:(j + 1) * tokens]
            if masked_kernel:  # every key of the sequence (all blocks, every block's condition copy), masked
                keys = torch.cat([rk, *[m.rope_apply(cond_kv.k[layer], None, f).type_as(rk) for f in cond_freqs]], 1)
                vals = torch.cat([v, *[cond_kv.v[layer]] * len(cond_freqs)], 1)
                allow = torch.zeros(keys.shape[1], dtype=torch.bool)
                for b_ in window(j):
                    allow[b_ * tokens:(b_ + 1) * tokens] = True
                c = cond_kv.k[layer].shape[1]
                allow[s + j * c:s + (j + 1) * c] = True
                o = torch.nn.functional.scaled_dot_product_attention(
                    qj.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                    attn_mask=allow[None, None, None, :]).transpose(1, 2)
            else:
                sel = [rk[:, b_ * tokens:(b_ + 1) * tokens] for b_ in window(j)]
                selv = [v[:, b_ * tokens:(b_ + 1) * tokens] for b_ in window(j)]
                o = m.flash_attention(q=qj, k=torch.cat([torch.cat(sel, 1), ck], 1),
                                      v=torch.cat([torch.cat(selv, 1), cond_kv.v[layer]], 1), k_lens=None,
                                      window_size=self.window_size)
            outs.append(o)
        return self.o(torch.cat(outs, 1).flatten(2))
    return forward


def _inject(m, idx: int, x, emb, glob):
    """Upstream's audio injection after block ``idx`` on one block's tokens: it has no term across
    frames, and is run per block because its AdaLN's Linear over the frames' rows rounds
    differently with another row count (a CPU GEMM picks its kernel by the row count)."""
    m.merged_audio_emb, m.audio_emb_global, m.original_seq_len = emb, glob, x.shape[1]
    return m.after_transformer_block(idx, x.clone())


def upstream_rope(dit, tokens: int, f0: int, frames: int, h: int, w: int, positions: int = 1024) -> torch.Tensor:
    """Upstream's RoPE for a grid, from upstream's whole table (``rope_params`` over ``positions``):
    what the live DiT's rows-only tables (``LiveDiT._rope``) must equal."""
    from wan.modules.model import rope_params
    from wan.modules.s2v.s2v_utils import rope_precompute

    from wan_s2v_runner.rank.live_dit import LiveDiT

    d = dit.head_dim
    table = torch.cat([rope_params(positions, d - 4 * (d // 6)), rope_params(positions, 2 * (d // 6)),
                       rope_params(positions, 2 * (d // 6))], dim=1)
    return rope_precompute(torch.empty(1, tokens, dit.heads, d), [LiveDiT._grid(f0, frames, h, w)], table, start=None)


def recompute(dit, ctx, ref_latents, motion_latents, latents: list, t, distances: list, audios: list,
              cond_states, motion_frames, masked_kernel: bool = False) -> list:
    """Noise predictions of blocks 0..len(latents)-1 at timestep ``t``, all recomputed (see the
    module docstring). ``dit``: a :class:`~wan_s2v_runner.rank.live_dit.LiveDiT` (its model and embeddings; the RoPE
    upstream's whole table's: :func:`upstream_rope`; none of its caches)."""
    m = dit.model
    cond = dit.sink(ref_latents, motion_latents, ctx)  # the condition's keys, recomputed
    g = len(latents)
    # each block's audio as the live recipe gives it (its 12 frames, 73 copies of the first before)
    embs, globs = [], []
    for a in audios:
        res = m.casual_audio_encoder(torch.cat([a[..., 0:1].repeat(1, 1, 1, motion_frames[0]), a], dim=-1))
        gl, emb = res if m.enbale_adain else (None, res)
        embs.append(emb[:, motion_frames[1]:])
        globs.append(gl[:, motion_frames[1]:] if gl is not None else None)
    xs = [m.patch_embedding(lat.unsqueeze(0)) + m.cond_encoder(cond_states.unsqueeze(0)) for lat in latents]
    f, h, w = (int(v) for v in xs[0].shape[2:])
    tokens = f * h * w
    x = torch.cat([u.flatten(2).transpose(1, 2) for u in xs], 1)
    n = x.shape[1]
    freqs = upstream_rope(dit, n, 0, g * f, h, w)
    x = x + m.trainable_cond_mask(torch.zeros([1, n], dtype=torch.long)).to(x.dtype)
    e, e0 = dit._time(t, n)
    cond_freqs = [dit.cond_freqs(cond, j * BLOCK_LATENT_FRAMES, distances[j], x.device) for j in range(g)]
    saved = []
    for i, block in enumerate(m.blocks):
        a = block.self_attn
        saved.append(a.forward)
        a._ref_layer = i
        a.forward = types.MethodType(_attention(cond.kv, cond_freqs, tokens, masked_kernel), a)
    try:
        seq_lens = torch.tensor([n], dtype=torch.long)
        for idx, block in enumerate(m.blocks):
            x = block(x, e=e0, seq_lens=seq_lens, grid_sizes=None, freqs=freqs, context=ctx, context_lens=None)
            x = torch.cat([_inject(m, idx, x[:, j * tokens:(j + 1) * tokens], embs[j], globs[j]) for j in range(g)], 1)
    finally:
        for a, fw in zip((b.self_attn for b in m.blocks), saved):
            a.forward = fw
    x = m.head(x[:, :n], e)
    out = m.unpatchify(x, torch.tensor([[g * f, h, w]]))[0].float()
    return [out[:, j * f:(j + 1) * f] for j in range(g)]
