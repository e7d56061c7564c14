"""Which speech a live block's features read: the rules of block-wise streaming speech features.

Upstream's speech features (``WanS2V.encode_audio``) are a function of the whole file: the
processor's zero-mean/unit-variance normalisation over every sample, wav2vec2's self-attention over
every frame, and ``linear_interpolation`` from 50 to 30 fps with ``align_corners=True`` (a grid
stretched by the file's length: its last 30-fps frame lands on the last wav2vec2 frame, up to
~2.7 frames, 53 ms, later than its time). A live session's speech arrives over time, so the live
recipe reads its speech in **windows** instead: block ``g``'s features are a pure function of the
speech samples in :meth:`SpeechWindow.samples_of_block` (a left context, the block's own frames, a
fixed lookahead after it), on absolute time from sample 0, samples not there counting as zeros
(silence). A file and the same speech fed in chunks of any size make the same bits.

The grid, on absolute time (numbers only, so the rank, the timeline and the plan agree):

* video frame ``i`` (16 fps) takes 30-fps feature ``k = round_half_even(i * 30 / 16)``
  (upstream's ``get_sample_indices``: ``np.round``, exact in binary floating point);
* 30-fps feature ``k`` lies at 50-fps position ``p = k * 50 / 30``: linear between wav2vec2 frames
  ``floor(p)`` and ``floor(p) + 1``, the second weighted ``p - floor(p)`` (0, 1/3 or 2/3);
* wav2vec2 frame ``j`` reads samples ``[320 j, 320 j + 400)`` (its conv stack's stride and
  receptive field: :data:`STRIDE`, :data:`RECEPTIVE`; the rank checks them against the model's
  config).

:meth:`SpeechWindow.blocks_for_samples` keeps today's count of blocks for a finished speech
(upstream's ``get_audio_embed_bucket_fps`` with 12-frame batches). No torch here: the rank's side
is :mod:`wan_s2v_runner.rank.speech_features`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from wan_s2v_runner.shared.encoder_placement import FRAMES_PER_S, RATE, RECEPTIVE, STRIDE, conv_frames
from wan_s2v_runner.shared.live_recipe import BLOCK_FRAMES, blocks_for
from wan_s2v_runner.shared.media import FPS

#: seconds of speech a block's video frames cover (12 frames at 16 fps: 0.75 s)
BLOCK_SECONDS = BLOCK_FRAMES / FPS
#: samples a block's frames cover
BLOCK_SAMPLES = RATE * BLOCK_FRAMES // FPS
#: the features' rate after upstream's interpolation (``AudioEncoder.video_rate``)
FEATURE_FPS = 30
#: the grid repeats every 4 blocks (48 video frames: 90 features, 150 wav2vec2 frames; 2 blocks
#: are 45 features, whose half-even rounding alternates)
_PERIOD = range(4)


def feature_index(i: int) -> int:
    """The 30-fps feature video frame ``i`` takes: ``round_half_even(i * 30 / 16)``."""
    q, r = divmod(i * FEATURE_FPS, FPS)
    twice = 2 * r
    return q + (1 if twice > FPS or (twice == FPS and q % 2) else 0)


def frame_taps(i: int) -> tuple[int, float]:
    """Video frame ``i``'s interpolation: (``j``, ``w``): ``(1 - w) x frame j + w x frame j + 1`` of
    wav2vec2's (50 fps) frames."""
    j, r = divmod(feature_index(i) * FRAMES_PER_S, FEATURE_FPS)
    return j, r / FEATURE_FPS


def _frames(seconds: float, name: str) -> int:
    """Whole wav2vec2 frames covering ``seconds`` (rounded up: 0.25 s is 13 frames)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {seconds!r}")
    return math.ceil(round(seconds * FRAMES_PER_S, 6))


@dataclass(frozen=True)
class SpeechWindow:
    """What a block's features read around its frames: ``context_s`` of speech before them (less
    at the start) and ``lookahead_s`` after, each rounded up to whole wav2vec2 frames (20 ms).

    The defaults are docs/live.md's "Streaming speech features" (measured): every second of
    lookahead is a second the avatar lags the speech; 0.5 s keeps most of what a second buys (the
    first quarter second the most), and 2 s of context covers the positional conv's reach (64
    frames, 1.28 s) with room, at 3.6x the whole-file pass's wav2vec2 work a second of speech."""

    lookahead_s: float = 0.5
    context_s: float = 2.0

    def __post_init__(self):
        _frames(self.lookahead_s, "lookahead_s")
        _frames(self.context_s, "context_s")

    @property
    def lookahead_frames(self) -> int:
        return _frames(self.lookahead_s, "lookahead_s")

    @property
    def context_frames(self) -> int:
        return _frames(self.context_s, "context_s")

    @staticmethod
    def video_frames_of_block(g: int) -> range:
        """Block ``g``'s video frames (absolute, 16 fps)."""
        return range(g * BLOCK_FRAMES, (g + 1) * BLOCK_FRAMES)

    def frames_of_block(self, g: int) -> tuple[int, int]:
        """[lo, hi): the wav2vec2 frames block ``g``'s 12 video frames interpolate from."""
        if g < 0:
            raise ValueError(f"block {g} < 0")
        frames = self.video_frames_of_block(g)
        return frame_taps(frames[0])[0], frame_taps(frames[-1])[0] + 2

    def window_frames(self, g: int) -> tuple[int, int]:
        """[first, end): the wav2vec2 frames block ``g``'s window computes (its context, its own
        frames, its lookahead)."""
        lo, hi = self.frames_of_block(g)
        return max(0, lo - self.context_frames), hi + self.lookahead_frames

    def samples_of_block(self, g: int) -> tuple[int, int]:
        """[s0, s1): the samples block ``g``'s wav2vec2 window reads (absolute, 16 kHz)."""
        first, end = self.window_frames(g)
        return first * STRIDE, (end - 1) * STRIDE + RECEPTIVE

    def needed_samples(self, g: int) -> int:
        """How much of the timeline must exist (arrived, or known silent) before block ``g``'s
        features can be computed."""
        return self.samples_of_block(g)[1]

    @property
    def context_samples(self) -> int:
        """The most samples before its own span (``g * BLOCK_SAMPLES``) a block reads."""
        g = self.context_frames // (BLOCK_SAMPLES // STRIDE) + 2  # a block whose context is whole
        return max((g + b) * BLOCK_SAMPLES - self.samples_of_block(g + b)[0] for b in _PERIOD)

    @property
    def lookahead_samples(self) -> int:
        """The most samples past its own span (``(g + 1) * BLOCK_SAMPLES``) a block reads: the lag
        a real-time session's avatar has behind its speech."""
        return max(0, *(self.needed_samples(g) - (g + 1) * BLOCK_SAMPLES for g in _PERIOD))

    @staticmethod
    def blocks_for_samples(n: int) -> int:
        """Blocks a finished speech of ``n`` samples takes: today's count, upstream's
        ``get_audio_embed_bucket_fps`` in 12-frame batches on the features' count ``M``
        (``int(N / 50 * 30)`` of ``N`` wav2vec2 frames, upstream's float expression: 3N/5 exactly
        would differ for N = 205, 410, ...): ``int(M / 22.5) + 1``, which is
        :func:`~wan_s2v_runner.shared.live_recipe.blocks_for` of ``M``'s whole video frames."""
        features = int(conv_frames(n) / float(FRAMES_PER_S) * FEATURE_FPS)
        return blocks_for(features * FPS // FEATURE_FPS)
