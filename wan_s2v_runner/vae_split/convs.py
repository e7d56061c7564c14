"""Convolution over a band of rows with the arithmetic of the engine's whole-frame call.

PyTorch picks a conv's kernel from the input's size, so a band of a large frame could run another
kernel than the whole frame does: :func:`conv_rows` asks PyTorch which backend the whole-frame
call selects and calls that backend on the band, padding gemm-backed calls past MKL's small-matrix
path (:data:`MIN_GEMM_COLUMNS`). The measurements behind this are in the package docstring.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

#: gemm-backed (im2col + sgemm) band convs get at least this many output pixels per image, by
#: zero rows appended below the band and cropped off (MKL's small-matrix path, which computes a
#: pixel differently, measured at <= 11 columns; 64 is a margin).
MIN_GEMM_COLUMNS = 64

_GEMM_BACKENDS = ("Slow2d", "Slow3d")


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
