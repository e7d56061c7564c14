"""What a server's rank groups and their jobs are doing, as the API shows it: a group's state
(:class:`GroupState`) and a running job's progress from rank 0's events (:class:`Progress`:
stage, clip k/n, step i/m, clips done of the clips in all, ETA, seconds per stage, the clips in the
video so far). The ETA is :mod:`wan_s2v_runner.shared.job_time`'s: the seconds a clip took so far,
before the first clip ends the plan's seconds a clip (``plan_clip_s``), else the first clip's
step pace; None while nothing is known."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from wan_s2v_runner.launcher.console import clock_on_event
from wan_s2v_runner.shared.events import steps_done
from wan_s2v_runner.shared.job_time import ClipClock
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
    clip: Optional[int] = None
    clips: Optional[int] = None
    step: Optional[int] = None
    steps: Optional[int] = None
    eta_s: Optional[float] = None
    marks: list[tuple[str, float]] = field(default_factory=list)
    denoise_t0: Optional[float] = None
    preview_clips: Optional[int] = None  # clips in the video so far (videos/ID.partial.mp4)
    steps_reused: Optional[int] = None  # --cache: the job's steps so far that reused a computed one
    plan_clip_s: Optional[float] = None  # the plan's seconds a clip (preflight's job.time), if known
    clock: Optional[ClipClock] = None

    def __post_init__(self) -> None:
        if self.clock is None:
            self.clock = ClipClock(self.plan_clip_s)

    def on_event(self, ev: dict[str, Any]) -> None:
        kind, t = ev.get("kind"), float(ev["t"])
        clock_on_event(self.clock, ev)
        if kind == "stage":
            self.stage = str(ev.get("stage"))
            self.marks.append((self.stage, t))
            if self.stage == Stage.DENOISE:
                self.denoise_t0 = self.denoise_t0 or t
                self.clip, self.clips, self.step = ev.get("clip"), ev.get("clips"), 0
                self.steps = ev.get("steps") or self.steps
        elif kind == "preview":
            self.preview_clips = ev.get("clips")
        elif kind == "progress":
            self.clip, self.clips = ev.get("clip"), ev.get("clips")
            self.step, self.steps = ev.get("step"), ev.get("steps")
            self.steps_reused = ev.get("reused_steps", self.steps_reused)
        self.eta_s = self.clock.eta(t)

    def steps_per_s(self, now: float) -> Optional[float]:
        if self.denoise_t0 is None or not self.step or not self.steps:
            return None
        done = steps_done({"clip": self.clip, "step": self.step, "steps": self.steps})
        return round(done / max(now - self.denoise_t0, 1e-6), 4)

    def stage_seconds(self, now: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for (stage, t), (_, t_next) in zip(self.marks, self.marks[1:] + [("", now)]):
            out[stage] = round(out.get(stage, 0.0) + t_next - t, 3)
        return out

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"stage": self.stage or None, "clip": self.clip, "clips": self.clips, "step": self.step,
                "steps": self.steps, "eta_s": round(self.eta_s, 1) if self.eta_s is not None else None,
                "clips_done": self.clock.clips_done if self.clock.clips_total else None,
                "clips_total": self.clock.clips_total,
                "stage_seconds": self.stage_seconds(now), "preview_clips": self.preview_clips,
                "steps_reused": self.steps_reused}
