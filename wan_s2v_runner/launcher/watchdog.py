"""The hang watchdog's verdicts: is the run stuck, and how to say where.

Pure functions over the ranks' states (:class:`~wan_s2v_runner.shared.events.RankState`) and what the
launcher gathered; the launcher (:mod:`.supervisor`, :mod:`.processes`) owns the processes, the clock and the stack
dumps, and calls these. A run is stuck when every unfinished rank has gone longer than its
stage's limit without a ``stage`` or ``progress`` record: load-class stages
(:attr:`Stage.is_load_class`) get ``watchdog_load_s``, the others ``watchdog_step_s``; a rank
that never reported counts as in ``start`` since the spawn; a limit of 0 turns that kind off.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

from wan_s2v_runner.launcher.diagnose import progress_suffix
from wan_s2v_runner.shared.events import RankState
from wan_s2v_runner.shared.stages import Stage, gets_load_limit

#: {stage: [ranks]}: where the unfinished ranks were when the watchdog fired
Stuck = dict[Union[Stage, str], list[int]]

#: a stuck rank whose last record of any kind (heartbeats included) is older than this is
#: called out: its process is frozen, swapping or stopped, not just waiting
HEARTBEAT_SILENT_S = 10.0


@dataclass(frozen=True)
class WatchdogLimits:
    """The two limits, seconds without progress (0: off for that kind of stage)."""

    load_s: float
    step_s: float

    def for_stage(self, stage: Union[Stage, str]) -> float:
        """The limit for a rank in ``stage`` (a name that is no stage gets the load limit)."""
        return self.load_s if gets_load_limit(stage) else self.step_s


def stalled(ranks: Mapping[int, RankState], expected: Iterable[int], spawn_t: float, now: float,
            limits: WatchdogLimits) -> Optional[Stuck]:
    """``{stage: [ranks]}`` when every unfinished expected rank has gone longer than its
    stage's limit without progress, else None. Ranks that never reported count as in
    ``start`` since ``spawn_t``; finished or failed ranks are left out; a rank still within its
    limit (say, slowly loading) keeps the run alive, and so does a limit of 0."""
    live = []
    for r in expected:
        st = ranks.get(r)
        if st is None:
            live.append((r, Stage.START, spawn_t))
        elif st.end is None and st.error is None:
            live.append((r, st.stage, st.last_progress_t or spawn_t))
    if not live:
        return None
    for _, stage, last in live:
        limit = limits.for_stage(stage)
        if not limit or now - last <= limit:
            return None
    by_stage: Stuck = {}
    for r, stage, _ in live:
        by_stage.setdefault(stage, []).append(r)
    return by_stage


def hang_hint(stages: Iterable[Union[Stage, str]]) -> str:
    if any(gets_load_limit(s) for s in stages):
        return ("Stuck while starting/loading/encoding: check storage speed, NCCL_P2P_DISABLE=1 on "
                "consumer GPUs, and that every node reached the rendezvous; raise --watchdog-load "
                "if loading is just slow.")
    return ("Stuck in a step or collective: read the stack dumps (the rank that is not waiting in "
            "a collective is the one to look at); raise --watchdog-step if steps are just slow.")


@dataclass(frozen=True)
class HangReport:
    """What the report says about a hang."""

    reason: str  # "stuck in denoise (clip 1/2, step 0/2) on ranks 0,1 (no progress for 4s); stacks in ..."
    details: tuple[str, ...]  # one line each: ranks that never reported, stack analysis, silent heartbeats
    hint: str
    limit_s: float  # the largest limit that was exceeded


def describe_hang(stuck: Stuck, ranks: Mapping[int, RankState], *, now: float,
                  limits: WatchdogLimits, stacks_dir: Path, stack_lines: Sequence[str] = (),
                  silent: Optional[Mapping[int, tuple[int, str]]] = None,
                  not_started: str = "torchrun did not start it") -> HangReport:
    """The hang report for :func:`stalled`'s result.

    ``stack_lines``: the analysis of the stack dumps (:func:`diagnose.analyse_stacks`);
    ``silent``: for ranks that never reported, the (pid, process state) of the worker process
    found for them while the run was still up (a rank missing there had no process);
    ``not_started``: why such a rank has no process (the launcher knows: a rendezvous with other
    nodes, :func:`wan_s2v_runner.launcher.supervisor.not_started_note`)."""
    silent = silent or {}
    limit = max(limits.for_stage(s) for s in stuck)
    parts = []
    for stage, rs in stuck.items():
        st = ranks.get(rs[0])
        parts.append(f"{stage}{progress_suffix(st) if st else ''} on rank{'s' if len(rs) > 1 else ''} "
                     f"{','.join(map(str, rs))}")
    details = []
    for r in stuck.get(Stage.START, []):
        if r in ranks:
            continue  # reported 'start' itself: not a silent rank
        if r in silent:
            pid, state = silent[r]
            details.append(f"rank {r} never reported (no events): its process (pid {pid}) was "
                           f"{state}; stacks/rank{r}.at-stop.txt has its stack if it got as far "
                           "as registering faulthandler")
        else:
            details.append(f"rank {r} never reported (no events) and no worker process was "
                           f"found for it: {not_started}")
    details.extend(stack_lines)
    for r in sorted(r for rs in stuck.values() for r in rs):
        st = ranks.get(r)
        if st and st.last_seen_t and now - st.last_seen_t > HEARTBEAT_SILENT_S:
            details.append(f"rank {r}: no heartbeat for {now - st.last_seen_t:.0f}s "
                           "(process frozen, swapping, or stopped?)")
    reason = f"stuck in {'; '.join(parts)} (no progress for {limit:g}s); stacks in {stacks_dir}"
    return HangReport(reason=reason, details=tuple(details), hint=hang_hint(stuck), limit_s=limit)
