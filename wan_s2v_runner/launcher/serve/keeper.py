"""The keeper: the server's thread that owns one resident rank group and holds its jobs.

It launches the group from its :class:`~wan_s2v_runner.shared.spec.GroupSpec` alone with
:func:`wan_s2v_runner.launcher.launch.run` (``served``: the run directory gets an inbox, the
ranks load once and wait in stage ``idle``), supervised exactly like a run (failure attribution,
hang watchdog, ``run.json``). The keeper is one of the run's observers
(:class:`KeeperObserver`, :mod:`~wan_s2v_runner.launcher.observer`), beside the console: the
supervisor tells it after every poll of the ranks' events; there, on the keeper's own thread, it:

- claims the next job of its pool when the group is idle and the server may take jobs (the
  claim gives the job a new attempt: this keeper's fencing token), prepares it in the attempt's
  own folder (resuming from the newest complete clip checkpoint any attempt wrote; a job whose
  published mp4 and record are already there is completed without running), tells the ranks
  how long its hold is sure (the inbox's lease file, :mod:`~wan_s2v_runner.rank.lease`), and
  posts it;
- renews the lease (a shared queue) every third of it, with the job's live progress
  (:class:`~.progress.Progress`), and passes on a cancel asked anywhere; a holder that learns it
  lost the job tells its ranks at once (they stop at the next step and write nothing more) and
  leaves the job's end and files to the new holder;
- records ``job_done`` / ``job_cancelled`` / ``job_failed`` through the store's fenced
  :meth:`~.store.protocol.JobStore.finish`, which moves the attempt's files into place
  (:func:`~.dirs.publisher`) in the same transaction.

While the store is unavailable (a database restart, a failover) the group goes on with the job
it runs; what the keeper could not record waits (:class:`Pending`) and is recorded, in order,
when the store answers again, fencing deciding whether it is still this keeper's to record.
When the group ends under a job (a rank died or hung), the job goes back to the queue with its
failure counted, and the keeper starts a new group after a back-off. The HTTP side never waits
on any of this.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from wan_s2v_runner.launcher.console import Display
from wan_s2v_runner.launcher.job_book import job_defaults, resume_point
from wan_s2v_runner.launcher.serve.dirs import ServerDirs, publisher, remove_partial_videos
from wan_s2v_runner.launcher.serve.leftovers import group_file
from wan_s2v_runner.launcher.serve.progress import GroupState, Progress
from wan_s2v_runner.launcher.serve.retention import SWEEP_EVERY_S, Retention
from wan_s2v_runner.launcher.serve.retention import sweep as retention_sweep
from wan_s2v_runner.launcher.serve.store.protocol import Held, JobRow, JobStatus, JobStore, QueueUnavailable
from wan_s2v_runner.shared import atomic, inbox
from wan_s2v_runner.shared.jobs import Job
from wan_s2v_runner.shared.spec import GroupSpec, JobSpec, RunSpec
from wan_s2v_runner.shared.stages import Stage

log = logging.getLogger("wan_s2v.keeper")

#: seconds before the keeper starts a new rank group after one failed (doubling, up to the max)
RESTART_BACKOFF_S = (1.0, 30.0)
#: how often a keeper looks for a cancel of its running job (one server's queue; a shared one:
#: every third of the lease, when it renews it)
BEAT_S = 2.0
#: how often an idle keeper asks a shared queue for the next job
CLAIM_EVERY_S = 0.5
#: the part of its lease a holder tells its ranks it is sure of (from the heartbeat's send): the
#: rest covers a clock running a little fast and the moment between a rank's check and its write
SURE_OF = 0.9


@dataclass
class Pending:
    """Writes the keeper could not make while its store was unavailable, made in order once it
    answers again (each raises :class:`QueueUnavailable` while it still does not)."""

    writes: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)

    def add(self, what: str, write: Callable[[], Any]) -> None:
        self.writes.append((what, write))

    def flush(self) -> list[str]:
        """Make the pending writes in order, stopping at the first that still cannot be made;
        returns what was made."""
        done = []
        while self.writes:
            what, write = self.writes[0]
            write()
            self.writes.pop(0)
            done.append(what)
        return done

    def __bool__(self) -> bool:
        return bool(self.writes)


@dataclass(frozen=True)
class Holding:
    """The job the group makes: its id and the attempt this keeper was given (its token)."""

    job_id: str
    attempt: int


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
    """Runs rank groups for the queue until :meth:`shutdown`. ``may_claim`` says why the server
    takes no job now (None: it may; the shared directory failing its check, say);
    ``stamp``: what each published record is stamped with (the pool and fleet identity)."""

    def __init__(self, group_spec: GroupSpec, queue: JobStore, dirs: ServerDirs, extra_env: Optional[dict] = None,
                 on_completed: Optional[Callable[[dict], None]] = None, retention: Optional[Retention] = None,
                 index: int = 0, holds: str = "all of the node",
                 may_claim: Callable[[], Optional[str]] = lambda: None, stamp: Optional[dict] = None):
        super().__init__(name=f"wan-s2v-keeper-{index}", daemon=True)
        self.group_spec, self.queue, self.dirs, self.extra_env = group_spec, queue, dirs, extra_env
        self.index, self.holds = index, holds  # which of the server's groups (--replicas), and on what
        self.on_completed = on_completed  # called with a completed job's record (the metrics)
        self.retention = retention or Retention()
        self.may_claim, self.stamp = may_claim, dict(stamp or {})
        self._swept = 0.0
        self._backoff = RESTART_BACKOFF_S[0]
        self.ranks: list[dict[str, Any]] = []  # each rank's stage and memory, from its events
        self.last_steps_per_s: Optional[float] = None  # the last completed job's denoising speed
        self.state = GroupState.LOADING
        self.restarts = 0
        self.groups = 0
        self.run_dir: Optional[Path] = None
        self.holding: Optional[Holding] = None  # the job the group makes, and this keeper's attempt
        self.progress: dict[str, Progress] = {}  # live progress of the running job (by id)
        self.outcome = None  # the last group's Outcome
        self.last_error: Optional[str] = None
        self.started_at = time.time()
        self._cancel_sent: set[str] = set()
        self._seq = 0
        # a shared queue: the lease on the running job is renewed every third of it; one server's: a
        # look for cancels every few seconds (the API tells this keeper directly besides)
        self.beat_every_s = (queue.lease_s or 3 * BEAT_S) / 3
        self._beat_at = 0.0
        self._claim_at = 0.0  # a shared queue is asked for the next job at most every CLAIM_EVERY_S
        self._lost: set[str] = set()  # jobs whose lease this keeper lost (another holder's now)
        self.pending = Pending()  # ends and failures to record once the store answers again
        self._up_since: Optional[float] = None  # since when the store answers this keeper (it reaps a lease later)
        self.completed = 0  # jobs this keeper's groups completed (a group that did work is no crash loop)
        self._closing = threading.Event()  # shutdown asked
        self._halt = threading.Event()  # stop the ranks now
        self._lock = threading.Lock()

    @property
    def current(self) -> Optional[str]:
        """The job the group is making (the API's view)."""
        holding = self.holding
        return holding.job_id if holding else None

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

    # ----- the lease -----
    def _tell_lease(self, holding: Holding, until: float = 0.0, lost: bool = False) -> None:
        """Tell the ranks how long this keeper is sure it holds the job (a shared queue only: one
        server's jobs have no lease, and no lease file)."""
        if self.queue.shared and self.run_dir is not None:
            inbox.write_lease(self.run_dir, holding.job_id, inbox.Lease(holding.attempt, until, lost))

    def beat(self) -> None:
        """Every :attr:`beat_every_s`: record what waits to be recorded, renew the lease on the
        running job (with its live progress, for the other servers of a shared queue), pass on a
        cancel asked anywhere, and give back the jobs of servers whose leases ran out. After the
        store was unavailable, a keeper reaps only once it has answered for a whole lease: every
        holder that outlived the outage has renewed its lease by then, so an outage longer than
        the lease does not hand running jobs over (a holder that did not come back is reaped)."""
        now = time.time()
        if now - self._beat_at < self.beat_every_s:
            return
        self._beat_at = now
        try:
            for what in self.pending.flush():
                log.warning("recorded now that the queue answers again: %s", what)
            with self._lock:
                holding = self.holding
                running = {holding.job_id: Held(holding.attempt, self.progress[holding.job_id].as_dict(now)
                                                if holding.job_id in self.progress else None)} if holding else {}
            beat = self.queue.heartbeat(running)
            with self._lock:
                if holding is not None and holding == self.holding:
                    if holding.job_id in beat.lost:  # another holder has it (or will): stop, write nothing more
                        log.warning("job %s: this server's lease ran out and the job was taken back; stopping it "
                                    "here (its files and its end are its new holder's)", holding.job_id)
                        self._lost.add(holding.job_id)
                        self._tell_lease(holding, lost=True)
                        self._send_cancel(holding.job_id)
                    else:  # renewed: sure of it until most of the lease from the send
                        self._tell_lease(holding, until=now + SURE_OF * (self.queue.lease_s or 0))
                for job_id in beat.cancel:
                    self._send_cancel(job_id)
            self._up_since = self._up_since or now
            if self.last_error and self.last_error.startswith("the queue is unavailable"):
                self.last_error = None
            reaped = self.queue.reap() if now - self._up_since >= (self.queue.lease_s or 0) else None
        except QueueUnavailable as e:  # the database away: the group goes on; the next beat tries again
            self.last_error = f"the queue is unavailable: {e}"
            self._up_since = None
            return
        except Exception as e:  # never a dead keeper: /health says it
            log.exception("the keeper's heartbeat failed")
            self.last_error = f"heartbeat: {type(e).__name__}: {e}"
            return
        if reaped is None:
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
            failed, self.holding = self.holding, None
            self.progress.clear()
            self.run_dir = None
            self.ranks = []
        reason = (self.outcome.reason if self.outcome is not None and self.outcome.reason
                  else self.last_error or "the rank group ended")
        if failed is not None and not self._closing.is_set():
            self._record(f"job {failed.job_id}: its rank group failed",
                         lambda: self._group_failed_under(failed, reason))
        if self._closing.is_set():
            return
        self.last_error = reason
        self.restarts += 1
        self.state = GroupState.RESTARTING
        if self.completed > served_before:
            self._backoff = RESTART_BACKOFF_S[0]  # it did work: not a crash loop
        self._closing.wait(self._backoff)
        self._backoff = min(self._backoff * 2, RESTART_BACKOFF_S[1])

    def _group_failed_under(self, holding: Holding, reason: str) -> None:
        """The group ended under the job: back to the queue (its clip checkpoints kept), or failed
        for good, or, deleted while it ran, gone with its files; nothing, if another holder has it."""
        if holding.job_id in self._lost:
            self._lost.discard(holding.job_id)
            return
        row = self.queue.get(holding.job_id)
        if row is None or row.attempt != holding.attempt:
            return  # not ours any more
        if row.deleting:
            if self.queue.finish(holding.job_id, holding.attempt, JobStatus.CANCELLED, error="deleted"):
                self._after_end(holding.job_id)
        elif self.queue.group_failed(holding.job_id, holding.attempt, reason) is JobStatus.FAILED:
            self._after_end(holding.job_id)

    def _record(self, what: str, write: Callable[[], Any]) -> None:
        """``write()`` now, or, while the store is unavailable, once it answers (in order)."""
        if not self.pending:
            try:
                write()
                return
            except QueueUnavailable as e:
                self.last_error = f"the queue is unavailable: {e}"
        log.warning("the queue is unavailable: %s is recorded when it answers again", what)
        self.pending.add(what, write)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the group: an idle one is told to stop; a job in progress is interrupted (it stays
        in the queue and resumes from its last clip when the server starts again)."""
        self.begin_shutdown()
        self.finish_shutdown(grace_s)

    def begin_shutdown(self) -> None:
        """Ask the group to stop (an idle one is told; a busy one is interrupted)."""
        self._closing.set()
        with self._lock:
            run_dir, busy = self.run_dir, self.holding is not None
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
        if self.state is GroupState.IDLE and self.holding is None and not self._closing.is_set():
            self._post_next()

    def _on_rank0(self, ev: dict, kind: Optional[str]) -> None:
        with self._lock:
            holding = self.holding
            p = self.progress.get(holding.job_id) if holding else None
            if kind == "stage":
                if ev.get("stage") == Stage.IDLE:
                    self.state = GroupState.IDLE
                elif holding is not None:
                    self.state = GroupState.WORKING
            if p is not None and kind in ("stage", "progress", "preview"):
                p.on_event(ev)
            if kind not in ("job_done", "job_cancelled", "job_failed", "job_lost") or holding is None \
                    or ev.get("id") != holding.job_id:
                return
            self.holding = None
            done = self.progress.pop(holding.job_id, None)
            if kind == "job_done" and done is not None:
                self.last_steps_per_s = done.steps_per_s(float(ev["t"])) or self.last_steps_per_s
        if self.run_dir is not None:
            inbox.drop_lease(self.run_dir, holding.job_id)
        if holding.job_id in self._lost or kind == "job_lost":  # another holder has it: its end and files
            self._lost.discard(holding.job_id)
            return
        kept = {"preview_clips": done.preview_clips} if done is not None and done.preview_clips else None
        if kind == "job_cancelled":  # what it made so far stays (the published ID.partial.mp4)
            self._record(f"job {holding.job_id} cancelled",
                         lambda: self._end(holding, JobStatus.CANCELLED, error="cancelled", record=kept))
        elif kind == "job_failed":  # the job's own error: the ranks stay up and take the next job
            error = str(ev.get("error") or "the job failed")
            self._record(f"job {holding.job_id} failed",
                         lambda: self._end(holding, JobStatus.FAILED, error=error, record=kept))
        else:
            self._record(f"job {holding.job_id} completed", lambda: self._completed(holding))

    def _end(self, holding: Holding, status: JobStatus, *, error: Optional[str] = None,
             record: Optional[dict] = None) -> bool:
        """End the job through the store's fenced finish (its files published in the same
        transaction); whether it was this holder's to end."""
        publish = publisher(self.dirs, holding.job_id, holding.attempt, status, stamp=self._stamp(holding))
        if not self.queue.finish(holding.job_id, holding.attempt, status, error=error, record=record,
                                 publish=publish):
            log.warning("job %s ended here, but this server no longer holds it: its end is not recorded",
                        holding.job_id)
            return False
        self._after_end(holding.job_id)
        return True

    def _stamp(self, holding: Holding) -> dict:
        return {**self.stamp, "attempt": holding.attempt}

    def _after_end(self, job_id: str) -> None:
        """A job ended, however it ended: nothing of it is left to resume from (its attempts'
        folders and uploads go); deleted while it ran, it goes whole (video, record, row); then
        retention."""
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
            try:
                retention_sweep(self.retention, self.queue, self.dirs, now)
            except QueueUnavailable:
                pass  # the next sweep

    def _completed(self, holding: Holding) -> bool:
        """Record a completed job (its mp4 and record published); whether it was this keeper's."""
        own = self.dirs.attempt(holding.job_id, holding.attempt) / self.dirs.record(holding.job_id).name
        try:
            record = json.loads(own.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if record is None:
            return self._end(holding, JobStatus.FAILED, error="rank 0 finished the job but wrote no record")
        record = {**record, **self._stamp(holding), "output": {**record.get("output", {}),
                                                               "path": str(self.dirs.video(holding.job_id))}}
        if not self._end(holding, JobStatus.COMPLETED, record=record):
            return False
        self.completed += 1
        if self.on_completed is not None:
            try:
                self.on_completed(record)
            except Exception:  # the metrics must never cost the queue an event
                traceback.print_exc()
        return True

    def _post_next(self) -> None:
        if self.pending:  # what the store has not heard yet comes first
            return
        now = time.time()
        if self.queue.shared and now < self._claim_at:  # every idle keeper of every server asks: not at every poll
            return
        self._claim_at = now + CLAIM_EVERY_S
        why_not = self.may_claim()
        if why_not is not None:
            self.last_error = why_not
            return
        while True:
            try:
                row = self.queue.claim_next()
            except QueueUnavailable as e:
                self.last_error = f"the queue is unavailable: {e}"
                return
            if row is None:
                return
            holding = Holding(row.id, row.attempt)
            if self._start(row, holding, now):
                return

    def _start(self, row: JobRow, holding: Holding, claimed_at: float) -> bool:
        """Prepare a claimed job and post it to the ranks; False when it ended without them
        (cancelled while the server was down, made before, or not preparable)."""
        remove_partial_videos(self.dirs.videos, row.id)  # what a dead server left half-written of it
        if row.cancel_requested:  # cancelled while the server was down
            self._record(f"job {row.id} cancelled", lambda: self._end(holding, JobStatus.CANCELLED, error="cancelled"))
            return False
        try:
            job = self._prepare(row)
        except Exception as e:  # a claimed job never stays in progress without a group: it fails
            traceback.print_exc()
            error = f"the job could not be prepared: {type(e).__name__}: {e}"
            self._record(f"job {row.id} failed", lambda: self._end(holding, JobStatus.FAILED, error=error))
            return False
        if job is None:  # its mp4 and record were published before the server went down
            return False
        with self._lock:
            self._seq += 1
            self.holding = holding
            self.progress[row.id] = Progress(started=time.time())
            self._tell_lease(holding, until=claimed_at + SURE_OF * (self.queue.lease_s or 0))
            inbox.post_job(self.run_dir, self._seq, job.model_dump_json())
        # a cancel that came after the claim but before ``holding`` named it: the API's
        # cancel_running found another job current, so it is passed on here (a later one
        # finds this job current and passes itself)
        try:
            again = self.queue.get(row.id)
        except QueueUnavailable:
            return True  # the next beat passes a cancel on
        if again is not None and again.cancel_requested:
            with self._lock:
                self._send_cancel(row.id)
        return True

    def _prepare(self, row: JobRow) -> Optional[Job]:
        """A claimed row -> the job to post, in its attempt's own folder, resuming from the newest
        complete clip checkpoint any attempt wrote (None: its mp4 and record were published
        before the server went down; it is completed now)."""
        from wan_s2v_runner.launcher.job_book import done_before

        job_spec = JobSpec(**job_defaults(row.spec))  # a row from before the split holds a whole RunSpec
        published = done_before(RunSpec.of(self.group_spec, job_spec), self.dirs.record(row.id),
                                self.dirs.video(row.id))
        if published is not None:
            self._record(f"job {row.id} completed before", lambda: self._completed_before(row, published))
            return None
        own = self.dirs.attempt(row.id, row.attempt)
        own.mkdir(parents=True, exist_ok=True)
        spec = RunSpec.of(self.group_spec, job_spec.model_copy(update={"output": own / f"{row.id}.mp4"}))
        earlier = [folder for folder in self.dirs.attempts(row.id) if folder != own]
        resumed = resume_point(spec, [*earlier, self.dirs.work(row.id)], own)
        if resumed is not None:
            spec = spec.model_copy(update={"resume_from": resumed})
        return Job(id=row.id, spec=spec.job, work_dir=own, record=own / self.dirs.record(row.id).name)

    def _completed_before(self, row: JobRow, record: dict) -> None:
        if self.queue.finish(row.id, row.attempt, JobStatus.COMPLETED, record=record):
            self._after_end(row.id)


def stop_keepers(keepers: list[Keeper], grace_s: float = 10.0) -> None:
    """Stop every group at once (each interrupted job resumes when the server starts again)."""
    running = [k for k in keepers if k.is_alive()]
    for k in running:
        k.begin_shutdown()
    for k in running:
        k.finish_shutdown(grace_s)
