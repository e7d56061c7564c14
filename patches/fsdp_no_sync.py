"""Patch: FSDP without ``sync_module_states``, after proving every rank holds the same weights.

Upstream: ``wan.distributed.fsdp.shard_model`` wraps with ``sync_module_states=True`` (a rank-0
broadcast of every parameter at init). That is the reported FSDP init hang, and on CPU it
refuses CPU params; ``device_id=int`` fails without an accelerator; ``param_dtype`` is bf16.
Change: ``wan.speech2video`` binds ``shard_model`` by name (for the DiT and, with t5_fsdp, the
T5), so we rebind it there to a wrapper that (1) all-gathers a per-tensor float64
(sum, sum of squares) fingerprint of the module and raises :class:`WeightMismatch` naming the
ranks that differ from rank 0 — with no broadcast, different weights would silently give wrong
frames (measured rel. error 0.30); (2) calls upstream ``shard_model`` with
``sync_module_states=False``, ``device_id`` = the CPU device on CPU (the CUDA index on GPU), and
``param_dtype`` = the run's param dtype (fp32 on CPU).
A model whose parameters are on the meta device (lean loading, ``wan_s2v_runner.loading.lean_load``)
is wrapped without materializing it: FSDP gets a ``param_init_fn`` that allocates each unit with
``to_empty`` (untouched pages), and, for this call only, FSDP's flattening copy
(``FlatParamHandle.flatten_tensors``, a ``torch.cat`` of the unit) and its shard copy
(``FlatParamHandle._get_shard``: ``clone`` then ``F.pad``) are replaced by uninitialized tensors
(the padding zeroed, as FSDP pads), so a rank's memory holds its shards and nothing else. The
weights are read into those shards afterwards (``lean_load.fill_fsdp_shards``), and the
fingerprint is taken on the files there (``lean_load.verify_same_checkpoint``), because there are
no weights to fingerprint yet here.
Proof: tests/test_parity.py (fsdp-fixed and hybrid equal one process, lean and full loading),
the mismatch tests (full loading: one rank's weights perturbed; lean loading: one rank given a
different checkpoint file -> the run fails with the fingerprint error naming that rank), and
tests/test_lean_load.py (a lean FSDP shard equals the fully loaded model's shard).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys

import torch
import torch.distributed as dist

from patches.patch import ORIGINAL, Patch, unbind
from wan_s2v_runner.shared.stages import Stage

log = logging.getLogger("wan_s2v.fsdp")

class WeightMismatch(RuntimeError):
    pass


def weight_fingerprint(module: torch.nn.Module) -> torch.Tensor:
    """[n_tensors, 2] float64: (sum, sum of squares) of every parameter and buffer, in order."""
    rows = []
    with torch.no_grad():
        for _, t in list(module.named_parameters()) + list(module.named_buffers()):
            d = t.detach().to(torch.float64)
            rows.append(torch.stack([d.sum(), (d * d).sum()]))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.float64)
    return torch.stack(rows).cpu()


def check_same_weights(module: torch.nn.Module, what: str, group=None) -> None:
    """All-gather fingerprints; raise WeightMismatch naming ranks that differ from rank 0."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    fp = weight_fingerprint(module)
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    fp = fp.to(dev)
    gathered = [torch.empty_like(fp) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, fp, group=group)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if bad:
        n_diff = int((gathered[bad[0]] != gathered[0]).any(dim=1).sum())
        raise WeightMismatch(
            f"{what} weights differ between ranks: rank(s) {bad} do not match rank 0 "
            f"({n_diff} of {fp.shape[0]} tensors differ). FSDP without sync_module_states never "
            "broadcasts, so the output would be silently wrong. Fix: give every node the same "
            "checkpoint files (compare sha256 of the .safetensors/.pth files).")


def is_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


@contextlib.contextmanager
def wrapping_on_meta(fsdp_module, device: torch.device):
    """While inside, upstream's ``shard_model`` (which looks ``FSDP`` up in ``fsdp_module``)
    materializes meta units with ``to_empty`` and FSDP skips its flattening copy: each unit's
    flat parameter is allocated uninitialized and only this rank's shard is ever touched."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    upstream_fsdp = fsdp_module.FSDP
    upstream_flatten = FlatParamHandle.flatten_tensors
    upstream_get_shard = FlatParamHandle.__dict__["_get_shard"]  # the staticmethod object

    def flatten_tensors(self, tensors, aligned_numel):
        if aligned_numel > 0:
            return upstream_flatten(self, tensors, aligned_numel)
        return torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)

    def get_shard(tensor, rank, world_size):  # upstream: chunk.clone(), then F.pad (two copies)
        chunk, numel_to_pad = FlatParamHandle._get_unpadded_shard(tensor, rank, world_size)
        shard = torch.empty(chunk.numel() + numel_to_pad, dtype=tensor.dtype, device=tensor.device)
        shard[chunk.numel():].zero_()  # FSDP's padding is zeros; the rest is read from the files
        return shard, numel_to_pad

    fsdp_module.FSDP = functools.partial(upstream_fsdp,
                                         param_init_fn=lambda m: m.to_empty(device=device, recurse=False))
    FlatParamHandle.flatten_tensors = flatten_tensors
    FlatParamHandle._get_shard = staticmethod(get_shard)
    try:
        yield
    finally:
        fsdp_module.FSDP = upstream_fsdp
        FlatParamHandle.flatten_tensors = upstream_flatten
        FlatParamHandle._get_shard = upstream_get_shard


def make_shard_model(upstream_shard_model, param_dtype: torch.dtype, on_cpu: bool, on_event=None):
    fsdp_module = sys.modules[upstream_shard_model.__module__]  # where shard_model looks FSDP up

    @functools.wraps(upstream_shard_model)
    def shard_model(model, device_id, **kwargs):
        what = type(model).__name__
        kwargs["sync_module_states"] = False
        kwargs.setdefault("param_dtype", param_dtype)
        if on_cpu:
            device_id = torch.device("cpu")
        if is_meta(model):
            if on_event:
                on_event(Stage.SHARD, what=what)
            device = device_id if isinstance(device_id, torch.device) else torch.device("cuda", device_id)
            log.info("FSDP-wrapping %s on meta (lean loading: each rank allocates its shards)", what)
            with wrapping_on_meta(fsdp_module, device):
                return upstream_shard_model(model, device_id=device_id, **kwargs)
        if on_event:
            on_event(Stage.FINGERPRINT, what=what)
        check_same_weights(model, what)
        if on_event:
            on_event(Stage.SHARD, what=what)
        log.info("FSDP-wrapping %s (sync_module_states=False, weights verified identical)", what)
        return upstream_shard_model(model, device_id=device_id, **kwargs)

    shard_model.__wan_s2v_patched__ = True
    return shard_model


def apply(wan_module, param_dtype: torch.dtype, on_cpu: bool, on_event=None) -> bool:
    s2v = wan_module.speech2video
    if getattr(s2v.shard_model, "__wan_s2v_patched__", False):
        return False
    upstream = wan_module.distributed.fsdp.shard_model
    patched = make_shard_model(upstream, param_dtype, on_cpu, on_event)
    setattr(patched, ORIGINAL, s2v.shard_model)
    s2v.shard_model = patched
    return True


def restore(wan_module) -> bool:
    """Undo :func:`apply`: ``speech2video``'s own ``shard_model`` again."""
    return unbind(wan_module.speech2video, "shard_model")


def _for_run(wan_module, ctx) -> str:
    apply(wan_module, param_dtype=ctx.param_dtype, on_cpu=ctx.on_cpu, on_event=ctx.on_event)
    return "sync_module_states=False + weight fingerprint"


PATCH = Patch("fsdp_no_sync", applies=lambda ctx: ctx.spec.layout.dit_fsdp or ctx.spec.layout.t5_fsdp,
              apply=_for_run, restore=restore)
