"""The DiT streamed block by block (``--dit-offload blocks``): its blocks live in host memory and
each is copied to the GPU just before it runs, so a 24 GB card holds the 14B's step (issue #57).

Upstream places the whole DiT on the rank's device (``WanS2V.__init__``/``_configure_model``:
``model.to(device)``), 30.4 GiB in bf16. Peers that run the 14B on 16-32 GB cards stream its
blocks instead (Kijai's block swap, Wan2GP, LightX2V's async block offload, diffusers'
``apply_group_offloading``). Here:

* A **unit** is one DiT block with the audio-injection layers that run right after it
  (``audio_injector.injector[j]``, its AdaIN or pre-norm layers, where block i injects):
  everything one block's turn in ``WanModel_S2V.forward`` reads. The first ``resident`` units and
  everything outside the units (embeddings, head, norms, the DiT's audio encoder, the frame
  packer, every buffer: RoPE table, fp8 scales) stay on the device.
* A streamed unit's parameters keep their host tensors (the dtype they were loaded in: bf16, or
  fp8 bytes, half the traffic). Two device **slots**, each as large as the largest unit, take
  turns: before block i runs (a forward pre-hook, outside any compiled graph) its unit is bound to
  its slot (each parameter's ``.data`` a view of the slot) and the next streamed unit, in the
  order the blocks run (after the last, the first again: the next pass), is copied into the other
  slot on a side stream while block i computes. A copy waits for the compute stream to have
  finished with its slot (an event); block i waits for its own copy (an event). A unit whose slot
  was not overwritten since is not copied again (two streamed units: copied once).
* Evicted parameters point back at their host tensors: whoever reads them outside the loop gets
  their values.
* On the CPU the slots are CPU tensors and the copies are real copies (what the tests run); on
  CUDA the host memory is pinned (``cudaHostRegister`` over each host storage, once: one packed
  buffer per rank, or the node-shared copy every local rank maps) so the copies are asynchronous
  DMA; where pinning fails (the host is short of memory; WSL2 pins at most about half the RAM) the
  copies are pageable (slower, not overlapped) and a warning says so.
* **From the page cache** (``mapped``: ``--dit-stream-from page-cache``, ``loading.dit_cache``): the
  host tensors are views of a cache file's read-only mapping, whose clean pages the kernel keeps or
  drops as memory allows. The mapping is never pinned (that would lock every page in RAM, the
  opposite of the point): a unit is copied by a thread of its own into one of two **staging**
  buffers (each as large as a slot, the ones pinned) — a CPU copy that faults the pages in from
  the disk where the kernel dropped them, after a ``MADV_WILLNEED`` read-ahead of the unit — and
  from there into its device slot (on CUDA, asynchronous DMA on the side stream, as above). The
  compute waits for the thread's copy only when it needs that unit. On the CPU the staging is a
  plain copy and the thread the same. The bytes are the same: the frames too.

Why not diffusers' ``apply_group_offloading``: it pins a private copy of every group in each
process (no node-shared copy), keeps nothing resident (no partial residency a 32 GB card wants),
and with ``onload_device`` the CPU its hooks move nothing, so the CPU tests would not run the
mechanism; its hooks also re-place parameters on every call, where a slot that still holds its
unit is reused here.

The values computed are the same: a parameter's bytes are copied, never converted, so streamed
frames equal resident frames bit for bit (tests/test_block_stream.py, every layout).

May import: nothing of the project (torch only).
"""
from __future__ import annotations

import ctypes
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

log = logging.getLogger("wan_s2v.block_stream")

#: byte alignment of a parameter inside a slot
_ALIGN = 256
#: ``cudaHostRegisterReadOnly``: the driver pins the pages without asking to write them (a
#: copy-on-write mapping of the node-shared weights stays shared)
_REGISTER_READ_ONLY = 0x08
#: ``madvise(MADV_WILLNEED)``: start reading a mapped range's pages in
_MADV_WILLNEED = 3
_PAGE = 4096
_libc = None


def _will_need(tensors: list[torch.Tensor]) -> None:
    """Ask the kernel to read the pages under ``tensors`` (views of a file mapping) ahead, one
    range per tensor (best effort: a failed call only loses the read-ahead)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                lo = (t.data_ptr() // _PAGE) * _PAGE
                _libc.madvise(lo, t.data_ptr() + n - lo, _MADV_WILLNEED)
    except (OSError, AttributeError):
        pass


@dataclass(eq=False)  # compared by identity (its fields hold tensors)
class Unit:
    """One streamed unit: a block and the audio-injection layers that run after it."""
    index: int  # the block's index
    params: list[nn.Parameter]
    host: list[torch.Tensor] = field(default_factory=list)  # each parameter's host tensor
    offsets: list[int] = field(default_factory=list)  # each parameter's byte offset in a slot
    nbytes: int = 0


def _unit_views(buffer: torch.Tensor, u: Unit) -> list[torch.Tensor]:
    """``u``'s parameters as views of a byte ``buffer`` laid out as a slot (``u.offsets``)."""
    return [buffer[off:off + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            for p, off in zip(u.params, u.offsets)]


def unit_modules(model) -> list[list[nn.Module]]:
    """The modules of each block's turn, in the order the blocks run: block i, then (where it
    injects audio) the injection layers ``after_transformer_block(i)`` calls."""
    injector = getattr(model, "audio_injector", None)
    injected = dict(getattr(injector, "injected_block_id", {}) or {})
    units = []
    for i, block in enumerate(model.blocks):
        mods = [block]
        if i in injected:
            j = injected[i]
            for name in ("injector", "injector_adain_layers", "injector_pre_norm_feat", "injector_pre_norm_vec"):
                layers = getattr(injector, name, None)
                if layers is not None and j < len(layers):
                    mods.append(layers[j])
        units.append(mods)
    return units


def unit_bytes(model) -> list[int]:
    """Each unit's parameter bytes (in the order the blocks run)."""
    return [sum(p.numel() * p.element_size() for m in mods for p in m.parameters()) for mods in unit_modules(model)]


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a refused registration (best effort): a later kernel launch
    check would otherwise report it as its own."""
    import ctypes
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except OSError:
            continue


def _pin(tensors: list[torch.Tensor], read_only: bool) -> tuple[int, list[str], list[int]]:
    """Pin the storages under ``tensors`` (each distinct storage once; ``read_only``: a
    copy-on-write mapping of the node's shared copy, pinned without asking to write it, else the
    pinning would give each rank a private copy). Returns (bytes pinned, the failures'
    descriptions, the pointers registered here)."""
    cudart = torch.cuda.cudart()
    seen, pinned, failed, registered = set(), 0, [], []
    for t in tensors:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen or st.nbytes() == 0:
            continue
        seen.add(ptr)
        if t.is_pinned():
            pinned += st.nbytes()
            continue
        err = cudart.cudaHostRegister(ptr, st.nbytes(), _REGISTER_READ_ONLY if read_only else 0)
        if int(err) != 0:
            _clear_cuda_error()
            failed.append(f"{st.nbytes() / 2**30:.1f} GiB: cudaError {int(err)}")
            continue
        registered.append(ptr)
        pinned += st.nbytes()
    return pinned, failed, registered


class BlockStreamer:
    """Streams ``model``'s units after the first ``resident`` through two slots on ``device``
    (see the module docstring). Build it with :func:`attach`."""

    def __init__(self, model, device: torch.device, resident: int, pinner: Optional[Callable] = None,
                 read_only: bool = False, mapped: bool = False):
        self.device = torch.device(device)
        self.mapped = mapped
        mods = unit_modules(model)
        self.resident = max(0, min(int(resident), len(mods)))
        streamed_ids: set[int] = set()
        self.units: list[Unit] = []
        for i, ms in enumerate(mods):
            if i < self.resident:
                continue
            params = [p for m in ms for p in m.parameters()]
            self.units.append(Unit(i, params))
            streamed_ids.update(id(p) for p in params)
        with torch.no_grad():
            # everything else (parameters outside the streamed units, every buffer) to the device
            for p in model.parameters():
                if id(p) not in streamed_ids:
                    p.data = p.data.to(self.device)
            for m in model.modules():
                for name, b in list(m._buffers.items()):
                    if b is not None:
                        m._buffers[name] = b.to(self.device)
            for u in self.units:
                off = 0
                for p in u.params:
                    off = -(-off // _ALIGN) * _ALIGN
                    u.offsets.append(off)
                    off += p.numel() * p.element_size()
                u.nbytes = off
            # units with parameters on the device (a model built there): into one packed host buffer
            # (one storage to pin; torch's pinned allocator would round each tensor up to a power of two)
            away = [u for u in self.units if any(p.device.type != "cpu" for p in u.params)]
            packed = torch.empty(sum(u.nbytes for u in away), dtype=torch.uint8)
            cursor = 0
            for u in self.units:
                if u in away:
                    u.host = _unit_views(packed[cursor:cursor + u.nbytes], u)
                    for p, host in zip(u.params, u.host):
                        host.copy_(p.data)
                    cursor += u.nbytes
                else:
                    u.host = [p.data for p in u.params]
                for p, host in zip(u.params, u.host):
                    p.data = host
        self.slot_bytes = max((u.nbytes for u in self.units), default=0)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(2 if len(self.units) > 1 else len(self.units))]
        self.slot_unit: list[Optional[int]] = [None] * len(self.slots)  # which unit (position) each holds
        self.current: Optional[int] = None  # the slot of the unit computing now
        self.host_bytes = sum(u.nbytes for u in self.units)
        self.copies = 0  # units copied so far
        self.bytes_copied = 0
        self.pinned_bytes, self.pin_failures, self._registered = 0, [], []
        cuda = self.device.type == "cuda"
        self._pinner = pinner if pinner is not None else (_pin if cuda else None)
        # the page cache's: the mapping's bytes, the staging buffers (the only memory pinned), the
        # staging thread, its copies in flight (one per slot) and the DMA out of each staging buffer
        self.mapped_bytes = 0
        self.staging: list[torch.Tensor] = []
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: list[Optional[Future]] = [None] * len(self.slots)
        self._staged = [torch.cuda.Event() if cuda else None for _ in self.slots] if mapped else []
        if mapped:
            self.mapped_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                     for u in self.units for t in u.host}.values())
            self.staging = [torch.empty(self.slot_bytes, dtype=torch.uint8) for _ in self.slots]
            if self._pinner is not None and self.staging:
                self.pinned_bytes, self.pin_failures, self._registered = self._pinner(self.staging, False)
                if self.pin_failures:
                    log.warning("the streamed DiT's staging buffers could not be pinned (%s): its copies are "
                                "pageable (slower). Fix: free host memory", "; ".join(self.pin_failures))
            if self.units:  # a thread starts on device 0: the staging thread's copies go to this one
                index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
                    if cuda else None
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="wan-s2v-stage",
                                                initializer=(lambda: torch.cuda.set_device(index)) if cuda else None)
        elif self._pinner is not None and self.units:
            self.pinned_bytes, self.pin_failures, self._registered = self._pinner(
                [t for u in self.units for t in u.host], read_only)
            if self.pin_failures:
                log.warning("the streamed DiT's host memory could not all be pinned (%s): its copies are pageable "
                            "(slower: the copy engine cannot overlap them with the compute). Fix: free host memory "
                            "(pinned pages are never swapped; on WSL2 the driver pins at most about half the RAM) "
                            "or use --dit-quant fp8 (half the bytes)", "; ".join(self.pin_failures))
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.ready = [torch.cuda.Event() if cuda else None for _ in self.slots]
        self._hooks = [model.blocks[u.index].register_forward_pre_hook(self._before(k))
                       for k, u in enumerate(self.units)]

    # ----- what the plan and the report read
    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() for t in self.staging)

    @property
    def host(self) -> str:
        """Where the streamed units' bytes are: ``page-cache`` (a file's mapping, copied through
        staging buffers), ``pinned`` (host memory pinned whole) or ``pageable`` (host memory not
        pinned: the CPU, or pinning refused)."""
        if self.mapped:
            return "page-cache"
        return "pinned" if self._pinner is not None and self.pinned_bytes >= self.host_bytes else "pageable"

    def describe(self) -> dict:
        pinned_whole = self.staging_bytes if self.mapped else self.host_bytes
        return {"resident_blocks": self.resident, "streamed_blocks": len(self.units),
                "slot_bytes": self.slot_bytes, "slots": len(self.slots), "host_bytes": self.host_bytes,
                "pinned_bytes": self.pinned_bytes,
                "pageable": self._pinner is not None and self.pinned_bytes < pinned_whole,
                "host": self.host, "mapped_bytes": self.mapped_bytes, "staging_bytes": self.staging_bytes}

    # ----- the mechanism
    def _evict(self, s: int) -> None:
        k = self.slot_unit[s]
        if k is not None:
            for p, host in zip(self.units[k].params, self.units[k].host):
                p.data = host
            self.slot_unit[s] = None

    def _load(self, k: int, s: int) -> None:
        """Copy unit ``k`` into slot ``s`` (asynchronously on CUDA) and bind its parameters there."""
        self._evict(s)
        u = self.units[k]
        views = _unit_views(self.slots[s], u)
        if self.mapped:
            self._wait(s)  # a copy into this slot still in flight (a unit run out of order)
            # the slot's previous unit: every kernel that reads it is queued on the compute stream by now
            freed = None
            if self.copy_stream is not None:
                freed = torch.cuda.Event()
                freed.record(torch.cuda.current_stream(self.device))
            self._pending[s] = self._pool.submit(self._stage, u, s, freed)
        elif self.copy_stream is not None:
            # the slot's previous unit: every kernel that reads it is queued on the compute stream by now
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                for v, host in zip(views, u.host):
                    v.copy_(host, non_blocking=True)
                self.ready[s].record(self.copy_stream)
        else:
            for v, host in zip(views, u.host):
                v.copy_(host)
        for p, v in zip(u.params, views):
            p.data = v
        self.slot_unit[s] = k
        self.copies += 1
        self.bytes_copied += u.nbytes

    def _stage(self, u: Unit, s: int, freed) -> None:
        """The staging thread's copy of unit ``u`` into slot ``s`` (page cache): mapping -> staging
        buffer ``s`` (a CPU copy, faulting the pages in) -> slot (DMA on the side stream, after the
        compute stream is done with the slot: ``freed``)."""
        with torch.no_grad():
            buf = self.staging[s]
            if self._staged[s] is not None:
                self._staged[s].synchronize()  # the DMA out of this staging buffer before has ended
            _will_need(u.host)
            for host, off in zip(u.host, u.offsets):
                flat = host.reshape(-1).view(torch.uint8)
                buf[off:off + flat.numel()].copy_(flat)
            if self.copy_stream is None:
                self.slots[s][:u.nbytes].copy_(buf[:u.nbytes])
                return
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(freed)
                self.slots[s][:u.nbytes].copy_(buf[:u.nbytes], non_blocking=True)
                self.ready[s].record(self.copy_stream)
                self._staged[s].record(self.copy_stream)

    def _wait(self, s: int) -> None:
        """Wait for the staging thread's copy into slot ``s`` (its DMA queued, on CUDA); raise what
        it raised."""
        pending, self._pending[s] = self._pending[s], None
        if pending is not None:
            pending.result()

    def _before(self, k: int):
        def hook(module, args):
            with torch.no_grad():
                s = next((i for i, held in enumerate(self.slot_unit) if held == k), None)
                if s is None:  # not prefetched (the first pass, or out of order): now
                    s = 0 if self.current is None or len(self.slots) == 1 else 1 - self.current
                    self._load(k, s)
                if self.mapped:
                    self._wait(s)
                if self.copy_stream is not None:
                    torch.cuda.current_stream(self.device).wait_event(self.ready[s])
                self.current = s
                nxt = (k + 1) % len(self.units)
                if len(self.slots) > 1 and nxt != k and self.slot_unit[1 - s] != nxt:
                    self._load(nxt, 1 - s)
            return None
        return hook

    def detach(self) -> None:
        """Remove the hooks and point every streamed parameter at its host tensor (tests)."""
        for s in range(len(self._pending)):
            self._wait(s)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.copy_stream is not None:  # a prefetch may be in flight: the slots are not free before it ends
            self.copy_stream.synchronize()
        for h in self._hooks:
            h.remove()
        for s in range(len(self.slots)):
            self._evict(s)
        self._hooks = []
        if self._registered and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered = []


def attach(model, device, resident: int, pinner: Optional[Callable] = None, read_only: bool = False,
           mapped: bool = False) -> BlockStreamer:
    """Stream ``model`` (its parameters anywhere, on the host or the device) on ``device``, keeping
    its first ``resident`` units there; ``read_only``: its host memory is a copy-on-write mapping
    shared by the node's ranks (pinned read-only, or not at all); ``mapped``: its host tensors are
    a cache file's mapping (the page cache: never pinned, copied through two pinned staging
    buffers). ``pinner(host tensors, read_only) -> (bytes pinned, failures, registered pointers)``:
    how host memory is pinned (default: CUDA's registration on a CUDA device, nothing on the CPU)."""
    streamer = BlockStreamer(model, device, resident, pinner, read_only, mapped)
    log.info("DiT streamed: %d of %d blocks from %s (%.2f GiB) through %d slot(s) of %.2f GiB; %d resident",
             len(streamer.units), len(streamer.units) + streamer.resident,
             "the page cache" if mapped else "host memory", streamer.host_bytes / 2**30,
             len(streamer.slots), streamer.slot_bytes / 2**30, streamer.resident)
    return streamer

