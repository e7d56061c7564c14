"""Patch: let a CUDA build of torchvision import on a CPU build of torch.

Upstream: only a CUDA build of torchvision 0.28 exists; with the CPU torch 2.13 wheel its import
fails with "operator torchvision::nms does not exist" because its C++ kernels (which register the
``torchvision::nms`` / ``qnms`` schemas) cannot load. ``import wan`` imports torchvision.
Change: when torch is a CPU build and the schemas are absent, define the two schemas with
``torch.library`` before torchvision is imported. The wan S2V path uses only torchvision's
Python transforms (Resize, CenterCrop, ToTensor), which work after that; nms itself stays
unimplemented. Never applied on a CUDA torch, so the GPU path is untouched.
Proof: tests/test_patches.py imports torchvision transforms after apply() in a fresh process.
"""
from __future__ import annotations

import torch

_LIB = None  # keep the Library alive: schemas vanish when it is collected


def needed() -> bool:
    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return False
    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return False
    except RuntimeError:
        return True


def apply() -> bool:
    """Define the schemas if needed. Returns True if it did anything. Idempotent."""
    global _LIB
    if _LIB is not None or not needed():
        return False
    lib = torch.library.Library("torchvision", "DEF")  # noqa: TOR901
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB = lib
    return True
