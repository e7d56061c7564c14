"""Mode ``hybrid``: Ulysses sequence parallel + FSDP-sharded DiT, T5 on the CPU.

Lowest GPU memory per rank with the speed-up of sequence parallelism; T5 (11.4 GB) never touches
the GPU. Same Ulysses degree constraints as ``ulysses``, same weight fingerprint as ``fsdp-fixed``.
"""
from wan_s2v_runner.spec import Mode

from .base import COMMON_CHECKS, ModeRunner

RUNNER = ModeRunner(
    mode=Mode.HYBRID,
    summary="Ulysses + FSDP DiT, T5 on CPU (lowest GPU memory)",
    checks=COMMON_CHECKS + ("ulysses_degree", "fsdp"),
)
