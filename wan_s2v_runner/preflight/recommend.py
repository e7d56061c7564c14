"""Which mode to use on this machine, and why (``--mode auto`` and ``wan-s2v doctor``).

Rules, in order (each reason names the fact that decided):
1. no CUDA GPU / ``--device cpu`` -> ``ulysses`` on CPU ranks with gloo: a demo, not the 14B model;
2. a world size Ulysses cannot split (more ranks than attention heads or tokens: 41+ ranks for
   the real model; any count up to that works, heads split unevenly, tokens padded) ->
   ``fsdp-fixed`` (memory relief, no speed-up);
3. the full model fits on each GPU (memory plan vs free memory) -> ``ulysses`` (fastest: only
   activations move, the sequence is split); on PCIe without P2P the reason says that the
   all-to-all crosses host memory, since FSDP modes would move the weights over the same link;
4. otherwise, where ``hybrid`` (DiT sharded, T5 on CPU) fits -> ``hybrid``;
5. otherwise, where the DiT streamed from host memory fits (``--dit-offload blocks``: ulysses,
   the same frames, the copies hidden behind the compute; :mod:`wan_s2v_runner.loading.block_stream`)
   -> ``ulysses`` with streaming, said so; never when a resident layout fits. Where its bytes live
   (memory, or the page cache), whether the encoders are released and whether T5 encodes on the
   CPU (where the GPU cannot hold it while it encodes: a 12 GB card) are the plan's
   (:func:`.memory.settle_plan`: the rank's rules), and the reason says what it settled;
6. otherwise -> ``hybrid``, with a warning that nothing fits: more GPUs only where the machine has
   them; one GPU: ``ulysses`` streamed with the largest ``--size`` that fits so, or what sets the
   floor where none does.

Below compute capability 8.0 the reason adds what ``--dtype auto`` computes in (fp16).

Then the plan for that mode at this world size (:mod:`wan_s2v_runner.preflight.plans`): the fastest split
of the ranks into CFG branches x Ulysses degree, explained (heads per rank, padding, whether CFG
is split); ``--mode auto`` applies its ``--cfg-parallel`` unless the flag was given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from wan_s2v_runner.shared.job_time import cfg_on
from wan_s2v_runner.shared.layout import DitOffload, Mode, valid_sp_degrees
from wan_s2v_runner.shared.spec import RunSpec, parse_size

from .context import CheckContext
from .core import gib
from .facts import MachineFacts
from .memory import (
    GPU_FILL,
    compute_dtype,
    dit_dims,
    free_gpu_bytes,
    largest_fitting,
    largest_fitting_size,
    model_sizes,
    plan_all,
    settle_plan,
    streamed_plan,
    t5_words,
    workload,
)
from .plans import Plan, candidates, plans_for


@dataclass(frozen=True)
class Recommendation:
    mode: Mode
    reason: str
    plan: Optional[Plan] = None  # the fastest split of the ranks for that mode
    dit_offload: DitOffload = DitOffload.NONE  # blocks: only a streamed DiT fits (rule 5)

    @property
    def cfg_parallel(self) -> bool:
        return bool(self.plan and self.plan.valid and self.plan.layout.cfg_degree > 1)

    @property
    def text(self) -> str:
        """The reason, then the plan."""
        if self.plan is None or not self.plan.valid or self.plan.layout.world_size == 1:
            return self.reason
        return f"{self.reason}. Plan: {self.plan.describe()}"

    def to_json(self) -> dict:
        return {"mode": self.mode.value, "reason": self.reason, "cfg_parallel": self.cfg_parallel,
                "dit_offload": self.dit_offload.value, "plan": self.plan.to_json() if self.plan else None,
                "text": self.text}

    def updates(self, given: dict) -> dict:
        """The spec fields ``--mode auto`` sets: the mode, and the plan's CFG split and streaming
        unless ``given`` (the user's values) names them."""
        out: dict = {"mode": self.mode}
        if "cfg_parallel" not in given:
            out["cfg_parallel"] = self.cfg_parallel
        if "dit_offload" not in given and self.dit_offload is DitOffload.BLOCKS:
            out["dit_offload"] = self.dit_offload
        return out

    def flags(self, cfg_parallel: bool) -> str:
        """What auto chose, as flags (``--mode auto: ulysses --dit-offload blocks``)."""
        return (f"{self.mode.value}{' --cfg-parallel' if cfg_parallel else ''}"
                f"{' --dit-offload blocks' if self.dit_offload is DitOffload.BLOCKS else ''}")


def _ensure_image_size(ctx: CheckContext) -> None:
    if "image_size" in ctx.cache or ctx.spec.image is None:
        return
    try:
        from PIL import Image
        with Image.open(ctx.spec.image) as im:
            ctx.cache["image_size"] = im.size
    except Exception:  # noqa: BLE001 - the inputs checks report it
        pass


def _link_summary(ctx) -> tuple[bool, str]:
    """(fast, description) of the interconnect between the GPUs the ranks use."""
    f = ctx.facts
    n = min(ctx.spec.nproc, f.gpu_count)
    if ctx.spec.nnodes > 1:
        return False, f"{ctx.spec.nnodes} nodes: collectives cross the network"
    if n < 2:
        return True, "one GPU"
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if all(f.nvlink(i, j) for i, j in pairs):
        return True, f"NVLink between all pairs ({f.link(0, 1)})"
    if all(f.nvlink(i, j) or f.p2p(i, j) for i, j in pairs):
        return True, "PCIe P2P between all pairs (no NVLink)"
    slow = next((i, j) for i, j in pairs if not (f.nvlink(i, j) or f.p2p(i, j)))
    return False, (f"PCIe without P2P (GPU {slow[0]}-{slow[1]}: {f.link(*slow) or '?'}): "
                   "all-to-all crosses host memory")


def recommend(ctx: CheckContext) -> Recommendation:
    """The mode (rules in the module docstring) and its fastest plan at this world size that
    fits the GPUs' free memory (the CFG split keeps a whole branch's tokens on each rank, so it
    can need more activation memory than the plain split it ties with)."""
    rec = _recommend_mode(ctx)
    sizes, wl = model_sizes(ctx), workload(ctx)
    plans = plans_for(rec.mode, ctx.layout.world_size, **plan_inputs(ctx))
    free = free_gpu_bytes(ctx)
    streams = rec.dit_offload is DitOffload.BLOCKS or ctx.spec.dit_offload is DitOffload.BLOCKS
    if free and ctx.spec.device != "cpu":
        def peak(p: Plan) -> Optional[int]:  # as the run settles it (the encoders released where that fits)
            return settle_plan(ctx, p.layout, sizes, wl, 0 if streams and not p.layout.dit_fsdp else None).gpu_peak
        peaks = [(p, peak(p)) for p in plans]
        # the fastest that is not tight, else the fastest that fits at all
        plans = ([p for p, need in peaks if not need or need <= GPU_FILL * free]
                 or [p for p, need in peaks if not need or need <= free] or plans)
    return Recommendation(rec.mode, rec.reason, plans[0], rec.dit_offload)




def heads_of(ctx, sizes) -> int:
    """The DiT's attention heads: config.json (read by the checkpoint checks), else the sizes
    read from the checkpoint, else the 14B model's 40."""
    return ctx.cache.get("num_heads") or dit_dims(sizes).num_heads


def plan_inputs(ctx) -> dict:
    """What :mod:`wan_s2v_runner.preflight.plans` judges a plan by, for this context: the model's heads
    and widths (the 14B's where the checkpoint gives none), the DiT's sequence lengths (clip 1
    and later clips), and whether there is an unconditional pass to split off."""
    sizes, wl = model_sizes(ctx), workload(ctx)
    dims = dit_dims(sizes)
    return dict(heads=heads_of(ctx, sizes), dim=dims.dim, ffn_dim=dims.ffn_dim,
                lengths=wl.tokens.lengths(2, ctx.spec.start_from_ref), cfg_possible=cfg_on(ctx.spec.guide_scale))


def _recommend_mode(ctx: CheckContext) -> Recommendation:
    f = ctx.facts
    ws = ctx.layout.world_size
    _ensure_image_size(ctx)
    sizes, wl = model_sizes(ctx), workload(ctx)
    heads = heads_of(ctx, sizes)
    lengths = wl.tokens.lengths(2, ctx.spec.start_from_ref)
    sp_layouts = candidates(Mode.ULYSSES, ws, cfg_possible=cfg_on(ctx.spec.guide_scale))  # with/without CFG split
    sp_ok = any(not lay.problems(heads, lengths) for lay in sp_layouts)
    sp_why = "; ".join(sp_layouts[0].problems(heads, lengths))
    good_ws = valid_sp_degrees(heads, lengths, range(min(ws - 1, heads), 1, -1))[:1]  # the most that split

    if ctx.spec.device == "cpu" or f.gpu_count == 0:
        why = "--device cpu" if f.gpu_count else f"no CUDA GPU visible (torch {f.torch.get('version')})"
        if not sp_ok:
            return Recommendation(Mode.FSDP_FIXED, f"{why}; {sp_why}, so Ulysses cannot split it: fsdp-fixed "
                                  "on CPU ranks (gloo) — a demo for tiny checkpoints only")
        real = sizes.dit_params > 1e9
        tail = (f"; the {sizes.dit_params / 1e9:.3g}B-param DiT in fp32 needs ~{gib(sizes.dit_params * 4)} "
                "RAM per rank and hours per step" if real else "")
        return Recommendation(Mode.ULYSSES, f"{why}: ulysses on {ws} CPU rank{'s' if ws > 1 else ''} with "
                              f"gloo — a demo for the tiny checkpoint, not for real generation{tail}")

    asked = ctx.spec.dit_offload is DitOffload.BLOCKS  # --dit-offload blocks given: ulysses' plan streams
    plans = plan_all(ctx)
    gpus = [g for g in ctx.local_gpus if g.get("free_mib") is not None] or f.gpus
    free = free_gpu_bytes(ctx)
    name = gpus[0].get("name", "GPU")
    avail = f.host_available_bytes()

    def fits(m: Mode) -> bool:
        p = plans[m.value]
        return bool(p.gpu_peak) and p.gpu_peak <= free and (avail is None or p.host_node_total <= avail)

    def est(m: Mode) -> str:
        p = plans[m.value].gpu_peak
        return gib(p) + (" — tight" if p and GPU_FILL * free < p <= free else "")

    def stream_rec(why: str) -> Optional[Recommendation]:
        """Rule 5: ulysses with the DiT streamed, where it fits and nothing resident did (not when the
        user set --dit-offload, nor under --load full, which cannot stream)."""
        streamed = None if ctx.dit_offload_given else streamed_plan(ctx)
        if streamed is None or streamed.stream is None or not (streamed.gpu_peak and streamed.gpu_peak <= free
                and (avail is None or streamed.host_node_total <= avail)):
            return None
        return Recommendation(Mode.ULYSSES, f"{pre}{why}; {streamed_words(ctx, streamed)}: ulysses{dtype_note}",
                              dit_offload=DitOffload.BLOCKS)

    def streamed_size() -> tuple[str, str]:
        """Where nothing fits at this size: the largest that fits streamed ('' if none, or streaming
        is not this run's to choose), and T5's place there where the plan settles it (:func:`t5_words`)."""
        if ctx.dit_offload_given or streamed_plan(ctx) is None:
            return "", ""
        size, plan = largest_fitting(ctx, Mode.ULYSSES, int(GPU_FILL * free), streamed=True)
        return size, t5_words(plan)

    held = " with its blocks streamed from host memory (--dit-offload blocks)" if asked else ""
    fast, link = _link_summary(ctx)
    dtype, dtype_why = compute_dtype(ctx)
    dtype_note = f"; computes in {dtype_why}" if dtype.value != "bf16" else ""
    spare = f.gpu_count > ws or ctx.spec.nnodes > 1  # GPUs this run leaves unused: "more GPUs" is a fix
    if ctx.spec.nproc > f.gpu_count:
        pre = f"--nproc {ctx.spec.nproc} > {f.gpu_count} visible GPUs (fix that first); "
    else:
        pre = ""
    if not sp_ok:
        alt = f"; {good_ws[-1]} GPUs with ulysses/hybrid would be faster" if good_ws else ""
        fit = "" if fits(Mode.FSDP_FIXED) else f" (est. {est(Mode.FSDP_FIXED)}/rank does not fit {gib(free)} free)"
        return Recommendation(Mode.FSDP_FIXED, f"{pre}{sp_why}, so Ulysses (ulysses/hybrid) is impossible; "
                              f"fsdp-fixed runs on any GPU count but every rank computes the whole "
                              f"sequence (memory relief, no speed-up){fit}{alt}")
    if ws == 1:
        if fits(Mode.ULYSSES):
            return Recommendation(Mode.ULYSSES, f"{pre}1 GPU ({name}, {gib(free)} free) holds the whole model"
                                  f"{held} (est. {est(Mode.ULYSSES)} peak with offload): ulysses on one rank"
                                  f"{dtype_note}",
                                  dit_offload=ctx.spec.dit_offload)
        if fits(Mode.HYBRID):
            return Recommendation(Mode.HYBRID, f"{pre}1 GPU with {gib(free)} free: the full model with T5 "
                                  f"on the GPU needs est. {est(Mode.ULYSSES)}; hybrid keeps T5 on the CPU "
                                  f"(est. {est(Mode.HYBRID)})" + (". Better: 2+ GPUs with hybrid" if spare else ""))
        rec = stream_rec(f"1 GPU ({name}, {gib(free)} free) cannot hold the resident model (est. "
                         f"{est(Mode.HYBRID)} even with T5 on the CPU)")
        if rec is not None:
            return rec
        cannot = (f"{pre}1 GPU with {gib(free)} free cannot hold the {sizes.dit_params / 1e9:.3g}B-param DiT at "
                  f"{wl.width}x{wl.height} (est. {est(Mode.HYBRID)} even with T5 on CPU")
        streamed = None if ctx.dit_offload_given else streamed_plan(ctx)
        if streamed is not None and streamed.gpu_peak:
            size, t5 = streamed_size()
            from .checks_memory import no_size_words
            fix = (f"--size {size} fits with its blocks streamed (--dit-offload blocks){t5}" if size else
                   no_size_words(ctx, free))
            return Recommendation(Mode.ULYSSES, f"{cannot}; {gib(streamed.gpu_peak)} with its blocks streamed): "
                                  f"{fix}" + ("; or 2+ GPUs with hybrid" if spare else "") + dtype_note,
                                  dit_offload=DitOffload.BLOCKS)
        return Recommendation(Mode.HYBRID, f"{cannot}): "
                              + ("use 2 or more GPUs with hybrid" if spare else
                                 "a smaller --size, or --dit-offload blocks (its blocks streamed)"))
    if fits(Mode.ULYSSES):
        if fast:
            return Recommendation(Mode.ULYSSES, f"{pre}{ws} GPUs ({name}) with {link} each hold the full model"
                                  f"{held} (est. {est(Mode.ULYSSES)} of {gib(free)} free per rank): ulysses is "
                                  f"fastest (sequence split, no weight traffic){dtype_note}",
                                  dit_offload=ctx.spec.dit_offload)
        return Recommendation(Mode.ULYSSES, f"{pre}{ws} GPUs ({name}) each hold the full model{held} (est. "
                              f"{est(Mode.ULYSSES)} of {gib(free)} free) but {link}: scaling will be sub-linear; "
                              f"still ulysses, as FSDP modes would move the weights over the same link{dtype_note}",
                              dit_offload=ctx.spec.dit_offload)
    if fits(Mode.HYBRID):
        pcie = "" if fast else f"; {link}, so expect sub-linear scaling"
        return Recommendation(Mode.HYBRID, f"{pre}the full model does not fit per GPU (est. {est(Mode.ULYSSES)} "
                              f"> {gib(free)} free on {name}): hybrid shards the DiT over {ws} ranks and keeps "
                              f"T5 on the CPU (est. {est(Mode.HYBRID)}/rank){pcie}{dtype_note}")
    rec = stream_rec(f"the resident model fits on none of the {ws} GPUs ({name}, {gib(free)} free; hybrid needs "
                     f"est. {est(Mode.HYBRID)}/rank)" + ("" if fast else f"; {link}"))
    if rec is not None:
        return rec
    more = valid_sp_degrees(heads, lengths, [2 * ws])  # hybrid shards the DiT over more ranks
    more = [m for m in more if m <= f.gpu_count or ctx.spec.nnodes > 1]  # never more GPUs than the machine has
    size, (streamed_at, t5) = largest_fitting_size(ctx, Mode.HYBRID, free), streamed_size()
    nothing = (f"{pre}nothing fits in {gib(free)} free per GPU ({name}): even hybrid needs est. "
               f"{est(Mode.HYBRID)}/rank at {wl.width}x{wl.height}" + (f"; use {more[0]} GPUs or" if more else ";"))
    if streamed_at and (not size or parse_size(streamed_at) > parse_size(size)):  # larger streamed than resident
        return Recommendation(Mode.ULYSSES, f"{nothing} --size {streamed_at} fits with the DiT's blocks streamed "
                              f"(--dit-offload blocks){t5}{dtype_note}", dit_offload=DitOffload.BLOCKS)
    return Recommendation(Mode.HYBRID, nothing + (f" --size {size}" if size else " a smaller --size") + dtype_note)


def recommend_mode(spec_or_ctx: Union[RunSpec, CheckContext, None] = None,
                   facts: Optional[MachineFacts] = None, dit_offload_given: bool = False) -> Recommendation:
    """Recommend a mode for a RunSpec or CheckContext (live facts unless ``facts`` is given;
    ``dit_offload_given``: a RunSpec whose --dit-offload the user set)."""
    if isinstance(spec_or_ctx, CheckContext):
        ctx = spec_or_ctx
        if facts is not None:
            ctx.facts = facts
    elif isinstance(spec_or_ctx, RunSpec):
        ctx = CheckContext.for_spec(spec_or_ctx, facts)
        ctx.dit_offload_given = dit_offload_given
    else:
        ctx = CheckContext.for_values({}, facts)
    return recommend(ctx)


def streamed_words(ctx, plan) -> str:
    """How a streamed plan fits, in the words of a recommendation: where its bytes live (memory or
    the page cache, and why), whether the encoders are released and T5 encodes on the CPU, and fp8
    where the disk, not the compute, would set the pace (never chosen for the user: it changes the
    frames)."""
    s = plan.stream or {}
    if s.get("source") == "page-cache":
        where = "from the page cache"
        flags = "--dit-offload blocks; --dit-stream-from auto takes the page cache"
        held = (f"the DiT's {gib(s.get('file_bytes', 0))} in a file on disk, memory-mapped, "
                f"{gib(s.get('pinned_bytes', 0))} of staging pinned: the RAM cannot hold it beside the rest")
    else:
        where, flags = "from host memory", "--dit-offload blocks"
        held = f"{gib(s.get('pinned_bytes', 0))} pinned on the host"
    released = ("; T5 and wav2vec2 released before the DiT is read (the plan sets --release-encoders)"
                if plan.release_why.startswith("released") else "")
    if plan.t5_settled:  # the same dtype on the CPU's kernels: within float rounding of the GPU's encode
        released += "; T5 encodes on the CPU (the plan sets --t5-cpu)"
    fp8 = ""
    if s.get("source") == "page-cache" and s.get("disk_bytes_per_pass"):
        from .checks_memory import stream_timing
        gpus = [g for g in ctx.local_gpus if g.get("free_mib") is not None] or ctx.facts.gpus
        t = stream_timing(ctx, plan, min(gpus, key=lambda g: g.get("free_mib") or 0)) if gpus else None
        if t is not None and t.hidden is False:
            fp8 = ("; the disk sets the pace: --dit-quant fp8 halves the file (frames change slightly, "
                   "docs/loading.md)")
    return (f"with the DiT's blocks streamed {where} it fits ({flags}: est. {gib(plan.gpu_peak)} per rank, "
            f"{s.get('resident_blocks', 0)} blocks resident, {held}{released}; the same frames){fp8}")
