"""``--dit-quant fp8`` at load: the DiT's target Linears read from the files as float8_e4m3fn,
one scale per output row, tensor by tensor (no rank ever holds the full-precision DiT).

:class:`Fp8Source` wraps the DiT's source (:func:`~wan_s2v_runner.loading.ckpt_read.open_dit`)
and presents the model of :mod:`patches.fp8_linear`: each target weight ``X.weight`` becomes
``X.qweight.weight`` in float8_e4m3fn; everything else reads as before. The quantization, for a
weight ``w`` (read in float32):

* ``amax[r] = max |w[r, :]|`` per output row; ``scale[r] = amax[r] / 448`` (1 for an all-zero row);
* ``q = clamp(w / scale, -448, 448)`` cast to float8_e4m3fn (round to nearest even).

Each element's ``q`` depends only on its row's scale, so a rank can quantize any slice once the
scales are known:

* **whole tensors** (a replicated DiT: ``lean_load.device_weights``/``node_shared_weights``): the
  tensor is read once in float32 (one tensor at a time), its scales computed, quantized. Only
  the ranks that read compute scales; :meth:`Fp8Source.share_scales` gives every rank rank 0's.
* **FSDP shards**: :meth:`Fp8Source.measure` reads this rank's slices and takes the partial
  per-row maxima, :meth:`Fp8Source.agree_scales` all-reduces them (MAX: a row cut between ranks
  gets its whole maximum), then ``fill_fsdp_shards`` reads the slices again, quantized. Each
  rank reads its slices twice (the second from the page cache), never a whole tensor.

A weight already stored in float8_e4m3fn in a ``--dit-file`` is used as it is (its bytes, and its
file scale per row), never requantized, unless a LoRA changes it. LoRAs (``deltas``) are merged in
full precision before quantizing: ``w + delta`` in float32 (a stored fp8 weight dequantized first,
then requantized: :attr:`Fp8Source.requantized` says which); a kept parameter (a bias, a norm)
gets ``patches.lora_merge``'s merge, rounded once to its dtype. The scales end up in the model
through :func:`patches.fp8_linear.set_scales`.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from patches.fp8_linear import quantized_name
from wan_s2v_runner.loading.ckpt_read import (
    CHUNK_ELEMENTS,
    CheckpointSource,
    DitFileSource,
    per_row,
    row_length,
    row_slices,
)
from wan_s2v_runner.shared.quant import E4M3_MAX


class Fp8Source(CheckpointSource):
    """A DiT source whose target weights read as float8_e4m3fn (see the module's docstring)."""

    def __init__(self, inner: CheckpointSource, targets: Iterable[str], deltas=None):
        self.inner = inner
        self.counter = inner.counter
        self.by_qname = {quantized_name(n): n for n in targets}
        self.scales: dict[str, torch.Tensor] = {}  # weight name -> float32 [rows]
        self._partial: dict[str, torch.Tensor] = {}  # weight name -> float32 [rows] partial maxima
        self._tmp = torch.empty(0, dtype=torch.float32)
        inner_table = inner.table()
        self.shapes = {n: tuple(inner_table[n][1]) for n in self.by_qname.values()}
        self.deltas = deltas  # LoRAs (loading.lora.LoraDeltas, full-precision names), merged before quantizing
        touched = set(deltas.names) if deltas is not None else set()
        stored = {n for n in self.by_qname.values() if self._stored_fp8(n)}
        self.as_is = stored - touched
        self.requantized = stored & touched  # an fp8 file's weights a LoRA changes
        self._delta: tuple[str, Optional[torch.Tensor]] = ("", None)

    # ----- what the file already holds
    def _stored_fp8(self, name: str) -> bool:
        if not isinstance(self.inner, DitFileSource):
            return False
        return self.inner.layout.dtypes.get(name) == "F8_E4M3"

    def _file_scale(self, name: str) -> torch.Tensor:
        rows = self.shapes[name][0]
        if name not in self.inner.layout.scales:
            return torch.ones(rows)  # fp8 cast without a scale
        s = self.inner.scale_of(name)
        return s.expand(rows).clone() if s.numel() == 1 else s.reshape(rows).clone()

    # ----- the table the fp8 model matches
    def table(self):
        out = {}
        for name, (dtype, shape) in self.inner.table().items():
            q = quantized_name(name)
            out[q if q in self.by_qname else name] = (torch.float8_e4m3fn, shape) if q in self.by_qname \
                else (dtype, shape)
        return out

    # ----- reading
    def _row(self, name: str) -> int:
        return row_length(self.shapes[name])

    def _buffer(self, n: int) -> torch.Tensor:
        if self._tmp.numel() < n:
            self._tmp = torch.empty(n, dtype=torch.float32)
        return self._tmp[:n]

    def _scale(self, name: str) -> Optional[torch.Tensor]:
        if name not in self.scales and name in self.as_is:
            self.scales[name] = self._file_scale(name)
        return self.scales.get(name)

    def _delta_slice(self, name: str, start: int, n: int) -> Optional[torch.Tensor]:
        """Elements ``[start, start + n)`` of the LoRAs' fp32 change to ``name`` (None: untouched);
        the last parameter's change is kept (slices of one tensor come one after the other)."""
        if self.deltas is None or name not in self.deltas.names:
            return None
        if self._delta[0] != name:
            self._delta = (name, self.deltas.delta(name).reshape(-1))
        return self._delta[1][start:start + n]

    def _read_merged(self, name: str, start: int, out: torch.Tensor, purpose: str) -> None:
        """The full-precision values (float32 ``out``) with the LoRAs merged."""
        self.inner.read_flat(name, start, out, purpose)
        d = self._delta_slice(name, start, out.numel())
        if d is not None:
            out.add_(d)

    def read_flat(self, key: str, start: int, out: torch.Tensor, purpose: str = "weights") -> None:
        name = self.by_qname.get(key)
        if name is None:
            self.inner.read_flat(key, start, out, purpose)
            d = self._delta_slice(key, start, out.numel())
            if d is not None:  # a LoRA on a kept parameter: merged as patches.lora_merge merges
                out.copy_((out.float() + d).to(out.dtype))
            return
        if name in self.as_is:
            self._scale(name)
            self.inner.read_stored(name, start, out, purpose)  # the file's fp8 bytes
            return
        n, numel = out.numel(), math.prod(self.shapes[name])
        if self._scale(name) is None:
            if start != 0 or n != numel:
                raise RuntimeError(f"{key}: a slice is read before its scales are known (measure, agree_scales)")
            whole = torch.empty(self.shapes[name], dtype=torch.float32)
            self._read_merged(name, 0, whole.view(-1), purpose)
            q, scale = quantize_tensor(whole, name, scratch=True)
            self.scales[name] = scale.reshape(-1)
            out.copy_(q.view(-1))
            return
        for s in range(0, n, CHUNK_ELEMENTS):
            m = min(CHUNK_ELEMENTS, n - s)
            chunk = self._buffer(m)
            self._read_merged(name, start + s, chunk, purpose)
            out[s:s + m].copy_(_quantize(chunk, start + s, self._row(name), self.scales[name]))  # chunk overwritten

    # ----- FSDP: scales agreed from slices
    def measure(self, slices: Iterable[tuple[str, int, torch.Tensor]]) -> None:
        """Partial per-row maxima of this rank's slices of the target weights."""
        for key, start, dest in slices:
            name = self.by_qname.get(key)
            if name is None or name in self.as_is:
                continue
            amax = self._partial.setdefault(name, torch.zeros(self.shapes[name][0]))
            row, n = self._row(name), dest.numel()
            for s in range(0, n, CHUNK_ELEMENTS):
                m = min(CHUNK_ELEMENTS, n - s)
                chunk = self._buffer(m)
                self._read_merged(name, start + s, chunk, purpose="scales")
                for lo, hi, r0, rows in row_slices(start + s, m, row):
                    part = chunk[lo:hi].abs()
                    if rows:
                        amax[r0:r0 + rows] = torch.maximum(amax[r0:r0 + rows], part.view(rows, row).amax(dim=1))
                    else:
                        amax[r0] = torch.maximum(amax[r0], part.max())

    def agree_scales(self, device: torch.device, group=None) -> None:
        """All-reduce the partial maxima (MAX) of every target weight across the ranks; the
        scales follow. Every rank calls it, in the same order (sorted names)."""
        import torch.distributed as dist
        names = sorted(n for n in self.shapes if n not in self.as_is)
        flat = torch.cat([self._partial.get(n, torch.zeros(self.shapes[n][0])) for n in names]) if names \
            else torch.zeros(0)
        # a NaN maximum becomes inf (MAX keeps inf on every backend): every rank then refuses alike
        flat = torch.nan_to_num(flat, nan=float("inf"))
        if dist.is_initialized() and dist.get_world_size(group) > 1 and flat.numel():
            moved = flat.to(device)
            dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=group)
            flat = moved.cpu()
        off = 0
        for n in names:
            rows = self.shapes[n][0]
            self.scales[n] = _scales(flat[off:off + rows], n)
            off += rows
        self._partial.clear()
        for n in self.as_is:  # a rank whose shard holds none of such a weight still needs its scales
            self._scale(n)

    def share_scales(self, group=None) -> None:
        """Every rank takes the first rank's scales (a replicated DiT: the ranks that map a node's
        shared copy read nothing, so computed none), over ``group`` (None: the default group; its
        first rank: the lowest it holds)."""
        import torch.distributed as dist
        for n in self.as_is:
            self._scale(n)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            src = 0 if group is None else min(dist.get_process_group_ranks(group))
            box = [self.scales if dist.get_rank() == src else None]
            dist.broadcast_object_list(box, src=src, group=group)
            self.scales = box[0]

    def row_scales(self) -> dict[str, torch.Tensor]:
        """Weight name -> float32 [rows, 1], for :func:`patches.fp8_linear.set_scales`."""
        missing = sorted(set(self.shapes) - set(self.scales))
        if missing:
            raise RuntimeError(f"no scales for {missing[:3]}")
        return {n: s.reshape(-1, 1) for n, s in self.scales.items()}

    def close(self) -> None:
        self.inner.close()


def quantize_loaded(model) -> list[str]:
    """Quantize a model whose weights are already in memory (on any device), Linear by Linear,
    by the same rule (:func:`quantize_tensor`): for the benches and the GPU runbook, which build
    random weights in place. Returns the quantized weights' names."""
    from patches import fp8_linear
    with torch.no_grad():
        return fp8_linear.convert(model, quantize=quantize_tensor)


def quantize_tensor(w: torch.Tensor, name: str = "weight", scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole [rows, ...] weight -> (float8_e4m3fn values of its shape, float32 scales [rows, 1]).
    ``scratch``: ``w`` is a float32 buffer the caller gives up (quantized in it, no copy)."""
    rows = w.shape[0]
    flat = (w if scratch and w.dtype == torch.float32 else w.to(torch.float32, copy=True)).reshape(-1)
    scale = _scales(row_amax(flat.view(rows, -1)), name)
    return _quantize(flat, 0, row_length(w.shape), scale).view(w.shape), scale.reshape(rows, 1)


def row_amax(w2d: torch.Tensor) -> torch.Tensor:
    """``w2d.abs().amax(dim=1)`` without the tensor-sized ``abs`` copy: max(max, -min) per row,
    the same values (NaN propagates through both), 1/rows of the memory."""
    return torch.maximum(w2d.amax(dim=1), w2d.amin(dim=1).neg())


def _scales(amax: torch.Tensor, name: str) -> torch.Tensor:
    """Row scales from row maxima: ``amax / 448``, 1 for an all-zero row. Refuses NaN or
    infinite weights (they would quantize to nothing the file meant)."""
    amax = amax.float()
    if not torch.isfinite(amax).all():
        raise ValueError(f"{name} holds NaN or infinite values: the DiT file is corrupt. "
                         "Fix: download it again (or check it with wan-s2v doctor)")
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _quantize(flat: torch.Tensor, first: int, row: int, scale: torch.Tensor) -> torch.Tensor:
    """Elements ``[first, first + len)`` of a row-major weight (float32), quantized with their
    rows' scales; ``flat`` is overwritten."""
    return per_row(flat, first, row, scale, torch.Tensor.div_).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
