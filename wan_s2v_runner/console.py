"""What a person watching a run sees: rich live table on a terminal, plain lines otherwise.

The launcher calls ``started``, ``update`` (after each poll of the event files), ``log_line``
(rank 0's output, relayed from torchrun) and ``finished``. ``--json`` makes the final summary a
JSON document on stdout and keeps everything else on stderr.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _fmt_s(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_text(st, p: Optional[dict] = None) -> str:
    p = st.progress if p is None else p
    if (p is not None or st.stage == "denoise") and p.get("step"):
        clips = p.get("clips") or "?"
        return f"clip {p.get('clip')}/{clips} step {p.get('step')}/{p.get('steps')}"
    return ""


def eta_s(st, elapsed_in_denoise: Optional[float], p: Optional[dict] = None) -> Optional[float]:
    p = st.progress if p is None else p
    if not (p.get("step") and p.get("clips") and p.get("steps") and elapsed_in_denoise):
        return None
    done = (p["clip"] - 1) * p["steps"] + p["step"]
    total = p["clips"] * p["steps"]
    return elapsed_in_denoise / done * (total - done) if done else None


class Display:
    def __init__(self, rich: bool, json_mode: bool = False, show_logs: bool = True):
        self.rich = rich
        self.json_mode = json_mode
        self.show_logs = show_logs
        self.console = Console(stderr=json_mode)
        self.err = Console(stderr=True)
        self._live: Optional[Live] = None
        self._last_plain: dict = {}
        self._denoise_t0: Optional[float] = None

    @classmethod
    def auto(cls, json_mode: bool = False) -> "Display":
        stream = sys.stderr if json_mode else sys.stdout
        return cls(rich=stream.isatty(), json_mode=json_mode)

    def _print(self, text: str) -> None:
        if self.rich:
            self.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=sys.stderr if self.json_mode else sys.stdout, flush=True)

    def started(self, spec, run_dir) -> None:
        self._print(f"wan-s2v: mode={spec.mode.value} world={spec.world_size} device={spec.device} "
                    f"seed={spec.seed} run_dir={run_dir}")
        if self.rich:
            self._live = Live(Table(), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def log_line(self, line: str) -> None:
        if self.show_logs:
            self._print(line)

    def update(self, reader, new_events, elapsed: float) -> None:
        r0 = reader.ranks.get(0)
        if r0 and r0.stage == "denoise" and self._denoise_t0 is None:
            self._denoise_t0 = r0.stage_t
        in_denoise = time.time() - self._denoise_t0 if self._denoise_t0 else None
        if self.rich and self._live:
            t = Table(title=f"elapsed {_fmt_s(elapsed)}")
            for col in ("rank", "stage", "progress", "ETA", "last event"):
                t.add_column(col)
            now = time.time()
            for r, st in sorted(reader.ranks.items()):
                t.add_row(str(r), st.stage, progress_text(st), _fmt_s(eta_s(st, in_denoise)),
                          f"{now - st.last_seen_t:.0f}s ago")
            self._live.update(t)
            return
        for ev in new_events:  # plain: one line per stage change of any rank, progress of rank 0
            kind, r = ev.get("kind"), ev.get("rank")
            if kind == "stage":
                extra = f" clip {ev['clip']}/{ev.get('clips') or '?'}" if ev.get("clip") else ""
                self._print(f"[{_fmt_s(elapsed)}] rank {r}: {ev['stage']}{extra}")
            elif kind == "progress" and r == 0:
                st = reader.ranks[0]
                eta = eta_s(st, in_denoise, ev)
                self._print(f"[{_fmt_s(elapsed)}] rank 0: {progress_text(st, ev)}"
                            + (f" ETA {_fmt_s(eta)}" if eta is not None else ""))
            elif kind == "error":
                self._print(f"[{_fmt_s(elapsed)}] rank {r} ERROR in {ev.get('stage')}: "
                            f"{ev.get('error_type')}: {ev.get('message')}")

    def finished(self, spec, run_dir, outcome, manifest: dict) -> None:
        if self._live:
            self._live.stop()
            self._live = None
        if self.json_mode:
            print(json.dumps(manifest, indent=2, default=str))
            return
        if outcome.code == 0:
            out = manifest.get("output") or {}
            self._print(f"done in {manifest['wall_s']:.1f}s: {out.get('path')} "
                        f"({out.get('frames')} frames, {out.get('video_codec')}+{out.get('audio_codec')}); "
                        f"manifest {run_dir / 'run.json'}")
            return
        self.err.print(f"[bold red]wan-s2v: FAILED[/] ({manifest['exit']['status']}, exit {outcome.code}): "
                       f"{outcome.reason}", highlight=False)
        if outcome.traceback:
            self.err.print(outcome.traceback, markup=False, highlight=False)
        if outcome.hint:
            self.err.print(f"hint: {outcome.hint}", markup=False, highlight=False)
        self.err.print(f"logs, events and stacks: {run_dir}", markup=False, highlight=False)
