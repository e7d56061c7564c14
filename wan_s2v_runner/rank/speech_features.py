"""A live block's speech features, computed from its own window of the speech (the rank's side of
:mod:`wan_s2v_runner.shared.speech_windows`).

Upstream's ``WanS2V.encode_audio`` runs wav2vec2 once over the whole file (the processor's
normalisation over every sample, attention over every frame, the 50 -> 30 fps interpolation
stretched by the file's length), so a live session whose speech arrives over time cannot use it.
Here block ``g``'s features are a pure function of the samples in
:meth:`~wan_s2v_runner.shared.speech_windows.SpeechWindow.samples_of_block` (absolute time from
sample 0; samples not in the timeline count as zeros, silence): those samples alone go through
upstream's processor (zero mean, unit variance over the window) and wav2vec2 (every hidden state,
``no_grad``, on the model's device), and the block's 12 video frames are interpolated from the
kept frames on the absolute grid, in fp32, then cast as upstream casts (``.to(device, dtype)``):
[1, layers, C, 12], the layout upstream's ``encode_audio`` returns, sliced to one block. A file
and the same speech fed in chunks of any size make the same bits.

A group-norm wav2vec2 (``feat_extract_norm != "layer"``, wav2vec2-base) normalises its first conv
layer over time: over the window here, which is the unit of the rule, so it works the same (and is
as causal); its features are just further from upstream's whole-file pass than the layer-norm
variant's (xlsr-53, whose conv stack is local).

:func:`load_speech` reads a file's samples as upstream reads them, before the processor.
"""
from __future__ import annotations

import sys
from typing import Union

import numpy as np
import torch

from wan_s2v_runner.rank import long_audio
from wan_s2v_runner.shared.speech_windows import (
    FEATURE_FPS,
    RATE,
    RECEPTIVE,
    STRIDE,
    SpeechWindow,
    frame_taps,
)


def load_speech(encoder, path: str) -> torch.Tensor:
    """The file's float32 mono samples at 16 kHz ([samples], CPU), read as upstream's
    ``extract_audio_feat`` reads them (the ``librosa`` its module holds: our ``audio_load`` patch
    where applied), without the processor's normalisation."""
    librosa = sys.modules[type(encoder).__module__].librosa
    samples, _ = librosa.load(path, sr=RATE)
    return torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32).reshape(-1))


class BlockFeatures:
    """Block features of one job's speech by :class:`SpeechWindow`'s rule, with ``encoder``
    (upstream's ``AudioEncoder``: its processor and wav2vec2), returned on ``device`` in ``dtype``
    (the DiT's param dtype, as upstream's ``encode_audio``)."""

    def __init__(self, encoder, window: SpeechWindow, device: torch.device, dtype: torch.dtype):
        cfg = encoder.model.config
        stride, receptive = long_audio._stride(cfg), long_audio._receptive(cfg)
        if (stride, receptive) != (STRIDE, RECEPTIVE):
            raise RuntimeError(f"wav2vec2's conv stack reads {receptive} samples every {stride}; the speech "
                               f"windows' rule assumes {RECEPTIVE} every {STRIDE}")
        if getattr(encoder, "video_rate", FEATURE_FPS) != FEATURE_FPS:
            raise RuntimeError(f"the audio encoder interpolates to {encoder.video_rate} fps; the speech "
                               f"windows' rule to {FEATURE_FPS}")
        self.encoder, self.window = encoder, window
        self.device, self.dtype = torch.device(device), dtype

    def of_block(self, timeline: Union[torch.Tensor, np.ndarray], g: int) -> torch.Tensor:
        """Block ``g``'s features ([1, layers, C, 12]) from ``timeline``: the speech's samples from
        absolute time 0 (16 kHz mono float32; what lies past its end is silence)."""
        s0, s1 = self.window.samples_of_block(g)
        timeline = torch.as_tensor(timeline).reshape(-1)
        window = np.zeros(s1 - s0, dtype=np.float32)
        have = timeline[s0:s1].detach().to("cpu", torch.float32).numpy()
        window[:have.size] = have
        return self.of_window(window, g)

    def of_window(self, window: np.ndarray, g: int) -> torch.Tensor:
        """Block ``g``'s features from its window's samples alone (``samples_of_block(g)``, zeros
        where silent): for a caller that holds only the recent speech."""
        s0, s1 = self.window.samples_of_block(g)
        window = np.asarray(window, dtype=np.float32).reshape(-1)
        if window.size != s1 - s0:
            raise ValueError(f"block {g}'s window is {s1 - s0} samples [{s0}, {s1}), got {window.size}")
        first, end = self.window.window_frames(g)
        model = self.encoder.model
        if long_audio.conv_frames(model.config, window.size) != end - first:
            raise RuntimeError(f"wav2vec2's conv stack makes {long_audio.conv_frames(model.config, window.size)} "
                               f"frames of {window.size} samples; the rule expects {end - first}")
        x = self.encoder.processor(window, sampling_rate=RATE, return_tensors="pt").input_values
        with torch.no_grad():
            res = model(x.to(model.device), output_hidden_states=True)
            states = torch.cat(res.hidden_states)  # [layers, frames, C], upstream's layout
            del res
            if states.shape[1] != end - first:
                raise RuntimeError(f"wav2vec2 made {states.shape[1]} frames of block {g}'s window "
                                   f"[{first}, {end}); expected {end - first}")
            taps = [frame_taps(i) for i in self.window.video_frames_of_block(g)]
            at = torch.tensor([j - first for j, _ in taps], device=states.device)
            w = torch.tensor([w for _, w in taps], dtype=torch.float32, device=states.device)[None, :, None]
            states = states.float()
            feat = states[:, at] * (1 - w) + states[:, at + 1] * w  # [layers, 12, C]
        return feat.to(self.device, self.dtype).permute(0, 2, 1).unsqueeze(0)
