"""Reading parts of checkpoint files: a tensor's bytes, or a slice of its flattened elements,
straight into the tensor that will hold them, counting every byte read.

Lean loading (``wan_s2v_runner.loading.lean_load``) fills each rank's FSDP shard from the files without
ever holding a whole tensor: :class:`SafetensorsFiles` indexes a diffusers checkpoint
(``diffusion_pytorch_model*.safetensors``, single or sharded with its index) from the headers
alone and reads byte ranges with ``pread`` (no mapping, so nothing lands in the process's RSS
but the destination); :class:`PthFile` does the same for a plain ``torch.save`` state dict
(``.pth``: T5, VAE) through ``torch.load(mmap=True)``, copying only the slice's pages and
handing them back to the kernel afterwards (``madvise(MADV_DONTNEED)``). Both count the bytes
they read in a :class:`ReadCounter` (the proof that a rank reads only its slices, and the
benchmark's bytes-per-rank column). Dtype conversion happens chunk by chunk (``copy_``: the
same rounding as ``Tensor.to``), so a bf16 file fills an fp32 model with a bounded buffer.
:class:`DitFileSource` reads a single ComfyUI-style DiT file (``--dit-file``) under the model's
names, scaled fp8 weights as their values; :func:`open_dit` picks the DiT's source.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Optional

import torch

from wan_s2v_runner.loading.ckpt_tables import dit_files, read_safetensors_header
from wan_s2v_runner.loading.dit_file import inspect as inspect_dit_file

#: safetensors dtype names -> torch dtypes (the ones a Wan checkpoint can hold)
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
             "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
             "F8_E5M2": torch.float8_e5m2}
#: elements converted per chunk when the file's dtype differs from the destination's
CHUNK_ELEMENTS = 1 << 24
_PAGE = mmap.PAGESIZE


@dataclass
class ReadCounter:
    """Bytes read from checkpoint files, by purpose ("weights", "verify")."""
    by_purpose: dict[str, int] = field(default_factory=dict)

    def add(self, n: int, purpose: str = "weights") -> None:
        self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) + int(n)

    @property
    def total(self) -> int:
        return sum(self.by_purpose.values())


@dataclass(frozen=True)
class TensorEntry:
    key: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def _read_into(fd: int, buf: memoryview, offset: int) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise OSError(f"unexpected end of file reading {len(buf)} bytes at {offset}")
        got += n


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without copying."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


class CheckpointSource:
    """What lean loading reads from: a file's tensor table, and ``read_flat`` of any slice."""

    counter: ReadCounter

    def table(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Tensor name -> (dtype, shape), from the file (no tensor data read)."""
        raise NotImplementedError

    def read_flat(self, key: str, start: int, out: torch.Tensor, purpose: str = "weights") -> None:
        """Elements ``[start, start + out.numel())`` of tensor ``key`` (flattened, row-major)
        into the contiguous CPU tensor ``out``, converted to ``out``'s dtype."""
        raise NotImplementedError

    def tensor_bytes(self) -> int:
        """The bytes of all the file's tensors."""
        return sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.table().values())

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SafetensorsFiles(CheckpointSource):
    """The tensors of a safetensors checkpoint (one file, or shards with an index), by key."""

    def __init__(self, files: list[Path], counter: Optional[ReadCounter] = None):
        self.counter = counter if counter is not None else ReadCounter()
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            info = read_safetensors_header(path)  # validated against the file size
            for key, (dtype, shape) in info.tensors.items():
                self.entries[key] = TensorEntry(key, Path(path), ST_DTYPES[dtype], shape, info.starts[key])
        self._fds: dict[Path, int] = {}
        self._tmp = torch.empty(0, dtype=torch.uint8)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """One conversion buffer, reused (fresh memory per read would fault in every page again)."""
        if self._tmp.numel() < nbytes:
            self._tmp = torch.empty(nbytes, dtype=torch.uint8)
        return self._tmp[:nbytes]

    @classmethod
    def in_dir(cls, ckpt_dir, counter=None) -> "SafetensorsFiles":
        """The DiT files of a checkpoint directory."""
        return cls(dit_files(Path(ckpt_dir)), counter)

    def table(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {k: (e.dtype, e.shape) for k, e in self.entries.items()}

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._tmp = torch.empty(0, dtype=torch.uint8)

    def read_flat(self, key: str, start: int, out: torch.Tensor, purpose: str = "weights") -> None:
        e = self.entries[key]
        n = out.numel()
        if start < 0 or start + n > e.numel:
            raise ValueError(f"{key}: elements [{start}, {start + n}) outside its {e.numel}")
        fd, isz = self._fd(e.path), e.itemsize
        if e.dtype == out.dtype:
            _read_into(fd, _bytes_view(out), e.offset + start * isz)
            self.counter.add(n * isz, purpose)
            return
        tmp = self._buffer(min(n, CHUNK_ELEMENTS) * isz)
        for s in range(0, n, CHUNK_ELEMENTS):
            m = min(CHUNK_ELEMENTS, n - s)
            chunk = tmp[:m * isz]
            _read_into(fd, _bytes_view(chunk), e.offset + (start + s) * isz)
            out[s:s + m].copy_(chunk.view(e.dtype))
            self.counter.add(m * isz, purpose)


class DitFileSource(CheckpointSource):
    """A single DiT file (``--dit-file``) under the Wan names the model has: the prefix stripped,
    scales and markers set apart (:func:`wan_s2v_runner.loading.dit_file.inspect`), and a scaled
    fp8 weight read as its value, ``weight.to(float32) * scale`` (one scale, or one per output row),
    then converted to the destination's dtype. A full-precision destination therefore holds
    exactly what a full-precision file of those values would give it. ``layout``: the file read
    under other names (a ``--t5-file``: :mod:`wan_s2v_runner.loading.t5_file`), instead of a DiT's."""

    def __init__(self, path, counter: Optional[ReadCounter] = None, layout=None):
        self.layout = layout if layout is not None else inspect_dit_file(path)
        self.files = SafetensorsFiles([self.layout.path], counter)
        self.counter = self.files.counter
        for name, key in self.layout.keys.items():  # fp8 in a uint8 container: read as the fp8 it is
            want = ST_DTYPES[self.layout.dtypes[name]]
            if self.files.entries[key].dtype != want:
                self.files.entries[key] = replace(self.files.entries[key], dtype=want)
        self._scales: dict[str, torch.Tensor] = {}
        self._tmp = torch.empty(0, dtype=torch.float32)

    def table(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {name: (self.files.entries[key].dtype, self.files.entries[key].shape)
                for name, key in self.layout.keys.items()}

    def scale_of(self, name: str) -> torch.Tensor:
        if name not in self._scales:
            key = self.layout.scales[name]
            s = torch.empty(self.files.entries[key].numel, dtype=torch.float32)
            self.files.read_flat(key, 0, s)
            self._scales[name] = s
        return self._scales[name]

    def read_flat(self, key: str, start: int, out: torch.Tensor, purpose: str = "weights") -> None:
        fkey = self.layout.keys[key]
        if key not in self.layout.scales:
            self.files.read_flat(fkey, start, out, purpose)
            return
        scale, row = self.scale_of(key), row_length(self.files.entries[fkey].shape)
        n = out.numel()
        if self._tmp.numel() < min(n, CHUNK_ELEMENTS):
            self._tmp = torch.empty(min(n, CHUNK_ELEMENTS), dtype=torch.float32)
        for s in range(0, n, CHUNK_ELEMENTS):
            m = min(CHUNK_ELEMENTS, n - s)
            tmp = self._tmp[:m]
            self.files.read_flat(fkey, start + s, tmp, purpose)  # fp8 -> float32: exact
            if scale.numel() == 1:
                tmp.mul_(scale[0])
            else:
                per_row(tmp, start + s, row, scale, torch.Tensor.mul_)
            out[s:s + m].copy_(tmp)

    def read_stored(self, key: str, start: int, out: torch.Tensor, purpose: str = "weights") -> None:
        """Elements of ``key`` as the file stores them (an fp8 weight's bytes, no scale applied)."""
        self.files.read_flat(self.layout.keys[key], start, out, purpose)

    def close(self) -> None:
        self.files.close()
        self._tmp = torch.empty(0, dtype=torch.float32)


def row_slices(first: int, n: int, row: int) -> Iterator[tuple[int, int, int, int]]:
    """Elements ``[first, first + n)`` of a row-major [rows, row] tensor, cut at row ends:
    (lo, hi, r0, rows) with offsets relative to ``first``; ``rows`` > 0 means ``[lo, hi)`` is that
    many whole rows from row ``r0``, 0 that it is part of row ``r0``."""
    pos = 0
    lead = min(n, (-first) % row)  # the rest of a row begun before the slice
    if lead:
        yield 0, lead, first // row, 0
        pos = lead
    full = (n - pos) // row
    if full:
        yield pos, pos + full * row, (first + pos) // row, full
        pos += full * row
    if pos < n:
        yield pos, n, (first + pos) // row, 0


def row_length(shape) -> int:
    """Elements per row of a row-major tensor of ``shape`` (its first dimension's rows)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def per_row(flat: torch.Tensor, first: int, row: int, values: torch.Tensor, op) -> torch.Tensor:
    """``flat`` holds elements ``[first, first + len)`` of a row-major [rows, row] tensor: apply
    ``op`` (``torch.Tensor.mul_`` or ``div_``) with each element's row value, in place; returns ``flat``."""
    for lo, hi, r0, rows in row_slices(first, flat.numel(), row):
        if rows:
            op(flat[lo:hi].view(rows, row), values[r0:r0 + rows, None])
        else:
            op(flat[lo:hi], values[r0:r0 + 1])
    return flat


def open_dit(ckpt_dir, dit_file=None, counter: Optional[ReadCounter] = None) -> CheckpointSource:
    """The DiT's weights: ``dit_file`` (``--dit-file``) when given, else the checkpoint directory's."""
    return DitFileSource(dit_file, counter) if dit_file else SafetensorsFiles.in_dir(ckpt_dir, counter)


_libc = None


def _release_pages(t: torch.Tensor) -> None:
    """Hand the pages under ``t`` (a view into a private file mapping) back to the kernel: they
    stay in the page cache, not in this process's RSS."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = t.data_ptr()
    lo = (addr // _PAGE) * _PAGE
    hi = -(-(addr + t.numel() * t.element_size()) // _PAGE) * _PAGE
    _libc.madvise(lo, hi - lo, 4)  # MADV_DONTNEED


class PthFile(CheckpointSource):
    """A ``torch.save``'d state dict, memory-mapped (no tensor data read until sliced)."""

    def __init__(self, path, counter: Optional[ReadCounter] = None):
        self.path = Path(path)
        self.counter = counter if counter is not None else ReadCounter()
        self.tensors: dict[str, torch.Tensor] = torch.load(self.path, map_location="cpu", mmap=True,
                                                           weights_only=True)

    def table(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {k: (t.dtype, tuple(t.shape)) for k, t in self.tensors.items()}

    def read_flat(self, key: str, start: int, out: torch.Tensor, purpose: str = "weights") -> None:
        src = self.tensors[key]
        if not src.is_contiguous():
            raise ValueError(f"{self.path.name}: {key} is not stored contiguously")
        n = out.numel()
        part = src.reshape(-1)[start:start + n]
        out.copy_(part)
        self.counter.add(n * src.element_size(), purpose)
        _release_pages(part)

    def close(self) -> None:
        self.tensors = {}


def sample_windows(keys_numels: Iterator[tuple[str, int]], width: int = 64) -> list[tuple[str, int, int]]:
    """(key, start, count): one deterministic window of ``width`` elements per tensor, at a
    position that depends on the key alone (every rank picks the same windows)."""
    import zlib
    out = []
    for key, numel in keys_numels:
        count = min(width, numel)
        start = zlib.crc32(key.encode()) % (numel - count + 1)
        out.append((key, start, count))
    return out
