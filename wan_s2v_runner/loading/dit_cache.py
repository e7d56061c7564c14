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
* **Bounded** (``shared.cache_budget``): before writing a file, the least recently used others
  go until the files fit the budget (``--dit-cache-max``; default a quarter of the disk) and the
  disk keeps its floor; a file any process maps is never removed (its mark: a shared ``flock``
  held as long as the mapping lives, ``shared.dit_files``), and its last use (atime) is set
  each time a run finds it. The trailer says what the file is for (``about``: checkpoint,
  quantization, LoRAs, dtype), which ``wan-s2v cache`` lists.
* **A full disk** fails with one line (the cause, and the fix: free space, ``wan-s2v cache clear``,
  or ``$WAN_S2V_DIT_CACHE_DIR`` elsewhere) and no temporary left behind.
* **One writer per node**: local rank 0 writes it (or finds it), the node's other ranks wait
  (an all-gather on the load's group, which carries the writer's path or its error) and map it.

May import: shared, the loading modules (torch).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from wan_s2v_runner.loading import lean_load
from wan_s2v_runner.shared import atomic, cache_budget, cache_dirs, dit_files

log = logging.getLogger("wan_s2v.dit_cache")

#: the file's format (``shared.dit_files``: one definition for its writer and its readers)
FORMAT, MAGIC, _TAIL, _PAGE = dit_files.FORMAT, dit_files.MAGIC, dit_files.TAIL, dit_files.PAGE
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class DitCacheError(RuntimeError):
    """The cache file could not be written or read (one line: the cause and the fix)."""


@dataclass
class CacheFile:
    """A checked cache file: its path, the parameters' bytes (what is mapped), fp8's row scales
    (weight name -> float32 [rows]) and what this process did (``written`` or ``reused``; the
    files it ``evicted`` first). ``mark``: a descriptor marking it used (``shared.dit_files``)
    until it is mapped (:func:`map_into`) or let go (:meth:`release`)."""

    path: Path
    nbytes: int
    scales: dict[str, torch.Tensor]
    action: str = "reused"
    seconds: float = 0.0
    evicted: list = field(default_factory=list)
    mark: Optional[int] = None

    def release(self) -> None:
        if self.mark is not None:
            os.close(self.mark)
            self.mark = None

    def __del__(self):
        self.release()


@dataclass(frozen=True)
class DitCachePlace:
    """Where the DiT's cache files go and how much they may take: the directory
    (``shared.cache_dirs``' rule) and the budget (``shared.cache_budget``)."""

    directory: Path
    budget: cache_budget.Budget = cache_budget.Budget()

    @classmethod
    def of(cls, cache_dir=None, budget=None, env=None) -> "DitCachePlace":
        """``cache_dir``: the caches' root setting (the spec's ``cache_dir``); ``budget``: the
        spec's ``dit_cache_max`` (else ``$WAN_S2V_DIT_CACHE_MAX``); ``env``: this process's."""
        env = os.environ if env is None else env
        text = budget if budget is not None else env.get(cache_budget.BUDGET_ENV)
        try:
            parsed = cache_budget.parse(text)
        except cache_budget.BudgetError as e:
            raise DitCacheError(f"the DiT cache's budget (--dit-cache-max, ${cache_budget.BUDGET_ENV}): {e}. Fix: "
                                "correct it") from None
        return cls(cache_dirs.dit_dir(cache_dir, env), parsed)


def place_of(spec) -> DitCachePlace:
    """A rank group's place for its DiT cache files (``LoadSettings.of`` hands it to the load)."""
    return DitCachePlace.of(getattr(spec, "cache_dir", None), getattr(spec, "dit_cache_max", None))


class CacheKey(str):
    """A cache file's name digest (:func:`cache_key`) with what a person needs to read it
    (``about``: written into the file's trailer)."""

    about: dict

    def __new__(cls, digest: str, about: Optional[dict] = None):
        key = super().__new__(cls, digest)
        key.about = dict(about or {})
        return key


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


def cache_key(source, layout, *, dit_file, quant, loras, param_dtype) -> CacheKey:
    """The digest naming a cache file: everything that decides its bytes (see the module's
    docstring), with what it is for in words (``about``: the checkpoint, ``--dit-file``, the
    quantization, the LoRAs, the dtype). ``source``: the DiT's full-precision source (not fp8's
    wrapper)."""
    from wan_s2v_runner.loading.fingerprint import source_digest
    from wan_s2v_runner.shared.media import sha256_file

    h = hashlib.sha256()
    digest = source_digest(source)
    h.update(f"format {FORMAT};dit {digest};".encode())
    files = _files_of(source)
    for f in files:
        h.update(f"file {f.name} {f.stat().st_size};".encode())
    quant_name = getattr(quant, "value", quant)
    h.update(f"dit_file {dit_file is not None};quant {quant_name};dtype {param_dtype};".encode())
    about_loras = []
    for ref in loras:
        sha = sha256_file(Path(ref.path))
        h.update(f"lora {sha} {float(ref.strength)!r};".encode())
        about_loras.append({"path": str(Path(ref.path).absolute()), "strength": float(ref.strength), "sha256": sha,
                            "bytes": Path(ref.path).stat().st_size})
    h.update(f"layout {layout_digest(layout)}".encode())
    parents = {str(f.parent.absolute()) for f in files}
    about = {"checkpoint": parents.pop() if len(parents) == 1 else None,
             "dit_file": str(Path(dit_file).absolute()) if dit_file is not None else None,
             "dit_files": [[f.name, f.stat().st_size] for f in files], "dit_digest": str(digest)[:16],
             "quant": str(quant_name), "dtype": _DTYPES.get(param_dtype, str(param_dtype)), "loras": about_loras}
    return CacheKey(h.hexdigest()[:32], about)


def path_for(cache_dir: Path, key: str) -> Path:
    return dit_files.path_for(cache_dir, key)


# --------------------------------------------------------------------------- reading
def read(path: Path, nbytes: int, layout_sha: str, key: Optional[str] = None) -> Optional[CacheFile]:
    """The cache file at ``path`` when it is whole and holds ``nbytes`` of parameters in the
    layout ``layout_sha`` (and ``key``, when given); else None."""
    try:
        with open(path, "rb") as f:
            meta = dit_files.read_meta(f, os.fstat(f.fileno()).st_size)
            if (meta is None or meta.get("format") != FORMAT or meta.get("nbytes") != nbytes
                    or meta.get("layout") != layout_sha or (key is not None and meta.get("key") != str(key))):
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
    read until a page is touched; nothing is copied), marked used for as long as the mapping lives
    (``shared.dit_files.mark``: the mapping keeps a duplicate of the marked descriptor; an
    eviction passes it by). Read-only and shared, not private: a private
    writable mapping (``UntypedStorage.from_file(path, False)``) is charged whole against the
    kernel's commit limit (measured: 2 GiB of ``Committed_AS`` for a 2 GiB file), which fails
    under strict overcommit, or where the file is near the RAM (WSL2: half the host's); a
    read-only shared one is charged nothing. Nothing writes the weights (a write would fault)."""
    import mmap
    import warnings

    fd = os.open(cache.path, os.O_RDONLY)
    try:
        dit_files.mark(fd)
        mapped = mmap.mmap(fd, cache.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # dups fd: the mark
    finally:
        os.close(fd)
        cache.release()  # the mapping's own mark holds it now
    with warnings.catch_warnings():  # "non-writable buffer": never written (see above)
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()  # keeps the mapping alive
    model.load_state_dict(lean_load._views(storage, layout), strict=True, assign=True)


# --------------------------------------------------------------------------- writing
def no_space(directory: Path, need: int, free: Optional[int], held: int = 0) -> str:
    have = f" ({free / 1e9:.1f} GB free)" if free is not None else ""
    using = f"; {held / 1e9:.1f} GB of cache files there are in use by running groups" if held else ""
    return (f"the DiT's page-cache file needs {need / 1e9:.1f} GB on {directory}{have}{using}. Fix: free space there "
            "(wan-s2v cache lists what it keeps; wan-s2v cache clear), or point --cache-dir or $WAN_S2V_DIT_CACHE_DIR "
            "at a disk with room (or use --dit-stream-from memory)")


def over_budget(directory: Path, need: int, budget: cache_budget.Budget, limit: int, held: int) -> str:
    using = f" beside {held / 1e9:.1f} GB of files in use by running groups" if held else ""
    return (f"the DiT's page-cache file needs {need / 1e9:.1f} GB{using}, over the DiT cache's budget of "
            f"{limit / 1e9:.1f} GB in {directory}. Fix: raise --dit-cache-max ($WAN_S2V_DIT_CACHE_MAX; now "
            f"{budget.describe()}), or --dit-quant fp8 (half the file), or use --dit-stream-from memory")


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
        about = {**getattr(key, "about", {}), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": atomic.HOST}
        meta = {"format": FORMAT, "key": str(key), "nbytes": nbytes, "layout": layout_digest(layout),
                "scales": entries, "at": pos, "about": about}
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


def _make_room(cache_dir: Path, dest: Path, need: int, budget: cache_budget.Budget) -> list[str]:
    """Evict the least recently used cache files (never one in use, nor ``dest``'s own) until
    ``need`` more bytes fit ``budget`` and the disk keeps its floor (``shared.cache_budget``);
    the names of those it removed. Raises :class:`DitCacheError` (nothing removed) when even
    every file not in use would not make room."""
    usage = shutil.disk_usage(cache_dir)
    files = {f.path.name: f for f in dit_files.scan(cache_dir) if f.path != dest}
    held = [cache_budget.Held(n, f.bytes, f.last_use, f.in_use) for n, f in files.items()]
    limit = budget.limit(usage.total, need)
    plan = cache_budget.plan_room(held, need, limit, usage.free)
    in_use = sum(h.bytes for h in held if h.in_use)
    if plan.short is cache_budget.Short.BUDGET:
        raise DitCacheError(over_budget(cache_dir, need, budget, limit, in_use))
    if plan.short is cache_budget.Short.DISK:
        raise DitCacheError(no_space(cache_dir, need + cache_budget.DISK_FLOOR, usage.free, in_use))
    gone = []
    for h in plan.evict:
        f = files[h.name]
        if dit_files.remove(f):
            gone.append(h.name)
            log.warning("evicted %s (%.2f GB, %s) from the DiT cache: %s", h.name, h.bytes / 1e9, f.describe(),
                        f"its budget is {budget.describe(usage.total)}" if plan.budget is not None and
                        plan.kept_bytes + need <= plan.budget else "the disk needs the room")
    free = shutil.disk_usage(cache_dir).free
    if free < need:  # a file came into use meanwhile, or something else wrote there
        raise DitCacheError(no_space(cache_dir, need, free, in_use))
    return gone


def ensure(cache_dir: Union[Path, DitCachePlace], key: str, layout, nbytes: int, source, deltas=None,
           scales_of: Optional[Callable[[], dict]] = None) -> CacheFile:
    """The cache file for ``key``: found and checked, or written (one writer at a time: a lock
    file beside it), after the least recently used others are evicted to keep the cache within
    its budget (``cache_dir``: a :class:`DitCachePlace`, or a directory with the environment's
    budget). Either way its last use is now, and it is marked used (:class:`CacheFile`'s
    ``mark``) until it is mapped. ``source``: what the parameters are read from (fp8's wrapper:
    quantized as read); ``deltas``: LoRAs to merge as written (full precision; fp8's source
    merges its own); ``scales_of()``: fp8's row scales once everything is read. Raises
    :class:`DitCacheError`."""
    place = cache_dir if isinstance(cache_dir, DitCachePlace) else DitCachePlace(Path(cache_dir),
                                                                                     DitCachePlace.of().budget)
    cache_dir = place.directory
    dest = path_for(cache_dir, key)
    with contextlib.ExitStack() as held:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(dit_files.key_lock(cache_dir, key))  # another run writing it: wait, then use it
        except OSError as e:
            raise DitCacheError(f"cannot use the DiT cache directory {cache_dir}: {e.strerror or e}. Fix: point "
                                "--cache-dir or $WAN_S2V_DIT_CACHE_DIR at a writable directory (or use "
                                "--dit-stream-from memory)") from e
        return _found_or_written(place, dest, key, layout, nbytes, source, deltas, scales_of)


def _found_or_written(place: DitCachePlace, dest: Path, key: str, layout, nbytes: int, source, deltas,
                      scales_of) -> CacheFile:
    """:func:`ensure`'s work under the file's writers' lock."""
    cache_dir, sha = place.directory, layout_digest(layout)
    found = read(dest, nbytes, sha, key)
    if found is not None:
        return _used(found)
    if dest.exists():
        log.warning("%s is not a whole cache file of this DiT: writing it again", dest)
    for p in _remove_leftovers(dest):
        log.warning("removed %s, a cache file a stopped run left half-written", p.name)
    need = dit_files.write_needs(nbytes)
    evicted = _make_room(cache_dir, dest, need, place.budget)
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
    written.action, written.seconds, written.evicted = "written", time.perf_counter() - t0, evicted
    return _used(written)


def _used(cache: CacheFile) -> CacheFile:
    """``cache`` marked used by this process and its last use now (under its writers' lock: no
    eviction between the two)."""
    cache.mark = os.open(cache.path, os.O_RDONLY)
    dit_files.mark(cache.mark)
    dit_files.touch(cache.path)
    return cache


# --------------------------------------------------------------------------- a rank's side
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
    node, leader, local_ranks = lean_load.node_place(group)  # the node's ranks that hold a DiT
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
        infos: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, (node, leader, mem_available()), group=group)
        readings = {n: r for n, lead, r in infos if lead}
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
    float32 [rows, 1]; empty without fp8), read from the file. ``cache_dir``: a
    :class:`DitCachePlace` (:func:`place_of` a spec), a directory (the environment's budget), or
    None (both by the environment: ``shared.cache_dirs``, ``shared.cache_budget``)."""
    import torch.distributed as dist

    layout, total = lean_load._layout(model)
    sha = layout_digest(layout)
    node, leader, _ = lean_load.node_place(group)  # local rank 0, unless the group leaves it out
    status, error, found = None, None, None
    if leader:
        try:
            place = (cache_dir if isinstance(cache_dir, DitCachePlace) else DitCachePlace.of() if cache_dir is None
                     else DitCachePlace(Path(cache_dir), DitCachePlace.of().budget))
            found = ensure(place, key_of(layout), layout, total, source, deltas, scales_of)
            status = {"path": str(found.path), "action": found.action, "seconds": round(found.seconds, 3),
                      "evicted": found.evicted}
        except Exception as e:  # noqa: BLE001 - every rank of the node raises it (below)
            error = e
            status = {"error": str(e) if isinstance(e, DitCacheError) else f"{type(e).__name__}: {e}"}
    mine = status
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        infos: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, (node, leader, status), group=group)
        mine = next((st for n, lead, st in infos if n == node and lead), None)
    if error is not None:
        raise error
    if mine is None:
        raise DitCacheError("no rank of this node writes the DiT's page-cache file. Fix: launch with "
                            "torchrun's local ranks (or use --dit-stream-from memory)")
    if "error" in mine:
        raise DitCacheError(f"the node's leading rank could not provide the DiT's page-cache file: {mine['error']}")
    cache = found if found is not None else read(Path(mine["path"]), total, sha)
    if cache is None:
        raise DitCacheError(f"{mine['path']}, the DiT's page-cache file local rank 0 gave, does not read whole here. "
                            "Fix: a cache directory every rank of the node sees alike ($WAN_S2V_DIT_CACHE_DIR)")
    map_into(model, cache, layout)
    action = mine["action"] if leader else f"mapped ({mine['action']} by the node's leading rank)"
    report.strategy[what] = "page-cache"
    report.strategy[f"{what}_cache"] = {"path": mine["path"], "bytes": total, "action": action,
                                        "write_s": mine["seconds"], "why": why, "evicted": mine.get("evicted", [])}
    log.info("%s: %s %s (%.2f GB)%s", what, action, mine["path"], total / 1e9,
             f" in {mine['seconds']:.1f} s" if mine["action"] == "written" else "")
    return {n: s.reshape(-1, 1) for n, s in cache.scales.items()}
