"""What a server knows of its queue and its shared directory between requests (:class:`Watch`):
a thread asks the queue every :data:`QUEUE_EVERY_S` (its counts by status) and checks the shared
directory every :data:`DIR_EVERY_S` (:func:`~.fleet.shared_dir_problem`: there, writable, the
fleet's marker). ``/health`` and ``/health/ready`` read what it last learned, so they answer at
once however the database is doing; a request that meets the queue down says so here at once.

While the queue is down the server is not ready (a load balancer sends submissions elsewhere)
and ``/health`` says why and since when; while the shared directory fails its check the server is
not ready either, and its keepers claim nothing (:meth:`Watch.claim_refusal`): a job it took
would write where no other server, and no client, would find it.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from wan_s2v_runner.serve.store.protocol import JobStore, QueueUnavailable

log = logging.getLogger("wan_s2v.serve")

QUEUE_EVERY_S = 1.0
DIR_EVERY_S = 5.0


@dataclass(frozen=True)
class Seen:
    """What the watch last learned."""

    queue_error: Optional[str] = None  # the queue is down: why
    queue_down_since: Optional[float] = None
    counts: Optional[dict[str, int]] = None  # jobs by status, when the queue last answered
    dir_problem: Optional[str] = None  # the shared directory failed its check: why
    dir_checked_at: Optional[float] = None


class Watch:
    """The server's watch over its queue and shared directory (see the module's docstring).
    ``dir_check`` returns why the shared directory is not usable (None: it is)."""

    def __init__(self, store: JobStore, dir_check: Callable[[], Optional[str]],
                 queue_every_s: float = QUEUE_EVERY_S, dir_every_s: float = DIR_EVERY_S):
        self.store, self.dir_check = store, dir_check
        self.queue_every_s, self.dir_every_s = queue_every_s, dir_every_s
        self.seen = Seen()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ----- what it learns -----
    def queue_failed(self, error: str) -> None:
        with self._lock:
            if self.seen.queue_error is None:
                log.warning("the queue is unavailable: %s", error)
            since = self.seen.queue_down_since or time.time()
            self.seen = Seen(error, since, self.seen.counts, self.seen.dir_problem, self.seen.dir_checked_at)

    def queue_answered(self, counts: dict[str, int]) -> None:
        with self._lock:
            if self.seen.queue_error is not None:
                log.warning("the queue answers again (it was down %.0f s)", time.time() - self.seen.queue_down_since)
            self.seen = Seen(None, None, counts, self.seen.dir_problem, self.seen.dir_checked_at)

    def check_queue(self) -> None:
        try:
            counts = self.store.job_counts()
        except QueueUnavailable as e:
            self.queue_failed(str(e))
            return
        self.queue_answered(counts)

    def check_dir(self) -> None:
        try:
            problem = self.dir_check()
        except Exception as e:  # whatever the filesystem does, it is a problem with the directory
            problem = f"the shared directory cannot be checked ({type(e).__name__}: {e})"
        with self._lock:
            if problem != self.seen.dir_problem:
                (log.warning if problem else log.info)("shared directory: %s", problem or "usable again")
            s = self.seen
            self.seen = Seen(s.queue_error, s.queue_down_since, s.counts, problem, time.time())

    # ----- what the server asks -----
    def not_ready(self) -> Optional[str]:
        """Why the server should take no submission now (None: it may)."""
        s = self.seen
        if s.queue_error is not None:
            return f"the queue is unavailable since {time.strftime('%H:%M:%S', time.localtime(s.queue_down_since))} " \
                   f"({s.queue_error})"
        return s.dir_problem

    def claim_refusal(self) -> Optional[str]:
        """Why the keepers claim nothing now (None: they may)."""
        return self.seen.dir_problem

    # ----- the thread -----
    def start(self) -> None:
        self.check_queue()
        self.check_dir()
        self._thread = threading.Thread(target=self._run, name="wan-s2v-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_dir = time.time() + self.dir_every_s
        while not self._stop.wait(self.queue_every_s):
            self.check_queue()
            if time.time() >= next_dir:
                self.check_dir()
                next_dir = time.time() + self.dir_every_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
