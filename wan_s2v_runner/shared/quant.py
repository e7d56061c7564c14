"""What ``--dit-quant fp8`` quantizes, as names (no torch): read by the patch that holds the fp8
weights (``patches.fp8_linear``), the loader that makes them (``loading.quantize``) and the memory
plan that counts them (``preflight.memory``).

The Linears are the ones peers quantize (LightX2V, Kijai's loader): the blocks' self- and
cross-attention q/k/v/o and FFN, and the audio injection's q/k/v/o. Kept in the param dtype:
modulation, embeddings, norms, biases, the audio encoder, the frame packer and the head.
"""
from __future__ import annotations

import re

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
