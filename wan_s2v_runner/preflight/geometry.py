"""The engine's size arithmetic, reimplemented as pure functions (no ``import wan``).

Read from wan/speech2video.py and wan/modules/s2v/{model_s2v,motioner}.py (Wan2.2 HEAD 42bf4cf
== wan22 2.2.11):

* ``generation_size`` is ``WanS2V.get_size_less_than_area`` (the image size fitted into
  ``max_area``, padded to multiples of 64); it can return a 0 side (e.g. ``max_area`` < 64*64,
  or a 3x300 image at 64*64), which then fails in torchvision's Resize.
* Per clip the DiT sees ONE sequence that ``WanModel_S2V.forward`` concatenates and, with
  Ulysses, splits with ``torch.chunk(x, world, dim=1)``: the noisy latent tokens
  ``lat_f * (H/16) * (W/16)`` (``lat_f``: ``shared.dit_cost.clip_latent_frames``), the
  reference-image tokens ``(H/16) * (W/16)``, and the FramePack motion tokens (buckets 1, 2, 16
  latent frames patchified at 1x, 2x, 4x: ``(H/16)(W/16) + (H/32)(W/32) + 4 (H/64)(W/64)``). The
  motion tokens are dropped on the first clip (``drop_first_motion``, unless the run starts
  from the reference image), so two lengths occur. Upstream does not pad (each must divide by
  the Ulysses degree, and the 40 heads too); ``patches.ulysses_sp`` pads both to a multiple of
  the degree and splits the heads unevenly.
* Clips: ``floor(seconds * 16 / infer_frames) + 1`` (``get_audio_embed_bucket_fps``), capped by
  ``--num-clips``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# a clip's latent frames and the 14B's heads: the DiT's rules
from wan_s2v_runner.shared.dit_cost import S2V_14B, clip_latent_frames

# the frame rate: the video budget's (one rule)
from wan_s2v_runner.shared.video_budget import FPS, video_frames

VAE_STRIDE = (4, 8, 8)
PATCH = (1, 2, 2)
FRAMEPACK_BUCKETS = (1, 2, 16)  # latent frames at 1x, 2x, 4x (WanModel_S2V passes [1, 2, 16])
REAL_NUM_HEADS = S2V_14B.num_heads


def generation_size(height: int, width: int, target_area: int, divisor: int = 64) -> tuple[int, int]:
    """(H, W) the engine generates for an image of (height, width): get_size_less_than_area."""
    if height * width <= target_area:
        max_upper_area, min_scale, max_scale = target_area, 0.1, 1.0
    else:
        max_upper_area = target_area
        d = divisor - 1
        b = d * (height + width)
        a = height * width
        c = d**2 - max_upper_area
        min_scale = (-b + math.sqrt(b**2 - 2 * a * c)) / (2 * a)
        max_scale = math.sqrt(max_upper_area / (height * width))
    for i in range(100):
        scale = max_scale - (max_scale - min_scale) * i / 100
        new_h, new_w = int(height * scale), int(width * scale)
        pad_h, pad_w = (64 - new_h % 64) % 64, (64 - new_w % 64) % 64
        ph, pw = new_h + pad_h, new_w + pad_w
        if ph * pw <= max_upper_area:
            return ph, pw
    aspect = width / height
    tw = int((target_area * aspect) ** 0.5 // divisor * divisor)
    th = int((target_area / aspect) ** 0.5 // divisor * divisor)
    if tw >= width or th >= height:
        tw, th = int(width // divisor * divisor), int(height // divisor * divisor)
    return th, tw


def latent_frames(infer_frames: int) -> int:
    """A clip's noisy latent frames (``shared.dit_cost.clip_latent_frames``: the one rule)."""
    return clip_latent_frames(infer_frames)


@dataclass(frozen=True)
class TokenCounts:
    height: int
    width: int
    latent_frames: int
    noisy: int
    ref: int
    motion: int

    @property
    def first_clip(self) -> int:
        """Sequence length of clip 1 when its motion tokens are dropped (the default)."""
        return self.noisy + self.ref

    @property
    def later_clips(self) -> int:
        return self.noisy + self.ref + self.motion

    def lengths(self, n_clips: int, start_from_ref: bool) -> list[int]:
        """Distinct sequence lengths the DiT sees (what Ulysses chunks)."""
        if start_from_ref:
            return [self.later_clips]
        return [self.first_clip] + ([self.later_clips] if n_clips > 1 else [])

    @property
    def max_len(self) -> int:
        return self.later_clips


def token_counts(height: int, width: int, infer_frames: int) -> TokenCounts:
    lh, lw = height // VAE_STRIDE[1], width // VAE_STRIDE[2]
    ph, pw = lh // PATCH[1], lw // PATCH[2]
    lat_f = latent_frames(infer_frames)
    b1, b2, b4 = FRAMEPACK_BUCKETS
    motion = (b1 * (lh // 2) * (lw // 2) + (b2 // 2) * (lh // 4) * (lw // 4)
              + (b4 // 4) * (lh // 8) * (lw // 8))
    return TokenCounts(height, width, lat_f, lat_f * ph * pw, ph * pw, motion)


def clips_for_audio(seconds: float, infer_frames: int, num_clips: Optional[int] = None) -> int:
    n = int(seconds * FPS / infer_frames) + 1
    return min(n, num_clips) if num_clips else n


def output_frames(n_clips: int, infer_frames: int, start_from_ref: bool) -> int:
    """Frames in the final video: infer_frames per clip, minus 3 on a dropped-motion first clip
    (``shared.video_budget.video_frames``)."""
    return video_frames(n_clips, infer_frames, start_from_ref)
