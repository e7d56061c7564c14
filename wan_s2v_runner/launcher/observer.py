"""Who watches a run: the observer protocol every launch (:mod:`.launch`) reports to.

A run's launcher tells each observer when the run starts (its group spec and run directory),
each line the node agent prints, what the ranks reported after every poll of their events, and how the
run ended (its outcome and ``run.json``). The console (:class:`~.console.Display`: what a person
watches, or JSON for machines) is one observer; a served group's feed
(``wan_s2v_runner.serve.group.GroupFeed``: it queues what it is told for the server's keeper, which
acts on it on its own clock) is another. Neither knows of the other.

An observer's error never stops supervision (the ranks keep running and are still stopped,
reported and cleaned up as they would be), and it is never swallowed: :class:`Observers` logs
it with its traceback on the ``wan_s2v.observer`` logger and keeps it in :attr:`Observers.errors`.
With ``strict`` (the group's ``strict_observers``, set by ``WAN_S2V_STRICT_OBSERVERS=1``: the test
suite sets it for every process it starts) the supervisor raises :class:`ObserverError` at its
next poll instead, so a test fails on it.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

from wan_s2v_runner.shared.events import EventReader
from wan_s2v_runner.shared.spec import GroupSpec

log = logging.getLogger("wan_s2v.observer")



@runtime_checkable
class RunObserver(Protocol):
    """What a launch (:mod:`.launch`) tells whoever watches a run."""

    def started(self, spec: GroupSpec, run_dir: Path) -> None:
        """The run directory is made and ``spec.json`` written; the node agent is about to start."""

    def log_line(self, line: str) -> None:
        """A line the node agent (or a rank) printed (called from the output pump's thread)."""

    def update(self, reader: EventReader, new_events: list[dict], elapsed: float) -> None:
        """After each poll of the ranks' event files: every rank's state and the new events."""

    def finished(self, spec: GroupSpec, run_dir: Path, outcome: Any, manifest: dict) -> None:
        """The run ended: its :class:`~.supervisor.Outcome` and its ``run.json``."""


class ObserverError(RuntimeError):
    """An observer failed in a strict run (``$WAN_S2V_STRICT_OBSERVERS``)."""


class Observers:
    """The observers of one run, told in order; their errors are logged and kept."""

    def __init__(self, observers: Iterable[RunObserver], strict: bool = False):
        self.observers = list(observers)
        self.strict = strict
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def _tell(self, method: str, *args: Any) -> None:
        for obs in self.observers:
            try:
                getattr(obs, method)(*args)
            except Exception as e:
                log.exception("observer %s.%s failed", type(obs).__name__, method)
                with self._lock:
                    self.errors.append(f"{type(obs).__name__}.{method}: {type(e).__name__}: {e}")

    def started(self, spec: GroupSpec, run_dir: Path) -> None:
        self._tell("started", spec, run_dir)

    def log_line(self, line: str) -> None:
        self._tell("log_line", line)

    def update(self, reader: EventReader, new_events: list[dict], elapsed: float) -> None:
        self._tell("update", reader, new_events, elapsed)

    def finished(self, spec: GroupSpec, run_dir: Path, outcome: Any, manifest: dict) -> None:
        self._tell("finished", spec, run_dir, outcome, manifest)
        self.raise_if_strict()

    def raise_if_strict(self) -> None:
        """In strict mode, the first error an observer raised (the supervisor asks every poll)."""
        if self.strict and self.errors:
            raise ObserverError("an observer failed: " + self.errors[0])
