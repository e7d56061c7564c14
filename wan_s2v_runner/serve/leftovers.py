"""What a killed server's rank groups may have left running, and how the next server finds it:
each keeper notes its group's run directory (``group.json``, ``group-I.json`` in the server's
own directory); at start the server stops whatever of those groups still runs
(:func:`wait_for_leftovers`)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from wan_s2v_runner.launcher.proctree import pids_with_cmdline
from wan_s2v_runner.shared.node_agent import AGENT_MODULE

#: the running group's run directory, so the next server can find (and stop) what a killed one left
GROUP_FILE = "group.json"


def group_files(root: Path) -> list[Path]:
    """Every keeper's note of its group's run directory (``group.json``, ``group-I.json``)."""
    return sorted(root.glob("group*.json"))


def group_file(root: Path, index: int) -> Path:
    """Where keeper ``index`` notes its group's run directory (for the next server, if this one is
    killed): ``group.json`` for the first group, ``group-I.json`` for the others."""
    return root / (GROUP_FILE if index == 0 else f"group-{index}.json")


def group_processes(run_dir: str) -> set[int]:
    """The node agent and the workers of the rank group in ``run_dir`` (their command lines name its spec)."""
    return pids_with_cmdline(AGENT_MODULE.encode(), str(Path(run_dir) / "spec.json").encode())


def wait_for_leftovers(group_file: Path, grace_s: float = 5.0) -> list[int]:
    """What a killed server's group left running: the node agent and its workers normally stop with
    the server (torchrun gets SIGTERM when it dies, and stops its workers), but a torchrun whose
    output pipe broke with the server can hang in its shutdown. Wait ``grace_s``, then SIGKILL
    whatever of the group is left. Returns the pids found."""
    try:
        run_dir = json.loads(group_file.read_text(encoding="utf-8"))["run_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    found = group_processes(run_dir)
    deadline = time.time() + grace_s
    while found and time.time() < deadline and group_processes(run_dir):
        time.sleep(0.2)
    for pid in group_processes(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return sorted(found)
