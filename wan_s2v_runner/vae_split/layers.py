"""The layer walk of the split VAE: :class:`BandVAE` runs the engine's ``WanVAE_.encode`` /
``decode`` (Encoder3d/Decoder3d and the blocks under them) over one rank's band, with the
engine's own modules, weights and temporal-cache bookkeeping; each conv through
:func:`~.convs.conv_rows` with the halo rows it reads (:class:`~.halo.Rows`), chunks in groups
(:data:`GROUP_BYTES`).
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .convs import conv_rows
from .halo import Rows

#: chunks (1 + 4k frames on encode, a latent frame on decode) go through each layer together, as
#: many as keep the group's estimated activations within this (``BandVAE._groups``): fewer halo
#: exchanges for small frames. A real VAE's chunk is far bigger on its own (96 channels x 4 frames
#: x a band of 704x1024: ~550 MB a tensor), so real sizes go one chunk at a time, as before.
GROUP_BYTES = 256 << 20
#: live full-resolution tensors a chunk holds in a layer, for that estimate (measured on the compute
#: preset: all 21 latent frames of a decode at once added ~0.8 GB per rank, ~8 of 2 MiB each a chunk)
_LIVE_TENSORS = 8


class BandVAE:
    """``WanVAE_.encode``/``decode`` (and the Encoder3d/Decoder3d/block forwards under them),
    over one rank's band, with the engine's modules and cache bookkeeping.

    The engine runs its chunks (1 + 4k frames on encode, one latent frame on decode) one after
    the other through every layer. Here a group of consecutive chunks goes through each layer
    before the next layer (``_groups``, ``GROUP_BYTES``): a layer's halo exchange carries the rows of every
    chunk of the group in one message, so a group of G chunks makes G times fewer exchanges, each
    of them one point where both ranks wait for the slower. The arithmetic is the engine's: every
    conv runs per chunk, on the same input as in the engine's order, and a conv's temporal cache
    still passes from chunk to chunk in order (chunk c at a layer reads what chunk c - 1 left at
    that layer, and nothing at a layer reads a later layer). Layer methods take and return the
    group's list of chunk tensors."""

    def __init__(self, model: nn.Module, rows: Rows):
        self.model = model
        self.rows = rows
        self.eng = sys.modules[type(model).__module__]  # wan.modules.vae2_1, wherever it lives
        #: layers that compute each pixel from that pixel alone
        self._pixelwise = (self.eng.RMS_norm, nn.SiLU, nn.Dropout, nn.Identity)

    # ----- convolutions
    def conv(self, conv: nn.Module, x: torch.Tensor, cache=None) -> torch.Tensor:
        """``CausalConv3d.forward(x, cache)`` on the band: H padding replaced by halo rows."""
        halo = conv._padding[2]
        full = self.rows.full_rows(x) + 2 * halo
        x = self.rows.halo(x, halo, halo)
        return self._causal(conv, x, cache, full)

    def _causal(self, conv, x, cache, full_rows: int) -> torch.Tensor:
        padding = list(conv._padding)
        padding[2] = padding[3] = 0  # rows: already in x
        if cache is not None and conv._padding[4] > 0:
            x = torch.cat([cache.to(x.device), x], dim=2)
            padding[4] -= cache.shape[2]
        return conv_rows(conv, F.pad(x, padding), full_rows)

    def _tail(self, x: torch.Tensor, old) -> torch.Tensor:
        """The engine's ``cache_x``: the last ``CACHE_T`` frames of a conv's input, with the
        previous cache's last frame in front when the chunk has one frame."""
        cache_x = x[:, :, -self.eng.CACHE_T:].clone()
        if cache_x.shape[2] < 2 and old is not None:
            cache_x = torch.cat([old[:, :, -1].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
        return cache_x

    def _cached_one(self, conv, x, feat_cache, idx: int, extra: int) -> torch.Tensor:
        """One chunk through the CausalConv3d at cache slot ``idx``; ``x`` holds ``extra`` (at
        least the conv's halo) rows beyond its band on each side, and the output keeps
        ``extra - halo``. The cache keeps the halo rows too, so the next chunk's conv has its rows
        without another exchange."""
        halo = conv._padding[2]
        assert extra >= halo, (extra, halo)
        full = self.rows.full_rows(x, extra) + 2 * halo
        if extra:
            x = self.rows.zero_outside(x, extra)
        cache_x = self._tail(x, feat_cache[idx])
        x = self._causal(conv, x, feat_cache[idx], full)
        feat_cache[idx] = cache_x
        return x

    def cached_conv(self, conv, xs, feat_cache, feat_idx, extra: int = 0) -> list[torch.Tensor]:
        """The engine's ``cache_x`` bookkeeping around a CausalConv3d, for the group ``xs``.
        ``extra``: rows the chunks already hold beyond their band on each side (an earlier,
        deeper exchange); the conv reads its halo from them, and its output keeps
        ``extra - halo``."""
        halo = conv._padding[2]
        idx = feat_idx[0]
        feat_idx[0] += 1
        if extra or not halo:
            return [self._cached_one(conv, x, feat_cache, idx, extra) for x in xs]
        pending = self.rows.start_halo(xs, halo, halo)
        if xs[0].shape[-2] > 2 * halo:  # the rows that need no halo while it travels
            return self._overlapped_conv(conv, xs, pending, [], feat_cache, idx, halo)
        return [self._cached_one(conv, torch.cat(top + [x] + bottom, dim=-2), feat_cache, idx, halo)
                for x, (top, bottom) in zip(xs, pending.wait())]

    # ----- blocks
    def layer(self, m: nn.Module, xs, feat_cache, feat_idx) -> list[torch.Tensor]:
        e = self.eng
        if isinstance(m, e.ResidualBlock):
            return self.residual(m, xs, feat_cache, feat_idx)
        if isinstance(m, e.Resample):
            return self.resample(m, xs, feat_cache, feat_idx)
        if isinstance(m, e.AttentionBlock):
            return self.attention(m, xs)
        if isinstance(m, e.CausalConv3d):
            return self.cached_conv(m, xs, feat_cache, feat_idx)
        if isinstance(m, self._pixelwise):
            return [m(x) for x in xs]
        raise NotImplementedError(f"split VAE: no band forward for {type(m).__name__}")

    def residual(self, block, xs, feat_cache, feat_idx) -> list[torch.Tensor]:
        layers = list(block.residual)
        convs = [m for m in layers if isinstance(m, self.eng.CausalConv3d)]
        depth = sum(c._padding[2] for c in convs)
        if not depth or self.rows.min_band(xs[0]) < depth:  # a halo per conv
            hs = [self._shortcut(block, x) for x in xs]
            for m in layers:
                xs = self.layer(m, xs, feat_cache, feat_idx)
            return [x + h for x, h in zip(xs, hs)]
        # One exchange for the block: ``depth`` rows each side (2: its two 3x3 convs), the
        # first conv computing the neighbours' row next to the band as well (the same
        # arithmetic as theirs: conv_rows), the second reading it. Norms/SiLU are per pixel.
        # The exchange runs while the shortcut, the layers before the first conv and that
        # conv's rows that need no halo are computed (``_overlapped_conv``).
        first = layers.index(convs[0])
        pending = self.rows.start_halo(xs, depth, depth)
        hs = [self._shortcut(block, x) for x in xs]
        before = layers[:first]
        assert all(isinstance(m, self._pixelwise) for m in before), before
        ys = [self._per_pixel(before, x) for x in xs]
        idx = feat_idx[0]
        feat_idx[0] += 1
        if xs[0].shape[-2] > 2 * convs[0]._padding[2]:  # rows that need no halo (as in cached_conv)
            ys = self._overlapped_conv(convs[0], ys, pending, before, feat_cache, idx, depth)
        else:  # too thin for rows without a halo
            ys = [self._cached_one(convs[0], torch.cat([self._per_pixel(before, t) for t in top] + [y] +
                                                       [self._per_pixel(before, t) for t in bottom], dim=-2),
                                   feat_cache, idx, depth)
                  for y, (top, bottom) in zip(ys, pending.wait())]
        extra = depth - convs[0]._padding[2]
        for m in layers[first + 1:]:
            if isinstance(m, self.eng.CausalConv3d):
                ys = self.cached_conv(m, ys, feat_cache, feat_idx, extra)
                extra -= m._padding[2]
            else:
                ys = self.layer(m, ys, feat_cache, feat_idx)
        assert extra == 0, extra
        return [y + h for y, h in zip(ys, hs)]

    def _shortcut(self, block, x) -> torch.Tensor:
        return self.conv(block.shortcut, x) if isinstance(block.shortcut, self.eng.CausalConv3d) \
            else block.shortcut(x)

    @staticmethod
    def _per_pixel(layers, x) -> torch.Tensor:
        for m in layers:
            x = m(x)
        return x

    def _overlapped_conv(self, conv, xs, pending, before, feat_cache, idx: int, extra: int) -> list[torch.Tensor]:
        """``_cached_one(conv, halo rows + x, ..., extra)`` for each chunk of the group, with the
        halo still on its way: the output rows that read only the chunk's own rows first, for
        every chunk, then (halo received, put through the per-pixel layers ``before``) the
        ``extra`` rows at each end. Every piece is ``conv_rows`` of the whole frame's kernel, and
        a conv output row's bits do not depend on which rows are computed with it (module
        docstring), so the rows are those of one call. A chunk's rows that read no halo read
        only the band rows of the previous chunk's cache, so they need no halo of that chunk
        either. The cache keeps the whole input, halo rows included, like ``_cached_one``."""
        k = conv._padding[2]
        rows = xs[0].shape[-2]
        full = self.rows.full_rows(xs[0]) + 2 * k
        old = feat_cache[idx]  # rows -extra .. rows + extra - 1 of the previous chunk's input
        band_old = None if old is None else old.narrow(-2, extra, rows)
        middles = []  # rows k .. rows - k - 1 of each chunk's output
        for x in xs:
            middles.append(self._causal(conv, x, band_old, full))
            band_old = self._tail(x, band_old)  # the band rows of the cache the next chunk reads
        out = []
        for x, middle, (top, bottom) in zip(xs, middles, pending.wait()):
            def cached(a, b):  # the cache's rows a .. b - 1 (band row numbers), or None
                return None if old is None else old.narrow(-2, a + extra, b - a)  # noqa: B023

            top, bottom = self._per_pixel(before, top[0]), self._per_pixel(before, bottom[0])
            if self.rows.rank == 0:  # the engine's zero padding of the conv input at the frame's edges
                top.zero_()
            if self.rows.rank == self.rows.world - 1:
                bottom.zero_()
            first = self._causal(conv, torch.cat([top, x.narrow(-2, 0, 2 * k)], dim=-2),
                                 cached(-extra, 2 * k), full)
            last = self._causal(conv, torch.cat([x.narrow(-2, rows - 2 * k, 2 * k), bottom], dim=-2),
                                cached(rows - 2 * k, rows + extra), full)
            out.append(torch.cat([first, middle, last], dim=-2))
            old = self._tail(torch.cat([t[:, :, -self.eng.CACHE_T:] for t in (top, x, bottom)], dim=-2), old)
        feat_cache[idx] = old
        return out

    def attention(self, block, xs) -> list[torch.Tensor]:
        """The whole frames are gathered (every chunk of the group in one gather); each rank runs
        the engine's block per chunk and keeps its rows."""
        f = self.rows.factor(xs[0])
        whole = self.rows.gather_all(torch.cat(xs, dim=2)).split([x.shape[2] for x in xs], dim=2)
        return [self.rows.own(block(w.contiguous()), f) for w in whole]

    def _each(self, fn, xs, feat_idx) -> list[torch.Tensor]:
        """``fn(x, feat_idx)`` for each chunk, all at the same cache slots, in chunk order."""
        start, out = feat_idx[0], []
        for x in xs:
            feat_idx[0] = start
            out.append(fn(x, feat_idx))
        return out

    def resample(self, m, xs, feat_cache, feat_idx) -> list[torch.Tensor]:
        """``Resample.forward``: time conv (upsample3d), the spatial x2 per frame, time conv
        (downsample3d)."""
        if m.mode == 'upsample3d':
            xs = self._each(lambda x, fi: self._time_upsample(m, x, feat_cache, fi), xs, feat_idx)
        ts = [x.shape[2] for x in xs]
        full = self.rows.full_rows(xs[0])
        xs = [rearrange(x, 'b c t h w -> (b t) c h w') for x in xs]
        if m.mode.startswith('upsample'):
            up, conv = m.resample
            xs = [up(x) for x in xs]  # nearest x2: band rows [s, e) -> [2s, 2e), a copy
            xs = self._halo_conv2d(conv, xs, 1, 1, 2 * full)
        elif m.mode.startswith('downsample'):
            zero_pad, conv = m.resample  # ZeroPad2d((0, 1, 0, 1)): rows below come from the halo
            left, right, top, bottom = zero_pad.padding
            xs = self._halo_conv2d(conv, xs, top, bottom, full + top + bottom,
                                   lambda t: F.pad(t, (left, right, 0, 0)))
        else:
            xs = [m.resample(x) for x in xs]
        xs = [rearrange(x, '(b t) c h w -> b c t h w', t=t) for x, t in zip(xs, ts)]
        if m.mode == 'downsample3d':
            xs = self._each(lambda x, fi: self._time_downsample(m, x, feat_cache, fi), xs, feat_idx)
        return xs

    def _halo_conv2d(self, conv, xs, above: int, below: int, full_rows: int, prep=lambda t: t) -> list[torch.Tensor]:
        """``conv_rows(conv, prep(halo(x, above, below)), full_rows)`` for each chunk (a resampling
        Conv2d on the band, its H padding replaced by ``above``/``below`` halo rows) with the
        exchange overlapped: the output rows that read no halo row are computed while the halo
        travels, the rows at each end after. Exact for the reason ``_overlapped_conv`` is."""
        k, s = conv.weight.shape[-2], conv.stride[-2]
        rows = xs[0].shape[-2]
        n_out = (above + rows + below - k) // s + 1
        j0, j1 = -(-above // s), (above + rows - k) // s  # output rows j0..j1 read x alone
        pending = self.rows.start_halo(xs, above, below)
        if j1 < j0:  # too thin for rows without a halo
            return [conv_rows(conv, prep(torch.cat(top + [x] + bottom, dim=-2)), full_rows)
                    for x, (top, bottom) in zip(xs, pending.wait())]
        middles = [conv_rows(conv, prep(x.narrow(-2, j0 * s - above, (j1 - j0) * s + k)), full_rows) for x in xs]
        out = []
        for x, middle, (top, bottom) in zip(xs, middles, pending.wait()):
            parts = [middle]
            if j0 > 0:  # input rows 0 .. (j0 - 1) * s + k - 1 of the band with its halo
                parts.insert(0, conv_rows(conv, prep(torch.cat(top + [x.narrow(-2, 0, (j0 - 1) * s + k - above)],
                                                               dim=-2)), full_rows))
            if j1 < n_out - 1:
                a = (j1 + 1) * s - above  # the first row of x the next output row reads
                parts.append(conv_rows(conv, prep(torch.cat([x.narrow(-2, a, rows - a)] + bottom, dim=-2)),
                                       full_rows))
            out.append(torch.cat(parts, dim=-2))
        return out

    def _time_upsample(self, m, x, feat_cache, feat_idx) -> torch.Tensor:
        """``Resample.forward``'s upsample3d time_conv part, with its 'Rep' first chunk."""
        b, c, t, h, w = x.size()
        idx = feat_idx[0]
        old = feat_cache[idx]
        feat_idx[0] += 1
        if old is None:
            feat_cache[idx] = 'Rep'
            return x
        rep = isinstance(old, str)
        cache_x = x[:, :, -self.eng.CACHE_T:].clone()
        if cache_x.shape[2] < 2:
            first = torch.zeros_like(cache_x) if rep else old[:, :, -1].unsqueeze(2).to(cache_x.device)
            cache_x = torch.cat([first, cache_x], dim=2)
        x = self.conv(m.time_conv, x, None if rep else old)
        feat_cache[idx] = cache_x
        x = x.reshape(b, 2, c, t, h, w)
        x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
        return x.reshape(b, c, t * 2, h, w)

    def _time_downsample(self, m, x, feat_cache, feat_idx) -> torch.Tensor:
        """``Resample.forward``'s downsample3d time_conv part (the first chunk is only cached)."""
        idx = feat_idx[0]
        feat_idx[0] += 1
        if feat_cache[idx] is None:
            feat_cache[idx] = x.clone()
            return x
        cache_x = x[:, :, -1:, :, :].clone()
        x = self.conv(m.time_conv, torch.cat([feat_cache[idx][:, :, -1:, :, :], x], 2))
        feat_cache[idx] = cache_x
        return x

    # ----- encoder / decoder
    def _run(self, parts: Sequence[nn.Module], xs, feat_cache, feat_idx) -> list[torch.Tensor]:
        for part in parts:
            for m in (part if isinstance(part, nn.Sequential) else [part]):
                xs = self.layer(m, xs, feat_cache, feat_idx)
        return xs

    def encoder(self, enc, xs, feat_cache, feat_idx) -> list[torch.Tensor]:
        return self._run([enc.conv1, enc.downsamples, enc.middle, enc.head], xs, feat_cache, feat_idx)

    def decoder(self, dec, xs, feat_cache, feat_idx) -> list[torch.Tensor]:
        return self._run([dec.conv1, dec.middle, dec.upsamples, dec.head], xs, feat_cache, feat_idx)

    def _groups(self, chunks: list, pixels: int, itemsize: int) -> list[list]:
        """``chunks`` in consecutive groups, each as many chunks as keep a group's activations
        (``_LIVE_TENSORS`` tensors of 4 frames, ``pixels`` band pixels per frame, the VAE's base
        width, a chunk) within ``GROUP_BYTES``; at least one chunk."""
        per_chunk = _LIVE_TENSORS * 4 * pixels * self.model.dim * itemsize
        size = max(1, GROUP_BYTES // max(per_chunk, 1))
        return [chunks[i:i + size] for i in range(0, len(chunks), size)]

    def encode(self, x: torch.Tensor, scale) -> torch.Tensor:
        """``WanVAE_.encode`` on the band ``x`` (pixel rows): chunks of 1, 4, 4, ... frames."""
        model = self.model
        feat_cache = [None] * self.eng.count_conv3d(model.encoder)
        t = x.shape[2]
        chunks = [x[:, :, :1]] + [x[:, :, 1 + 4 * (i - 1):1 + 4 * i] for i in range(1, 1 + (t - 1) // 4)]
        outs = []
        for group in self._groups(chunks, x.shape[-2] * x.shape[-1], x.element_size()):
            outs += self.encoder(model.encoder, group, feat_cache, [0])
        mu, log_var = self.conv(model.conv1, torch.cat(outs, 2)).chunk(2, dim=1)
        if isinstance(scale[0], torch.Tensor):
            return (mu - scale[0].view(1, model.z_dim, 1, 1, 1)) * scale[1].view(1, model.z_dim, 1, 1, 1)
        return (mu - scale[0]) * scale[1]

    def decode(self, z: torch.Tensor, scale) -> torch.Tensor:
        """``WanVAE_.decode`` on the band ``z`` (latent rows), one latent frame per chunk."""
        model = self.model
        if isinstance(scale[0], torch.Tensor):
            z = z / scale[1].view(1, model.z_dim, 1, 1, 1) + scale[0].view(1, model.z_dim, 1, 1, 1)
        else:
            z = z / scale[1] + scale[0]
        x = self.conv(model.conv2, z)
        feat_cache = [None] * self.eng.count_conv3d(model.decoder)
        factor = decoder_factor(model)
        outs = []
        for group in self._groups([x[:, :, i:i + 1] for i in range(z.shape[2])],
                                  z.shape[-2] * z.shape[-1] * factor * factor, x.element_size()):
            outs += self.decoder(model.decoder, group, feat_cache, [0])
        return torch.cat(outs, 2)


def levels(modules, prefix: str, eng) -> int:
    """Spatial resampling levels (each x2) among ``modules``."""
    return sum(1 for m in modules if isinstance(m, eng.Resample) and m.mode.startswith(prefix))


def encoder_factor(vae) -> int:
    eng = sys.modules[type(vae.model).__module__]
    return 2 ** levels(vae.model.encoder.downsamples, 'downsample', eng)


def decoder_factor(model) -> int:
    """Pixel rows per latent row of the decoder's output (``model``: the engine's WanVAE_)."""
    return 2 ** levels(model.decoder.upsamples, 'upsample', sys.modules[type(model).__module__])
