"""Where wav2vec2 encodes a job's speech: the one rule the memory plan and the encoding rank share.

Upstream (``WanS2V.__init__``: ``AudioEncoder(device='cpu')``) runs wav2vec2 on the CPU in fp32 on
every rank. At the real size that is the slowest input stage of a short job (15.0 s for 5 s of
speech on an H200's host, ``docs/gpu.md``), while the GPU does it in a fraction of a second. So on
CUDA the encoding rank moves wav2vec2 to its GPU for the audio encode, and back to the CPU right
after (before T5 or the DiT need the room), **where memory allows**: the GPU's free memory at that
moment (the caching allocator's unused reserve counted) must hold wav2vec2's fp32 weights and the
encode's activations for this speech's length, with :data:`MARGIN` to spare. Otherwise it stays
upstream's: the CPU. The features are the same computation in fp32 (cuDNN's TF32 is turned off
for it); the bound against the CPU's is measured on a GPU and stated in docs/gpu.md.

:func:`encode_bytes` is the estimate, :func:`choose` the rule; :func:`windowed` says whether the
speech is long enough to be encoded in windows (``rank.long_audio``), which the estimate follows.
The plan (``preflight``) applies it to the GPU's free memory less its whole encode phase and the
runtime (the DiT, the VAE and T5 or the VAE's workspace: more than the rank holds when wav2vec2
runs, which is before T5 moves in); the rank (``rank.encoders``) to what ``torch.cuda.mem_get_info``
says then. Imports nothing heavy.
"""
from __future__ import annotations

from enum import Enum
from typing import Optional

GiB = 2**30
#: what must stay free beside the encode (the allocator's rounding, cuDNN's workspace)
MARGIN = 1 * GiB
#: wav2vec2 emits 50 feature frames a second of 16 kHz speech
FRAMES_PER_S = 50
#: wav2vec2-large-xlsr-53's shape (the checkpoint's config.json says; these when it cannot be read)
HIDDEN, HEADS, LAYERS = 1024, 16, 24
#: long speech is encoded in windows of this many seconds, each keeping its centre: OVERLAP_S on
#: each inner side is context only (``rank.long_audio``; docs/generation.md, "Long speech")
WINDOW_S = 60.0
OVERLAP_S = 5.0
#: the rate wav2vec2 reads (upstream's ``librosa.load(audio_path, sr=16000)``), and its conv stack:
#: a frame reads RECEPTIVE samples at a stride of STRIDE (50 frames a second)
RATE, RECEPTIVE, STRIDE = 16000, 400, 320


class AudioEncoderDevice(str, Enum):
    """Where wav2vec2 runs for a job's audio encode."""

    CPU = "cpu"  # upstream's placement
    GPU = "cuda"  # the encoding rank's GPU, for the encode only


def encode_bytes(params: int, seconds: float, hidden: int = HIDDEN, heads: int = HEADS,
                 layers: int = LAYERS, windows: bool = True) -> int:
    """GPU bytes wav2vec2's encode of ``seconds`` of speech needs: its fp32 weights, every layer's
    hidden states (all are kept: the DiT reads 25 of them) three times over (the states, their
    concatenation, the interpolation to the video's rate), and one layer's attention scores in
    full (the eager form's; SDPA's kernels need less). Speech longer than one window
    (:func:`windowed`; ``windows``: False for an encoder that is never windowed) is encoded a
    window at a time (``rank.long_audio``): the scores and the model's own hidden states are one
    window's, the stitched features (x3) the whole speech's."""
    frames = int(max(0.0, seconds) * FRAMES_PER_S) + 1
    features = 3 * (layers + 1) * frames * hidden * 4
    if windows and windowed(seconds):
        w = window_frames()
        return int(params * 4 + features + (layers + 1) * w * hidden * 4 + heads * w * w * 4)
    return int(params * 4 + features + heads * frames * frames * 4)


#: host bytes of wav2vec2's one-pass encode per second of speech (fp32, CPU): every layer's states,
#: their concatenation and the interpolation, measured (docs/memory-plan.md)
HOST_PER_S = 18 * 2**20
#: host bytes per second of speech of the stitched features beyond the first window (the buffer of
#: every layer's kept states and its interpolation to the video's rate: 2 x 25 layers x 50 frames x
#: 1024 x 4 bytes); the window's own activations are one window's (``rank.long_audio``)
HOST_FEATURES_PER_S = 2 * (LAYERS + 1) * FRAMES_PER_S * HIDDEN * 4


def host_bytes(seconds: float, windows: bool = True) -> int:
    """Host bytes wav2vec2's encode of ``seconds`` of speech takes beyond its weights, on the CPU:
    the one pass's (:data:`HOST_PER_S` a second) up to one window; beyond it (windowed), one
    window's activations plus the longer speech's stitched features. One rule for the plan."""
    seconds = max(0.0, seconds)
    if not (windows and windowed(seconds)):
        return int(seconds * HOST_PER_S)
    return int(WINDOW_S * HOST_PER_S + (seconds - WINDOW_S) * HOST_FEATURES_PER_S)


def choose(device_type: str, free: Optional[int], need: int) -> tuple[AudioEncoderDevice, str]:
    """(where, why) for one audio encode: the GPU when ``device_type`` is cuda and ``free`` bytes
    hold ``need`` with :data:`MARGIN` to spare; else upstream's CPU."""
    if device_type != "cuda":
        return AudioEncoderDevice.CPU, "on the CPU, as upstream (the run is on the CPU)"
    if free is None:
        return AudioEncoderDevice.CPU, "on the CPU, as upstream (the GPU's free memory is unknown)"
    if need + MARGIN <= free:
        return AudioEncoderDevice.GPU, (f"on the GPU for the audio encode ({need / GiB:.1f} GiB of "
                                        f"{free / GiB:.1f} GiB free), back on the CPU after")
    return AudioEncoderDevice.CPU, (f"on the CPU, as upstream: its encode needs {need / GiB:.1f} GiB "
                                    f"(+{MARGIN / GiB:.0f} GiB margin), the GPU has {free / GiB:.1f} GiB free")


def conv_frames(samples: int) -> int:
    """wav2vec2 frames of ``samples`` samples at :data:`RATE` (its conv stack's count)."""
    return 0 if samples < RECEPTIVE else (samples - RECEPTIVE) // STRIDE + 1


def speech_frames(seconds: float) -> int:
    """wav2vec2 frames of ``seconds`` of 16 kHz speech (its conv stack's count)."""
    return conv_frames(int(round(max(0.0, seconds) * RATE)))


def window_frames(window_s: float = WINDOW_S) -> int:
    return int(round(window_s * FRAMES_PER_S))


def overlap_frames(overlap_s: float = OVERLAP_S) -> int:
    return int(round(overlap_s * FRAMES_PER_S))


def windowed(seconds: float) -> bool:
    """Whether ``seconds`` of speech are encoded in windows (more than one window's frames)."""
    return speech_frames(seconds) > window_frames()
