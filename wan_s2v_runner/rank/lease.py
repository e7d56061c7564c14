"""Rank 0's side of fencing: it writes a served job's files into the shared directory only while
its server is sure it still holds the job.

A server on a shared queue holds each job it runs with a lease in the database; its keeper tells
the ranks how long it is sure of it (the inbox's ``lease-<id>.json``: the attempt, a wall time
a little short of what its last heartbeat bought, or that the job is lost, :mod:`~wan_s2v_runner.shared.inbox`).
A server paused past its lease (SIGSTOP, a frozen VM, a swap storm) wakes up with ranks that
do not know whether another server took the job meanwhile; until the keeper renews the lease or
learns it lost the job, :class:`LeaseGate` answers :attr:`~Verdict.UNKNOWN`, and rank 0:

- goes on appending the clips to the job's growing video (the attempt's own file, which no other
  attempt writes), and skips a clip's checkpoint commit (:class:`~wan_s2v_runner.shared.resume.Checkpoint`:
  the next clip's names every clip before it) and a first frame: the denoising goes on through a
  database outage, and nothing it holds grows meanwhile;
- waits before the job's own files (its speech, the final mp4 and record), saying ``waiting`` so
  the hang watchdog knows it lives.

When the lease is lost nothing more is written, and the job stops at the next step on every rank
(:meth:`LeaseGate.verdict` in the step hook, broadcast) or, after the last step, on rank 0 alone
(:class:`JobLost`). A job without a lease file (a server's own queue, ``run``, ``batch``) is
always current.

Every write asks again just before its rename. What this cannot close is the moment between
that check and the rename: a pause exactly there lets one write through after the lease ran
out. It lands in the attempt's own folder, which no other attempt writes, and the files are
moved into place only by the keeper, inside the database transaction that checks the attempt
(the store's ``job_finish``). A wait for a verdict is bounded (``limit_s``, below the process group's
timeout, while the other ranks wait in a collective): past it the job is taken as lost.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from wan_s2v_runner.shared import inbox
from wan_s2v_runner.shared.inbox import Verdict

#: how often a waiting rank 0 looks at the lease again
POLL_S = 0.1
#: how often a waiting rank says it lives (``waiting``: the hang watchdog's sign of life), here and
#: in an idle served group (rank.job_sources)
SAY_EVERY_S = 2.0


class JobLost(Exception):
    """The server lost the job to another holder: its ranks stop it and write nothing more."""


class LeaseGate:
    """Rank 0's view of a served job's lease (``run_dir`` None: not a served group, always current)."""

    def __init__(self, run_dir: Optional[Path], job_id: str, say: Optional[Callable[[], None]] = None,
                 limit_s: float = float("inf")):
        self.run_dir, self.job_id, self.say, self.limit_s = run_dir, job_id, say, limit_s

    def verdict(self) -> Verdict:
        if self.run_dir is None:
            return Verdict.CURRENT
        lease = inbox.read_lease(self.run_dir, self.job_id)
        return Verdict.CURRENT if lease is None else lease.verdict()

    def lost(self) -> bool:
        """Whether the server knows it lost the job (nothing more of it is written)."""
        return self.verdict() is Verdict.LOST

    def current(self) -> bool:
        return self.verdict() is Verdict.CURRENT

    def wait(self) -> bool:
        """Until the lease is current (True) or lost (False: also after :attr:`limit_s`), saying
        it lives meanwhile."""
        said = start = time.time()
        while True:
            v = self.verdict()
            if v is not Verdict.UNKNOWN:
                return v is Verdict.CURRENT
            if time.time() - start > self.limit_s:
                return False
            if self.say is not None and time.time() - said >= SAY_EVERY_S:
                said = time.time()
                self.say()
            time.sleep(POLL_S)

    def wait_or_raise(self) -> None:
        """:meth:`wait`; :class:`JobLost` when the lease is lost (rank 0 alone: no peer waits)."""
        if not self.wait():
            raise JobLost(self.job_id)


#: the gate of a job that has no lease
ALWAYS = LeaseGate(None, "")
