"""``wan-s2v batch``: one rank group loads once and makes several videos in a row, each exactly the
frames one process makes for that job's spec (different sizes, seeds, prompts, solvers: nothing
of one job leaks into the next); a bad line is refused with its cause and the others run; after a
rank fails in the middle of a job, the same command skips the finished job and resumes the
interrupted one from its last clip, and its mp4 is the uninterrupted one's."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import BIG_JOB, TINY_FLAGS, asset_flags, one_process_frames, run_cli
from fault_worker import fault_env

from wan_s2v_runner.launcher.batch import plan_lines
from wan_s2v_runner.launcher.job_book import JobState, group_values
from wan_s2v_runner.shared import exit_codes, media
from wan_s2v_runner.shared.job_source import SPEC_KEY, JobSource, read_source
from wan_s2v_runner.shared.spec import GroupSpec, RunSpec

#: jobs 2 and 3 differ from job 1 (the shared tiny spec) in size, seed, prompt, solver, first frame
OTHER_JOBS = {"big": BIG_JOB, "third": dict(seed=5, prompt="a third person", start_from_ref=True)}


@pytest.fixture(scope="module")
def other_frames(engine_cpu, big_reference_frames):
    """One process's frames for each of OTHER_JOBS (the loop a --nproc 1 worker runs, here; the
    big one made once per test run: conftest's)."""
    return {"big": big_reference_frames, "third": one_process_frames(engine_cpu, **OTHER_JOBS["third"])}


def _write_jobs(path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


#: ulysses at 2 ranks takes jobs in a row in tests/test_serve.py (the same RankGroup loop); here fsdp-fixed +
#: CFG: T5 is FSDP-sharded, so every rank encodes the texts together and all must agree, job after job, on
#: which texts the group's memo holds (rank/encoders.py: the default negative prompt is encoded once)
LAYOUT = ["--nproc", "2", "--mode", "fsdp-fixed", "--cfg-parallel"]


@pytest.mark.slow
def test_jobs_in_a_row_equal_one_process(tiny_assets, pose_reference_frames, other_frames, tmp_path):
    jobs = tmp_path / "my jobs.jsonl"
    _write_jobs(jobs, [
        {"id": "first", "frames_out": str(tmp_path / "first.pt"), "pose_video": str(tiny_assets.pose_video)},
        {"id": "big", "size": "128*128", "seed": 7, "prompt": "someone else", "solver": "dpm++",
         "frames_out": str(tmp_path / "big.pt")},
        {"id": "missing", "audio": str(tmp_path / "nowhere.wav")},
        {"id": "third", "seed": 5, "prompt": "a third person", "start_from_ref": True,
         "frames_out": str(tmp_path / "third.pt")},
    ])
    out = tmp_path / "out"
    r = run_cli(["batch", str(jobs), *TINY_FLAGS, *asset_flags(tiny_assets), *LAYOUT, "--output-dir", str(out),
                 "--runs-root", str(tmp_path / "runs")], cwd=tmp_path)
    # the bad line is refused with its cause, the others are made: exit 3 says a line was refused
    assert r.returncode == exit_codes.PREFLIGHT, r.output
    assert "line 3 (missing) refused: preflight inputs.audio" in r.stderr and "does not exist" in r.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()  # one rank group for all three, whose jobs are the list's
    assert json.loads((run_dir / "spec.json").read_text())[SPEC_KEY] == "list"  # recorded, not inferred
    assert read_source(run_dir) is JobSource.LIST
    assert "job 1/3: first" in r.stdout and "job 3/3: third" in r.stdout, r.stdout
    expected = {"first": pose_reference_frames, **other_frames}
    for name, want in expected.items():
        got = torch.load(tmp_path / f"{name}.pt")
        assert got.shape == want.shape and torch.equal(got, want), f"{name}: {(got - want).abs().max()}"
        record = json.loads((out / f"{name}.json").read_text())
        assert record["status"] == "ok" and record["output"]["sha256"] == media.sha256_file(out / f"{name}.mp4")
        assert record["stage_seconds"]["denoise"] > 0
    summary = r.stdout[r.stdout.index("line  id"):]
    assert [row.split()[2] for row in summary.splitlines()[1:]] == ["done", "done", "refused", "done"], summary
    # T5 ran for each new prompt only, on both ranks alike: the negative prompt was kept from job 1
    for events in (next((tmp_path / "runs").iterdir()) / "events").glob("rank*.jsonl"):
        texts = [e["texts_encoded"] for e in map(json.loads, events.read_text().splitlines())
                 if e.get("kind") == "stage" and e.get("stage") == "text_encode"]
        assert texts == [2, 1, 1], (events.name, texts)


@pytest.mark.slow
def test_batch_resumes_the_interrupted_job_and_skips_the_finished_one(tiny_assets, engine_cpu, tmp_path):
    three_clips = {"infer_frames": 4, "num_clips": 3}
    jobs = tmp_path / "jobs.jsonl"
    _write_jobs(
        jobs, [{"id": "one", "steps": 1, **three_clips, "num_clips": 1}, {"id": "two", "seed": 9, **three_clips}]
    )
    out = tmp_path / "out"
    argv = ["batch", str(jobs), *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", "--output-dir", str(out),
            "--runs-root", str(tmp_path / "runs")]
    r = run_cli(argv, cwd=tmp_path, env=fault_env("1:denoise@2#2:raise"))  # job 2, clip 2
    assert r.returncode == exit_codes.RANK_FAILED, r.output
    assert "rank 1 failed in stage denoise" in r.stderr
    assert (out / "one.json").is_file() and not (out / "two.mp4").exists()
    state = json.loads((out / ".work" / "two" / "clips" / "state.json").read_text())
    assert state["next_clip"] == 1
    one_mtime = (out / "one.mp4").stat().st_mtime_ns

    r = run_cli(argv, cwd=tmp_path)  # the same command again
    assert r.returncode == 0, r.output
    assert "line 1 (one) done before" in r.stderr and "line 2 (two) resumes at clip 2" in r.stderr, r.stderr
    assert (out / "one.mp4").stat().st_mtime_ns == one_mtime  # not made again
    assert json.loads((out / "two.json").read_text())["resumed_at_clip"] == 2
    whole = tmp_path / "whole.mp4"  # the uninterrupted job: one process's frames, written as rank 0 does
    frames = one_process_frames(engine_cpu, seed=9, **three_clips)
    media.save_video_with_audio(frames, engine_cpu[1].sample_fps, tiny_assets.audio, whole,
                                media.clip_lengths(frames.shape[1], three_clips["infer_frames"]))
    assert media.sha256_file(out / "two.mp4") == media.sha256_file(whole)


def test_lines_are_checked_before_anything_runs(tiny_assets, tmp_path):
    """No spawn: how lines become job specs or refusals (JSON Lines and CSV)."""
    base = dict(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, audio=tiny_assets.audio,
                prompt="p", device="cpu", nproc=2)
    group = GroupSpec(**group_values(base))  # the rank group: checked once, before the lines
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "ok", "sample_steps": 3, "size": "64*64"}\n'
                    "not json\n"
                    '{"id": "ok"}\n'
                    '{"nproc": 4}\n'
                    '{"infer_frames": 5}\n'
                    '# a comment\n'
                    '{"prompt": "no id: one is made from the settings", "image": "pics/a b.png"}\n')
    lines = plan_lines(jobs, base, group, tmp_path / "out")
    states = [(line.number, line.state) for line in lines]
    assert states == [(1, JobState.QUEUED), (2, JobState.REFUSED), (3, JobState.REFUSED), (4, JobState.REFUSED),
                      (5, JobState.REFUSED), (7, JobState.QUEUED)]
    ok = lines[0].spec
    assert (
        isinstance(ok, RunSpec)
        and ok.steps == 3
        and ok.max_area == 64 * 64
        and ok.output == tmp_path / "out" / "ok.mp4"
    )
    assert lines[0].spec.seed >= 0  # -1 resolved once, and kept for the job (a resumed job keeps it)
    assert "not JSON" in lines[1].cause
    assert "used by an earlier line" in lines[2].cause
    assert "nproc: set once for the whole rank group" in lines[3].cause and "--nproc" in lines[3].cause
    assert "multiple of 4" in lines[4].cause
    assert len(lines[5].id) == 12 and lines[5].id == plan_lines(jobs, base, group, tmp_path / "out")[5].id
    assert lines[5].spec.image == tmp_path / "pics" / "a b.png"  # relative to the jobs file's folder

    csv_jobs = tmp_path / "jobs.csv"
    csv_jobs.write_text("id,prompt,seed,steps\nx,hello there,3,\ny,\"a, comma\",4,5\n")
    rows = plan_lines(csv_jobs, base, group, tmp_path / "out")
    assert [(row.id, row.spec.prompt, row.spec.seed, row.spec.steps) for row in rows] == [
        ("x", "hello there", 3, 40), ("y", "a, comma", 4, 5)]


@pytest.mark.slow(seconds=30)
def test_released_encoders_over_real_ranks_equal_one_process(tiny_assets, reference_frames, other_frames, tmp_path):
    """``--release-encoders`` in a group of two Ulysses ranks running two jobs: T5 (whole, on the
    text rank) and wav2vec2 (rank 0) let go after each job's encode and built again for the next
    job's new prompt, the DiT read after the first job's encoders: both videos equal one process's."""
    jobs = tmp_path / "jobs.jsonl"
    _write_jobs(jobs, [{"id": "first", "frames_out": str(tmp_path / "first.pt")},
                       {"id": "big", "size": "128*128", "seed": 7, "prompt": "someone else", "solver": "dpm++",
                        "frames_out": str(tmp_path / "big.pt")}])
    r = run_cli(["batch", str(jobs), *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", "--mode", "ulysses",
                 "--release-encoders", "--output-dir", str(tmp_path / "out"), "--runs-root", str(tmp_path / "runs")],
                cwd=tmp_path)
    assert r.returncode == 0, r.output
    assert torch.equal(torch.load(tmp_path / "first.pt"), reference_frames)
    assert torch.equal(torch.load(tmp_path / "big.pt"), other_frames["big"])
    (run_dir,) = (tmp_path / "runs").iterdir()
    for rank in (0, 1):
        events = [json.loads(line) for line in (run_dir / "events" / f"rank{rank}.jsonl").read_text().splitlines()]
        loaded = next(e for e in events if e.get("kind") == "loaded")
        assert loaded["strategy"]["encoders"] == "let go after they encode, the DiT read after them"
        assert loaded["strategy"]["dit_load"].startswith("after the encoders were let go")
