"""The streamed DiT's bytes in a file on disk, memory-mapped (``--dit-stream-from page-cache``).

A streamed DiT held in memory (``lean_load.node_shared_weights``: one packed buffer, pinned
whole) needs RAM for all of it: 30.4 GiB in bf16, 16.1 GiB in fp8, which a 32 GB machine beside
the encoders does not have. Here its packed bytes (``lean_load._layout``: the parameters as the
stream copies them, after fp8's quantization and the LoRAs' merge) are written **once** to a file
in the cache directory (``shared.stream_source.cache_dir``) and mapped read-only and shared
(:func:`map_into`: charged nothing against the commit limit): the parameters are views
of the mapping, its clean pages are page cache, which the kernel keeps while memory allows and
reads back from the disk when it dropped them (LightX2V's ``lazy_load``, one file).

* **Named by what decides its bytes** (:func:`cache_key`): the DiT files' fingerprint
  (``fingerprint.source_digest``: the tensor table and a window of every tensor, the identity a
  server's fleet uses) with each file's name and size, ``--dit-file``, ``--dit-quant``, every
  LoRA's sha256 and strength, the parameter dtype and the packed layout. A later run with the same
  key maps the file without reading the checkpoint (the load report says ``reused``).
* **Never half used**: written under a temporary name (``shared.atomic``), fsynced, renamed; the
  file ends in a trailer (its key, its size, fp8's row scales, a magic) that a reader checks, so a
  truncated or foreign file is rewritten, never mapped. One writer at a time per file (a lock
  file); the writer removes what a crashed writer on this host left.
* **A full disk** fails with one line (the cause, and the fix: free space, or
  ``$WAN_S2V_DIT_CACHE_DIR`` elsewhere) and no temporary left behind.
* **One writer per node**: local rank 0 writes it (or finds it), the node's other ranks wait
  (an all-gather on the load's group, which carries the writer's path or its error) and map it.

May import: shared, the loading modules (torch).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from wan_s2v_runner.loading import lean_load
from wan_s2v_runner.shared import atomic

log = logging.getLogger("wan_s2v.dit_cache")

#: bump when the file's layout changes: older files are then never matched
FORMAT = 1
MAGIC = b"wan-s2v-dit-v1\0\0"  # 16 bytes, the file's last
_TAIL = struct.Struct("<Q16s")  # the trailer's JSON length, the magic
#: the trailer starts on a page boundary after the parameters
_PAGE = 4096


class DitCacheError(RuntimeError):
    """The cache file could not be written or read (one line: the cause and the fix)."""


@dataclass
class CacheFile:
    """A checked cache file: its path, the parameters' bytes (what is mapped), fp8's row scales
    (weight name -> float32 [rows]) and what this process did (``written`` or ``reused``)."""

    path: Path
    nbytes: int
    scales: dict[str, torch.Tensor]
    action: str = "reused"
    seconds: float = 0.0


def layout_digest(layout) -> str:
    h = hashlib.sha256()
    for name, off, dtype, shape in layout:
        h.update(f"{name}|{off}|{dtype}|{tuple(shape)};".encode())
    return h.hexdigest()


def _files_of(source) -> list[Path]:
    """The files a checkpoint source reads (``SafetensorsFiles``, a ``DitFileSource``'s)."""
    inner = getattr(source, "files", source)
    entries = getattr(inner, "entries", {}) or {}
    return sorted({Path(e.path) for e in entries.values()})


def cache_key(source, layout, *, dit_file, quant, loras, param_dtype) -> str:
    """The digest naming a cache file: everything that decides its bytes (see the module's
    docstring). ``source``: the DiT's full-precision source (not fp8's wrapper)."""
    from wan_s2v_runner.loading.fingerprint import source_digest
    from wan_s2v_runner.shared.media import sha256_file

    h = hashlib.sha256()
    h.update(f"format {FORMAT};dit {source_digest(source)};".encode())
    for f in _files_of(source):
        h.update(f"file {f.name} {f.stat().st_size};".encode())
    h.update(f"dit_file {dit_file is not None};quant {getattr(quant, 'value', quant)};dtype {param_dtype};".encode())
    for ref in loras:
        h.update(f"lora {sha256_file(Path(ref.path))} {float(ref.strength)!r};".encode())
    h.update(f"layout {layout_digest(layout)}".encode())
    return h.hexdigest()[:32]


def path_for(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / f"dit-{key}.bin"


# --------------------------------------------------------------------------- reading
def read(path: Path, nbytes: int, layout_sha: str, key: Optional[str] = None) -> Optional[CacheFile]:
    """The cache file at ``path`` when it is whole and holds ``nbytes`` of parameters in the
    layout ``layout_sha`` (and ``key``, when given); else None."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _TAIL.size:
                return None
            f.seek(size - _TAIL.size)
            meta_len, magic = _TAIL.unpack(f.read(_TAIL.size))
            if magic != MAGIC or meta_len > size - _TAIL.size:
                return None
            f.seek(size - _TAIL.size - meta_len)
            meta = json.loads(f.read(meta_len).decode("utf-8"))
            if (meta.get("format") != FORMAT or meta.get("nbytes") != nbytes or meta.get("layout") != layout_sha
                    or (key is not None and meta.get("key") != key) or meta.get("at") != size - _TAIL.size - meta_len):
                return None
            scales = {}
            for name, rows, off in meta.get("scales", []):
                f.seek(off)
                s = torch.empty(rows, dtype=torch.float32)
                if f.readinto(memoryview(s.numpy()).cast("B")) != rows * 4:
                    return None
                scales[name] = s
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CacheFile(Path(path), nbytes, scales)


def map_into(model, cache: CacheFile, layout) -> None:
    """``model``'s (meta) parameters as views of the file's read-only shared mapping (nothing is
    read until a page is touched; nothing is copied). Read-only and shared, not private: a private
    writable mapping (``UntypedStorage.from_file(path, False)``) is charged whole against the
    kernel's commit limit (measured: 2 GiB of ``Committed_AS`` for a 2 GiB file), which fails
    under strict overcommit, or where the file is near the RAM (WSL2: half the host's); a
    read-only shared one is charged nothing. Nothing writes the weights (a write would fault)."""
    import mmap
    import warnings

    with open(cache.path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), cache.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # "non-writable buffer": never written (see above)
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()  # keeps the mapping alive
    model.load_state_dict(lean_load._views(storage, layout), strict=True, assign=True)


# --------------------------------------------------------------------------- writing
def no_space(directory: Path, need: int, free: Optional[int]) -> str:
    have = f" ({free / 1e9:.1f} GB free)" if free is not None else ""
    return (f"the DiT's page-cache file needs {need / 1e9:.1f} GB on {directory}{have}. Fix: free space there, "
            "or point $WAN_S2V_DIT_CACHE_DIR at a disk with room (or use --dit-stream-from memory)")


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _write_body(tmp: Path, layout, nbytes: int, source, deltas, scales_of: Optional[Callable[[], dict]],
                key: str) -> None:
    """The parameters read from ``source`` tensor by tensor (``deltas``: LoRAs merged as
    ``patches.lora_merge`` merges them), each at its layout offset, then the trailer."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        merged = set(deltas.names) if deltas is not None else set()
        with torch.no_grad():
            for name, off, dtype, shape in layout:
                t = torch.empty(shape, dtype=dtype)  # one tensor at a time in memory
                if t.numel() == 0:
                    continue
                source.read_flat(name, 0, t.view(-1))
                if name in merged:
                    t.copy_((t.float() + deltas.delta(name)).to(t.dtype))
                _pwrite(fd, _bytes_of(t), off)
        scales = {n: s.reshape(-1).float().contiguous() for n, s in (scales_of() if scales_of else {}).items()}
        pos = -(-nbytes // _PAGE) * _PAGE
        entries = []
        for n in sorted(scales):
            entries.append([n, scales[n].numel(), pos])
            _pwrite(fd, _bytes_of(scales[n]), pos)
            pos += scales[n].numel() * 4
        meta = {"format": FORMAT, "key": key, "nbytes": nbytes, "layout": layout_digest(layout), "scales": entries,
                "at": pos}
        text = json.dumps(meta).encode()
        _pwrite(fd, memoryview(text + _TAIL.pack(len(text), MAGIC)), pos)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o444)  # the mapping is private: nothing writes it back, and nothing should write it


def _remove_leftovers(dest: Path) -> list[Path]:
    """Temporaries of ``dest`` a dead writer on this host left (the lock is held: no live writer)."""
    gone = []
    for p in dest.parent.glob(f".{dest.stem}.*.{atomic.HOST}-*{dest.suffix}"):
        try:
            pid = int(p.name[len(dest.stem) + 2:].split(".", 1)[0])
            os.kill(pid, 0)
            if pid != os.getpid():
                continue  # alive: not ours to remove
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        p.unlink(missing_ok=True)
        gone.append(p)
    return gone


def ensure(cache_dir: Path, key: str, layout, nbytes: int, source, deltas=None,
           scales_of: Optional[Callable[[], dict]] = None) -> CacheFile:
    """The cache file for ``key``: found and checked, or written (one writer at a time: a lock
    file beside it). ``source``: what the parameters are read from (fp8's wrapper: quantized as
    read); ``deltas``: LoRAs to merge as written (full precision; fp8's source merges its own);
    ``scales_of()``: fp8's row scales once everything is read. Raises :class:`DitCacheError`."""
    cache_dir = Path(cache_dir)
    dest, sha = path_for(cache_dir, key), layout_digest(layout)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(cache_dir / f".dit-{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DitCacheError(f"cannot use the DiT cache directory {cache_dir}: {e.strerror or e}. Fix: point "
                            "$WAN_S2V_DIT_CACHE_DIR at a writable directory (or use --dit-stream-from memory)") from e
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run writing the same file: wait, then use it
        found = read(dest, nbytes, sha, key)
        if found is not None:
            return found
        if dest.exists():
            log.warning("%s is not a whole cache file of this DiT: writing it again", dest)
        for p in _remove_leftovers(dest):
            log.warning("removed %s, a cache file a stopped run left half-written", p.name)
        need = -(-nbytes // _PAGE) * _PAGE + 64 * 2**20
        free = shutil.disk_usage(cache_dir).free
        if free < need:
            raise DitCacheError(no_space(cache_dir, need, free))
        t0 = time.perf_counter()
        try:
            atomic.atomic_write(dest, lambda tmp: _write_body(tmp, layout, nbytes, source, deltas, scales_of, key),
                                durable=True)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DitCacheError(no_space(cache_dir, need, None)) from e
            raise DitCacheError(f"writing the DiT's page-cache file {dest} failed: {e}. Fix: check the disk, or "
                                "point $WAN_S2V_DIT_CACHE_DIR elsewhere (or use --dit-stream-from memory)") from e
        written = read(dest, nbytes, sha, key)
        if written is None:
            raise DitCacheError(f"the DiT's page-cache file {dest} does not read back whole after writing it. Fix: "
                                "check the disk, or point $WAN_S2V_DIT_CACHE_DIR elsewhere")
        written.action, written.seconds = "written", time.perf_counter() - t0
        return written
    finally:
        os.close(lock)  # releases the lock


# --------------------------------------------------------------------------- a rank's side
def _node() -> tuple[str, int, int]:
    """(this node, the local rank, the local ranks), as torchrun says."""
    return (os.environ.get("GROUP_RANK", "0"), int(os.environ.get("LOCAL_RANK", 0)),
            max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def _size(*paths) -> int:
    for p in paths:
        try:
            return Path(p).stat().st_size
        except OSError:
            continue
    return 0


def encoder_bytes_to_come(ckpt_dir) -> int:
    """Host bytes the encoders still take once the node's ranks have loaded T5 and the VAE (the DiT
    is read after them): wav2vec2's fp32 weights (its file) and one window of its encode
    (``shared.encoder_placement.host_bytes``)."""
    from wan_s2v_runner.shared import ckpt_layout, encoder_placement
    ckpt = Path(ckpt_dir)
    out = _size(ckpt / ckpt_layout.W2V_WEIGHTS, ckpt / ckpt_layout.W2V_WEIGHTS_BIN)
    return out + encoder_placement.host_bytes(encoder_placement.WINDOW_S)


def resolve(want, dit_bytes: int, slot_bytes: int, ckpt_dir, group=None) -> tuple:
    """(where, why) a streamed DiT's bytes live: ``want`` unless it is ``auto``, then
    :func:`wan_s2v_runner.shared.stream_source.choose` on what each node's local rank 0 measures
    (MemAvailable, after a barrier: the node's ranks have loaded their encoders), the same answer
    on every rank of ``group``: the page cache when any node needs it (every rank then takes the
    same collectives)."""
    import torch.distributed as dist

    from wan_s2v_runner.shared.layout import StreamSource
    from wan_s2v_runner.shared.procfs import mem_available
    from wan_s2v_runner.shared.stream_source import choose
    want = StreamSource(want)
    if want is not StreamSource.AUTO:
        return want, f"{want.value}: --dit-stream-from {want.value}"
    node, local_rank, local_ranks = _node()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
        infos: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, (node, local_rank, mem_available()), group=group)
        readings = {n: r for n, lr, r in infos if lr == 0}
    else:
        readings = {node: mem_available()}
    rest = encoder_bytes_to_come(ckpt_dir)
    answers = {n: choose(dit_bytes, rest, r, local_ranks, slot_bytes) for n, r in sorted(readings.items())}
    paged = [(n, why) for n, (where, why) in answers.items() if where is StreamSource.PAGE_CACHE]
    if paged:
        n, why = paged[0]
        return StreamSource.PAGE_CACHE, f"auto: {why}" + (f" (node {n})" if len(answers) > 1 else "")
    return StreamSource.MEMORY, "auto: " + answers.get(node, next(iter(answers.values())))[1]


def node_cached_weights(model, source, report, what: str, *, cache_dir, key_of: Callable, deltas=None,
                        scales_of: Optional[Callable[[], dict]] = None, group=None, why: str = "") -> dict:
    """Fill ``model``'s (meta) parameters with views of its cache file's read-only mapping: the
    node's local rank 0 finds or writes the file (:func:`ensure`; ``key_of(layout)`` names it),
    the node's other ranks wait for it (an all-gather on ``group`` carrying its path, or its
    error, which every rank then raises) and map it. Returns fp8's row scales (weight name ->
    float32 [rows, 1]; empty without fp8), read from the file."""
    import torch.distributed as dist

    from wan_s2v_runner.shared.stream_source import cache_dir as default_cache_dir
    layout, total = lean_load._layout(model)
    sha = layout_digest(layout)
    node, local_rank, _ = _node()
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    status, error, found = None, None, None
    if local_rank == 0:
        try:
            found = ensure(directory, key_of(layout), layout, total, source, deltas, scales_of)
            status = {"path": str(found.path), "action": found.action, "seconds": round(found.seconds, 3)}
        except Exception as e:  # noqa: BLE001 - every rank of the node raises it (below)
            error = e
            status = {"error": str(e) if isinstance(e, DitCacheError) else f"{type(e).__name__}: {e}"}
    mine = status
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        infos: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, (node, local_rank, status), group=group)
        mine = next((st for n, lr, st in infos if n == node and lr == 0), None)
    if error is not None:
        raise error
    if mine is None:
        raise DitCacheError("no local rank 0 on this node writes the DiT's page-cache file. Fix: launch with "
                            "torchrun's local ranks (or use --dit-stream-from memory)")
    if "error" in mine:
        raise DitCacheError(f"local rank 0 could not provide the DiT's page-cache file: {mine['error']}")
    cache = found if found is not None else read(Path(mine["path"]), total, sha)
    if cache is None:
        raise DitCacheError(f"{mine['path']}, the DiT's page-cache file local rank 0 gave, does not read whole here. "
                            "Fix: a cache directory every rank of the node sees alike ($WAN_S2V_DIT_CACHE_DIR)")
    map_into(model, cache, layout)
    action = mine["action"] if local_rank == 0 else f"mapped ({mine['action']} by local rank 0)"
    report.strategy[what] = "page-cache"
    report.strategy[f"{what}_cache"] = {"path": mine["path"], "bytes": total, "action": action,
                                        "write_s": mine["seconds"], "why": why}
    log.info("%s: %s %s (%.2f GB)%s", what, action, mine["path"], total / 1e9,
             f" in {mine['seconds']:.1f} s" if mine["action"] == "written" else "")
    return {n: s.reshape(-1, 1) for n, s in cache.scales.items()}
