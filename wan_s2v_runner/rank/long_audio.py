"""Long speech through wav2vec2 in overlapping windows (issue #72, item 4).

Upstream (``WanS2V.encode_audio`` -> ``AudioEncoder.extract_audio_feat``) runs wav2vec2 over the
whole speech file in one pass and keeps every layer's hidden states. Self-attention makes that
pass O(T^2) in time (and in memory with an eager attention): measured with wav2vec2-large's
configuration on one CPU thread, 60 s of speech took 36.9 s, ten minutes extrapolate to ~28
minutes (docs/generation.md, "Long speech"). Where the speech is longer than one window
(:data:`~wan_s2v_runner.shared.encoder_placement.WINDOW_S`: 60 s) this module encodes it in windows
instead and stitches the per-frame hidden states; speech that fits one window goes through
upstream's ``s2v.encode_audio`` unchanged (the very same call as before: bit for bit upstream's).

What stays exact, and what cannot:

* the feature extractor's input normalisation (zero mean, unit variance) is global: it is
  computed over the whole waveform by upstream's own processor, then the normalised samples are
  cut into windows;
* the conv feature encoder of the layer-norm variant (``feat_extract_norm == "layer"``, as
  wav2vec2-large-xlsr-53) is local: a frame sees 400 samples at a stride of 320. Windows start on
  a multiple of 320 samples, so a window's frame j is the file's frame ``start + j`` and its conv
  features and feature projection are the single pass's (up to float rounding). The group-norm
  variant (wav2vec2-base: a GroupNorm over time in the first conv layer, a global statistic) is
  never windowed: it keeps upstream's single pass;
* the positional conv embedding (kernel 128 frames: +-64 frames) is exact for every frame at
  least 64 frames from a window's edge: the overlap kept on each side
  (:data:`~wan_s2v_runner.shared.encoder_placement.OVERLAP_S`: 5 s, 250 frames) is wider than that, and only the
  centre of each window is kept (the file's first / last window keep their outer edge too, which
  the single pass pads exactly the same way);
* self-attention is global in the single pass and window-wide here: that is the approximation. A
  kept frame still sees at least ``OVERLAP_S`` (5 s) of context on each side. Bound: every hidden
  state within 1e-2 x its max |value| of the single pass's, the input state (before attention)
  within 1e-5 (tests/test_long_audio.py, tiny wav2vec2: 3.4e-3 and 5.6e-7; xlsr-53's configuration
  with random weights at 90 s, bench/bench_long_audio.py: 9.1e-3 and 4.2e-8). Random weights
  attend evenly over the sequence; the real weights' distance is ``bench_long_audio.py --ckpt``'s.

The stitched states go straight into one [layers + 1, frames, hidden] buffer (what upstream's
``torch.cat(res.hidden_states)`` builds), on the model's device, then upstream's own
``linear_interpolation`` and ``get_audio_embed_bucket_fps`` run on it, as upstream's
``encode_audio`` does. So the peak is one window's activations plus the features themselves.
"""
from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass

import torch

from wan_s2v_runner.shared import encoder_placement
from wan_s2v_runner.shared.encoder_placement import FRAMES_PER_S

log = logging.getLogger("wan_s2v.long_audio")

#: the rate wav2vec2 reads (upstream's ``librosa.load(audio_path, sr=16000)``)
RATE = encoder_placement.RATE


@dataclass(frozen=True)
class Windows:
    """Window and overlap lengths, in wav2vec2 frames (50 a second)."""

    window: int = encoder_placement.window_frames()
    overlap: int = encoder_placement.overlap_frames()

    def __post_init__(self):
        if self.overlap < 0 or self.window <= 2 * self.overlap:
            raise ValueError(f"a window of {self.window} frames cannot keep a centre with {self.overlap} "
                             "frames of overlap on each side")

    def splits(self, frames: int) -> bool:
        """Whether ``frames`` frames of speech take more than one window."""
        return frames > self.window

    def spans(self, frames: int) -> list[tuple[int, int, int, int]]:
        """The windows for ``frames`` frames: (start, end, keep_from, keep_to) in file frames, the
        windows [start, end) of at most :attr:`window` frames, evenly spaced, the last one ending
        at ``frames``; consecutive windows overlap by at least ``2 * overlap`` and each keeps
        [keep_from, keep_to): the kept parts tile [0, frames), each at least :attr:`overlap` frames
        from its window's inner edges."""
        if not self.splits(frames):
            return [(0, frames, 0, frames)]
        step = self.window - 2 * self.overlap
        n = math.ceil((frames - self.window) / step) + 1
        starts = [round(i * (frames - self.window) / (n - 1)) for i in range(n)]
        out = []
        for i, a in enumerate(starts):
            lo = 0 if i == 0 else (starts[i - 1] + self.window + a) // 2
            hi = frames if i == n - 1 else (a + self.window + starts[i + 1]) // 2
            out.append((a, a + self.window, lo, hi))
        return out


def conv_frames(config, samples: int) -> int:
    """Frames wav2vec2's conv feature encoder makes of ``samples`` samples (its layers' floors)."""
    n = samples
    for k, s in zip(config.conv_kernel, config.conv_stride):
        n = (n - k) // s + 1 if n >= k else 0
    return max(0, n)


def windowable(config) -> bool:
    """Whether windowing can keep the encoder's local parts exact: the layer-norm conv encoder
    (``feat_extract_norm == "layer"``: xlsr-53's). The group-norm variant normalises the first conv
    layer over the whole time axis: it keeps upstream's single pass."""
    return getattr(config, "feat_extract_norm", "group") == "layer" and not getattr(config, "add_adapter", False)


def _stride(config) -> int:
    return math.prod(config.conv_stride)


def _receptive(config) -> int:
    """Samples one frame reads (400 for wav2vec2's conv stack)."""
    r = 1
    for k, s in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        r = (r - 1) * s + k
    return r


def load_input_values(encoder, audio_path: str) -> torch.Tensor:
    """The normalised samples upstream's ``extract_audio_feat`` hands the model ([1, samples]):
    the same load (the ``librosa`` its module holds, our ``audio_load`` patch where applied) and
    the same processor call, over the whole file."""
    librosa = sys.modules[type(encoder).__module__].librosa
    audio_input, sample_rate = librosa.load(audio_path, sr=RATE)
    return encoder.processor(audio_input, sampling_rate=sample_rate, return_tensors="pt").input_values


def hidden_states(model, input_values: torch.Tensor, windows: Windows) -> torch.Tensor:
    """Every hidden state wav2vec2 returns for ``input_values`` ([1, samples], normalised over
    the whole file), stitched from :meth:`Windows.spans`: [layers + 1, frames, hidden] on the
    model's device, what upstream's ``torch.cat(model(...).hidden_states)`` is for one window."""
    cfg = model.config
    stride, receptive = _stride(cfg), _receptive(cfg)
    samples = input_values.shape[-1]
    frames = conv_frames(cfg, samples)
    out = None
    for a, b, lo, hi in windows.spans(frames):
        s0 = a * stride
        s1 = samples if b >= frames else (b - 1) * stride + receptive
        res = model(input_values[:, s0:s1].to(model.device), output_hidden_states=True)
        states = res.hidden_states
        if states[0].shape[1] != b - a:
            raise RuntimeError(f"wav2vec2 made {states[0].shape[1]} frames of window [{a}, {b}); expected {b - a}")
        if out is None:
            out = states[0].new_empty((len(states), frames, states[0].shape[-1]))
        for i, h in enumerate(states):
            out[i, lo:hi] = h[0, lo - a:hi - a]
        del res, states, h
    return out


def extract_audio_feat(encoder, audio_path: str, windows: Windows, dtype=torch.float32) -> torch.Tensor:
    """Upstream's ``extract_audio_feat(audio_path, return_all_layers=True)`` with the hidden
    states from :func:`hidden_states`; then upstream's own interpolation to the video's rate."""
    audio_encoder = sys.modules[type(encoder).__module__]
    feat = hidden_states(encoder.model, load_input_values(encoder, audio_path), windows)
    feat = audio_encoder.linear_interpolation(feat, input_fps=FRAMES_PER_S, output_fps=encoder.video_rate)
    return feat.to(dtype)


def encode_audio(s2v, audio_path: str, infer_frames: int, seconds, windows: Windows | None = None):
    """What upstream's ``s2v.encode_audio(audio_path, infer_frames=...)`` returns, for speech of
    ``seconds`` (its header's; None: unknown). Speech that fits one window (or of unknown length,
    or a group-norm wav2vec2): that very call. Longer speech: its features encoded in windows
    (:func:`extract_audio_feat`), then upstream's ``encode_audio`` steps after
    ``extract_audio_feat`` (the buckets per video frame, the DiT's device and dtype, the
    [1, layers, dim, frames] layout)."""
    windows = windows or Windows()
    enc = s2v.audio_encoder
    frames = None if seconds is None else encoder_placement.speech_frames(seconds)
    if frames is None or not windows.splits(frames) or not windowable(enc.model.config):
        return s2v.encode_audio(audio_path, infer_frames=infer_frames)
    log.info("long speech (%.1f s): %d wav2vec2 frames in %d windows of %d, %d of overlap each side",
             seconds, frames, len(windows.spans(frames)), windows.window, windows.overlap)
    z = extract_audio_feat(enc, audio_path, windows)
    # upstream's WanS2V.encode_audio from here on
    bucket, num_repeat = enc.get_audio_embed_bucket_fps(z, fps=s2v.fps, batch_frames=infer_frames,
                                                        m=s2v.audio_sample_m)
    del z
    bucket = bucket.to(s2v.device, s2v.param_dtype).unsqueeze(0)
    if len(bucket.shape) == 3:
        bucket = bucket.permute(0, 2, 1)
    elif len(bucket.shape) == 4:
        bucket = bucket.permute(0, 2, 3, 1)
    return bucket, num_repeat
