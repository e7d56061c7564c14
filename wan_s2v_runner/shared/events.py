"""Rank -> launcher events: one JSON-lines file per rank in ``<run_dir>/events/rank{r}.jsonl``.

Every record is one line ``{"t": unix time, "rank": global rank, "kind": ..., "stage": ..., ...}``
(``stage`` is the stage the rank is in when it writes the record). Kinds:

- ``hello``: first record; ``pid``, ``host``, ``local_rank``, ``cpus`` (the CPUs a CPU rank is
  bound to, or null).
- ``stage``: the rank entered a stage (:class:`~wan_s2v_runner.shared.stages.Stage`, written as its
  plain name); a per-clip stage (``denoise``, ``decode``, ...) carries the job's position in its
  unit (below).
- ``progress``: a clip job's denoising step finished, a live job's block was made.

A job's position is in its own unit (:class:`ProgressUnit`, the record's ``unit``): a clip job's
records carry ``unit: "clip"``, ``clip``, ``clips`` (1-based clip, count), and ``step``, ``steps``
(and with ``--cache`` ``reused``, ``reused_steps``); a live job's (``--mode live``) ``unit:
"block"``, ``block``, ``blocks`` (1-based block, count), and in ``progress`` also ``fps`` and
``first_frame_s`` once known. Every reader takes either through :func:`position`; a record without
``unit`` (an older event file) is a clip job's.
- ``heartbeat``: every few seconds from a daemon thread, with memory figures (``rss_mb``,
  ``host_peak_rss_mb``, ``gpu_peak_allocated_mb``), so a stuck rank shows as "alive, not
  progressing" and a killed rank still leaves its last memory reading.
- ``stage_peak``: written as a stage ends (its ``stage``), the peaks while it ran:
  ``host_peak_rss_mb`` (Linux), ``gpu_peak_allocated_mb``, ``gpu_peak_reserved_mb`` (CUDA);
  the reader keeps each stage's largest (``RankState.stage_peaks``).
- ``patches``, ``frames``: informational.
- ``error``: the rank raised; ``error_type``, ``message`` (written before the process group is
  torn down, so the first failing rank's record comes before its peers' connection errors).
- ``end``: last record (also after an error); ``wall_s`` and peak memory.

Only ``stage`` and ``progress`` count as progress for the hang watchdog; heartbeats do not.
The launcher tails these files with :class:`EventReader`; nothing else is shared. Besides events,
ranks write plain log lines (:data:`RANK_LOG_FORMAT`), which the node agent keeps in the per-rank log
files and the launcher relays to the display. The reader
turns stage names into :class:`Stage` members and keeps a name it does not know as a plain
string (an event file from another version never stops the launcher).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from wan_s2v_runner.shared.disk import is_disk_full
from wan_s2v_runner.shared.stages import Stage


class EventKind(str, Enum):
    """What a rank's event record is (its ``kind``): the one vocabulary the rank writes and the
    launcher, console, keeper and page read. A member compares equal to its plain name (the file's
    text), so a reader may hold either."""

    HELLO = "hello"
    STAGE = "stage"
    PROGRESS = "progress"
    HEARTBEAT = "heartbeat"
    STAGE_PEAK = "stage_peak"
    PATCHES = "patches"
    PLAN = "plan"
    LOADED = "loaded"
    LORA = "lora"
    COMPILE = "compile"
    FRAMES = "frames"
    PREVIEW = "preview"
    PREVIEW_FAILED = "preview_failed"
    THUMBNAIL = "thumbnail"
    RESUMED = "resumed"
    WAITING = "waiting"
    JOB = "job"
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"
    JOB_CANCELLED = "job_cancelled"
    JOB_LOST = "job_lost"
    LIVE = "live"
    STEP_CACHE = "step_cache"
    ERROR = "error"
    END = "end"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def coerce(cls, name: object) -> Union["EventKind", str, None]:
        """The member named ``name``, else ``name`` as it is (a kind this version does not know,
        from an event file of another version: kept, never an error; None stays None)."""
        try:
            return cls(name)
        except ValueError:
            return None if name is None else str(name)


class ProgressUnit(str, Enum):
    """What a job's progress counts: a clip job's clips (``clip``/``clips``, each of ``steps``
    steps), a live job's blocks (``block``/``blocks``: 12 frames each)."""

    CLIP = "clip"
    BLOCK = "block"

    def __str__(self) -> str:
        return self.value

    @property
    def plural(self) -> str:
        return self.value + "s"


def position(record: Mapping[str, Any]) -> tuple[ProgressUnit, Optional[int], Optional[int]]:
    """Where a job is, in its own unit: ``(unit, index, count)`` (1-based index; None where the
    record does not say) from a ``stage`` or ``progress`` record, a rank's
    :attr:`RankState.progress`, or a video object's fields. A clip job's ``clip``/``clips``, a live
    job's (``unit: "block"``) ``block``/``blocks``; a record without ``unit`` is a clip job's. The
    one place that knows the fields: every reader (the console, the keeper, the server's progress,
    the status page's API) asks it."""
    if record.get("unit") == ProgressUnit.BLOCK:
        # ``clip``/``clips`` beside ``unit: "block"``: a live job's records before the block fields
        index = record.get("block") if record.get("block") is not None else record.get("clip")
        count = record.get("blocks") if record.get("blocks") is not None else record.get("clips")
        return ProgressUnit.BLOCK, index, count
    return ProgressUnit.CLIP, record.get("clip"), record.get("clips")


def position_fields(unit: ProgressUnit, index: Optional[int], count: Optional[int]) -> dict[str, Any]:
    """A position as a record's fields (:func:`position`'s inverse): ``unit`` and the unit's two."""
    unit = ProgressUnit(unit)
    return {"unit": unit.value, unit.value: index, unit.plural: count}


#: error text of a rank whose *peer* went away (gloo/NCCL): the peer is the one to look at
SECONDARY = ("connection closed by peer", "connection reset by peer", "broken pipe",
             "remote process exited", "ncclremoteerror", "communicator was aborted",
             "socket closed", "transport retry", "peer closed")


#: the ranks' log line format (the engine logs through the root logger, so its lines share it)
RANK_LOG_FORMAT = "[%(asctime)s] [rank{rank}] %(levelname)s %(name)s: %(message)s"
_RANK_LOG_LEVEL = re.compile(r"^\[[^\]]*\] \[rank\d+\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def rank_log_level(line: str) -> Optional[str]:
    """The level of a rank's log line (``"INFO"``, ...), or None for any other output."""
    m = _RANK_LOG_LEVEL.match(line)
    return m.group(1) if m else None


def is_secondary(text: str) -> bool:
    """True for an error that says a peer went away (a consequence, not a cause)."""
    low = text.lower()
    return any(s in low for s in SECONDARY)


def events_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "events"


log = logging.getLogger("wan_s2v.events")


class EventWriter:
    """Appends one rank's records; each record is a single ``write`` of one line.

    A record that cannot be written (a full disk above all: ENOSPC, a quota) is dropped, never
    raised: the heartbeat thread and the rank's own work go on, and the rank's log says once that
    its records are being dropped (and once more when a write succeeds again, with how many were
    lost). A line a full disk cut short is ended before the next record, so readers skip it whole."""

    def __init__(self, run_dir: Path, rank: int, heartbeat_s: float = 2.0,
                 mem_fn: Optional[Callable[[], dict]] = None,
                 stage_peak_fn: Optional[Callable[[], dict]] = None):
        d = events_dir(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = d / f"rank{rank}.jsonl"
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.dropped = 0  # records not written since the last write failed (0: writing)
        self._torn = False  # a failed write left part of a line in the file
        self._lock = threading.Lock()
        self.current_stage = Stage.START
        self.progress: dict[str, Any] = {}
        self._mem_fn = mem_fn
        self._stage_peak_fn = stage_peak_fn  # the ending stage's memory peaks (then reset)
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True,
                                    name="wan-s2v-heartbeat")
        self._hb.start()

    def emit(self, kind: EventKind, **data: Any) -> None:
        """Write a ``kind`` record (an :class:`EventKind`; a plain name that is not one raises
        ValueError) with ``data``."""
        kind = EventKind(kind)
        rec = {"t": time.time(), "rank": self.rank, "kind": kind.value, "stage": self.current_stage.value,
               **data}
        line = json.dumps(rec, default=str)  # ASCII only: a reader never sees a split character
        with self._lock:
            if self._fd is not None:
                self._write((line + "\n").encode("ascii"))

    def _write(self, data: bytes) -> None:
        """One record's line, whole (the lock held); an error drops it (:class:`EventWriter`)."""
        if self._torn:  # the rest of a line cut short: a line of its own, which readers skip
            data = b"\n" + data
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as e:
            self._torn = self._torn or written > 0
            if not self.dropped:
                log.warning("rank %d: its events cannot be written to %s (%s): dropping them until a write "
                            "succeeds%s", self.rank, self.path, e.strerror or e,
                            " (the disk is full: free space there)" if is_disk_full(e) else "")
            self.dropped += 1
            return
        self._torn = False
        if self.dropped:
            log.warning("rank %d: its events are written again to %s (%d records were dropped)", self.rank,
                        self.path, self.dropped)
            self.dropped = 0

    def stage(self, stage: Stage, **data: Any) -> None:
        """Enter ``stage`` (a :class:`Stage`; a plain name that is not one raises ValueError)."""
        new = Stage(stage)
        self.stage_peak()
        self.current_stage = new
        self.emit(EventKind.STAGE, **data)

    def stage_peak(self) -> None:
        """Record the memory peaks of the stage in progress (``stage_peak``), when measured."""
        if self._stage_peak_fn is not None:
            peaks = self._stage_peak_fn()
            if peaks:
                self.emit(EventKind.STAGE_PEAK, **peaks)

    def step(self, **counters: Any) -> None:
        self.progress.update(counters)
        self.emit(EventKind.PROGRESS, **counters)

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            mem: dict = {}
            if self._mem_fn is not None:
                try:
                    mem = self._mem_fn()
                except Exception:  # a heartbeat must never die
                    mem = {}
            self.emit(EventKind.HEARTBEAT, **mem)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


@dataclass
class RankState:
    rank: int
    stage: Union[Stage, str] = Stage.START  # a plain string: a name this version does not know
    stage_t: float = 0.0
    last_progress_t: float = 0.0  # last stage/progress/hello record (not heartbeats)
    last_seen_t: float = 0.0  # any record, heartbeats included
    progress: dict[str, Any] = field(default_factory=dict)
    transitions: list[tuple[Union[Stage, str], float]] = field(default_factory=list)  # (stage, entry time)
    pid: Optional[int] = None
    host: Optional[str] = None
    local_rank: Optional[int] = None
    cpus: Optional[list] = None  # CPU runs: the CPUs the rank is bound to (--pin-cpus), None: unbound
    mem: dict[str, Any] = field(default_factory=dict)  # last heartbeat's memory figures
    end: Optional[dict[str, Any]] = None
    error: Optional[dict[str, Any]] = None
    job_failed: Optional[dict[str, Any]] = None  # the last job whose own error the group outlived
    loaded: Optional[dict[str, Any]] = None  # what the rank's loading read, and how (``loaded`` event)
    step_cache: list[dict[str, Any]] = field(default_factory=list)  # --cache: per clip, steps computed/reused
    #: --mode live, the decoding rank: the latest figures (time to the first frame, frames per second)
    live: Optional[dict[str, Any]] = None
    stage_peaks: dict[Union[Stage, str], dict[str, float]] = field(default_factory=dict)  # MiB, largest per stage


def denoise_position(p: Mapping[str, Any]) -> str:
    """'clip j/M, step i/N' from a progress record or RankState.progress ('?' for unknowns), and
    with ``--cache`` how many of the job's steps so far reused a computed one; a live job's
    (``unit: block``): 'block j/M, F frames/s, first frame at S s'."""
    unit, index, count = position(p)
    if unit is ProgressUnit.BLOCK:  # --mode live: the video's blocks, and how fast they come
        live = "".join(f", {text}" for key, text in (("fps", f"{p.get('fps')} frames/s"),
                                                      ("first_frame_s", f"first frame at {p.get('first_frame_s')} s"))
                       if p.get(key) is not None)
        return f"block {index}/{count or '?'}{live}"
    reused = f" ({p['reused_steps']} reused: --cache)" if p.get("reused_steps") else ""
    return f"clip {index}/{count or '?'}, step {p.get('step') or 0}/{p.get('steps') or '?'}{reused}"


def steps_done(p: Mapping[str, Any]) -> Optional[int]:
    """A clip job's denoising steps done over all clips so far, ``(clip - 1) x steps + step``, from
    a progress record or RankState.progress; None while the steps per clip are unknown, and for a
    live job (it counts blocks, not steps)."""
    unit, index, _ = position(p)
    if unit is ProgressUnit.BLOCK or not p.get("steps"):
        return None
    return (max(index or 1, 1) - 1) * p["steps"] + (p.get("step") or 0)


def share_done(p: Mapping[str, Any]) -> Optional[float]:
    """The share of a job's denoising done, 0 to 1 (None while unknown): a clip job's steps of all
    its clips' steps, a live job's blocks before the one in progress of all its blocks."""
    unit, index, count = position(p)
    if not count:
        return None
    if unit is ProgressUnit.BLOCK:
        made = p.get("blocks_done")
        return (made if made is not None else max(0, (index or 1) - 1)) / count
    done = steps_done(p)
    return None if done is None else done / (count * p["steps"])


def stage_durations(st: RankState) -> dict[Union[Stage, str], float]:
    """Seconds spent in each stage (summed over repeats, e.g. per-clip denoise/decode)."""
    out: dict[Union[Stage, str], float] = {}
    end_t = float(st.end["t"]) if st.end else st.last_seen_t
    for i, (name, t) in enumerate(st.transitions):
        nxt = st.transitions[i + 1][1] if i + 1 < len(st.transitions) else end_t
        out[name] = round(out.get(name, 0.0) + max(0.0, nxt - t), 3)
    return out


class EventReader:
    """Incrementally reads every rank's event file into :class:`RankState` objects.

    Reads bytes and keeps an unterminated last line until its newline arrives, so a record that
    is being written while we read is never lost or half-parsed. Undecodable lines are skipped
    (counted in ``bad_lines``).
    """

    def __init__(self, run_dir: Path):
        self.dir = events_dir(run_dir)
        self._pos: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self.ranks: dict[int, RankState] = {}
        self.bad_lines = 0

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.dir.is_dir():
            return new
        for path in sorted(self.dir.glob("rank*.jsonl")):
            try:
                with open(path, "rb") as f:
                    f.seek(self._pos.get(path, 0))
                    chunk = f.read()
                    self._pos[path] = f.tell()
            except OSError:
                continue
            if not chunk:
                continue
            lines = (self._partial.pop(path, b"") + chunk).split(b"\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                if not line.strip():
                    continue
                try:
                    ev = json.loads(line)
                    int(ev["rank"]), float(ev["t"])
                except (ValueError, KeyError, TypeError):
                    self.bad_lines += 1
                    continue
                new.append(ev)
        new.sort(key=lambda e: float(e["t"]))
        for ev in new:
            self._apply(ev)
        return new

    def _apply(self, ev: dict[str, Any]) -> None:
        r = int(ev["rank"])
        st = self.ranks.setdefault(r, RankState(rank=r))
        t = float(ev["t"])
        st.last_seen_t = max(st.last_seen_t, t)
        kind = EventKind.coerce(ev.get("kind"))
        if kind is EventKind.STAGE:
            st.stage = Stage.coerce(ev.get("stage", "?"))
            st.stage_t = t
            st.last_progress_t = t
            st.transitions.append((st.stage, t))
            unit, index, count = position(ev)
            if index is not None and st.stage == Stage.DENOISE:  # a new clip (block): its steps start again
                if index == 1:  # a job's first clip: a job before it (--cache) reused nothing of this one
                    for key in ("reused", "reused_steps", "fps", "first_frame_s"):
                        st.progress.pop(key, None)
                for key in ("clip", "clips", "block", "blocks"):  # the unit's own fields alone
                    st.progress.pop(key, None)
                st.progress.update(position_fields(unit, index, count), step=0)
                if ev.get("steps"):
                    st.progress["steps"] = ev["steps"]
        elif kind is EventKind.WAITING:  # idle between served jobs, its collectives still answering
            st.last_progress_t = t
        elif kind is EventKind.PROGRESS:
            st.last_progress_t = t
            st.progress.update({k: v for k, v in ev.items() if k not in ("t", "rank", "kind", "stage")})
            st.progress.update(position_fields(*position(ev)))
        elif kind is EventKind.HELLO:
            st.pid, st.host, st.local_rank = ev.get("pid"), ev.get("host"), ev.get("local_rank")
            st.cpus = ev.get("cpus")
            st.last_progress_t = t
        elif kind is EventKind.HEARTBEAT:
            st.mem = {k: v for k, v in ev.items() if k not in ("t", "rank", "kind", "stage")}
        elif kind is EventKind.STAGE_PEAK:
            peaks = st.stage_peaks.setdefault(Stage.coerce(ev.get("stage", "?")), {})
            for k, v in ev.items():
                if k not in ("t", "rank", "kind", "stage") and isinstance(v, (int, float)):
                    peaks[k] = max(peaks.get(k, v), v)
        elif kind is EventKind.END:
            st.end = ev
        elif kind is EventKind.JOB_FAILED:
            st.job_failed = ev
        elif kind is EventKind.LOADED:
            st.loaded = {k: v for k, v in ev.items() if k not in ("t", "rank", "kind", "stage")}
        elif kind is EventKind.LIVE:  # --mode live: after each decoded block
            st.live = {k: v for k, v in ev.items() if k not in ("t", "rank", "kind", "stage")}
        elif kind is EventKind.STEP_CACHE:  # --cache: a clip's steps computed and reused
            st.step_cache.append({k: ev.get(k) for k in ("clip", "computed", "reused")})
        elif kind is EventKind.ERROR:
            if st.error is None:  # keep the first (a later one is teardown noise)
                st.error = ev
