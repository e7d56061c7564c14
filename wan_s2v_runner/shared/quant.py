"""What ``--dit-quant fp8`` quantizes, as names (no torch): read by the patch that holds the fp8
weights (``patches.fp8_linear``), the loader that makes them (``loading.quantize``) and the memory
plan that counts them (``preflight.memory``).

The Linears are the ones peers quantize (LightX2V, Kijai's loader): the blocks' self- and
cross-attention q/k/v/o and FFN, and the audio injection's q/k/v/o. Kept in the param dtype:
modulation, embeddings, norms, biases, the audio encoder, the frame packer and the head.

How an fp8 Linear multiplies (``--fp8-matmul``, :class:`Fp8Matmul`) is chosen here by one rule,
:func:`choose_fp8_matmul`, which the patch (on the rank's own GPU) and the doctor (on the probe's
recorded facts) both call, so they cannot disagree.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Optional, Sequence

#: e4m3fn's largest finite value: a row's largest magnitude maps to it
E4M3_MAX = 448.0
#: module names (in WanModel_S2V) of the Linears held in float8_e4m3fn
FP8_LINEARS = re.compile(r"^(blocks\.\d+\.(self_attn|cross_attn)\.[qkvo]|blocks\.\d+\.ffn\.[02]"
                         r"|audio_injector\.injector\.\d+\.[qkvo])$")
#: bytes per output row beside the fp8 weight: its float32 scale
SCALE_BYTES = 4


def is_fp8_weight(name: str) -> bool:
    """Whether the tensor ``name`` (``blocks.0.ffn.0.weight``) is held in fp8 under --dit-quant fp8."""
    return name.endswith(".weight") and bool(FP8_LINEARS.match(name.removesuffix(".weight")))


class Fp8Matmul(str, Enum):
    """How an fp8 Linear computes (``--fp8-matmul``; ``patches.fp8_linear``)."""

    AUTO = "auto"  # the rule of :func:`choose_fp8_matmul`
    DEQUANT = "dequant"  # the weight dequantized per call to the run's dtype, then upstream's F.linear
    SCALED_MM = "scaled-mm"  # torch._scaled_mm: fp8 x fp8, activations quantized per token (cc >= 8.9)


#: torch._scaled_mm's fp8 tensor-core path: Ada (8.9) and Hopper (9.0) or newer
SCALED_MM_MIN_CC = (8, 9)


class Fp8MatmulUnavailable(ValueError):
    """``--fp8-matmul scaled-mm`` where it cannot run: the message is the cause, ``fix`` the fix."""

    def __init__(self, cause: str, fix: str):
        super().__init__(cause)
        self.fix = fix


def choose_fp8_matmul(requested, device_type: str, capability: Optional[Sequence[int]],
                      compiled: bool = False) -> tuple[Fp8Matmul, str]:
    """``(matmul, reason)`` for a run whose fp8 Linears run on ``device_type`` (``cuda``/``cpu``)
    with the lowest compute capability ``capability`` among its GPUs (None: unknown or no GPU),
    its DiT blocks compiled or not (``--compile``).

    ``auto`` takes ``scaled-mm`` where it was measured faster: compiled, on CUDA with cc >= 8.9
    (H100, real size: 0.93x the compiled dequant step, as Inductor fuses the activations'
    quantizing; docs/gpu.md); ``dequant`` everywhere else (eager on the H100 scaled-mm was 1.03x
    dequant's step; the CPU has no fp8 arithmetic). An explicit ``scaled-mm`` needs cc >= 8.9 on
    CUDA (on the CPU torch runs it without fp8 hardware: for tests) and raises
    :class:`Fp8MatmulUnavailable` otherwise."""
    req = Fp8Matmul(requested)
    if req is Fp8Matmul.DEQUANT:
        return req, "requested explicitly"
    cc = tuple(int(v) for v in capability) if capability and device_type == "cuda" else None
    fp8_hardware = cc is not None and cc >= SCALED_MM_MIN_CC
    if req is Fp8Matmul.AUTO:
        if compiled and fp8_hardware:
            return Fp8Matmul.SCALED_MM, (f"auto: compiled blocks on cc {cc[0]}.{cc[1]} >= 8.9, fp8 x fp8 with "
                                         "per-token activation scales (measured faster than dequant there)")
        where = ("eager" if device_type == "cuda" and fp8_hardware else
                 f"cc {cc[0]}.{cc[1]} < 8.9" if cc is not None else "no fp8 matrix hardware")
        return Fp8Matmul.DEQUANT, f"auto ({where}): the weights dequantized per call, activations keep their dtype"
    if device_type != "cuda":
        return req, "requested explicitly; torch's CPU kernel, no fp8 hardware: for tests"
    if not fp8_hardware:
        have = "an unknown compute capability" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
        raise Fp8MatmulUnavailable(
            f"--fp8-matmul scaled-mm needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer) for "
            f"fp8 matrix products; this GPU has {have}",
            "drop --fp8-matmul (auto) or use --fp8-matmul dequant: the fp8 weights are dequantized per call "
            "and multiplied in bf16")
    return req, f"requested explicitly; cc {cc[0]}.{cc[1]} >= 8.9"
