"""The observers of a run (:mod:`wan_s2v_runner.launcher.observer`): an observer's error is
logged and kept, never stops the others, and fails the run in strict mode (the test suite's)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from wan_s2v_runner.launcher.console import Display
from wan_s2v_runner.launcher.observer import ObserverError, Observers, RunObserver
from wan_s2v_runner.serve.group import GroupFeed
from wan_s2v_runner.shared.config import env_values

STRICT_ENV = "WAN_S2V_STRICT_OBSERVERS"


class Broken:
    def started(self, spec, run_dir):
        raise KeyError("boom")

    def log_line(self, line):
        pass

    def update(self, reader, new_events, elapsed):
        raise ValueError("bad event")

    def finished(self, spec, run_dir, outcome, manifest):
        pass


class Seen:
    def __init__(self):
        self.calls = []

    def started(self, spec, run_dir):
        self.calls.append("started")

    def log_line(self, line):
        self.calls.append(line)

    def update(self, reader, new_events, elapsed):
        self.calls.append("update")

    def finished(self, spec, run_dir, outcome, manifest):
        self.calls.append("finished")


def test_the_console_and_a_served_groups_feed_are_observers():
    assert isinstance(Display(rich=False), RunObserver)
    assert isinstance(GroupFeed(group=None), RunObserver)
    assert isinstance(Seen(), RunObserver)


def test_an_observer_error_is_logged_and_kept_and_the_others_are_still_told(caplog):
    seen = Seen()
    watchers = Observers([Broken(), seen], strict=False)
    with caplog.at_level(logging.ERROR, logger="wan_s2v.observer"):
        watchers.started(None, Path("."))
        watchers.log_line("a line")
        watchers.update(None, [], 0.0)
        watchers.raise_if_strict()  # not strict: supervision goes on
        watchers.finished(None, Path("."), None, {})
    assert seen.calls == ["started", "a line", "update", "finished"]
    assert watchers.errors == ["Broken.started: KeyError: 'boom'", "Broken.update: ValueError: bad event"]
    logged = [r for r in caplog.records if r.name == "wan_s2v.observer"]
    assert len(logged) == 2 and all(r.exc_info for r in logged)  # with the traceback


def test_strict_mode_fails_the_run_at_the_next_poll(monkeypatch):
    from wan_s2v_runner.shared.spec import GroupSpec

    monkeypatch.setenv(STRICT_ENV, "1")
    # the spec's environment layer
    watchers = Observers([Broken()], strict=GroupSpec(ckpt_dir="c", **env_values(os.environ)).strict_observers)
    assert watchers.strict
    watchers.update(None, [], 0.0)  # the error is kept where it happened (maybe the pump's thread)
    with pytest.raises(ObserverError, match="Broken.update: ValueError: bad event"):
        watchers.raise_if_strict()  # and raised on the supervisor's
    monkeypatch.setenv(STRICT_ENV, "0")
    assert not GroupSpec(ckpt_dir="c", **env_values(os.environ)).strict_observers and not Observers([]).strict
