"""The launcher's verdicts without processes: the stage vocabulary, the hang watchdog, the hang
report, which rank failed first, and the out-of-memory hints. Every input (rank states, error
files, exit times, exit codes) is built by hand; nothing is spawned.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from wan_s2v_runner.launcher.diagnose import (
    DEATH,
    ERROR_EVENT,
    ERROR_FILE,
    RankFailure,
    attribute_failures,
    hint_for,
    read_error_files,
)
from wan_s2v_runner.launcher.watchdog import WatchdogLimits, describe_hang, stalled
from wan_s2v_runner.shared.events import EventReader, EventWriter, RankState
from wan_s2v_runner.shared.stages import Stage, gets_load_limit

SPAWN = 1000.0
LIMITS = WatchdogLimits(load_s=100.0, step_s=10.0)


def _spec(tmp_path: Path, **kw):
    from wan_s2v_runner.shared.spec import RunSpec

    return RunSpec(ckpt_dir=tmp_path, image=tmp_path / "i.png", audio=tmp_path / "a.wav", prompt="p",
                   output=tmp_path / "o.mp4", nproc=2, device="cpu", **kw)


def _in_denoise(rank: int, t: float, **kw) -> RankState:
    return RankState(rank, stage=Stage.DENOISE, last_progress_t=t, last_seen_t=t, pid=4000 + rank,
                     local_rank=rank, progress={"clip": 1, "clips": 2, "step": 1, "steps": 2}, **kw)


def _error(t: float, error_type: str, message: str) -> dict:
    return {"t": t, "kind": "error", "error_type": error_type, "message": message}


# ----- the stage vocabulary -----
def test_stages_in_run_order_with_their_classes():
    assert [s.value for s in Stage] == [
        "start", "init_pg", "engine_import", "load", "fingerprint", "shard", "tts", "audio_encode",
        "ref_encode", "text_encode", "receive_inputs", "compile", "pose_encode", "denoise", "decode", "motion_encode",
        "receive_motion", "clip_checkpoint", "save", "idle", "done"]
    load_class = [s for s in Stage if s.is_load_class]
    assert load_class == list(Stage)[:list(Stage).index(Stage.POSE_ENCODE)]  # everything before the clips
    assert all(s.is_step_class != s.is_load_class for s in Stage)
    assert {s for s in Stage if s.repeats_per_clip} == {Stage.POSE_ENCODE, Stage.DENOISE, Stage.DECODE,
                                                         Stage.MOTION_ENCODE, Stage.RECEIVE_MOTION,
                                                         Stage.CLIP_CHECKPOINT}
    assert {s for s in Stage if s.first_rank_only} == {Stage.TTS, Stage.SAVE, Stage.CLIP_CHECKPOINT}
    # members are the plain names wherever text is made
    assert Stage.LOAD == "load" and f"{Stage.LOAD}" == "load" and str(Stage.SAVE) == "save"
    assert json.dumps({Stage.DENOISE: [Stage.DECODE]}) == '{"denoise": ["decode"]}'
    assert Stage.lookup("denoise") is Stage.DENOISE and Stage.lookup("denoize") is None
    assert Stage.coerce("warmup") == "warmup" and not isinstance(Stage.coerce("warmup"), Stage)


def test_writer_refuses_an_unknown_stage_and_writes_plain_names(tmp_path):
    w = EventWriter(tmp_path, rank=0, heartbeat_s=60)
    try:
        w.stage(Stage.LOAD)
        w.stage("text_encode")  # a valid name is accepted as the member
        assert w.current_stage is Stage.TEXT_ENCODE
        with pytest.raises(ValueError):
            w.stage("text_encdoe")
    finally:
        w.close()
    recs = [json.loads(x) for x in (tmp_path / "events" / "rank0.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in recs] == ["load", "text_encode"]


def test_reader_keeps_an_unknown_stage_and_the_watchdog_gives_it_the_load_limit(tmp_path):
    (tmp_path / "events").mkdir()
    recs = [{"t": 1001.0, "rank": 0, "kind": "stage", "stage": "warmup"},
            {"t": 1001.0, "rank": 1, "kind": "stage", "stage": "denoise", "clip": 1, "clips": 1},
            {"t": 1001.5, "rank": 1, "kind": "stage"}]  # no stage name at all
    for r in (0, 1):
        (tmp_path / "events" / f"rank{r}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in recs if x["rank"] == r))
    reader = EventReader(tmp_path)
    assert len(reader.poll()) == 3
    assert reader.ranks[0].stage == "warmup" and not isinstance(reader.ranks[0].stage, Stage)
    assert reader.ranks[1].stage == "?"
    assert gets_load_limit("warmup") and LIMITS.for_stage("warmup") == 100.0
    assert stalled({0: reader.ranks[0]}, [0], SPAWN, 1050.0, LIMITS) is None  # 49 s < load limit
    assert stalled({0: reader.ranks[0]}, [0], SPAWN, 1102.0, LIMITS) == {"warmup": [0]}


# ----- the watchdog -----
def test_watchdog_waits_while_any_rank_is_within_its_limit():
    ranks = {0: RankState(0, stage=Stage.DENOISE, last_progress_t=1000.0),
             1: RankState(1, stage=Stage.LOAD, last_progress_t=1000.0)}
    # rank 0 is 50 s past the step limit, but rank 1 is still loading (load limit 100 s)
    assert stalled(ranks, [0, 1], SPAWN, 1050.0, LIMITS) is None
    assert stalled(ranks, [0, 1], SPAWN, 1101.0, LIMITS) == {Stage.DENOISE: [0], Stage.LOAD: [1]}


def test_watchdog_fires_when_every_rank_exceeds_its_stage_limit():
    ranks = {r: RankState(r, stage=Stage.DENOISE, last_progress_t=1000.0) for r in (0, 1)}
    assert stalled(ranks, [0, 1], SPAWN, 1010.0, LIMITS) is None  # exactly at the limit: not yet
    assert stalled(ranks, [0, 1], SPAWN, 1010.5, LIMITS) == {Stage.DENOISE: [0, 1]}
    ranks[1].last_progress_t = 1005.0  # progress on one rank keeps the run alive
    assert stalled(ranks, [0, 1], SPAWN, 1010.5, LIMITS) is None
    ranks[1].end = {"t": 1005.0}  # a finished rank is left out
    assert stalled(ranks, [0, 1], SPAWN, 1010.5, LIMITS) == {Stage.DENOISE: [0]}
    ranks[0].error = _error(1001.0, "E", "m")  # so is a failed one: nothing left to watch
    assert stalled(ranks, [0, 1], SPAWN, 5000.0, LIMITS) is None


def test_watchdog_uses_the_load_limit_for_load_stages_and_the_spawn_for_silent_ranks():
    for stage in (s for s in Stage if s.is_load_class):
        ranks = {0: RankState(0, stage=stage, last_progress_t=1000.0)}
        assert stalled(ranks, [0], SPAWN, 1050.0, LIMITS) is None, stage  # past 10 s, within 100 s
        assert stalled(ranks, [0], SPAWN, 1101.0, LIMITS) == {stage: [0]}, stage
    # a rank that never reported is in 'start' since the spawn
    assert stalled({}, [0, 1], SPAWN, 1099.0, LIMITS) is None
    assert stalled({}, [0, 1], SPAWN, 1101.0, LIMITS) == {Stage.START: [0, 1]}


def test_a_limit_of_zero_turns_that_kind_off():
    ranks = {r: RankState(r, stage=Stage.DENOISE, last_progress_t=1000.0) for r in (0, 1)}
    assert stalled(ranks, [0, 1], SPAWN, 9999.0, WatchdogLimits(load_s=100.0, step_s=0.0)) is None
    loading = {0: RankState(0, stage=Stage.LOAD, last_progress_t=1000.0)}
    assert stalled(loading, [0], SPAWN, 9999.0, WatchdogLimits(load_s=0.0, step_s=10.0)) is None
    assert stalled(ranks, [0, 1], SPAWN, 1011.0, WatchdogLimits(load_s=0.0, step_s=10.0)) == {Stage.DENOISE: [0, 1]}


# ----- the hang report -----
def test_hang_report_names_stuck_stage_silent_ranks_and_frozen_processes(tmp_path):
    ranks = {0: RankState(0, stage=Stage.DENOISE, last_progress_t=1000.0, last_seen_t=1029.0,
                          progress={"clip": 1, "clips": 2, "step": 0, "steps": 2}),
             1: RankState(1, stage=Stage.DENOISE, last_progress_t=1000.0, last_seen_t=1005.0,
                          progress={"clip": 1, "clips": 2, "step": 0, "steps": 2})}
    r = describe_hang({Stage.DENOISE: [0, 1]}, ranks, now=1030.0, limits=LIMITS,
                      stacks_dir=tmp_path / "stacks", stack_lines=["rank 1: not in a collective, at f.py:1 in g"])
    assert r.reason == (f"stuck in denoise (clip 1/2, step 0/2) on ranks 0,1 (no progress for 10s); "
                        f"stacks in {tmp_path / 'stacks'}")
    assert r.details == ("rank 1: not in a collective, at f.py:1 in g",
                         "rank 1: no heartbeat for 25s (process frozen, swapping, or stopped?)")
    assert "--watchdog-step" in r.hint and r.limit_s == 10.0

    stuck = {Stage.INIT_PG: [0], Stage.START: [1, 2]}
    ranks = {0: RankState(0, stage=Stage.INIT_PG, last_progress_t=1000.0, last_seen_t=1199.0)}
    r = describe_hang(stuck, ranks, now=1200.0, limits=LIMITS, stacks_dir=tmp_path,
                      silent={1: (4321, "S (sleeping)")})
    assert r.reason.startswith("stuck in init_pg on rank 0; start on ranks 1,2 (no progress for 100s)")
    assert r.details[0].startswith("rank 1 never reported (no events): its process (pid 4321) was S (sleeping)")
    assert r.details[1].startswith("rank 2 never reported (no events) and no worker process was found")
    assert "--watchdog-load" in r.hint


# ----- which rank failed first -----
def _attribute(ranks, **kw):
    args = dict(error_files={}, death_times={}, exit_codes={})
    args.update(kw)
    return attribute_failures(ranks, **args)


def test_the_first_error_is_the_cause_and_connection_errors_are_consequences():
    ranks = {0: _in_denoise(0, 1000.0, error=_error(1099.6, "RuntimeError", "Connection closed by peer [::1]:1234")),
             1: _in_denoise(1, 1000.0, error=_error(1100.0, "InjectedFault", "boom on rank 1")),
             2: _in_denoise(2, 1000.0, error=_error(1100.4, "ValueError", "later, unrelated"))}
    fs = _attribute(ranks)
    # rank 0's "connection closed" came 0.4 s earlier, but it says a peer went away: a consequence
    assert [f.rank for f in fs] == [1, 2, 0]
    cause = fs[0]
    assert cause.source == ERROR_EVENT and not cause.secondary and cause.stage is Stage.DENOISE
    assert cause.headline() == "rank 1 failed in stage denoise (clip 1/2, step 1/2): InjectedFault: boom on rank 1"
    assert fs[2].secondary and fs[2].also_line() == (
        "also rank 0 in denoise: RuntimeError: Connection closed by peer [::1]:1234 (a consequence: a peer went away)")
    assert fs[1].also_line() == "also rank 2 in denoise: ValueError: later, unrelated"
    # the real cause wins even when it is recorded a little after its peer noticed
    ranks[1].error["t"] = 1100.3  # 0.7 s after rank 0 noticed
    assert _attribute(ranks)[0].rank == 1
    # ... but not when it comes much later (then rank 0's error is all there is to go on)
    ranks[1].error["t"] = 1101.0
    ranks[2].error["t"] = 1102.0
    assert _attribute(ranks)[0].rank == 0


def test_a_peer_lost_on_another_node_names_that_node(tmp_path):
    from wan_s2v_runner.launcher.diagnose import analyse_stacks, other_nodes_text
    msg = "Connection reset by peer [10.0.0.2]:29500"
    assert "read the other ranks' errors" in hint_for(msg, Stage.DENOISE, _spec(tmp_path))
    two = _spec(tmp_path, nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=29500)
    assert other_nodes_text(two) == "node 1 of 2 (global ranks 2-3)"
    hint = hint_for(msg, Stage.DENOISE, two)
    assert "peer on another node: node 1 of 2 (global ranks 2-3) went away first, peer address 10.0.0.2" in hint
    four = _spec(tmp_path, nnodes=4, node_rank=2, master_addr="10.0.0.1", master_port=29500)
    assert other_nodes_text(four) == "one of nodes 0, 1, 3 of 4 (global ranks 0-3, 6-7)"
    # a hang where every rank of this node waits (a collective, or the split VAE's halo rows)
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    for r, (path, fn) in enumerate([("torch/distributed/distributed_c10d.py", "all_gather"),
                                    ("wan_s2v_runner/vae_split/halo.py", "await_peers")]):
        (stacks / f"rank{r}.txt").write_text(
            f'Current thread 0x0001 (most recent call first):\n  File "/x/{path}", line 9 in {fn}\n'
            '  File "/x/wan_s2v_runner/rank/worker.py", line 1 in main\n')
    lines = analyse_stacks(tmp_path, [0, 1], remote=other_nodes_text(two))
    assert lines[1] == "rank 1: waiting in collective await_peers (top frame halo.py:9 in await_peers)"
    assert "every rank of this node waits for its peers, so what holds them up is on node 1 of 2" in lines[-1]
    assert len(analyse_stacks(tmp_path, [0, 1])) == 2  # one node: nothing to point at
    # NCCL: a rank blocks at a later CUDA sync, not in the collective; the other node is still named
    (stacks / "rank1.txt").write_text('Current thread 0x0001 (most recent call first):\n'
                                      '  File "/x/wan_s2v_runner/rank/generation.py", line 5 in step\n'
                                      '  File "/x/wan_s2v_runner/rank/worker.py", line 1 in main\n')
    lines = analyse_stacks(tmp_path, [1], remote=other_nodes_text(two))
    assert lines[-1].startswith("-> with several nodes, the rank holding these up may be on node 1 of 2")


def test_a_rank_killed_by_a_signal_without_an_error_record_is_named_with_the_signal(tmp_path):
    ranks = {0: _in_denoise(0, 1000.0, error=_error(1100.1, "RuntimeError", "Connection reset by peer")),
             1: _in_denoise(1, 1000.0)}  # no error, no end: only its exit says it failed
    fs = _attribute(ranks, death_times={4001: 1100.0, 4000: 1100.3}, exit_codes={1: -9, 0: 1})
    cause = fs[0]
    assert (cause.rank, cause.source, cause.exitcode, cause.pid, cause.timestamp) == (1, DEATH, -9, 4001, 1100.0)
    assert cause.message == "died without an error report (killed by SIGKILL)"
    assert cause.headline() == ("rank 1 (pid 4001) died without an error report (killed by SIGKILL) "
                                "in stage denoise (clip 1/2, step 1/2)")
    assert "OOM killer" in cause.hint
    assert fs[1].rank == 0 and fs[1].secondary
    # an exit code we do not know yet, and a crash with a Python stack
    stack = tmp_path / "rank1.txt"
    fs = _attribute(ranks, death_times={4001: 1100.0}, exit_codes={}, crash_stacks={1: stack})
    assert fs[0].message == "died without an error report (exit status unknown)"
    assert str(stack) in fs[0].hint
    # a rank that exited normally (end record) or whose process still runs is no failure
    ranks[1].end = {"t": 1100.0}
    assert [f.rank for f in _attribute(ranks, death_times={4001: 1100.0})] == [0]


def test_failure_record_has_torch_elastic_process_failure_fields():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    ours = [f.name for f in dataclasses.fields(RankFailure)]
    theirs = [f.name for f in dataclasses.fields(ProcessFailure) if f.name != "error_file_data"]
    assert ours[:len(theirs)] == theirs
    assert RankFailure.__dataclass_params__.frozen


def _write_error_file(run_dir: Path, local_rank: int, stamp: int, message: str) -> Path:
    d = run_dir / "logs" / "abc_x" / "attempt_0" / str(local_rank)
    d.mkdir(parents=True)
    tb = f'Traceback (most recent call last):\n  File "w.py", line 1, in main\n{message}\n'
    (d / "error.json").write_text(json.dumps({"message": {"message": message, "extraInfo": {
        "py_callstack": tb, "timestamp": str(stamp)}}}))
    return d / "error.json"


def test_ranks_that_failed_before_their_first_event_are_told_by_their_error_files(tmp_path):
    p3 = _write_error_file(tmp_path, 1, 1700000005, "ImportError: no module named wan")
    _write_error_file(tmp_path, 0, 1700000007, "RuntimeError: later")
    files = read_error_files(tmp_path, rank_offset=2)  # node 1 of 2 nodes with 2 ranks each
    assert sorted(files) == [2, 3] and files[3].local_rank == 1 and files[3].timestamp == 1700000005
    fs = _attribute({}, error_files=files)
    cause = fs[0]
    assert (cause.rank, cause.local_rank, cause.source, cause.stage) == (3, 1, ERROR_FILE, Stage.START)
    assert cause.error_file == str(p3) and "no module named wan" in cause.traceback
    assert cause.headline() == "rank 3 failed before its first event: ImportError: no module named wan"
    assert fs[1].also_line() == "also rank 2 in start: RuntimeError: later"


def test_no_failed_rank_gives_no_failure():
    done = {r: RankState(r, stage=Stage.DONE, pid=4000 + r, end={"t": 1.0}) for r in (0, 1)}
    assert _attribute(done, death_times={4000: 2.0, 4001: 2.0}, exit_codes={}) == []


# ----- hints decided by the layout, not by mode names -----
@pytest.mark.slow
def test_oom_hints_follow_the_layout(tmp_path):
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    ulysses, fsdp, hybrid = (_spec(tmp_path, mode=m) for m in ("ulysses", "fsdp-fixed", "hybrid"))
    h = hint_for(oom, Stage.LOAD, ulysses)
    assert h.startswith("GPU out of memory while loading weights (ulysses): try ")
    assert "--mode fsdp-fixed" in h and "--mode hybrid" in h  # both shard the DiT
    h = hint_for(oom, Stage.SHARD, fsdp)
    assert "--mode hybrid" in h and "T5 on CPU" in h and "--mode fsdp-fixed" not in h and "more ranks" in h
    h = hint_for(oom, Stage.LOAD, hybrid)
    assert "--mode" not in h and "more ranks" in h  # nothing left to shard or move
    assert "--mode hybrid" in hint_for(oom, Stage.TEXT_ENCODE, fsdp)  # the mode with T5 on the CPU
    assert "--mode" not in hint_for(oom, Stage.TEXT_ENCODE, hybrid)
    assert "--mode hybrid" in hint_for(oom, Stage.DENOISE, ulysses)  # splits weights and activations
    assert "--mode" not in hint_for(oom, Stage.DENOISE, hybrid) and "more ranks" in hint_for(oom, Stage.DENOISE, hybrid)
    assert "VAE" in hint_for(oom, Stage.DECODE, hybrid)
    assert hint_for(oom, "warmup", None).startswith("GPU out of memory in warmup (?)")
    assert hint_for("RuntimeError: something new", Stage.LOAD, ulysses) is None
