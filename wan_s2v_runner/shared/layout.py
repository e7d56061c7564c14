"""The parallel layout: which modes exist, what each one shards or splits, and every rule about
parallel degrees (torchtitan's ``ParallelDims`` is the model).

One :class:`Layout` is derived from a run spec (``spec.layout``) and answers every question the
rest of the house asks about the parallel plan: the Ulysses (sequence-parallel) degree, whether
the DiT/T5 are FSDP-sharded or T5 runs on the CPU, whether a degree fits the model's heads and
the DiT's token counts, which degrees would. Nothing else re-derives these rules: preflight
checks, the memory plan, the mode recommendation, failure hints and the worker all ask here.
It also builds the run's device mesh (:meth:`Layout.device_mesh`: dimensions named by
:class:`MeshAxis`, sequence parallel innermost), places a global rank on it (:meth:`Layout.coords`),
and says who does what: the encoding, text and decoding ranks, and for the live recipe's step
pipeline which ranks run which steps and so who holds a DiT (:attr:`Layout.stages`).

Adding a mode = one :class:`Mode` member + one :data:`MODES` entry (+ its ``runners/`` module).
This module imports nothing from the project; torch only inside :meth:`Layout.device_mesh` (the
launcher imports it).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Optional, Sequence

from pydantic import BaseModel, ConfigDict

#: GPU counts per node people usually have: the default candidates of :func:`valid_sp_degrees`
COMMON_GPU_COUNTS = (1, 2, 4, 8)
#: the live recipe's denoising steps (LiveAvatar's distilled 4; ``shared.live_recipe.STEPS``),
#: which its step pipeline shares over the ranks (:func:`stage_plan`)
LIVE_STEPS = 4


class Mode(str, Enum):
    """Parallel modes. Each has a :data:`MODES` entry and a runner module in ``runners/``."""

    ULYSSES = "ulysses"
    FSDP_FIXED = "fsdp-fixed"
    HYBRID = "hybrid"
    LIVE = "live"  # LiveAvatar's causal 4-step blocks, the steps pipelined over the ranks (docs/live.md)


class LoadStrategy(str, Enum):
    """How ranks get their weights (issue #9; ``wan_s2v_runner.loading.lean_load``)."""

    LEAN = "lean"  # meta models; FSDP shards read slice by slice; a replicated CPU DiT once per node
    FULL = "full"  # upstream's constructors: every rank reads every file it needs, whole


class DitQuant(str, Enum):
    """How the DiT's big Linears hold their weights (``--dit-quant``; ``patches.fp8_linear``)."""

    NONE = "none"  # the param dtype, as upstream
    FP8 = "fp8"  # float8_e4m3fn, one scale per output row, dequantized per call


class DitOffload(str, Enum):
    """Where the DiT's blocks live between uses (``--dit-offload``; ``loading.block_stream``)."""

    NONE = "none"  # on the rank's device, as upstream
    BLOCKS = "blocks"  # in host memory, each block copied to the device just before it runs


class StreamSource(str, Enum):
    """Where a streamed DiT's host bytes live (``--dit-stream-from``; ``loading.block_stream``,
    ``loading.dit_cache``; the ``auto`` rule: ``shared.stream_source``)."""

    MEMORY = "memory"  # one host buffer (the node's shared copy, or the rank's own), pinned whole
    PAGE_CACHE = "page-cache"  # a cache file on disk, memory-mapped: the kernel keeps what fits
    AUTO = "auto"  # the page cache when the whole DiT beside the rest would not fit the RAM


class Recipe(str, Enum):
    """What a mode's ranks make of a job: upstream's clips (every rank at every denoising step; the
    ``rank.clip_steps`` driver), or LiveAvatar's causal blocks with the steps pipelined over the
    ranks (``rank.block_pipeline``). Another recipe is another video, not another layout: a pool's
    identity names it, and a failure hint never offers one for the other."""

    CLIPS = "clips"
    LIVE = "live"


class MeshAxis(str, Enum):
    """The device mesh's dimensions, outermost first (:attr:`Layout.mesh_shape`'s order): the
    names the mesh is built with and its process groups are looked up by."""

    CFG = "cfg"  # the CFG branches: conditional / unconditional pass (spans nodes)
    SP = "sp"  # the Ulysses sequence-parallel ranks of one branch (consecutive ranks: one node)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ModeTraits:
    """What a mode does with the engine's parts (independent of the world size)."""

    summary: str
    sequence_parallel: bool  # Ulysses over all ranks (when there is more than one)
    dit_fsdp: bool
    t5_fsdp: bool
    t5_cpu: bool
    #: what the ranks make (:class:`Recipe`)
    recipe: "Recipe" = Recipe.CLIPS

    @property
    def step_pipeline(self) -> bool:
        """LiveAvatar's causal recipe, its denoising steps pipelined over the ranks (rank 0 decodes):
        another recipe, not another layout of the clip steps' job (never offered in its place)."""
        return self.recipe is Recipe.LIVE


MODES: dict[Mode, ModeTraits] = {
    Mode.ULYSSES: ModeTraits("sequence parallel over all ranks; each rank holds the full model",
                             sequence_parallel=True, dit_fsdp=False, t5_fsdp=False, t5_cpu=False),
    Mode.FSDP_FIXED: ModeTraits("DiT + T5 sharded with FSDP (no rank-0 broadcast; weights fingerprinted)",
                                sequence_parallel=False, dit_fsdp=True, t5_fsdp=True, t5_cpu=False),
    Mode.HYBRID: ModeTraits("Ulysses + FSDP DiT, T5 on CPU (lowest GPU memory)",
                            sequence_parallel=True, dit_fsdp=True, t5_fsdp=False, t5_cpu=True),
    Mode.LIVE: ModeTraits("live: causal 4-step blocks, one rank per denoising step (+ a decoding rank) or the "
                          "steps shared; each DiT rank holds the full model", sequence_parallel=False,
                          dit_fsdp=False, t5_fsdp=False, t5_cpu=False, recipe=Recipe.LIVE),
}


# --------------------------------------------------------------------------- the one rule
def split_evenly(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` ranks as evenly as possible, the larger shares first
    (40 heads on 3 ranks: [14, 13, 13]). How Ulysses splits the attention heads."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def padded_length(length: int, degree: int) -> int:
    """The sequence length after padding to a multiple of the Ulysses degree (every rank then
    holds ``padded_length // degree`` tokens; the padding is never attended to)."""
    return -(-length // degree) * degree


def sp_degree_fits(degree: int, heads: int, lengths: Iterable[int]) -> bool:
    """Our Ulysses (``patches.ulysses_sp``) splits the heads unevenly and pads the token sequence
    to a multiple of the degree, so any degree works that gives every rank at least one head
    and is no larger than the shortest sequence (past that, ranks would hold only padding)."""
    return 1 <= degree <= heads and all(n >= degree for n in lengths)


def valid_sp_degrees(heads: int, lengths: Sequence[int],
                     candidates: Iterable[int] = COMMON_GPU_COUNTS) -> list[int]:
    """The candidate degrees (default: common GPU counts) that :func:`sp_degree_fits`."""
    return [d for d in candidates if sp_degree_fits(d, heads, lengths)]


class Layout(BaseModel):
    """What a mode means for the engine at a world size: derived from the spec, never set by
    hand (:meth:`for_mode`). Validity against a model and a size is a question asked of it
    (:meth:`problems`), not a construction error: the doctor reports it with a fix."""

    model_config = ConfigDict(frozen=True)

    world_size: int
    use_sp: bool  # Ulysses sequence parallel inside each CFG group
    dit_fsdp: bool
    t5_fsdp: bool
    t5_cpu: bool
    mode: Optional[Mode] = None
    cfg_degree: int = 1  # 2: the conditional and unconditional DiT passes run on different ranks
    vae_parallel: bool = False  # the VAE's encodes and decodes split by rows over all ranks

    @classmethod
    def for_mode(cls, mode: Mode, world_size: int, cfg_parallel: bool = False,
                 vae_parallel: Optional[bool] = None) -> "Layout":
        """``vae_parallel`` None: on whenever there is more than one rank."""
        t = MODES[Mode(mode)]
        cfg = 2 if cfg_parallel else 1
        vae = world_size > 1 if vae_parallel is None else (vae_parallel and world_size > 1)
        if t.step_pipeline:  # rank 0 decodes each block as it comes (the other ranks denoise)
            vae = False
        # one rank per branch: the plain engine path (upstream's ulysses_size=1), no SP machinery
        return cls(world_size=world_size, use_sp=t.sequence_parallel and world_size // cfg > 1,
                   dit_fsdp=t.dit_fsdp, t5_fsdp=t.t5_fsdp, t5_cpu=t.t5_cpu, mode=Mode(mode), cfg_degree=cfg,
                   vae_parallel=vae)

    def splits_vae(self, frame_height: int) -> bool:
        """Whether the VAE work of frames this tall is split: one band of latent rows (8 pixel
        rows each) per rank needs at least as many latent rows as ranks; else rank 0 runs it."""
        return self.vae_parallel and 1 < self.world_size <= frame_height // 8

    # ----- who does what -----
    @property
    def recipe(self) -> Recipe:
        return MODES[self.mode].recipe if self.mode is not None else Recipe.CLIPS

    @property
    def encoding_rank(self) -> int:
        """The rank that encodes the speech and the reference (and broadcasts them)."""
        return 0

    @property
    def decoding_rank(self) -> int:
        """The rank that decodes each clip or block whole and writes the video."""
        return 0

    @property
    def stages(self):
        """The live recipe's step pipeline (:class:`StagePlan`: which rank runs which
        denoising steps; the decoding rank of a 5-rank pipeline runs none), or None: every rank runs
        every step (the clip recipe), or this world size cannot run it (``stage_problem`` says why)."""
        if self.recipe is not Recipe.LIVE:
            return None
        return stage_plan(self.world_size)

    def holds_dit(self, rank: int) -> bool:
        """Whether ``rank`` loads and runs a DiT (every rank but a step pipeline's decoding rank
        that runs no step)."""
        stages = self.stages
        return stages is None or bool(stages.steps_of(rank))

    # ----- degrees -----
    @property
    def group_size(self) -> int:
        """Ranks per CFG branch (the whole world without CFG-parallel)."""
        return max(1, self.world_size // self.cfg_degree)

    @property
    def sp_degree(self) -> int:
        """Ulysses degree: the ranks of a CFG branch when sequence parallel, else 1."""
        return self.group_size if self.use_sp else 1

    # ----- the device mesh -----
    @property
    def mesh_shape(self) -> tuple[int, int]:
        """Ranks along each :class:`MeshAxis` (cfg, sp), the sequence-parallel dimension innermost:
        an SP group is consecutive ranks (one node), so CFG groups are what spans nodes."""
        return self.cfg_degree, self.group_size

    def coords(self, rank: int) -> tuple[int, int]:
        """A global rank's place on the mesh, in :class:`MeshAxis` order: (cfg_rank, sp_rank).
        cfg_rank 0 runs the conditional branch, 1 the unconditional one."""
        if not 0 <= rank < max(1, self.world_size):
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return divmod(rank, self.group_size)

    def device_mesh(self, device_type: str):
        """The run's ``DeviceMesh`` of :attr:`mesh_shape`, its dimensions named by :class:`MeshAxis`
        (``mesh.get_group(MeshAxis.SP)``). Collective: every rank of the initialized default
        process group calls it."""
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=tuple(MeshAxis))

    @property
    def ulysses_degree(self) -> int:  # the name the manifest and docs use
        return self.sp_degree

    @property
    def shards_weights(self) -> bool:
        return self.dit_fsdp or self.t5_fsdp

    @property
    def text_rank(self) -> Optional[int]:
        """The rank that encodes the prompts and broadcasts the contexts: the last one, so that with
        more than one rank T5 runs while rank 0 encodes the speech (and, unsplit, the reference);
        rank 0 alone; None when T5 is FSDP-sharded (every rank takes part)."""
        return None if self.t5_fsdp else max(1, self.world_size) - 1

    @property
    def t5_placement(self) -> str:
        """'cpu', 'fsdp' or 'gpu' (on the rank's device)."""
        return "cpu" if self.t5_cpu else ("fsdp" if self.t5_fsdp else "gpu")

    def head_split(self, heads: int) -> list[int]:
        """Attention heads per rank of an SP group (rank order)."""
        return split_evenly(heads, self.sp_degree)

    def heads_per_rank(self, heads: int) -> int:
        """The most heads any rank attends (the rank that sets the pace)."""
        return max(self.head_split(heads))

    def padding(self, length: int) -> int:
        """Padding tokens added to a ``length``-token sequence (0 without SP or when it divides)."""
        return padded_length(length, self.sp_degree) - length

    def padding_overhead(self, lengths: Sequence[int]) -> float:
        """Largest share of padding tokens over the sequences (0.0 = none)."""
        return max((self.padding(n) / n for n in lengths if n), default=0.0)

    # ----- validity -----
    def splits_heads(self, heads: int) -> bool:
        """Every rank of an SP group gets at least one head (the split need not be even)."""
        return sp_degree_fits(self.sp_degree, heads, ())

    def bad_lengths(self, lengths: Iterable[int]) -> list[int]:
        """Sequences shorter than the degree (some ranks would hold only padding)."""
        return [n for n in lengths if n < self.sp_degree]

    def padded_lengths(self, lengths: Iterable[int]) -> list[int]:
        """Sequences the degree does not divide (they run padded: :meth:`padding`)."""
        return [n for n in lengths if self.padding(n)]

    def fits(self, heads: int, lengths: Sequence[int]) -> bool:
        return sp_degree_fits(self.sp_degree, heads, lengths)

    def problems(self, heads: int, lengths: Sequence[int]) -> list[str]:
        """Why this layout cannot run the model at this size (empty when it can)."""
        out = []
        if self.cfg_degree > 1 and self.world_size % self.cfg_degree:
            out.append(f"--cfg-parallel needs an even world size (got {self.world_size})")
        if self.t5_cpu and self.t5_fsdp:
            out.append("T5 on CPU together with T5 FSDP: the engine accepts it but it is unsupported")
        if not self.splits_heads(heads):
            out.append(f"Ulysses degree {self.sp_degree} exceeds the {heads} attention heads "
                       "(every rank needs at least one)")
        elif self.bad_lengths(lengths):
            out.append(f"Ulysses degree {self.sp_degree} exceeds the {min(self.bad_lengths(lengths))}-token "
                       "sequence (ranks would hold only padding)")
        return out

    def to_json(self) -> dict:
        return {**self.model_dump(mode="json"), "ulysses_degree": self.ulysses_degree}


def dit_load_overlap(layout: Layout, device: str, load: LoadStrategy) -> tuple[bool, str]:
    """Whether every rank reads its DiT on a thread of its own while the first job's encoders run
    (prompts, speech, reference: ``loading.components``), joined before the first denoising step;
    and why, or why not. Said by the plan: the preflight's ``memory.plan`` line and each rank's
    ``plan`` event (``run.json``)."""
    if LoadStrategy(load) is not LoadStrategy.LEAN:
        return False, "before the encoders: --load full builds it with upstream's constructors"
    if layout.dit_fsdp:
        return False, ("before the encoders: an FSDP-sharded DiT is wrapped and checked on the layout's "
                       "process groups, which the encoders' broadcasts use too")
    if device != "cpu":
        return False, ("before the encoders: on a GPU the encoders take ~5 s, so the overlap saved 3.2 of 47.7 s "
                       "to the first step and reserved 0.9 GiB more (docs/gpu.md)")
    return True, ("while the encoders run (a thread of its own, its collectives on a process group of "
                  "its own; no more memory: the DiT was held while encoding before too)")


# --------------------------------------------------------------------------- the step pipeline
@dataclass(frozen=True)
class StagePlan:
    """Which rank runs which denoising steps, and who decodes (rank 0 always)."""

    world_size: int
    steps: int
    #: per rank: the steps it runs (empty: the decoding rank of a ``steps + 1`` pipeline)
    rank_steps: tuple[tuple[int, ...], ...]

    @property
    def dit_ranks(self) -> list[int]:
        return [r for r, s in enumerate(self.rank_steps) if s]

    def steps_of(self, rank: int) -> tuple[int, ...]:
        return self.rank_steps[rank]

    def rank_of_step(self, step: int) -> int:
        return next(r for r, s in enumerate(self.rank_steps) if step in s)

    @property
    def decoder_runs_dit(self) -> bool:
        return bool(self.rank_steps[0])

    def describe(self) -> str:
        parts = [f"rank {r}: " + (("steps " + ",".join(str(s + 1) for s in st)) if st else "decode")
                 + (" + decode" if r == 0 and st else "") for r, st in enumerate(self.rank_steps)]
        return "; ".join(parts)


def supported_world_sizes(steps: int = LIVE_STEPS) -> list[int]:
    """Rank counts the step pipeline runs on: the divisors of the step count, and one more than it."""
    return sorted({d for d in range(1, steps + 1) if steps % d == 0} | {steps + 1})


def stage_plan(world_size: int, steps: int = LIVE_STEPS) -> Optional[StagePlan]:
    """The stages of ``world_size`` ranks, or None where that count is not supported
    (:func:`stage_problem` says the fix)."""
    if world_size == steps + 1:  # LiveAvatar's: a decoding rank, then one rank per step
        return StagePlan(world_size, steps, ((),) + tuple((s,) for s in range(steps)))
    if world_size >= 1 and steps % world_size == 0:
        per = steps // world_size
        return StagePlan(world_size, steps, tuple(tuple(range(r * per, (r + 1) * per)) for r in range(world_size)))
    return None


def stage_problem(world_size: int, steps: int = LIVE_STEPS) -> Optional[str]:
    """Why ``world_size`` ranks cannot run the live step pipeline, with the fix (None: they can)."""
    if stage_plan(world_size, steps) is not None:
        return None
    ok = supported_world_sizes(steps)
    return (f"--mode live runs its {steps} steps on {', '.join(map(str, ok[:-1]))} or {ok[-1]} ranks "
            f"(one rank per step and a decoding rank, or the steps shared evenly), not {world_size}. "
            f"Fix: --nproc {max(d for d in ok if d <= world_size) if any(d <= world_size for d in ok) else 1}")
