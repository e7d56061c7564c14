"""The compute dtype (``--dtype``): one rule the rank's engine config and the memory plan both read.

Upstream computes the DiT and T5 in bf16 (``WAN_CONFIGS['s2v-14B'].param_dtype``), which GPUs
older than Ampere (compute capability < 8.0: V100, T4, the 20xx cards) do not have: torch emulates
it through fp32 there (V100 cuBLAS ~10 TFLOPS bf16 against ~95-100 fp16), SDPA's flash kernel
needs sm80 and its memory-efficient kernel takes fp16/fp32 only. Peers compute in fp16 there
(ComfyUI, Wan2GP), keeping a few small layers in fp32; so does ``--dtype fp16``
(``patches.fp16_compute``: which layers, and the guard against a non-finite activation).

* ``auto`` (the default): bf16 on a GPU with bf16 units (cc >= 8.0), fp16 below; fp32 on the CPU
  (bf16 matmuls there are slow and lossy: what the worker has always done).
* ``bf16``/``fp16``/``fp32``: that dtype for the DiT and T5 (the VAE and wav2vec2 stay fp32, as
  upstream keeps them).

:func:`resolve` is the rule; :func:`element_bytes` what the plan counts per parameter. Imports
nothing heavy (torch only inside :func:`torch_dtype`).
"""
from __future__ import annotations

from enum import Enum
from typing import Optional, Sequence

#: the first compute capability with bf16 units (Ampere)
BF16_CC = (8, 0)


class ComputeDtype(str, Enum):
    """What the DiT and T5 compute in (``--dtype``)."""

    AUTO = "auto"  # bf16 where the GPU has it, fp16 below cc 8.0, fp32 on the CPU
    BF16 = "bf16"  # upstream's
    FP16 = "fp16"  # GPUs older than Ampere; a few layers kept in fp32 (patches.fp16_compute)
    FP32 = "fp32"  # the CPU's; slow on a GPU, for a part that overflows in fp16


def resolve(choice: ComputeDtype, device_type: str,
            capabilities: Sequence[Optional[tuple[int, int]]] = ()) -> tuple[ComputeDtype, str]:
    """(dtype, why) of ``choice`` on ``device_type`` (``cuda``/``cpu``) whose GPUs have
    ``capabilities`` (every GPU of the group: the oldest decides; None where unknown)."""
    choice = ComputeDtype(choice)
    if choice is not ComputeDtype.AUTO:
        return choice, f"{choice.value} (--dtype {choice.value})"
    if device_type != "cuda":
        return ComputeDtype.FP32, "fp32 (auto: the CPU; bf16 matmuls there are slow and lossy)"
    known = [tuple(c) for c in capabilities if c is not None]
    if not known:
        return ComputeDtype.BF16, "bf16 (auto: the GPU's compute capability is unknown; upstream's dtype)"
    oldest = min(known)
    cc = f"{oldest[0]}.{oldest[1]}"
    if oldest >= BF16_CC:
        return ComputeDtype.BF16, f"bf16 (auto: cc {cc} has bf16 units; upstream's dtype)"
    return ComputeDtype.FP16, (f"fp16 (auto: cc {cc} has no bf16 units: bf16 would be emulated through fp32; "
                               "a few layers stay fp32, a non-finite activation stops the job)")


#: what each device computed in before ``--dtype`` existed (a digest or an identity that records
#: this value records nothing: runs and pools made before keep theirs)
HISTORICAL = {"cuda": ComputeDtype.BF16, "cpu": ComputeDtype.FP32}


def recorded(dtype, device_type: str) -> Optional[str]:
    """What a frame-settings record keeps of ``dtype`` on ``device_type``: None for ``auto`` and
    for the device's historical dtype (:data:`HISTORICAL`), else its name. The launcher settles
    ``auto`` from the preflight (the oldest GPU), so a V100's run records fp16 and is never
    resumed as, or pooled with, bf16 frames."""
    dtype = ComputeDtype(dtype)
    if dtype is ComputeDtype.AUTO or HISTORICAL.get(device_type) is dtype:
        return None
    return dtype.value


def element_bytes(dtype: ComputeDtype) -> int:
    """Bytes of one parameter (or activation) element in ``dtype`` (resolved)."""
    return 4 if ComputeDtype(dtype) is ComputeDtype.FP32 else 2


def torch_dtype(dtype: ComputeDtype):
    """The torch dtype of a resolved ``dtype``."""
    import torch
    return {ComputeDtype.BF16: torch.bfloat16, ComputeDtype.FP16: torch.float16,
            ComputeDtype.FP32: torch.float32}[ComputeDtype(dtype)]


def has_bf16(capability: Optional[tuple[int, int]]) -> bool:
    """Whether a GPU of ``capability`` computes bf16 natively (None: unknown, assumed yes)."""
    return capability is None or tuple(capability) >= BF16_CC
