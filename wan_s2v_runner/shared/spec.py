"""The run spec: every run setting, in two typed sections, shared by the launcher and every rank.

A rank group (one launch of its nodes' agents) and a job (one video it makes) are two
things, so they are two models: :class:`GroupSpec` holds what the group fixes for its life
(checkpoint, LoRAs, mode and layout, device, attention, supervision, where runs go) and
:class:`JobSpec` what one video needs (inputs, sampling, outputs). :class:`RunSpec` is both
(``class RunSpec(GroupSpec, JobSpec)``): ``wan-s2v run`` is a group with its one job, and a
batch line or a server submission is a :class:`JobSpec` joined to the group it runs on with
:meth:`RunSpec.of` (which adds the rules across the two: ``--cfg-parallel`` needs guidance).

Like torchtitan's ``ParallelDims``, each validates itself on construction and everything else
asks it (``group.world_size``, ``group.layout``, ``job.speech``). Each field carries its own
command-line surface as :class:`Flag` metadata (flag name, aliases, help section, environment
default, how its default reads in help); each help section (:class:`FlagGroup`) belongs to one
of the two models. The argparse flags (:mod:`wan_s2v_runner.launcher.flags`), the TOML keys,
the README flags table and the doctor's lenient view are generated from these fields, flat, as
one list. Adding a setting is one field in the section it belongs to. How values arrive (flags,
TOML, the environment, a Slurm step), the doctor's lenient view and the one-line errors are
parsing, not settings: :mod:`wan_s2v_runner.shared.config`.

The launcher builds the spec once (defaults < environment < TOML file < flags), resolves
``seed=-1`` to a concrete seed, writes the group's spec (a run's: the whole :class:`RunSpec`) to
the run directory as JSON (:func:`read_spec` reads either), and each rank reads that file back;
a batch or a server hands the ranks each job's :class:`JobSpec`. Nothing else carries settings.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from wan_s2v_runner.shared import cache_budget, cache_policy, schedule
from wan_s2v_runner.shared.dit_cost import max_infer_frames
from wan_s2v_runner.shared.layout import DitOffload, DitQuant, Layout, LoadStrategy, Mode, StreamSource
from wan_s2v_runner.shared.node_agent import DEFAULT_WORKER
from wan_s2v_runner.shared.precision import ComputeDtype
from wan_s2v_runner.shared.quant import Fp8Matmul
from wan_s2v_runner.shared.speech_timeline import Pace
from wan_s2v_runner.shared.speech_windows import SpeechWindow

__all__ = ["GroupSpec", "JobSpec", "RunSpec", "LoraRef", "Mode", "Layout", "Flag", "FlagGroup", "parse_size",
           "read_spec", "flag_of", "flag_name", "DEFAULT_MAX_AREA", "MAX_SEED"]

#: Upstream S2V default area (width*height); the engine fits the reference image inside it.
DEFAULT_MAX_AREA = 1024 * 704
MAX_SEED = 2**63 - 1
#: the most sampling steps a job may ask (upstream samples 40; a number far beyond is a mistake,
#: or a job that would hold a served group for days)
MAX_STEPS = 1000
#: positions per axis of the DiT's 3D rotary table (upstream's ``rope_params(1024, ...)``): a clip
#: with more latent frames, or a frame with more patches a side (16384 px: preflight's inputs.size),
#: fails in the DiT's ``rope_precompute`` (IndexError, found by the server's fuzz test)
ROPE_POSITIONS = 1024
#: frames a clip may have: its latent frames (``shared.dit_cost.clip_latent_frames``: after the 73
#: motion frames, the VAE's stride 4 in time) at most ROPE_POSITIONS: 4096
MAX_INFER_FRAMES = max_infer_frames(ROPE_POSITIONS)
#: the largest noise schedule shift and guidance scale (upstream: 3-5)
MAX_SCALE = 100.0


class FlagGroup(str, Enum):
    """Help sections, in display order: the job's three, then the rank group's three (each
    section's fields belong to one model: :attr:`job` says which)."""

    INPUTS = "job: inputs"
    SAMPLING = "job: sampling"
    OUTPUTS = "job: outputs"
    MODEL = "rank group: model"
    LAYOUT = "rank group: parallel layout"
    SUPERVISION = "rank group: supervision"

    @property
    def job(self) -> bool:
        """A job's section (:class:`JobSpec`), else the rank group's (:class:`GroupSpec`)."""
        return self in (FlagGroup.INPUTS, FlagGroup.SAMPLING, FlagGroup.OUTPUTS)


@dataclass(frozen=True)
class Flag:
    """How a spec field appears on the command line (metadata on the field)."""

    group: FlagGroup
    name: Optional[str] = None  # default: --field-name
    aliases: tuple[str, ...] = ()  # more flag spellings (also accepted as TOML keys)
    env: Optional[str] = None  # environment variable that supplies the default
    default_text: Optional[str] = None  # how the default reads when it is computed or None
    metavar: Optional[str] = None
    cli_type: Optional[Callable[[str], Any]] = None  # argparse type when it differs from the field's
    extra_choices: tuple[str, ...] = ()  # CLI-only choices resolved before the spec (e.g. mode auto)
    repeatable: bool = False  # the flag may be given several times (a list field)
    #: False: no command-line flag and no row in --help or the README (a setting for those who
    #: build on the runner, e.g. the tests' rank worker): the environment and TOML set it
    cli: bool = True


def size_pair(value: str) -> tuple[int, int]:
    """'1024*704' or '1024x704' -> (width, height)."""
    for sep in ("*", "x", "X"):
        if sep in value:
            w, h = value.split(sep, 1)
            try:
                w_i, h_i = int(w), int(h)
            except ValueError:
                break
            if w_i > 0 and h_i > 0:
                return w_i, h_i
    raise ValueError(f"size must look like WIDTH*HEIGHT (e.g. 1024*704), got {value!r}")


def parse_size(value: str) -> int:
    """'1024*704' or '1024x704' -> area in pixels."""
    w, h = size_pair(value)
    return w * h


def _area(value: Any) -> Any:
    """max_area accepts an area in pixels or WIDTH*HEIGHT (``--size``, TOML ``size``)."""
    if isinstance(value, str) and not value.strip().isdigit():
        return parse_size(value)
    return value


def _absolute(p: Path) -> Path:
    return Path(p).expanduser().absolute()


AbsPath = Annotated[Path, AfterValidator(_absolute)]


def _bytes_text(value: Any) -> Any:
    """A number of bytes (TOML ``dit_cache_max = 200000000000``) as the text it also reads as."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _cache_budget(value: Optional[str]) -> Optional[str]:
    """``dit_cache_max`` reads as a size or a share (``shared.cache_budget.parse``: its error is the
    one line)."""
    if value is not None:
        cache_budget.parse(value)
    return value
Area = Annotated[int, BeforeValidator(_area)]


class LoraRef(BaseModel):
    """One LoRA of a run: ``PATH[:STRENGTH]`` on the command line (strength 1.0 by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    path: AbsPath
    strength: float = 1.0

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if isinstance(value, (str, Path)):
            text = str(value)
            head, sep, tail = text.rpartition(":")
            try:
                return {"path": head, "strength": float(tail)} if sep and head else {"path": text}
            except ValueError:  # a ':' inside the path, no strength
                return {"path": text}
        return value

    def __str__(self) -> str:
        return f"{self.path}:{self.strength:g}"

_IN, _SA, _OU = FlagGroup.INPUTS, FlagGroup.SAMPLING, FlagGroup.OUTPUTS
_MO, _LA, _SU = FlagGroup.MODEL, FlagGroup.LAYOUT, FlagGroup.SUPERVISION


class GroupSpec(BaseModel):
    """What a rank group fixes for its life: the model it loads, its layout, its supervision.
    Paths are absolute after validation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # ----- the model
    ckpt_dir: Annotated[AbsPath, Flag(_MO, metavar="DIR")] = Field(
        description="Wan2.2-S2V-14B checkpoint directory")
    dit_file: Annotated[Optional[AbsPath], Flag(_MO, metavar="FILE", default_text="CKPT_DIR's DiT")] = Field(
        None, description="read the DiT from this one .safetensors file (a ComfyUI or Kijai single file: bare or "
                          "model.diffusion_model. names; bf16, fp16, fp32 or scaled fp8, dequantized at load); "
                          "everything else still comes from --ckpt-dir")
    t5_file: Annotated[Optional[AbsPath], Flag(_MO, metavar="FILE", default_text="CKPT_DIR's T5")] = Field(
        None, description="read the T5 text encoder from this one .safetensors file (ComfyUI's umt5_xxl_fp16, bf16 "
                          "or umt5_xxl_fp8_e4m3fn_scaled: Hugging Face/ComfyUI or Wan names; scaled fp8 dequantized "
                          "at load; lean loading only); its tokenizer still comes from --ckpt-dir")
    dit_quant: Annotated[DitQuant, Flag(_MO)] = Field(
        DitQuant.NONE, description="fp8: hold the DiT's block and audio-injection Linears in float8_e4m3fn with one "
                                   "scale per output row (quantized as read; an e4m3 --dit-file is used as it is): "
                                   "about half the DiT's bf16 bytes; how it multiplies: --fp8-matmul; precision: "
                                   "docs/loading.md")
    fp8_matmul: Annotated[Fp8Matmul, Flag(_MO)] = Field(
        Fp8Matmul.DEQUANT, description="with --dit-quant fp8: dequant multiplies the dequantized weights in the "
                                       "run's dtype; scaled-mm multiplies in fp8 with torch._scaled_mm, the "
                                       "activations quantized per token (compute capability >= 8.9; faster with "
                                       "--compile, and it rounds the activations too: docs/loading.md)")
    dtype: Annotated[ComputeDtype, Flag(_MO)] = Field(
        ComputeDtype.AUTO, description="what the DiT and T5 compute in (auto: bf16 where the GPU has bf16 units, "
                                       "fp16 below compute capability 8.0 (V100, T4, 20xx), fp32 on the CPU); "
                                       "fp16 keeps the embeddings and the head in fp32 and stops the job at a "
                                       "non-finite activation (docs/loading.md)")
    fp32_blocks: Annotated[list[int], Flag(_MO, metavar="I", repeatable=True, default_text="none")] = Field(
        default_factory=list, description="with --dtype fp16: compute these DiT blocks in fp32 (the fix the "
                                          "non-finite guard names for a block that overflows in fp16)")
    release_encoders: Annotated[Optional[bool], Flag(_MO, default_text="when the memory plan needs it")] = Field(
        None, description="let T5 and wav2vec2 go once they have encoded (built again for a later job's new text), "
                          "and read a replicated DiT only after them: the host holds the encoders or the DiT, "
                          "never both (a 32 GB machine)")
    t5_cpu: Annotated[Optional[bool], Flag(_MO, default_text="the mode's (hybrid: on), or the memory plan's")] = Field(
        None, description="encode the prompts with T5 on the CPU, never on the GPU (slower: tens of seconds a new "
                          "text on a desktop CPU; a served group encodes each text once): T5's ~11 GB in bf16 off "
                          "the GPU, a 12 GB card's streamed DiT; hybrid always does, fsdp-fixed (T5 sharded on "
                          "the GPUs) refuses it")
    wan_repo: Annotated[Optional[AbsPath], Flag(_MO, env="WAN_REPO", metavar="DIR",
                                                default_text="installed `wan`")] = Field(
        None, description="use this Wan2.2 checkout (repo root) instead of the installed wan package")
    cosyvoice_dir: Annotated[Optional[AbsPath], Flag(_MO, metavar="DIR", default_text="CKPT_DIR/CosyVoice")] = Field(
        None, description="a CosyVoice code checkout (nothing is downloaded at run time)")
    cosyvoice_model: Annotated[Optional[AbsPath], Flag(_MO, metavar="DIR",
                                                       default_text="CKPT_DIR/CosyVoice2-0.5B")] = Field(
        None, description="the CosyVoice2-0.5B model directory")
    lora: Annotated[list[LoraRef], Flag(_MO, metavar="PATH[:STRENGTH]", repeatable=True, default_text="none")] = Field(
        default_factory=list,
        description="merge a LoRA (.safetensors: peft/DiffSynth, kohya/VideoX-Fun or ComfyUI keys) into the "
                    "DiT before sharding; repeat for several; strength 1.0 unless given")
    lora_allow_partial: Annotated[bool, Flag(_MO)] = Field(
        False, description="run even when some LoRA keys name no module of this DiT (they are skipped)")
    offload_model: Annotated[Optional[bool], Flag(_MO, default_text="only with 1 GPU")] = Field(
        None, description="offload the DiT to CPU between uses (with --dit-offload blocks: always T5, never the DiT)")
    dit_offload: Annotated[DitOffload, Flag(_MO, env="WAN_S2V_DIT_OFFLOAD")] = Field(
        DitOffload.NONE, description="blocks: keep the DiT's blocks in pinned host memory and copy each to the GPU "
                                     "while the one before computes: the 14B on a 16-32 GB card, the same frames "
                                     "(ulysses mode; docs/loading.md)")
    resident_blocks: Annotated[Optional[int], Flag(_MO, metavar="N", default_text="from the memory plan")] = Field(
        None, ge=0, description="with --dit-offload blocks: how many of the DiT's blocks stay on the GPU (the "
                                "rest stream)")
    dit_stream_from: Annotated[StreamSource, Flag(_MO, env="WAN_S2V_DIT_STREAM_FROM")] = Field(
        StreamSource.AUTO, description="with --dit-offload blocks: where the streamed DiT's bytes live: memory (one "
                                       "host copy, pinned whole), page-cache (written once to a file under "
                                       "--cache-dir's dit/, ~/.cache/wan-s2v/dit by default, within "
                                       "--dit-cache-max, and memory-mapped: "
                                       "the kernel keeps what fits in RAM), auto (the page cache when the whole "
                                       "DiT beside the rest would not fit the RAM; docs/loading.md)")
    cache_dir: Annotated[Optional[AbsPath], Flag(_MO, env="WAN_S2V_CACHE_DIR", metavar="DIR",
                                                 default_text="$XDG_CACHE_HOME/wan-s2v, else "
                                                              "~/.cache/wan-s2v")] = Field(
        None, description="where wan-s2v keeps its caches: the DiT's page-cache files (DIR/dit; "
                          "$WAN_S2V_DIT_CACHE_DIR wins), the demo's assets (DIR/demo), --compile's kernels "
                          "(DIR/inductor; $TORCHINDUCTOR_CACHE_DIR wins); wan-s2v cache lists and clears them "
                          "(docs/caches.md)")
    dit_cache_max: Annotated[Optional[str], BeforeValidator(_bytes_text), AfterValidator(_cache_budget),
                             Flag(_MO, env="WAN_S2V_DIT_CACHE_MAX", metavar="SIZE",
                                  default_text="25% of its disk")] = Field(
        None, description="most disk the DiT's page-cache files may take (200G, 1.5T: binary units; or a share of "
                          "the disk: 20%): before writing a new file the least recently used others go (never one a "
                          "running group maps), and a write always leaves the disk the room the next video needs "
                          "(docs/caches.md)")
    # ----- parallel layout
    mode: Annotated[Mode, Flag(_LA, extra_choices=("auto",))] = Field(
        Mode.ULYSSES, description="parallel mode (auto: the doctor's recommendation)")
    cfg_parallel: Annotated[bool, Flag(_LA)] = Field(
        False, description="run the conditional and unconditional DiT passes of each step on two halves of "
                           "the ranks (CFG degree 2; the sequence-parallel degree becomes world/2)")
    vae_parallel: Annotated[Optional[bool], Flag(_LA, default_text="on when world > 1")] = Field(
        None, description="split the VAE's reference encode, per-clip decode and motion re-encode over "
                          "all ranks by rows (exact; off: rank 0 runs them alone)")
    load: Annotated[LoadStrategy, Flag(_LA)] = Field(
        LoadStrategy.LEAN, description="how ranks get the weights: lean (FSDP ranks read only their shards, "
                                       "a node reads a replicated CPU DiT once) or full (upstream: every "
                                       "rank reads whole files)")
    load_waves: Annotated[Optional[int], Flag(_LA, metavar="N", default_text="from the memory plan")] = Field(
        None, ge=1, description="read weights in N turns of this node's ranks (1: all at once)")
    nproc: Annotated[int, Flag(_LA, aliases=("--nproc-per-node",), metavar="N")] = Field(
        1, ge=1, description="ranks (GPUs) on this node")
    nnodes: Annotated[int, Flag(_LA, env="WORLD_SIZE", metavar="N")] = Field(
        1, ge=1, description="number of nodes (world size = nproc x nnodes)")
    node_rank: Annotated[int, Flag(_LA, env="RANK", metavar="I")] = Field(
        0, ge=0, description="this node's index")
    master_addr: Annotated[str, Flag(_LA, env="MASTER_ADDR", metavar="HOST")] = Field(
        "127.0.0.1", description="rendezvous host (node 0)")
    master_port: Annotated[Optional[int], Flag(_LA, env="MASTER_PORT", metavar="PORT",
                                               default_text="OS-chosen (1 node), 29500")] = Field(
        None, ge=1, le=65535, description="rendezvous port")
    device: Annotated[Literal["cuda", "cpu"], Flag(_LA)] = Field(
        "cuda", description="cuda (nccl) or cpu (gloo, fp32)")
    attention: Annotated[Literal["auto", "fa4", "fa3", "fa2", "sdpa"], Flag(_LA)] = Field(
        "auto", description="attention backend (fa4: flash-attn-4's CuTe kernels, SM90/SM100); the choice "
                            "is logged and recorded")
    compile: Annotated[bool, Flag(_LA, env="WAN_S2V_COMPILE")] = Field(
        False, description="compile each DiT block with torch.compile (inductor; one compiled block serves all, "
                           "once per size, cached under ~/.cache/wan-s2v/inductor; every mode): results within "
                           "float rounding of eager; speed: docs/bench.md")
    threads: Annotated[int, Flag(_LA, metavar="N")] = Field(1, ge=1, description="torch threads per rank on CPU")
    cpus: Annotated[Optional[str], Flag(_LA, metavar="LIST", default_text="all allowed")] = Field(
        None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
        description="CPU runs: the CPUs this node's ranks run on, e.g. 0-3,8 (serve --replicas gives each group "
                    "its share); ignored on CUDA")
    pin_cpus: Annotated[bool, Flag(_LA)] = Field(
        False, description="CPU runs: bind local rank r to its own CPUs (r*threads .. (r+1)*threads-1 of "
                           "those allowed; not when there are too few); ignored on CUDA (docs/bench.md)")
    # ----- supervision: no progress on any rank for this long -> stacks dumped, run stopped
    pg_timeout_s: Annotated[float, Flag(_SU, name="--pg-timeout", metavar="S")] = Field(
        3600.0, gt=0, description="process-group collective timeout, s (must exceed the watchdog limits)")
    watchdog_load_s: Annotated[float, Flag(_SU, name="--watchdog-load", metavar="S")] = Field(
        1800.0, ge=0, description="hang limit while importing/loading/sharding/encoding inputs, s (0 = off)")
    watchdog_step_s: Annotated[float, Flag(_SU, name="--watchdog-step", metavar="S")] = Field(
        600.0, ge=0, description="hang limit per step, decode, save, s (0 = off)")
    runs_root: Annotated[AbsPath, Flag(_SU, metavar="DIR")] = Field(
        Path("runs"), validate_default=True, description="where run directories go")
    strict_observers: Annotated[bool, Flag(_SU, env="WAN_S2V_STRICT_OBSERVERS", cli=False)] = Field(
        False, description="an observer's error (the console's, a served group's feed's) or a server's keeper's "
                           "fails the run instead of being logged (the test suite sets it)")
    rank_worker: Annotated[str, Flag(_SU, env="WAN_S2V_RANK_WORKER", metavar="MODULE", cli=False)] = Field(
        DEFAULT_WORKER, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
        description="module whose rank_main(spec_path) each rank runs (a custom rank body; the tests' "
                    "fault-injecting and engine-free workers)")

    @model_validator(mode="after")
    def _group_rules(self) -> "GroupSpec":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.device == "cpu" and self.attention in ("fa2", "fa3", "fa4"):
            raise ValueError(f"--attention {self.attention} needs CUDA; use --attention sdpa (or auto) "
                             "with --device cpu")
        limits = [x for x in (self.watchdog_load_s, self.watchdog_step_s) if x > 0]
        if limits and self.pg_timeout_s <= max(limits):
            raise ValueError(f"pg_timeout_s ({self.pg_timeout_s:g}) must exceed the watchdog limits "
                             f"({max(limits):g}) so the watchdog reports a hang before the collective times out")
        if self.cfg_parallel and self.world_size % 2:
            raise ValueError(f"--cfg-parallel splits the ranks in two: the world size must be even "
                             f"(got {self.world_size})")
        if (self.load_waves or 1) > 1 and self.load is LoadStrategy.FULL:
            raise ValueError("--load-waves reads weights in turns under lean loading; drop it or --load full")
        if self.dit_quant is not DitQuant.NONE:
            for given, why in ((self.load is LoadStrategy.FULL, "--load full (quantizing happens as lean loading "
                                "reads the weights)"),
                               (self.compile and self.layout.dit_fsdp, f"--compile in {self.mode.value} mode (the "
                                "fp8 weights are FSDP units of their own, which a compiled block cannot call); "
                                "use --mode ulysses")):
                if given:
                    raise ValueError(f"--dit-quant {self.dit_quant.value} cannot be combined with {why}; drop one")
        if self.mode is Mode.LIVE:
            from wan_s2v_runner.shared.live_recipe import stage_problem
            problem = stage_problem(self.world_size)
            for given, why in ((problem, problem),
                               (self.cfg_parallel, "--mode live runs without CFG (its distilled recipe): drop "
                                "--cfg-parallel"),
                               (self.compile, "--mode live does not compile its cached attention yet: drop "
                                "--compile")):
                if given:
                    raise ValueError(why)
        if self.t5_cpu and self.layout.t5_fsdp:
            raise ValueError(f"--t5-cpu keeps T5 whole on the CPU; --mode {self.mode.value} shards it over the "
                             "GPUs: drop one (--mode hybrid keeps T5 on the CPU)")
        if self.t5_file is not None and self.load is LoadStrategy.FULL:
            raise ValueError("--t5-file is read by lean loading; drop --load full")
        if self.fp32_blocks and self.dtype is not ComputeDtype.FP16:
            raise ValueError("--fp32-blocks computes some of the DiT's blocks in fp32 under --dtype fp16; "
                             "add --dtype fp16 or drop --fp32-blocks")
        if self.fp8_matmul is not Fp8Matmul.DEQUANT and self.dit_quant is not DitQuant.FP8:
            raise ValueError(f"--fp8-matmul {self.fp8_matmul.value} is how --dit-quant fp8's Linears multiply; "
                             "add --dit-quant fp8 or drop --fp8-matmul")
        if self.dit_offload is DitOffload.BLOCKS:
            for given, why in ((self.layout.dit_fsdp, f"--mode {self.mode.value}: each rank already holds 1/N "
                                "of the DiT and gathers every block when it runs (FSDP's own streaming, over "
                                "the network); stream a replicated DiT with --mode ulysses (any degree)"),
                               (self.load is LoadStrategy.FULL, "--load full (lean loading reads the blocks into "
                                "host memory)")):
                if given:
                    raise ValueError(f"--dit-offload blocks cannot be combined with {why}")
        elif self.resident_blocks is not None:
            raise ValueError("--resident-blocks says how many blocks stay on the GPU while the rest stream; "
                             "add --dit-offload blocks or drop it")
        elif self.dit_stream_from is StreamSource.PAGE_CACHE:
            raise ValueError("--dit-stream-from page-cache is where a streamed DiT's blocks are read from; "
                             "add --dit-offload blocks or drop it")
        if self.dit_file is not None and self.load is LoadStrategy.FULL:
            raise ValueError("--dit-file is read by lean loading (--load full is upstream's own reading of "
                             "CKPT_DIR); drop --load full")
        return self

    # ----- derived facts everything else asks -----
    @property
    def cpu_list(self) -> list[int]:
        """``cpus`` as CPU numbers ("0-2,5" -> [0, 1, 2, 5]; empty when not set)."""
        out: list[int] = []
        for part in (self.cpus or "").split(","):
            if part:
                lo, _, hi = part.partition("-")
                out.extend(range(int(lo), int(hi or lo) + 1))
        return sorted(set(out))

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def writes_output(self) -> bool:
        """Whether this node hosts global rank 0, which writes the mp4 and ``--frames-out``: node 0
        (several nodes use torchrun's static rendezvous, which numbers ranks in node order)."""
        return self.node_rank == 0

    def node_ranks(self, node: int) -> range:
        """Global ranks on ``node`` (node-major, as the static rendezvous numbers them)."""
        return range(node * self.nproc, (node + 1) * self.nproc)

    @property
    def other_nodes(self) -> list[int]:
        return [n for n in range(self.nnodes) if n != self.node_rank]

    @property
    def layout(self) -> Layout:
        return Layout.for_mode(self.mode, self.world_size, self.cfg_parallel, self.vae_parallel)

    @property
    def cosyvoice_paths(self) -> tuple[Path, Path]:
        """(CosyVoice code checkout, CosyVoice2 model directory), defaults under the checkpoint."""
        return (self.cosyvoice_dir or self.ckpt_dir / "CosyVoice",
                self.cosyvoice_model or self.ckpt_dir / "CosyVoice2-0.5B")

    @property
    def offload(self) -> bool:
        if self.device == "cpu":
            return False  # nothing to offload to; the engine's offload path calls torch.cuda.synchronize
        if self.dit_offload is DitOffload.BLOCKS:  # T5 leaves the GPU after encoding; the DiT is never moved whole
            return True
        return self.offload_model if self.offload_model is not None else self.world_size == 1

    @property
    def group(self) -> "GroupSpec":
        """The rank group's section alone (a :class:`RunSpec`'s group; a group spec is its own)."""
        return GroupSpec.model_validate(self.model_dump(include=set(GroupSpec.model_fields)))

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


#: the most lookahead a live job's speech features may read (a second the avatar lags the speech)
MAX_LOOKAHEAD_S = 1.0


class JobSpec(BaseModel):
    """What one video needs beyond its rank group: inputs, sampling, outputs. A batch line and a
    server submission are validated as one. Paths are absolute after validation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # ----- inputs
    image: Annotated[AbsPath, Flag(_IN, metavar="PATH")] = Field(description="reference image")
    audio: Annotated[Optional[AbsPath], Flag(_IN, metavar="PATH", default_text="required (or --tts-text)")] = Field(
        None, description="speech audio (wav, mp3, ...)")
    pose_video: Annotated[Optional[AbsPath], Flag(_IN, metavar="PATH", default_text="none")] = Field(
        None, description="pose video (e.g. DWPose renders): the body follows it while the face follows the "
                          "speech; read at the engine's 16 fps as upstream reads it, padded when shorter")
    tts_text: Annotated[Optional[str], Flag(_IN, metavar="TEXT", default_text="none")] = Field(
        None, min_length=1, description="speak this text with CosyVoice2 (instead of --audio); the speech is "
                                        "written next to the output as OUTPUT.speech.wav")
    tts_prompt_audio: Annotated[Optional[AbsPath], Flag(_IN, metavar="PATH", default_text="none")] = Field(
        None, description="the voice to speak --tts-text in (16 kHz or more, 5-15 s)")
    tts_prompt_text: Annotated[Optional[str], Flag(_IN, metavar="TEXT", default_text="none")] = Field(
        None, min_length=1, description="what --tts-prompt-audio says (zero-shot cloning; without it: "
                                        "cross-lingual)")
    session: Annotated[Optional[Pace], Flag(_IN, cli=False)] = Field(
        None, description="a live session (wan-s2v serve's /v1/videos/sessions): its speech arrives over time "
                          "through the server instead of --audio; realtime: blocks at their time, silent where "
                          "no speech arrived; speech: blocks as the speech arrives")
    prompt: Annotated[str, Flag(_IN, metavar="TEXT")] = Field(min_length=1, description="text prompt")
    negative_prompt: Annotated[str, Flag(_IN, metavar="TEXT", default_text="engine's")] = Field(
        "", description="negative prompt (empty: the engine's default)")
    # ----- sampling
    max_area: Annotated[Area, Flag(_SA, aliases=("--size",), metavar="W*H", cli_type=str,
                                   default_text="1024*704")] = Field(
        DEFAULT_MAX_AREA, gt=0,
        description="target area, WIDTH*HEIGHT or pixels; the image's aspect ratio is kept")
    infer_frames: Annotated[int, Flag(_SA, metavar="N")] = Field(
        80, gt=0, le=MAX_INFER_FRAMES, description="frames per clip (multiple of 4)")
    num_clips: Annotated[Optional[int], Flag(_SA, metavar="N", default_text="from audio")] = Field(
        None, gt=0, description="clips to generate (default: enough to cover the audio)")
    steps: Annotated[int, Flag(_SA, aliases=("--sample-steps",), metavar="N")] = Field(
        40, gt=0, le=MAX_STEPS, description="sampling steps")
    shift: Annotated[float, Flag(_SA, aliases=("--sample-shift",))] = Field(
        3.0, gt=0, le=MAX_SCALE, description="noise schedule shift")
    guide_scale: Annotated[float, Flag(_SA, aliases=("--sample-guide-scale",))] = Field(
        4.5, ge=0, le=MAX_SCALE, description="classifier-free guidance scale")
    solver: Annotated[Literal["unipc", "dpm++"], Flag(_SA)] = Field("unipc", description="sampler")
    seed: Annotated[int, Flag(_SA, metavar="N")] = Field(
        -1, ge=-1, le=MAX_SEED, description="-1 = random, chosen once by the launcher and recorded in run.json")
    speech_lookahead: Annotated[float, Flag(_SA, metavar="SECONDS")] = Field(
        SpeechWindow.lookahead_s, ge=0, le=MAX_LOOKAHEAD_S,
        description="--mode live: seconds of speech past a block its speech features read (the avatar lags "
                    "live speech by at least this; docs/live.md, streaming speech features)")
    start_from_ref: Annotated[bool, Flag(_SA)] = Field(
        False, description="use the reference image as the first frame")
    cache: Annotated[str, AfterValidator(cache_policy.canonical),  # in the type: drafts and env values check it too
                     Flag(_SA, metavar="POLICY[:THRESHOLD]", env="WAN_S2V_CACHE")] = Field(
        "off", description="step caching: off, or easycache[:THRESHOLD] (threshold "
                           f"{cache_policy.DEFAULT_THRESHOLD:g} when left out): a step whose DiT output is "
                           "predicted to change by less than THRESHOLD (relative, summed over the steps reused in "
                           "a row) reuses the last computed step's instead of running the DiT; the first steps "
                           "and the last are always computed; 0 computes every step (docs/generation.md)")
    # ----- outputs
    output: Annotated[AbsPath, Flag(_OU, aliases=("--save-file",), metavar="PATH")] = Field(
        Path("outputs/s2v.mp4"), validate_default=True,
        description="the .mp4 (written to a temporary name, renamed when complete)")
    preview: Annotated[bool, Flag(_OU)] = Field(
        False, description="also write the first frame to OUTPUT.thumbnail.jpg and say after each clip how far "
                           "the video so far is (it always grows in OUTPUT.partial.mp4, with its span of the speech, "
                           "playable at any moment; finished, it becomes OUTPUT)")
    # (the growing file itself is not optional: it is how frames leave rank 0, rank/video_writer.py)
    frames_out: Annotated[Optional[AbsPath], Flag(_OU, metavar="PATH")] = Field(
        None, description="also save the raw frames tensor (.pt), e.g. for parity checks (float32: 4 bytes per "
                          "pixel and channel, written to disk as the clips come; a resumed run's: the clips it made)")
    resume_from: Annotated[Optional[AbsPath], Flag(_OU, metavar="RUN_DIR")] = Field(
        None, description="continue that run directory's run from its last complete clip "
                          "(set by `wan-s2v resume RUN_DIR`)")

    @model_validator(mode="after")
    def _job_rules(self) -> "JobSpec":
        if self.infer_frames % 4:
            raise ValueError(f"infer_frames must be a multiple of 4 (got {self.infer_frames})")
        if self.output.suffix.lower() != ".mp4":
            raise ValueError(f"output must be an .mp4 file, got {self.output.name!r}")
        if self.session is not None:
            if self.audio is not None or self.tts_text is not None:
                raise ValueError("a live session's speech comes through the server: drop --audio/--tts-text")
        elif (self.audio is None) == (self.tts_text is None):
            raise ValueError("give the speech as --audio PATH, or as --tts-text TEXT with --tts-prompt-audio PATH "
                             f"(got {'both' if self.audio else 'neither'})")
        if self.tts_text is not None and self.tts_prompt_audio is None:
            raise ValueError("--tts-text needs --tts-prompt-audio PATH (the voice to speak it in)")
        if self.tts_text is None and (self.tts_prompt_audio or self.tts_prompt_text):
            raise ValueError("--tts-prompt-audio/--tts-prompt-text are for --tts-text; add --tts-text TEXT "
                             "or drop them")
        if self.solver == "unipc" and schedule.unipc_fails(self.steps, self.shift):
            first = schedule.unipc_timesteps(self.steps, self.shift)[0]
            raise ValueError(
                f"the unipc solver with {self.steps} steps at shift {self.shift:g} starts on timestep {first} twice "
                f"(the shift maps it {'to 0' if first == 0 else 'near 1000'}), and upstream's UniPC scheduler fails "
                f"on that at its last step. Fix: {flag_name('steps')} "
                f"{schedule.most_unipc_steps(self.shift, self.steps)} or fewer at this shift, a "
                f"{'larger' if first == 0 else 'smaller'} {flag_name('shift')} (upstream uses 3-5), or "
                f"{flag_name('solver')} dpm++")
        return self

    @property
    def speech(self) -> Optional[Path]:
        """The audio the video speaks: ``audio``, or the TTS speech written next to the output; None:
        a live session's, which arrives over time."""
        if self.session is not None:
            return None
        return self.audio if self.audio is not None else self.tts_speech_path

    @property
    def tts_speech_path(self) -> Path:
        """Where ``--tts-text``'s speech goes: OUTPUT.speech.wav beside the mp4."""
        return self.output.with_name(self.output.stem + ".speech.wav")

    def with_resolved_seed(self, rng: Optional[random.Random] = None):
        """seed -1 means random: chosen once here (launcher), recorded in the spec every rank reads."""
        if self.seed >= 0:
            return self
        return self.model_copy(update={"seed": (rng or random.SystemRandom()).randint(0, MAX_SEED)})

    @property
    def job(self) -> "JobSpec":
        """The job's section alone (a :class:`RunSpec`'s job; a job spec is its own)."""
        return JobSpec.model_validate(self.model_dump(include=set(JobSpec.model_fields)))


class RunSpec(GroupSpec, JobSpec):
    """A rank group with one job: everything ``wan-s2v run`` needs, and what a rank makes one
    video from. Its fields are the two sections' (flat: ``spec.ckpt_dir``, ``spec.image``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _across(self) -> "RunSpec":
        if self.session is not None and self.mode is not Mode.LIVE:
            raise ValueError("a live session needs a --mode live group")
        if self.mode is Mode.LIVE:
            for given, why in ((self.pose_video is not None, "--pose-video (LiveAvatar's recipe has no pose "
                                "condition)"),
                               (self.cache != cache_policy.OFF.text, "--cache (4 distilled steps: none to skip)"),
                               (self.resume_from is not None, "a resume (a live job's caches are its state: "
                                "run it again)")):
                if given:
                    raise ValueError(f"--mode live cannot be combined with {why}; drop one")
        if self.cfg_parallel and self.guide_scale <= 1:
            raise ValueError(f"--cfg-parallel with guide_scale {self.guide_scale:g}: there is no unconditional "
                             "pass to split (the engine skips it when guide_scale <= 1); drop --cfg-parallel")
        return self

    @classmethod
    def of(cls, group: GroupSpec, job: JobSpec) -> "RunSpec":
        """The spec of ``job`` made by ``group`` (validated again: the rules across the two)."""
        return cls(**group.model_dump(include=set(GroupSpec.model_fields)),
                   **job.model_dump(include=set(JobSpec.model_fields)))

    # ----- the lenient view (doctor) -----
    @classmethod
    def required_fields(cls) -> list[str]:
        return [k for k, f in cls.model_fields.items() if f.is_required()]


#: the key of ``spec.json`` beside the spec's fields that names where the group's jobs come from
#: (:mod:`wan_s2v_runner.shared.job_source`)
SPEC_KEY = "jobs_from"


def read_spec(path: Path) -> GroupSpec:
    """A run directory's ``spec.json``: a :class:`RunSpec` (a run with its one job; every run
    directory before the split) or a :class:`GroupSpec` (a batch's or a server's group)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    data.pop(SPEC_KEY, None)  # where the jobs come from, beside the spec: wan_s2v_runner.shared.job_source
    has_job = any(k in data for k in JobSpec.model_fields)
    return (RunSpec if has_job else GroupSpec).model_validate(data)


def flag_of(name: str) -> Flag:
    """The :class:`Flag` metadata of a spec field."""
    return next(m for m in RunSpec.model_fields[name].metadata if isinstance(m, Flag))


def flag_name(name: str) -> str:
    """'pg_timeout_s' -> '--pg-timeout' (the flag users type for a field)."""
    return flag_of(name).name or "--" + name.replace("_", "-")
