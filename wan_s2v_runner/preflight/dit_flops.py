"""The S2V DiT's arithmetic: floating-point operations of one forward pass, counted from shapes.

One place for what a denoising step costs. :mod:`.plans` weighs layouts with its per-token and
attention terms; the job's time and the streamed DiT's pace turn its total into seconds
(``shared.dit_cost.pass_seconds``), ``bench/gpu_step.py`` into TFLOP/s and MFU
(``shared.dit_cost.achieved_mfu``). No torch: the counts follow from ``config.json``'s dims
(:class:`~wan_s2v_runner.shared.dit_cost.DitDims`, the S2V-14B's where a size is missing) and the
token counts of :mod:`.geometry`, read from the engine's ``WanModel_S2V.forward`` (Wan2.2 42bf4cf):

* a matmul of (m x k) by (k x n) is ``2 m k n`` operations; a convolution is a matmul over its
  patches (``2 * outputs * in_channels * kernel volume * out_channels``); elementwise work
  (norms, RoPE, modulation, softmax) is not counted, as MFU conventions do;
* the sequence is ``L = noisy + ref + motion`` tokens (motion dropped on a first clip that starts
  without the reference image); ``N`` = noisy tokens, ``T`` = 512 text tokens, ``C`` = dim,
  ``F`` = ffn_dim, ``A`` = 5 audio tokens per latent frame (4 + a padding token);
* per block: self-attention q/k/v/o ``8 L C^2``, its scores and weighted sum ``4 L^2 C`` (full
  attention, every head), text cross-attention q/o ``4 L C^2`` + k/v ``4 T C^2`` + scores
  ``4 L T C``, FFN ``4 L C F``;
* per audio-injection layer (12 in S2V-14B), on the N noisy tokens frame by frame: AdaLN
  ``4 f C^2`` (f latent frames), q/o ``4 N C^2``, k/v ``4 f A C^2``, scores ``4 N A C``;
* once per pass: patch embeddings of the noisy, pose-condition and reference latents, the
  FramePack motion convolutions, the text embedding ``2 T (4096 C + C^2)``, the time embedding,
  the head; the audio encoder (causal 1-D convolutions over ~audio frames) is left out (<0.01%
  at real size);
* a live block's forward (:func:`live_block_flops`, ``--mode live``): the same terms with the
  block's noisy tokens as the sequence, their self-attention over the cached keys (the window's
  blocks and the condition tokens), the text's keys and values cached, no reference or motion
  tokens (the sink computed those once).

``tests/test_dit_flops.py`` checks the total against ``torch.utils.flop_counter`` on the engine's
own model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from wan_s2v_runner.shared.dit_cost import DitDims

from .geometry import FRAMEPACK_BUCKETS, PATCH, VAE_STRIDE, TokenCounts

TEXT_LEN = 512  # text tokens the DiT sees (context padded to text_len)
TEXT_DIM = 4096  # umt5-xxl width; WanModel_S2V's text_dim
#: audio tokens per latent frame: num_audio_token (4) + the padding token MotionEncoder_tc appends
AUDIO_TOKENS = 4 + 1
LATENT_CHANNELS = 16  # in_dim, cond_dim and the FramePack input
#: FramePack's three convolutions (kernel = stride): (temporal kernel, spatial kernel) at 1x, 2x
#: and 4x, reading FRAMEPACK_BUCKETS latent frames each
FRAMEPACK_KERNELS = ((1, 2), (2, 4), (4, 8))
#: a patch's values: the latent channels over the patch (1 x 2 x 2)
_PATCH = LATENT_CHANNELS * PATCH[0] * PATCH[1] * PATCH[2]


def per_token_flops(dims: DitDims) -> int:
    """One block's work per token that grows linearly with the sequence: self-attention q/k/v/o,
    text cross-attention q/o (its k/v depend on the text only) and the FFN."""
    c = dims.dim
    return 8 * c * c + 4 * c * c + 4 * c * dims.ffn_dim


def attention_flops(dims: DitDims, length: int) -> int:
    """One block's self-attention scores and weighted sum over ``length`` tokens, all heads."""
    return 4 * length * length * dims.dim


@dataclass(frozen=True)
class ForwardFlops:
    """One DiT forward pass, by term (operations)."""
    length: int
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def forward_flops(dims: DitDims, tokens: TokenCounts, *, with_motion: bool = True,
                  text_cached: bool = False) -> ForwardFlops:
    """Operations of one ``WanModel_S2V.forward`` over the sequence of ``tokens`` (module docstring).
    ``with_motion=False``: a first clip whose motion tokens are dropped. ``text_cached``: the text
    embedding and the cross-attention keys/values come from ``patches.context_cache`` (the runner
    computes them once per prompt), so they are not counted."""
    c, f_dim, layers = dims.dim, dims.ffn_dim, dims.num_layers
    n, ref = tokens.noisy, tokens.ref
    length = n + ref + (tokens.motion if with_motion else 0)
    frames = tokens.latent_frames
    t = TEXT_LEN
    terms = {
        "self_attn_proj": layers * 8 * length * c * c,
        "self_attn_scores": layers * attention_flops(dims, length),
        "cross_attn": layers * (4 * length * c * c + (0 if text_cached else 4 * t * c * c) + 4 * length * t * c),
        "ffn": layers * 4 * length * c * f_dim,
        "audio_inject": audio_inject_flops(dims, n, frames),
    }
    embed = 2 * (2 * n + ref) * _PATCH * c  # noisy + pose condition + reference
    lh, lw = tokens.height // VAE_STRIDE[1], tokens.width // VAE_STRIDE[2]  # latent rows and columns
    for read, (kt, ks) in zip(FRAMEPACK_BUCKETS, FRAMEPACK_KERNELS):  # run even when clip 1 drops their tokens
        count = (read // kt) * (lh // ks) * (lw // ks)
        embed += 2 * count * LATENT_CHANNELS * kt * ks * ks * c
    if not text_cached:
        embed += 2 * t * (TEXT_DIM * c + c * c)  # text embedding
    terms["embed_head"] = embed + _time_and_head(dims, n)
    return ForwardFlops(length, terms)


def audio_inject_flops(dims: DitDims, noisy: int, frames: int) -> int:
    """The audio-injection layers on ``noisy`` tokens of ``frames`` latent frames (module docstring)."""
    c = dims.dim
    return dims.audio_layers * (4 * frames * c * c + 4 * noisy * c * c
                                + 4 * frames * AUDIO_TOKENS * c * c + 4 * noisy * AUDIO_TOKENS * c)


def _time_and_head(dims: DitDims, noisy: int) -> int:
    """The time embedding (t and the zero timestep) and the head over the ``noisy`` tokens."""
    c = dims.dim
    return 2 * 2 * (dims.freq_dim * c + c * c + c * 6 * c) + 2 * noisy * c * dims.out_dim * 4


def live_block_flops(dims: DitDims, tokens: TokenCounts, keys: int) -> ForwardFlops:
    """Operations of one live block's forward (``rank.live_dit.LiveDiT.block``), counted as
    :func:`forward_flops` counts a clip's: the block's ``tokens.noisy`` tokens
    (``tokens.latent_frames`` latent frames) are the whole sequence, their self-attention reads
    ``keys`` keys (the window's cached blocks and the condition's), the text's keys and values are
    cached, and the reference and motion tokens are the sink's (computed once a job, not here)."""
    c, layers = dims.dim, dims.num_layers
    n, frames = tokens.noisy, tokens.latent_frames
    terms = {
        "self_attn_proj": layers * 8 * n * c * c,
        "self_attn_scores": layers * 4 * n * keys * c,
        "cross_attn": layers * (4 * n * c * c + 4 * n * TEXT_LEN * c),
        "ffn": layers * 4 * n * c * dims.ffn_dim,
        "audio_inject": audio_inject_flops(dims, n, frames),
        "embed_head": 2 * (2 * n) * _PATCH * c + _time_and_head(dims, n),  # noisy + pose condition
    }
    return ForwardFlops(n, terms)


def step_flops(dims: DitDims, tokens: TokenCounts, *, guided: bool = True, with_motion: bool = True,
               text_cached: bool = False) -> int:
    """One denoising step: the conditional pass, and the unconditional one when guided (CFG)."""
    one = forward_flops(dims, tokens, with_motion=with_motion, text_cached=text_cached).total
    return one * (2 if guided else 1)
