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

    DEQUANT = "dequant"  # the weight dequantized per call to the run's dtype, then upstream's F.linear
    SCALED_MM = "scaled-mm"  # torch._scaled_mm: fp8 x fp8, activations quantized per token (cc >= 8.9)


#: torch._scaled_mm's fp8 tensor-core path: Ada (8.9) and Hopper (9.0) or newer
SCALED_MM_MIN_CC = (8, 9)
_MIN_CC_S = f"{SCALED_MM_MIN_CC[0]}.{SCALED_MM_MIN_CC[1]}"


class Fp8MatmulUnavailable(ValueError):
    """``--fp8-matmul scaled-mm`` where it cannot run: the message is the cause, ``fix`` the fix."""

    def __init__(self, cause: str, fix: str):
        super().__init__(cause)
        self.fix = fix


#: the fix when scaled-mm cannot run
DEQUANT_FIX = ("use --fp8-matmul dequant (the default): the fp8 weights are dequantized per call and multiplied "
               "in the run's dtype")


def _fp8_capable(capability: Optional[Sequence[int]]) -> tuple[Optional[tuple[int, ...]], bool]:
    """``(cc, whether it has fp8 matrix products)``: cc as ints, None when unknown."""
    cc = tuple(int(v) for v in capability) if capability else None
    return cc, cc is not None and cc >= SCALED_MM_MIN_CC


def choose_fp8_matmul(requested, device_type: str, capability: Optional[Sequence[int]]) -> tuple[Fp8Matmul, str]:
    """``(matmul, reason)`` for a run whose fp8 Linears run on ``device_type`` (``cuda``/``cpu``)
    with compute capability ``capability`` (the lowest among the GPUs in use; None: unknown).

    Never chosen for the user: ``scaled-mm`` also rounds the activations to fp8, so it changes the
    frames more than the fp8 weights do (as ``--mode auto`` never picks fp8). It is faster only
    compiled (one H100 at real size: 0.93x the compiled dequant step, 1.03x eager; docs/gpu.md),
    which the doctor says. Asked for, it needs cc >= 8.9 on CUDA (on the CPU torch runs it
    without fp8 hardware: for tests); otherwise :class:`Fp8MatmulUnavailable`."""
    req = Fp8Matmul(requested)
    if req is Fp8Matmul.DEQUANT:
        return req, "the weights dequantized per call, the activations keep their dtype"
    if device_type != "cuda":
        return req, "torch's CPU kernel, no fp8 hardware: for tests"
    cc, capable = _fp8_capable(capability)
    if not capable:
        have = "an unknown compute capability" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
        raise Fp8MatmulUnavailable(
            f"--fp8-matmul scaled-mm needs a GPU of compute capability >= {_MIN_CC_S} (Ada, Hopper or newer) "
            f"for fp8 matrix products; this GPU has {have}", DEQUANT_FIX)
    return req, f"fp8 x fp8 with per-token activation scales; cc {cc[0]}.{cc[1]} >= {_MIN_CC_S}"


def scaled_mm_hint(device_type: str, capability: Optional[Sequence[int]], compiled: bool) -> Optional[str]:
    """What the doctor adds for a dequant run that scaled-mm would make faster (compiled, cc >= 8.9),
    or None."""
    if device_type != "cuda" or not compiled or not _fp8_capable(capability)[1]:
        return None
    return ("--fp8-matmul scaled-mm would be faster here: compiled on an H100 at real size it took 0.93x the "
            "dequant step (docs/gpu.md); it also rounds the activations to fp8")
