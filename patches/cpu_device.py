"""Patch: run ``wan.speech2video.WanS2V`` on the CPU.

Upstream: ``WanS2V`` hard-codes ``torch.device(f"cuda:{device_id}")`` for the VAE, DiT, noise
and generator, calls ``torch.cuda.empty_cache()/synchronize()`` and wraps denoising in
``torch.amp.autocast('cuda', dtype=bf16)``.
Change (CPU runs only): ``wan.speech2video`` looks ``torch`` up as a module global, so we rebind
that one name to a thin proxy of ``torch`` in which ``device('cuda...')`` is the CPU device,
``cuda.empty_cache/synchronize`` do nothing, and ``amp.autocast('cuda', ...)`` is a no-op context.
Every other attribute is torch's own. No engine file changes, no other module sees the proxy, and
a GPU run never applies it. fp32 on CPU is set through the config (``param_dtype``/``t5_dtype``)
by the worker, not here.
Proof: the parity tests run the whole pipeline on CPU through this patch; tests/test_patches.py
checks the proxy maps devices and leaves ``torch`` itself untouched.
"""
from __future__ import annotations

import contextlib
from types import ModuleType, SimpleNamespace

import torch

from patches.patch import Patch


def _cpu_device(*args, **kwargs):
    dev = torch.device(*args, **kwargs)
    return torch.device("cpu") if dev.type == "cuda" else dev


class _AmpProxy(SimpleNamespace):
    @staticmethod
    def autocast(device_type="cuda", *args, **kwargs):
        if device_type == "cuda":
            return contextlib.nullcontext()
        return torch.amp.autocast(device_type, *args, **kwargs)


class _CudaProxy:
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def synchronize(*args, **kwargs):
        return None


class TorchOnCPU(ModuleType):
    """`torch`, except for the CUDA-only calls wan.speech2video makes."""

    def __init__(self):
        super().__init__("torch")
        self.device = _cpu_device
        self.cuda = _CudaProxy()
        self.amp = _AmpProxy()

    def __getattr__(self, name):
        return getattr(torch, name)


def apply(wan_module) -> bool:
    s2v = wan_module.speech2video
    if isinstance(s2v.__dict__.get("torch"), TorchOnCPU):
        return False
    s2v.torch = TorchOnCPU()
    return True


def restore(wan_module) -> bool:
    """Undo :func:`apply`: ``speech2video`` sees torch itself again."""
    s2v = wan_module.speech2video
    if not isinstance(s2v.__dict__.get("torch"), TorchOnCPU):
        return False
    s2v.torch = torch
    return True


def _for_run(wan_module, ctx) -> str:
    apply(wan_module)
    return "speech2video CUDA calls mapped to CPU"


PATCH = Patch("cpu_device", applies=lambda ctx: ctx.on_cpu, apply=_for_run, restore=restore)
