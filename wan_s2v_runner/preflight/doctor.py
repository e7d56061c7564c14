"""The preflight verdicts as data: the ``run`` gate's report and the doctor's report.

* :func:`check_run` (``run``, before anything is spawned): the check groups of the spec's mode
  against the complete spec -> :class:`GateReport` (refused when any check fails).
* :func:`diagnose` / :func:`doctor` (``wan-s2v doctor``): a lenient context (no checkpoint or
  inputs needed), the recommended mode (checked unless ``--mode`` is given), every check, the
  memory plan of each mode, the fastest parallel plan for 1..16 GPUs -> :class:`DoctorReport`.
  ``WAN_S2V_FACTS=machine.json`` makes the doctor judge recorded facts instead of this machine.

Both reports have ``to_json``; :mod:`.render` words them for a person. Nothing here parses argv
or prints.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.layout import DitOffload, StreamSource
from wan_s2v_runner.shared.precision import ComputeDtype

from .checks_cache import caches_report
from .checks_time import JobTime, job_time
from .context import CheckContext, ModeSource
from .core import CheckGroup, CheckResult, Status, counts
from .facts import MachineFacts
from .memory import ModelSizes, ModePlan, Workload, model_sizes, plan_all, streamed_plan, workload
from .plans import DEFAULT_QUEUE_DEPTH, Plan, Split, best_splits, plan_table, splits_for
from .recommend import Recommendation, plan_inputs, recommend
from .registry import groups_for, run_checks

FACTS_ENV = "WAN_S2V_FACTS"


@dataclass
class GateReport:
    """What ``run``'s preflight found for one complete spec."""

    results: list[CheckResult]
    groups: tuple[CheckGroup, ...]

    @property
    def counts(self) -> dict[str, int]:
        return counts(self.results)

    def with_status(self, status: Status) -> list[CheckResult]:
        return [r for r in self.results if r.status is status]

    @property
    def refused(self) -> bool:
        return bool(self.with_status(Status.FAIL))

    def data_of(self, check_id: str) -> dict:
        """The measured values of check ``check_id`` ({} if it did not run)."""
        return next((r.data for r in self.results if r.id == check_id), {})

    def settled(self, group) -> dict:
        """What the plan fills in that ``group`` (a GroupSpec) leaves to it: ``load_waves`` when the
        node cannot load its ranks at once, ``resident_blocks`` for a streamed DiT,
        ``release_encoders`` when the plan fits only with the encoders let go before the DiT is read,
        ``t5_cpu`` when the GPU holds the encode phase only with T5 on the CPU
        (the rank takes an unset value as False), ``dit_stream_from`` where the plan counted a
        streamed DiT's bytes (``auto`` resolved), ``dtype`` (``auto`` resolved on the oldest GPU),
        ``dit_cache_max`` in bytes where the run writes a DiT page-cache file (``output.dit_cache``: the
        budget less what would leave the disk short of the video)."""
        out = {}
        waves = self.data_of("memory.host").get("waves")
        if group.load_waves is None and waves and waves > 1:  # the memory plan's safety net
            out["load_waves"] = waves
        resident = self.data_of("memory.gpu").get("resident_blocks")
        if group.dit_offload is DitOffload.BLOCKS and group.resident_blocks is None and resident is not None:
            out["resident_blocks"] = resident
        if group.release_encoders is None and self.data_of("memory.host").get("release_encoders"):
            out["release_encoders"] = True
        if group.t5_cpu is None and self.data_of("memory.gpu").get("t5_cpu"):
            out["t5_cpu"] = True
        source = self.data_of("memory.host").get("dit_stream_from")
        if (group.dit_offload is DitOffload.BLOCKS and group.dit_stream_from is StreamSource.AUTO
                and source in (StreamSource.MEMORY.value, StreamSource.PAGE_CACHE.value)):
            out["dit_stream_from"] = StreamSource(source)  # the rank streams from where the plan counted it
        room = self.data_of("output.dit_cache").get("budget_bytes")
        if room is not None:  # the DiT cache's budget less the video's room: the rank evicts what the check listed
            out["dit_cache_max"] = str(room)
        dtype = self.data_of("gpus.bf16").get("dtype")
        if group.dtype is ComputeDtype.AUTO and dtype is not None:
            out["dtype"] = ComputeDtype(dtype)  # the oldest GPU's; the run's digest records it
        return out

    def to_json(self) -> dict:
        shown = self.with_status(Status.FAIL) + self.with_status(Status.WARN)
        return {"status": "preflight-refused" if self.refused else "preflight-passed",
                "exit_code": exit_codes.PREFLIGHT if self.refused else exit_codes.OK,
                "counts": self.counts, "results": [r.to_json() for r in shown]}


@dataclass
class DoctorReport:
    """Everything ``wan-s2v doctor`` found: checks, recommendation, memory plan."""

    ctx: CheckContext
    recommendation: Recommendation
    results: list[CheckResult]
    groups: tuple[CheckGroup, ...]
    plans: dict[str, ModePlan]
    sizes: ModelSizes
    workload: Workload
    parallel_plans: list[Plan]  # the fastest split of 1..16 GPUs for the checked mode
    splits: list[Split] = field(default_factory=list)  # the node's GPUs as 1..N groups (serve --replicas)
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    #: ulysses with the DiT streamed (--dit-offload blocks), beside the resident plans (None: the
    #: checked spec streams already, or no GPU)
    streamed: Optional[ModePlan] = None
    #: the job's denoising time on this machine (None: on the CPU, or a GPU of unknown peak)
    job_time: Optional[JobTime] = None
    #: the caches wan-s2v keeps, in sum, and their disk's free space (``checks_cache.caches_report``)
    caches: Optional[dict] = None

    @property
    def counts(self) -> dict[str, int]:
        return counts(self.results)

    @property
    def exit_code(self) -> int:
        return exit_codes.DOCTOR_FAILED if self.counts["fail"] else exit_codes.OK

    def to_json(self) -> dict:
        ctx, spec, f, wl = self.ctx, self.ctx.spec, self.ctx.facts, self.workload
        return {
            "machine": {
                "label": f.label,
                "live": f.live,
                "gpus": [g.get("name") for g in f.gpus],
                "torch": f.torch.get("version"),
                "probe_errors": f.raw.get("probe_errors") or [],
            },
            "context": {
                "mode": ctx.mode.value,
                "mode_source": ctx.mode_source.value,
                "device": spec.device,
                "nproc": spec.nproc,
                "nnodes": spec.nnodes,
                "world_size": ctx.layout.world_size,
                "attention": spec.attention,
                "layout": ctx.layout.to_json(),
                "ckpt_dir": str(spec.ckpt_dir) if spec.ckpt_dir else None,
                "image": str(spec.image) if spec.image else None,
                "audio": str(spec.audio) if spec.audio else None,
                "assumptions": ctx.notes,
                "groups": [g.value for g in self.groups],
            },
            "recommendation": self.recommendation.to_json(),
            "results": [r.to_json() for r in self.results],
            "counts": self.counts,
            "memory_plan": {
                "approximate": True,
                "formula": "docs/memory-plan.md",
                "sizes": asdict(self.sizes),
                "workload": {
                    "width": wl.width,
                    "height": wl.height,
                    "tokens": wl.tokens.max_len,
                    "clips": wl.n_clips,
                    "unit": wl.unit,
                    "audio_seconds": wl.audio_seconds,
                    "assumed": wl.assumed,
                },
                "modes": {m: p.to_json() for m, p in self.plans.items()},
                "ulysses_streamed": self.streamed.to_json() if self.streamed is not None else None,
            },
            "job_time": ({**self.job_time.to_json(), "hours": round(self.job_time.seconds / 3600, 2),
                          "estimate": "DiT passes only (wan_s2v_runner/preflight/checks_time.py)"}
                         if self.job_time is not None else None),
            "caches": self.caches,
            "parallel_plans": {
                "mode": ctx.mode.value,
                "lengths": list(self.parallel_plans[0].lengths),
                "heads": self.parallel_plans[0].heads,
                "estimate": "DiT compute per rank, communication not included (wan_s2v_runner/preflight/plans.py)",
                "by_gpu_count": [p.to_json() for p in self.parallel_plans],
            },
            "serving_splits": {
                "gpus": ctx.layout.world_size, "queue_depth": self.queue_depth,
                "estimate": "DiT compute per rank, with a sequence-parallel communication cost calibrated on "
                            "upstream's 8-GPU timing (wan_s2v_runner/preflight/plans.py: SP_COMM_COST)",
                "most_videos_per_hour": best_splits(self.splits)[0].groups if self.splits else None,
                "lowest_latency": best_splits(self.splits)[1].groups if self.splits else None,
                "splits": [s.to_json() for s in self.splits],
            },
            "exit_code": self.exit_code,
        }


def check_run(spec, facts: Optional[MachineFacts] = None, group_running: bool = False,
              served: Optional[bool] = None) -> GateReport:
    """The checks of ``spec``'s mode against the complete spec; ``group_running``: a job for a rank
    group that is up (a server's), whose start is behind it; ``served`` (default: ``group_running``):
    a group that runs several jobs (a server's, a batch's), whose released encoders are built again
    beside the DiT for a new prompt, so the plan counts them beside it."""
    ctx = CheckContext.for_spec(spec, facts)
    ctx.group_running = group_running
    ctx.served = group_running if served is None else served
    groups = groups_for(spec.mode)
    return GateReport(run_checks(ctx, groups), groups)


def group_context(group, defaults: dict, output: Optional[Path] = None,
                  facts: Optional[MachineFacts] = None, node_groups: int = 1) -> CheckContext:
    """What checks read of a rank group before any job: its settings, the jobs' defaults (a size,
    steps; inputs when the command gives defaults for them) and, with ``output``, where its
    videos go; ``node_groups`` such groups side by side on the node (``serve --replicas``).
    Checks of an input no job has given yet skip, as the doctor's do."""
    from wan_s2v_runner.shared.jobs import GROUP_FIELDS, JOB_FIELDS, OUTPUT_FIELDS

    values = {k: v for k, v in defaults.items() if k in JOB_FIELDS and k not in OUTPUT_FIELDS}
    values.update(group.model_dump(include=set(GROUP_FIELDS)))
    if output is not None:
        values["output"] = Path(output) / "group-check.mp4"
    ctx = CheckContext.for_values(values, facts if facts is not None else machine_facts())
    ctx.node_groups = node_groups
    ctx.served = True  # a server's group: new prompts build its released encoders again beside the DiT
    return ctx


def check_group(group, defaults: dict, output: Optional[Path] = None,
                facts: Optional[MachineFacts] = None, node_groups: int = 1) -> GateReport:
    """The checks of a rank group's mode before any job (:func:`group_context`)."""
    ctx = group_context(group, defaults, output, facts, node_groups)
    groups = groups_for(group.mode)
    return GateReport(run_checks(ctx, groups), groups)


def diagnose(ctx: CheckContext, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> DoctorReport:
    """Recommendation, results and memory plan for a context (the data behind doctor); the split
    table for a server of its GPUs with ``queue_depth`` jobs waiting."""
    rec = recommend(ctx)
    if ctx.mode_source is ModeSource.DEFAULT:
        ctx.with_mode(rec.mode, ModeSource.RECOMMENDED)
        if rec.dit_offload is DitOffload.BLOCKS and not ctx.dit_offload_given:  # only a streamed DiT fits
            ctx.spec = ctx.spec.model_copy(update={"dit_offload": rec.dit_offload})
            ctx.notes.append("--dit-offload blocks recommended (only a streamed DiT fits)")
    groups = groups_for(ctx.mode)
    results = run_checks(ctx, groups)
    streamed = None
    if ctx.spec.dit_offload is DitOffload.NONE and ctx.on_cuda:  # the streamed row beside the resident ones
        streamed = streamed_plan(ctx)
    return DoctorReport(ctx=ctx, recommendation=rec, results=results, groups=groups, plans=plan_all(ctx),
                        streamed=streamed,
                        sizes=model_sizes(ctx), workload=workload(ctx),
                        parallel_plans=plan_table(ctx.mode, **plan_inputs(ctx)),
                        splits=splits_for(ctx.mode, ctx.layout.world_size, queue_depth=queue_depth,
                                          **plan_inputs(ctx)),
                        queue_depth=queue_depth, job_time=job_time(ctx), caches=caches_report(ctx))


def machine_facts(env=None) -> MachineFacts:
    """Recorded facts when ``$WAN_S2V_FACTS`` names a file, else this machine's (probed)."""
    path = (os.environ if env is None else env).get(FACTS_ENV)
    if path:
        return MachineFacts.load(path)
    from .probe import probe_machine
    return probe_machine()


def doctor(values: dict, facts: Optional[MachineFacts] = None, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> DoctorReport:
    """The doctor for partial run values (environment < config < flags, already merged)."""
    return diagnose(CheckContext.for_values(values, facts if facts is not None else machine_facts()), queue_depth)
