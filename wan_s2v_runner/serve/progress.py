"""What a server's rank groups and their jobs are doing, as the API shows it: a group's state
(:class:`GroupState`) and a running job's progress from rank 0's events (:class:`Progress`:
stage, clip k/n, step i/m, clips done of the clips in all, ETA, seconds per stage, the clips in the
video so far; a live job's in its blocks: block k/n, blocks done, no steps). The ETA is
:mod:`wan_s2v_runner.shared.job_time`'s: the seconds a clip (block) took so far, before the first
ends the plan's seconds a clip (``plan_clip_s``), else the first clip's step pace; None while
nothing is known."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from wan_s2v_runner.launcher.console import clock_on_event
from wan_s2v_runner.shared.events import EventKind, ProgressUnit, position, steps_done
from wan_s2v_runner.shared.job_time import ClipClock
from wan_s2v_runner.shared.latency import Latencies
from wan_s2v_runner.shared.stages import Stage


class GroupState(str, Enum):
    """What the rank group is doing (``/health``, the status page)."""

    LOADING = "loading"
    IDLE = "idle"
    WORKING = "working"
    RESTARTING = "restarting"
    STOPPED = "stopped"


@dataclass
class Progress:
    """A running job's progress, from rank 0's events."""

    started: float
    stage: str = ""
    unit: ProgressUnit = ProgressUnit.CLIP  # what it counts: clips, or a live job's blocks
    index: Optional[int] = None  # the clip (block) in progress, 1-based
    count: Optional[int] = None  # the clips (blocks) in all
    step: Optional[int] = None  # a clip job's step of its clip (None for a live job)
    steps: Optional[int] = None
    eta_s: Optional[float] = None
    marks: list[tuple[str, float]] = field(default_factory=list)
    denoise_t0: Optional[float] = None
    preview_clips: Optional[int] = None  # clips in the video so far (videos/ID.partial.mp4)
    steps_reused: Optional[int] = None  # --cache: the job's steps so far that reused a computed one
    plan_clip_s: Optional[float] = None  # the plan's seconds a clip (preflight's job.time), if known
    clock: Optional[ClipClock] = None
    #: a live job's figures (its rank 0's ``live`` events: first frame, frames a second)
    live: dict = field(default_factory=dict)
    #: a live session's block latencies (its ``preview`` events' ``latency_s``)
    latencies: Latencies = field(default_factory=Latencies)

    def __post_init__(self) -> None:
        if self.clock is None:
            self.clock = ClipClock(self.plan_clip_s)

    def on_event(self, ev: dict[str, Any]) -> None:
        kind, t = EventKind.coerce(ev.get("kind")), float(ev["t"])
        clock_on_event(self.clock, ev)
        if kind is EventKind.STAGE:
            self.stage = str(ev.get("stage"))
            self.marks.append((self.stage, t))
            unit, index, count = position(ev)
            if self.stage == Stage.DENOISE:
                self.denoise_t0 = self.denoise_t0 or t
            if index is not None:  # a stage that says where the job is (a live rank 0's denoise says not)
                self.unit, self.index, self.count = unit, index, count
                if self.stage == Stage.DENOISE and unit is ProgressUnit.CLIP:
                    self.step, self.steps = 0, ev.get("steps") or self.steps
                elif unit is ProgressUnit.BLOCK:
                    self.step = self.steps = None
        elif kind is EventKind.PREVIEW:
            self.preview_clips = ev.get("clips")
            if isinstance(ev.get("latency_s"), (int, float)):
                self.latencies.add(float(ev["latency_s"]))
        elif kind is EventKind.LIVE:
            self.live = {k: ev[k] for k in ("first_frame_s", "fps", "frames_made", "blocks") if k in ev}
        elif kind is EventKind.PROGRESS:
            unit, index, count = position(ev)
            if unit is ProgressUnit.BLOCK:  # a block made: the block in progress is the stage's, or the next
                self.unit, self.count = unit, count
                self.index = max(self.index or 0, min(index + 1, count or index + 1)) if index else self.index
            else:
                self.unit, self.index, self.count = unit, index, count
            if self.unit is ProgressUnit.CLIP:
                self.step, self.steps = ev.get("step"), ev.get("steps")
                self.steps_reused = ev.get("reused_steps", self.steps_reused)
            else:
                self.step = self.steps = None
        self.eta_s = self.clock.eta(t)

    def steps_per_s(self, now: float) -> Optional[float]:
        """A clip job's denoising steps a second so far (None for a live job, and while unknown)."""
        if self.denoise_t0 is None or not self.step or not self.steps:
            return None
        done = steps_done({"clip": self.index, "step": self.step, "steps": self.steps})
        return round(done / max(now - self.denoise_t0, 1e-6), 4)

    def stage_seconds(self, now: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for (stage, t), (_, t_next) in zip(self.marks, self.marks[1:] + [("", now)]):
            out[stage] = round(out.get(stage, 0.0) + t_next - t, 3)
        return out

    def as_dict(self, now: float) -> dict[str, Any]:
        """The video object's progress fields (:class:`~.protocol.VideoObject`): the position in
        the job's unit (``unit``; a clip job's ``clip``/``clips``/``clips_done``/``clips_total``
        and steps, a live job's ``block``/``blocks``/``blocks_done``/``blocks_total``, the other
        unit's None)."""
        live = self.unit is ProgressUnit.BLOCK
        # a live session's blocks: counted without a total (it is known when its speech ends)
        done = self.clock.clips_done if self.clock.clips_total or (live and self.index is not None) else None
        return {"stage": self.stage or None, "unit": self.unit.value if self.index is not None else None,
                "clip": None if live else self.index, "clips": None if live else self.count,
                "block": self.index if live else None, "blocks": self.count if live else None,
                "step": self.step, "steps": self.steps,
                "eta_s": round(self.eta_s, 1) if self.eta_s is not None else None,
                "clips_done": None if live else done, "clips_total": None if live else self.clock.clips_total,
                "blocks_done": done if live else None, "blocks_total": self.clock.clips_total if live else None,
                "stage_seconds": self.stage_seconds(now), "preview_clips": self.preview_clips,
                "steps_reused": self.steps_reused,
                "live": {**self.live, **self.latencies.summary()} if live and self.live else None}
