"""The live mode's recipe and its rules (LiveAvatar's causal few-step S2V): pure numbers and
functions that the rank's loop (:mod:`wan_s2v_runner.rank.block_pipeline`), the preflight and the plan all read,
so they cannot disagree.

What LiveAvatar's inference does (github Alibaba-Quark/LiveAvatar @9c2c38d, read from
``causal_s2v_pipeline.py`` / ``causal_model_s2v.py``; docs/live.md says which points we keep):

* the video is made in **blocks** of 3 latent frames (12 video frames, 0.75 s at 16 fps);
* each block is denoised in **4 steps** of diffusers' ``FlowMatchEulerDiscreteScheduler(shift=3)``
  (timesteps 1000, 857.7, 602.2, 8.9), no CFG;
* its queries are the block's tokens; its keys are the last :data:`WINDOW_BLOCKS` blocks' keys
  **at the same step** (one cache per step, the block itself included) plus the condition tokens
  (reference and frame-packed motion), whose keys a sink pass computed once;
* the noisy tokens sit at their absolute latent frame; the reference at
  ``max(30, frame + distance)`` with the distance drawn in 4..30 for every forward (LiveAvatar:
  ``random.randint`` unseeded; ours: drawn from the job's seed, :func:`ref_distance`); the motion
  tokens at their fixed negative positions;
* the first block's first 3 decoded frames are dropped, as upstream drops a first clip's.

The step pipeline (``shared.layout``'s :func:`stage_plan`, ``Layout.stages``): one rank per
denoising step and a decoding rank (5 ranks for 4 steps), or the steps shared evenly by 1, 2 or 4
ranks, the first of which also decodes. Rank 0 always encodes the inputs, decodes and writes the
video.
"""
from __future__ import annotations

import hashlib

from wan_s2v_runner.shared.layout import LIVE_STEPS, StagePlan, stage_plan, stage_problem, supported_world_sizes

__all__ = ["StagePlan", "stage_plan", "stage_problem", "supported_world_sizes"]  # the layout's, read here too

#: latent frames a block holds (LiveAvatar's ``num_frames_per_block``)
BLOCK_LATENT_FRAMES = 3
#: video frames a block adds (4 per latent frame; the first block 3 fewer: :data:`FIRST_BLOCK_DROP`)
BLOCK_FRAMES = 4 * BLOCK_LATENT_FRAMES
#: frames dropped from the first block's decode (upstream's first clip drops the same 3)
FIRST_BLOCK_DROP = 3
#: blocks a query block attends at one step, itself included: LiveAvatar's KV cache is one
#: 48-frame clip long (``kv_cache_size = max_seq_len`` with ``infer_frames 48``)
WINDOW_BLOCKS = 4
#: the distilled schedule: steps (the layout's, whose stage plan shares them over the ranks) and
#: shift (no CFG)
STEPS = LIVE_STEPS
SHIFT = 3.0
#: the reference token's base temporal position (upstream's S2V: 30) and the drawn distance's range
REF_BASE = 30
REF_DISTANCE = (4, 30)
#: latent frames of the initial motion latents decoded first, to fill the streaming VAE's causal
#: cache before the first block (LiveAvatar: ``motion_latents[:, :, :7]``)
PRIME_LATENTS = 7
#: LiveAvatar's published LoRA (``liveavatar.safetensors``): PEFT r=128, alpha=64 (its training
#: config ``s2v_causal_sft.yaml``); a PEFT file carries no alpha, so it is merged at alpha / rank
LORA_RANK = 128
LORA_ALPHA = 64.0


def lora_strength(rank: int = LORA_RANK) -> float:
    """The strength ``--live-lora`` is merged at: PEFT's scale alpha / rank."""
    return LORA_ALPHA / rank


def video_frames(blocks: int) -> int:
    """Frames of a live video of ``blocks`` blocks."""
    return max(0, blocks * BLOCK_FRAMES - FIRST_BLOCK_DROP)


def blocks_for(audio_frames: int) -> int:
    """Blocks for ``audio_frames`` video frames of speech: upstream's bucketing of the speech
    (``get_audio_embed_bucket_fps`` in 12-frame batches: one more than the whole batches that fit),
    so the video ends within 2 frames of the speech, or pads it with up to 9."""
    return audio_frames // BLOCK_FRAMES + 1


def ref_distance(seed: int, block: int, step: int) -> int:
    """The reference token's distance for ``block``'s ``step`` forward: uniform in
    :data:`REF_DISTANCE` like LiveAvatar's ``random.randint(4, 30)``, but a function of the job's
    seed, the block and the step, so a run is reproducible and every rank of a step pipeline draws
    the same value without talking (a hash, not a shared generator's state)."""
    lo, hi = REF_DISTANCE
    digest = hashlib.sha256(f"wan-s2v-live:{seed}:{block}:{step}".encode()).digest()
    return lo + int.from_bytes(digest[:8], "little") % (hi - lo + 1)


def ref_position(frame: int, distance: int) -> int:
    """The reference token's temporal position for a block starting at latent ``frame``:
    LiveAvatar rolls the condition grid by ``max(0, frame - (30 - distance))``."""
    return REF_BASE + max(0, frame - (REF_BASE - distance))


def window(block: int) -> range:
    """The blocks ``block`` attends at a step (its own K/V included)."""
    return range(max(0, block - WINDOW_BLOCKS + 1), block + 1)
