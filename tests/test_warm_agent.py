"""A node's warm agent (``wan-s2v warm``; wan_s2v_runner/rank/warm_agent.py): a run's node agent is
forked from it, or, where a fork could not be what a spawn is, spawned, and run.json says which
and why. The whole suite runs its launches through one (``conftest.warm_agent``), so every
frame-parity test also proves a forked agent's ranks make one process's frames; this file proves
what is the warm agent's own: the refusals, the code changed under it, and that neither the
launcher's death nor the warm agent's leaves a process of the run behind.

Each test starts its own warm agent on an engine checkout copied to its temporary directory (the
engine's files are then the test's to change), with the real CLI and real processes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import STUB_RANKS, TINY_FLAGS, asset_flags, cli_env, run_cli, wait_for
from fault_worker import fault_env

from wan_s2v_runner.launcher.proctree import pids_with_cmdline
from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared import warm_agent as wire
from wan_s2v_runner.shared.engine_source import locate
from wan_s2v_runner.shared.node_agent import AGENT_MODULE


# ----------------------------------------------------------------------------- the rules
def test_an_import_time_variable_set_otherwise_is_refused_and_a_runtime_one_is_the_runs():
    warm = {"PATH": "/bin", "MKL_NUM_THREADS": "2", "TORCHINDUCTOR_CACHE_DIR": "/a"}
    assert wire.env_conflict(warm, {**warm, "PATH": "/usr/bin", "WAN_S2V_X": "1"}) is None  # not read at import
    assert wire.env_conflict(warm, {**warm, "TORCHINDUCTOR_CACHE_DIR": "/b"}) is None  # read when compiling
    why = wire.env_conflict(warm, {**warm, "MKL_NUM_THREADS": "3"})
    assert why and "$MKL_NUM_THREADS is '3' for this run, '2' in the warm agent" in why
    assert "unset for this run" in wire.env_conflict(warm, {k: v for k, v in warm.items() if k != "MKL_NUM_THREADS"})


def test_what_a_fork_sets_for_itself_is_taken_on_and_what_it_cannot_undo_is_refused():
    warm = {"OMP_NUM_THREADS": "4"}
    assert wire.env_conflict(warm, {"OMP_NUM_THREADS": "1", "MALLOC_TOP_PAD_": "1073741824",
                                    "PYTHONUNBUFFERED": "1", "PYTHONPATH": "/x"}) is None
    assert "$OMP_NUM_THREADS is unset" in wire.env_conflict(warm, {})  # a fork cannot unset it
    assert "$PYTHONHASHSEED" in wire.env_conflict({}, {"PYTHONHASHSEED": "0"})  # read when Python starts


def test_a_value_the_warm_agents_own_imports_gave_and_a_library_not_loaded_are_not_conflicts():
    cv2 = {"LD_LIBRARY_PATH": "/venv/cv2/../../lib64:"}  # what importing OpenCV sets, in both processes
    assert wire.env_conflict({}, cv2, warm_now=cv2) is None
    assert "$LD_LIBRARY_PATH" in wire.env_conflict({}, cv2, warm_now={})
    joblib = {"KMP_INIT_AT_FORK": "FALSE"}  # read by Intel's OpenMP runtime when it loads
    assert wire.env_conflict({}, joblib, dormant=("KMP_",)) is None
    assert "$KMP_INIT_AT_FORK" in wire.env_conflict({}, joblib)


def test_the_socket_is_per_user_and_host_and_off_is_off(tmp_path):
    host = os.uname().nodename
    assert wire.socket_path({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "wan-s2v" / f"warm-{host}.sock"
    assert wire.socket_path({}) == Path("/tmp") / f"wan-s2v-{os.getuid()}" / f"warm-{host}.sock"
    assert wire.socket_path({wire.ENV: "OFF"}) is None
    assert wire.socket_path({wire.ENV: str(tmp_path / "s")}) == tmp_path / "s"


def test_a_socket_directory_others_can_write_in_or_that_is_a_link_is_not_trusted(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert wire.socket_dir_problem(mine / "warm.sock") is None
    assert wire.socket_dir_problem(tmp_path / "not yet" / "warm.sock") is None  # the warm agent makes it, 0700
    mine.chmod(0o777)
    assert "writable by other users (mode 777" in wire.socket_dir_problem(mine / "warm.sock")
    mine.chmod(0o1777)  # sticky, as /tmp: no one replaces another's file there
    assert wire.socket_dir_problem(mine / "warm.sock") is None
    mine.chmod(0o700)
    (tmp_path / "link").symlink_to(mine)
    assert "is not a directory" in wire.socket_dir_problem(tmp_path / "link" / "warm.sock")


# ----------------------------------------------------------------------------- real processes
class Warm:
    """A ``wan-s2v warm`` on its own socket, importing the engine from a copy in ``root``."""

    def __init__(self, root: Path):
        self.repo = root / "engine checkout"
        shutil.copytree(locate().package_dir, self.repo / "wan", ignore=shutil.ignore_patterns("__pycache__"))
        self.sock, self.log = root / "warm.sock", root / "warm.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "warm", "--socket", str(self.sock),
                                      "--wan-repo", str(self.repo)], env=cli_env({wire.ENV: wire.OFF}),
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: self.proc.poll() is not None or "ready on" in self.text(), 120, "the warm agent", self.text)
        assert self.proc.poll() is None, self.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def env(self, **more) -> dict:
        return {wire.ENV: str(self.sock), **more}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def warm(tmp_path):
    w = Warm(tmp_path)
    yield w
    w.stop()


def _run(d: Path, warm: Warm, *flags: str, env: dict, assets, wan_repo: bool = True):
    d.mkdir(parents=True, exist_ok=True)
    args = ["run", *TINY_FLAGS, *asset_flags(assets), "--output", str(d / "out.mp4"), "--runs-root", str(d / "runs"),
            *(["--wan-repo", str(warm.repo)] if wan_repo else []), *flags]
    return run_cli(args, cwd=d, env=env)


def _launcher_agent(d: Path) -> dict:
    (run_dir,) = (d / "runs").iterdir()
    return json.loads((run_dir / "run.json").read_text())["launcher"]["agent"]


def _left(under: Path) -> set[int]:
    return pids_with_cmdline(AGENT_MODULE.encode(), str(under).encode())


@pytest.mark.slow(seconds=25)
def test_runs_fork_their_agent_unless_a_fork_would_differ_and_changed_code_ends_the_warm_agent(
        warm, tiny_assets, reference_frames, tmp_path):
    # forked: its ranks (2, the real engine) make one process's frames, and run.json says so
    r = _run(tmp_path / "forked", warm, "--nproc", "2", "--frames-out", str(tmp_path / "f.pt"), env=warm.env(),
             assets=tiny_assets)
    assert r.returncode == exit_codes.OK, r.output
    assert torch.equal(torch.load(tmp_path / "f.pt"), reference_frames)
    assert _launcher_agent(tmp_path / "forked") == {"forked_from_warm_agent": True, "warm_agent_socket": str(warm.sock),
                                                    "why_spawned": None}
    assert "forked the agent of" in warm.text() and "ended (0)" in warm.text()

    # an import-time variable set otherwise, another engine, another user's socket directory: the
    # launcher's own request over the socket is refused, with the reason (and the run spawns)
    def ask(env: dict, wan_repo=warm.repo):
        from wan_s2v_runner.launcher.spawn import agent_env
        from wan_s2v_runner.launcher.warm import fork_agent

        argv = [sys.executable, "-m", AGENT_MODULE, str(tmp_path / "nowhere" / "spec.json")]
        forked, origin = fork_agent(argv, {**agent_env(), **warm.env(), **env}, str(tmp_path), subprocess.DEVNULL,
                                    wan_repo)
        assert forked is None and not origin.forked, origin
        return origin.why

    assert "$MKL_NUM_THREADS is '3' for this run, unset in the warm agent" in ask({"MKL_NUM_THREADS": "3"})
    assert f"the warm agent imported {warm.repo.resolve() / 'wan'}" in ask({}, wan_repo=None)
    assert "refused: $OMP_NUM_THREADS is '2,1' for this run" in ask({"OMP_NUM_THREADS": "2,1"})

    # the engine's code changed under it: refused (the run spawns, and makes its video) and the warm
    # agent exits
    changed = warm.repo / "wan" / "speech2video.py"
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    r = _run(tmp_path / "changed", warm, env={**STUB_RANKS, **warm.env()}, assets=tiny_assets)
    assert r.returncode == exit_codes.OK, r.output
    why = _launcher_agent(tmp_path / "changed")["why_spawned"]
    assert f"{changed} changed since the warm agent started" in why, why
    assert warm.proc.wait(timeout=30) == 0 and not warm.sock.exists(), warm.text()
    assert "no warm agent listens" in ask({})


def _start_held(d: Path, warm: Warm, assets) -> subprocess.Popen:
    """A 2-rank stub run whose rank 0 holds in denoise (the tests' ``wait`` fault, never released)."""
    d.mkdir()
    args = ["run", *TINY_FLAGS, *asset_flags(assets), "--nproc", "2", "--output", str(d / "out.mp4"),
            "--runs-root", str(d / "runs"), "--wan-repo", str(warm.repo)]
    env = cli_env({**fault_env("0:denoise:wait", WAN_S2V_TEST_RELEASE=str(d / "never")), **STUB_RANKS,
                   **warm.env()})
    p = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", *args], cwd=d, env=env, stdin=subprocess.DEVNULL,
                         stdout=open(d / "cli.out", "wb"), stderr=subprocess.STDOUT)
    wait_for(lambda: p.poll() is not None or len(_left(d)) == 3, 120, "the forked agent and its 2 ranks",
             lambda: (d / "cli.out").read_text(errors="replace"))
    assert p.poll() is None, (d / "cli.out").read_text(errors="replace")
    return p


@pytest.mark.slow(seconds=20)
def test_neither_the_launchers_death_nor_the_warm_agents_leaves_a_process_of_the_run(warm, tiny_assets, tmp_path):
    # the launcher killed: its connection closes, the warm agent stops the forked agent (SIGTERM, as
    # PR_SET_PDEATHSIG does for a spawned one), which stops its ranks
    d = tmp_path / "launcher killed"
    p = _start_held(d, warm, tiny_assets)
    (agent,) = [pid for pid in _left(d) if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1]
                == str(warm.proc.pid)]
    p.kill()
    p.wait()
    wait_for(lambda: not _left(d), 30, "the run's processes to end", lambda: str(_left(d)))
    wait_for(lambda: f"agent {agent} ended" in warm.text(), 10, "the warm agent to reap it", warm.text)

    # the warm agent killed: the forked agent ends with it (PR_SET_PDEATHSIG), the launcher's run
    # ends with the ranks' failure, says why, and leaves nothing
    d = tmp_path / "warm killed"
    p = _start_held(d, warm, tiny_assets)
    warm.proc.kill()
    warm.proc.wait()
    rc = p.wait(timeout=60)
    out = (d / "cli.out").read_text(errors="replace")
    assert rc != exit_codes.OK, out
    assert "the warm agent ended before the run's agent" in out, out
    wait_for(lambda: not _left(d), 30, "the run's processes to end", lambda: str(_left(d)))
