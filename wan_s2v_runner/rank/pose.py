"""Rank side of ``--pose-video``: each clip's pose condition latents, computed as upstream's
``WanS2V.load_pose_cond`` computes them (speech2video.py), one clip at a time.

Upstream reads ``infer_frames * num_repeat`` frames (every ``round(fps / 16)``-th, from the
first: :mod:`wan_s2v_runner.shared.pose_video`), scales them to [-1, 1], resizes the short side
to ``min(H, W)`` and centre-crops (torchvision, on the float frames), pads with -1 frames up to
``num_repeat * infer_frames``, chunks per clip, prepends each chunk's first frame, VAE-encodes
(input in the run's param dtype) and drops the first latent frame; clip ``r`` is conditioned on
chunk ``r``. It does all of that for every clip up front, on every rank, with the whole video's
frames as float at full resolution in memory.

Here the same numbers are made per clip, just before the clip's denoising, by the ranks that
run the VAE: with ``--vae-parallel`` each rank transforms the frames and keeps only its own rows
(``own_band``) and the encode is split by rows (exact; every rank ends with the whole latents),
otherwise the decoding rank encodes alone and broadcasts the latents. The frame transform is per
frame (the same numbers as upstream's batched transform: tests/test_pose.py proves the frames
equal upstream ``generate(pose_video=...)``). A resumed run reads only the clips it generates.
"""
from __future__ import annotations

from typing import Callable

import torch

from wan_s2v_runner.shared.pose_video import PoseFrames


class PoseCondition:
    """The pose condition latents of each clip of one video (``[1, 16, T_lat, H/8, W/8]``)."""

    def __init__(self, path: str, size: tuple[int, int], infer_frames: int, num_clips: int,
                 param_dtype: torch.dtype, device: torch.device,
                 encode: Callable[[torch.Tensor], torch.Tensor], band: Callable[[torch.Tensor], torch.Tensor]):
        """``encode``: pixels ``[1, 3, T, h, W]`` -> latents (the loop's VAE encode, split or
        not; with a split, ``h`` is this rank's band); ``band``: this rank's rows of a frame
        (identity without a split)."""
        from torchvision import transforms

        self.height, self.width = size
        self.infer_frames, self.param_dtype, self.device = infer_frames, param_dtype, device
        self.frames = PoseFrames(path, infer_frames, num_clips)
        self._resize = transforms.Resize(min(self.height, self.width))
        self._crop = transforms.CenterCrop((self.height, self.width))
        self._encode, self._band = encode, band

    def pixels(self, clip: int) -> torch.Tensor:
        """Clip ``clip``'s condition frames (this rank's rows of them): ``[1, 3, infer_frames + 1,
        rows, W]``, the chunk's first frame first, -1 frames past the video's end."""
        video = self.frames.clip(clip)
        frames = []
        for frame in video:  # upstream: the whole video at once; per frame gives the same numbers
            x = torch.from_numpy(frame).unsqueeze(0).permute(0, 3, 1, 2) / 255.0 * 2 - 1.0
            frames.append(self._band(self._crop(self._resize(x)).permute(1, 0, 2, 3).unsqueeze(0)))
        pad = self.infer_frames - len(frames)
        if pad:
            like = self._band(torch.empty([1, 3, 1, self.height, self.width]))
            frames.append(-torch.ones([1, 3, pad, like.shape[-2], self.width]))
        cond = torch.cat(frames, dim=2)
        return torch.cat([cond[:, :, 0:1], cond], dim=2)

    def latents(self, clip: int) -> torch.Tensor:
        """Clip ``clip``'s condition latents, in the run's param dtype on its device. Collective
        when the encode is split."""
        cond = self.pixels(clip).to(dtype=self.param_dtype, device=self.device)
        return self._encode(cond)[:, :, 1:].to(dtype=self.param_dtype, device=self.device)

    def close(self) -> None:
        self.frames.close()

