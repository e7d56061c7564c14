"""What a keeper holds (:class:`Holds`): the job its rank group makes, the jobs whose end it
still owes the store, how long it is sure of each, and the ones it lost.

A claim gives the keeper a job under an attempt (its fencing token, :class:`Holding`). On a
shared queue it is sure of the job until most of its lease has passed since the last heartbeat
that renewed it was sent (:data:`SURE_OF`); the ranks are told so (they write only while it
lasts, :mod:`wan_s2v_runner.rank.lease`), and so is the publish of the job's files
(:func:`~.dirs.publisher`: no file moved once it is not sure). An end (or a failure) the store
could not take while it was unavailable is *owed* (:class:`Owed`): its lease is renewed with the
running job's at every heartbeat, and it is recorded, in order, once the store answers; if the
lease is lost meanwhile, the end is the new holder's and the owed write is dropped. A write that
fails for any other reason is dropped too, with its cause: it would fail again, and nothing
behind it may wait for it forever.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from wan_s2v_runner.serve.store.protocol import Beat, Held, QueueUnavailable
from wan_s2v_runner.shared.atomic import NotCommitted

log = logging.getLogger("wan_s2v.keeper")

#: the part of its lease a holder is sure of (from the heartbeat's send): the rest covers a clock
#: running a little fast and the moment between a check and the write after it
SURE_OF = 0.9


@dataclass(frozen=True)
class Holding:
    """A job this keeper holds: its id and the attempt the claim gave (the fencing token)."""

    job_id: str
    attempt: int


@dataclass
class Owed:
    """A write for a held job the store has not taken yet: what it is, and the write (it raises
    :class:`QueueUnavailable` or :class:`NotCommitted` while it cannot be made yet)."""

    holding: Holding
    what: str
    write: Callable[[], Any]


@dataclass
class Holds:
    """The keeper's holds (see the module's docstring); ``lease_s`` None: one server's queue (no
    leases: always sure)."""

    lease_s: Optional[float]
    running: Optional[Holding] = None
    owed: list[Owed] = field(default_factory=list)
    sure_until: dict[str, float] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)

    def sure(self, job_id: str) -> bool:
        """Whether this keeper is sure it still holds ``job_id`` (no other holder can have it)."""
        return self.lease_s is None or time.time() < self.sure_until.get(job_id, 0.0)

    def until(self, sent_at: float) -> float:
        """How long a lease renewed by a heartbeat sent at ``sent_at`` is sure."""
        return sent_at + SURE_OF * (self.lease_s or 0.0)

    def claimed(self, holding: Holding, at: float) -> None:
        """``holding`` was claimed by a call made at ``at`` (the claim set its lease)."""
        self.sure_until[holding.job_id] = self.until(at)

    def held(self, progress: Callable[[str], Optional[dict]]) -> dict[str, Held]:
        """Every job whose lease the next heartbeat renews: the running one (with its live
        progress) and those whose end is owed."""
        out = {o.holding.job_id: Held(o.holding.attempt) for o in self.owed}
        if self.running is not None:
            out[self.running.job_id] = Held(self.running.attempt, progress(self.running.job_id))
        return out

    def heard(self, beat: Beat, sent_at: float) -> Optional[Holding]:
        """A heartbeat sent at ``sent_at`` answered ``beat``: the leases it renewed are sure a
        while longer; an owed write of a job it lost is dropped (the job is its new holder's).
        Returns the running job when it was lost."""
        held = {o.holding.job_id for o in self.owed} | ({self.running.job_id} if self.running else set())
        for job_id in held - beat.lost:
            self.sure_until[job_id] = self.until(sent_at)
        for o in [o for o in self.owed if o.holding.job_id in beat.lost]:
            log.warning("%s: not recorded: the lease ran out and the job was taken back (its end is its new "
                        "holder's)", o.what)
            self.owed.remove(o)
            self.sure_until.pop(o.holding.job_id, None)
        if self.running is not None and self.running.job_id in beat.lost:
            self.lost.add(self.running.job_id)
            return self.running
        return None

    def owe(self, holding: Holding, what: str, write: Callable[[], Any]) -> None:
        self.owed.append(Owed(holding, what, write))

    def settle(self) -> list[str]:
        """Make the owed writes in order, until one cannot be made yet; a write that fails
        otherwise is dropped with its cause. Returns what was recorded."""
        done = []
        while self.owed:
            o = self.owed[0]
            try:
                o.write()
            except (QueueUnavailable, NotCommitted):
                break
            except Exception as e:  # it would fail again: nothing behind it waits for it forever
                log.exception("%s: could not be recorded (%s: %s); dropped", o.what, type(e).__name__, e)
            else:
                done.append(o.what)
            self.owed.pop(0)
            if not any(x.holding == o.holding for x in self.owed) and o.holding != self.running:
                self.sure_until.pop(o.holding.job_id, None)
        return done

    def released(self, holding: Holding) -> None:
        """The job is not held any more (its end recorded, or lost)."""
        if holding != self.running and not any(o.holding == holding for o in self.owed):
            self.sure_until.pop(holding.job_id, None)
