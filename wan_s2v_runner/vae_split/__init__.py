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
width-32 VAE on a 112x32 frame, 2 ranks: encode 3.4e-7, decode 2.8e-6). ``conv_rows`` therefore asks PyTorch which
backend the engine's whole-frame call selects
(``torch._C._select_conv_backend`` on a zero-stride stand-in of the whole input) and calls that
backend on the band. Within a backend (measured, MKL 2024.2 / oneDNN 3.12, AVX2, 1 and 2 threads):
oneDNN's direct conv gives the same bits for any number of rows; MKL sgemm does too except for
very few output columns (m <= 11 pixels per image: a small-matrix path), so gemm-backed band calls
are padded with zero rows up to ``MIN_GEMM_COLUMNS`` pixels (or up to the whole frame when that is
smaller) and cropped (without it the test's 56x16 frame decodes 2.4e-6 off). One measured caveat: with fewer than 8
output channels (only the decoder's
3-channel head) MKL's tail kernels make a pixel's bits depend on its position modulo 4..8 in the
gemm; bands start on whole rows, so this is exact when the pixel width is a multiple of 8, as
every Wan size is. Frames only a few latent columns wide are the other limit: split into
1-latent-row bands, a 24x16 frame encoded 1.9e-7 off (the whole-frame call is itself in MKL's
small-matrix range there; the tests use 12 latent columns, real sizes have 60 or more). The per-pixel ops (RMS
norm, SiLU, the scale, clamp) and the gathered
attention (the whole frame, as the engine computes it) are exact as they are.

On CUDA the convs go through the normal dispatch (measured on an H100, torch 2.11 + cuDNN 9.19,
the real VAE width, 2 and 3 ranks, 256x448 and 704x1024; bench/gpu_vae.py, docs/gpu.md): with
TF32 off (``torch.backends.cudnn.allow_tf32 = False``) the split equals the unsplit VAE bit for
bit; with PyTorch's default, which lets cuDNN run fp32 convs in TF32, cuDNN's per-shape choice of
algorithm rounds a band differently from the whole frame: up to 9.9e-4 on latents and 3.2e-3 on
frames in [-1, 1] (0.4 of an 8-bit level; a 73-frame encode and a 39-latent-frame decode at
704x1024), the size of TF32's own error; ``cudnn.deterministic`` does not change that. The
engine's own fp32 VAE runs under that default, and we keep it.

The package: :mod:`.bands` (which rows each rank owns), :mod:`.halo` (the exchanges),
:mod:`.convs` (a conv on a band, exact), :mod:`.layers` (the engine's forward band by band),
:mod:`.api` (the calls below).

May import: nothing else from the project.
"""
from .api import decode_bands, gather_bands, own_band, split_decode, split_encode
from .bands import band_rows
from .convs import MIN_GEMM_COLUMNS, conv_rows

__all__ = ["MIN_GEMM_COLUMNS", "band_rows", "conv_rows", "decode_bands", "gather_bands", "own_band",
           "split_decode", "split_encode"]
