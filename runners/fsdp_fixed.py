"""Mode ``fsdp-fixed``: DiT and T5 sharded with FSDP, ``sync_module_states=False``.

Upstream's ``shard_model`` broadcasts from rank 0 (``sync_module_states=True``) which is the
reported init hang; ``patches.fsdp_no_sync`` turns that off and instead proves every rank loaded
identical weights (all-gathered fingerprint). No sequence parallelism: every rank denoises the
whole sequence, so it helps memory, not speed.
"""
from wan_s2v_runner.shared.layout import Mode

from .base import ModeRunner

RUNNER = ModeRunner(Mode.FSDP_FIXED)
