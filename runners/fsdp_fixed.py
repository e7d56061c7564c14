"""Mode ``fsdp-fixed``: DiT and T5 sharded with FSDP, ``sync_module_states=False``.

Upstream's ``shard_model`` broadcasts from rank 0 (``sync_module_states=True``) which is the
reported init hang; ``patches.fsdp_no_sync`` turns that off and instead proves every rank loaded
identical weights (all-gathered fingerprint). No sequence parallelism: every rank denoises the
whole sequence, so it helps memory, not speed.
"""
from wan_s2v_runner.spec import Mode

from .base import COMMON_CHECKS, ModeRunner

RUNNER = ModeRunner(
    mode=Mode.FSDP_FIXED,
    summary="DiT + T5 sharded with FSDP (no rank-0 broadcast; weights fingerprinted)",
    checks=COMMON_CHECKS + ("fsdp",),
)
