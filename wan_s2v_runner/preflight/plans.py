"""Parallel plans for a GPU count: how the ranks split the work (CFG branches x Ulysses degree),
what each split costs, and which is fastest. The doctor's plan table and recommendation ask here.

A plan is a :class:`~wan_s2v_runner.shared.layout.Layout` judged against one model and one size:
heads per rank (Ulysses splits them as evenly as possible), the padding its degree adds to the
token sequence, and an estimated DiT speed-up over one GPU from the per-rank arithmetic:

* a DiT pass over L tokens costs, per block, work proportional to ``L (12 C^2 + 4 C F)`` (per-token
  work: self-attention q/k/v/o 8 C^2, text cross-attention q/o 4 C^2 -- its k/v are cached -- and
  the FFN 4 C F) plus ``4 L^2 C`` (attention: scores and weighted sum), C = dim, F = ffn_dim;
* a rank of a (cfg c, sp d) plan runs 2/c passes per step (CFG: conditional + unconditional;
  ``shared.job_time.step_passes``),
  each over ``ceil(L / d)`` tokens of per-token work (padding included) and the attention of
  ``max(heads per rank) / heads`` of the heads over the L real tokens;
* speed-up = one GPU's work / the busiest rank's work, on the longest sequence.

Communication is not in the number: on ties the plan with the smaller sequence-parallel group
wins (its all-to-alls move less and stay among fewer GPUs; a CFG split costs one small
all-gather per step). At 1024x704 (63,360 tokens) attention is ~68% of the 14B DiT's work, so
an uneven head split costs more than the padding (at most degree - 1 tokens).

The per-token and attention terms are :mod:`.dit_flops`'s (the whole pass's count lives there).
This module imports only :mod:`wan_s2v_runner.shared.layout`, ``shared.job_time`` and :mod:`.dit_flops`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from wan_s2v_runner.shared.job_time import step_passes
from wan_s2v_runner.shared.layout import Layout, Mode

from .dit_flops import DitDims, attention_flops, per_token_flops

#: GPU counts the doctor's plan table covers
PLAN_WORLD_SIZES = tuple(range(1, 17))


@dataclass(frozen=True)
class Plan:
    """A layout judged against one model and size; its degrees are the layout's (``plan.layout``)."""

    layout: Layout
    heads: int
    lengths: tuple[int, ...]
    speedup: float  # estimated DiT step speed-up over one GPU (compute only)

    @property
    def head_split(self) -> list[int]:
        return self.layout.head_split(self.heads)

    @property
    def padding_overhead(self) -> float:
        return self.layout.padding_overhead(self.lengths)

    @property
    def problems(self) -> list[str]:
        return self.layout.problems(self.heads, self.lengths)

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def shape(self) -> str:
        """'CFG 2 x SP 3', 'SP 4', 'CFG 2', '1 rank'."""
        lay = self.layout
        parts = ([f"CFG {lay.cfg_degree}"] if lay.cfg_degree > 1 else []) + \
                ([f"SP {lay.sp_degree}"] if lay.sp_degree > 1 else [])
        return " x ".join(parts) or ("1 rank" if lay.world_size == 1 else f"{lay.world_size} ranks")

    def heads_text(self) -> str:
        split = self.head_split
        if len(set(split)) == 1:
            return f"{split[0]} heads per rank"
        if len(split) <= 8:
            return f"heads {'/'.join(map(str, split))} per rank"
        return f"{max(split)} or {min(split)} heads per rank"

    def padding_text(self) -> str:
        pad = [self.layout.padding(n) for n in self.lengths]
        if not any(pad):
            return "no padding"
        return (f"padding {'/'.join(map(str, pad))} token(s) to the {'/'.join(map(str, self.lengths))}-token "
                f"sequence{'s' if len(self.lengths) > 1 else ''} (at most {self.padding_overhead * 100:.3g}%)")

    def describe(self) -> str:
        """One line: the split, heads per rank, padding, CFG, estimated speed-up."""
        if not self.valid:
            return f"{self.shape}: " + "; ".join(self.problems)
        bits = [self.shape]
        if self.layout.use_sp:
            bits += [self.heads_text(), self.padding_text()]
        bits.append("CFG split (--cfg-parallel)" if self.layout.cfg_degree > 1 else "CFG not split")
        return ", ".join(bits) + f"; est. {self.speedup:.2f}x DiT speed-up"

    def to_json(self) -> dict:
        lay = self.layout
        return {"world_size": lay.world_size, "cfg_degree": lay.cfg_degree, "sp_degree": lay.sp_degree,
                "head_split": self.head_split, "padding_tokens": [lay.padding(n) for n in self.lengths],
                "padding_overhead": round(self.padding_overhead, 6), "speedup_estimate": round(self.speedup, 3),
                "valid": self.valid, "problems": self.problems, "cfg_parallel": lay.cfg_degree > 1,
                "text": self.describe()}


def estimate_speedup(layout: Layout, heads: int, dim: int, ffn_dim: int, length: int) -> float:
    """One GPU's DiT step work / the busiest rank's (module docstring); 0.0 for an invalid plan."""
    if not layout.fits(heads, [length]) or length <= 0:
        return 0.0
    dims = DitDims(dim=dim, ffn_dim=ffn_dim, num_heads=heads)
    per_token, attention = per_token_flops(dims), attention_flops(dims, length)
    one_gpu = step_passes(True) * (length * per_token + attention)  # a guided step: the CFG split's case
    local = -(-length // layout.sp_degree)
    rank = step_passes(True, layout.cfg_degree) * (local * per_token + attention * layout.heads_per_rank(heads) / heads)
    return one_gpu / rank


def candidates(mode: Mode, world_size: int, cfg_possible: bool = True) -> list[Layout]:
    """The layouts of ``mode`` at ``world_size``: without and (even world, CFG on) with the CFG split."""
    out = [Layout.for_mode(mode, world_size)]
    if cfg_possible and world_size % 2 == 0:
        out.append(Layout.for_mode(mode, world_size, cfg_parallel=True))
    return out


def plans_for(mode: Mode, world_size: int, heads: int, dim: int, ffn_dim: int, lengths: Sequence[int],
              cfg_possible: bool = True) -> list[Plan]:
    """Every candidate plan at ``world_size``, fastest first (ties: smaller SP group first)."""
    longest = max(lengths) if lengths else 0
    plans = [Plan(lay, heads, tuple(lengths), estimate_speedup(lay, heads, dim, ffn_dim, longest))
             for lay in candidates(mode, world_size, cfg_possible)]
    return sorted(plans, key=lambda p: (not p.valid, -round(p.speedup, 3), p.layout.sp_degree))


def best_plan(mode: Mode, world_size: int, heads: int, dim: int, ffn_dim: int, lengths: Sequence[int],
              cfg_possible: bool = True) -> Plan:
    """The fastest plan at ``world_size`` (the first candidate, invalid, when none is valid)."""
    return plans_for(mode, world_size, heads, dim, ffn_dim, lengths, cfg_possible)[0]


def plan_table(mode: Mode, heads: int, dim: int, ffn_dim: int, lengths: Sequence[int],
               cfg_possible: bool = True, worlds: Iterable[int] = PLAN_WORLD_SIZES) -> list[Plan]:
    """The best plan of ``mode`` for each GPU count in ``worlds`` (1..16 by default)."""
    return [best_plan(mode, w, heads, dim, ffn_dim, lengths, cfg_possible) for w in worlds]


# ----- serving: several groups side by side (``serve --replicas``) or one wide group -----
#: what each more rank of a sequence-parallel group costs in communication, as a share of its
#: step: calibrated on upstream's timing table, where 8 GPUs of Ulysses give 6.7x and the compute
#: split alone gives ~7.9x (1 + 7 x 0.0256 = 1.18). The CFG split costs one exchange of the noise
#: prediction per step: nothing here.
SP_COMM_COST = 0.0256
#: the queue depth the doctor's split table assumes unless told (``--queue-depth``)
DEFAULT_QUEUE_DEPTH = 8


@dataclass(frozen=True)
class Split:
    """``gpus`` GPUs as ``groups`` rank groups of ``plan``'s layout: videos per unit of time (one
    GPU makes 1) and the mean time for a job of a queue ``queue_depth`` deep (submitted at once)
    to be done, in one GPU's video time."""

    groups: int
    plan: Plan
    speedup: float  # one group's, communication included (SP_COMM_COST)
    videos_per_gpu_time: float
    mean_latency: float

    def to_json(self) -> dict:
        return {"groups": self.groups, "ranks_per_group": self.plan.layout.world_size, "plan": self.plan.describe(),
                "cfg_parallel": self.plan.layout.cfg_degree > 1, "speedup": round(self.speedup, 3),
                "videos_per_gpu_time": round(self.videos_per_gpu_time, 3),
                "mean_latency_gpu_times": round(self.mean_latency, 3)}


def splits_for(mode: Mode, gpus: int, heads: int, dim: int, ffn_dim: int, lengths: Sequence[int],
               queue_depth: int = DEFAULT_QUEUE_DEPTH, cfg_possible: bool = True) -> list[Split]:
    """Every way to split ``gpus`` into equal groups (each with its fastest valid plan), widest first."""
    out = []
    for size in sorted((d for d in range(1, gpus + 1) if gpus % d == 0), reverse=True):
        plan = best_plan(mode, size, heads, dim, ffn_dim, lengths, cfg_possible)
        if not plan.valid:
            continue
        speedup = plan.speedup / (1 + SP_COMM_COST * (plan.layout.sp_degree - 1))
        groups = gpus // size
        waits = sum(-(-i // groups) for i in range(1, queue_depth + 1)) / max(queue_depth, 1)
        out.append(Split(groups, plan, speedup, groups * speedup, waits / speedup))
    return out


def best_splits(splits: Sequence[Split]) -> tuple[Split, Split]:
    """(the most videos per hour, the lowest mean latency) of ``splits`` (ties: fewer groups)."""
    most = max(splits, key=lambda s: (round(s.videos_per_gpu_time, 3), -s.groups))
    soonest = min(splits, key=lambda s: (round(s.mean_latency, 3), s.groups))
    return most, soonest
