"""The DiT as the live mode runs it: a sink pass over the condition tokens, then one forward per
block and denoising step against that step's key/value cache.

Built from the engine's own modules in upstream ``WanModel_S2V.forward``'s order (audio encoder,
patch and condition embeddings, RoPE from ``rope_precompute``, the condition mask embedding, the
time embedding with the zero timestep for the condition, the text embedding, every block's own
forward followed by the audio injection, the head, ``unpatchify``). What differs is LiveAvatar's
(``causal_model_s2v.py`` ``_forward_sink`` / ``_forward_inference``; :mod:`patches.live_kv` holds the
attention's half):

* :meth:`LiveDiT.sink`: the reference tokens (at temporal position 30) and the frame-packed motion
  tokens alone, each block's self-attention storing their keys before RoPE;
* :meth:`LiveDiT.block`: only the block's noisy tokens (3 latent frames at their absolute
  positions); the audio encoder sees the block's 12 audio frames (after upstream's 73 copies of
  the first); the condition keys get their RoPE for this forward (the reference at
  :func:`~wan_s2v_runner.shared.live_recipe.ref_position`, the motion tokens where the sink had them).

RoPE uses upstream's float64 rows (LiveAvatar rounds its tables to complex32; docs/live.md), made
for the positions a forward reads (:meth:`LiveDiT._rope`; a row depends on its position alone, so
they are upstream's table's rows at any position, its 1024 and past them).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from patches import fp16_compute, live_kv
from wan_s2v_runner.shared.live_recipe import BLOCK_LATENT_FRAMES, REF_BASE, ref_position


@dataclass
class Cond:
    """What the sink leaves for every block: the condition tokens' cached keys and values, and
    the motion tokens' RoPE (fixed)."""

    kv: live_kv.CondKV
    ref_grid: tuple[int, int]  # the reference's patch grid (h, w)
    ref_tokens: int
    motion_freqs: torch.Tensor  # [1, motion tokens, 1, c] complex


@contextlib.contextmanager
def _upstream_state(model, merged_audio_emb, audio_emb_global, original_seq_len: int):
    """Upstream's forward leaves the audio it injects and the noisy tokens' count on the model
    (``merged_audio_emb``, ``audio_emb_global``, ``original_seq_len``), where its
    ``after_transformer_block`` reads them: set here for one forward only, as they were after."""
    names = ("merged_audio_emb", "audio_emb_global", "original_seq_len")
    before = {n: getattr(model, n, None) for n in names}
    model.merged_audio_emb, model.original_seq_len = merged_audio_emb, original_seq_len
    if audio_emb_global is not None:
        model.audio_emb_global = audio_emb_global
    try:
        yield
    finally:
        for n, v in before.items():
            setattr(model, n, v)


def rope_rows(start: int, n: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Rows ``start .. start + n`` of upstream's ``rope_params(max_seq_len, dim, theta)`` table, its
    very expression (``wan.modules.model``): the same float64 products, so the same bits."""
    assert dim % 2 == 0
    freqs = torch.outer(torch.arange(start, start + n),
                        1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim)))
    return torch.polar(torch.ones_like(freqs), freqs)


class LiveDiT:
    """One loaded DiT (a plain module: resident, streamed or fp8), patched for the live mode.
    ``guard``: fp16's (:class:`patches.fp16_compute.Guard`; None in bf16/fp32), which the loop reads
    after each forward; ``dtype``: the compute dtype (the CPU's autocast for a half one)."""

    def __init__(self, model, guard: Optional[fp16_compute.Guard] = None, dtype: torch.dtype = torch.float32,
                 device_type: str = "cpu"):
        """``device_type``: the rank's (a half dtype on the CPU computes under the CPU's autocast, as the
        clip recipe's DiT forward does: ``patches.fp16_compute.cpu_autocast``)."""
        self.model, self.guard = model, guard
        self.attention = live_kv.apply(model)
        self._compute = lambda: fp16_compute.cpu_autocast(device_type, dtype)
        d = model.dim // model.num_heads
        self.heads, self.head_dim = model.num_heads, d
        #: the last block's noisy-token RoPE (key, table): a rank runs its steps of a block in a row
        self._noisy_freqs: tuple = (None, None)

    # ----- pieces of upstream's forward
    def _rope(self, tokens: int, f0: int, frames: int, h: int, w: int, device) -> torch.Tensor:
        """Upstream's ``rope_precompute`` for a grid of ``frames`` latent frames from temporal position
        ``f0`` (and ``h`` x ``w`` patches), from a table of only the rows it reads: the temporal
        columns' rows at positions ``f0 ..``, the spatial columns' at ``0 ..``. A row is a function of
        its position alone (``rope_params``: the position times each frequency, in float64), so these
        are bit for bit the rows of upstream's table, at any position: a session's video of any length
        holds a few rows, never a table as long as the video."""
        from wan.modules.s2v.s2v_utils import rope_precompute

        n, d = max(frames, h, w), self.head_dim
        table = torch.cat([rope_rows(f0, n, d - 4 * (d // 6)), rope_rows(0, n, 2 * (d // 6)),
                           rope_rows(0, n, 2 * (d // 6))], dim=1)
        shape = torch.empty(1, tokens, self.heads, d, device=device)
        return rope_precompute(shape, [self._grid(0, frames, h, w)], table, start=None)

    @staticmethod
    def _grid(f0: int, frames: int, h: int, w: int) -> list:
        return [torch.tensor([[f0, 0, 0]]), torch.tensor([[f0 + frames, h, w]]), torch.tensor([[frames, h, w]])]

    def _time(self, t: torch.Tensor, noisy_tokens: int):
        """Upstream's time embedding with ``zero_timestep``: (e for the head, [e0, seg index])."""
        from wan.modules.model import sinusoidal_embedding_1d

        m = self.model
        t = torch.cat([t, torch.zeros([1], dtype=t.dtype, device=t.device)])
        with torch.amp.autocast("cuda", dtype=torch.float32):
            e = m.time_embedding(sinusoidal_embedding_1d(m.freq_dim, t).float())
            e0 = m.time_projection(e).unflatten(1, (6, m.dim))
        e = e[:-1]
        zero_e0 = e0[-1:]
        e0 = e0[:-1]
        e0 = torch.cat([e0.unsqueeze(2), zero_e0.unsqueeze(2).repeat(e0.size(0), 1, 1, 1)], dim=2)
        return e, [e0, torch.tensor(noisy_tokens)]

    def context(self, context: list) -> torch.Tensor:
        """The text embedding of the prompt's T5 context (upstream's padding to ``text_len``)."""
        m = self.model
        with self._compute():
            return m.text_embedding(torch.stack([torch.cat([u, u.new_zeros(m.text_len - u.size(0), u.size(1))])
                                             for u in context]))

    def _blocks(self, x, e0, freqs, ctx, call: live_kv.Call, inject_audio: bool):
        m = self.model
        seq_lens = torch.tensor([x.shape[1]], dtype=torch.long)
        with self.attention.calling(call):
            for idx, block in enumerate(m.blocks):
                x = block(x, e=e0, seq_lens=seq_lens, grid_sizes=None, freqs=freqs, context=ctx, context_lens=None)
                if inject_audio:
                    x = m.after_transformer_block(idx, x)
        return x

    # ----- the two forwards
    def sink(self, ref_latents: torch.Tensor, motion_latents: torch.Tensor, ctx: torch.Tensor) -> Cond:
        """The condition tokens' pass: every layer's keys (before RoPE) and values kept."""
        with self._compute():
            return self._sink(ref_latents, motion_latents, ctx)

    def _sink(self, ref_latents: torch.Tensor, motion_latents: torch.Tensor, ctx: torch.Tensor) -> Cond:
        m = self.model
        ref = m.patch_embedding(ref_latents[0].unsqueeze(0))  # [1, C, 1, h, w]
        h, w = ref.shape[3], ref.shape[4]
        ref = ref.flatten(2).transpose(1, 2)
        ref_freqs = self._rope(ref.shape[1], REF_BASE, 1, h, w, ref.device)
        add_last_motion = m.add_last_motion * 2
        mot, mot_remb = m.process_motion_frame_pack(motion_latents, drop_motion_frames=False,
                                                    add_last_motion=add_last_motion)
        x = torch.cat([ref, mot[0]], dim=1)
        freqs = torch.cat([ref_freqs, mot_remb[0]], dim=1)
        mask = torch.cat([torch.ones([1, ref.shape[1]], dtype=torch.long, device=x.device),
                          2 * torch.ones([1, mot[0].shape[1]], dtype=torch.long, device=x.device)], dim=1)
        x = x + m.trainable_cond_mask(mask).to(x.dtype)
        _, e0 = self._time(torch.zeros([1], device=x.device), 0)
        kv = live_kv.CondKV(len(m.blocks))
        self._blocks(x, e0, freqs, ctx, live_kv.Call(kv), inject_audio=False)
        return Cond(kv, (h, w), ref.shape[1], mot_remb[0])

    def cond_freqs(self, cond: Cond, frame: int, distance: int, device) -> torch.Tensor:
        """The condition keys' RoPE for a block starting at latent ``frame``."""
        h, w = cond.ref_grid
        ref = self._rope(cond.ref_tokens, ref_position(frame, distance), 1, h, w, device)
        return torch.cat([ref, cond.motion_freqs.to(ref.device)], dim=1)

    def block(self, latents: torch.Tensor, t: torch.Tensor, step: live_kv.StepKV, block: int, distance: int,
              audio: torch.Tensor, cond_states: torch.Tensor, motion_frames: list, ctx: torch.Tensor,
              cond: Cond) -> torch.Tensor:
        """One denoising step's noise prediction for ``block`` (latents [16, 3, H/8, W/8]) at
        timestep ``t`` ([1]); writes the block's keys into ``step``. A non-finite output is flagged
        on the guard (fp16), whose blocks flagged theirs."""
        with self._compute():
            out = self._block(latents, t, step, block, distance, audio, cond_states, motion_frames, ctx, cond)
        if self.guard is not None:
            self.guard.flag(self.guard.blocks, out)
        return out

    def _block(self, latents, t, step, block, distance, audio, cond_states, motion_frames, ctx, cond):
        m = self.model
        audio_input = torch.cat([audio[..., 0:1].repeat(1, 1, 1, motion_frames[0]), audio], dim=-1)
        res = m.casual_audio_encoder(audio_input)
        audio_emb_global = None
        if m.enbale_adain:
            audio_emb_global, audio_emb = res
            audio_emb_global = audio_emb_global[:, motion_frames[1]:].clone()
        else:
            audio_emb = res
        x = m.patch_embedding(latents.unsqueeze(0)) + m.cond_encoder(cond_states.unsqueeze(0))
        grid = torch.tensor([x.shape[2:]], dtype=torch.long)
        f, h, w = (int(v) for v in x.shape[2:])
        x = x.flatten(2).transpose(1, 2)
        n = x.shape[1]
        frame = block * BLOCK_LATENT_FRAMES
        key = (frame, f, h, w, x.device)
        if self._noisy_freqs[0] != key:  # the same positions at every step of the block
            self._noisy_freqs = (key, self._rope(n, frame, f, h, w, x.device))
        freqs = self._noisy_freqs[1]
        x = x + m.trainable_cond_mask(torch.zeros([1, n], dtype=torch.long, device=x.device)).to(x.dtype)
        e, e0 = self._time(t, n)
        call = live_kv.Call(cond.kv, step, block, self.cond_freqs(cond, frame, distance, x.device))
        with _upstream_state(m, audio_emb[:, motion_frames[1]:, :], audio_emb_global, n):
            x = self._blocks(x, e0, freqs, ctx, call, inject_audio=True)
        x = m.head(x[:, :n], e)
        return m.unpatchify(x, grid)[0].float()
