"""The keeper: the server's thread that owns one resident rank group and holds its jobs.

It starts the group from its :class:`~wan_s2v_runner.shared.spec.GroupSpec` alone and reaches it
only through a :class:`~.group.GroupClient` (:class:`~.group.LaunchedGroup`: the launcher on a
thread of its own, ``served``: the ranks load once and wait in stage ``idle``, supervised exactly
like a run: failure attribution, hang watchdog, ``run.json``). On its own clock (every
:data:`TICK_S`, whatever the supervisor is doing) it reads the group's news (the ranks' events)
and:

- claims the next job of its pool when the group is idle and the server may take jobs (the
  claim gives the job a new attempt: this keeper's fencing token), prepares it in the attempt's
  own folder (resuming from the newest complete clip checkpoint any attempt wrote; a job whose
  published mp4 and record are already there is completed without running), tells the ranks
  how long its hold is sure (the inbox's lease file, :mod:`~wan_s2v_runner.rank.lease`), and
  posts it;
- renews the leases of what it holds (:mod:`.holds`; a shared queue) every third of the lease,
  with the running job's live progress (:class:`~.progress.Progress`), and passes on a cancel
  asked anywhere; a holder that learns it lost the job tells its ranks at once (they stop at the
  next step and write nothing more) and leaves the job's end and files to the new holder;
- records ``job_done`` / ``job_cancelled`` / ``job_failed`` through the store's fenced
  :meth:`~.store.protocol.JobStore.job_finish`, which moves the attempt's files into place
  (:func:`~.dirs.publisher`) in the same transaction.

While the store is unavailable (a database restart, a failover) the group goes on with the job
it runs; what the keeper could not record is owed (:mod:`.holds`) and recorded, in order, when
the store answers again, fencing deciding whether it is still this keeper's to record. A write
that fails for another reason (the shared directory full when the files are published, say)
ends the job as failed with that cause, never the keeper. When the group ends under a job (a
rank died or hung), the job goes back to the queue with its failure counted, and the keeper
starts a new group after a back-off. The HTTP side never waits on any of this.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Union

from wan_s2v_runner.launcher.job_book import job_defaults, resume_point
from wan_s2v_runner.serve.dirs import ServerDirs, publisher, remove_partial_videos
from wan_s2v_runner.serve.group import GroupClient, GroupNews, LaunchedGroup
from wan_s2v_runner.serve.holds import Holding, Holds
from wan_s2v_runner.serve.leftovers import group_file
from wan_s2v_runner.serve.progress import GroupState, Progress
from wan_s2v_runner.serve.retention import SWEEP_EVERY_S, Retention
from wan_s2v_runner.serve.retention import sweep as retention_sweep
from wan_s2v_runner.serve.store import rules
from wan_s2v_runner.serve.store.protocol import JobRow, JobStatus, JobStore, QueueUnavailable
from wan_s2v_runner.shared import atomic, inbox
from wan_s2v_runner.shared.atomic import NotCommitted
from wan_s2v_runner.shared.events import EventKind, EventReader
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
#: the end events of a job, as rank 0 reports them
ENDS = frozenset({EventKind.JOB_DONE, EventKind.JOB_CANCELLED, EventKind.JOB_FAILED, EventKind.JOB_LOST})
#: rank 0's events that move a running job's progress
PROGRESS_KINDS = frozenset({EventKind.STAGE, EventKind.PROGRESS, EventKind.PREVIEW, EventKind.LIVE})
#: the keeper's clock: how long it waits for news from its group before it beats and sweeps anyway
TICK_S = 0.2
#: how long a keeper that stops following its group (an error of its own) waits for the group to end
GROUP_END_WAIT_S = 120.0


class Keeper(threading.Thread):
    """Runs rank groups for the queue until :meth:`shutdown`. ``may_claim`` says why the server
    takes no job now (None: it may; the shared directory failing its check, say);
    ``stamp``: what each published record is stamped with (the pool and fleet identity);
    ``new_group``: how a group is made (:class:`~.group.LaunchedGroup`, the launcher's)."""

    def __init__(self, group_spec: GroupSpec, queue: JobStore, dirs: ServerDirs, extra_env: Optional[dict] = None,
                 on_completed: Optional[Callable[[dict], None]] = None, retention: Optional[Retention] = None,
                 index: int = 0, holds: str = "all of the node",
                 may_claim: Callable[[], Optional[str]] = lambda: None, stamp: Optional[dict] = None,
                 new_group: Callable[..., GroupClient] = LaunchedGroup,
                 plan_clip_s: Callable[[RunSpec], Optional[float]] = lambda spec: None):
        super().__init__(name=f"wan-s2v-keeper-{index}", daemon=True)
        self.new_group = new_group
        self.group: Optional[GroupClient] = None  # the group it keeps now
        self.group_spec, self.queue, self.dirs, self.extra_env = group_spec, queue, dirs, extra_env
        self.index, self.holds = index, holds  # which of the server's groups (--replicas), and on what
        self.on_completed = on_completed  # called with a completed job's record (the metrics)
        self.retention = retention or Retention()
        self.may_claim, self.stamp = may_claim, dict(stamp or {})
        #: the plan's seconds a clip of a job's spec (its ETA before its first clip ends; None: unknown)
        self.plan_clip_s = plan_clip_s
        self._swept = 0.0
        self._backoff = RESTART_BACKOFF_S[0]
        self.ranks: list[dict[str, Any]] = []  # each rank's stage and memory, from its events
        self.last_steps_per_s: Optional[float] = None  # the last completed job's denoising speed
        self.state = GroupState.LOADING
        self.restarts = 0
        self.groups = 0
        self.run_dir: Optional[Path] = None
        self.held = Holds(queue.lease_s if queue.shared else None)  # what this keeper holds and owes
        self.progress: dict[str, Progress] = {}  # live progress of the running job (by id)
        self.outcome = None  # the last group's Outcome
        self.last_error: Optional[str] = None
        self.started_at = time.time()
        self._cancel_sent: set[str] = set()
        self._seq = 0
        # a shared queue: the leases are renewed every third of the lease; one server's: a look for
        # cancels every few seconds (the API tells this keeper directly besides)
        self.beat_every_s = (queue.lease_s or 3 * BEAT_S) / 3
        self._beat_at = 0.0
        self._claim_at = 0.0  # a shared queue is asked for the next job at most every CLAIM_EVERY_S
        self._up_since: Optional[float] = None  # since when the store answers every beat (reaping waits a lease)
        self._answered_at: Optional[float] = None  # the last beat it answered
        self.completed = 0  # jobs this keeper's groups completed (a group that did work is no crash loop)
        self._closing = threading.Event()  # shutdown asked
        self._halted_for: Optional[str] = None  # the keeper's own error that stopped its group
        self._lock = threading.Lock()

    @property
    def holding(self) -> Optional[Holding]:
        """The job the group makes, with this keeper's attempt."""
        return self.held.running

    @property
    def current(self) -> Optional[str]:
        """The job the group is making (the API's view)."""
        holding = self.held.running
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

    def note_ranks(self, snapshot: list[dict]) -> None:
        """Each rank's stage and latest memory figures (the status page, /metrics;
        :func:`~.group.ranks_snapshot`)."""
        with self._lock:
            self.ranks = snapshot

    def cancel_running(self, job_id: str) -> None:
        """The API marked ``job_id`` cancelled while it runs: tell the ranks (next step boundary)."""
        with self._lock:
            self._send_cancel(job_id)

    # ----- the lease -----
    def _tell_lease(self, holding: Holding, lost: bool = False) -> None:
        """Tell the ranks how long this keeper is sure it holds the running job (a shared queue
        only: one server's jobs have no lease, and no lease file)."""
        if self.held.lease_s is not None and self.run_dir is not None:
            until = self.held.sure_until.get(holding.job_id, 0.0)
            self.group.renew(holding.job_id, inbox.Lease(holding.attempt, until, lost))

    def beat(self) -> None:
        """Every :attr:`beat_every_s`: renew the leases of what this keeper holds (the running
        job with its live progress, for the other servers of a shared queue, and the jobs whose
        end it owes), pass on a cancel asked anywhere, record what it owes, and give back the jobs
        of servers whose leases ran out. A keeper reaps only once the store has answered it for a
        whole lease without a break: every holder that outlived an outage has renewed by then, so
        an outage longer than the lease hands no running job over (one that did not come back is
        reaped)."""
        now = time.time()
        if now - self._beat_at < self.beat_every_s:
            return
        self._beat_at = now
        with self._lock:
            held = self.held.held(lambda job_id: self.progress[job_id].as_dict(now) if job_id in self.progress
                                  else None)
        try:
            beat = self.queue.lease_renew(held)
        except QueueUnavailable as e:  # the database away: the group goes on; the next beat tries again
            self.last_error, self._up_since = f"the queue is unavailable: {e}", None
            return
        except Exception as e:  # never a dead keeper: /health says it
            log.exception("the keeper's heartbeat failed")
            self.last_error = f"heartbeat: {type(e).__name__}: {e}"
            return
        if self._answered_at is None or now - self._answered_at > 2 * self.beat_every_s + 5:
            self._up_since = now  # answering again after a break (or for the first time)
        self._answered_at = now
        if self.last_error and self.last_error.startswith("the queue is unavailable"):
            self.last_error = None
        with self._lock:
            lost = self.held.heard(beat, now)
            if lost is not None:  # another holder has it (or will): stop, write nothing more
                log.warning("job %s: this server's lease ran out and the job was taken back; stopping it here "
                            "(its files and its end are its new holder's)", lost.job_id)
                self._tell_lease(lost, lost=True)
                self._send_cancel(lost.job_id)
            elif self.held.running is not None:
                self._tell_lease(self.held.running)
            for job_id in beat.cancel:
                self._send_cancel(job_id)
        for what in self.held.settle():
            log.warning("recorded now that the queue answers: %s", what)
        if now - (self._up_since or now) < (self.queue.lease_s or 0):
            return
        try:
            reaped = self.queue.lease_reap()
        except Exception as e:  # the next beat tries again
            self.last_error = f"reap: {type(e).__name__}: {e}"
            return
        if reaped.requeued:
            log.warning("jobs whose server stopped renewing their leases are queued again (they resume from "
                        "their last clip): %s", ", ".join(reaped.requeued))
        for job_id in reaped.deleted:  # deleted while a server that died ran them
            self.dirs.remove_job_files(job_id, video=True)

    def _send_cancel(self, job_id: str) -> None:
        if job_id == self.current and self.run_dir is not None and job_id not in self._cancel_sent:
            self.group.cancel(job_id)
            self._cancel_sent.add(job_id)

    # ----- the thread -----
    def run(self) -> None:
        self._backoff = RESTART_BACKOFF_S[0]  # what a killed server's groups left: run_server stopped it
        while not self._closing.is_set():
            try:
                self._one_group()
            except Exception as e:  # never a silent death: /health says it, the log has it, and the keeper goes on
                log.exception("the keeper failed; it starts the rank group again")
                self.last_error = f"keeper: {type(e).__name__}: {e}"
                self.state = GroupState.RESTARTING
                self._closing.wait(self._backoff)
                self._backoff = min(self._backoff * 2, RESTART_BACKOFF_S[1])
        self.state = GroupState.STOPPED

    def _one_group(self) -> None:
        """One rank group's life, then what became of its job, then the back-off before the next."""
        self.state, self.outcome, self._halted_for = GroupState.LOADING, None, None
        self.groups += 1
        served_before = self.completed
        group = self.new_group(self.group_spec, self.extra_env, name=f"wan-s2v-group-{self.index}")
        with self._lock:
            self.group = group
        group.start()
        if self._closing.is_set():  # a shutdown asked before there was a group to tell
            group.halt()
        try:
            self._follow(group)
        except BaseException:  # never a group left running by a keeper that stopped following it
            group.halt()
            deadline = time.time() + GROUP_END_WAIT_S
            while not group.events(timeout=TICK_S).ended and time.time() < deadline:
                pass
            raise
        self._late_end()
        with self._lock:
            failed, self.held.running = self.held.running, None
            self.progress.clear()
            self.run_dir, self.group = None, None
            self.ranks = []
        reason = (self._halted_for or (self.outcome.reason if self.outcome is not None and self.outcome.reason
                                       else self.last_error) or "the rank group ended")
        if failed is not None and not self._closing.is_set():
            self._record(failed, "its rank group failed", lambda: self._group_failed_under(failed, reason))
        if self._closing.is_set():
            return
        self.last_error = reason
        self.restarts += 1
        self.state = GroupState.RESTARTING
        if self.completed > served_before:
            self._backoff = RESTART_BACKOFF_S[0]  # it did work: not a crash loop
        self._closing.wait(self._backoff)
        self._backoff = min(self._backoff * 2, RESTART_BACKOFF_S[1])

    def _follow(self, group: GroupClient) -> None:
        """The group's life on the keeper's clock, until the launcher returned. A job is posted
        only at a tick that brought the supervisor's poll of a group still running (not once the
        launcher reported how the group ended: it is stopping its ranks)."""
        finishing = False
        while True:
            news = group.events(timeout=TICK_S)
            if news.outcome is not None:
                self.outcome, finishing = news.outcome, True
            if news.error:  # the launcher itself failed: say so, and try again
                self.last_error = news.error
            self._tick(news, may_post=news.ranks is not None and not finishing and not news.ended)
            if news.ended:
                return

    def _tick(self, news: GroupNews, may_post: bool) -> None:
        """One tick of the keeper's clock: the group's start and its ranks' states and new events
        first (a failing beat must not cost them), then the lease beat and retention's sweep. An
        error is shown in /health and logged; under the test suite's strict observers
        (``strict_observers``) it also stops the group, as an observer's error stops a strict run,
        and is the reason the group ended."""
        try:
            if news.started is not None:
                self.group_started(news.started)
            if news.ranks is not None:
                self.note_ranks(news.ranks)
            self.on_events(news.events, may_post=may_post)
            if not news.ended:
                self.beat()
                self.sweep(every_s=SWEEP_EVERY_S)
        except Exception as e:
            log.exception("the keeper could not follow its rank group")
            self.last_error = f"keeper: {type(e).__name__}: {e}"
            if self.group_spec.strict_observers and self.group is not None and self._halted_for is None:
                self._halted_for = self.last_error
                self.group.halt()

    def _late_end(self) -> None:
        """Rank 0's end of the running job that the group's supervision did not pass on: rank 0
        finished the job (its mp4 written, then ``job_done``) while its group was being stopped
        (the server's SIGTERM) or just before the group died. Recorded as it ended, rather than left
        in the queue to be made again from its last clip (tests/test_serve_shared_queue.py: each
        of 50 jobs made once while both servers restart)."""
        with self._lock:
            run_dir, holding = self.run_dir, self.held.running
        if run_dir is None or holding is None:
            return
        for ev in EventReader(run_dir).poll():
            kind = EventKind.coerce(ev.get("kind"))
            if ev.get("rank") == 0 and kind in ENDS and ev.get("id") == holding.job_id:
                log.info("job %s: its end (%s) came as its rank group stopped", holding.job_id, kind)
                self._on_rank0(ev, kind)
                return

    def _group_failed_under(self, holding: Holding, reason: str) -> None:
        """The group ended under the job: back to the queue (its clip checkpoints kept), or failed
        for good (what it made so far published), or, deleted while it ran, gone with its files;
        nothing, if another holder has it."""
        if holding.job_id in self.held.lost:
            self.held.lost.discard(holding.job_id)
            return
        row = self.queue.job_get(holding.job_id)
        if row is None or row.attempt != holding.attempt:
            return  # not ours any more
        if row.deleting:
            if self.queue.job_finish(holding.job_id, holding.attempt, JobStatus.CANCELLED, error="deleted"):
                self._after_end(holding.job_id)
            return
        publish = publisher(self.dirs, holding.job_id, holding.attempt, JobStatus.FAILED,
                            sure=lambda: self.held.sure(holding.job_id))
        if self.queue.job_attempt_failed(holding.job_id, holding.attempt, reason, publish=publish) is JobStatus.FAILED:
            self._after_end(holding.job_id)

    def _record(self, holding: Holding, what: str, write: Callable[[], Any], fallback: bool = True) -> None:
        """``write()`` (what this holder records of ``holding``) now, or, while the store cannot
        take it, once it does (in order, after what is owed already). A write that fails for
        another reason ends the job as failed, with that cause, without its files."""
        what = f"job {holding.job_id}: {what}"
        if not self.held.owed:
            try:
                write()
                self.held.released(holding)
                return
            except QueueUnavailable as e:
                self.last_error = f"the queue is unavailable: {e}"
            except NotCommitted:  # its lease is not sure now: after the next heartbeat renews it
                pass
            except Exception as e:
                log.exception("%s: could not be recorded", what)
                error = f"{what} could not be recorded: {type(e).__name__}: {e}"
                if fallback:  # failed as such, its files left where they are
                    self._record(holding, "failed, its files not published", lambda: self._ended_bare(holding, error),
                                 fallback=False)
                return
        log.warning("%s: recorded when the queue answers again", what)
        self.held.owe(holding, what, write)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the group: an idle one is told to stop; a job in progress is interrupted (it stays
        in the queue and resumes from its last clip when the server starts again)."""
        self.begin_shutdown()
        self.finish_shutdown(grace_s)

    def begin_shutdown(self) -> None:
        """Ask the group to stop (an idle one is told; a busy one is interrupted)."""
        self._closing.set()
        with self._lock:
            group, run_dir, busy = self.group, self.run_dir, self.held.running is not None
        if group is None:
            return  # the loop halts the group it starts next
        if run_dir is not None and not busy:
            group.stop()
        else:
            group.halt()

    def finish_shutdown(self, grace_s: float = 10.0) -> None:
        """Wait up to ``grace_s`` for the group to stop, then stop its ranks now."""
        self.join(grace_s)
        if self.is_alive():
            with self._lock:
                group = self.group
            if group is not None:
                group.halt()
            self.join(grace_s)

    # ----- the group's news, on this thread -----
    def group_started(self, run_dir: Path) -> None:
        with self._lock:
            self.run_dir = run_dir
            self._cancel_sent.clear()
        # for the next server, if this one is killed: what to look for among the processes
        atomic.write_text(group_file(self.dirs.root, self.index), json.dumps({"run_dir": str(run_dir)}))

    def on_events(self, new_events: list[dict], may_post: bool = True) -> None:
        for ev in new_events:
            if ev.get("rank") == 0:
                try:
                    self._on_rank0(ev, EventKind.coerce(ev.get("kind")))
                except Exception as e:  # one event's trouble never costs the others (nor the next job)
                    log.exception("the keeper could not act on rank 0's %s event", ev.get("kind"))
                    self.last_error = f"keeper: {type(e).__name__}: {e}"
        if may_post and self.state is GroupState.IDLE and self.held.running is None and not self._closing.is_set():
            self._post_next()

    def _on_rank0(self, ev: dict, kind: Union[EventKind, str, None]) -> None:
        with self._lock:
            holding = self.held.running
            p = self.progress.get(holding.job_id) if holding else None
            if kind is EventKind.STAGE:
                if ev.get("stage") == Stage.IDLE:
                    self.state = GroupState.IDLE
                elif holding is not None:
                    self.state = GroupState.WORKING
            if p is not None and kind in PROGRESS_KINDS:
                p.on_event(ev)
            if kind not in ENDS or holding is None or ev.get("id") != holding.job_id:
                return
            self.held.running = None
            done = self.progress.pop(holding.job_id, None)
            if kind is EventKind.JOB_DONE and done is not None:
                self.last_steps_per_s = done.steps_per_s(float(ev["t"])) or self.last_steps_per_s
        try:
            self._ended(holding, kind, ev, done)
        except Exception as e:  # never a job left in progress with no one making it: it fails, with the cause
            log.exception("job %s: its end could not be handled", holding.job_id)
            error = f"the job's end could not be handled: {type(e).__name__}: {e}"
            self._record(holding, "failed, its end not handled", lambda: self._ended_bare(holding, error),
                         fallback=False)
            raise

    def _ended(self, holding: Holding, kind: EventKind, ev: dict, done: Optional[Progress]) -> None:
        """Rank 0 ended the job ``kind``: record it (what this holder may record)."""
        if self.run_dir is not None:
            self.group.release(holding.job_id)
        if holding.job_id in self.held.lost or kind is EventKind.JOB_LOST:  # another holder has it: its end and files
            self.held.lost.discard(holding.job_id)
            self.held.released(holding)
            return
        kept: dict = {}  # what it did before it ended: the video so far, the steps it reused (--cache)
        if done is not None and done.preview_clips:
            kept["preview_clips"] = done.preview_clips
        if done is not None and done.steps_reused:
            kept["step_cache"] = {"steps_reused": done.steps_reused}
        kept = kept or None
        if kind is EventKind.JOB_CANCELLED:  # what it made so far stays (the published ID.partial.mp4)
            self._record(holding, "cancelled",
                         lambda: self._end(holding, JobStatus.CANCELLED, error="cancelled", record=kept))
        elif kind is EventKind.JOB_FAILED:  # the job's own error: the ranks stay up and take the next job
            error = str(ev.get("error") or "the job failed")
            told = self._rank_record(holding)  # rank 0's record of the failure (read once, here)
            self._record(holding, "failed", lambda: self._end(holding, JobStatus.FAILED, error=error, record=kept,
                                                               record_file=told))
        else:
            told = self._rank_record(holding)
            self._record(holding, "completed", lambda: self._completed(holding, told))

    def _rank_record(self, holding: Holding) -> Optional[dict]:
        """Rank 0's record of the job in its attempt's folder, stamped with who made it (None: it
        wrote none)."""
        own = self.dirs.attempt(holding.job_id, holding.attempt) / self.dirs.record(holding.job_id).name
        try:
            record = json.loads(own.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return {**record, **self.stamp, "attempt": holding.attempt}

    def _end(self, holding: Holding, status: JobStatus, *, error: Optional[str] = None,
             record: Optional[dict] = None, record_file: Optional[dict] = None) -> bool:
        """End the job through the store's fenced finish (its files, and ``record_file`` as its
        ``ID.json``, published in the same transaction); whether it was this holder's to end."""
        publish = publisher(self.dirs, holding.job_id, holding.attempt, status, record=record_file,
                            sure=lambda: self.held.sure(holding.job_id))
        if not self.queue.job_finish(holding.job_id, holding.attempt, status, error=error, record=record,
                                 publish=publish):
            log.warning("job %s ended here, but this server no longer holds it: its end is not recorded",
                        holding.job_id)
            return False
        self._after_end(holding.job_id)
        return True

    def _ended_bare(self, holding: Holding, error: str) -> None:
        """End the job as failed with ``error``, publishing nothing (what did not let it be recorded
        otherwise: the shared directory full when its files were moved, say)."""
        if self.queue.job_finish(holding.job_id, holding.attempt, JobStatus.FAILED, error=error):
            self._after_end(holding.job_id)

    def _after_end(self, job_id: str) -> None:
        """A job ended, however it ended: nothing of it is left to resume from (its attempts'
        folders and uploads go); deleted while it ran, it goes whole (video, record, row); then
        retention. Never raises: what it could not do now, the restart's purge and the sweeps do."""
        try:
            row = self.queue.job_get(job_id)
        except Exception:  # the row is left to the reap or the restart's purge
            self.dirs.remove_job_files(job_id, video=False)
            return
        deleting = row is None or row.deleting
        self.dirs.remove_job_files(job_id, video=deleting)
        if row is not None and row.deleting:
            try:
                self.queue.job_remove(job_id)
            except Exception:
                pass
        self.sweep()

    def sweep(self, every_s: float = 0.0) -> None:
        """Retention (:mod:`.retention`): delete the ended jobs it says are due (at most every
        ``every_s``)."""
        now = time.time()
        if now - self._swept >= every_s:
            self._swept = now
            try:
                retention_sweep(self.retention, self.queue, self.dirs, now)
            except Exception as e:  # the next sweep
                self.last_error = f"retention: {type(e).__name__}: {e}"

    def _completed(self, holding: Holding, record: Optional[dict]) -> None:
        """Record a completed job (its mp4 and ``record`` published)."""
        if record is None:
            self._end(holding, JobStatus.FAILED, error="rank 0 finished the job but wrote no record")
            return
        record = {**record, "output": {**record.get("output", {}), "path": str(self.dirs.video(holding.job_id))}}
        if not self._end(holding, JobStatus.COMPLETED, record=record, record_file=record):
            return
        self.completed += 1
        if self.on_completed is not None:
            try:
                self.on_completed(record)
            except Exception:  # the metrics must never cost the queue an event
                traceback.print_exc()

    def _post_next(self) -> None:
        if self.held.owed:  # what the store has not heard yet comes first
            return
        now = time.time()
        if self.queue.shared and now < self._claim_at:  # every idle keeper of every server asks: not at every poll
            return
        self._claim_at = now + CLAIM_EVERY_S
        why_not = self.may_claim()
        if why_not is not None:
            self.last_error = why_not
            return
        while not self.held.owed:
            claimed_at = time.time()
            try:
                row = self.queue.job_claim_next()
            except Exception as e:  # QueueUnavailable: the next poll asks again
                self.last_error = f"claim: {type(e).__name__}: {e}"
                return
            if row is None:
                return
            holding = Holding(row.id, row.attempt)
            self.held.claimed(holding, claimed_at)
            if self._start(row, holding):
                return

    def _start(self, row: JobRow, holding: Holding) -> bool:
        """Prepare a claimed job and post it to the ranks; False when it ended without them
        (cancelled while the server was down, made before, taken too often, or not preparable)."""
        remove_partial_videos(self.dirs.videos, row.id)  # what a dead server left half-written of it
        if row.cancel_requested:  # cancelled while the server was down: what it made so far stays
            self._record(holding, "cancelled", lambda: self._end(holding, JobStatus.CANCELLED, error="cancelled"))
            return False
        exhausted = rules.attempts_exhausted(row.attempt)
        if exhausted:
            self._record(holding, "failed", lambda: self._end(holding, JobStatus.FAILED, error=exhausted))
            return False
        try:
            job = self._prepare(row, holding)
        except OSError as e:  # the shared directory for a moment: back to the queue (a failure counted)
            log.exception("job %s could not be prepared", row.id)
            why = f"the job could not be prepared: {type(e).__name__}: {e}"
            self._record(holding, "not prepared", lambda: self.queue.job_attempt_failed(row.id, row.attempt, why))
            return False
        except Exception as e:  # the job itself: it fails (a claimed job never stays in progress without a group)
            traceback.print_exc()
            error = f"the job could not be prepared: {type(e).__name__}: {e}"
            self._record(holding, "failed", lambda: self._end(holding, JobStatus.FAILED, error=error))
            return False
        if job is None:  # its mp4 and record were published before the server went down
            return False
        try:
            plan_clip_s = self.plan_clip_s(job.run_spec(self.group_spec))
        except Exception:  # noqa: BLE001 - an estimate: the ETA waits for the first clip's pace instead
            plan_clip_s = None
        try:
            with self._lock:
                self._seq += 1
                self.held.running = holding  # the lease file names it: the ranks read it before they start
                self._tell_lease(holding)
                self.group.submit(self._seq, job.model_dump_json())
                self.progress[row.id] = Progress(started=time.time(), plan_clip_s=plan_clip_s)
        except Exception as e:  # not posted: back to the queue
            with self._lock:
                self.held.running = None
            log.exception("job %s could not be posted to the ranks", row.id)
            why = f"the job could not be handed to the ranks: {type(e).__name__}: {e}"
            self._record(holding, "not posted", lambda: self.queue.job_attempt_failed(row.id, row.attempt, why))
            return False
        # a cancel that came after the claim but before the job was running here: the API's
        # cancel_running found another job current, so it is passed on here (a later one finds
        # this job current and passes itself)
        try:
            again = self.queue.job_get(row.id)
        except Exception:
            return True  # the next beat passes a cancel on
        if again is not None and again.cancel_requested:
            with self._lock:
                self._send_cancel(row.id)
        return True

    def _prepare(self, row: JobRow, holding: Holding) -> Optional[Job]:
        """A claimed row -> the job to post, in its attempt's own folder, resuming from the newest
        complete clip checkpoint any attempt wrote (None: its mp4 and record were published
        before the server went down; it is completed now)."""
        from wan_s2v_runner.launcher.job_book import done_before

        job_spec = JobSpec(**job_defaults(row.spec))  # a row from before the split holds a whole RunSpec
        published = done_before(RunSpec.of(self.group_spec, job_spec), self.dirs.record(row.id),
                                self.dirs.video(row.id))
        if published is not None:
            self._record(holding, "completed before", lambda: self._completed_before(holding, published))
            return None
        speech_dir = None
        if job_spec.session is not None:
            if row.attempt > 1:  # its caches and the speech it took were the group's that failed under it
                raise ValueError("a live session cannot go on after the rank group making it failed. Fix: create a "
                                 "new session")
            speech_dir = self.dirs.speech(row.id)
        own = self.dirs.attempt(row.id, row.attempt)
        own.mkdir(parents=True, exist_ok=True)
        spec = RunSpec.of(self.group_spec, job_spec.model_copy(update={"output": own / f"{row.id}.mp4"}))
        earlier = [folder for folder in self.dirs.attempts(row.id) if folder != own]
        resumed = resume_point(spec, [*earlier, self.dirs.work(row.id)], own)
        if resumed is not None:
            spec = spec.model_copy(update={"resume_from": resumed})
        return Job(id=row.id, spec=spec.job, work_dir=own, record=own / self.dirs.record(row.id).name,
                   speech_dir=speech_dir)

    def _completed_before(self, holding: Holding, record: dict) -> None:
        if self.queue.job_finish(holding.job_id, holding.attempt, JobStatus.COMPLETED, record=record):
            self._after_end(holding.job_id)


def stop_keepers(keepers: list[Keeper], grace_s: float = 10.0) -> None:
    """Stop every group at once (each interrupted job resumes when the server starts again)."""
    running = [k for k in keepers if k.is_alive()]
    for k in running:
        k.begin_shutdown()
    for k in running:
        k.finish_shutdown(grace_s)
