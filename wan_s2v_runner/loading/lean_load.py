"""Lean loading: each rank holds only the weights it computes with, and a node reads a
non-sharded model once (issue #9). Used by :mod:`wan_s2v_runner.loading.components` under
``--load lean`` (the default); ``--load full`` keeps upstream's way (every rank reads every file).

Models are built on the meta device (no memory), then:

* **FSDP-sharded** (the DiT in fsdp-fixed/hybrid, the T5 in fsdp-fixed): upstream's
  ``shard_model`` wraps the meta model (``patches.fsdp_no_sync`` materializes each unit with
  ``to_empty`` and skips FSDP's flattening copy, see ``make_shard_model``), so a rank allocates only
  its flat-parameter shards; :func:`fill_fsdp_shards` then reads exactly the slices of the
  original tensors that fall into them from the files (``ckpt_read``: ``pread`` for
  safetensors, mapped pages for ``.pth``). Before that, :func:`verify_same_checkpoint`
  all-gathers a digest of what every rank reads in common (the tensor table and one
  64-element window per tensor): FSDP without ``sync_module_states`` never broadcasts, so ranks
  given different files would silently compute wrong frames.
* **Replicated on the CPU** (the DiT in ulysses mode on CPU): one process per node (local rank 0)
  reads the file into an anonymous shared-memory file (``memfd``) in the model's dtype; the other
  local ranks map the same pages (copy-on-write, so a LoRA merge stays per rank). The node holds
  one copy, not one per rank.
* **Replicated on a GPU**: tensor by tensor from the file to the device (host RAM holds one
  tensor at a time; the page cache is shared by the node's ranks).

``in_turns`` runs a read phase in waves of local ranks when the memory plan says the node cannot
hold every rank's loading at once (``--load-waves``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from wan_s2v_runner.loading.ckpt_read import ReadCounter

log = logging.getLogger("wan_s2v.lean_load")

#: alignment of each tensor in a node-shared weights file (bytes)
_ALIGN = 64


@dataclass
class LoadReport:
    """What a rank's loading did: strategy per component, bytes read, waves."""
    counter: ReadCounter = field(default_factory=ReadCounter)
    strategy: dict[str, str] = field(default_factory=dict)
    waves: int = 1
    #: a DiT read while the encoders ran: {"read_s": its read, "waited_s": the loop's wait for it}
    dit_overlap: Optional[dict[str, float]] = None

    def as_dict(self) -> dict:
        out = {"strategy": dict(self.strategy), "bytes_read": dict(self.counter.by_purpose),
               "bytes_read_total": self.counter.total, "waves": self.waves}
        if self.dit_overlap is not None:
            out["dit_overlap"] = dict(self.dit_overlap)
        return out


# --------------------------------------------------------------------------- empty models
def empty_dit(dit_cls, ckpt_dir, dtype: torch.dtype):
    """``WanModel_S2V`` with the checkpoint's config, parameters on meta in ``dtype`` (its
    non-parameter tensors, the RoPE ``freqs``, are real: ``init_empty_weights`` leaves them)."""
    from accelerate import init_empty_weights
    with init_empty_weights():
        model = dit_cls.from_config(dit_cls.load_config(str(ckpt_dir)))
    torch.nn.Module.to(model, dtype)  # nn.Module.to: diffusers' .to() warns about fp32 modules
    return model


def empty_t5(wan, checkpoint_path, dtype: torch.dtype):
    """The T5 encoder ``T5EncoderModel.__init__`` builds (sizes from the file, via
    ``patches.checkpoint_dims``), on meta."""
    from patches import checkpoint_dims
    with checkpoint_dims.t5_checkpoint(checkpoint_path):
        return wan.modules.t5.umt5_xxl(encoder_only=True, return_tokenizer=False, dtype=dtype,
                                       device="meta").eval().requires_grad_(False)


def check_same_keys(model, source, what: str) -> None:
    """The (unwrapped) model's parameters and the file's tensors: same names, same shapes
    (strict, like ``load_state_dict``)."""
    from patches.checkpoint_dims import CheckpointLayoutError
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    table = source.table()
    missing, unexpected = sorted(set(names) - set(table)), sorted(set(table) - set(names))
    bad = [n for n in names if n in table and tuple(table[n][1]) != names[n]]
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:3]}")
        if bad:
            parts.append(f"shape differs for {bad[:3]}")
        raise CheckpointLayoutError(f"{what}: the checkpoint does not match the model ({'; '.join(parts)})")


# --------------------------------------------------------------------------- FSDP shards
def fsdp_units(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name prefix of the unit's module, its FlatParameter) for every FSDP unit of ``model``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    for name, mod in model.named_modules():
        if isinstance(mod, FSDP) and mod._handle is not None:
            prefix = clean_tensor_name(name)
            yield (prefix + "." if prefix else ""), mod._handle.flat_param


def shard_slices(model) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(tensor name, first element, destination view) for every piece of an original tensor
    that lies in this rank's shards."""
    for prefix, fp in fsdp_units(model):
        if fp._shared_param_infos:
            raise NotImplementedError("FSDP lean loading does not handle shared (tied) parameters")
        flat = fp.data
        for fqn, info in zip(fp._fqns, fp._shard_param_infos):
            if info.in_shard:
                yield prefix + fqn, info.intra_param_start_idx, \
                    flat[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]


def fill_fsdp_shards(model, source) -> None:
    """Read this rank's slices of every tensor into its FSDP shards."""
    with torch.no_grad():
        for name, start, dest in shard_slices(model):
            if dest.device.type == "cpu":
                source.read_flat(name, start, dest)
            else:
                staging = torch.empty(dest.numel(), dtype=dest.dtype)
                source.read_flat(name, start, staging)
                dest.copy_(staging)


def merge_deltas_into_shards(model, deltas) -> None:
    """Add the LoRAs' fp32 deltas (a :class:`~wan_s2v_runner.loading.lora.LoraDeltas`; one parameter's
    delta at a time) to the slices this rank holds, rounding once to the weight's dtype: element
    for element what a merge into the whole tensor gives."""
    wanted = set(deltas.names)
    with torch.no_grad():
        for name, start, dest in shard_slices(model):
            if name in wanted:
                part = deltas.delta(name).reshape(-1)[start:start + dest.numel()].to(dest.device)
                dest.copy_((dest.float() + part).to(dest.dtype))


def verify_same_checkpoint(source, what: str, group=None) -> None:
    """Raise ``WeightMismatch`` naming the ranks whose files differ from rank 0's: a digest of the
    tensor table (names, dtypes, shapes) and of one 64-element window per tensor (same windows
    on every rank), all-gathered. A difference confined outside every window goes unnoticed."""
    import torch.distributed as dist

    from patches.fsdp_no_sync import WeightMismatch
    from wan_s2v_runner.loading.fingerprint import source_digest

    entries = source.table()
    digest = source_digest(source)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, digest, group=group)
    bad = [r for r, g in enumerate(gathered) if g != gathered[0]]
    if bad:
        raise WeightMismatch(
            f"{what} checkpoint differs between ranks: rank(s) {bad} do not match rank 0 "
            f"(tensor table and sampled contents of {len(entries)} tensors). FSDP without "
            "sync_module_states never broadcasts, so the output would be silently wrong. Fix: give "
            "every node the same checkpoint files (compare sha256 of the .safetensors/.pth files).")


# --------------------------------------------------------------------------- replicated weights
def _layout(model) -> tuple[list[tuple[str, int, torch.dtype, tuple]], int]:
    """(name, byte offset, dtype, shape) of every parameter packed into one aligned buffer."""
    out, off = [], 0
    for name, p in model.named_parameters():
        off = -(-off // _ALIGN) * _ALIGN
        out.append((name, off, p.dtype, tuple(p.shape)))
        off += p.numel() * p.element_size()
    return out, max(off, 1)


def _views(storage, layout) -> dict[str, torch.Tensor]:
    sd = {}
    for name, off, dtype, shape in layout:
        t = torch.empty(0, dtype=dtype)
        t.set_(storage, off // dtype.itemsize, shape, _contiguous_strides(shape))
        sd[name] = t
    return sd


def _read_into(storage, layout, source) -> dict[str, torch.Tensor]:
    """Every tensor of ``layout`` read from ``source`` into its place in ``storage``: the views."""
    views = _views(storage, layout)
    with torch.no_grad():
        for name, t in views.items():
            source.read_flat(name, 0, t.view(-1))
    return views


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def node_place(group=None) -> tuple[str, bool, int]:
    """(this node, whether this rank leads the node's ranks of ``group``, how many of ``group``'s
    ranks are on this node). The leader is the lowest local rank among them: local rank 0, unless
    ``group`` leaves it out (a 5-rank live pipeline's decoding rank holds no DiT). ``group`` None:
    every rank. A node's ranks are consecutive global ranks (``RANK - LOCAL_RANK`` first)."""
    import torch.distributed as dist

    node = os.environ.get("GROUP_RANK", "0")
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if not dist.is_initialized():  # one process: the environment's node
        return node, local_rank == 0, local_world
    members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    first = rank - local_rank
    here = [r for r in members if first <= r < first + local_world]
    return node, bool(here) and rank == min(here), len(here)


def node_shared_weights(model, source, report: LoadReport, what: str, group=None, packed: bool = False) -> str:
    """Fill ``model``'s (meta) parameters on the CPU with one copy per node: local rank 0 reads
    the file into a memfd, the node's other ranks map it. A rank alone on its node reads into
    private memory (faster: anonymous pages fault in huge pages, shared memory in 4 KiB ones),
    tensor by tensor, or with ``packed`` into one buffer (a streamed DiT: one storage to pin).
    ``group``: the process group of its collectives (a DiT loaded while the encoders run has one
    of its own). Returns the strategy used."""
    import torch.distributed as dist
    node, leader, local_members = node_place(group)
    if local_members <= 1:  # alone on the node: nothing to share
        private_weights(model, source, report, what, packed)
        return report.strategy[what]
    layout, total = _layout(model)
    fd = None
    if leader:
        fd = os.memfd_create(f"wan-s2v-{what}", 0)
        os.ftruncate(fd, total)
        _read_into(torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, total), layout, source)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        infos: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, (node, leader, os.getpid(), fd), group=group)
        path = next((f"/proc/{pid}/fd/{f}" for n, lead, pid, f in infos if n == node and lead), None)
    else:
        path = f"/proc/self/fd/{fd}"
    try:
        if path is None:
            raise OSError("no rank leads this node's copy")
        model.load_state_dict(_views(torch.UntypedStorage.from_file(path, False, total), layout),
                              strict=True, assign=True)
        report.strategy[what] = "node-shared"
    except (OSError, RuntimeError) as e:  # e.g. /proc/PID/fd not readable: a private copy
        log.warning("%s: cannot map local rank 0's weights (%s); reading a private copy", what, e)
        private_weights(model, source, report, what, packed)
        report.strategy[what] = "private (node sharing unavailable)"
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)  # every local rank has mapped the file before its creator closes it
    if fd is not None:
        os.close(fd)  # the mappings keep the memory alive
    return report.strategy[what]


def private_weights(model, source, report: LoadReport, what: str, packed: bool) -> None:
    """Fill ``model``'s (meta) parameters with this rank's own copy on the CPU: tensor by tensor,
    or with ``packed`` into one buffer (a streamed DiT: one storage to pin)."""
    if not packed:
        device_weights(model, source, torch.device("cpu"), report, what)
        return
    layout, total = _layout(model)
    views = _read_into(torch.empty(total, dtype=torch.uint8).untyped_storage(), layout, source)
    model.load_state_dict(views, strict=True, assign=True)
    report.strategy[what] = "private (one buffer)"


def device_weights(model, source, device: torch.device, report: LoadReport, what: str) -> None:
    """Fill ``model``'s (meta) parameters on ``device`` tensor by tensor (host RAM: one tensor)."""
    sd = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            staging = torch.empty(p.shape, dtype=p.dtype)
            source.read_flat(name, 0, staging.view(-1))
            sd[name] = staging.to(device) if device.type != "cpu" else staging
    model.load_state_dict(sd, strict=True, assign=True)
    report.strategy[what] = "per-tensor to " + device.type if device.type != "cpu" else "private"


# --------------------------------------------------------------------------- waves
def in_turns(waves: int, fn: Callable[[], None], group=None) -> None:
    """Run ``fn`` on every rank, local ranks in ``waves`` turns (local rank r in turn
    r % waves), with a barrier (on ``group``) after each turn; one turn is a plain call. Every
    rank takes part in every barrier, so the collectives stay matched."""
    import torch.distributed as dist
    if waves <= 1 or not dist.is_initialized():
        fn()
        return
    mine = int(os.environ.get("LOCAL_RANK", 0)) % waves
    for turn in range(waves):
        if turn == mine:
            fn()
        dist.barrier(group=group)


def describe_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

