"""Reading checkpoint files without reading their tensors (headers and shapes only).

* safetensors: the first 8 bytes are the little-endian header length N, then N bytes of JSON
  ``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``, then the
  data. A complete file is exactly ``8 + N + max(end)`` bytes and every tensor's
  ``end - start == numel * itemsize``; the safetensors library refuses anything else.
* ``.pth`` (T5, VAE): ``torch.load(mmap=True, weights_only=True)`` maps the zip and unpickles
  only the small record of tensor metadata (milliseconds for the 11 GB T5 file).

The file names of a Wan2.2-S2V-14B checkpoint directory are in :mod:`wan_s2v_runner.shared.ckpt_layout`.
"""
from __future__ import annotations

import json
import math
import os
import struct
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


def read_pth_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of a plain state-dict ``.pth``, via mmap (no tensor data read)."""
    import torch

    path = os.fspath(path)
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
