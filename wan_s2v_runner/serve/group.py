"""How the server reaches one rank group: the only door (:class:`GroupClient`), as vLLM's server
reaches its engine only through ``EngineClient``.

A keeper (:mod:`.keeper`) hands the group its jobs, cancels them, tells it how long a job's lease
is sure, reads what the ranks report and stops the group, all through this interface, on its own
clock. The one implementation, :class:`LaunchedGroup`, runs the launcher
(:func:`wan_s2v_runner.launcher.launch.run_served`: the ranks load once and wait for jobs in
their run directory's inbox, supervised exactly like a run) on a thread of its own; what the
launcher's supervisor tells its observers is queued for the keeper (:class:`GroupNews`) instead of
being acted on in the supervisor's call. Its door to the ranks is the inbox
(:mod:`wan_s2v_runner.shared.inbox`), and :class:`InboxDoor` is that door alone (a group the
caller started itself: the keeper's tests play the ranks through it).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from wan_s2v_runner.shared import exit_codes, inbox
from wan_s2v_runner.shared.spec import GroupSpec


class News(str, Enum):
    """What the launcher's thread queues for the keeper (:class:`GroupFeed`, read by
    :meth:`LaunchedGroup.events`): each item is ``(News, value)``."""

    STARTED = "started"  # the group's run directory
    UPDATE = "update"  # (the ranks' new events, each rank's latest state)
    FINISHED = "finished"  # the supervisor's outcome
    ENDED = "ended"  # the launcher returned (None), or raised (why, a string)

    def __str__(self) -> str:
        return self.value


@dataclass
class GroupNews:
    """What happened to a group since the keeper last asked, in the order it happened: it started
    (its run directory), the ranks' new events, each rank's latest state, and its end (the
    launcher returned: its ``outcome``, or ``error`` when the launcher itself raised)."""

    started: Optional[Path] = None
    events: list[dict] = field(default_factory=list)
    ranks: Optional[list[dict]] = None
    ended: bool = False
    outcome: Any = None
    error: Optional[str] = None


@runtime_checkable
class GroupClient(Protocol):
    """One rank group, as the server sees it."""

    @property
    def run_dir(self) -> Optional[Path]:
        """The group's run directory, once it started."""

    def start(self) -> None:
        """Start the group (its ranks load, then wait for jobs)."""

    def events(self, timeout: float) -> GroupNews:
        """What happened since the last call, waiting up to ``timeout`` seconds for anything."""

    def submit(self, seq: int, job_json: str) -> None:
        """Hand the ranks a job (``seq``: its order among this group's jobs)."""

    def cancel(self, job_id: str) -> None:
        """Ask the ranks to end ``job_id`` at its next step."""

    def renew(self, job_id: str, lease: inbox.Lease) -> None:
        """Tell the ranks until when this server is sure it holds ``job_id`` (or that it lost it)."""

    def release(self, job_id: str) -> None:
        """``job_id`` ended: its lease is no longer the ranks' concern."""

    def stop(self) -> None:
        """Ask an idle group to end (after the job it runs, if any)."""

    def halt(self) -> None:
        """End the group now (a job in progress is interrupted)."""


class InboxDoor:
    """A started group's door: its run directory's inbox (the ranks' side reads it)."""

    def __init__(self, run_dir: Optional[Path] = None):
        self._run_dir = run_dir

    @property
    def run_dir(self) -> Optional[Path]:
        return self._run_dir

    def submit(self, seq: int, job_json: str) -> None:
        inbox.post_job(self._door(), seq, job_json)

    def cancel(self, job_id: str) -> None:
        inbox.cancel(self._door(), job_id)

    def renew(self, job_id: str, lease: inbox.Lease) -> None:
        inbox.write_lease(self._door(), job_id, lease)

    def release(self, job_id: str) -> None:
        inbox.drop_lease(self._door(), job_id)

    def stop(self) -> None:
        if self._run_dir is not None:
            inbox.stop(self._run_dir)

    def _door(self) -> Path:
        if self._run_dir is None:
            raise RuntimeError("the rank group has not started: it has no inbox yet")
        return self._run_dir


def ranks_snapshot(ranks: dict) -> list[dict]:
    """Each rank's stage and latest memory figures, from the supervisor's reader (the status
    page, /metrics)."""
    return [{"rank": r, "stage": str(getattr(st.stage, "value", st.stage)), "host": st.host,
             "rss_mb": st.mem.get("rss_mb"), "host_peak_rss_mb": st.mem.get("host_peak_rss_mb"),
             "gpu_peak_allocated_mb": st.mem.get("gpu_peak_allocated_mb"),
             "gpu_peak_reserved_mb": st.mem.get("gpu_peak_reserved_mb")}
            for r, st in sorted(ranks.items())]


class LaunchedGroup(InboxDoor):
    """A rank group run by the launcher on a thread of its own (``name``), its supervisor's news
    queued for :meth:`events`."""

    def __init__(self, spec: GroupSpec, extra_env: Optional[dict] = None, name: str = "wan-s2v-group"):
        super().__init__()
        self.spec, self.extra_env = spec, extra_env
        self._news: queue.Queue = queue.Queue()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._launch, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        self._halt.set()

    def events(self, timeout: float) -> GroupNews:
        news = GroupNews()
        try:
            items = [self._news.get(timeout=timeout)]
        except queue.Empty:
            return news
        while True:
            try:
                items.append(self._news.get_nowait())
            except queue.Empty:
                break
        for kind, value in items:
            if kind is News.STARTED:
                news.started = value
            elif kind is News.UPDATE:
                news.events.extend(value[0])
                news.ranks = value[1]
            elif kind is News.FINISHED:
                news.outcome = value
            else:  # News.ENDED: the launcher returned (or raised: value is why)
                news.ended, news.error = True, value
        return news

    def _launch(self) -> None:
        from wan_s2v_runner.launcher import launch
        from wan_s2v_runner.launcher.console import Display

        error = None
        try:
            launch.run_served(self.spec, observers=[Display(rich=False, show_logs=False), GroupFeed(self)],
                              extra_env=self.extra_env, halt=self._halt)
        except BaseException as e:  # the launcher itself failed: the keeper says so and starts another
            error = f"{type(e).__name__}: {e}"
            if not isinstance(e, Exception):
                raise
        finally:  # the keeper hears the end, however the launcher left
            self._news.put((News.ENDED, error))


def compute_for_node0(spec: GroupSpec, extra_env: Optional[dict] = None) -> int:
    """``wan-s2v serve`` on a node other than 0: this node's share of every group node 0 starts
    (its ranks join, node 0's keeper reaches them), run again after each ends, until interrupted;
    the exit code of the interrupted one."""
    from wan_s2v_runner.launcher import launch
    from wan_s2v_runner.launcher.console import Display

    while True:
        code = launch.run_served(spec, observers=[Display.auto()], extra_env=extra_env)
        if code == exit_codes.INTERRUPTED:
            return code
        time.sleep(1.0)


class GroupFeed:
    """The group's observer (:class:`~wan_s2v_runner.launcher.observer.RunObserver`): what the
    supervisor tells, queued for the keeper; nothing is decided on the supervisor's thread."""

    def __init__(self, group: LaunchedGroup):
        self.group = group

    def started(self, spec: GroupSpec, run_dir: Path) -> None:
        self.group._run_dir = Path(run_dir)
        self.group._news.put((News.STARTED, Path(run_dir)))

    def log_line(self, line: str) -> None:
        pass  # the console observer prints the group's log

    def update(self, reader, new_events: list[dict], elapsed: float) -> None:
        self.group._news.put((News.UPDATE, (list(new_events), ranks_snapshot(reader.ranks))))

    def finished(self, spec: GroupSpec, run_dir: Path, outcome, manifest: dict) -> None:
        self.group._news.put((News.FINISHED, outcome))
