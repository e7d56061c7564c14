"""The DiT's cost model, each rule written once: the model's sizes (Wan2.2-S2V-14B's where a
checkpoint does not give one), its clip's latent frames, the seconds a pass of counted operations
takes on a GPU, and the bytes of the live mode's key/value caches. Pure arithmetic (no torch): the
preflight (the memory plan, the job's time, the streamed DiT's pace, the live checks), the bench,
the demo and the rank read it, so they cannot disagree.

* **The sizes** (:class:`DitDims`): ``config.json``'s dims that set the DiT's arithmetic; their
  defaults are the S2V-14B's (:data:`S2V_14B`: dim 5120, ffn_dim 13824, 40 heads, 40 layers, the
  12 audio-injection layers of :data:`S2V_14B_INJECT_LAYERS`). :meth:`DitDims.of` is the rule for a
  reader whose sizes may be missing (0 or None: a checkpoint that could not be read, a
  ``config.json`` without the key): the 14B's in their place.
* **The frames** (:func:`motion_latent_frames`, :func:`clip_latent_frames`): the VAE's causal 4x in
  time (the first frame alone, then 4 frames a latent frame). A clip of ``F`` frames follows the
  :data:`MOTION_FRAMES` (73) motion frames, so its noisy latents are ``(F + 3 + 73) // 4 - 19``
  latent frames (19: the motion frames' own, upstream's ``lat_motion_frames``);
  :func:`max_infer_frames` is its inverse (the most frames whose latents fit the RoPE positions).
* **The seconds a pass** (:func:`pass_seconds`): its operations (``preflight.dit_flops`` counts
  them from the shapes) at :data:`ASSUMED_MFU` of the GPU's dense peak in the run's dtype
  (``preflight.streaming.gpu_tflops``); :func:`achieved_mfu` is the bench's inverse (a measured
  pass's share of the peak).
* **The live caches** (:func:`step_kv_bytes`, :func:`cond_kv_bytes`): what ``patches.live_kv``
  allocates. A step's ring (``StepKV``) holds per layer a key and a value tensor of shape
  ``(batch, WINDOW_BLOCKS * block_tokens, heads, head_dim)``; the condition's (``CondKV``) per layer
  the condition tokens' key and value, ``(batch, cond_tokens, heads, head_dim)``; all in the
  values' dtype (the run's compute dtype: ``shared.precision``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from wan_s2v_runner.shared.live_recipe import WINDOW_BLOCKS

# --------------------------------------------------------------------------- the sizes
#: the 14B's audio-injection layers (``WAN_CONFIGS['s2v-14B'].transformer.audio_inject_layers``)
S2V_14B_INJECT_LAYERS = (0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39)


@dataclass(frozen=True)
class DitDims:
    """The DiT's sizes that set its arithmetic (``config.json`` of the checkpoint); the defaults
    are Wan2.2-S2V-14B's."""

    dim: int = 5120
    ffn_dim: int = 13824
    num_heads: int = 40
    num_layers: int = 40
    audio_layers: int = len(S2V_14B_INJECT_LAYERS)  # len(audio_inject_layers)
    freq_dim: int = 256
    out_dim: int = 16

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @classmethod
    def of(cls, dim: Optional[int] = 0, ffn_dim: Optional[int] = 0, num_heads: Optional[int] = 0,
           num_layers: Optional[int] = 0, audio_layers: Optional[int] = None) -> "DitDims":
        """The sizes a reader has, the S2V-14B's for each it has not (0 or None; ``audio_layers``:
        None only, 0 is a model without audio injection)."""
        d = cls()
        return cls(dim=dim or d.dim, ffn_dim=ffn_dim or d.ffn_dim, num_heads=num_heads or d.num_heads,
                   num_layers=num_layers or d.num_layers,
                   audio_layers=d.audio_layers if audio_layers is None else audio_layers)

    @classmethod
    def from_config(cls, cfg: Mapping) -> "DitDims":
        layers = cfg.get("audio_inject_layers")
        return cls(dim=int(cfg["dim"]), ffn_dim=int(cfg["ffn_dim"]), num_heads=int(cfg["num_heads"]),
                   num_layers=int(cfg["num_layers"]),
                   audio_layers=len(layers) if layers is not None else cls.audio_layers,
                   freq_dim=int(cfg.get("freq_dim", cls.freq_dim)), out_dim=int(cfg.get("out_dim", cls.out_dim)))


#: Wan2.2-S2V-14B's DiT
S2V_14B = DitDims()

# --------------------------------------------------------------------------- the frames
#: frames carried from one clip to the next (``config.transformer.motion_frames``)
MOTION_FRAMES = 73
#: the VAE's stride in time: 4 frames a latent frame (the first frame alone)
VAE_TIME_STRIDE = 4


def motion_latent_frames(motion_frames: int = MOTION_FRAMES) -> int:
    """Latent frames of ``motion_frames`` video frames (the VAE's causal 4x: the first frame alone,
    then 4 a latent frame): upstream's ``(motion_frames + 3) // 4``, 19 for S2V-14B's 73."""
    return (motion_frames + VAE_TIME_STRIDE - 1) // VAE_TIME_STRIDE


def clip_latent_frames(infer_frames: int, motion_frames: int = MOTION_FRAMES) -> int:
    """The noisy latent frames of a clip of ``infer_frames`` frames (upstream's ``lat_target_frames``:
    the clip's and the motion frames' latents, less the motion frames' own): 20 for 80 frames, 3
    for a live block's 12."""
    return ((infer_frames + motion_frames + VAE_TIME_STRIDE - 1) // VAE_TIME_STRIDE
            - motion_latent_frames(motion_frames))


def max_infer_frames(latent_positions: int, motion_frames: int = MOTION_FRAMES) -> int:
    """The most frames (a multiple of 4) a clip may have for its noisy latents to fit
    ``latent_positions`` positions (:func:`clip_latent_frames` at most ``latent_positions``)."""
    return VAE_TIME_STRIDE * (latent_positions + motion_latent_frames(motion_frames)) - (motion_frames + 3)


# --------------------------------------------------------------------------- the seconds a pass
#: the share of the dense peak a DiT pass reaches (measured 46-48% on an H100 and an H200, bf16)
ASSUMED_MFU = 0.45


def pass_seconds(flops: float, peak_tflops: float, mfu: float = ASSUMED_MFU) -> float:
    """Seconds ``flops`` operations take on a GPU whose dense peak is ``peak_tflops`` (in the run's
    dtype), at ``mfu`` of it."""
    return flops / (peak_tflops * 1e12 * mfu)


def achieved_mfu(flops: float, seconds: float, peak_tflops: Optional[float]) -> Optional[float]:
    """The share of the peak ``flops`` operations done in ``seconds`` reached (None: the peak is
    unknown): :func:`pass_seconds`' inverse."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


# --------------------------------------------------------------------------- the live caches
def step_kv_bytes(*, layers: int, block_tokens: int, heads: int, head_dim: int, element_bytes: int,
                  batch: int = 1) -> int:
    """One denoising step's ring of keys and values (``patches.live_kv.StepKV``): per layer a key
    and a value of ``(batch, WINDOW_BLOCKS * block_tokens, heads, head_dim)`` at ``element_bytes``
    (``layers=1``: one layer's pair)."""
    return layers * 2 * batch * WINDOW_BLOCKS * block_tokens * heads * head_dim * element_bytes


def cond_kv_bytes(*, layers: int, cond_tokens: int, heads: int, head_dim: int, element_bytes: int,
                  batch: int = 1) -> int:
    """The condition tokens' keys and values (``patches.live_kv.CondKV``, once a rank): per layer a
    key and a value of ``(batch, cond_tokens, heads, head_dim)`` at ``element_bytes``."""
    return layers * 2 * batch * cond_tokens * heads * head_dim * element_bytes
