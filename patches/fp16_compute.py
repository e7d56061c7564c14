"""Patch: the DiT computed in fp16 (``--dtype fp16``): a few layers in fp32, and a guard that stops
the job at the first non-finite activation instead of writing black frames.

Upstream computes the DiT under ``torch.amp.autocast('cuda', dtype=param_dtype)`` (bf16). Its own
fp32 islands are the time embedding, the modulation arithmetic and the head, written as
``torch.cuda.amp.autocast(dtype=torch.float32)`` blocks (on CUDA they upcast the matmuls in them;
on the CPU they do nothing); norms return fp32 and the residual stream becomes fp32 after the first
block; RoPE is float64. bf16 has fp32's range, so nothing else needed it. fp16 has a range of
+-65504: peers that run Wan in fp16 below Ampere keep more in fp32 (ComfyUI: the patch embedding;
Wan2GP: the head, its modulation and the patch embedding; Kijai's wrapper: the patch, motion and
condition embeddings).

Change (applied to a loaded DiT when the run computes in fp16; bf16 on CUDA and fp32 never see it,
so their path is unchanged to the bit; bf16 on the CPU takes 1. and 2., without which upstream's
islands, CUDA's autocast, do nothing there):

1. **fp32 islands**: the Linear and Conv layers of :data:`ISLANDS` (the patch, condition and
   motion-frame embeddings, the time embedding and projection, the head's Linear) and every
   LayerNorm with weights compute in fp32 on every device: autocast off, inputs and weights
   upcast. Their weights stay stored in the param dtype (one dtype for FSDP's flat parameters;
   bf16 -> fp16 is exact for every value in fp16's normal range, and :func:`apply` counts those
   that are not). ``--fp32-blocks I`` computes every Linear of block I the same way (fp8 ones
   dequantized into fp32): the fix the guard names.
2. **CPU**: the forward runs under ``torch.autocast('cpu', dtype=fp16)``, as a CUDA run's does
   under the loop's autocast (upstream's is CUDA's only), so CPU tests compute what a GPU does.
3. **FSDP** keeps its root's forward inputs as they are (:func:`fsdp_inputs_kept`).
4. **The guard** (:class:`Guard`): each block's output, and the model's, is checked for non-finite
   values into a flag tensor on the device (no host sync per block); the loop asks it once per step
   (:meth:`Guard.take`: the first flagged block since it last asked) and puts the answer in its step
   message, which every rank of the group then reads (``rank.step_control``: the guard calls no
   collective); the first non-finite block fails the job on every rank with
   :class:`NonFiniteActivation`: the block, the step and the fix.

Proof: tests/test_fp16.py (every layout in fp16 equals one rank in fp16 exactly on the CPU; fp16
against fp32 within a stated bound; the islands compute in fp32; the guard names the block; the
bf16/fp32 paths do not apply it).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
import weakref
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("wan_s2v.fp16_compute")

#: module names (in WanModel_S2V) whose Linear/Conv layers compute in fp32 under fp16
ISLANDS = re.compile(r"^(patch_embedding|cond_encoder|frame_packer|time_embedding|time_projection|head\.head)(\.|$)")
#: what marks a layer this patch made compute in fp32 (its forward is an instance attribute)
_MARK = "_wan_s2v_fp32"
#: the DiTs :func:`apply` has made compute so: what it did and their guard (None but in fp16)
_APPLIED: "weakref.WeakKeyDictionary[nn.Module, tuple[dict, Optional[Guard]]]" = weakref.WeakKeyDictionary()


class NonFiniteActivation(RuntimeError):
    """A DiT block's output held inf or NaN under fp16 compute."""

    def __init__(self, block: Optional[int], step: Optional[int] = None, steps: Optional[int] = None,
                 clip: Optional[int] = None, unit: str = "clip"):
        self.block, self.step, self.steps, self.clip, self.unit = block, step, steps, clip, unit
        where = f"DiT block {block}" if block is not None else "the DiT's output (its last audio injection or head)"
        if step is not None:
            where += f" at step {step}" + (f"/{steps}" if steps else "")
        if clip is not None:
            where += f" of {unit} {clip}"
        keep = (f"or keep fp16 and add --fp32-blocks {block} (that block's Linears in fp32), "
                if block is not None else "")
        super().__init__(f"a non-finite activation (inf or NaN) in {where} under --dtype fp16: fp16's range "
                         f"(+-65504) overflowed. Fix: --dtype bf16 on a GPU with bf16 units (compute capability "
                         f">= 8.0), {keep}or --dtype fp32")

    def at(self, step: int, steps: int, clip: int, unit: str = "clip") -> "NonFiniteActivation":
        """The same failure, with the loop's step and its clip (or a live job's block: ``unit``)."""
        return NonFiniteActivation(self.block, step, steps, clip, unit)


def _fp32_forward(layer: nn.Module):
    """``layer``'s forward in fp32 whatever the autocast around it: input and weights upcast."""
    if isinstance(layer, nn.Linear):
        def forward(x):
            with torch.autocast(x.device.type, enabled=False):
                b = layer.bias.float() if layer.bias is not None else None
                return F.linear(x.float(), layer.weight.float(), b)
    elif hasattr(layer, "qweight"):  # patches.fp8_linear's Fp8Linear (--dit-quant fp8): dequantized into fp32
        def forward(x):
            with torch.autocast(x.device.type, enabled=False):
                b = layer.bias.float() if layer.bias is not None else None
                return F.linear(x.float(), layer.qweight(torch.float32), b)
    elif isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        def forward(x):
            with torch.autocast(x.device.type, enabled=False):
                b = layer.bias.float() if layer.bias is not None else None
                return layer._conv_forward(x.float(), layer.weight.float(), b)
    elif isinstance(layer, nn.LayerNorm) and layer.weight is not None:  # as CUDA's autocast runs layer_norm
        def forward(x):
            with torch.autocast(x.device.type, enabled=False):
                b = layer.bias.float() if layer.bias is not None else None
                return F.layer_norm(x.float(), layer.normalized_shape, layer.weight.float(), b, layer.eps).type_as(x)
    else:
        return None
    return forward


def fp32_layers(model: nn.Module, blocks: Iterable[int] = ()) -> list[str]:
    """Names of the layers that compute in fp32: the Linear/Conv layers of :data:`ISLANDS` and of
    the ``blocks`` given, and every LayerNorm with weights (CUDA's autocast computes layer_norm in
    fp32; upstream's norms return fp32 where their input is)."""
    wanted = {int(b) for b in blocks}
    names = []
    for name, m in model.named_modules():
        if isinstance(m, nn.LayerNorm) and m.weight is not None:  # every norm with weights
            names.append(name)
            continue
        if not (isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) or hasattr(m, "qweight")):
            continue
        inside = re.match(r"^blocks\.(\d+)\.", name)
        if ISLANDS.match(name) or (inside and int(inside.group(1)) in wanted):
            names.append(name)
    return names


class Guard:
    """Non-finite checks of each block's output and the model's (the module docstring, 4): flags on
    the device, read by :meth:`take`. It calls no collective: the loop's step message carries what
    it saw to every rank."""

    def __init__(self, model: nn.Module):
        self.blocks = len(model.blocks)
        self.flags: Optional[torch.Tensor] = None
        self._hooks = [b.register_forward_hook(self._after(i)) for i, b in enumerate(model.blocks)]
        self._hooks.append(model.register_forward_hook(self._end))

    def flag(self, i: int, x: torch.Tensor) -> None:
        """Flag ``i`` (a block's; :attr:`blocks`: the output's) set where ``x`` holds inf or NaN; a
        flag once set stays until :meth:`take`."""
        if self.flags is None or self.flags.device != x.device:
            self.flags = torch.zeros(self.blocks + 1, dtype=torch.bool, device=x.device)
        self.flags[i] |= ~torch.isfinite(x).all()

    def _after(self, i: int):
        def hook(module, args, out):
            self.flag(i, out[0] if isinstance(out, (tuple, list)) else out)
        return hook

    def _end(self, module, args, out) -> None:
        """The output too (the audio injection after the last block, the head)."""
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor):
                self.flag(self.blocks, o)

    def take(self) -> Optional[int]:
        """The first flagged block since the last call (:attr:`blocks`: the output), or None; the
        flags start again (one host read)."""
        flags, self.flags = self.flags, None
        if flags is None or not bool(flags.any()):
            return None
        return int(flags.nonzero()[0, 0])

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def cpu_autocast(device_type: str, dtype: torch.dtype):
    """The context a DiT forward runs in (2.): ``torch.autocast('cpu', dtype)`` for a half dtype on
    the CPU (as CUDA's autocast around the loop), else nothing. The model's forward takes it here
    (:func:`apply`); a path that calls the DiT's pieces itself (the live mode) takes it from here too."""
    if device_type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.autocast("cpu", dtype=dtype)
    return contextlib.nullcontext()


def _cpu_autocast(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's forward under :func:`cpu_autocast`."""
    inner = model.forward

    def forward(*args, **kwargs):
        with cpu_autocast("cpu", dtype):
            return inner(*args, **kwargs)
    model.forward = forward


def _not_exact(model: nn.Module) -> int:
    """Parameters of the fp32 layers whose values fp16 cannot hold exactly (subnormal or beyond
    65504): what storing them in fp16 rounded (informational)."""
    tiny, big = torch.finfo(torch.float16).tiny, torch.finfo(torch.float16).max
    n = 0
    for name in fp32_layers(model):
        for p in model.get_submodule(name).parameters(recurse=False):
            if p.device.type == "meta":
                continue
            a = p.detach().float().abs()
            n += int(((a > 0) & (a < tiny)).sum() + (a > big).sum())
    return n


def apply(model: nn.Module, dtype: torch.dtype, fp32_blocks: Iterable[int] = (), device_type: str = "cuda") -> dict:
    """Make ``model`` (a loaded ``WanModel_S2V``, FSDP-wrapped or not) compute as the module
    docstring says, for ``dtype`` (fp16: islands and guard; any half dtype on the CPU: the CPU
    autocast). Returns what it did (the load report's line)."""
    inner = getattr(model, "module", model)  # FSDP keeps the model's modules under .module
    if model in _APPLIED:  # applied once per loaded DiT
        return _APPLIED[model][0]
    done: dict = {}
    guard = None
    fp16, cpu_half = dtype == torch.float16, device_type == "cpu" and dtype == torch.bfloat16
    if fp16 or cpu_half:  # bf16 on the CPU: upstream's fp32 islands are CUDA's autocast, off there
        layers = fp32_layers(inner, fp32_blocks)
        for name in layers:
            layer = inner.get_submodule(name)
            if not getattr(layer, _MARK, False):
                layer.forward = _fp32_forward(layer)
                setattr(layer, _MARK, True)
        done["fp32_layers"] = len(layers)
    if fp16:
        guard = Guard(inner)
        done.update(fp32_blocks=sorted(int(b) for b in fp32_blocks),
                    guard="every block's output checked for inf/NaN, read once per step",
                    fp16_rounded_island_values=_not_exact(inner))
    if device_type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        _cpu_autocast(model, dtype)
        done["cpu_autocast"] = str(dtype)
    if done:
        log.info("compute in %s: %s", dtype, done)
    _APPLIED[model] = (done, guard)
    return done


@contextlib.contextmanager
def fsdp_inputs_kept(model: nn.Module):
    """While inside, upstream ``shard_model`` (``wan.distributed.fsdp``) wraps an fp16 ``model``
    without FSDP's cast of the root's forward inputs to the param dtype (MixedPrecision's
    ``cast_root_forward_inputs``, on by default): the latents, motion and audio inputs reach the
    fp32 layers as they do in one process, so every FSDP layout equals one rank in fp16 (with
    it, the fsdp-fixed frames differed by 2e-4). Any other model is wrapped as upstream does."""
    if next(model.parameters()).dtype != torch.float16:
        yield
        return
    fsdp_module = sys.modules["wan.distributed.fsdp"]
    upstream = fsdp_module.MixedPrecision
    fsdp_module.MixedPrecision = functools.partial(upstream, cast_root_forward_inputs=False)
    try:
        yield
    finally:
        fsdp_module.MixedPrecision = upstream


def guard_of(model: nn.Module) -> Optional[Guard]:
    """The guard :func:`apply` gave ``model`` (fp16), or None. The loaded parts keep it
    (``loading.components.Components.guard``); nothing is stored on the engine's model."""
    return _APPLIED[model][1] if model in _APPLIED else None
