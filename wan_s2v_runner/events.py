"""Rank -> launcher events: one JSON-lines file per rank in ``<run_dir>/events/``.

Each rank appends ``{"t", "rank", "kind", "stage", ...}`` records: ``stage`` when it enters a
stage (engine_import, load, fingerprint, shard, audio_encode, text_encode, clip, step, decode,
save, mux, done), ``progress`` for clip/step counters, ``heartbeat`` every few seconds from a
daemon thread (so a stuck rank is visible as "alive but not progressing"), and ``end`` with peak
memory. The launcher tails these files (:class:`EventReader`); nothing else is shared.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

STAGES = ("init_pg", "engine_import", "load", "fingerprint", "shard", "audio_encode",
          "text_encode", "denoise", "decode", "save", "mux", "done")


def events_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "events"


class EventWriter:
    def __init__(self, run_dir: Path, rank: int, heartbeat_s: float = 2.0):
        d = events_dir(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f = open(d / f"rank{rank}.jsonl", "a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()
        self.stage_name = "start"
        self.progress: dict[str, Any] = {}
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True)
        self._hb.start()

    def emit(self, kind: str, **data: Any) -> None:
        rec = {"t": time.time(), "rank": self.rank, "kind": kind, "stage": self.stage_name, **data}
        line = json.dumps(rec, default=str)
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")

    def stage(self, name: str, **data: Any) -> None:
        self.stage_name = name
        self.emit("stage", **data)

    def step(self, **counters: Any) -> None:
        self.progress.update(counters)
        self.emit("progress", **counters)

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            self.emit("heartbeat")

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._f.close()


@dataclass
class RankState:
    rank: int
    stage: str = "start"
    stage_t: float = 0.0
    last_progress_t: float = 0.0  # last stage/progress event (not heartbeats)
    last_seen_t: float = 0.0  # any event, heartbeats included
    progress: dict[str, Any] = field(default_factory=dict)
    transitions: list[tuple[str, float]] = field(default_factory=list)  # (stage, entry time)
    pid: Optional[int] = None
    host: Optional[str] = None
    end: Optional[dict[str, Any]] = None
    error: Optional[dict[str, Any]] = None


def stage_durations(st: RankState) -> dict[str, float]:
    """Seconds spent in each stage (summed over repeats, e.g. per-clip denoise/decode)."""
    out: dict[str, float] = {}
    end_t = float(st.end["t"]) if st.end else st.last_seen_t
    for i, (name, t) in enumerate(st.transitions):
        nxt = st.transitions[i + 1][1] if i + 1 < len(st.transitions) else end_t
        out[name] = round(out.get(name, 0.0) + max(0.0, nxt - t), 3)
    return out


class EventReader:
    """Incrementally reads every rank's event file into :class:`RankState` objects."""

    def __init__(self, run_dir: Path):
        self.dir = events_dir(run_dir)
        self._pos: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.ranks: dict[int, RankState] = {}

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.dir.is_dir():
            return new
        for path in sorted(self.dir.glob("rank*.jsonl")):
            with open(path, "r", encoding="utf-8") as f:
                f.seek(self._pos.get(path, 0))
                chunk = f.read()
                self._pos[path] = f.tell()
            text = self._partial.pop(path, "") + chunk
            lines = text.split("\n")
            if lines and lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                if line.strip():
                    try:
                        new.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        for ev in new:
            self._apply(ev)
        return new

    def _apply(self, ev: dict[str, Any]) -> None:
        r = int(ev["rank"])
        st = self.ranks.setdefault(r, RankState(rank=r))
        t = float(ev["t"])
        st.last_seen_t = max(st.last_seen_t, t)
        kind = ev.get("kind")
        if kind == "stage":
            st.stage = ev["stage"]
            st.stage_t = t
            st.last_progress_t = t
            st.transitions.append((ev["stage"], t))
        elif kind == "progress":
            st.last_progress_t = t
            st.progress.update({k: v for k, v in ev.items() if k not in ("t", "rank", "kind", "stage")})
        elif kind == "hello":
            st.pid, st.host = ev.get("pid"), ev.get("host")
            st.last_progress_t = t
        elif kind == "end":
            st.end = ev
        elif kind == "error":
            st.error = ev
