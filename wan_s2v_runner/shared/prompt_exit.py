"""Ending a process that imported torch and the engine without paying for the interpreter's teardown.

A process that imported torch, diffusers, transformers and the engine spends 0.4-1.3 s after its
last line freeing module objects one by one (measured on the 2-core CPU machine: the node agent
1.3 s after its ranks had exited, the launcher 0.45 s), seconds a user waits for the prompt and
every test that starts a run pays. :func:`exit_now` does what the interpreter's own exit does that
anyone can observe (the ``atexit`` functions, e.g. logging's flush and torch elastic's; stdout and
stderr flushed) and then leaves with ``os._exit``. Only where this process's main thread is its
last thread: another thread still running (a server's) is waited for by the normal exit instead.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Optional


def exit_now(code: Optional[int]) -> None:
    """Exit with ``code`` now (as ``sys.exit`` takes it: None is 0): the atexit functions run and
    the standard streams are flushed, the modules are not torn down. Falls back to
    ``sys.exit(code)`` while other threads run, or for a code that is not a number."""
    if threading.active_count() > 1 or not isinstance(code, (int, type(None))):
        sys.exit(code)
    leave_now(code or 0)


def leave_now(code: int) -> None:
    """:func:`exit_now`'s exit, whatever else runs: the atexit functions, the standard streams
    flushed, ``os._exit(code)``. For a process that has joined the threads it waits for itself (an
    agent forked by the warm agent: :mod:`wan_s2v_runner.rank.warm_agent`)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader went away
            pass
    os._exit(code)
