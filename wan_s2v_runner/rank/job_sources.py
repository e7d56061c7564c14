"""Where this rank group's jobs come from, as its launcher chose (the :class:`JobSource` recorded in
the run's spec.json: :mod:`wan_s2v_runner.shared.job_source`), behind one interface (:class:`Jobs`)
for the group's loop (:mod:`wan_s2v_runner.rank.worker`):

- :class:`ListedJobs`: the run's own one job (``wan-s2v run``), or the launcher's ``jobs.jsonl`` in
  order (``wan-s2v batch``); rank 0 reads them and every rank hears the same list;
- :class:`InboxJobs`: each job a server posts to the run directory's inbox until it says stop
  (``wan-s2v serve``); rank 0 reads the inbox and tells every rank. A served job is stopped at a
  denoising step when its server cancels it or loses its lease, rank 0 writes a served job's
  files only while the lease holds (:mod:`~wan_s2v_runner.rank.lease`), and a Python error in
  one may be the job's alone (:mod:`~wan_s2v_runner.rank.job_errors`).

Which jobs rank 0 reads reaches every rank by a broadcast, so all ranks take the same jobs; whether
a job stops, rank 0 alone answers, and the loop's step message carries it to every rank
(:mod:`~wan_s2v_runner.rank.step_control`), so all ranks stop it at the same step or block.
"""
from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol, runtime_checkable

from wan_s2v_runner.rank import job_errors
from wan_s2v_runner.rank.lease import ALWAYS, SAY_EVERY_S, LeaseGate
from wan_s2v_runner.shared import inbox
from wan_s2v_runner.shared.events import EventKind
from wan_s2v_runner.shared.job_source import JobSource
from wan_s2v_runner.shared.jobs import Job, read_jobs
from wan_s2v_runner.shared.spec import GroupSpec, RunSpec
from wan_s2v_runner.shared.stages import Stage


class JobEnd(str, Enum):
    """Rank 0's word to every rank that a job ends before it is done, and how (broadcast; None: go on):
    before its ranks start it (``RankGroup.start_job``: FAILED with its cause, or LOST) or at a
    denoising step or block of a served job (:meth:`Jobs.stop_requested`: LOST or CANCELLED)."""

    FAILED = "failed"  # its inputs or its speech: the job's own error, the group goes on
    LOST = "lost"  # its server lost it to another holder: nothing more of it is written here
    CANCELLED = "cancelled"  # its server cancelled it


def from_rank0(value):
    """Rank 0's ``value``, on every rank (on several nodes only node 0's counts)."""
    import torch.distributed as dist

    box = [value]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


@runtime_checkable
class Jobs(Protocol):
    """A rank group's jobs, the same on every rank."""

    #: the jobs are a server's (their errors may be theirs alone; cancels and leases apply)
    served: bool
    #: the job-error control group of a served group (rank.job_errors), made as its jobs start
    control: object

    @property
    def count(self) -> Optional[int]:
        """How many jobs there are, once known (None while serving)."""

    def __iter__(self) -> Iterator[Job]:
        """The jobs in order; every rank iterates together (their collectives match)."""

    def gate(self, job: Job) -> LeaseGate:
        """What rank 0 may write of ``job`` into a shared directory, and when (others: always)."""

    def stop_requested(self, job: Job, gate: LeaseGate) -> Optional[JobEnd]:
        """Asked by the loop at each step or block of ``job`` on every rank, answered on this
        rank alone (no collective: the loop's step message carries it to the others): None (go
        on) or how it stops."""

    def ended(self, job: Job) -> None:
        """``job`` ended (made, failed, cancelled or lost)."""


class ListedJobs:
    """The jobs a launcher listed: the run's own one (:attr:`JobSource.RUN`) or ``jobs.jsonl``'s
    (:attr:`JobSource.LIST`). Nothing stops one at a step, and every rank may always write."""

    served = False
    control = None

    def __init__(self, source: JobSource, spec: GroupSpec, run_dir: Path, rank: int):
        if source is JobSource.RUN and not isinstance(spec, RunSpec):  # on every rank: none waits on rank 0
            raise TypeError(f"{run_dir}/spec.json: a run's group needs a run's spec (with its job)")
        self.source, self.spec, self.run_dir, self.rank = source, spec, run_dir, rank
        self._count: Optional[int] = None

    @property
    def count(self) -> Optional[int]:
        return self._count

    def _read(self) -> list[Job]:
        if self.source is JobSource.LIST:
            listed = read_jobs(self.run_dir)
            if listed is None:
                raise FileNotFoundError(f"{self.run_dir}: a batch's group has no jobs.jsonl")
            return listed
        return [Job(id="run", spec=self.spec.job, work_dir=self.run_dir)]

    def __iter__(self) -> Iterator[Job]:
        texts = [job.model_dump_json() for job in self._read()] if self.rank == 0 else None
        texts = from_rank0(texts)  # rank 0's paths: every rank's job writes where node 0's does
        self._count = len(texts)
        yield from (Job.model_validate_json(text) for text in texts)

    def gate(self, job: Job) -> LeaseGate:
        return ALWAYS

    def stop_requested(self, job: Job, gate: LeaseGate) -> Optional[JobEnd]:
        return None

    def ended(self, job: Job) -> None:
        pass


class InboxJobs:
    """The jobs a server posts to the inbox (:attr:`JobSource.INBOX`, :mod:`wan_s2v_runner.shared.inbox`),
    one at a time until it says stop. While none waits, the ranks idle (``on_idle`` runs at each
    quiet look: the group finishes what it may meanwhile) and say ``waiting`` now and then."""

    served = True
    count = None

    def __init__(self, spec: GroupSpec, run_dir: Path, rank: int, events, on_idle: Callable[[], None]):
        self.spec, self.run_dir, self.rank, self.events, self.on_idle = spec, run_dir, rank, events, on_idle
        self.control = None

    def __iter__(self) -> Iterator[Job]:
        self.control = job_errors.control_group()  # every rank, here: where a job's error is asked about
        while True:
            message = self._wait_for_job()
            if message.get("stop"):
                return
            yield Job.model_validate_json(message["job"])

    def _wait_for_job(self) -> dict:
        """Idle until the server posts a job or says stop: rank 0 looks at the inbox every
        :data:`~wan_s2v_runner.shared.inbox.IDLE_POLL_S` and tells every rank (``{}``: nothing
        yet), so no rank waits in one collective long; every rank says ``waiting`` now and then
        (the hang watchdog's sign of life for an idle group)."""
        self.events.stage(Stage.IDLE)
        said = time.time()
        while True:
            message: dict = {}
            if self.rank == 0:
                deadline = time.time() + inbox.IDLE_POLL_S
                while not message:
                    if inbox.stopping(self.run_dir):
                        message = {"stop": True}
                    else:
                        posted = inbox.take_job(self.run_dir)
                        if posted is not None:
                            message = {"job": posted}
                    if message or time.time() >= deadline:
                        break
                    time.sleep(0.05)
            message = from_rank0(message)
            if message:
                return message
            self.on_idle()
            if time.time() - said >= SAY_EVERY_S:
                said = time.time()
                self.events.emit(EventKind.WAITING)

    def gate(self, job: Job) -> LeaseGate:
        """Rank 0's view of the job's lease: what it may write into the shared directory."""
        if self.rank != 0:
            return ALWAYS
        # a wait stays well below the process group's timeout: the other ranks wait in a collective
        return LeaseGate(self.run_dir, job.id, say=lambda: self.events.emit(EventKind.WAITING),
                         limit_s=self.spec.pg_timeout_s / 2)

    def stop_requested(self, job: Job, gate: LeaseGate) -> Optional[JobEnd]:
        """Rank 0 reads the inbox (lost first: a lost job's cancel is its server's way of saying so
        too); the other ranks say None (the loop's step message tells them rank 0's word)."""
        if self.rank != 0:
            return None
        if gate.verdict() is inbox.Verdict.LOST:
            return JobEnd.LOST
        if inbox.cancelled(self.run_dir, job.id):
            return JobEnd.CANCELLED
        return None

    def ended(self, job: Job) -> None:
        if self.rank == 0:
            inbox.job_ended(self.run_dir, job.id)


def for_group(source: JobSource, spec: GroupSpec, run_dir: Path, rank: int, events,
              on_idle: Callable[[], None]) -> Jobs:
    """The jobs of a group whose launcher chose ``source``."""
    if source is JobSource.INBOX:
        return InboxJobs(spec, run_dir, rank, events, on_idle)
    return ListedJobs(source, spec, run_dir, rank)
