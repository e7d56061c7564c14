"""Split VAE: each rank computes a band of rows; halo exchange sized to each conv's kernel; exact.

``split_encode`` / ``split_decode`` return what the engine's ``Wan2_1_VAE.encode`` / ``.decode``
(``wan/modules/vae2_1.py``) return, bit for bit, with the work spread over the ranks of a process
group: every rank holds the whole input, or only its own rows of it (``split_encode(height=)``),
computes the output rows of its own band only, and the bands are gathered on one rank (``dst``) or
on all (``dst=None``), or stay where they are (``decode_bands``; ``gather_bands`` assembles them).
The generation loop keeps each decoded clip in bands: rank 0 gathers it for the output, and the
motion re-encode of its last frames reads every rank's own rows, so no other rank holds a whole
decoded clip.

How the engine's forward is split (it runs the engine's own modules and weights; nothing copied):

- Bands are chosen in latent rows (as even as possible: ``band_rows``) and mapped up by 2 per
  spatial resampling level (x8 at pixel resolution), so every band boundary is an even row at every
  level and the stride-2 downsample / nearest x2 upsample never straddle a boundary.
- Halo, per layer, from the kernel: a CausalConv3d with kernel (kt, 3, 3) reads 1 row above and 1
  below (its ``_padding``), the 1x1x1 shortcuts and the (3, 1, 1) ``time_conv``s none, the
  upsample Conv2d (3x3, padding 1) 1 above and 1 below (after the nearest upsample), the downsample
  Conv2d (ZeroPad2d(0, 1, 0, 1), 3x3, stride 2) 1 below only. Halo rows come from the neighbouring
  ranks (``batch_isend_irecv``); at the frame's top/bottom they are the zeros of the engine's own
  padding. Norms (RMS over channels), SiLU, dropout and the nearest upsample are per pixel.
- A residual block (norm, SiLU, 3x3 conv, norm, SiLU, 3x3 conv) exchanges once, 2 rows each side:
  its first conv also computes the neighbours' row next to the band (the arithmetic they use for
  it, see below), its second reads that row; past the frame's edges those rows are set to the
  zeros the engine pads with. That halves the exchanges (latency-bound: ~550 per 73-frame encode
  before) for one extra row per side of the first conv. Bands thinner than 2 rows at a block's
  resolution exchange per conv. The exchange is posted first and waited for only after the
  block's shortcut, its norms and the first conv's output rows that read no halo row are computed
  (``_overlapped_conv``); the first conv's rows at each end follow, so a rank that is a little
  behind its neighbour costs the neighbour nothing. The other cached 3x3 convs (the encoder's and
  decoder's first conv and head) and the resampling Conv2ds overlap their exchange with their own
  interior rows the same way.
- Chunks in groups: the engine runs its chunks (1 + 4k frames on encode, one latent frame on
  decode) one after the other through every layer; the band forward runs a group of consecutive
  chunks through each layer before the next (``GROUP_BYTES``), so one exchange carries the halo
  rows of every chunk of the group, and the middle attention gathers them in one all-gather.
  Every conv still runs per chunk on the same input, and a conv's temporal cache passes from
  chunk to chunk in order, so the arithmetic is the engine's. Small frames group (the compute
  preset: 16 chunks a group, ~16x fewer exchanges, each a point where both ranks wait for the
  slower); real sizes do not (a chunk alone is over the budget).
- Temporal caches stay per band: each rank keeps its own ``feat_cache`` with the engine's
  bookkeeping (1 + 4k frame chunks on encode, one latent frame at a time on decode); a conv's
  cache holds its input rows including the halo rows, so the next chunk needs no extra exchange.
- The middle ``AttentionBlock`` (per-frame attention over the whole frame) is the one place a rank
  holds a whole frame: the bands are all-gathered at latent resolution, the engine's block runs on
  the whole frame, and the rank keeps its rows. Everything else holds only a band (+ halo rows).

Exactness (CPU fp32: ``torch.equal`` with the unsplit engine, tests/test_vae_split.py). A conv
output pixel is the same arithmetic on a band as on the whole frame only if the same kernel
computes it, and PyTorch picks the kernel from the input's *size*: on CPU a batch-1 conv goes to
oneDNN (``Mkldnn``) only when N*C*D*H > 20480, else to im2col + MKL sgemm (``Slow3d``/``Slow2d``),
so a band of a large frame would run the other kernel (measured: ~1e-6 max abs per conv; a
width-32 VAE on a 112x32 frame, 2 ranks: encode 3.4e-7, decode 2.8e-6). ``conv_rows`` therefore asks PyTorch which backend the engine's whole-frame call selects
(``torch._C._select_conv_backend`` on a zero-stride stand-in of the whole input) and calls that
backend on the band. Within a backend (measured, MKL 2024.2 / oneDNN 3.12, AVX2, 1 and 2 threads):
oneDNN's direct conv gives the same bits for any number of rows; MKL sgemm does too except for
very few output columns (m <= 11 pixels per image: a small-matrix path), so gemm-backed band calls
are padded with zero rows up to ``MIN_GEMM_COLUMNS`` pixels (or up to the whole frame when that is
smaller) and cropped (without it the test's 56x16 frame decodes 2.4e-6 off). One measured caveat: with fewer than 8 output channels (only the decoder's
3-channel head) MKL's tail kernels make a pixel's bits depend on its position modulo 4..8 in the
gemm; bands start on whole rows, so this is exact when the pixel width is a multiple of 8, as
every Wan size is. Frames only a few latent columns wide are the other limit: split into
1-latent-row bands, a 24x16 frame encoded 1.9e-7 off (the whole-frame call is itself in MKL's
small-matrix range there; the tests use 12 latent columns, real sizes have 60 or more). The per-pixel ops (RMS norm, SiLU, the scale, clamp) and the gathered
attention (the whole frame, as the engine computes it) are exact as they are.

On CUDA the convs go through the normal dispatch (measured on an H100, torch 2.11 + cuDNN 9.19,
the real VAE width, 2 and 3 ranks, 256x448 and 704x1024; bench/gpu_vae.py, docs/gpu.md): with
TF32 off (``torch.backends.cudnn.allow_tf32 = False``) the split equals the unsplit VAE bit for
bit; with PyTorch's default, which lets cuDNN run fp32 convs in TF32, cuDNN's per-shape choice of
algorithm rounds a band differently from the whole frame: up to 9.9e-4 on latents and 3.2e-3 on
frames in [-1, 1] (0.4 of an 8-bit level; a 73-frame encode and a 39-latent-frame decode at
704x1024), the size of TF32's own error; ``cudnn.deterministic`` does not change that. The
engine's own fp32 VAE runs under that default, and we keep it.

May import: nothing else from the project.
"""
from __future__ import annotations

import math
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

__all__ = ["MIN_GEMM_COLUMNS", "band_rows", "conv_rows", "decode_bands", "gather_bands", "own_band",
           "split_decode", "split_encode"]

#: gemm-backed (im2col + sgemm) band convs get at least this many output pixels per image, by
#: zero rows appended below the band and cropped off (MKL's small-matrix path, which computes a
#: pixel differently, measured at <= 11 columns; 64 is a margin).
MIN_GEMM_COLUMNS = 64

_GEMM_BACKENDS = ("Slow2d", "Slow3d")

#: chunks (1 + 4k frames on encode, a latent frame on decode) go through each layer together, as
#: many as keep the group's estimated activations within this (``_BandVAE._groups``): fewer halo
#: exchanges for small frames. A real VAE's chunk is far bigger on its own (96 channels x 4 frames
#: x a band of 704x1024: ~550 MB a tensor), so real sizes go one chunk at a time, as before.
GROUP_BYTES = 256 << 20
#: live full-resolution tensors a chunk holds in a layer, for that estimate (measured on the compute
#: preset: all 21 latent frames of a decode at once added ~0.8 GB per rank, ~8 of 2 MiB each a chunk)
_LIVE_TENSORS = 8


# --------------------------------------------------------------------------------------------
# bands


def band_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` bands ``(start, stop)`` covering ``range(rows)``, sizes as even as possible
    (the first ``rows % parts`` bands one row taller). Needs ``1 <= parts <= rows``."""
    if not 1 <= parts <= rows:
        raise ValueError(f"cannot split {rows} rows into {parts} non-empty bands")
    q, r = divmod(rows, parts)
    stops = [(i + 1) * q + min(i + 1, r) for i in range(parts)]
    return list(zip([0] + stops[:-1], stops))


def _latent_rows(height: int, factor: int, world: int) -> int:
    """Latent rows of a ``height``-row frame; checks that ``world`` bands fit."""
    if height % factor:
        raise ValueError(f"split VAE: the frame height {height} is not a multiple of {factor}")
    rows = height // factor
    if world > rows:
        raise ValueError(f"split VAE: {world} ranks but only {rows} latent rows; "
                         f"use a group of at most {rows} ranks")
    return rows


# --------------------------------------------------------------------------------------------
# convolution as the whole-frame call computes it


def _out_size(size: int, k: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def _engine_backend(conv: nn.Module, x: torch.Tensor, full_rows: int,
                    padding: Sequence[int]) -> Optional[str]:
    """Name of the backend PyTorch selects for ``conv`` on the whole input (``x`` with
    ``full_rows`` rows, called with ``padding``); None off CPU or if PyTorch cannot say."""
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None or x.device.type != "cpu":
        return None
    shape = list(x.shape)
    shape[-2] = full_rows
    stand_in = torch.zeros((), dtype=x.dtype, device=x.device).expand(shape)  # no allocation
    nd = x.dim() - 2
    try:
        backend = select(stand_in, conv.weight, conv.bias, list(conv.stride), list(padding),
                         list(conv.dilation), False, [0] * nd, conv.groups, None)
    except (TypeError, RuntimeError):  # another torch's signature: normal dispatch
        return None
    return backend.name


def _run_backend(backend: Optional[str], x, weight, bias, stride, padding, dilation, groups):
    """The ATen op ``torch.nn.functional.conv*d`` reaches for ``backend`` (normal dispatch for
    None or any other backend)."""
    if backend == "Mkldnn":
        return torch.mkldnn_convolution(x, weight, bias, padding, stride, dilation, groups)
    if backend == "Slow3d":
        return torch._C._nn.slow_conv3d(x, weight, weight.shape[2:], bias, stride, padding)
    if backend == "Slow2d":
        return torch._C._nn.thnn_conv2d(x, weight, weight.shape[2:], bias, stride, padding)
    conv = F.conv3d if x.dim() == 5 else F.conv2d
    return conv(x, weight, bias, stride, padding, dilation, groups)


def conv_rows(conv: nn.Module, x: torch.Tensor, full_rows: int,
              padding: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``conv`` (an ``nn.Conv2d``/``nn.Conv3d``, its own weights) over a band of rows, with the
    arithmetic of the whole-frame call.

    ``x``: the band's input, rows on dim -2, holding every row its outputs read (halo rows, or
    zero rows where the whole-frame call pads H); ``full_rows``: the rows of the whole-frame
    call's input; ``padding``: that call's padding (default ``conv.padding``). The band call
    pads every dim but H like the whole-frame call. Returns the band's output rows.
    """
    padding = tuple(conv.padding if padding is None else padding)
    band_padding = padding[:-2] + (0,) + padding[-1:]
    weight, bias = conv.weight, conv.bias
    stride, dilation = tuple(conv.stride), tuple(conv.dilation)
    ks = weight.shape[2:]
    rows_out = _out_size(x.shape[-2], ks[-2], stride[-2], 0, dilation[-2])
    backend = _engine_backend(conv, x, full_rows, padding)
    if backend in _GEMM_BACKENDS:
        full_out = _out_size(full_rows, ks[-2], stride[-2], padding[-2], dilation[-2])
        per_row = math.prod(_out_size(x.shape[2 + i], ks[i], stride[i], band_padding[i], dilation[i])
                            for i in range(x.dim() - 2) if i != x.dim() - 4)
        want = min(full_out, max(rows_out, -(-MIN_GEMM_COLUMNS // max(per_row, 1))))
        if want > rows_out:
            extra = list(x.shape)
            extra[-2] = (want - rows_out) * stride[-2]
            x = torch.cat([x, x.new_zeros(extra)], dim=-2)
    y = _run_backend(backend, x.contiguous(), weight, bias, stride, band_padding, dilation, conv.groups)
    return y if y.shape[-2] == rows_out else y.narrow(-2, 0, rows_out).contiguous()


# --------------------------------------------------------------------------------------------
# communication
def await_peers(works) -> None:
    """Wait for point-to-point transfers (the halo rows). Named so that a hang report's stack
    analysis (``diagnose.analyse_stacks``, which looks for this name) counts a rank blocked
    here as waiting for its peers, like one blocked in a collective."""
    for work in works:
        work.wait()


class _PendingHalo:
    """Halo rows on their way (``_Rows.start_halo``): ``wait()`` returns, per chunk, ([the rows
    above] or [], [the rows below] or []), zeros past the frame's edges."""

    def __init__(self, works, sent, rows):
        self._works, self._sent, self._rows = works, sent, rows

    def wait(self) -> list[tuple[list, list]]:
        await_peers(self._works)
        self._sent = None
        return self._rows()


class _Rows:
    """This rank's band of a frame in a process group, and the exchanges between bands.

    Band tensors have rows on dim -2; a band tensor at any resolution has exactly
    ``(stop - start) * f`` rows, ``f`` its resolution in rows per latent row."""

    def __init__(self, group, latent_rows: int, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.latent_rows = latent_rows
        self.bands = band_rows(latent_rows, self.world)
        self.start, self.stop = self.bands[self.rank]
        # gloo moves CPU tensors only: stage through the CPU when the model is elsewhere
        self.stage = dist.get_backend(group) == "gloo" and device.type != "cpu"

    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def factor(self, x: torch.Tensor, extra: int = 0) -> int:
        """``x``'s resolution in rows per latent row; ``extra``: rows ``x`` holds beyond its band
        on each side."""
        f, rem = divmod(x.shape[-2] - 2 * extra, self.stop - self.start)
        assert rem == 0 and f > 0, (x.shape, extra, self.start, self.stop)
        return f

    def full_rows(self, x: torch.Tensor, extra: int = 0) -> int:
        """Rows of the whole frame at ``x``'s resolution."""
        return self.latent_rows * self.factor(x, extra)

    def min_band(self, x: torch.Tensor) -> int:
        """Rows of the smallest band at ``x``'s resolution (``x``: a band without extra rows)."""
        return min(e - s for s, e in self.bands) * self.factor(x)

    def zero_outside(self, x: torch.Tensor, extra: int) -> torch.Tensor:
        """``x`` (a fresh tensor; changed in place) with its ``extra`` rows past the frame's top
        or bottom edge set to zero: what the whole-frame conv's zero padding reads there."""
        if self.rank == 0:
            x.narrow(-2, 0, extra).zero_()
        if self.rank == self.world - 1:
            x.narrow(-2, x.shape[-2] - extra, extra).zero_()
        return x

    def own(self, full: torch.Tensor, f: int) -> torch.Tensor:
        """This rank's rows of a whole frame at resolution ``f``."""
        return full.narrow(-2, self.start * f, (self.stop - self.start) * f).contiguous()

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()  # first: a copy to the CPU keeps the strides, and gloo wants dense
        return t.cpu() if self.stage else t

    def halo(self, x: torch.Tensor, above: int, below: int) -> torch.Tensor:
        """``x`` with ``above`` rows of the previous band on top and ``below`` rows of the next
        band underneath; zero rows (the whole frame's zero padding) past the frame's edges."""
        if not above and not below:
            return x
        (top, bottom), = self.start_halo([x], above, below).wait()
        return torch.cat(top + [x] + bottom, dim=-2)

    def start_halo(self, xs: Sequence[torch.Tensor], above: int, below: int) -> "_PendingHalo":
        """Posts the exchange of ``halo``'s rows of every band tensor in ``xs`` (the chunks of a
        group, ``_BandVAE``), one message per neighbour for them all, and returns at once;
        ``.wait()`` gives each one's (rows above, rows below)."""
        rows = xs[0].shape[-2]
        assert all(x.shape[-2] == rows for x in xs) and rows >= max(above, below), (rows, above, below)
        shapes = [list(x.shape) for x in xs]
        part = lambda s, n: s[:-2] + [n, s[-1]]  # noqa: E731
        wire = torch.device("cpu") if self.stage else xs[0].device
        ops, got, sent = [], {}, []

        def recv(key, n, peer):
            got[key] = torch.empty(sum(math.prod(part(s, n)) for s in shapes), dtype=xs[0].dtype, device=wire)
            ops.append(dist.P2POp(dist.irecv, got[key], self._peer(peer), self.group))

        def send(start, n, peer):  # rows start .. start + n - 1 of every chunk, in one message
            sent.append(self._wire(torch.cat([x.narrow(-2, start, n).reshape(-1) for x in xs])))
            ops.append(dist.P2POp(dist.isend, sent[-1], self._peer(peer), self.group))  # kept alive until waited

        if self.rank > 0:
            if above:
                recv("above", above, self.rank - 1)
            if below:
                send(0, below, self.rank - 1)
        if self.rank < self.world - 1:
            if above:
                send(rows - above, above, self.rank + 1)
            if below:
                recv("below", below, self.rank + 1)
        works = dist.batch_isend_irecv(ops) if ops else []

        def edges(key, n) -> list[list]:  # per chunk: its received rows, or the frame's zero padding
            if not n:
                return [[] for _ in xs]
            if key not in got:
                return [[x.new_zeros(part(s, n))] for x, s in zip(xs, shapes)]
            pieces = got[key].split([math.prod(part(s, n)) for s in shapes])
            return [[p.view(part(s, n)).to(x.device)] for p, x, s in zip(pieces, xs, shapes)]
        return _PendingHalo(works, sent, lambda: list(zip(edges("above", above), edges("below", below))))

    def _padded(self, x: torch.Tensor, f: int) -> tuple[torch.Tensor, list[int]]:
        heights = [(e - s) * f for s, e in self.bands]
        pad = max(heights) - x.shape[-2]
        if pad:
            shape = list(x.shape)
            shape[-2] = pad
            x = torch.cat([x, x.new_zeros(shape)], dim=-2)
        return self._wire(x), heights

    def _assemble(self, parts: list[torch.Tensor], heights: list[int], device) -> torch.Tensor:
        return torch.cat([p.narrow(-2, 0, h) for p, h in zip(parts, heights)], dim=-2).to(device)

    def gather_all(self, x: torch.Tensor) -> torch.Tensor:
        """The whole frame from every rank's band, on every rank."""
        padded, heights = self._padded(x, self.factor(x))
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return self._assemble(parts, heights, x.device)

    def gather_to(self, x: torch.Tensor, dst: Optional[int]) -> Optional[torch.Tensor]:
        """The whole frame on group rank ``dst`` (None elsewhere), or on all ranks for None."""
        if dst is None:
            return self.gather_all(x)
        padded, heights = self._padded(x, self.factor(x))
        parts = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(padded, parts, dst=self._peer(dst), group=self.group)
        return self._assemble(parts, heights, x.device) if parts is not None else None


# --------------------------------------------------------------------------------------------
# the engine's forward, band by band


class _BandVAE:
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

    def __init__(self, model: nn.Module, rows: _Rows):
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
                return None if old is None else old.narrow(-2, a + extra, b - a)

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
        factor = _decoder_factor(model)
        outs = []
        for group in self._groups([x[:, :, i:i + 1] for i in range(z.shape[2])],
                                  z.shape[-2] * z.shape[-1] * factor * factor, x.element_size()):
            outs += self.decoder(model.decoder, group, feat_cache, [0])
        return torch.cat(outs, 2)


# --------------------------------------------------------------------------------------------
# public API


def _split_world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _levels(modules, prefix: str, eng) -> int:
    """Spatial resampling levels (each x2) among ``modules``."""
    return sum(1 for m in modules if isinstance(m, eng.Resample) and m.mode.startswith(prefix))


@contextmanager
def _engine_autocast(vae) -> Iterator[None]:
    """What ``Wan2_1_VAE.encode``/``decode`` run under: ``torch.cuda.amp.autocast(dtype=vae.dtype)``
    (on CUDA with the fp32 VAE this overrides the caller's bf16 autocast; off CUDA it is off)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        ctx = torch.amp.autocast("cuda", dtype=vae.dtype)
    with ctx:
        yield


def _unsplit(result: list, group, dst: Optional[int]) -> Optional[list]:
    """``result`` where it is returned (``dst``, or every rank for None), else None."""
    if dst is None or not dist.is_initialized() or dist.get_rank(group) == dst:
        return result
    return None


def _split_call(vae, inputs: Sequence[torch.Tensor], group, in_factor: int, compute,
                height: Optional[int] = None) -> list[tuple[_Rows, torch.Tensor]]:
    """Each input's row band (``in_factor`` input rows per latent row) through
    ``compute(band_vae, band)``: per input, its ``_Rows`` and this rank's output band. The inputs
    are whole frames, or (``height``) this rank's bands of frames ``height`` rows tall."""
    world = _split_world(group)
    out = []
    with _engine_autocast(vae):
        for u in inputs:
            rows = _Rows(group, _latent_rows(height or u.shape[-2], in_factor, world), u.device)
            band = u.unsqueeze(0) if height else rows.own(u.unsqueeze(0), in_factor)
            if height:
                assert band.shape[-2] == (rows.stop - rows.start) * in_factor, (band.shape, rows.bands)
            out.append((rows, compute(_BandVAE(vae.model, rows), band).squeeze(0)))
    return out


def _gathered(results: list[tuple[_Rows, torch.Tensor]], group, dst: Optional[int]) -> Optional[list]:
    return _unsplit([rows.gather_to(band, dst) for rows, band in results], group, dst)


def _encoder_factor(vae) -> int:
    eng = sys.modules[type(vae.model).__module__]
    return 2 ** _levels(vae.model.encoder.downsamples, 'downsample', eng)


def _decoder_factor(model) -> int:
    """Pixel rows per latent row of the decoder's output (``model``: the engine's WanVAE_)."""
    return 2 ** _levels(model.decoder.upsamples, 'upsample', sys.modules[type(model).__module__])


@torch.no_grad()
def split_encode(vae, videos: Sequence[torch.Tensor], group=None, dst: Optional[int] = 0,
                 height: Optional[int] = None) -> Optional[list[torch.Tensor]]:
    """``vae.encode(videos)`` (a ``Wan2_1_VAE``; each video ``[C, T, H, W]``, H a multiple of 8,
    given in full on every rank of ``group``), computed in row bands over the group's ranks.
    Collective: every rank of ``group`` (default: the world) calls it with the same inputs.
    With ``height``, each rank gives only its own rows of videos ``height`` rows tall (what
    ``own_band`` or ``decode_bands`` hold): nobody needs the whole video.

    Returns the engine's list of latents on group rank ``dst`` (None on the others), or on every
    rank for ``dst=None``. Bit-identical to the engine on CPU (see the module docstring). Needs at
    most one rank per latent row. A process without a process group (or a group of one) runs the
    engine's own ``vae.encode``.
    """
    if _split_world(group) == 1:
        return _unsplit(vae.encode(videos), group, dst)
    return _gathered(_split_call(vae, videos, group, _encoder_factor(vae),
                                 lambda band_vae, band: band_vae.encode(band, vae.scale).float(), height),
                     group, dst)


def _decode_results(vae, zs, group) -> list[tuple[_Rows, torch.Tensor]]:
    factor = _decoder_factor(vae.model)

    def decode(band_vae, band):
        x = band_vae.decode(band, vae.scale).float().clamp_(-1, 1)
        rows = band_vae.rows
        assert x.shape[-2] == (rows.stop - rows.start) * factor
        return x

    return _split_call(vae, zs, group, 1, decode)


@torch.no_grad()
def decode_bands(vae, zs: Sequence[torch.Tensor], group=None) -> list[torch.Tensor]:
    """``vae.decode(zs)`` (each latent ``[16, T, h, w]``, given in full on every rank of
    ``group``), computed in row bands over the group's ranks; each rank gets its own rows of each
    decoded video (``own_band`` of what ``vae.decode`` returns; all of it without a split).
    Collective like ``split_encode``; ``gather_bands`` assembles the whole videos."""
    if _split_world(group) == 1:
        return vae.decode(zs)
    return [band for _, band in _decode_results(vae, zs, group)]


def own_band(vae, x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's rows (dim -2) of a whole frame at pixel resolution: the band ``split_encode``
    computes from, and ``decode_bands`` returns (``x`` itself without a split)."""
    world = _split_world(group)
    if world == 1:
        return x
    factor = _encoder_factor(vae)
    return _Rows(group, _latent_rows(x.shape[-2], factor, world), x.device).own(x, factor)


def gather_bands(vae, bands: Sequence[torch.Tensor], height: int, group=None,
                 dst: Optional[int] = 0) -> Optional[list[torch.Tensor]]:
    """The whole videos (``height`` rows) from every rank's ``bands`` (pixel resolution), on group
    rank ``dst`` (None on the others), or on every rank for ``dst=None``. Collective."""
    world = _split_world(group)
    if world == 1:
        return _unsplit(list(bands), group, dst)
    factor = _encoder_factor(vae)
    results = [(_Rows(group, _latent_rows(height, factor, world), b.device), b) for b in bands]
    return _gathered(results, group, dst)


@torch.no_grad()
def split_decode(vae, zs: Sequence[torch.Tensor], group=None,
                 dst: Optional[int] = 0) -> Optional[list[torch.Tensor]]:
    """``vae.decode(zs)`` computed in row bands over the group's ranks (``decode_bands``) and
    gathered like ``split_encode``'s result."""
    if _split_world(group) == 1:
        return _unsplit(vae.decode(zs), group, dst)
    return _gathered(_decode_results(vae, zs, group), group, dst)
