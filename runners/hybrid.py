"""Mode ``hybrid``: Ulysses sequence parallel + FSDP-sharded DiT, T5 on the CPU.

Lowest GPU memory per rank with the speed-up of sequence parallelism; T5 (11.4 GB) never touches
the GPU. Same Ulysses degree constraints as ``ulysses``, same weight fingerprint as ``fsdp-fixed``.
"""
from wan_s2v_runner.shared.layout import Mode

from .base import ModeRunner

RUNNER = ModeRunner(Mode.HYBRID)
