"""What a person watching a run sees: a rich live table on a terminal, plain lines otherwise.

The launcher calls ``started``, ``update`` (after each poll of the event files), ``log_line``
(rank 0's output, relayed from torchrun) and ``finished``. ``--json`` makes the final summary a
JSON document on stdout and keeps everything else on stderr.

Plain mode (stdout not a terminal: CI, ``nohup``, a pipe) prints only meaningful lines:

- one line per stage change, all ranks that entered it together on one line
  (``[0:07] load: ranks 0-1``; a rank entering more than a second later gets its own line with
  its lag, ``[0:09] load: rank 1 (+2.1s)``); ``denoise`` lines carry ``clip j/M`` (a live job's:
  ``block j/M``: every position is in the job's own unit, :func:`~wan_s2v_runner.shared.events.position`);
- rank 0's denoising progress with clips done / clips in all and an ETA (first and last step of
  each clip, and at most every 10 s in between): the seconds a clip took so far, or before the
  first clip ends the plan's estimate (``job.time``), else the first clip's step pace
  (:mod:`wan_s2v_runner.shared.job_time`);
- any rank's error, the moment it is recorded;
- rank 0's own log lines, without Python warnings, tqdm bars and tracebacks (all of those stay
  in ``torchrun.log`` and ``logs/``; the failure report prints the traceback that matters).
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from typing import Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.events import (
    EventKind,
    ProgressUnit,
    denoise_position,
    is_secondary,
    position,
    rank_log_level,
)
from wan_s2v_runner.shared.job_time import ClipClock
from wan_s2v_runner.shared.spec import JobSpec
from wan_s2v_runner.shared.stages import Stage

#: in plain mode, print a step line at least this often (besides each clip's first/last step)
PROGRESS_EVERY_S = 10.0
#: stage entries of several ranks within this window are printed as one line
COALESCE_S = 1.0


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = max(0, int(round(s)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def fmt_ranks(ranks) -> str:
    """[0,1,2,5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts, start = [], rs[0]
    for a, b in zip(rs, rs[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return "ranks " + ",".join(parts)


def progress_text(st) -> str:
    p = st.progress
    if st.stage == Stage.DENOISE and position(p)[1]:
        return denoise_position(p)
    return ""


#: rank 0's stages after the clips (the video is complete then: nothing left but writing it)
AFTER_CLIPS = frozenset({Stage.SAVE, Stage.IDLE, Stage.DONE})


def clock_on_event(clock: ClipClock, ev: dict) -> None:
    """Feed one of rank 0's events to ``clock`` (the console's and the server's progress alike),
    in the job's unit: a clip job's clips and steps, a live job's blocks (a block's ``progress``
    record: that block made)."""
    kind, t = EventKind.coerce(ev.get("kind")), float(ev.get("t", 0.0))
    unit, index, count = position(ev)
    if kind is EventKind.STAGE:
        stage = Stage.coerce(ev.get("stage", ""))
        if index and isinstance(stage, Stage) and stage.repeats_per_clip:
            clock.unit = unit.value
            clock.clip(int(index), count, t)
        elif stage in AFTER_CLIPS:
            clock.finished()
    elif kind is EventKind.PROGRESS and index:
        clock.unit = unit.value
        if unit is ProgressUnit.BLOCK:  # a live block's progress: that block is made
            clock.made(int(index), count, t)
        elif ev.get("step") and ev.get("steps"):
            clock.step(int(index), count, int(ev["step"]), int(ev["steps"]), t)


def clips_text(clock: ClipClock, now: float) -> str:
    """'ETA 1:02:03 (3/121 clips done)' (a live job: 'blocks done'; the parts known; '' when none is)."""
    eta = clock.eta(now)
    text = f"ETA {fmt_seconds(eta)}" if eta is not None else ""
    if clock.clips_total:
        done = f"{clock.clips_done}/{clock.clips_total} {ProgressUnit(clock.unit).plural} done"
        text = f"{text} ({done})" if text else done
    return text


class LogFilter:
    """torchrun's relayed output -> the lines worth showing (None = hide).

    Only lines torchrun prefixes with ``[default<N>]:`` (the ranks' own output) are shown;
    torchrun's own messages (and its failure summary) are kept in torchrun.log. Hidden: blank
    lines, ``file.py:N: XWarning:`` and the source line after it, tqdm bars, glog-style W/I lines,
    and tracebacks (the failure report shows the first failing rank's). With ``quiet_info`` (a
    terminal, where the live table is the progress display) the ranks' INFO/DEBUG log lines are
    hidden too: they stay in the per-rank log files (``<run_dir>/logs``) and ``torchrun.log``."""

    PREFIX = re.compile(r"^\[default(\d+)\]:(.*)$")
    WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")
    GLOG = re.compile(r"^\[?[WI]\d{4} \d\d:\d\d:\d\d")
    RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch's excepthook prefixes uncaught tracebacks

    def __init__(self, quiet_info: bool = False):
        self.quiet_info = quiet_info
        self._skip_indented = False
        self._in_tb = False

    def __call__(self, raw: str) -> Optional[str]:
        m = self.PREFIX.match(raw)
        if not m:
            return None
        line = self.RANK_PREFIX.sub("", m.group(2).split("\r")[-1].rstrip(), count=1)
        if self._in_tb:
            if not line or line[0].isspace() or line.startswith(("During handling", "The above exception")):
                return None
            if line.startswith("Traceback (most recent call last)"):
                return None
            self._in_tb = False  # the exception line itself: hidden too
            return None
        if self._skip_indented:
            self._skip_indented = False
            if line[:1].isspace():
                return None
        if not line.strip():
            return None
        if line.startswith("Traceback (most recent call last)"):
            self._in_tb = True
            return None
        if self.WARNING.match(line):
            self._skip_indented = True
            return None
        if "%|" in line or self.GLOG.match(line):
            return None
        if self.quiet_info and rank_log_level(line) in ("DEBUG", "INFO"):
            return None
        return line


class Display:
    def __init__(self, rich: bool, json_mode: bool = False, show_logs: bool = True,
                 plan_clip_s: Optional[float] = None):
        self.rich = rich
        self.json_mode = json_mode
        self.show_logs = show_logs
        self.out = sys.stderr if json_mode else sys.stdout
        self.console = Console(stderr=json_mode)
        self.err = Console(stderr=True)
        self._live: Optional[Live] = None
        self._lock = threading.RLock()
        self._filter = LogFilter(quiet_info=rich)
        self._expected: list[int] = [0]
        self._first: int = 0
        self._header = ""
        # plain-mode state
        self._groups: dict = {}  # (stage, clip, job) -> {"first_t", "pending": [(rank, t)], "printed": set}
        self._last_progress_print = 0.0
        #: the first rank's clips (done, in all, the ETA); ``plan_clip_s``: the plan's seconds a clip
        self.plan_clip_s = plan_clip_s
        self._clock = ClipClock(plan_clip_s)
        self._t0 = time.time()
        self._rank_clip: dict = {}  # rank -> (unit, index, count): the clip (live: block) it is working on
        self._rank_job: dict = {}  # rank -> the job (1-based) of the rank group it is working on

    @classmethod
    def auto(cls, json_mode: bool = False, plan_clip_s: Optional[float] = None) -> "Display":
        stream = sys.stderr if json_mode else sys.stdout
        return cls(rich=stream.isatty(), json_mode=json_mode, plan_clip_s=plan_clip_s)

    def _print(self, text: str) -> None:
        with self._lock:
            if self.rich:
                self.console.print(text, highlight=False, markup=False, soft_wrap=True)
            else:
                print(text, file=self.out, flush=True)

    def started(self, spec, run_dir) -> None:
        self._expected = list(range(spec.node_rank * spec.nproc, (spec.node_rank + 1) * spec.nproc))
        self._first = self._expected[0]
        self._header = f"wan-s2v {spec.mode.value} x{spec.world_size} ({spec.device})"
        seed = f"seed={spec.seed} " if isinstance(spec, JobSpec) else ""  # a run's own job; a group's jobs: each
        self._print(f"wan-s2v: mode={spec.mode.value} world={spec.world_size} device={spec.device} "
                    f"{seed}run_dir={run_dir}")
        if self.rich:
            self._live = Live(Table(), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def log_line(self, line: str) -> None:
        if not self.show_logs:
            return
        with self._lock:
            shown = self._filter(line)
        if shown is not None:
            self._print(shown)

    # ----- progress -----
    def update(self, reader, new_events, elapsed: float) -> None:
        now = time.time()
        t0 = self._t0 = now - elapsed
        # both modes: stage lines and errors scroll (the history); plain mode: step lines too;
        # rich mode: a live table of every rank below them
        for ev in new_events:
            kind, r = EventKind.coerce(ev.get("kind")), ev.get("rank")
            t = float(ev.get("t", now))
            if r == self._first:
                clock_on_event(self._clock, ev)
            if kind in (EventKind.STAGE, EventKind.HELLO):
                if kind is EventKind.HELLO:
                    key = ("started", None, 1)
                else:
                    unit, index, count = position(ev)
                    if index:
                        self._rank_clip[r] = (unit, index, count)
                    stage = Stage.coerce(ev.get("stage", "?"))  # a name it does not know: a plain line
                    per_clip = isinstance(stage, Stage) and stage.repeats_per_clip
                    key = (stage, self._rank_clip.get(r) if per_clip else None, self._rank_job.get(r, 1))
                g = self._groups.setdefault(key, {"first_t": t, "pending": [], "printed": set(), "pids": {}})
                g["pending"].append((r, t))
                if kind is EventKind.HELLO:
                    g["pids"][r] = ev.get("pid")
            elif kind is EventKind.JOB:  # a rank group's next job: its stages and clips start again
                self._rank_job[r] = ev.get("job")
                self._rank_clip.pop(r, None)
                if r == self._first:
                    self._flush(t0, force=True)
                    # a group's next job: the plan's estimate was of the run's own (its only) job
                    self._clock = ClipClock(self.plan_clip_s if ev.get("jobs") == 1 else None)
                    of = f"/{ev['jobs']}" if ev.get("jobs") else ""  # a served group: no total
                    self._print(f"[{fmt_seconds(t - t0)}] job {ev.get('job')}{of}: {ev.get('id')}")
            elif kind is EventKind.PROGRESS and r == self._first and not self.rich:
                self._flush(t0, force=True)
                p = {k: ev.get(k) for k in ("clip", "clips", "block", "blocks", "step", "steps", "reused_steps",
                                            "unit", "fps", "first_frame_s")}
                # a clip's first and last step; a live block: each (they are the first and last of it)
                first_or_last = position(p)[0] is ProgressUnit.BLOCK or p.get("step") in (1, p.get("steps"))
                if first_or_last or now - self._last_progress_print >= PROGRESS_EVERY_S:
                    self._last_progress_print = now
                    clips = clips_text(self._clock, t)
                    self._print(f"[{fmt_seconds(t - t0)}] rank {r}: {denoise_position(p)}"
                                + (f", {clips}" if clips else ""))
            elif kind is EventKind.PREVIEW:  # --preview: rank 0 wrote the video so far
                self._flush(t0, force=True)
                self._print(f"[{fmt_seconds(t - t0)}] video so far: {ev.get('path')} ({ev.get('clips')}/"
                            f"{ev.get('of')} clips, {ev.get('seconds')} s)")
            elif kind is EventKind.ERROR:
                self._flush(t0, force=True)
                msg = str(ev.get("message") or "").strip().splitlines()
                first = (msg[0] if msg else "")[:300]
                self._print(f"[{fmt_seconds(t - t0)}] rank {r} ERROR in {ev.get('stage')}: "
                            f"{ev.get('error_type')}: {first}"
                            + (" (a peer went away first)" if is_secondary(first) else ""))
        self._flush(t0)
        if self.rich and self._live:
            self._live.update(self._table(reader, elapsed, now))

    def _flush(self, t0: float, force: bool = False) -> None:
        """Print waiting stage groups in time order; stop at the first one still collecting
        ranks (so lines never jump ahead), unless ``force``."""
        now = time.time()
        # ordered by the latest entry: a group is placed where it became complete (e.g. "done"
        # after rank 0's save/mux, though rank 1 was done earlier)
        waiting = [(max(t for _, t in g["pending"]), key, g) for key, g in self._groups.items() if g["pending"]]
        for _, (stage, clip, _job), g in sorted(waiting, key=lambda x: x[0]):
            ranks = {r for r, _ in g["pending"]}
            oldest = min(t for _, t in g["pending"])
            first_only = isinstance(stage, Stage) and stage.first_rank_only
            expected = {self._first} if first_only else set(self._expected)
            complete = (g["printed"] | ranks) >= expected
            if not (force or complete or now - oldest >= COALESCE_S):
                break
            label = stage
            if clip:
                label += f" {clip[0].value} {clip[1]}/{clip[2] or '?'}"
            if g["printed"]:
                lag = max(t for _, t in g["pending"]) - g["first_t"]
                line = f"[{fmt_seconds(oldest - t0)}] {label}: {fmt_ranks(ranks)} (+{lag:.1f}s)"
            else:
                line = f"[{fmt_seconds(max(t for _, t in g['pending']) - t0)}] {label}: {fmt_ranks(ranks)}"
                if not complete:
                    line += f" ({len(ranks)} of {len(expected)})"
            if stage == "started" and g["pids"]:
                line += f" (pid {', '.join(str(g['pids'][r]) for r in sorted(ranks) if r in g['pids'])})"
            g["printed"] |= ranks
            g["pending"] = []
            self._print(line)

    def _table(self, reader, elapsed: float, now: float) -> Table:
        clips = clips_text(self._clock, now)
        title = f"{self._header} - elapsed {fmt_seconds(elapsed)}" + (f" - {clips}" if clips else "")
        t = Table(title=title, title_justify="left")
        for col in ("rank", "pid", "stage", "progress", "host RSS", "no progress for", "heartbeat"):
            t.add_column(col)
        for r in self._expected:
            st = reader.ranks.get(r)
            if st is None:
                t.add_row(str(r), "-", "(not started)", "", "", "", "")
                continue
            rss = st.mem.get("rss_mb")
            if st.error:
                stage = f"[red]{st.stage}: {st.error.get('error_type')}[/]"
            elif st.end:
                stage = f"[green]{st.stage}[/]"
            else:
                stage = st.stage
            idle = "" if st.end else f"{now - (st.last_progress_t or now):.0f}s"
            t.add_row(str(r), str(st.pid or "-"), stage, progress_text(st),
                      f"{rss / 1024:.1f} GiB" if rss else "", idle,
                      "" if st.end else f"{now - st.last_seen_t:.0f}s ago")
        return t

    # ----- the end -----
    def finished(self, spec, run_dir, outcome, manifest: dict) -> None:
        with self._lock:
            if self._live:
                self._live.stop()
                self._live = None
            if not self.rich:
                self._flush(self._t0, force=True)
        if self.json_mode:
            print(json.dumps(manifest, indent=2, default=str), flush=True)
            return
        if outcome.code == 0 and not spec.writes_output:
            what = spec.output if isinstance(spec, JobSpec) else "the videos"
            self._print(f"node {spec.node_rank} done in {manifest['wall_s']:.1f}s: its ranks finished; node 0 "
                        f"writes {what}; manifest {run_dir / 'run.json'}")
            return
        if outcome.code == 0:
            for line in outcome.details or []:  # what the launcher had to do after the ranks were done
                self._err(f"note: {line}")
        if outcome.code == 0 and not (manifest.get("output") or {}).get("path"):  # a group of jobs (batch, serve)
            self._print(f"done in {manifest['wall_s']:.1f}s: the rank group ended; manifest {run_dir / 'run.json'}")
            return
        if outcome.code == 0:
            out = manifest.get("output") or {}
            self._print(f"done in {manifest['wall_s']:.1f}s: {out.get('path')} "
                        f"({out.get('frames')} frames, {out.get('video_codec')}+{out.get('audio_codec')}, "
                        f"sha256 {str(out.get('sha256'))[:12]}); manifest {run_dir / 'run.json'}")
            return
        status = manifest["exit"]["status"]
        word = "INTERRUPTED" if status == "interrupted" else "FAILED"
        self._err(f"wan-s2v: {word} ({status}, exit {outcome.code}): {outcome.reason}", style="bold red")
        if outcome.code == exit_codes.DISK_FULL:  # one line: the disk, what was kept, the fix (run.json has the rest)
            return
        if outcome.traceback:
            rank = f" of rank {outcome.failed_rank}" if outcome.failed_rank is not None else ""
            self._err(f"--- traceback{rank} ---\n{outcome.traceback.rstrip()}\n---")
        for line in outcome.details or []:
            self._err(line)
        if outcome.hint:
            self._err(f"hint: {outcome.hint}")
        self._err(f"run directory: {run_dir} (run.json, logs/, events/, stacks/, torchrun.log)")

    def _err(self, text: str, style: Optional[str] = None) -> None:
        with self._lock:
            if self.err.is_terminal:
                self.err.print(text, style=style, markup=False, highlight=False, soft_wrap=True)
            else:
                print(text, file=sys.stderr, flush=True)
