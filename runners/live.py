"""Mode ``live`` (docs/live.md): LiveAvatar's causal few-step S2V. Every DiT rank holds the whole
DiT, unsharded and without sequence parallelism: each runs its denoising steps of every block
alone (``wan_s2v_runner.shared.live_recipe.stage_plan``), passing the block's latents on point to point;
rank 0 encodes the inputs, decodes the blocks and writes the video. The loop is
``wan_s2v_runner.rank.block_pipeline`` (the live driver of the job shell).
"""
from wan_s2v_runner.shared.layout import Mode

from .base import ModeRunner

RUNNER = ModeRunner(Mode.LIVE)
