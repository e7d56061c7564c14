"""The live mode's VAE decode: latent frames decoded as they come, the decoder's causal cache kept
between calls (LiveAvatar's ``vae_streaming.py`` ``stream_decode``).

Upstream's ``WanVAE_.decode`` already runs its decoder one latent frame at a time against a
cache of each causal convolution's last input frames (``feat_cache``), cleared at the start and
end of every call. Keeping that cache across calls makes the decode of frames given in pieces
the decode of the whole sequence: the first latent frame gives 1 frame, every later one 4
(``tests/test_live.py``: equal to one ``vae.decode`` of the concatenation, exactly).
"""
from __future__ import annotations

import torch


class StreamDecoder:
    """One video's decode on the decoding rank; ``vae`` is the engine's ``Wan2_1_VAE``."""

    def __init__(self, vae):
        from wan.modules.vae2_1 import count_conv3d

        self.vae = vae
        self.feat = [None] * count_conv3d(vae.model.decoder)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents [1, 16, f, h, w] after every earlier call's -> their frames [1, 3, n, H, W]
        (float, clamped to [-1, 1] as upstream's ``decode``)."""
        model, scale = self.vae.model, self.vae.scale
        with torch.amp.autocast("cuda", dtype=self.vae.dtype):
            if isinstance(scale[0], torch.Tensor):
                z = z / scale[1].view(1, model.z_dim, 1, 1, 1) + scale[0].view(1, model.z_dim, 1, 1, 1)
            else:
                z = z / scale[1] + scale[0]
            x = model.conv2(z)
            outs = []
            for i in range(z.shape[2]):
                idx = [0]
                outs.append(model.decoder(x[:, :, i:i + 1], feat_cache=self.feat, feat_idx=idx))
            out = torch.cat(outs, 2)
        return out.float().clamp_(-1, 1)

    def close(self) -> None:
        self.feat = []
