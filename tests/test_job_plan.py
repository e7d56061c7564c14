"""Long talking videos (issue #72), the planning side: rank 0's frames are flat in the clip count,
the disk the job writes, the job's time on a recorded machine, and the ETA while it runs. No
engine, no checkpoint: recorded machines (tests/data/machines/) and pure functions."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from wan_s2v_runner.preflight import CheckContext, MachineFacts, Status, run_checks
from wan_s2v_runner.preflight.core import find
from wan_s2v_runner.shared import video_budget
from wan_s2v_runner.shared.job_time import ClipClock, eta_s, job_seconds, passes_per_step
from wan_s2v_runner.shared.media import clips_for_seconds

MACHINES = Path(__file__).parent / "data" / "machines"
SIZE = 1024 * 704
TEN_MINUTES = clips_for_seconds(600, 80)  # 121 clips


def facts(name: str, **raw) -> MachineFacts:
    f = MachineFacts.load(MACHINES / f"{name}.json")
    return MachineFacts({**copy.deepcopy(f.raw), **raw})


def ctx_for(f: MachineFacts, **values) -> CheckContext:
    return CheckContext.for_values({"max_area": SIZE, **values}, f)


def result(ctx, group: str, id: str):
    r = find(run_checks(ctx, [group]), id)
    assert r is not None, f"no result {id}"
    return r


# --------------------------------------------------------------------------- host memory
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_rank0_host_memory_is_the_same_for_4_and_24_clips(device):
    """The same speech cut at 4 or at 24 clips: the same host figure per rank, for the node, and
    in memory.host (the frames are the streaming writer's few clips, not every clip's)."""
    from wan_s2v_runner.preflight.memory import plan_all

    def plan(clips):
        ctx = ctx_for(facts("rtx4090_1x"), num_clips=clips, device=device, mode="ulysses",
                      dit_offload="blocks" if device == "cuda" else "none")
        ctx.cache["audio_seconds"] = 150.0  # what the inputs check measures; the speech is held fixed
        p = plan_all(ctx)["ulysses"]
        return p, result(ctx, "memory", "memory.host")

    (p4, host4), (p24, host24) = plan(4), plan(24)
    assert (p4.host_peak, p4.host_node_total, p4.host_rank0) == (p24.host_peak, p24.host_node_total, p24.host_rank0)
    assert host4.data["need"] == host24.data["need"] and host4.finding == host24.finding
    frames = video_budget.host_frame_bytes(704, 1024, 80, on_cpu=device == "cpu")
    assert p4.parts["video_frames_rank0"] == frames
    # 2 float32 clips + 1 uint8 clip (+ the 73 motion frames in float32 on the CPU): ~1.5 GiB at 1024x704
    assert 1.4 * 2**30 < video_budget.host_frame_bytes(704, 1024, 80) < 1.5 * 2**30


def test_the_plan_states_one_host_figure():
    """memory.plan's host figure per rank, the table's node figure and memory.host's total are one
    number for one rank (they disagreed by the whole video before: 45.2 vs 133.6 GiB)."""
    from wan_s2v_runner.preflight.core import gib
    ctx = ctx_for(facts("rtx4090_1x"), num_clips=TEN_MINUTES, mode="ulysses", dit_offload="blocks")
    results = run_checks(ctx, ["memory"])
    plan, host = find(results, "memory.plan"), find(results, "memory.host")
    p = ctx.cache["plans"]["ulysses"]
    assert p.host_peak == p.host_node_total == host.data["need"]
    assert f"host {gib(p.host_peak)}/rank" in plan.finding
    # 64 GB of RAM with ten minutes of speech: T5 and wav2vec2 beside the pinned DiT would be past
    # 85% of it, so the plan releases them (issue #73); each phase's rank figure is its node figure
    assert p.release_encoders and host.data["release_encoders"] and p.host_phases is not None
    for phase in p.host_phases.values():
        assert f"1 local rank x {gib(phase['node'])} = {gib(phase['node'])}" in host.finding
    assert p.host_peak == max(phase["node"] for phase in p.host_phases.values())
    assert f"the larger (lean loading) = {gib(p.host_peak)}" in host.finding


# --------------------------------------------------------------------------- the target
def test_ten_minutes_at_1024x704_fits_the_recorded_4090_and_states_its_hours():
    from wan_s2v_runner.preflight.doctor import doctor
    report = doctor({"max_area": SIZE, "num_clips": TEN_MINUTES}, facts("rtx4090_1x"))
    host = find(report.results, "memory.host")
    assert host.status in (Status.OK, Status.WARN) and host.data["need"] <= host.data["avail"], host.finding
    assert report.workload.n_clips == TEN_MINUTES and report.workload.audio_seconds >= 600
    assert find(report.results, "memory.gpu").status is not Status.FAIL
    t = report.job_time
    assert t is not None and t.clips == TEN_MINUTES and t.passes == 2 and t.steps == 40
    assert 60 < t.pass_s < 72  # "~66 s a DiT pass at 1024x704 on a 4090"
    data = report.to_json()["job_time"]
    assert data["hours"] == pytest.approx(t.seconds / 3600, abs=0.01) and data["hours"] > 100
    text = find(report.results, "job.time").finding
    assert f"{TEN_MINUTES} clip(s) x 40 steps x 2 pass(es)" in text and " h " in text


# --------------------------------------------------------------------------- disk
def test_the_disk_check_fails_with_a_cause_and_a_fix_when_the_output_does_not_fit(tmp_path):
    """The free space comes from the recorded machine's ``disks`` (the probe's filesystem record)."""
    need = video_budget.disk_plan(TEN_MINUTES, 80, 704, 1024)
    values = dict(num_clips=TEN_MINUTES, output=tmp_path / "out" / "talk.mp4", runs_root=tmp_path / "runs")

    def disk(free_mib):
        f = facts("rtx4090_1x", disks=[{"path": "/", "free_mib": free_mib, "total_mib": 10**6}])
        return result(ctx_for(f, **values), "output", "output.disk")

    r = disk(200)
    assert r.status is Status.FAIL, r.finding
    assert "not enough disk for the job: / has 200 MiB free" in r.finding and "the mp4" in r.finding
    assert "clips/state_NNNN.pt" in r.finding and f"{TEN_MINUTES} clip(s)" in r.finding
    assert r.fix.startswith("free ") and "--output/--runs-root" in r.fix
    assert r.data["filesystems"]["/"]["need"] == need.output + need.run_dir
    close = disk((need.total + 2**29) // 2**20)  # half a GiB to spare
    assert close.status is Status.WARN and "close to full" in close.finding
    assert disk(10**6).status is Status.OK
    # a recorded machine without disks: unknown, not this machine's disk
    unknown = result(ctx_for(facts("rtx4090_1x"), **values), "output", "output.disk")
    assert unknown.status is Status.SKIP and "free space unknown" in unknown.finding


def test_the_probe_records_the_filesystem_a_path_lands_on(tmp_path):
    from wan_s2v_runner.preflight.probe import filesystem
    fs = filesystem(tmp_path / "not" / "yet" / "made.mp4")
    assert fs is not None and fs["free_mib"] > 0 and Path(fs["path"]) in [tmp_path, *tmp_path.parents]
    f = MachineFacts({"disks": [{"path": "/", "free_mib": 1}, {"path": str(tmp_path), "free_mib": 7}]})
    assert f.filesystem(tmp_path / "a.mp4")["free_mib"] == 7 and f.filesystem("/elsewhere")["free_mib"] == 1


def test_the_video_budget_rule():
    frames = video_budget.video_frames(TEN_MINUTES, 80)
    assert frames == TEN_MINUTES * 80 - 3
    mp4 = video_budget.mp4_bytes(frames, 704, 1024)
    assert mp4 == int(frames * 704 * 1024 * 0.5 / 8 + frames / 16 * 128_000 / 8)
    assert 0.4e9 < mp4 < 0.5e9  # ten minutes at 1024x704: ~0.44 GB
    assert video_budget.state_bytes(704, 1024) == video_budget.state_bytes(704, 1024)  # one file, any length
    with_raw = video_budget.disk_plan(4, 80, 704, 1024, frames_out=True)
    assert with_raw.frames_out == 2 * 3 * (4 * 80 - 3) * 704 * 1024 * 4


# --------------------------------------------------------------------------- time
def test_the_job_time_scales_with_clips_steps_and_passes():
    from wan_s2v_runner.preflight.checks_time import job_time

    def t(f="rtx4090_1x", **kw):
        vals = dict(num_clips=4, steps=40, guide_scale=4.5, start_from_ref=True, mode="ulysses",
                    dit_offload="blocks")
        return job_time(ctx_for(facts(f), **{**vals, **kw}))

    base = t()
    assert base.seconds == pytest.approx(4 * 40 * 2 * base.pass_s)
    assert t(num_clips=8).seconds == pytest.approx(2 * base.seconds)
    assert t(steps=10).seconds == pytest.approx(base.seconds / 4)
    one = t(guide_scale=1.0)
    assert one.passes == 1 and one.seconds == pytest.approx(base.seconds / 2)
    # two GPUs with the CFG split: each rank runs one of the two passes a step
    cfg = t("rtx4090_2x", nproc=2, cfg_parallel=True)
    assert cfg.passes == 1 and cfg.seconds == pytest.approx(4 * 40 * cfg.pass_s)
    # the first clip has no motion tokens: a shorter pass
    first = t(start_from_ref=False)
    assert first.first_pass_s < first.pass_s and first.seconds < base.seconds


def test_job_seconds_and_passes_are_plain_arithmetic():
    assert passes_per_step(4.5) == 2 and passes_per_step(1.0) == 1 and passes_per_step(4.5, cfg_degree=2) == 1
    assert job_seconds(3, 40, 2, 10.0) == 2400.0
    assert job_seconds(3, 40, 2, 10.0, first_pass_s=5.0) == 40 * 2 * (5.0 + 2 * 10.0)
    assert job_seconds(0, 40, 2, 10.0) == 0.0


# --------------------------------------------------------------------------- ETA
def test_eta_from_the_measured_seconds_a_clip():
    # 3 of 10 clips made in 300 s, 40 s into the fourth: 7 left at 100 s, less the 40 spent
    assert eta_s(10, 3, made=3, made_s=300.0, in_clip_s=40.0, plan_clip_s=999.0) == pytest.approx(660.0)
    # a resumed attempt: clips 1-5 came from before; it made 2 in 100 s -> 50 s a clip
    assert eta_s(10, 7, made=2, made_s=100.0, in_clip_s=10.0) == pytest.approx(140.0)
    assert eta_s(10, 10, made=10, made_s=1000.0) == 0.0


def test_eta_before_the_first_clip_ends_falls_back_to_the_plan_then_the_step_pace():
    assert eta_s(10, 0, in_clip_s=30.0, plan_clip_s=100.0) == pytest.approx(970.0)
    assert eta_s(10, 0, in_clip_s=30.0, clip_fraction=0.25) == pytest.approx(10 * 120.0 - 30.0)
    assert eta_s(10, 0, in_clip_s=30.0) is None  # nothing known yet
    assert eta_s(None, 0, plan_clip_s=100.0) is None  # clips unknown
    assert eta_s(10, 0, in_clip_s=5000.0, plan_clip_s=100.0) == 0.0  # never negative


def test_the_clip_clock_follows_rank0s_events():
    from wan_s2v_runner.launcher.console import clock_on_event
    clock = ClipClock(plan_clip_s=50.0)
    assert clock.clips_done == 0 and clock.eta(0.0) is None
    for ev in ({"kind": "stage", "stage": "denoise", "clip": 1, "clips": 3, "t": 100.0},
               {"kind": "progress", "clip": 1, "clips": 3, "step": 1, "steps": 4, "t": 110.0}):
        clock_on_event(clock, ev)
    assert (clock.clips_done, clock.clips_total) == (0, 3)
    assert clock.eta(110.0) == pytest.approx(3 * 50.0 - 10.0)  # the plan's until a clip is done
    for ev in ({"kind": "stage", "stage": "decode", "clip": 1, "clips": 3, "t": 130.0},
               {"kind": "stage", "stage": "denoise", "clip": 2, "clips": 3, "t": 160.0}):
        clock_on_event(clock, ev)
    assert clock.clips_done == 1 and clock.eta(170.0) == pytest.approx(2 * 60.0 - 10.0)  # measured: 60 s a clip
    clock_on_event(clock, {"kind": "stage", "stage": "save", "t": 300.0})
    assert clock.clips_done == 3 and clock.eta(300.0) == 0.0


def test_a_served_jobs_video_object_has_its_clips_and_eta():
    from wan_s2v_runner.serve.progress import Progress
    from wan_s2v_runner.serve.protocol import VideoObject
    p = Progress(started=0.0, plan_clip_s=20.0)
    assert p.as_dict(0.0)["clips_done"] is None and p.as_dict(0.0)["eta_s"] is None
    p.on_event({"kind": "stage", "stage": "denoise", "clip": 1, "clips": 5, "steps": 2, "t": 10.0})
    p.on_event({"kind": "progress", "clip": 1, "clips": 5, "step": 1, "steps": 2, "t": 15.0})
    d = p.as_dict(15.0)
    assert (d["clips_done"], d["clips_total"], d["eta_s"]) == (0, 5, 95.0)
    v = VideoObject(id="video_1", model="m", status="in_progress", progress=10, created_at=0, **d)
    assert (v.clips_done, v.clips_total, v.eta_s) == (0, 5, 95.0)


def test_a_live_jobs_video_object_counts_its_blocks():
    """A live job (``unit: "block"``): its block fields, blocks done and percent of its blocks; the
    clip and step fields None. A clip job's: the clip fields, the block ones None."""
    from wan_s2v_runner.serve.progress import Progress
    from wan_s2v_runner.serve.protocol import VideoObject
    from wan_s2v_runner.serve.state import percent
    from wan_s2v_runner.serve.store.protocol import JobStatus

    p = Progress(started=0.0)
    for ev in ({"kind": "stage", "stage": "denoise", "unit": "block", "block": 1, "blocks": 4, "t": 10.0},
               {"kind": "progress", "unit": "block", "block": 1, "blocks": 4, "fps": 12.0, "t": 12.0},
               {"kind": "stage", "stage": "denoise", "unit": "block", "block": 2, "blocks": 4, "t": 12.5}):
        p.on_event(ev)
    d = p.as_dict(13.0)
    assert (d["unit"], d["block"], d["blocks"], d["blocks_done"], d["blocks_total"]) == ("block", 2, 4, 1, 4)
    assert d["clip"] is d["clips"] is d["step"] is d["steps"] is d["clips_done"] is d["clips_total"] is None
    assert d["eta_s"] == pytest.approx(3 * 2.5)  # as the second block began: 2.5 s a block, 3 blocks left
    row = type("Row", (), {"status": JobStatus.IN_PROGRESS})()
    assert percent(row, d) == 25
    v = VideoObject(id="video_1", model="m", status="in_progress", progress=percent(row, d), created_at=0, **d)
    assert (v.unit, v.block, v.blocks, v.clip) == ("block", 2, 4, None)
    clip = Progress(started=0.0)
    clip.on_event({"kind": "progress", "unit": "clip", "clip": 2, "clips": 4, "step": 1, "steps": 2, "t": 1.0})
    c = clip.as_dict(1.0)
    assert (c["unit"], c["clip"], c["clips"], c["block"], c["blocks"]) == ("clip", 2, 4, None, None)
    assert percent(row, c) == int(100 * 3 / 8)
