"""Memory plan: per-rank GPU and host memory each mode needs, from the checkpoint's own sizes.

Parameter counts come from the checkpoint (safetensors headers, ``.pth`` shapes via mmap), or,
without ``--ckpt-dir``, from the Wan2.2-S2V-14B reference sizes (:data:`REFERENCE`). The
arithmetic follows the engine's load and generate order and is documented, with what is
approximate, in ``docs/memory-plan.md``. All results are bytes.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from wan_s2v_runner.loading import ckpt_tables as cr
from wan_s2v_runner.loading.dit_file import dit_shapes
from wan_s2v_runner.shared import encoder_placement, live_recipe, precision, stream_source
from wan_s2v_runner.shared.ckpt_layout import DIT_CONFIG, T5_FILE, VAE_FILE, W2V_WEIGHTS, W2V_WEIGHTS_BIN
from wan_s2v_runner.shared.dit_cost import S2V_14B, S2V_14B_INJECT_LAYERS, DitDims
from wan_s2v_runner.shared.job_time import cfg_on, step_passes
from wan_s2v_runner.shared.layout import MODES, DitOffload, DitQuant, Layout, LoadStrategy, Mode, StreamSource
from wan_s2v_runner.shared.precision import ComputeDtype
from wan_s2v_runner.shared.quant import SCALE_BYTES, is_fp8_weight
from wan_s2v_runner.shared.speech_windows import RATE, SpeechWindow
from wan_s2v_runner.shared.video_budget import MOTION_LATENT_FRAMES, host_frame_bytes

from .dit_flops import TEXT_LEN
from .geometry import FPS, TokenCounts, clips_for_audio, generation_size, output_frames, token_counts

GiB = 2**30
#: per-process overheads (measured/typical; see docs/memory-plan.md)
GPU_RUNTIME = int(1.0 * GiB)  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers
HOST_BASE_CUDA = int(3.0 * GiB)  # python + torch/CUDA libraries + transformers/diffusers imports
HOST_BASE_CPU = int(0.8 * GiB)  # measured ~0.8 GB RSS per rank for the tiny CPU demo
#: lean loading's conversion buffer on the CPU (ckpt_read.CHUNK_ELEMENTS of a bf16 file)
LEAN_CHUNK = 2**24 * 2
#: the VAE's working memory, in fp32 96-channel 4-frame full-resolution maps (1,536 bytes a pixel).
#: Encode: the reference image's encode took 4.0 GiB at 1024x704 on an H200 (4 maps: 4.1 GiB).
#: Decode, calibrated on the same run (docs/gpu.md, 2026-11-26): a clip's decode stage peaked at
#: 18.8 GiB allocated, of which the VAE's weights, the text k/v memo and the decoded frames are 1.9;
#: 16 maps (16.5 GiB) also cover what the loop holds through decode (latents, audio features, the
#: motion frames). The split VAE's bands scale with their rows (docs/gpu.md: 0.50x / 0.34x).
VAE_ENCODE_MAPS = 4
VAE_DECODE_MAPS = 16
#: the share of the available RAM a plan may fill before it is called tight (``memory.host`` warns
#: above it; a streamed DiT held whole is kept in memory only within it: ``shared.stream_source``;
#: the encoders are released when the plan would be past it otherwise)
HOST_FILL = stream_source.HOST_FILL


def live_window_s(window: Optional[SpeechWindow] = None) -> float:
    """Seconds of speech one live block's wav2vec2 window reads (its context, span and lookahead)."""
    s0, s1 = (window or SpeechWindow()).samples_of_block(8)  # a block whose context is whole
    return (s1 - s0) / RATE


@dataclass
class ModelSizes:
    source: str  # "checkpoint <dir>" or "reference ..."
    dit_params: int
    dit_root_params: int  # not in blocks.* : the FSDP root unit (embeddings, head, audio modules)
    dit_block_max: int  # largest transformer block (an FSDP unit)
    t5_params: int
    t5_block_max: int
    vae_params: int
    wav2vec_params: int
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    dit_fp8_params: int = 0  # the weights --dit-quant fp8 holds in float8_e4m3fn (shared.quant)
    dit_fp8_rows: int = 0  # their output rows (one float32 scale each)
    #: each streamed unit's parameters (a block and the audio-injection layers after it, in the
    #: order the blocks run: loading.block_stream), and how many of them are fp8 weights
    dit_units: tuple[int, ...] = ()
    dit_units_fp8: tuple[int, ...] = ()

    def unit_bytes(self, pb: int, fp8: bool) -> list[int]:
        """Each unit's bytes as it is held (fp8: its fp8 weights at one byte, the rest at ``pb``)."""
        fp8s = self.dit_units_fp8 if fp8 and self.dit_units_fp8 else (0,) * len(self.dit_units)
        return [(n - f) * pb + f for n, f in zip(self.dit_units, fp8s)]


#: the 14B's audio-injection layers (``WAN_CONFIGS['s2v-14B'].transformer.audio_inject_layers``)
REFERENCE_INJECT_LAYERS = S2V_14B_INJECT_LAYERS
_D, _F, _L = S2V_14B.dim, S2V_14B.ffn_dim, S2V_14B.num_layers
_BLOCK = 351_400_000  # one 14B block's parameters
_BLOCK_FP8 = 8 * _D**2 + 2 * _D * _F
_INJECT = 4 * (_D**2 + _D) + _D * 2 * _D + 2 * _D  # q, k, v, o + the AdaIN's Linear
_INJECT_FP8 = 4 * _D**2


#: Wan2.2-S2V-14B (engine-facts): DiT 16.3B = 40 blocks x 351.4M + 2.24B root; T5 umt5-xxl
#: encoder 5.68B (24 blocks); VAE 127M; wav2vec2-large-xlsr-53 317M.
REFERENCE = ModelSizes(source="reference Wan2.2-S2V-14B sizes (no readable checkpoint)",
                       dit_params=16_300_000_000, dit_root_params=2_240_000_000,
                       dit_block_max=351_400_000, t5_params=5_680_000_000, t5_block_max=201_000_000,
                       vae_params=127_000_000, wav2vec_params=317_000_000, dim=_D, ffn_dim=_F,
                       num_heads=S2V_14B.num_heads, num_layers=_L,
                       # 40 blocks x (8 x 5120^2 + 2 x 5120 x 13824) + 12 audio layers x 4 x 5120^2
                       dit_fp8_params=_L * _BLOCK_FP8 + len(REFERENCE_INJECT_LAYERS) * _INJECT_FP8,
                       dit_fp8_rows=_L * (8 * _D + _F + _D) + len(REFERENCE_INJECT_LAYERS) * 4 * _D,
                       dit_units=tuple(_BLOCK + (_INJECT if i in REFERENCE_INJECT_LAYERS else 0) for i in range(_L)),
                       dit_units_fp8=tuple(_BLOCK_FP8 + (_INJECT_FP8 if i in REFERENCE_INJECT_LAYERS else 0)
                                           for i in range(_L)))

_INJECT_RE = re.compile(r"audio_injector\.(?:injector|injector_adain_layers|injector_pre_norm_feat|"
                        r"injector_pre_norm_vec)\.(\d+)\.")


def _units(names_params: dict[str, int], fp8: set[str], inject_layers) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(parameters, fp8 weights) of each streamed unit: block i and the injection layers of the
    j-th entry of ``inject_layers`` where that entry is i (``loading.block_stream.unit_modules``)."""
    at = {j: int(b) for j, b in enumerate(inject_layers or ())}
    per: dict[int, list[int]] = {}
    for name, n in names_params.items():
        m = re.match(r"blocks\.(\d+)\.", name)
        i = int(m.group(1)) if m else None
        if i is None:
            m = _INJECT_RE.match(name)
            i = at.get(int(m.group(1))) if m else None
        if i is not None:
            row = per.setdefault(i, [0, 0])
            row[0] += n
            row[1] += n if name in fp8 else 0
    order = sorted(per)
    return tuple(per[i][0] for i in order), tuple(per[i][1] for i in order)


def _blocks(names_params: dict[str, int], prefix=r"blocks\.(\d+)\.") -> tuple[int, int]:
    """(sum of params outside blocks.N., largest block)."""
    per: dict[int, int] = {}
    root = 0
    for name, n in names_params.items():
        m = re.match(prefix, name)
        if m:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + n
        else:
            root += n
    return root, max(per.values(), default=0)


def sizes_from_checkpoint(ckpt: Path, cache: Optional[dict] = None, dit_file: Optional[Path] = None) -> ModelSizes:
    """Read the sizes from the files (headers/shapes only; the DiT's from ``dit_file`` when given).
    Raises CheckpointFileError/OSError."""
    cache = cache if cache is not None else {}
    ckpt = Path(ckpt)
    cfg = cache.get("config") or json.loads((ckpt / DIT_CONFIG).read_text(encoding="utf-8"))
    shapes = cache.get("dit_shapes")
    if shapes is None:
        shapes = dit_shapes(ckpt, dit_file)
    dit = cache.get("dit_tensors") or {k: math.prod(s) for k, s in shapes.items()}
    fp8 = {k: s for k, s in shapes.items() if is_fp8_weight(k)}
    t5 = cache.get("t5_shapes") or cr.read_pth_shapes(ckpt / T5_FILE)
    vae = cache.get("vae_shapes") or cr.read_pth_shapes(ckpt / VAE_FILE)
    w2v = cache.get("w2v_params")
    if w2v is None:
        st = ckpt / W2V_WEIGHTS
        w2v = (cr.read_safetensors_header(st).params if st.is_file()
               else cr.pth_params(cr.read_pth_shapes(ckpt / W2V_WEIGHTS_BIN)))
    root, block = _blocks(dit)
    units, units_fp8 = _units(dit, set(fp8), cfg.get("audio_inject_layers"))
    t5_root, t5_block = _blocks({k: math.prod(s) for k, (s, _) in t5.items()})
    return ModelSizes(
        source=f"checkpoint {ckpt}", dit_params=sum(dit.values()), dit_root_params=root,
        dit_block_max=block, t5_params=cr.pth_params(t5), t5_block_max=t5_block,
        vae_params=cr.pth_params(vae), wav2vec_params=int(w2v), dim=int(cfg.get("dim", 0)),
        ffn_dim=int(cfg.get("ffn_dim", 0)), num_heads=int(cfg.get("num_heads", 0)),
        num_layers=int(cfg.get("num_layers", 0)), dit_fp8_params=sum(math.prod(s) for s in fp8.values()),
        dit_fp8_rows=sum(s[0] for s in fp8.values()), dit_units=units, dit_units_fp8=units_fp8)


def dit_dims(sizes: ModelSizes) -> DitDims:
    """The DiT's dims from ``sizes`` (:meth:`~wan_s2v_runner.shared.dit_cost.DitDims.of`: the
    S2V-14B's for a size the checkpoint did not give); its audio-injection layers are the streamed
    units larger than the smallest (a block with an injection layer after it), the 14B's 12 where
    there are no units."""
    units = sizes.dit_units
    inject = sum(1 for u in units if u > min(units)) if units else None
    return DitDims.of(dim=sizes.dim, ffn_dim=sizes.ffn_dim, num_heads=sizes.num_heads, num_layers=sizes.num_layers,
                      audio_layers=inject)


def model_sizes(ctx) -> ModelSizes:
    """Sizes for this context: from its checkpoint when readable (cached), else REFERENCE."""
    if "sizes" in ctx.cache:
        return ctx.cache["sizes"]
    sizes = REFERENCE
    if ctx.spec.ckpt_dir is not None:
        try:
            sizes = sizes_from_checkpoint(ctx.spec.ckpt_dir, ctx.cache.setdefault("ckpt", {}), ctx.spec.dit_file)
        except Exception as e:  # noqa: BLE001 - the checkpoint checks report the cause
            sizes = ModelSizes(**{**asdict(REFERENCE),
                                  "source": f"reference Wan2.2-S2V-14B sizes (checkpoint unreadable: {e})"})
    ctx.cache["sizes"] = sizes
    return sizes


@dataclass
class Workload:
    """What the job makes, as the plans count it: ``n_clips`` clips of ``infer_frames`` frames
    (``tokens``: one clip's); a live job's (``unit`` "block"): its blocks of the recipe's frames."""

    height: int
    width: int
    tokens: TokenCounts
    n_clips: int
    audio_seconds: float
    infer_frames: int = 80
    start_from_ref: bool = False
    assumed: list[str] = field(default_factory=list)
    #: a step runs CFG's unconditional pass too (``shared.job_time.cfg_on``; the live recipe: never)
    cfg: bool = True
    #: what ``n_clips`` counts: "clip", or "block" (``--mode live``)
    unit: str = "clip"
    #: latent frames the VAE decodes in one call (None: a clip's, after the motion latents upstream
    #: decodes with them; a live job's: its priming latents, then a block's)
    decode_latents: Optional[int] = None

    def __post_init__(self):
        if self.decode_latents is None:
            self.decode_latents = self.tokens.latent_frames + MOTION_LATENT_FRAMES


def workload(ctx) -> Workload:
    """Generation size, tokens and clips for the memory plan (measured inputs, else assumptions).
    A live job (the step pipeline, :mod:`wan_s2v_runner.shared.live_recipe`) reads the recipe, not
    ``--infer-frames``, ``--num-clips`` nor ``--guide-scale``: the speech's blocks
    (:func:`~wan_s2v_runner.shared.live_recipe.blocks_for`) of :data:`~wan_s2v_runner.shared.live_recipe.BLOCK_FRAMES`
    frames, one block's tokens (:data:`~wan_s2v_runner.shared.live_recipe.BLOCK_LATENT_FRAMES` latent
    frames, with the condition's reference and motion tokens), no CFG."""
    assumed = []
    img = ctx.cache.get("image_size")  # (w, h) set by the inputs checks
    if img:
        h, w = generation_size(img[1], img[0], ctx.spec.max_area)
    else:
        h, w = generation_size(704, 1024, ctx.spec.max_area)
        assumed.append(f"a 1024x704 (landscape) image -> {w}x{h}")
    secs = ctx.cache.get("audio_seconds")
    if MODES[ctx.mode].step_pipeline:
        if secs is None:
            secs = 5.0
            assumed.append("5 s of audio")
        frames = live_recipe.BLOCK_FRAMES
        return Workload(h, w, token_counts(max(h, 64), max(w, 64), frames), live_recipe.blocks_for(int(secs * FPS)),
                        secs, frames, False, assumed, cfg=False, unit="block",
                        decode_latents=max(live_recipe.PRIME_LATENTS, live_recipe.BLOCK_LATENT_FRAMES))
    if secs is None and ctx.spec.num_clips:
        # no speech to measure (the doctor without --audio): the speech --num-clips covers, so a
        # long job is planned without a long file (``--num-clips 121``: ten minutes)
        secs = output_frames(ctx.spec.num_clips, ctx.spec.infer_frames, ctx.spec.start_from_ref) / FPS
        assumed.append(f"{secs:g} s of speech (what --num-clips {ctx.spec.num_clips} makes)")
    elif secs is None:
        secs = 5.0
        assumed.append("5 s of audio")
    n_clips = clips_for_audio(secs, ctx.spec.infer_frames, ctx.spec.num_clips)
    guide = ctx.spec.guide_scale
    return Workload(h, w, token_counts(max(h, 64), max(w, 64), ctx.spec.infer_frames), n_clips, secs,
                    ctx.spec.infer_frames, ctx.spec.start_from_ref, assumed, cfg=guide is None or cfg_on(guide))


@dataclass
class ModePlan:
    mode: str
    world_size: int
    gpu_peak: Optional[int]  # per rank, bytes; None on CPU
    gpu_phases: dict[str, int]
    host_peak: int  # per rank (the largest: rank 0, or the text rank holding T5), a node-shared DiT included
    host_node_total: int  # all local ranks loading at once (rank 0's frames included: host_rank0)
    parts: dict[str, int]
    load: LoadStrategy = LoadStrategy.LEAN
    host_others: int = 0  # per rank other than rank 0 and the text rank (node-shared weights not included)
    host_shared: int = 0  # held once per node, mapped by every local rank (lean: a replicated CPU DiT)
    host_load_transient: int = 0  # per rank, only while reading weights (what waves spread out)
    nproc: int = 1
    host_rank0: int = 0  # rank 0 (node-shared weights not included)
    host_text_extra: int = 0  # what the text rank (the last: it encodes the prompts) holds beyond host_others
    #: the streamed DiT (``--dit-offload blocks``): resident_blocks, streamed_blocks, slot_bytes,
    #: pinned_bytes (host, per node), bytes_per_pass (copied), source (memory / page-cache: where
    #: its host bytes live), file_bytes (the page cache's file), cache_room (what the page cache
    #: can keep of it beside the plan), disk_bytes_per_pass (read from the disk again each pass);
    #: None when the DiT is resident
    stream: Optional[dict] = None
    #: what the DiT and T5 compute in (``shared.precision``), and why
    dtype: str = ComputeDtype.BF16.value
    dtype_why: str = field(default="", compare=False)
    #: the encoders let go before the DiT is read (``--release-encoders``): the host's two phases,
    #: ``encode`` (T5, wav2vec2, no DiT) and ``dit`` (the DiT's host bytes, no encoders), each
    #: {rank0, others, text_extra, shared, node}; the figures above are the larger phase's
    release_encoders: bool = False
    host_phases: Optional[dict] = None
    #: why the encoders are (not) released, and where the streamed DiT's bytes live (the plan's
    #: words: explanations, not figures, so two plans of the same numbers compare equal)
    release_why: str = field(default="", compare=False)
    source_why: str = field(default="", compare=False)
    #: T5 encodes on the CPU and never moves to the GPU (the hybrid mode's, ``--t5-cpu``, or
    #: settled by the plan: :func:`settle_plan`), and why (words, as above)
    t5_cpu: bool = False
    t5_why: str = field(default="", compare=False)

    @property
    def t5_settled(self) -> bool:
        """Whether the plan itself put T5 on the CPU (``--t5-cpu`` unset: the gate settles it)."""
        return self.t5_why.startswith(T5_SETTLED)

    def node_total(self, waves: int = 1) -> int:
        """Host RAM the node needs when its ranks read their weights in ``waves`` turns."""
        waves = max(1, min(waves, self.nproc))
        extra = self.host_load_transient * (self.nproc - -(-self.nproc // waves))
        return self.host_node_total - extra

    def waves_needed(self, avail: int) -> Optional[int]:
        """The fewest waves whose node total fits ``avail`` (1: all at once), None if none does."""
        for w in range(1, self.nproc + 1):
            if self.node_total(w) <= avail:
                return w
        return None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HostPhase:
    """What each kind of rank holds on the host in one phase of a run (base included), and what
    the node holds once: rank 0 (wav2vec2, the frames), any other rank, what the text rank (the
    last: it encodes the prompts) holds beyond them, the node-shared DiT."""

    rank0: int
    others: int
    text_extra: int
    shared: int

    def node(self, nproc: int) -> int:
        return self.rank0 + (nproc - 1) * self.others + (self.text_extra if nproc > 1 else 0) + self.shared

    def peak(self) -> int:
        return max(self.rank0, self.others + self.text_extra) + self.shared

    def to_json(self, nproc: int) -> dict:
        return {**asdict(self), "node": self.node(nproc)}


def _act(l_local: int, l_full: int, dim: int, ffn: int, use_sp: bool) -> int:
    """DiT activations per rank (bytes). Dominated by self-attention on the local tokens: the fp32
    residual stream and its fp32 norm, q/k/v, and rope_apply_usp's float64/complex128 temporaries
    of q and k (~44 bytes per element of dim), plus the precomputed complex128 rope table (8 per
    element). The FFN (2 x ffn_dim bf16 per token + 8 x dim) is smaller for Wan's ffn/dim = 2.7.
    At audio-injection layers every rank holds fp32 full-sequence hidden states (gathered with
    Ulysses): ~3 x L_full x dim x 4."""
    per_token = max(52 * dim, 8 * dim + 4 * ffn)
    return l_local * per_token + (3 if use_sp else 2) * l_full * dim * 4


def _vae_ws(h: int, w: int, maps: int = VAE_ENCODE_MAPS) -> int:
    """VAE working memory: ``maps`` fp32 96-channel 4-frame full-resolution maps."""
    return maps * 96 * 4 * h * w * 4


def _text_kv(layers: int, dim: int, pb: int, contexts: int) -> int:
    """The text keys and values ``patches.context_cache`` keeps per block for each context (the
    prompt and the negative prompt; one per rank with CFG-parallel). They stay where they were
    made: on the GPU through decode, even when offload parks the DiT on the CPU."""
    return contexts * 2 * layers * TEXT_LEN * dim * pb


def stream_terms(sizes: ModelSizes, pb: int, fp8: bool, resident: int) -> dict:
    """What streaming the DiT's units after the first ``resident`` costs: the device bytes it
    saves (the streamed units') and adds (two slots of the largest streamed unit, one when only
    one streams), and the bytes copied per pass."""
    units = sizes.unit_bytes(pb, fp8)
    resident = max(0, min(resident, len(units)))
    streamed = units[resident:]
    slots = min(2, len(streamed))
    slot = max(streamed, default=0)
    return {"resident_blocks": resident, "streamed_blocks": len(streamed), "slot_bytes": slot,
            "streamed_bytes": sum(streamed), "device_bytes": slots * slot,
            "bytes_per_pass": sum(streamed) if len(streamed) > 2 else 0}


def plan_mode(layout: Layout, sizes: ModelSizes, wl: Workload, *, nproc: int, device: str,
              offload: bool, load: LoadStrategy = LoadStrategy.LEAN, quant: DitQuant = DitQuant.NONE,
              stream: Optional[int] = None, dtype: Optional[ComputeDtype] = None,
              source: StreamSource = StreamSource.MEMORY, release: bool = False, served: bool = False,
              t5_cpu: bool = False) -> ModePlan:
    """The plan of one layout: what it shards, splits or keeps on the CPU decides every term;
    the host figures also follow the loading strategy (``load``) and the DiT's weights ``quant``
    (fp8: its big Linears at one byte a weight plus a float32 scale a row, each dequantized when
    called: an fp32 copy and the param-dtype copy F.linear takes of the largest one in flight).
    ``stream`` (not None; a replicated DiT): ``--dit-offload blocks`` with that many blocks
    resident: the device holds the rest of the DiT plus two slots, the host the whole DiT (read
    once per node, pinned; ``source`` page-cache: a file on disk, mapped, the host holding two
    pinned staging slots per rank), and T5 goes back to the CPU after encoding (offload).
    ``dtype``: the resolved compute dtype (``shared.precision``; None: ``auto`` on a GPU of unknown
    capability). ``release`` (lean loading on a GPU): the encoders are let go after they encode and
    the DiT is read after them, so the host's peak is the larger of the two phases, not their sum;
    ``served``: a server's group builds them again beside the DiT for a new prompt and speech, so
    they are counted beside it all the same. ``t5_cpu`` (``--t5-cpu``; the hybrid mode's always):
    T5 encodes on the CPU, so the encode phase holds none of it on the GPU (its host bytes are
    where they always are: T5 is built on the CPU); not with an FSDP-sharded T5."""
    on_cuda = device == "cuda"
    if dtype is None:
        dtype, dtype_why = precision.resolve(ComputeDtype.AUTO, device)
    else:
        dtype, dtype_why = ComputeDtype(dtype), ""
    pb = precision.element_bytes(dtype)  # the DiT's and T5's parameters and activations (the rank's rule)
    ws = max(1, layout.world_size)
    use_sp, dit_fsdp, t5_fsdp = layout.use_sp, layout.dit_fsdp, layout.t5_fsdp
    t5_cpu = layout.t5_cpu or (bool(t5_cpu) and not t5_fsdp)
    dims = dit_dims(sizes)
    dim, ffn = dims.dim, dims.ffn_dim
    l_full = wl.tokens.max_len
    l_loc = -(-l_full // layout.sp_degree) if use_sp else l_full  # a CFG branch splits over its SP group
    w_dit, w_t5, w_vae = sizes.dit_params * pb, sizes.t5_params * pb, sizes.vae_params * 4
    w_w2v = sizes.wav2vec_params * 4
    fp8 = DitQuant(quant) is DitQuant.FP8 and sizes.dit_fp8_params > 0
    largest_linear = dim * ffn
    if fp8:
        w_dit = (sizes.dit_params - sizes.dit_fp8_params) * pb + sizes.dit_fp8_params + sizes.dit_fp8_rows * SCALE_BYTES
    act = _act(l_loc, l_full, dim, ffn, use_sp) + (largest_linear * (4 + pb) if fp8 else 0)
    vae_ws = _vae_ws(wl.height, wl.width)
    # a split VAE decodes a band of rows per rank; the gathering rank also holds the whole clip
    vae_dec = _vae_ws(wl.height, wl.width, VAE_DECODE_MAPS) // (ws if layout.vae_parallel else 1)
    # a context a pass: the prompt's, and the negative prompt's where a rank runs the unconditional pass
    text_kv = _text_kv(dims.num_layers, dim, pb, step_passes(wl.cfg, layout.cfg_degree))
    dec_frames = 4 * wl.decode_latents - 3  # the VAE's first latent frame gives 1 frame, the others 4
    dec_out = 3 * dec_frames * wl.height * wl.width * 4
    # rank 0's frames on the host: the streaming writer's few clips, flat in the clip count
    # (shared.video_budget, the one rule); they come after the audio encode, so on CUDA they
    # share the encode's transient (wav2vec2's activations) rather than add to it
    frames = host_frame_bytes(wl.height, wl.width, wl.infer_frames, on_cpu=not on_cuda)
    parts = {"dit_weights": w_dit, "t5_weights": w_t5, "vae_weights": w_vae, "wav2vec_weights": w_w2v,
             "dit_activations": act, "vae_workspace": vae_dec + dec_out, "text_kv_memo": text_kv,
             "video_frames_rank0": frames}

    streaming = None
    if stream is not None and not dit_fsdp and on_cuda:
        streaming = stream_terms(sizes, pb, fp8, stream)
        streaming["source"] = StreamSource(source).value
        offload = True  # T5 leaves the GPU after encoding; the DiT is never moved whole
    if dit_fsdp:
        dit_res = -(-w_dit // ws)
        root, block = sizes.dit_root_params, sizes.dit_block_max
        if fp8:  # the fp8 weights are units of their own, gathered one Linear at a time (in the param dtype)
            per_block = 8 * dim * dim + 2 * largest_linear
            root -= max(0, sizes.dit_fp8_params - dims.num_layers * per_block)
            block = max(0, block - per_block) + largest_linear
        dit_gathered = (root + 2 * block) * pb if ws > 1 else 0
    else:
        dit_res, dit_gathered = w_dit, 0
    if streaming is not None:
        dit_res = w_dit - streaming["streamed_bytes"] + streaming["device_bytes"]
        parts["dit_streamed_host"] = streaming["streamed_bytes"]
    if t5_cpu:
        t5_gpu, t5_gather = 0, 0
    elif t5_fsdp:
        t5_gpu, t5_gather = -(-w_t5 // ws), (2 * sizes.t5_block_max * pb if ws > 1 else 0)
    else:
        t5_gpu, t5_gather = w_t5, 0
    t5_denoise = 0 if (offload or t5_cpu) else t5_gpu  # offload: T5 back to CPU after encoding
    phases: dict[str, int] = {}
    # the encoders let go before the DiT is read (lean loading on a GPU; a server's group builds them
    # again beside the DiT for a new prompt, so it gains nothing)
    released = (bool(release) and on_cuda and LoadStrategy(load) is LoadStrategy.LEAN and not served
                and not dit_fsdp)  # the rank reads only a replicated DiT after the encoders
    #: a live pipeline whose decoding rank runs no step (5 ranks): it holds the VAE and decodes, no DiT;
    #: the step ranks hold the DiT (the text rank T5 too), no VAE
    decoder_alone = layout.stages is not None and not layout.holds_dit(layout.decoding_rank)
    if decoder_alone:
        parts["dit_weights_rank0"] = 0
    #: the live recipe: the decoding rank's wav2vec2 on its GPU for the whole job (each block's speech
    #: features made as it starts: rank.block_pipeline), fp32, with one window's activations
    w2v_live = encoder_placement.encode_bytes(sizes.wav2vec_params, live_window_s()) if layout.stages is not None else 0
    if w2v_live:
        parts["wav2vec_live_rank0"] = w2v_live
    if on_cuda and decoder_alone:
        phases["encode"] = max(w_vae + vae_ws, (0 if released else dit_res) + t5_gpu + t5_gather)
        phases["denoise"] = dit_res + t5_denoise + act + text_kv
        phases["decode"] = w_vae + vae_dec + dec_out + w2v_live  # rank 0's
        gpu_peak = max(phases.values()) + GPU_RUNTIME
    elif on_cuda:
        # the reference is encoded before the prompt: the VAE's workspace and T5 come one after the
        # other; released encoders: the DiT's device part comes after them
        phases["encode"] = (0 if released else dit_res) + w_vae + max(t5_gpu + t5_gather, vae_ws)
        phases["denoise"] = dit_res + dit_gathered + t5_denoise + w_vae + act + text_kv + w2v_live
        # offload parks a resident DiT on the CPU for the decode; a streamed one keeps its device part
        parked = 0 if streaming is None else dit_res
        phases["decode"] = ((parked if offload else dit_res + t5_denoise) + w_vae + vae_dec + dec_out + text_kv
                            + w2v_live)
        gpu_peak = max(phases.values()) + GPU_RUNTIME
    else:
        gpu_peak = None
    w2v_phase = w_w2v + encoder_placement.host_bytes(wl.audio_seconds)
    base = HOST_BASE_CUDA if on_cuda else HOST_BASE_CPU
    name = layout.mode.value if layout.mode else "custom"
    if load is LoadStrategy.LEAN:
        staging = ((largest_linear * (6 if fp8 else pb)) if on_cuda  # fp8: read in fp32, quantized, staged
                   else LEAN_CHUNK + (largest_linear * 4 if fp8 else 0))
        stage_stream = dit0 = dit_shared = 0
        if streaming is not None:
            if StreamSource(source) is StreamSource.PAGE_CACHE:  # a file, mapped: two pinned slots a rank
                stage_stream = stream_source.staging_bytes(streaming["slot_bytes"])
                streaming["pinned_bytes"] = nproc * stage_stream
                streaming["file_bytes"] = w_dit
            else:  # the whole DiT in host memory: the node's one copy, or rank 0's own
                dit_shared, dit0 = (w_dit, 0) if nproc > 1 else (0, w_dit)
                streaming["pinned_bytes"] = w_dit
        kw = dict(on_cuda=on_cuda, offload=offload and streaming is None, w_dit=w_dit, w_t5=w_t5, w_vae=w_vae,
                  w2v_phase=w2v_phase, dit_res=dit_res, dit_gathered=dit_gathered, act=act + text_kv,
                  vae_band=vae_dec, vae_out=dec_out, frames=frames, w_w2v=w_w2v, staging=staging)
        host0, others, shared, transient, text_extra = _lean_host(layout, **kw)
        # the text rank (the last) holds T5 on top of what any other rank holds; rank 0's frames
        # are in host0
        whole = HostPhase(host0 + dit0 + stage_stream + base, others + stage_stream + base, text_extra,
                          shared + dit_shared)
        host_phases = None
        if released:
            enc, dit = _lean_host_released(layout, **kw)
            encode = HostPhase(enc[0] + base, enc[1] + base, enc[2], enc[3])
            after = HostPhase(dit[0] + dit0 + stage_stream + base, dit[1] + stage_stream + base, dit[2],
                              dit[3] + dit_shared)
            host_phases = {"encode": encode, "dit": after}
            whole = max((encode, after), key=lambda ph: ph.node(nproc))
        node = max(ph.node(nproc) for ph in host_phases.values()) if host_phases else whole.node(nproc)
        peak = max(ph.peak() for ph in host_phases.values()) if host_phases else whole.peak()
        return ModePlan(name, ws, gpu_peak, phases, int(peak), int(node), parts,
                        load, int(whole.others), int(whole.shared), int(transient), nproc, int(whole.rank0),
                        int(whole.text_extra), streaming, dtype.value, dtype_why, bool(release) and on_cuda,
                        {k: ph.to_json(nproc) for k, ph in host_phases.items()} if host_phases else None,
                        t5_cpu=t5_cpu)
    if on_cuda:
        t5_build = sizes.t5_params * 4 + (0 if pb == 2 else sizes.t5_params * 2)  # fp32 init (+ file)
        t5_resident = w_t5 if not t5_fsdp else 0
        # an FSDP DiT is loaded whole on the CPU before sharding (a sharded T5 is on the GPU by
        # then); otherwise it goes straight to the GPU (device_map)
        dit_host = w_dit if dit_fsdp else 0
        host = max(t5_build, t5_resident + dit_host, t5_resident + w2v_phase)
        host0 = max(host, t5_resident + w_w2v + frames)  # rank 0 decodes: its frames after the encode
        # offload parks the DiT on the CPU between uses, and T5's shard when it is FSDP-sharded (a
        # whole T5 is in t5_resident already)
        if offload:
            host += w_dit + (t5_gpu if t5_fsdp else 0)
            host0 += w_dit + (t5_gpu if t5_fsdp else 0)
        host += HOST_BASE_CUDA
        host0 += HOST_BASE_CUDA
    else:
        t5_build = sizes.t5_params * 4 + sizes.t5_params * 2
        run = (dit_res + dit_gathered + w_t5 + w_vae + w_w2v + act + text_kv + vae_dec + dec_out
               + encoder_placement.host_bytes(wl.audio_seconds))
        host = max(t5_build, run) + HOST_BASE_CPU
        host0 = max(t5_build, run + frames) + HOST_BASE_CPU
        if dit_fsdp:  # the whole DiT is loaded on every rank before sharding
            host = max(host, w_t5 + w_dit + HOST_BASE_CPU)
            host0 = max(host0, w_t5 + w_dit + HOST_BASE_CPU)
    # --load full: upstream's constructors; reading in waves is lean loading's (no transient here)
    return ModePlan(name, ws, gpu_peak, phases, int(max(host, host0)), int((nproc - 1) * host + host0), parts,
                    load, int(host), 0, 0, nproc, int(host0), dtype=dtype.value, dtype_why=dtype_why, t5_cpu=t5_cpu)


def _lean_host(layout: Layout, *, on_cuda, offload, w_dit, w_t5, w_vae, w2v_phase, dit_res,
               dit_gathered, act, vae_band, vae_out, staging, frames=0, w_w2v=0) -> tuple[int, int, int, int, int]:
    """Host bytes under lean loading, base excluded: (rank 0, any other rank, shared once per
    node, per-rank transient while reading, what the text rank holds on top of any other rank).
    Rank 0 runs wav2vec2; the text rank (the layout's ``text_rank``: the last, rank 0 when alone)
    holds T5 unless it is FSDP-sharded; weights stream to the GPU through a one-tensor staging
    buffer; on the CPU a replicated DiT is one node-shared copy and an FSDP rank holds its shards.
    Rank 0 also holds the video's ``frames`` (``shared.video_budget``): on CUDA after the audio
    encode, beside wav2vec2's weights (not its activations); on the CPU on top of everything."""
    ws = max(1, layout.world_size)
    t5_shard = -(-w_t5 // ws)
    t5_whole = 0 if layout.t5_fsdp else w_t5
    t5_0, text_extra = (t5_whole, 0) if layout.text_rank in (0, None) else (0, t5_whole)
    if on_cuda:
        # T5 is built on the CPU, moved to the GPU when used; the frames come after the encode
        host0 = t5_0 + max(w2v_phase, staging, w_w2v + frames)
        # offload parks the DiT on the CPU between uses, and T5's shard when it is FSDP-sharded (a
        # whole T5 is counted where it is built already)
        if offload:
            host0 += w_dit + (t5_shard if layout.t5_fsdp else 0)
        return host0, staging, 0, staging, text_extra
    dit_local, shared = (dit_res, 0) if layout.dit_fsdp else (0, w_dit)
    t5_0, t5_other = (t5_shard, t5_shard) if layout.t5_fsdp else (t5_0, 0)
    # a split VAE: every rank works on its band (vae_band is per rank already); rank 0 gathers the clip
    vae_other = (w_vae + vae_band + vae_out // max(1, ws)) if layout.vae_parallel else 0
    host0 = dit_local + dit_gathered + t5_0 + w_vae + w2v_phase + act + vae_band + vae_out + staging + frames
    others = dit_local + dit_gathered + t5_other + vae_other + act + staging
    return host0, others, shared, staging, text_extra


def _lean_host_released(layout: Layout, *, on_cuda, offload, w_dit, w_t5, w2v_phase, staging, frames=0,
                        **_) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Lean loading on a GPU with the encoders released (``--release-encoders``): (rank 0, any
    other rank, the text rank's extra, shared) in the encode phase (T5 where it is built, wav2vec2
    and its encode on rank 0, the weights' staging; no DiT yet: it is read after the encoders are
    let go) and in the DiT phase (rank 0's frames or the staging of the DiT's read, offload's
    parked DiT; an FSDP-sharded T5 is kept, so offload's parked shard is in both). Base excluded;
    the streamed DiT's host bytes are the caller's."""
    ws = max(1, layout.world_size)
    t5_whole = 0 if layout.t5_fsdp else w_t5
    t5_0, text_extra = (t5_whole, 0) if layout.text_rank in (0, None) else (0, t5_whole)
    t5_park = -(-w_t5 // ws) if (offload and layout.t5_fsdp) else 0
    encode = (t5_0 + max(w2v_phase, staging) + t5_park, staging, text_extra, 0)
    dit = (max(staging, frames) + t5_park + (w_dit if offload else 0), staging, 0, 0)
    return encode, dit


def compute_dtype(ctx) -> tuple[ComputeDtype, str]:
    """What this context's DiT and T5 compute in, and why (``--dtype``: ``shared.precision``'s
    rule on the oldest GPU the node's ranks use)."""
    caps = [tuple(g["capability"]) if g.get("capability") else None for g in ctx.local_gpus] if ctx.on_cuda else []
    return precision.resolve(ctx.spec.dtype, ctx.spec.device, caps)


def host_available(ctx) -> Optional[int]:
    """The RAM one rank group may use: what the host has available, shared by the node's groups."""
    avail = ctx.facts.host_available_bytes()
    return None if avail is None else avail // max(1, ctx.node_groups)


def _dit_phase(p: ModePlan) -> tuple[int, int]:
    """(the streamed DiT's host bytes, everything else the node holds beside them, the page cache's
    staging aside) of ``p``: the DiT phase's when the encoders are released (they are gone by
    then). What ``shared.stream_source.choose`` takes."""
    st = p.stream or {}
    w_dit = st.get("file_bytes") or st.get("pinned_bytes", 0)
    node = p.host_phases["dit"]["node"] if p.host_phases else p.host_node_total
    return w_dit, max(0, node - st.get("pinned_bytes", 0))  # memory: the DiT pinned; page cache: the staging


def settle_host(ctx, layout: Layout, sizes: ModelSizes, wl: Workload, stream: Optional[int],
                t5_cpu: bool = False) -> ModePlan:
    """The plan of ``layout`` with what the spec leaves to the plan settled, as the run will settle it:

    * where a streamed DiT's bytes live (``--dit-stream-from auto``): ``shared.stream_source.choose``
      (the rank's rule) on the plan's DiT bytes, the node's other bytes beside them and the RAM
      available: memory when they fit :data:`HOST_FILL` of it, else the page cache;
    * whether the encoders are released (``--release-encoders`` unset, lean loading on a GPU, a
      replicated DiT (ulysses: streamed, or parked on the host by offload; an FSDP mode keeps its
      sharded T5 and holds no DiT copy on the host), not a server's group): only when the plan
      would otherwise be past :data:`HOST_FILL` of the RAM (or :data:`GPU_FILL` of the GPU's free
      memory: T5 then encodes before the DiT's device part is placed) and releasing lowers that peak;
      tried before the page cache (a DiT held in memory copies at PCIe's pace, the page cache's at
      the disk's where the RAM cannot keep it);
    * the page cache's room (the RAM available less what the plan holds) and what a pass then reads
      from the disk again (all of it when the file does not fit: a cyclic scan larger than the cache).

    ``t5_cpu``: T5 encodes on the CPU (:func:`settle_plan` decides it)."""
    spec = ctx.spec
    avail = host_available(ctx)
    dtype, dtype_why = compute_dtype(ctx)
    # a server's group (its replicas too: only ``serve`` puts several groups on a node)
    served = bool(getattr(ctx, "served", False)) or ctx.node_groups > 1
    kw = dict(nproc=spec.nproc, device=spec.device, offload=ctx.offload, load=spec.load, quant=spec.dit_quant,
              stream=stream, dtype=dtype, served=served, t5_cpu=t5_cpu)
    streamed = stream is not None and not layout.dit_fsdp and ctx.on_cuda
    given_release = spec.release_encoders
    can_release = (ctx.on_cuda and LoadStrategy(spec.load) is LoadStrategy.LEAN and not served
                   and not layout.dit_fsdp)
    src_given = StreamSource(spec.dit_stream_from) if streamed else StreamSource.MEMORY

    def plan(release: bool, source: StreamSource) -> ModePlan:
        p = plan_mode(layout, sizes, wl, release=release, source=source, **kw)
        p.dtype_why = dtype_why
        return p

    free = free_gpu_bytes(ctx) if ctx.on_cuda else 0

    def fits(p: ModePlan) -> bool:
        return avail is None or p.host_node_total <= HOST_FILL * avail

    def gpu_tight(p: ModePlan) -> bool:
        return bool(free and p.gpu_peak and p.gpu_peak > GPU_FILL * free)

    def with_release(source: StreamSource) -> ModePlan:
        """The plan without released encoders, unless it is past HOST_FILL and releasing lowers it."""
        kept = plan(bool(given_release), source)
        if given_release is not None:
            kept.release_why = (f"--release-encoders {'on' if given_release else 'off'}"
                                + (" (a server's group builds them again beside the DiT for a new prompt: "
                                   "counted beside it)" if given_release and served else ""))
            return kept
        if not can_release or (fits(kept) and not gpu_tight(kept)):
            kept.release_why = "kept: " + ("a server's group needs them for each new prompt" if served
                                           else "the host holds them beside the DiT" if can_release
                                           else "an FSDP-sharded DiT holds no copy on the host" if layout.dit_fsdp
                                           else "only lean loading on a GPU releases them")
            return kept
        freed = plan(True, source)
        why = []
        if not fits(kept) and freed.host_node_total < kept.host_node_total:
            why.append(f"with T5 and wav2vec2 held beside the DiT the host needs {kept.host_node_total / GiB:.1f} GiB, "
                       f"past {HOST_FILL:.0%} of the {avail / GiB:.1f} GiB available")
        if gpu_tight(kept) and freed.gpu_peak < kept.gpu_peak:
            why.append(f"T5 on the GPU beside the DiT's device part peaks at {kept.gpu_peak / GiB:.1f} GiB, past "
                       f"{GPU_FILL:.0%} of the {free / GiB:.1f} GiB free (released: "
                       f"{freed.gpu_peak / GiB:.1f} GiB)")
        if why:
            freed.release_why = "released (the plan settles --release-encoders): " + "; ".join(why)
            return freed
        kept.release_why = "kept: releasing them would not lower the peak"
        return kept

    if not streamed:
        return with_release(StreamSource.MEMORY)
    if src_given is not StreamSource.AUTO:
        p = with_release(src_given)
        p.source_why = f"{src_given.value} (--dit-stream-from {src_given.value})"
    else:
        p = with_release(StreamSource.MEMORY)
        where, why = stream_source.choose(*_dit_phase(p), avail, spec.nproc, p.stream["slot_bytes"])
        if where is StreamSource.PAGE_CACHE:
            p = with_release(StreamSource.PAGE_CACHE)
            # in the words of the plan it settled on (its figures are memory.host's)
            why = stream_source.choose(*_dit_phase(p), avail, spec.nproc, p.stream["slot_bytes"])[1]
        p.source_why = why
    _cache_room(p, avail)
    return p


def _cache_room(p: ModePlan, avail: Optional[int]) -> None:
    """The page cache's room beside ``p`` and what a pass reads from the disk again (in ``p.stream``)."""
    st = p.stream
    if not st or st.get("source") != StreamSource.PAGE_CACHE.value:
        return
    node = p.host_phases["dit"]["node"] if p.host_phases else p.host_node_total
    room = None if avail is None else max(0, avail - node)
    st["cache_room"] = room
    st["disk_bytes_per_pass"] = st["bytes_per_pass"] if room is not None and st["file_bytes"] > room else 0


def plan_all(ctx) -> dict[str, ModePlan]:
    """The plan of every mode at this context's world size (keys: mode values; ``live`` only for
    a live context: checks_live adds its caches); with
    ``--dit-offload blocks``, the modes that replicate the DiT stream it (``--resident-blocks``,
    else as many resident as :func:`resident_blocks` finds room for)."""
    sizes, wl = model_sizes(ctx), workload(ctx)
    out = {}
    # the live mode is another recipe, not another layout of the same job: planned only when asked for
    for m in (m for m in Mode if not MODES[m].step_pipeline or ctx.mode is m):
        stream = None
        if ctx.spec.dit_offload is DitOffload.BLOCKS and not ctx.layout_for(m).dit_fsdp:
            stream = ctx.spec.resident_blocks if ctx.spec.resident_blocks is not None else RESIDENT_FROM_PLAN
        out[m.value] = settle_plan(ctx, ctx.layout_for(m), sizes, wl, stream)
    return out


#: :func:`settle_plan`'s ``stream`` for a streamed DiT whose resident blocks the plan picks
RESIDENT_FROM_PLAN = -1
#: how :attr:`ModePlan.t5_why` begins where the plan put T5 on the CPU (``--t5-cpu`` unset)
T5_SETTLED = "T5 encodes on the CPU (the plan sets --t5-cpu)"


def settle_plan(ctx, layout: Layout, sizes: ModelSizes, wl: Workload, stream: Optional[int]) -> ModePlan:
    """:func:`settle_host`'s plan of ``layout`` with where T5 encodes settled too (``stream``: the
    resident blocks of a streamed DiT, :data:`RESIDENT_FROM_PLAN` for as many as
    :func:`resident_blocks` finds room for, None: not streamed):

    * the hybrid mode keeps T5 on the CPU, fsdp-fixed shards it on the GPUs; ``--t5-cpu`` given
      (or a run on the CPU) is obeyed;
    * unset, on a GPU, with the DiT streamed: T5 encodes on the GPU, unless the GPU cannot hold the
      encode phase with it there (past the free memory, the encoders released where the plan
      settles that) but can with T5 on the CPU: then on the CPU (slower; what lets a 12 GB card
      stream the DiT), and the resident blocks are picked for it. A resident DiT keeps T5 on the
      GPU (the hybrid mode is the one that puts it on the CPU beside a DiT too large to replicate)."""
    free = free_gpu_bytes(ctx) if ctx.on_cuda else 0

    def settled(cpu: bool) -> ModePlan:
        resident = stream
        if stream == RESIDENT_FROM_PLAN:
            resident = resident_blocks(layout, sizes, wl, ctx, free, t5_cpu=cpu)
        return settle_host(ctx, layout, sizes, wl, resident, t5_cpu=cpu)

    given = ctx.spec.t5_cpu
    if layout.t5_cpu or layout.t5_fsdp:
        p = settled(False)
        p.t5_why = f"the {p.mode} mode's: " + ("on the CPU" if layout.t5_cpu else "sharded on the GPUs")
        return p
    if given is not None or not ctx.on_cuda:
        p = settled(bool(given))
        p.t5_why = f"--t5-cpu {'on' if given else 'off'}" if given is not None else "--device cpu"
        return p
    kept = settled(False)

    def encode(p: ModePlan) -> int:
        return p.gpu_phases.get("encode", 0) + GPU_RUNTIME
    if kept.stream is None or not free or encode(kept) <= free:
        kept.t5_why = "on the GPU while it encodes"
        return kept
    cpu = settled(True)
    if encode(cpu) > free:
        kept.t5_why = "on the GPU: the encode phase does not fit with T5 on the CPU either"
        return kept
    cpu.t5_why = (f"{T5_SETTLED}: on the GPU its encode phase needs est. {encode(kept) / GiB:.1f} GiB of the "
                  f"{free / GiB:.1f} GiB free (on the CPU: {encode(cpu) / GiB:.1f} GiB; slower: "
                  f"~{2 * sizes.t5_params * TEXT_LEN / 1e12:.1f} TFLOP a new text on the CPU, tens of seconds)")
    return cpu


def streamed_plan(ctx) -> Optional[ModePlan]:
    """The ``ulysses`` plan of this context with the DiT streamed (``--dit-offload blocks``, as
    many blocks resident as fit), whatever the context itself says: what the doctor shows beside
    the resident plans and names when they do not fit. None under ``--load full`` (it cannot
    stream)."""
    if LoadStrategy(ctx.spec.load) is LoadStrategy.FULL:
        return None
    return plan_all(ctx.with_settings(dit_offload=DitOffload.BLOCKS, resident_blocks=None))[Mode.ULYSSES.value]


#: what of the GPU's free memory a plan may fill before it is called tight (``memory.gpu`` warns
#: above it, ``--mode auto`` says so, a streamed DiT keeps no more blocks resident): the estimate
#: is approximate, and a streamed step whose blocks fill the last gigabytes waits on the allocator
#: (docs/gpu.md, the streamed DiT)
GPU_FILL = 0.9


def free_gpu_bytes(ctx) -> int:
    """The least free memory of the GPUs the node's ranks use (total where free is unknown; 0 on none)."""
    gpus = [g for g in ctx.local_gpus if g.get("free_mib") is not None] or ctx.facts.gpus
    return min((g.get("free_mib") or g.get("total_mib") or 0 for g in gpus), default=0) * 2**20


def resident_blocks(layout: Layout, sizes: ModelSizes, wl: Workload, ctx, free: int, t5_cpu: bool = False) -> int:
    """How many DiT blocks a streamed run keeps on the GPU: the most whose plan stays within
    :data:`GPU_FILL` of ``free`` (0 when even every block streamed does not, or free is unknown;
    ``t5_cpu``: T5 encodes on the CPU)."""
    if not free or not sizes.dit_units:
        return 0

    dtype = compute_dtype(ctx)[0]

    def peak(r: int) -> int:
        return plan_mode(layout, sizes, wl, nproc=ctx.spec.nproc, device=ctx.spec.device, offload=ctx.offload,
                         load=ctx.spec.load, quant=ctx.spec.dit_quant, stream=r, dtype=dtype,
                         t5_cpu=t5_cpu).gpu_peak or 0
    # the most that fit, tried from all down: the peak is not monotonic in R (two streamed units
    # take two slots of the larger one, more than keeping one of them resident)
    return next((r for r in range(len(sizes.dit_units), -1, -1) if peak(r) <= GPU_FILL * free), 0)


#: standard S2V areas, largest first (WIDTH*HEIGHT as the CLI takes them)
SIZES = ("1024*704", "960*640", "832*480", "704*448", "640*384", "512*320")


def largest_fitting_size(ctx, mode: Mode, free: int, streamed: bool = False) -> str:
    """The largest of :data:`SIZES` below ``--size`` whose plan fits in ``free`` bytes, or ''
    (``streamed``: ulysses with the DiT streamed, :func:`streamed_plan`, whatever the context says)."""
    return largest_fitting(ctx, mode, free, streamed)[0]


def largest_fitting(ctx, mode: Mode, free: int, streamed: bool = False) -> tuple[str, Optional[ModePlan]]:
    """:func:`largest_fitting_size` and its plan (None where no size fits)."""
    from wan_s2v_runner.shared.spec import parse_size
    for s in SIZES:
        if parse_size(s) >= ctx.spec.max_area:
            continue
        trial = ctx.with_settings(max_area=parse_size(s))
        plan = streamed_plan(trial) if streamed else plan_all(trial)[Mode(mode).value]
        if plan is not None and (plan.gpu_peak or 0) <= free:
            return s, plan
    return "", None


def t5_words(plan: Optional[ModePlan]) -> str:
    """``; T5 encodes on the CPU (the plan sets --t5-cpu)`` where ``plan`` put it there itself, else ''."""
    return f"; {T5_SETTLED}" if plan is not None and plan.t5_settled else ""
