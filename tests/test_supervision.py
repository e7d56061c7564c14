"""Supervision: failures, hangs, kills and Ctrl-C end the whole run, fast, with a report that names
the right rank; a normal run leaves a complete manifest.

Distributed tests spawn the real CLI, which spawns real ``torch.distributed.run`` over gloo;
faults come from the worker's test hook (``WAN_S2V_TEST_FAULT=RANK:STAGE:ACTION``) or from
signals sent by the test. Nothing is mocked. Where the engine adds nothing to what is checked
(the supervisor's reports, stops and clean-up) the ranks are the stub rank
(:data:`STUB_RANKS`, tests/stub_rank.py: the real worker, process group, events, faults and mp4
writer, without the engine); the hang with its stack analysis and the normal run's manifest keep
the real engine, as do the other real-engine failure runs (test_resume, test_batch, test_serve,
test_multinode, test_parity). Every test checks, by PID (with the process start
time, so a recycled PID is not mistaken for a survivor), that no process of the run is left:
torchrun (from run.json or /proc) and every worker (from the ``hello`` events).
The unit tests at the end (EventReader, watchdog, rendezvous flags, log filter, stack analysis)
spawn nothing but small stand-in processes; the verdicts themselves are unit-tested in
test_verdicts.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import STUB_RANKS, TINY_FLAGS, asset_flags, cli_env, run_cli, wait_for
from fault_worker import fault_env

from wan_s2v_runner.shared import exit_codes, media

#: watchdog limits for the tests. Load-class stages (spawn .. text_encode) measured on this
#: 2-core box with three 2-rank runs at once: longest single stage 13 s (engine_import),
#: spawn -> first event 5.6 s; so 90 s never fires by accident. The step limit only matters
#: in the hang test (the fault parks both ranks in denoise).
WATCHDOG_LOAD = "90"
WATCHDOG_STEP = 4.0
#: launcher exit after a rank's failure / kill / SIGINT (torchrun teardown + our sweep)
EXIT_WITHIN_S = 10.0


# ----- helpers -----
def _args(assets, tmp_path: Path, *extra: str) -> list[str]:
    return ["run", *TINY_FLAGS, *asset_flags(assets), "--nproc", "2",
            "--output", str(tmp_path / "out" / "video.mp4"), "--runs-root", str(tmp_path / "runs"),
            "--watchdog-load", WATCHDOG_LOAD, *extra]


def _popen(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """The CLI as a child we can signal; output to files (no pipe to fill up)."""
    full_env = cli_env(env)
    return subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", *args], cwd=cwd, env=full_env,
                            stdin=subprocess.DEVNULL, stdout=open(cwd / "cli.out", "w"),
                            stderr=open(cwd / "cli.err", "w"))


def _output(cwd: Path) -> str:
    return (cwd / "cli.out").read_text() + (cwd / "cli.err").read_text()


def _run_dir(tmp_path: Path) -> Path:
    dirs = list((tmp_path / "runs").glob("*-*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


def _events(run_dir: Path, rank: int) -> list[dict]:
    p = run_dir / "events" / f"rank{rank}.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _start_time(pid: int):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


class RunProcs:
    """PIDs (with start times) of one run's processes, gathered while it runs and afterwards."""

    def __init__(self):
        self.known: dict[int, str] = {}

    def add(self, pids) -> None:
        for p in pids:
            if p and p not in self.known:
                st = _start_time(p)
                if st is not None:
                    self.known[p] = st

    def add_from_run_dir(self, run_dir: Path) -> None:
        for r in (0, 1):
            self.add(e.get("pid") for e in _events(run_dir, r) if e["kind"] == "hello")

    def alive(self) -> list[int]:
        out = []
        for p, st in self.known.items():
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[19] == st and fields[0] != "Z":
                out.append(p)
        return out

    def kill_all(self) -> None:
        for p in self.alive():
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def _assert_nothing_left(procs: RunProcs, run_dir: Path, tmp_path: Path) -> None:
    procs.add_from_run_dir(run_dir)
    tr = (_manifest(run_dir).get("launcher") or {}).get("torchrun_pid")
    assert len(procs.known) >= 2 or tr, "no pids gathered"
    left = procs.alive()
    assert not left, f"processes of the run survived: {left}"
    out_dir = tmp_path / "out"
    assert not (out_dir / "video.mp4").exists(), "a failed run left an output file"
    leftovers = list(out_dir.glob(".*")) if out_dir.is_dir() else []
    assert not leftovers, f"temporary files left: {leftovers}"


def _ended(manifest: dict) -> float:
    return datetime.fromisoformat(manifest["ended"]).timestamp()


# ----- distributed tests -----
@pytest.mark.slow
def test_normal_run_manifest_is_complete(hybrid_run):
    """hybrid (Ulysses + FSDP DiT + T5 on CPU; the session's shared run, conftest.hybrid_run):
    every stage of the list appears, with a time. A second 2-rank run (one clip, one step) started
    at the same moment: with no --master-port, each rendezvous binds a port the OS picks, so both
    succeed."""
    r, tmp_path = hybrid_run.result, hybrid_run.dir
    assert r.returncode == 0, r.output
    assert hybrid_run.other_result.returncode == 0, hybrid_run.other_result.output
    from wan_s2v_runner.rank.agent import rendezvous
    from wan_s2v_runner.shared.spec import read_spec

    for d in (tmp_path, hybrid_run.other_dir):
        rd = _run_dir(d)
        assert json.loads((rd / "command.json").read_text())[-1] == str(rd / "spec.json")
        assert _manifest(rd)["spec"]["master_port"] is None
        assert rendezvous(read_spec(rd / "spec.json"))["rdzv_endpoint"] == "localhost:0"
    first, second = (_manifest(_run_dir(d))["started"] for d in (tmp_path, hybrid_run.other_dir))
    assert abs(datetime.fromisoformat(first).timestamp() - datetime.fromisoformat(second).timestamp()) < 5
    run_dir = _run_dir(tmp_path)
    m = _manifest(run_dir)
    assert m["exit"]["status"] == "ok" and m["exit"]["code"] == 0
    # every rank was forked from its agent with the engine imported already (rank/agent.py)
    for rank in (0, 1):
        events = [json.loads(line) for line in (run_dir / "events" / f"rank{rank}.jsonl").read_text().splitlines()]
        imports = [e for e in events if e["kind"] == "stage" and e["stage"] == "engine_import"]
        assert len(imports) == 1 and imports[0]["preloaded"] is True, imports
    assert m["seed"] == 42 and m["spec"]["seed"] == 42
    assert m["mode"] == "hybrid" and m["layout"]["world_size"] == 2
    for stage in ("init_pg", "engine_import", "load", "fingerprint", "shard", "audio_encode",
                  "ref_encode", "denoise", "decode", "motion_encode", "clip_checkpoint", "save"):  # rank 0's
        assert isinstance(m["stage_seconds"].get(stage), float), (stage, m["stage_seconds"])
    # the prompts: on the text rank (the last), while rank 0 encodes the speech
    assert isinstance(m["ranks"]["1"]["stage_seconds"].get("text_encode"), float), m["ranks"]["1"]
    assert set(m["ranks"]) == {"0", "1"}
    for info in m["ranks"].values():
        assert info["host_peak_rss_mb"] > 100, info
        assert "gpu_peak_allocated_mb" in info and info["gpu_peak_allocated_mb"] is None
        # peaks per stage (the kernel's RSS high-water mark, reset at each stage): one for every
        # stage the rank went through (and its start, before the first), none above the run's, and
        # the run's is one of them
        peaks = {k: v["host_peak_rss_mb"] for k, v in info["stage_peak_mb"].items()}
        assert set(peaks) == set(info["stage_seconds"]) | {"start"}, (peaks, info["stage_seconds"])
        assert all(0 < v <= info["host_peak_rss_mb"] for v in peaks.values()), (peaks, info)
        assert max(peaks.values()) >= 0.98 * info["host_peak_rss_mb"], (peaks, info)
        assert info["finished"] and info["error"] is None
        assert info["progress"] == {"unit": "clip", "clip": 2, "clips": 2, "step": 2, "steps": 2}
    out = hybrid_run.output
    assert m["output"]["path"] == str(out)
    assert m["output"]["sha256"] == media.sha256_file(out)
    assert m["engine"]["s2v_fingerprint"] and m["versions"]["torch"]
    assert m["launcher"]["torchrun_exit_code"] == 0
    cpu = m["launcher"]["cpu_s"]  # the supervision's own cost, next to the ranks' seconds
    assert 0 < cpu["launcher"] < m["wall_s"] and 0 < cpu["torchrun"] < m["wall_s"], cpu
    # every denoising step of rank 0 was reported
    steps = [(e["clip"], e["step"]) for e in _events(run_dir, 0) if e["kind"] == "progress"]
    assert steps == [(1, 1), (1, 2), (2, 1), (2, 2)]
    # plain console: stage lines, rank 0's steps with ETA; no warnings, tqdm bars or blank lines
    assert "denoise clip 2/2: ranks 0-1" in r.stdout and "step 2/2, ETA" in r.stdout, r.stdout
    assert "Warning" not in r.stdout and "%|" not in r.stdout and "\n\n" not in r.stdout, r.stdout
    assert not (run_dir / "stacks").exists(), "empty stack files should be removed after a good run"


@pytest.mark.slow
def test_rank_raising_in_denoise_is_reported_and_everything_stops(tiny_assets, tmp_path):
    procs = RunProcs()
    try:
        r = run_cli(_args(tiny_assets, tmp_path), cwd=tmp_path,
                    env={**fault_env("1:denoise:raise"), **STUB_RANKS})
        run_dir = _run_dir(tmp_path)
        procs.add_from_run_dir(run_dir)
        assert r.returncode == exit_codes.RANK_FAILED, r.output
        # the first failing rank, not rank 0 (which then fails with "connection closed")
        assert "rank 1 failed in stage denoise" in r.stderr, r.stderr
        assert "InjectedFault: injected fault on rank 1 in stage denoise" in r.stderr
        assert "Traceback (most recent call last)" in r.stderr and "fault_worker.py" in r.stderr
        m = _manifest(run_dir)
        assert m["exit"]["failed_rank"] == 1 and m["exit"]["failed_stage"] == "denoise"
        assert m["output"] is None
        fault_t = next(e["t"] for e in _events(run_dir, 1) if e["kind"] == "error")
        took = _ended(m) - fault_t
        print(f"raise: fault -> launcher done {took:.2f}s")
        assert took < EXIT_WITHIN_S
        _assert_nothing_left(procs, run_dir, tmp_path)
    finally:
        procs.kill_all()


@pytest.mark.slow
def test_hang_fires_watchdog_with_stacks_of_every_rank(tiny_assets, tmp_path):
    procs = RunProcs()
    try:
        r = run_cli(_args(tiny_assets, tmp_path, "--watchdog-step", str(WATCHDOG_STEP)), cwd=tmp_path,
                    env=fault_env("1:denoise:hang"))
        run_dir = _run_dir(tmp_path)
        procs.add_from_run_dir(run_dir)
        assert r.returncode == exit_codes.HUNG, r.output
        assert "stuck in denoise (clip 1/2, step 0/2) on ranks 0,1" in r.stderr, r.stderr
        assert f"stacks in {run_dir / 'stacks'}" in r.stderr
        # the suspect is named: rank 1 never reached the collective rank 0 waits in
        assert "rank 0: waiting in collective all_to_all" in r.stderr, r.stderr
        assert "rank 1: not in a collective, at fault_worker.py" in r.stderr, r.stderr
        for rank in (0, 1):
            text = (run_dir / "stacks" / f"rank{rank}.txt").read_text()
            assert 'File "' in text and "wan_s2v_runner/rank/worker.py" in text, text
        assert "in maybe_fire" in (run_dir / "stacks" / "rank1.txt").read_text()
        m = _manifest(run_dir)
        assert m["exit"]["status"] == "hung" and m["exit"]["stuck"] == {"denoise": [0, 1]}
        last_progress = max(e["t"] for rank in (0, 1) for e in _events(run_dir, rank)
                            if e["kind"] in ("stage", "progress"))
        took = _ended(m) - last_progress
        print(f"hang: last progress -> launcher done {took:.2f}s (limit {WATCHDOG_STEP}s)")
        assert WATCHDOG_STEP <= took < WATCHDOG_STEP + 6.0
        _assert_nothing_left(procs, run_dir, tmp_path)
    finally:
        procs.kill_all()


@pytest.mark.slow
def test_watchdog_sees_a_rank_that_never_reports(tiny_assets, tmp_path):
    """Rank 0 hangs before its first event (so rank 1 waits in the rendezvous): the load limit
    applies from the spawn, and the report names rank 0 and what its process was doing."""
    procs = RunProcs()
    try:
        # 12 s: time for rank 0 to import torch and register its stack dumps (1-2 s alone; over 8 s
        # once, with three test workers on 2 cores) before the limit fires
        r = run_cli(_args(tiny_assets, tmp_path, "--watchdog-load", "12"), cwd=tmp_path,
                    env={**fault_env("0:start:hang"), **STUB_RANKS})
        run_dir = _run_dir(tmp_path)
        procs.add_from_run_dir(run_dir)
        assert r.returncode == exit_codes.HUNG, r.output
        assert not _events(run_dir, 0)
        m = _manifest(run_dir)
        assert 0 in m["exit"]["stuck"]["start"], m["exit"]
        assert "rank 0 never reported (no events): its process (pid" in r.stderr, r.stderr
        # where it hung: the fault hook (fault_worker.py); the dump is whole (one SIGTERM reaches the rank:
        # test_stop_gives_each_rank_one_sigterm_so_its_stack_dump_is_whole)
        stack = (run_dir / "stacks" / "rank0.at-stop.txt").read_text()
        assert 'tests/fault_worker.py", line' in stack and " in maybe_fire" in stack, stack
        _assert_nothing_left(procs, run_dir, tmp_path)
    finally:
        procs.kill_all()


@pytest.mark.slow
def test_rank0_stopped_while_saving_leaves_no_partial_output(tiny_assets, tmp_path):
    """Rank 0 hangs with its video written under a temporary name, before the rename; the
    watchdog stops it (SIGTERM: no Python cleanup runs). The output path holds nothing, and the
    launcher removes the rank's temporary files."""
    procs = RunProcs()
    p = _popen(_args(tiny_assets, tmp_path, "--watchdog-step", str(WATCHDOG_STEP)), cwd=tmp_path,
               env={**fault_env("0:save:hang"), **STUB_RANKS})
    try:
        procs.add([p.pid])
        out_dir = tmp_path / "out"
        temps = wait_for(lambda: list(out_dir.glob(".video.*.mp4")) if out_dir.is_dir() else None,
                          150, "rank 0's temporary video")
        procs.add(descendants(p.pid))
        rc = p.wait(timeout=60)
        out = _output(tmp_path)
        assert rc == exit_codes.HUNG, out
        assert "stuck in save on rank 0" in out, out
        run_dir = _run_dir(tmp_path)
        m = _manifest(run_dir)
        assert m["ranks"]["1"]["finished"] and not m["ranks"]["0"]["finished"]
        assert all(not t.exists() for t in temps)
        _assert_nothing_left(procs, run_dir, tmp_path)
        assert not list(out_dir.iterdir())
    finally:
        if p.poll() is None:
            p.kill()
        procs.kill_all()


def _wait_in_denoise(run_dir_fn, rank: int, min_step: int = 2):
    """(pid of rank, its progress record) once it has finished min_step steps of a clip."""
    def probe():
        rd = run_dir_fn()
        if rd is None:
            return None
        ev = _events(rd, rank)
        pid = next((e["pid"] for e in ev if e["kind"] == "hello"), None)
        prog = [e for e in ev if e["kind"] == "progress"]
        if pid and prog and prog[-1]["step"] >= min_step and prog[-1]["step"] < prog[-1]["steps"]:
            return pid, prog[-1]
        return None
    return wait_for(probe, 150, f"rank {rank} in denoise")


def _maybe_run_dir(tmp_path: Path):
    dirs = list((tmp_path / "runs").glob("*-*")) if (tmp_path / "runs").is_dir() else []
    return dirs[0] if dirs else None


@pytest.mark.slow
def test_rank_killed_with_sigkill_mid_denoise(tiny_assets, tmp_path):
    procs = RunProcs()
    p = _popen(_args(tiny_assets, tmp_path, "--steps", "12"), cwd=tmp_path, env=STUB_RANKS)
    try:
        procs.add([p.pid])
        pid, prog = _wait_in_denoise(lambda: _maybe_run_dir(tmp_path), rank=1)
        procs.add(descendants(p.pid))
        os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        rc = p.wait(timeout=60)
        took = time.time() - t_kill
        print(f"SIGKILL: kill -> launcher exit {took:.2f}s (killed at clip {prog['clip']} step {prog['step']})")
        out = _output(tmp_path)
        assert rc == exit_codes.RANK_FAILED, out
        # rank 1 is named (not rank 0, whose collective then failed with a connection error)
        assert f"rank 1 (pid {pid}) died without an error report (killed by SIGKILL) in stage denoise" in out, out
        assert "(a consequence: a peer went away)" in out or "also rank 0" in out, out
        m = _manifest(_run_dir(tmp_path))
        assert m["exit"]["failed_rank"] == 1 and m["exit"]["failed_stage"] == "denoise"
        assert m["ranks"]["1"]["host_peak_rss_mb"], "a killed rank still gets a peak-memory figure"
        assert took < EXIT_WITHIN_S
        _assert_nothing_left(procs, _run_dir(tmp_path), tmp_path)
    finally:
        if p.poll() is None:
            p.kill()
        procs.kill_all()


@pytest.mark.slow(seconds=22)
def test_an_agent_frozen_mid_run_does_not_keep_the_run(tiny_assets, tmp_path, spawned_agent):
    """The node agent stopped (SIGSTOP) while its ranks denoise: the ranks finish and rank 0 writes
    the video; the run then ends at most AGENT_EXIT_GRACE_S (+ the stop) after its last rank did,
    with the ranks' verdict (exit 0) and a note; the agent and every rank are gone."""
    from wan_s2v_runner.launcher.supervisor import AGENT_EXIT_GRACE_S

    procs = RunProcs()
    p = _popen(_args(tiny_assets, tmp_path, "--steps", "12"), cwd=tmp_path, env=STUB_RANKS)
    agent = None
    try:
        procs.add([p.pid])
        pid, _ = _wait_in_denoise(lambda: _maybe_run_dir(tmp_path), rank=1, min_step=1)
        procs.add(descendants(p.pid))
        agent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the rank's parent
        assert agent in descendants(p.pid) and agent != p.pid
        os.kill(agent, signal.SIGSTOP)
        rc = p.wait(timeout=AGENT_EXIT_GRACE_S + 120)
        out, run_dir = _output(tmp_path), _run_dir(tmp_path)
        m = _manifest(run_dir)
        assert rc == exit_codes.OK, out
        assert f"note: every rank ended, but the node agent (pid {agent}, stopped" in out, out
        assert "had not exited" in m["exit"]["details"][0] and m["output"]["frames"], m["exit"]
        last_end = max(e["t"] for r in (0, 1) for e in _events(run_dir, r) if e["kind"] == "end")
        assert _ended(m) - last_end < AGENT_EXIT_GRACE_S + EXIT_WITHIN_S, (_ended(m) - last_end)
        procs.add_from_run_dir(run_dir)
        assert not procs.alive(), f"processes of the run survived: {procs.alive()}"
    finally:
        if p.poll() is None:
            p.kill()
        procs.kill_all()
        if agent is not None:
            try:
                os.kill(agent, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.slow
def test_sigint_to_launcher_stops_every_process(tiny_assets, tmp_path, spawned_agent):
    procs = RunProcs()
    p = _popen(_args(tiny_assets, tmp_path, "--steps", "12"), cwd=tmp_path, env=STUB_RANKS)
    try:
        procs.add([p.pid])
        _wait_in_denoise(lambda: _maybe_run_dir(tmp_path), rank=0)
        tree = descendants(p.pid)
        procs.add(tree)
        assert len(tree) >= 3, f"expected torchrun + 2 workers under the launcher, got {tree}"
        os.kill(p.pid, signal.SIGINT)
        t_sig = time.time()
        rc = p.wait(timeout=60)
        took = time.time() - t_sig
        print(f"SIGINT: signal -> launcher exit {took:.2f}s")
        out = _output(tmp_path)
        assert rc == exit_codes.INTERRUPTED == 130, out
        assert "interrupted by SIGINT" in out, out
        run_dir = _run_dir(tmp_path)
        m = _manifest(run_dir)
        assert m["exit"]["status"] == "interrupted" and m["launcher"]["signal"] == "SIGINT"
        assert took < EXIT_WITHIN_S
        _assert_nothing_left(procs, run_dir, tmp_path)
        assert p.pid in procs.known and m["launcher"]["torchrun_pid"] in procs.known
    finally:
        if p.poll() is None:
            p.kill()
        procs.kill_all()


# ----- unit tests (nothing spawned) -----
def test_event_reader_handles_partial_lines_and_garbage(tmp_path):
    from wan_s2v_runner.shared.events import EventReader

    d = tmp_path / "events"
    d.mkdir()
    f = d / "rank0.jsonl"
    rec = json.dumps({"t": 1.0, "rank": 0, "kind": "stage", "stage": "load"})
    f.write_text(rec[:10])
    reader = EventReader(tmp_path)
    assert reader.poll() == [] and 0 not in reader.ranks
    with open(f, "a") as fh:
        fh.write(rec[10:] + "\nnot json\n" + json.dumps({"t": 2.0, "rank": 0, "kind": "progress",
                                                         "stage": "denoise", "step": 1}))
    new = reader.poll()
    assert [e["kind"] for e in new] == ["stage"] and reader.bad_lines == 1
    assert reader.ranks[0].stage == "load" and reader.ranks[0].last_progress_t == 1.0
    with open(f, "a") as fh:
        fh.write("\n")
    assert [e["kind"] for e in reader.poll()] == ["progress"]
    assert reader.ranks[0].progress["step"] == 1 and reader.ranks[0].last_progress_t == 2.0


def _supervisor(tmp_path, **spec_kw):
    from wan_s2v_runner.launcher.console import Display
    from wan_s2v_runner.launcher.supervisor import Supervisor
    from wan_s2v_runner.shared.spec import RunSpec

    spec = RunSpec(ckpt_dir=tmp_path, image=tmp_path / "i.png", audio=tmp_path / "a.wav",
                   prompt="p", output=tmp_path / "o.mp4", nproc=2, device="cpu", **spec_kw)
    sup = Supervisor(spec, tmp_path, Display(rich=False))
    sup.t0 = 1000.0
    return sup


def test_watchdog_stalled_is_stage_aware(tmp_path):
    from wan_s2v_runner.shared.events import RankState

    sup = _supervisor(tmp_path, watchdog_load_s=100, watchdog_step_s=10)
    # a rank that never reported counts as stuck in 'start' since the spawn (load limit)
    sup.reader.ranks = {0: RankState(0, stage="init_pg", last_progress_t=1001.0)}
    assert sup.stalled(1050.0) is None
    assert sup.stalled(1102.0) == {"init_pg": [0], "start": [1]}
    # one rank still loading (long limit) keeps the watchdog quiet even if the other idles
    sup.reader.ranks = {0: RankState(0, stage="denoise", last_progress_t=1000.0),
                        1: RankState(1, stage="load", last_progress_t=1000.0)}
    assert sup.stalled(1050.0) is None
    sup.reader.ranks[1].stage = "denoise"
    assert sup.stalled(1009.0) is None
    assert sup.stalled(1011.0) == {"denoise": [0, 1]}
    # progress on any rank resets it; finished ranks are ignored
    sup.reader.ranks[1].last_progress_t = 1008.0
    assert sup.stalled(1011.0) is None
    sup.reader.ranks[1].end = {"t": 1008.0}
    assert sup.stalled(1011.0) == {"denoise": [0]}
    # 0 turns the limit off
    sup2 = _supervisor(tmp_path, watchdog_load_s=100, watchdog_step_s=0)
    sup2.reader.ranks = {r: RankState(r, stage="denoise", last_progress_t=1000.0) for r in (0, 1)}
    assert sup2.stalled(5000.0) is None


def test_rendezvous_lets_the_os_pick_the_port_on_one_node(tmp_path):
    """No port is picked before the agent binds it: one node without --master-port gets the c10d
    rendezvous on localhost:0 (torchrun --standalone); a given port or several nodes keep the
    static rendezvous on --master-addr:--master-port (29500 by default with several nodes)."""
    from wan_s2v_runner.launcher.spawn import finalize_spec
    from wan_s2v_runner.rank.agent import rendezvous

    def rdzv(**kw):
        spec = finalize_spec(_supervisor(tmp_path, **kw).spec)
        return spec, rendezvous(spec)

    spec, r = rdzv()
    assert spec.master_port is None and (r["rdzv_backend"], r["rdzv_endpoint"]) == ("c10d", "localhost:0")
    assert r["run_id"] != rdzv()[1]["run_id"]  # one rendezvous per run
    spec, r = rdzv(master_port=29611)
    assert (r["rdzv_backend"], r["rdzv_endpoint"]) == ("static", f"{spec.master_addr}:29611")
    spec, r = rdzv(nnodes=2, node_rank=1, master_addr="node0")
    assert spec.master_port == 29500
    assert (r["rdzv_backend"], r["rdzv_endpoint"], r["rdzv_configs"]) == ("static", "node0:29500", {"rank": 1})


def test_log_filter_keeps_rank0_logs_and_drops_noise():
    from wan_s2v_runner.launcher.console import LogFilter

    f = LogFilter()
    lines = [
        "W1122 01:54:05.765000 7391 torch/distributed/elastic/multiprocessing/api.py:1028] Sending SIGTERM",
        "[default0]:/x/motioner.py:30: FutureWarning: `torch.cuda.amp.autocast(args...)` is deprecated.",
        "[default0]:  @amp.autocast(enabled=False)",
        "[default0]:[2026-11-22 01:51:52,151] [rank0] INFO wan_s2v.patches: attention backend: sdpa",
        "[default0]:",
        "[default0]:Loading weights: 100%|██████████| 423/423 [00:00<00:00, 33308.75it/s]",
        "[default0]:[rank0]: Traceback (most recent call last):",
        '[default0]:[rank0]:   File "x.py", line 1, in <module>',
        "[default0]:[rank0]: RuntimeError: boom",
        "[default0]:[2026-11-22 01:51:53,000] [rank0] INFO root: after",
    ]
    shown = [s for s in (f(x) for x in lines) if s is not None]
    assert shown == ["[2026-11-22 01:51:52,151] [rank0] INFO wan_s2v.patches: attention backend: sdpa",
                     "[2026-11-22 01:51:53,000] [rank0] INFO root: after"]
    # in a terminal (the live table) INFO lines stay in the per-rank logs; warnings still show
    quiet = LogFilter(quiet_info=True)
    warning = "[default0]:[2026-11-22 01:51:54,000] [rank0] WARNING wan: low memory"
    shown = [s for s in (quiet(x) for x in lines + [warning, "[default0]:plain print"]) if s is not None]
    assert shown == ["[2026-11-22 01:51:54,000] [rank0] WARNING wan: low memory", "plain print"]


def test_rank_log_format_is_what_the_filter_reads():
    import logging

    from wan_s2v_runner.shared.events import RANK_LOG_FORMAT, rank_log_level

    fmt = logging.Formatter(RANK_LOG_FORMAT.replace("{rank}", "3"))
    rec = logging.LogRecord("wan", logging.INFO, __file__, 1, "loading [x] 1/2", None, None)
    assert rank_log_level(fmt.format(rec)) == "INFO"
    assert rank_log_level("[rank3] INFO not a log line") is None


def test_gate_prints_each_warning_with_its_finding_and_fix_on_one_line():
    from wan_s2v_runner.preflight.core import warn
    from wan_s2v_runner.preflight.doctor import GateReport
    from wan_s2v_runner.preflight.render import gate_text

    report = GateReport(results=[warn("inputs.size", "image 8x8 is upscaled 8.0x", "use a larger image")],
                        groups=())
    lines = gate_text(report).splitlines()
    assert lines[1:] == ["  WARN inputs.size: image 8x8 is upscaled 8.0x (fix: use a larger image)"]


def test_stack_analysis_names_the_rank_outside_the_collective(tmp_path):
    from wan_s2v_runner.launcher.diagnose import analyse_stacks

    (tmp_path / "stacks").mkdir()
    waiting = ('Current thread 0x1 (most recent call first):\n'
               '  File "/t/torch/distributed/distributed_c10d.py", line 5279 in all_to_all\n'
               '  File "/w/wan_s2v_runner/rank/worker.py", line 90 in generate_frames\n')
    sleeping = ('Thread 0x2 (most recent call first):\n'
                '  File "/p/threading.py", line 331 in wait\n\n'
                'Current thread 0x1 (most recent call first):\n'
                '  File "/w/wan_s2v_runner/rank/faults.py", line 38 in maybe_fire\n'
                '  File "/w/wan_s2v_runner/rank/worker.py", line 90 in generate_frames\n')
    (tmp_path / "stacks" / "rank0.txt").write_text(waiting)
    (tmp_path / "stacks" / "rank1.txt").write_text(sleeping)
    lines = analyse_stacks(tmp_path, [0, 1])
    assert lines[0].startswith("rank 0: waiting in collective all_to_all")
    assert lines[1] == "rank 1: not in a collective, at faults.py:38 in maybe_fire"
    assert "rank(s) 1 did not reach the collective" in lines[2]


def test_plain_display_coalesces_stage_lines(capsys):
    from types import SimpleNamespace

    from wan_s2v_runner.launcher.console import Display
    from wan_s2v_runner.shared.events import EventReader

    d = Display(rich=False)
    d.started(SimpleNamespace(node_rank=0, nproc=2, world_size=2, device="cpu", seed=1,
                              mode=SimpleNamespace(value="ulysses")), "RUN")
    reader = EventReader(Path("/nonexistent"))
    now = time.time()
    evs = [{"t": now, "rank": 0, "kind": "stage", "stage": "load"},
           {"t": now + 0.1, "rank": 1, "kind": "stage", "stage": "load"},
           {"t": now + 0.2, "rank": 0, "kind": "stage", "stage": "denoise", "clip": 1, "clips": 2},
           {"t": now + 0.3, "rank": 1, "kind": "error", "stage": "load", "error_type": "E", "message": "m"}]
    for ev in evs:
        reader._apply(ev)
    d.update(reader, evs, 0.0)
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["[0:00] load: ranks 0-1", "[0:00] denoise clip 1/2: rank 0 (1 of 2)",
                       "[0:00] rank 1 ERROR in load: E: m"], out


def test_event_kinds_are_the_one_vocabulary_and_a_job_counts_in_its_own_unit(tmp_path, capsys):
    """A rank writes only kinds :class:`EventKind` has (a misspelt one raises, as a stage does);
    every reader reads a clip job's position and a live job's (``unit: "block"``, its blocks, no
    steps) through ``position``: the reader's state, the console's step lines and its ETA part."""
    from types import SimpleNamespace

    from wan_s2v_runner.launcher.console import Display
    from wan_s2v_runner.shared.events import EventKind, EventReader, EventWriter, ProgressUnit, position
    from wan_s2v_runner.shared.stages import Stage

    w = EventWriter(tmp_path, 0, heartbeat_s=3600)
    try:
        with pytest.raises(ValueError):
            w.emit("progres")
        w.emit("waiting")  # a plain name that is a kind: its member
        w.stage(Stage.DENOISE, unit="block", block=1, blocks=3)
        w.step(unit="block", block=1, blocks=3, fps=12.5, first_frame_s=0.8)
    finally:
        w.close()
    reader = EventReader(tmp_path)
    new = reader.poll()
    assert [e["kind"] for e in new] == ["waiting", "stage", "progress"]
    st = reader.ranks[0]
    assert position(st.progress) == (ProgressUnit.BLOCK, 1, 3) and "clip" not in st.progress
    # the reader's progress of a clip job, and of a live job in the fields it wrote before the block fields
    assert position({"clip": 2, "clips": 5, "step": 1, "steps": 4}) == (ProgressUnit.CLIP, 2, 5)
    assert position({"unit": "block", "clip": 2, "clips": 5}) == (ProgressUnit.BLOCK, 2, 5)
    assert EventKind.coerce("job_done") is EventKind.JOB_DONE and EventKind.coerce("new_kind") == "new_kind"

    d = Display(rich=False)
    d.started(SimpleNamespace(node_rank=0, nproc=1, world_size=1, device="cpu", seed=1,
                              mode=SimpleNamespace(value="live")), "RUN")
    now = time.time()
    evs = [{"t": now, "rank": 0, "kind": "stage", "stage": "denoise", "unit": "block", "block": 1, "blocks": 3},
           {"t": now + 1, "rank": 0, "kind": "progress", "stage": "denoise", "unit": "block", "block": 1,
            "blocks": 3, "fps": 12.5, "first_frame_s": 0.8},
           {"t": now + 2, "rank": 0, "kind": "stage", "stage": "denoise", "unit": "block", "block": 2, "blocks": 3},
           {"t": now + 3, "rank": 0, "kind": "progress", "stage": "denoise", "unit": "block", "block": 2,
            "blocks": 3, "fps": 12.0}]
    reader = EventReader(Path("/nonexistent"))
    for ev in evs:
        reader._apply(ev)
    d.update(reader, evs, 0.0)
    out = capsys.readouterr().out
    assert "denoise block 1/3: rank 0" in out and "denoise block 2/3: rank 0" in out, out
    assert "rank 0: block 1/3, 12.5 frames/s, first frame at 0.8 s" in out, out
    assert "(1/3 blocks done)" in out and "(2/3 blocks done)" in out and "clip" not in out, out


def test_a_full_disk_never_kills_the_event_writer(tmp_path, monkeypatch, caplog):
    """ENOSPC while writing a record (the heartbeat thread's or the rank's own): the record is
    dropped, the rank's log says so once (and once more when writing works again, with the count);
    a line the disk cut short is ended, so readers skip it whole and read every later record."""
    import errno
    import logging
    import threading

    from wan_s2v_runner.shared import events as events_mod
    from wan_s2v_runner.shared.events import EventReader, EventWriter

    real_write, full = os.write, threading.Event()

    def write(fd, data):
        if full.is_set():
            if len(data) > 8 and not getattr(write, "cut", False):  # a short write, then no room at all
                write.cut = True
                return real_write(fd, data[:8])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(events_mod.os, "write", write)
    caplog.set_level(logging.WARNING, logger="wan_s2v.events")
    w = EventWriter(tmp_path, 0, heartbeat_s=0.02)
    try:
        w.emit("waiting")
        full.set()
        time.sleep(0.2)  # heartbeats meet the full disk
        w.emit("waiting")  # and the rank's own records
        assert w._hb.is_alive() and w.dropped >= 2
        full.clear()
        wait_for(lambda: not w.dropped, 5, "a write that succeeds again")
        w.emit("job_done", id="j")
    finally:
        w.close()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "cannot be written" in m]) == 1 and "the disk is full" in said[0], said
    assert len([m for m in said if "written again" in m and "records were dropped" in m]) == 1, said
    reader = EventReader(tmp_path)
    kinds = [e["kind"] for e in reader.poll()]
    assert kinds[0] == "waiting" and kinds[-1] == "job_done" and reader.bad_lines == 1, (kinds, reader.bad_lines)


def test_a_full_disk_before_any_rank_is_one_line_too(tiny_assets, tmp_path, monkeypatch, capsys):
    """The run directory's spec.json meets ENOSPC (no rank exists yet, nothing to resume): exit
    code disk-full, one line naming the file, its filesystem and the fix, no traceback."""
    import errno

    from wan_s2v_runner.cli import main as cli
    from wan_s2v_runner.shared import atomic
    from wan_s2v_runner.shared.disk import mount_point

    real = atomic.atomic_write

    def full(dest, write, *args, **kw):
        def no_room(tmp):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(dest, no_room, *args, **kw)

    monkeypatch.setattr(atomic, "atomic_write", full)
    code = cli.main(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--skip-preflight", "--output",
                     str(tmp_path / "o.mp4"), "--runs-root", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == exit_codes.DISK_FULL, err
    said = [line for line in err.splitlines() if line.startswith("wan-s2v: FAILED")]
    assert len(said) == 1 and "(disk-full, exit 10): the disk is full: writing " in said[0], err
    assert f"spec.json failed: No space left on device (the filesystem at {mount_point(tmp_path)})" in said[0]
    assert said[0].endswith("Fix: free space on that disk (or raise the quota), then run the same command again")
    assert "Traceback" not in err


def test_cpu_ranks_get_the_heap_reusing_malloc_settings_unless_the_user_set_them(tmp_path, monkeypatch):
    from wan_s2v_runner.launcher.spawn import CPU_MALLOC_ENV, worker_env

    spec = _supervisor(tmp_path).spec
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = worker_env(spec)
    assert all(env[k] == v for k, v in CPU_MALLOC_ENV.items()) and env["OMP_NUM_THREADS"] == str(spec.threads)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert worker_env(spec)["MALLOC_MMAP_THRESHOLD_"] == "131072"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    gpu = spec.model_copy(update={"device": "cuda"})
    assert "MALLOC_MMAP_THRESHOLD_" not in worker_env(gpu)


def test_proc_table_records_each_exit_as_it_happens_without_polling():
    """The death watch blocks (no timer) and still sees a process tracked after it started (the
    wake-up pipe re-arms it): death_t lands within a second of the exit with nobody calling
    alive(), and a watched process that lives reads as alive."""
    from wan_s2v_runner.launcher.proctree import ProcTable
    procs = ProcTable()
    sleeper = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))"]
    lasting = subprocess.Popen([*sleeper, "60"])
    try:
        procs.track(lasting.pid)
        time.sleep(0.3)  # the watch thread is now blocked on the lasting process alone
        short = subprocess.Popen([*sleeper, "0.5"])
        procs.track(short.pid)
        short.wait()
        exited = time.time()
        while time.time() < exited + 5 and short.pid not in procs.death_t:
            time.sleep(0.02)
        assert short.pid in procs.death_t, "the exit was never recorded"
        assert abs(procs.death_t[short.pid] - exited) < 1.0
        assert procs.alive(lasting.pid) and not procs.alive(short.pid)
        assert lasting.pid not in procs.death_t
    finally:
        lasting.kill()
        lasting.wait()
        procs.close()


_FORWARDING_AGENT = """
import signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
signal.signal(signal.SIGTERM, lambda sig, _frame: child.send_signal(sig))  # as torchrun's agent
child.wait()  # then exit, as the agent does once its workers are gone
"""

_DUMPING_WORKER = """
import faulthandler, signal, sys, threading, time
def deep(n, ready=None):
    if n:
        return deep(n - 1, ready)
    if ready is not None:
        ready.set()
    while True:
        time.sleep(60)
f = open(sys.argv[1] + ".part", "w")
faulthandler.register(signal.SIGTERM, file=f, all_threads=True, chain=True)  # as rank/worker.py
events = [threading.Event() for _ in range(40)]
for e in events:
    threading.Thread(target=deep, args=(80, e), daemon=True).start()
for e in events:
    e.wait()
open(sys.argv[1] + ".ready", "w").close()
deep(80)
"""


def test_stop_gives_each_rank_one_sigterm_so_its_stack_dump_is_whole(tmp_path):
    """stop() leaves the SIGTERM of torchrun's own workers to torchrun (which passes it on): a
    second SIGTERM while the worker's faulthandler writes its at-stop stacks ends the dump
    mid-line (it chains with SA_NODEFER). A stand-in agent that forwards SIGTERM and a worker
    with 41 deep stacks (a dump of milliseconds); ten stops, every dump whole."""
    from wan_s2v_runner.launcher.observer import Observers
    from wan_s2v_runner.launcher.processes import RunProcesses
    from wan_s2v_runner.shared.events import EventReader
    for i in range(10):
        dump = tmp_path / f"dump{i}"
        procs = RunProcesses(None, tmp_path, EventReader(tmp_path), Observers([]))
        procs.proc = subprocess.Popen([sys.executable, "-c", _FORWARDING_AGENT, _DUMPING_WORKER, str(dump)])
        try:
            wait_for(Path(f"{dump}.ready").exists, 30, "the worker's threads")
            procs.stop(grace_s=10.0)
        finally:
            procs.proc.kill()
            procs.procs.close()
        text = Path(f"{dump}.part").read_text()
        assert text.count("hread 0x") == 41, text[-300:]
        assert text.count("in deep") == 41 * 81 and text.endswith("\n"), (i, text[-300:])


@pytest.mark.slow(seconds=25)
def test_a_run_whose_video_cannot_be_written_says_why(tiny_assets, tmp_path):
    """The disk fills while rank 0 writes the mp4 (a real rank, one process): the job's error is
    the job's (the group ends cleanly), and the run's exit is the full disk's, in one line naming
    the filesystem, what was kept and the fix, instead of only "not written" (found on a GPU
    without imageio-ffmpeg, docs/gpu.md); run.json keeps the rank, its stage and its error."""
    from wan_s2v_runner.shared.disk import mount_point

    out = tmp_path / "out" / "o.mp4"
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--num-clips", "1", "--steps", "1",
                 "--output", str(out), "--runs-root", str(tmp_path / "runs")],
                cwd=tmp_path, env=fault_env("0:save:enospc"))
    assert r.returncode == exit_codes.DISK_FULL, r.output
    run_dir = _run_dir(tmp_path)
    said = [line for line in r.stderr.splitlines() if line.startswith("wan-s2v: FAILED")]
    assert len(said) == 1 and "(disk-full, exit 10): the disk is full (No space left on device)" in said[0], r.stderr
    assert f"kept: clip 1 of 1 in {out.parent / 'o.partial.mp4'}" in said[0], said
    assert f"Fix: free space on {mount_point(out)}, then `wan-s2v resume {run_dir}`" in said[0], said
    assert "Traceback" not in r.stderr and "hint:" not in r.stderr
    m = _manifest(run_dir)
    assert m["exit"]["status"] == "disk-full" and m["exit"]["failed_rank"] == 0, m["exit"]
    assert m["exit"]["failed_stage"] == "save" and "writing the video failed in stage save" in m["exit"]["error"]
    assert not out.exists()
