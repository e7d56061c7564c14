"""Mode ``ulysses`` (default): Ulysses sequence parallelism over all ranks, no FSDP.

Every rank holds the whole DiT, T5 and VAE; the DiT's self-attention is split by heads with
all-to-all (upstream ``sp_attn_forward_s2v``). Any degree up to the head count (40 for the real
model) runs: ``patches.ulysses_sp`` splits the heads unevenly and pads the token sequence.
"""
from wan_s2v_runner.shared.layout import Mode

from .base import ModeRunner

RUNNER = ModeRunner(Mode.ULYSSES)
