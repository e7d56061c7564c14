"""``shared/prompt_exit.exit_now``: the launcher and the node agent leave without the interpreter's
teardown, yet what a normal exit does that anyone sees still happens (atexit, flushed output), and
a process with another thread still running exits the normal way (the thread finishes)."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

PROGRAM = """
import atexit, sys, threading, time
from wan_s2v_runner.shared.prompt_exit import exit_now
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", end=""))).start()
print("unflushed", end="")
sys.stderr.write("to stderr")
exit_now(3)
"""


def test_exit_now_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    for mode in ("alone", "thread"):
        mark = tmp_path / f"{mode}.txt"
        p = subprocess.run([sys.executable, "-c", PROGRAM, str(mark), mode], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 3, (mode, p.stderr)
        assert p.stdout.startswith("unflushed") and "to stderr" in p.stderr, (mode, p.stdout, p.stderr)
        assert mark.read_text() == "atexit ran", mode
        assert ("thread finished" in p.stdout) == (mode == "thread"), (mode, p.stdout)


def test_exit_now_takes_codes_as_sys_exit_does(tmp_path):
    """None is 0 (a main that returns nothing succeeded); a text is printed and exits 1."""
    for code, rc in (("None", 0), ("0", 0), ("'stopped'", 1)):
        p = subprocess.run([sys.executable, "-c", f"from wan_s2v_runner.shared.prompt_exit import exit_now; "
                            f"exit_now({code})"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == rc, (code, p.stderr)
    assert "stopped" in p.stderr
