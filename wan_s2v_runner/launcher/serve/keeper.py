"""The keeper: the server's thread that owns one resident rank group.

It launches the group from its :class:`~wan_s2v_runner.shared.spec.GroupSpec` alone with
:func:`wan_s2v_runner.launcher.launch.run` (``served``: the run directory gets an inbox, the
ranks load once and wait in stage ``idle``), supervised exactly like a run (failure attribution,
hang watchdog, ``run.json``). The keeper is one of the run's observers
(:class:`KeeperObserver`, :mod:`~wan_s2v_runner.launcher.observer`), beside the console: the
supervisor tells it after every poll of the ranks' events; there, on the keeper's own thread, it:

- posts the next queued job when the group is idle (one at a time: a job that resumes is
  prepared from its clip checkpoints, a job whose record and mp4 are already there is completed
  without running, as ``wan-s2v batch`` does);
- follows rank 0's events into the job's live progress (:class:`Progress`: stage, clip k/n,
  step i/m, ETA, seconds per stage), and records ``job_done`` / ``job_cancelled`` /
  ``job_failed`` (the job's own error: its inputs unreadable when it starts, or rank 0's writing
  failed; the same ranks take the next job) in the queue;
- passes a cancel of the running job to the ranks (the inbox's cancel file).

When the group ends under a job (a rank died or hung), the job goes back to the queue with its
failure counted (failed for good at :data:`~.queue.MAX_FAILURES`), and the keeper starts a new
group after a back-off. The HTTP side never waits on any of this.

One keeper owns one group and takes jobs from a :class:`~.queue.JobStore` by claiming them, so
more groups (more keepers) can share one store.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

from wan_s2v_runner.launcher.console import Display, eta_s
from wan_s2v_runner.launcher.job_book import (
    WORK_DIR,
    JobState,
    Line,
    job_defaults,
    mark_done_before,
    prepare_resume,
)
from wan_s2v_runner.launcher.proctree import pids_with_cmdline
from wan_s2v_runner.launcher.serve.queue import JobStatus, JobStore
from wan_s2v_runner.launcher.serve.retention import SWEEP_EVERY_S, Retention
from wan_s2v_runner.launcher.serve.retention import sweep as retention_sweep
from wan_s2v_runner.launcher.torchrun import WORKER_MODULE
from wan_s2v_runner.shared import atomic, inbox, media
from wan_s2v_runner.shared.events import steps_done
from wan_s2v_runner.shared.jobs import Job
from wan_s2v_runner.shared.spec import GroupSpec, JobSpec, RunSpec
from wan_s2v_runner.shared.stages import Stage

log = logging.getLogger("wan_s2v.keeper")

#: seconds before the keeper starts a new rank group after one failed (doubling, up to the max)
RESTART_BACKOFF_S = (1.0, 30.0)
#: the running group's run directory, so the next server can find (and stop) what a killed one left
GROUP_FILE = "group.json"
#: how often a keeper looks for a cancel of its running job (one server's queue; a shared one:
#: every third of the lease, when it renews it)
BEAT_S = 2.0
#: how often an idle keeper asks a shared queue for the next job
CLAIM_EVERY_S = 0.5


def group_files(root: Path) -> list[Path]:
    """Every keeper's note of its group's run directory (``group.json``, ``group-I.json``)."""
    return sorted(root.glob("group*.json"))


def group_file(root: Path, index: int) -> Path:
    """Where keeper ``index`` notes its group's run directory (for the next server, if this one is
    killed): ``group.json`` for the first group, ``group-I.json`` for the others."""
    return root / (GROUP_FILE if index == 0 else f"group-{index}.json")


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

    def on_event(self, ev: dict[str, Any]) -> None:
        kind, t = ev.get("kind"), float(ev["t"])
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
            p = {"clip": self.clip, "clips": self.clips, "step": self.step, "steps": self.steps}
            self.eta_s = eta_s(p, self.denoise_t0, t)

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
                "stage_seconds": self.stage_seconds(now), "preview_clips": self.preview_clips}


@dataclass(frozen=True)
class ServerDirs:
    """Where a server keeps things (``--server-dir``)."""

    root: Path  # this server's own (its lock, its rank groups' run directories, a SQLite queue)
    shared: Optional[Path] = None  # --shared-dir: what every server of a shared queue reads (else root)

    @property
    def videos(self) -> Path:  # ID.mp4 and ID.json: the only files the API ever serves
        return (self.shared or self.root) / "videos"

    @property
    def uploads(self) -> Path:
        return (self.shared or self.root) / "uploads"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def queue(self) -> Path:
        return self.root / "jobs.sqlite"

    def work(self, job_id: str) -> Path:
        return self.videos / WORK_DIR / job_id

    def video(self, job_id: str) -> Path:
        return self.videos / f"{job_id}.mp4"

    def record(self, job_id: str) -> Path:  # rank 0's record of the job (ID.json)
        return self.videos / f"{job_id}.json"

    def partial(self, job_id: str) -> Path:  # the video so far (rank 0's preview, rank/preview.py)
        return media.partial_path(self.video(job_id))

    def thumbnail(self, job_id: str) -> Path:  # the first frame (rank 0 writes it after clip 1)
        return media.thumbnail_path(self.video(job_id))

    def remove_job_files(self, job_id: str, *, video: bool) -> None:
        """What a job left: its clip checkpoints and uploads (a job that ended keeps nothing it
        could resume from); with ``video``, its mp4, record, speech, video so far and thumbnail
        too (deleted)."""
        import shutil

        shutil.rmtree(self.work(job_id), ignore_errors=True)
        shutil.rmtree(self.uploads / job_id, ignore_errors=True)
        if video:
            for path in (self.video(job_id), self.record(job_id), self.videos / f"{job_id}.speech.wav",
                         self.partial(job_id), self.thumbnail(job_id)):
                path.unlink(missing_ok=True)


class KeeperObserver:
    """The keeper's side of a run's observers (:class:`~wan_s2v_runner.launcher.observer.RunObserver`):
    what the supervisor tells, handed to the keeper on the supervisor's thread."""

    def __init__(self, keeper: "Keeper"):
        self.keeper = keeper

    def started(self, spec: GroupSpec, run_dir: Path) -> None:
        self.keeper.group_started(Path(run_dir))

    def log_line(self, line: str) -> None:
        pass  # the console observer prints the group's log

    def update(self, reader, new_events: list[dict], elapsed: float) -> None:
        try:
            self.keeper.note_ranks(reader.ranks)
            self.keeper.on_events(new_events)  # first: a failing beat must not cost the ranks' events
            self.keeper.beat()
            self.keeper.sweep(every_s=SWEEP_EVERY_S)
        except Exception as e:  # shown in /health; raised on: the observers log it (and a test fails)
            self.keeper.last_error = f"keeper: {type(e).__name__}: {e}"
            raise

    def finished(self, spec: GroupSpec, run_dir: Path, outcome, manifest: dict) -> None:
        self.keeper.outcome = outcome


class Keeper(threading.Thread):
    """Runs rank groups for the queue until :meth:`shutdown`."""

    def __init__(self, group_spec: GroupSpec, queue: JobStore, dirs: ServerDirs, extra_env: Optional[dict] = None,
                 on_completed: Optional[Callable[[dict], None]] = None, retention: Optional[Retention] = None,
                 index: int = 0, holds: str = "all of the node"):
        super().__init__(name=f"wan-s2v-keeper-{index}", daemon=True)
        self.group_spec, self.queue, self.dirs, self.extra_env = group_spec, queue, dirs, extra_env
        self.index, self.holds = index, holds  # which of the server's groups (--replicas), and on what
        self.on_completed = on_completed  # called with a completed job's record (the metrics)
        self.retention = retention or Retention()
        self._swept = 0.0
        self._backoff = RESTART_BACKOFF_S[0]
        self.ranks: list[dict[str, Any]] = []  # each rank's stage and memory, from its events
        self.last_steps_per_s: Optional[float] = None  # the last completed job's denoising speed
        self.state = GroupState.LOADING
        self.restarts = 0
        self.groups = 0
        self.run_dir: Optional[Path] = None
        self.current: Optional[str] = None  # the job the group is making
        self.progress: dict[str, Progress] = {}  # live progress of the running job (by id)
        self.outcome = None  # the last group's Outcome
        self.last_error: Optional[str] = None
        self.started_at = time.time()
        self._cancel_sent: set[str] = set()
        self._seq = 0
        # a shared queue: the lease on the running job is renewed every third of it; one server's: a
        # look for cancels every few seconds (the API tells this keeper directly besides)
        self.beat_every_s = getattr(queue, "lease_s", 3 * BEAT_S) / 3
        self._beat_at = 0.0
        self._claim_at = 0.0  # a shared queue is asked for the next job at most every CLAIM_EVERY_S
        self._lost: set[str] = set()  # jobs another server took from this group (its lease ran out)
        self.completed = 0  # jobs this keeper's groups completed (a group that did work is no crash loop)
        self._closing = threading.Event()  # shutdown asked
        self._halt = threading.Event()  # stop the ranks now
        self._lock = threading.Lock()

    # ----- what the API reads -----
    def live(self, job_id: str) -> Optional[dict[str, Any]]:
        with self._lock:
            p = self.progress.get(job_id)
            return p.as_dict(time.time()) if p else None

    def steps_per_s(self) -> Optional[float]:
        """Denoising steps a second, since the job's first step (its decodes included): the
        running job's so far, else the last completed job's; None before any."""
        with self._lock:
            p = self.progress.get(self.current) if self.current else None
            live = p.steps_per_s(time.time()) if p else None
            return live if live is not None else self.last_steps_per_s

    def note_ranks(self, ranks: dict) -> None:
        """Each rank's stage and latest memory figures (the status page, /metrics)."""
        snapshot = [{"rank": r, "stage": str(getattr(st.stage, "value", st.stage)), "host": st.host,
                     "rss_mb": st.mem.get("rss_mb"), "host_peak_rss_mb": st.mem.get("host_peak_rss_mb"),
                     "gpu_peak_allocated_mb": st.mem.get("gpu_peak_allocated_mb"),
                     "gpu_peak_reserved_mb": st.mem.get("gpu_peak_reserved_mb")}
                    for r, st in sorted(ranks.items())]
        with self._lock:
            self.ranks = snapshot

    def cancel_running(self, job_id: str) -> None:
        """The API marked ``job_id`` cancelled while it runs: tell the ranks (next step boundary)."""
        with self._lock:
            self._send_cancel(job_id)

    def beat(self) -> None:
        """Every :attr:`beat_every_s`: renew the lease on the running job (with its live progress,
        for the other servers of a shared queue), pass on a cancel asked anywhere, and give back
        the jobs of servers whose leases ran out."""
        now = time.time()
        if now - self._beat_at < self.beat_every_s:
            return
        self._beat_at = now
        try:
            with self._lock:
                running = {self.current: (self.progress[self.current].as_dict(now)
                                          if self.current in self.progress else None)} if self.current else {}
            beat = self.queue.heartbeat(running)
            with self._lock:
                for job_id in beat.lost:  # another server has it now: stop, and leave its files to it
                    log.warning("job %s: this server's lease ran out and another server took it; stopping it here",
                                job_id)
                    self._lost.add(job_id)
                    self._send_cancel(job_id)
                for job_id in beat.cancel:
                    self._send_cancel(job_id)
            reaped = self.queue.reap()
        except Exception as e:  # the database away for a moment: the next beat tries again
            log.exception("the keeper's heartbeat failed")
            self.last_error = f"heartbeat: {type(e).__name__}: {e}"
            return
        if reaped.requeued:
            log.warning("jobs whose server stopped renewing their leases are queued again (they resume from "
                        "their last clip): %s", ", ".join(reaped.requeued))
        for job_id in reaped.deleted:  # deleted while a server that died ran them
            self.dirs.remove_job_files(job_id, video=True)

    def _send_cancel(self, job_id: str) -> None:
        if job_id == self.current and self.run_dir is not None and job_id not in self._cancel_sent:
            inbox.cancel(self.run_dir, job_id)
            self._cancel_sent.add(job_id)

    # ----- the thread -----
    def run(self) -> None:
        from wan_s2v_runner.launcher import launch

        self._backoff = RESTART_BACKOFF_S[0]  # what a killed server's groups left: run_server stopped it
        while not self._closing.is_set():
            try:
                self._one_group(launch)
            except Exception as e:  # never a silent death: /health says it, the log has it, and the keeper goes on
                log.exception("the keeper failed; it starts the rank group again")
                self.last_error = f"keeper: {type(e).__name__}: {e}"
                self.state = GroupState.RESTARTING
                self._closing.wait(self._backoff)
                self._backoff = min(self._backoff * 2, RESTART_BACKOFF_S[1])
        self.state = GroupState.STOPPED

    def _one_group(self, launch) -> None:
        """One rank group's life, then what became of its job, then the back-off before the next."""
        self.state, self.outcome = GroupState.LOADING, None
        self.groups += 1
        served_before = self.completed
        try:
            launch.run(self.group_spec, observers=[Display(rich=False, show_logs=False), KeeperObserver(self)],
                       extra_env=self.extra_env, served=True, halt=self._halt)
        except Exception as e:  # the launcher itself failed: say so, and try again
            self.last_error = f"{type(e).__name__}: {e}"
        with self._lock:
            failed, self.current = self.current, None
            self.progress.clear()
            self.run_dir = None
            self.ranks = []
        if failed is not None:  # what its rank 0 left half-written (other groups' writes go on)
            remove_partial_videos(self.dirs.videos, failed)
        reason = (self.outcome.reason if self.outcome is not None and self.outcome.reason
                  else self.last_error or "the rank group ended")
        if failed is not None and not self._closing.is_set():
            self._group_failed_under(failed, reason)
        if self._closing.is_set():
            return
        self.last_error = reason
        self.restarts += 1
        self.state = GroupState.RESTARTING
        if self.completed > served_before:
            self._backoff = RESTART_BACKOFF_S[0]  # it did work: not a crash loop
        self._closing.wait(self._backoff)
        self._backoff = min(self._backoff * 2, RESTART_BACKOFF_S[1])

    def _group_failed_under(self, job_id: str, reason: str) -> None:
        """The group ended under ``job_id``: back to the queue (its clip checkpoints kept), or
        failed for good, or, deleted while it ran, gone with its files."""
        if job_id in self._lost:  # another server holds it now
            self._lost.discard(job_id)
            return
        row = self.queue.get(job_id)
        if (row is not None and row.deleting) or self.queue.group_failed(job_id, reason) is JobStatus.FAILED:
            self._after_end(job_id)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the group: an idle one is told to stop; a job in progress is interrupted (it stays
        in the queue and resumes from its last clip when the server starts again)."""
        self.begin_shutdown()
        self.finish_shutdown(grace_s)

    def begin_shutdown(self) -> None:
        """Ask the group to stop (an idle one is told; a busy one is interrupted)."""
        self._closing.set()
        with self._lock:
            run_dir, busy = self.run_dir, self.current is not None
        if run_dir is not None and not busy:
            inbox.stop(run_dir)
        else:
            self._halt.set()

    def finish_shutdown(self, grace_s: float = 10.0) -> None:
        """Wait up to ``grace_s`` for the group to stop, then stop its ranks now."""
        self.join(grace_s)
        if self.is_alive():
            self._halt.set()
            self.join(grace_s)

    # ----- told by KeeperObserver, on this thread -----
    def group_started(self, run_dir: Path) -> None:
        with self._lock:
            self.run_dir = run_dir
            self._cancel_sent.clear()
        # for the next server, if this one is killed: what to look for among the processes
        atomic.write_text(group_file(self.dirs.root, self.index), json.dumps({"run_dir": str(run_dir)}))

    def on_events(self, new_events: list[dict]) -> None:
        for ev in new_events:
            if ev.get("rank") == 0:
                self._on_rank0(ev, ev.get("kind"))
        if self.state is GroupState.IDLE and self.current is None and not self._closing.is_set():
            self._post_next()

    def _on_rank0(self, ev: dict, kind: Optional[str]) -> None:
        with self._lock:
            p = self.progress.get(self.current) if self.current else None
            if kind == "stage":
                if ev.get("stage") == Stage.IDLE:
                    self.state = GroupState.IDLE
                elif self.current is not None:
                    self.state = GroupState.WORKING
            if p is not None and kind in ("stage", "progress", "preview"):
                p.on_event(ev)
            if kind in ("job_done", "job_cancelled", "job_failed") and ev.get("id") == self.current:
                job_id, self.current = self.current, None
                done = self.progress.pop(job_id, None)
                if kind == "job_done" and done is not None:
                    self.last_steps_per_s = done.steps_per_s(float(ev["t"])) or self.last_steps_per_s
            else:
                return
        if job_id in self._lost:  # another server holds it now: its end, and its files, are that server's
            self._lost.discard(job_id)
            return
        kept = {"preview_clips": done.preview_clips} if done is not None and done.preview_clips else None
        if kind == "job_cancelled":  # what it made so far stays (videos/ID.partial.mp4)
            ended = self.queue.finish(job_id, JobStatus.CANCELLED, error="cancelled", record=kept)
        elif kind == "job_failed":  # the job's own error: the ranks stay up and take the next job
            ended = self.queue.finish(job_id, JobStatus.FAILED, error=str(ev.get("error") or "the job failed"),
                                      record=kept)
        else:
            ended = self._completed(job_id)
        if ended:
            self._after_end(job_id)
        else:
            log.warning("job %s ended here, but this server no longer holds it: its end is not recorded", job_id)

    def _after_end(self, job_id: str) -> None:
        """A job ended, however it ended: nothing of it is left to resume from (its clip
        checkpoints and uploads go); deleted while it ran, it goes whole (video, record, row);
        then retention."""
        row = self.queue.get(job_id)
        deleting = row is None or row.deleting
        self.dirs.remove_job_files(job_id, video=deleting)
        if row is not None and row.deleting:
            self.queue.remove(job_id)
        self.sweep()

    def sweep(self, every_s: float = 0.0) -> None:
        """Retention (:mod:`.retention`): delete the ended jobs it says are due (at most every
        ``every_s``)."""
        now = time.time()
        if now - self._swept >= every_s:
            self._swept = now
            retention_sweep(self.retention, self.queue, self.dirs, now)

    def _completed(self, job_id: str) -> bool:
        """Record a completed job; whether it was this keeper's to record."""
        try:
            record = json.loads(self.dirs.record(job_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if record is None:
            return self.queue.finish(job_id, JobStatus.FAILED, error="rank 0 finished the job but wrote no record")
        if not self.queue.finish(job_id, JobStatus.COMPLETED, record=record):
            return False
        self.completed += 1
        if self.on_completed is not None:
            try:
                self.on_completed(record)
            except Exception:  # the metrics must never cost the queue an event
                traceback.print_exc()
        return True

    def _post_next(self) -> None:
        if self.queue.shared:  # every idle keeper of every server asks: not at every poll
            now = time.time()
            if now < self._claim_at:
                return
            self._claim_at = now + CLAIM_EVERY_S
        while True:
            row = self.queue.claim_next()
            if row is None:
                return
            remove_partial_videos(self.dirs.videos, row.id)  # what a dead server left half-written of it
            if row.cancel_requested:  # cancelled while the server was down
                self.queue.finish(row.id, JobStatus.CANCELLED, error="cancelled")
                self._after_end(row.id)
                continue
            try:
                job = self._prepare(row)
            except Exception as e:  # a claimed job never stays in progress without a group: it fails
                traceback.print_exc()
                self.queue.finish(row.id, JobStatus.FAILED, error=f"the job could not be prepared: "
                                                                  f"{type(e).__name__}: {e}")
                self._after_end(row.id)
                continue
            if job is None:  # its mp4 was written before the server went down
                continue
            with self._lock:
                self._seq += 1
                self.current = row.id
                self.progress[row.id] = Progress(started=time.time())
                inbox.post_job(self.run_dir, self._seq, job.model_dump_json())
            # a cancel that came after the claim but before ``current`` named it: the API's
            # cancel_running found another job current, so it is passed on here (a later one
            # finds this job current and passes itself)
            if self.queue.get(row.id).cancel_requested:
                with self._lock:
                    self._send_cancel(row.id)
            return

    def _prepare(self, row) -> Optional[Job]:
        """A claimed row -> the job to post (None: it was done before, now completed)."""
        job_spec = JobSpec(**job_defaults(row.spec))  # a row from before the split holds a whole RunSpec
        line = Line(0, row.id, JobState.QUEUED, spec=RunSpec.of(self.group_spec, job_spec))  # held whole
        mark_done_before(line)
        if line.state is JobState.DONE_BEFORE:
            self.queue.finish(row.id, JobStatus.COMPLETED, record=json.loads(line.record.read_text(encoding="utf-8")))
            self._after_end(row.id)
            return None
        work = self.dirs.work(row.id)
        work.mkdir(parents=True, exist_ok=True)
        line.record.unlink(missing_ok=True)  # a record says done only when this group writes it
        prepare_resume(line, work)
        return Job(id=row.id, spec=line.spec.job, work_dir=work, record=line.record)


def stop_keepers(keepers: list[Keeper], grace_s: float = 10.0) -> None:
    """Stop every group at once (each interrupted job resumes when the server starts again)."""
    running = [k for k in keepers if k.is_alive()]
    for k in running:
        k.begin_shutdown()
    for k in running:
        k.finish_shutdown(grace_s)


def remove_partial_videos(videos: Path, job_id: Optional[str] = None) -> list[Path]:
    """What a killed rank left half-written among the videos (every writer names its temporaries
    ``.NAME.PID.*``, :func:`~wan_s2v_runner.shared.atomic.temp_name`): ``job_id``'s, or, when no
    group runs, everyone's."""
    removed = []
    for path in videos.glob(f".{job_id}.*" if job_id else ".*.*"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def group_processes(run_dir: str) -> set[int]:
    """torchrun and the workers of the rank group in ``run_dir`` (their command lines name its spec)."""
    return pids_with_cmdline(WORKER_MODULE.encode(), str(Path(run_dir) / "spec.json").encode())


def wait_for_leftovers(group_file: Path, grace_s: float = 5.0) -> list[int]:
    """What a killed server's group left running: torchrun and its workers normally stop with
    the server (torchrun gets SIGTERM when it dies, and stops its workers), but a torchrun whose
    output pipe broke with the server can hang in its shutdown. Wait ``grace_s``, then SIGKILL
    whatever of the group is left. Returns the pids found."""
    try:
        run_dir = json.loads(group_file.read_text(encoding="utf-8"))["run_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    found = group_processes(run_dir)
    deadline = time.time() + grace_s
    while found and time.time() < deadline and group_processes(run_dir):
        time.sleep(0.2)
    for pid in group_processes(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return sorted(found)
