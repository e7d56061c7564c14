"""Reading checkpoint files without reading their tensors (headers and shapes only).

* safetensors: the first 8 bytes are the little-endian header length N, then N bytes of JSON
  ``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``, then the
  data. A complete file is exactly ``8 + N + max(end)`` bytes and every tensor's
  ``end - start == numel * itemsize``; the safetensors library refuses anything else.
* ``.pth`` (T5, VAE, wav2vec2's ``.bin``): torch's zip format, whose ``data.pkl`` is the small
  pickled record of each tensor's storage type, size and stride (the data are other members).
  :func:`read_pth_shapes` unpickles that record alone with an unpickler that knows only the names
  a plain state dict uses (:class:`_RecordUnpickler`), so the launcher's checks need not import
  torch (a second of CPU in every ``wan-s2v run``); anything else it meets (another format, a
  global it does not know) is read as before, by ``torch.load(mmap=True, weights_only=True)``.

The file names of a Wan2.2-S2V-14B checkpoint directory are in :mod:`wan_s2v_runner.shared.ckpt_layout`.
"""
from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
               "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
               "F64": 8, "C64": 8}
MAX_HEADER = 100 * 2**20  # the safetensors library's own limit


class CheckpointFileError(ValueError):
    """A file is unreadable or inconsistent; the message is a one-line finding."""


@dataclass
class SafetensorsInfo:
    path: Path
    file_size: int
    header_len: int
    data_bytes: int  # max end offset
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # name -> (dtype, shape)
    starts: dict[str, int] = field(default_factory=dict)  # name -> byte offset in the file
    metadata: dict[str, str] = field(default_factory=dict)  # the header's "__metadata__" (str -> str)

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors.values())


def read_safetensors_header(path: Path) -> SafetensorsInfo:
    """Parse and validate a safetensors header against the file size. Reads no tensor data."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise CheckpointFileError(f"{path.name} is {size} bytes: too short for a safetensors header")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER or n > size - 8:
            raise CheckpointFileError(
                f"{path.name}: header length field says {n} bytes but the file has {size} bytes "
                "(truncated or not a safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CheckpointFileError(f"{path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path.name}: header is not a JSON object")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    starts: dict[str, int] = {}
    max_end = 0
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise CheckpointFileError(f"{path.name}: header's __metadata__ is not a JSON object")
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(int(x) for x in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointFileError(f"{path.name}: malformed header entry for {name!r}") from None
        if dtype not in DTYPE_BYTES:
            raise CheckpointFileError(f"{path.name}: tensor {name!r} has unknown dtype {dtype!r}")
        want = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - start != want or start < 0:
            raise CheckpointFileError(f"{path.name}: tensor {name!r} spans {end - start} bytes, its "
                                      f"{dtype} shape {list(shape)} needs {want}")
        tensors[name] = (dtype, shape)
        starts[name] = 8 + n + start
        max_end = max(max_end, end)
    expected = 8 + n + max_end
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise CheckpointFileError(f"{path.name} is {size} bytes but its header describes {expected} "
                                  f"(8 + {n} header + {max_end} data): {what}")
    return SafetensorsInfo(path, size, n, max_end, tensors, starts, {str(k): str(v) for k, v in metadata.items()})


def read_index(path: Path) -> dict[str, str]:
    """weight_map of a ``*.safetensors.index.json`` (tensor name -> shard file name)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        wm = data["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"{Path(path).name}: not a safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointFileError(f"{Path(path).name}: empty weight_map")
    return {str(k): str(v) for k, v in wm.items()}


def dit_files(ckpt: Path) -> list[Path]:
    """The DiT's safetensors files in a checkpoint directory: the shards its index names, or the
    single file. Raises CheckpointFileError for a bad index."""
    from wan_s2v_runner.shared.ckpt_layout import DIT_INDEX, DIT_WEIGHTS

    ckpt = Path(ckpt)
    idx = ckpt / DIT_INDEX
    return [ckpt / f for f in (sorted(set(read_index(idx).values())) if idx.is_file() else [DIT_WEIGHTS])]


def dit_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """DiT tensor name -> shape from the safetensors headers (single file or sharded with an
    index). Reads no tensor data; raises CheckpointFileError/OSError. With a ``--dit-file``:
    :func:`wan_s2v_runner.loading.dit_file.dit_shapes`."""
    out: dict[str, tuple[int, ...]] = {}
    for f in dit_files(ckpt):
        out.update({k: shape for k, (_, shape) in read_safetensors_header(f).tensors.items()})
    return out


@dataclass(frozen=True)
class _DType:
    name: str
    itemsize: int  # bytes per element


#: torch's storage classes as a state dict's record names them -> the dtype
_STORAGE_DTYPES = {"FloatStorage": _DType("float32", 4), "DoubleStorage": _DType("float64", 8),
                   "HalfStorage": _DType("float16", 2), "BFloat16Storage": _DType("bfloat16", 2),
                   "LongStorage": _DType("int64", 8), "IntStorage": _DType("int32", 4),
                   "ShortStorage": _DType("int16", 2), "CharStorage": _DType("int8", 1),
                   "ByteStorage": _DType("uint8", 1), "BoolStorage": _DType("bool", 1),
                   "ComplexFloatStorage": _DType("complex64", 8), "ComplexDoubleStorage": _DType("complex128", 16)}


class _Unknown(Exception):
    """The record holds something :class:`_RecordUnpickler` does not read: torch reads the file."""


@dataclass(frozen=True)
class _Storage:
    dtype: _DType
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRecord:
    shape: tuple[int, ...]
    dtype: str


def _rebuild_tensor_v2(storage, offset, size, stride, *rest):
    """A tensor's record, after the bounds torch.load checks: sizes not negative, the last element
    inside its storage."""
    if not isinstance(storage, _Storage) or not all(isinstance(n, int) and n >= 0 for n in (offset, *size)):
        raise _Unknown("not a plain tensor record")
    if len(size) != len(stride):
        raise _Unknown("size and stride differ in length")
    if all(size) and offset + sum((n - 1) * st for n, st in zip(size, stride)) >= storage.numel:
        raise _Unknown("a tensor past its storage")
    return _TensorRecord(tuple(size), storage.dtype.name)


class _RecordUnpickler(pickle.Unpickler):
    """Unpickles a state dict's ``data.pkl`` into :class:`_TensorRecord` values, building nothing
    but dicts, tuples and these records: the only globals it resolves are the ordered dict and
    torch's tensor rebuild and storage names (as ``weights_only=True`` allows, a narrower set)."""

    def __init__(self, file):
        super().__init__(file)
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda *args: _rebuild_tensor_v2(*args)  # a fresh callable: BUILD cannot touch ours
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _Unknown(f"{module}.{name}")

    def persistent_load(self, pid):
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _DType)
                and isinstance(pid[2], str) and isinstance(pid[4], int)):
            self.storages[pid[2]] = _Storage(pid[1], pid[2], pid[4])
            return self.storages[pid[2]]
        raise _Unknown(f"persistent id {pid!r:.60}")


def _pth_record_shapes(path: str) -> Optional[dict[str, tuple[tuple[int, ...], str]]]:
    """:func:`read_pth_shapes` without torch, or None where torch must read the file (another
    format, a name the unpickler does not know, a storage whose data member is missing or short:
    torch then reads it, and refuses what it refuses, with its own finding)."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                return None
            unpickler = _RecordUnpickler(io.BytesIO(z.read(pkl[0])))
            sd = unpickler.load()
            if type(sd) not in (dict, collections.OrderedDict):
                return None
            prefix = pkl[0].rsplit("/", 1)[0]
            for st in unpickler.storages.values():
                if z.getinfo(f"{prefix}/data/{st.key}").file_size < st.numel * st.dtype.itemsize:
                    return None
            return {k: (v.shape, v.dtype) for k, v in dict.items(sd) if type(v) is _TensorRecord}
    except Exception:  # noqa: BLE001 - not this format, or not only plain tensors: torch reads it
        return None


def read_pth_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of a plain state-dict ``.pth``: its record read without torch
    (:func:`_pth_record_shapes`), or via ``torch.load(mmap=True, weights_only=True)`` (no tensor
    data read either way)."""
    path = os.fspath(path)
    fast = _pth_record_shapes(path)
    if fast is not None:
        return fast
    import torch

    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointFileError(f"{Path(path).name} does not load with torch.load(weights_only=True, "
                                  f"mmap=True): {msg}") from None
    if not isinstance(sd, dict):
        raise CheckpointFileError(f"{Path(path).name}: expected a state dict, got {type(sd).__name__}")
    out = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()
           if isinstance(v, torch.Tensor)}
    del sd
    return out


def pth_params(shapes: dict[str, tuple[tuple[int, ...], str]]) -> int:
    return sum(math.prod(s) for s, _ in shapes.values())


def find_entry(ckpt: Path, alternatives: tuple[str, ...]) -> Optional[Path]:
    for rel in alternatives:
        p = ckpt / rel
        if p.is_file():
            return p
    return None
