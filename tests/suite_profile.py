"""What each test costs: wall seconds, CPU seconds (this process and the children it waited for)
and the launches of the CLI it made, one JSON line per test phase in ``--profile-out`` (each
pytest-xdist worker appends to the same file). Opt in with ``-p tests.suite_profile``;
``tools/suite_table`` turns the file into docs/testing.md's per-file table.

A launch is one ``python -m wan_s2v_runner run|batch|serve|demo`` process a test started (each
starts one rank group; a server's restarts and replicas are not counted apart). A session
fixture's cost lands on the first test that uses it (its setup) and, for the processes it
waits for at the end, on the last (its teardown).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from pathlib import Path

import pytest

VERBS = {"run", "batch", "serve", "demo"}
_launches = [0]
_real_init = subprocess.Popen.__init__


def _counting_init(self, args, *a, **kw):
    argv = [str(x) for x in args] if isinstance(args, (list, tuple)) else str(args).split()
    if "wan_s2v_runner" in argv:
        i = argv.index("wan_s2v_runner")
        if i + 1 < len(argv) and argv[i + 1] in VERBS:
            _launches[0] += 1
    _real_init(self, args, *a, **kw)


def pytest_addoption(parser):
    parser.addoption("--profile-out", default=None, help="append each test's wall, CPU and launches here")


def pytest_configure(config):
    if config.getoption("--profile-out"):
        if config.inipath is None:  # "--profile-out PATH" with no test path: pytest took PATH for one
            raise pytest.UsageError(
                f"pytest found no configuration (rootdir {config.rootpath}): --profile-out's path was read as a "
                "test path, so pyproject.toml's options (-n 2 ...) were not applied. Fix: --profile-out=PATH")
        subprocess.Popen.__init__ = _counting_init


#: this worker's warm agent (conftest.warm_agent), once found: the node agents it forks, and their
#: ranks, are its children, not this process's
_warm: list = [None]


def _warm_cpu() -> float:
    """CPU-seconds of the processes this worker's warm agent has reaped (the forked node agents,
    with their ranks), and its own."""
    if _warm[0] is None:
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and b"wan_s2v_runner.rank.warm_agent" in (d / "cmdline").read_bytes() and \
                        int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    _warm[0] = int(d.name)
                    break
            except (OSError, ValueError):
                continue
        else:
            return 0.0
    try:
        f = Path(f"/proc/{_warm[0]}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + _warm_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = item.config.getoption("--profile-out")
    if not out:
        yield
        return
    t0, c0, n0 = time.monotonic(), _cpu(), _launches[0]
    yield
    row = {"nodeid": item.nodeid, "file": item.location[0], "wall": round(time.monotonic() - t0, 3),
           "cpu": round(_cpu() - c0, 3), "launches": _launches[0] - n0,
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
