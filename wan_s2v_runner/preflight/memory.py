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
from wan_s2v_runner.shared import encoder_placement
from wan_s2v_runner.shared.ckpt_layout import DIT_CONFIG, T5_FILE, VAE_FILE, W2V_WEIGHTS, W2V_WEIGHTS_BIN
from wan_s2v_runner.shared.layout import DitOffload, DitQuant, Layout, LoadStrategy, Mode
from wan_s2v_runner.shared.quant import SCALE_BYTES, is_fp8_weight
from wan_s2v_runner.shared.video_budget import host_frame_bytes

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
REFERENCE_INJECT_LAYERS = (0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39)
_BLOCK = 351_400_000  # one 14B block's parameters
_BLOCK_FP8 = 8 * 5120**2 + 2 * 5120 * 13824
_INJECT = 4 * (5120**2 + 5120) + 5120 * 2 * 5120 + 2 * 5120  # q, k, v, o + the AdaIN's Linear
_INJECT_FP8 = 4 * 5120**2


#: Wan2.2-S2V-14B (engine-facts): DiT 16.3B = 40 blocks x 351.4M + 2.24B root; T5 umt5-xxl
#: encoder 5.68B (24 blocks); VAE 127M; wav2vec2-large-xlsr-53 317M.
REFERENCE = ModelSizes(source="reference Wan2.2-S2V-14B sizes (no readable checkpoint)",
                       dit_params=16_300_000_000, dit_root_params=2_240_000_000,
                       dit_block_max=351_400_000, t5_params=5_680_000_000, t5_block_max=201_000_000,
                       vae_params=127_000_000, wav2vec_params=317_000_000, dim=5120, ffn_dim=13824,
                       num_heads=40, num_layers=40,
                       # 40 blocks x (8 x 5120^2 + 2 x 5120 x 13824) + 12 audio layers x 4 x 5120^2
                       dit_fp8_params=40 * (8 * 5120**2 + 2 * 5120 * 13824) + 12 * 4 * 5120**2,
                       dit_fp8_rows=40 * (8 * 5120 + 13824 + 5120) + 12 * 4 * 5120,
                       dit_units=tuple(_BLOCK + (_INJECT if i in REFERENCE_INJECT_LAYERS else 0) for i in range(40)),
                       dit_units_fp8=tuple(_BLOCK_FP8 + (_INJECT_FP8 if i in REFERENCE_INJECT_LAYERS else 0)
                                           for i in range(40)))

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
    height: int
    width: int
    tokens: TokenCounts
    n_clips: int
    audio_seconds: float
    infer_frames: int = 80
    start_from_ref: bool = False
    assumed: list[str] = field(default_factory=list)


def workload(ctx) -> Workload:
    """Generation size, tokens and clips for the memory plan (measured inputs, else assumptions)."""
    assumed = []
    img = ctx.cache.get("image_size")  # (w, h) set by the inputs checks
    if img:
        h, w = generation_size(img[1], img[0], ctx.spec.max_area)
    else:
        h, w = generation_size(704, 1024, ctx.spec.max_area)
        assumed.append(f"a 1024x704 (landscape) image -> {w}x{h}")
    secs = ctx.cache.get("audio_seconds")
    if secs is None and ctx.spec.num_clips:
        # no speech to measure (the doctor without --audio): the speech --num-clips covers, so a
        # long job is planned without a long file (``--num-clips 121``: ten minutes)
        secs = output_frames(ctx.spec.num_clips, ctx.spec.infer_frames, ctx.spec.start_from_ref) / FPS
        assumed.append(f"{secs:g} s of speech (what --num-clips {ctx.spec.num_clips} makes)")
    elif secs is None:
        secs = 5.0
        assumed.append("5 s of audio")
    n_clips = clips_for_audio(secs, ctx.spec.infer_frames, ctx.spec.num_clips)
    return Workload(h, w, token_counts(max(h, 64), max(w, 64), ctx.spec.infer_frames), n_clips, secs,
                    ctx.spec.infer_frames, ctx.spec.start_from_ref, assumed)


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
    #: pinned_bytes (host, per node), bytes_per_pass (copied); None when the DiT is resident
    stream: Optional[dict] = None

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
              stream: Optional[int] = None) -> ModePlan:
    """The plan of one layout: what it shards, splits or keeps on the CPU decides every term;
    the host figures also follow the loading strategy (``load``) and the DiT's weights ``quant``
    (fp8: its big Linears at one byte a weight plus a float32 scale a row, each dequantized when
    called: an fp32 copy and the param-dtype copy F.linear takes of the largest one in flight).
    ``stream`` (not None; a replicated DiT): ``--dit-offload blocks`` with that many blocks
    resident: the device holds the rest of the DiT plus two slots, the host the whole DiT (read
    once per node, pinned), and T5 goes back to the CPU after encoding (offload)."""
    on_cuda = device == "cuda"
    pb = 2 if on_cuda else 4  # param_dtype/t5_dtype: bf16 on CUDA, fp32 on CPU (worker.engine_config)
    ws = max(1, layout.world_size)
    use_sp, dit_fsdp, t5_fsdp, t5_cpu = layout.use_sp, layout.dit_fsdp, layout.t5_fsdp, layout.t5_cpu
    dim, ffn = sizes.dim or REFERENCE.dim, sizes.ffn_dim or REFERENCE.ffn_dim
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
    text_kv = _text_kv(sizes.num_layers or REFERENCE.num_layers, dim, pb, 2 // layout.cfg_degree)
    dec_frames = 4 * (wl.tokens.latent_frames + (73 + 3) // 4) - 3
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
        offload = True  # T5 leaves the GPU after encoding; the DiT is never moved whole
    if dit_fsdp:
        dit_res = -(-w_dit // ws)
        root, block = sizes.dit_root_params, sizes.dit_block_max
        if fp8:  # the fp8 weights are units of their own, gathered one Linear at a time (in the param dtype)
            per_block = 8 * dim * dim + 2 * largest_linear
            root -= max(0, sizes.dit_fp8_params - (sizes.num_layers or REFERENCE.num_layers) * per_block)
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
    if on_cuda:
        # the reference is encoded before the prompt: the VAE's workspace and T5 come one after the other
        phases["encode"] = dit_res + w_vae + max(t5_gpu + t5_gather, vae_ws)
        phases["denoise"] = dit_res + dit_gathered + t5_denoise + w_vae + act + text_kv
        # offload parks a resident DiT on the CPU for the decode; a streamed one keeps its device part
        parked = 0 if streaming is None else dit_res
        phases["decode"] = (parked if offload else dit_res + t5_denoise) + w_vae + vae_dec + dec_out + text_kv
        gpu_peak = max(phases.values()) + GPU_RUNTIME
    else:
        gpu_peak = None
    w2v_phase = w_w2v + encoder_placement.host_bytes(wl.audio_seconds)
    base = HOST_BASE_CUDA if on_cuda else HOST_BASE_CPU
    if load is LoadStrategy.LEAN:
        host0, others, shared, transient, text_extra = _lean_host(
            layout, on_cuda=on_cuda, offload=offload and streaming is None, w_dit=w_dit, w_t5=w_t5, w_vae=w_vae,
            w2v_phase=w2v_phase, dit_res=dit_res, dit_gathered=dit_gathered, act=act + text_kv,
            vae_band=vae_dec, vae_out=dec_out, frames=frames, w_w2v=w_w2v,
            staging=(largest_linear * (6 if fp8 else pb)) if on_cuda  # fp8: read in fp32, quantized, staged
            else LEAN_CHUNK + (largest_linear * 4 if fp8 else 0))
        if streaming is not None:  # the whole DiT in host memory: the node's one copy, or rank 0's own
            if nproc > 1:
                shared += w_dit
            else:
                host0 += w_dit
            streaming["pinned_bytes"] = w_dit
        host0, others = host0 + base, others + base
        name = layout.mode.value if layout.mode else "custom"
        # the text rank (the last) holds T5 on top of what any other rank holds; rank 0's frames
        # are in host0
        node = host0 + (nproc - 1) * others + (text_extra if nproc > 1 else 0) + shared
        return ModePlan(name, ws, gpu_peak, phases, int(max(host0, others + text_extra) + shared), int(node), parts,
                        load, int(others), int(shared), int(transient), nproc, int(host0), int(text_extra),
                        streaming)
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
    name = layout.mode.value if layout.mode else "custom"
    # --load full: upstream's constructors; reading in waves is lean loading's (no transient here)
    return ModePlan(name, ws, gpu_peak, phases, int(max(host, host0)), int((nproc - 1) * host + host0), parts,
                    load, int(host), 0, 0, nproc, int(host0))


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


def plan_all(ctx) -> dict[str, ModePlan]:
    """The plan of every mode at this context's world size (keys: mode values); with
    ``--dit-offload blocks``, the modes that replicate the DiT stream it (``--resident-blocks``,
    else as many resident as :func:`resident_blocks` finds room for)."""
    sizes, wl = model_sizes(ctx), workload(ctx)
    out = {}
    for m in Mode:
        stream = None
        if ctx.spec.dit_offload is DitOffload.BLOCKS and not ctx.layout_for(m).dit_fsdp:
            stream = ctx.spec.resident_blocks
            if stream is None:
                stream = resident_blocks(ctx.layout_for(m), sizes, wl, ctx, free_gpu_bytes(ctx))
        out[m.value] = plan_mode(ctx.layout_for(m), sizes, wl, nproc=ctx.spec.nproc, device=ctx.spec.device,
                                 offload=ctx.offload, load=ctx.spec.load, quant=ctx.spec.dit_quant, stream=stream)
    return out


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


def resident_blocks(layout: Layout, sizes: ModelSizes, wl: Workload, ctx, free: int) -> int:
    """How many DiT blocks a streamed run keeps on the GPU: the most whose plan stays within
    :data:`GPU_FILL` of ``free`` (0 when even every block streamed does not, or free is unknown)."""
    if not free or not sizes.dit_units:
        return 0

    def peak(r: int) -> int:
        return plan_mode(layout, sizes, wl, nproc=ctx.spec.nproc, device=ctx.spec.device, offload=ctx.offload,
                         load=ctx.spec.load, quant=ctx.spec.dit_quant, stream=r).gpu_peak or 0
    # the most that fit, tried from all down: the peak is not monotonic in R (two streamed units
    # take two slots of the larger one, more than keeping one of them resident)
    return next((r for r in range(len(sizes.dit_units), -1, -1) if peak(r) <= GPU_FILL * free), 0)


#: standard S2V areas, largest first (WIDTH*HEIGHT as the CLI takes them)
SIZES = ("1024*704", "960*640", "832*480", "704*448", "640*384", "512*320")


def largest_fitting_size(ctx, mode: Mode, free: int) -> str:
    """The largest of :data:`SIZES` below ``--size`` whose plan fits in ``free`` bytes, or ''."""
    from wan_s2v_runner.shared.spec import parse_size
    for s in SIZES:
        if parse_size(s) >= ctx.spec.max_area:
            continue
        trial = ctx.with_settings(max_area=parse_size(s))
        if (plan_all(trial)[Mode(mode).value].gpu_peak or 0) <= free:
            return s
    return ""
