"""The live mode (``--mode live``, docs/live.md), CPU fp32 on the tiny checkpoint:

* the cached block loop equals a full recomputation of every block from its step latents with the
  block-causal window mask, exactly, at every step of 6 blocks (the 4-block ring wraps);
* the streaming VAE decode equals one decode of the whole latent sequence, exactly;
* the step pipeline over real gloo ranks (2 and 4 ranks: steps shared, rank 0 decoding blocks in
  flight behind; 5 ranks: a decoding rank holding no DiT and one rank per step) equals one process,
  exactly, through ``wan-s2v run`` (2 ranks: a ``batch`` of two live jobs), and so does the DiT
  streamed block by block (``--dit-offload blocks``); fp16 compute stays within its bound; a served
  5-rank group stops a job mid-stream, fails a job whose middle stage overflowed, and streams the
  next one equal to one process;
* the recipe's rules (stages, the seeded reference distance, positions) and the refusals.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from conftest import asset_flags, run_cli

from wan_s2v_runner.shared import live_recipe as recipe

LIVE = ["--mode", "live", "--device", "cpu", "--size", "64*64", "--seed", "42", "--prompt", "a person talking"]


@pytest.fixture(scope="module")
def long_speech(tmp_path_factory) -> Path:
    """4.2 s of speech: 6 blocks (the ring of 4 wraps twice over)."""
    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio

    return make_speech_audio(tmp_path_factory.mktemp("live") / "long.wav", seconds=4.2, seed=3)


def _live_parts(engine_cpu):
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine_cpu
    plan = RankPlan(Layout.for_mode(Mode.LIVE, 1), 0)
    return components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                           components.LoadSettings.of(spec)), plan


@pytest.fixture(scope="module")
def live_one(engine_cpu, long_speech):
    """One process's live job (seed 42, the 6-block speech: the 4-block ring wraps), in this process
    (the loop a ``--nproc 1`` worker runs), with every sink pass and block forward it made recorded:
    the cached-blocks proof reads the forwards, and every layout's frames must equal its frames."""
    from types import SimpleNamespace

    from wan_s2v_runner.rank import live_dit
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.worker import request_for

    wan, cfg, spec = engine_cpu
    parts, plan = _live_parts(engine_cpu)
    calls, sinks, held = [], [], []
    block, sink = live_dit.LiveDiT.block, live_dit.LiveDiT.sink

    def recording_block(self, latents, t, step, g, distance, audio, cond_states, motion_frames, ctx, cond):
        out = block(self, latents, t, step, g, distance, audio, cond_states, motion_frames, ctx, cond)
        calls.append(dict(x=latents.clone(), t=t.clone(), g=g, distance=distance, audio=audio.clone(), out=out,
                          cond_states=cond_states, motion_frames=motion_frames, dit=self, ctx=ctx))
        held.append(sorted(step.held.values()))
        return out

    def recording_sink(self, ref, motion, ctx):
        sinks.append((ref, motion))
        return sink(self, ref, motion, ctx)

    live_dit.LiveDiT.block, live_dit.LiveDiT.sink = recording_block, recording_sink
    try:
        frames = JobShell(parts, plan).generate(request_for(spec.model_copy(update={"audio": long_speech,
                                                                                     "seed": 42})))
    finally:
        live_dit.LiveDiT.block, live_dit.LiveDiT.sink = block, sink
    return SimpleNamespace(frames=frames, calls=calls, sinks=sinks, held=held)


@pytest.mark.slow
def test_cached_blocks_equal_a_full_recomputation_with_the_window_mask(live_one):
    from live_reference import recompute

    frames, calls, sinks, held = live_one.frames, live_one.calls, live_one.sinks, live_one.held
    blocks = len(calls) // recipe.STEPS
    assert blocks == recipe.blocks_for(int(4.2 * 16)) > recipe.WINDOW_BLOCKS + 1
    assert frames.shape[1] == recipe.video_frames(blocks)
    # the ring holds at most the window, and block g's step sees blocks g-3..g
    assert held[-1] == list(range(blocks - 4, blocks)) and max(len(h) for h in held) == recipe.WINDOW_BLOCKS
    by_step = defaultdict(list)
    for c in calls:
        by_step[float(c["t"])].append(c)
    assert len(by_step) == recipe.STEPS
    ref, motion = sinks[0]
    with torch.no_grad():
        for t, cs in by_step.items():
            for g in range(blocks):
                got = recompute(cs[0]["dit"], cs[0]["ctx"], ref, motion, [c["x"] for c in cs[:g + 1]], cs[0]["t"],
                                [c["distance"] for c in cs[:g + 1]], [c["audio"] for c in cs[:g + 1]],
                                cs[0]["cond_states"], cs[0]["motion_frames"])
                for j in range(g + 1):  # every block recomputed equals what the loop made when it ran it
                    assert torch.equal(got[j], cs[j]["out"]), (t, g, j, (got[j] - cs[j]["out"]).abs().max())
        # the mask as a masked kernel sees: the same to rounding
        cs = by_step[max(by_step)]
        masked = recompute(cs[0]["dit"], cs[0]["ctx"], ref, motion, [c["x"] for c in cs], cs[0]["t"],
                           [c["distance"] for c in cs], [c["audio"] for c in cs], cs[0]["cond_states"],
                           cs[0]["motion_frames"], masked_kernel=True)
    assert max((a - c["out"]).abs().max().item() for a, c in zip(masked, cs)) < 1e-5
    # the reference's distance changes from block to block and step to step (drawn, not fixed)
    assert len({c["distance"] for c in calls}) > 3


@pytest.mark.slow
def test_streaming_decode_equals_one_decode(engine_cpu):
    from wan_s2v_runner.rank.live_decode import StreamDecoder

    parts, _ = _live_parts(engine_cpu)
    vae = parts.shell.vae
    z = torch.randn(1, 16, recipe.PRIME_LATENTS + 3 * recipe.BLOCK_LATENT_FRAMES, 8, 8,
                    generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = torch.stack(vae.decode(z))
        dec = StreamDecoder(vae)
        pieces = [dec.decode(z[:, :, :recipe.PRIME_LATENTS])]
        for b in range(3):
            s = recipe.PRIME_LATENTS + b * recipe.BLOCK_LATENT_FRAMES
            pieces.append(dec.decode(z[:, :, s:s + recipe.BLOCK_LATENT_FRAMES]))
    assert [p.shape[2] for p in pieces] == [1 + 4 * 6] + [recipe.BLOCK_FRAMES] * 3
    assert torch.equal(torch.cat(pieces, 2), whole)


def _run(assets, d: Path, speech: Path, *extra: str):
    d.mkdir()
    flags = asset_flags(assets)
    flags[flags.index("--audio") + 1] = str(speech)
    r = run_cli(["run", *LIVE, *flags, "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
                 "--runs-root", str(d / "runs"), *extra], cwd=d)
    assert r.returncode == 0, r.output
    run = json.loads(next((d / "runs").glob("*/run.json")).read_text())
    return torch.load(d / "f.pt"), run, next((d / "runs").glob("*"))


@pytest.mark.slow
def test_the_step_pipeline_over_real_ranks_equals_one_process(tiny_assets, long_speech, live_one, tmp_path):
    """4 and 5 real ranks equal one process (2 ranks: the batch below), exactly; so does a DiT
    streamed block by block over 2; fp16 stays within its bound; every rank reports every block."""
    one = live_one.frames
    four, _, _ = _run(tiny_assets, tmp_path / "four", long_speech, "--nproc", "4")
    # --release-encoders: the DiT ranks read theirs after the encoders let go; rank 0, holding none, meets
    # their load's barrier at the same point (the first job's join)
    five, run5, run_dir = _run(tiny_assets, tmp_path / "five", long_speech, "--nproc", "5", "--release-encoders")
    blocks = run5["live"]["blocks"]  # run.json: the live figures
    assert run5["live"]["first_frame_s"] > 0 and run5["live"]["fps"] > 0 and run5["live"]["frames_made"] == one.shape[1]
    assert one.shape[1] == recipe.video_frames(blocks) and blocks > 2
    assert torch.equal(four, one), (four - one).abs().max()
    assert torch.equal(five, one), (five - one).abs().max()
    # the DiT streamed block by block from host memory: the same frames; fp16 compute: within its bound
    streamed, _, _ = _run(tiny_assets, tmp_path / "streamed", long_speech, "--nproc", "2", "--dit-offload", "blocks")
    assert torch.equal(streamed, one), (streamed - one).abs().max()
    half, _, _ = _run(tiny_assets, tmp_path / "fp16", long_speech, "--nproc", "1", "--dtype", "fp16")
    diff = (half - one).abs()
    assert torch.isfinite(half).all() and 0 < diff.max() < 1e-2 and diff.mean() < 5e-4, (diff.max(), diff.mean())
    # rank 0 decodes and writes; the others denoise their steps: each reports every block
    events = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in (run_dir / "events").glob("*.jsonl")}
    live = [e for e in events["rank0.jsonl"] if e.get("kind") == "live"]
    assert [e["blocks"] for e in live] == list(range(1, blocks + 1)) and live[-1]["frames_made"] == one.shape[1]
    assert live[0]["first_frame_s"] > 0 and live[-1]["fps"] > 0
    for name, evs in events.items():
        assert [e["block"] for e in evs if e.get("kind") == "progress"] == list(range(1, blocks + 1)), name


@pytest.mark.slow
def test_live_jobs_in_a_batch_equal_their_one_process_runs(tiny_assets, engine_cpu, long_speech, live_one, tmp_path):
    """Two live jobs in a row over 2 ranks (rank 0 runs the first two steps and decodes the blocks in
    flight behind): the first, the 6-block speech, equals one process's (``live_one``), the second
    (another seed, prompt and speech) its own one-process run."""
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.worker import request_for

    wan, cfg, spec = engine_cpu
    parts, plan = _live_parts(engine_cpu)
    want = {"a": live_one.frames,
            "b": JobShell(parts, plan).generate(request_for(spec.model_copy(update={"seed": 9,
                                                                                    "prompt": "someone else"})))}
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "a", "audio": str(long_speech), "frames_out": str(tmp_path / "a.pt")}) + "\n"
                    + json.dumps({"id": "b", "seed": 9, "prompt": "someone else", "frames_out": str(tmp_path / "b.pt")})
                    + "\n")
    r = run_cli(["batch", str(jobs), *LIVE, *asset_flags(tiny_assets), "--nproc", "2", "--output-dir",
                 str(tmp_path / "out"), "--runs-root", str(tmp_path / "runs")], cwd=tmp_path)
    assert r.returncode == 0, r.output
    for name, frames in want.items():
        got = torch.load(tmp_path / f"{name}.pt")
        assert torch.equal(got, frames), (name, (got - frames).abs().max())
        record = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert record["live"]["first_frame_s"] > 0 and record["live"]["frames_made"] == frames.shape[1], record
    assert json.loads((tmp_path / "out" / "b.json").read_text())["live"]["blocks"] == 2


def test_the_stage_rule():
    assert recipe.supported_world_sizes() == [1, 2, 4, 5]
    five = recipe.stage_plan(5)
    assert five.rank_steps == ((), (0,), (1,), (2,), (3,)) and not five.decoder_runs_dit
    assert [five.rank_of_step(s) for s in range(4)] == [1, 2, 3, 4]
    assert recipe.stage_plan(2).rank_steps == ((0, 1), (2, 3)) and recipe.stage_plan(1).rank_steps == ((0, 1, 2, 3),)
    for n in (3, 6, 8):
        assert recipe.stage_plan(n) is None and "Fix: --nproc" in recipe.stage_problem(n)
    assert "--nproc 2" in recipe.stage_problem(3) and "--nproc 5" in recipe.stage_problem(8)


def test_the_reference_distance_is_seeded_uniform_and_placed_as_liveavatar_places_it():
    draws = [recipe.ref_distance(7, b, s) for b in range(400) for s in range(4)]
    assert draws == [recipe.ref_distance(7, b, s) for b in range(400) for s in range(4)]  # a function of the seed
    assert draws != [recipe.ref_distance(8, b, s) for b in range(400) for s in range(4)]
    assert min(draws) == 4 and max(draws) == 30 and abs(sum(draws) / len(draws) - 17) < 1.0  # uniform 4..30
    # LiveAvatar: the condition grid rolled by max(0, frame - (30 - distance)) from its position 30
    assert recipe.ref_position(0, 4) == 30 and recipe.ref_position(30, 4) == 34 and recipe.ref_position(30, 30) == 60
    assert list(recipe.window(1)) == [0, 1] and list(recipe.window(9)) == [6, 7, 8, 9]
    assert recipe.video_frames(1) == 9 and recipe.video_frames(4) == 45 and recipe.blocks_for(45) == 4


@pytest.mark.parametrize("extra, says", [
    (["--nproc", "3"], "--mode live runs its 4 steps on 1, 2, 4 or 5 ranks"),
    (["--cfg-parallel", "--nproc", "2"], "--cfg-parallel"),
    (["--cache", "auto"], "--cache"),
    (["--compile"], "--compile"),
])
def test_what_the_live_mode_cannot_do_is_refused_before_a_rank_starts(tiny_assets, tmp_path, extra, says):
    r = run_cli(["run", *LIVE, *asset_flags(tiny_assets), "--output", str(tmp_path / "o.mp4"), "--runs-root",
                 str(tmp_path / "runs"), *extra], cwd=tmp_path)
    assert r.returncode != 0 and says in r.output, r.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*/events"))


@pytest.mark.slow(seconds=60)
def test_a_served_live_group_stops_fails_and_streams_its_jobs(tiny_assets, inputs, engine_cpu, tmp_path):
    """``wan-s2v serve --mode live`` over 5 real ranks (rank 0 decodes and holds no DiT, ranks 1-4 one
    step each), three jobs in a row, the blocks in flight while rank 0 decodes (no collective a block):

    1. cancelled while it streams (rank 0 held at its first decode until the cancel arrives): every
       rank ends it at its stream's end, nothing left in flight for the next job;
    2. a non-finite activation on rank 2 (a middle stage: step 2) at the first block: the fault
       travels with the block to rank 0, the job fails with its cause, and the group stays up;
    3. its progress streams block by block (server-sent events) and its finished mp4 is byte for
       byte the one process's frames written 12 frames at a time."""
    from fault_worker import fault_env
    from serving import TINY_DEFAULTS, TOKEN, ServerProcess

    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared import media

    wan, cfg, spec = engine_cpu
    parts, plan = _live_parts(engine_cpu)
    frames = JobShell(parts, plan).generate(request_for(spec.model_copy(update={"audio": inputs["audio"]})))
    want = media.save_video_with_audio(frames, cfg.sample_fps, inputs["audio"], tmp_path / "want.mp4",
                                       media.clip_lengths(frames.shape[1], recipe.BLOCK_FRAMES))
    release = tmp_path / "release"  # the third job waits at its second block's decode until it exists
    s = ServerProcess(tmp_path / "server", [*TINY_DEFAULTS, "--mode", "live", "--nproc", "5", "--ckpt-dir",
                                            str(tiny_assets.ckpt_dir), "--token", TOKEN, "--allow-dir",
                                            str(inputs["root"])],
                      env=fault_env("0:decode#1:wait,2:denoise#2:nonfinite,0:decode@2#3:wait",
                                    WAN_S2V_TEST_RELEASE=str(release)))
    try:
        held = s.submit(image=inputs["image"], audio=inputs["audio"], seed=42).json()["id"]
        s.wait(held, "in_progress")
        assert s.http.post(f"/v1/videos/{held}/cancel").status_code == 200
        assert s.wait(held, "cancelled")["status"] == "cancelled"
        faulty = s.submit(image=inputs["image"], audio=inputs["audio"], seed=42).json()["id"]
        failed = s.wait(faulty, "failed")
        assert "non-finite activation (inf or NaN) in DiT block 1 at step 2/4 of block 1" in failed["error"]["message"]
        vid = s.submit(image=inputs["image"], audio=inputs["audio"], seed=42).json()["id"]
        seen = []
        with s.http.stream("GET", f"/v1/videos/{vid}/events", timeout=180) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    seen.append(json.loads(line[5:]))
                    if seen[-1].get("block") == 2:  # held there: the stream has shown it, let it go on
                        release.touch()
        assert seen[-1]["status"] == "completed", seen[-1]
        blocks = [(v["block"], v["blocks"]) for v in seen if v["status"] == "in_progress" and v.get("blocks")]
        assert (2, 2) in blocks and blocks == sorted(blocks), seen  # block by block, in order
        held_at = next(v for v in seen if v.get("block") == 2)
        assert held_at["unit"] == "block" and held_at["blocks_done"] == 1 and held_at["clip"] is None, held_at
        done = s.video(vid)
        assert done["frames"] == list(frames.shape), done
        stages = set(done["stage_seconds"])
        assert {"decode", "save"} <= stages and "denoise" not in stages, done  # rank 0 runs no step
        got = s.http.get(f"/v1/videos/{vid}/content")
        assert got.status_code == 200
        (tmp_path / "got.mp4").write_bytes(got.content)
        assert media.sha256_file(tmp_path / "got.mp4") == media.sha256_file(want)
        group = Path(s.group_dir())
        assert len(list((group / "events").glob("rank*.jsonl"))) == 5  # the same group took the three jobs
        loaded = [json.loads(x) for x in (group / "events" / "rank0.jsonl").read_text().splitlines()
                  if '"loaded"' in x]
        assert loaded and loaded[0]["strategy"]["dit"].startswith("none"), loaded  # rank 0 holds no DiT
    finally:
        assert s.stop() == []


def _live_ctx(machine: str, **values):
    import os
    from dataclasses import replace

    from wan_s2v_runner.preflight.context import CheckContext
    from wan_s2v_runner.preflight.facts import MachineFacts
    from wan_s2v_runner.preflight.memory import REFERENCE

    path = os.path.join(os.path.dirname(__file__), "data", "machines", f"{machine}.json")
    ctx = CheckContext.for_values({"mode": "live", "max_area": "704*384", **values}, MachineFacts.load(path))
    ctx.cache["sizes"] = replace(REFERENCE, source="checkpoint (test: Wan2.2-S2V-14B sizes)")
    return ctx


def test_the_doctor_plans_the_live_pipeline(tmp_path):
    """On recorded machines: the stages, each DiT rank's caches against its GPU (one H100 holds the
    4 step caches beside an fp8 DiT, not beside a bf16 one; 5 ranks hold one each), the frames per
    second from a block's operations, and the LiveAvatar LoRA's strength."""
    from safetensors.torch import save_file

    from wan_s2v_runner.preflight.core import Status, find
    from wan_s2v_runner.preflight.registry import groups_for, run_checks
    from wan_s2v_runner.shared.layout import Mode

    assert "live" in [g.value for g in groups_for(Mode.LIVE)]
    assert "live" not in [g.value for g in groups_for(Mode.ULYSSES)]
    # another recipe, never offered as the fix for a clip run's layout (a SIGKILL's hint, say)
    import signal

    from wan_s2v_runner.launcher.diagnose import death_hint
    hint = death_hint(-signal.SIGKILL, None)
    assert "--mode ulysses" in hint and "--mode live" not in hint, hint
    one = run_checks(_live_ctx("h100_1x"), ["live"])
    assert find(one, "live.stages").finding == "rank 0: steps 1,2,3,4 + decode"
    bf16 = find(one, "live.memory")
    assert bf16.status is Status.FAIL and "--dit-quant fp8" in bf16.fix
    # 2 x 4 blocks x 3024 tokens x 5120 x 40 layers x 2 bytes a step, 4 steps on the one rank
    assert bf16.data["kv_bytes"] > 4 * 2 * 4 * 3024 * 5120 * 40 * 2
    fp8 = find(run_checks(_live_ctx("h100_1x", dit_quant="fp8"), ["live"]), "live.memory")
    assert fp8.status is Status.OK, fp8.finding
    five = run_checks(_live_ctx("a100_8x_nvlink", nproc=5), ["live"])
    assert find(five, "live.stages").finding.startswith("rank 0: decode; rank 1: steps 1;")
    assert find(five, "live.memory").data["kv_bytes"] < bf16.data["kv_bytes"] / 3  # one step's caches a rank
    # the 5-rank pipeline's decoding rank holds no DiT: its plan counts the VAE and the decode alone
    from wan_s2v_runner.preflight.checks_memory import current_plan
    plan5 = current_plan(_live_ctx("a100_8x_nvlink", nproc=5))
    plan1 = current_plan(_live_ctx("h100_1x"))
    assert plan5.parts["dit_weights_rank0"] == 0 and "dit_weights_rank0" not in plan1.parts
    assert plan5.gpu_phases["decode"] < plan5.parts["dit_weights"] < plan5.gpu_phases["denoise"]
    gpu5 = find(run_checks(_live_ctx("a100_8x_nvlink", nproc=5), ["memory"]), "memory.gpu")
    assert "rank 0 decodes and holds no DiT" in gpu5.finding, gpu5.finding
    fps1, fps5 = find(one, "live.fps").data["fps"], find(five, "live.fps").data["fps"]
    assert 1 < fps1 < fps5  # one step a rank: the pipeline's pace; an A100 is slower than an H100, not 4x
    assert find(run_checks(_live_ctx("h100_1x", nproc=3), ["live"]), "live.stages").status is Status.FAIL
    # the LoRA: none (the base model is not distilled), LiveAvatar's rank 128 at strength 1 (its alpha is 64)
    assert "no --lora" in find(one, "live.recipe").finding
    lora = tmp_path / "liveavatar.safetensors"
    import torch
    save_file({"blocks.0.self_attn.q.lora_A.weight": torch.zeros(128, 8),
               "blocks.0.self_attn.q.lora_B.weight": torch.zeros(8, 128)}, str(lora))
    r = find(run_checks(_live_ctx("h100_1x", lora=[str(lora)]), ["live"]), "live.recipe")
    assert r.status is Status.WARN and r.fix == f"give it as --lora {lora}:0.5", r.fix
    r = find(run_checks(_live_ctx("h100_1x", lora=[f"{lora}:0.5"], steps=40), ["live"]), "live.recipe")
    assert r.status is Status.OK, r.finding
