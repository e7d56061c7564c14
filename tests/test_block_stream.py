"""``--dit-offload blocks`` (issue #57): the DiT's blocks in host memory, each copied into one of
two device slots just before it runs (``wan_s2v_runner.loading.block_stream``).

What is proven here, on the CPU, where the slots are CPU tensors and every copy is a real copy:
streamed frames equal resident frames exactly (fp32) with every block streamed, some resident,
and one streamed unit; the slots rotate (a pass copies each streamed unit once when more than two
stream, none again when two or fewer do); with fp8 and a LoRA (merged before streaming); compiled
(streamed weights neither recompile nor break the graph); over real ranks, Ulysses x CFG-parallel
at 4 ranks streaming from the node's one shared copy equals one process; and the setting's
refusals; resume (a failed resident run resumed streamed) and a pose video. A 5-block tiny DiT, so that
more units stream than there are slots.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import TINY_FLAGS, cpu_engine, run_cli
from wan_s2v_runner.shared.layout import DitOffload, DitQuant

BLOCKS = 5


@pytest.fixture(scope="module")
def five(tiny_assets, tmp_path_factory):
    """The demo's inputs with a 5-block tiny DiT (blocks 0, 2, 4 inject audio)."""
    from wan_s2v_runner.demo.tiny_checkpoint import build_tiny_checkpoint
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("five") / "ckpt", dit_layers=BLOCKS)
    return SimpleNamespace(ckpt_dir=ckpt, image=tiny_assets.image, audio=tiny_assets.audio)


def generate(engine, **updates):
    """(frames, parts) of our loop at one process for the tiny spec with ``updates``, loaded as a
    ``--nproc 1`` rank loads it (``LoadSettings.of``: the resident count from the spec)."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine
    spec = spec.model_copy(update=updates)
    cpu = torch.device("cpu")
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, cpu, 0, components.LoadSettings.of(spec))
    return JobShell(parts, plan).generate(request_for(spec)), parts


def streamed(resident: int) -> dict:
    return {"dit_offload": DitOffload.BLOCKS, "resident_blocks": resident}


@pytest.fixture(scope="module")
def resident_frames(five):
    with cpu_engine(five) as engine:
        return generate(engine)[0]


def passes(frames_clips: int = 2, steps: int = 2) -> int:
    return frames_clips * steps * 2  # CFG: two DiT passes a step


def test_streamed_frames_equal_resident_frames(five, resident_frames):
    """Every block streamed (5 units through 2 slots: each pass copies all 5, and the last
    block's turn prefetches the next pass's first: once more at the end), 2 resident (3
    stream), 3 resident (2 stream: copied once, then the slots hold them), 4 resident (1 streams,
    one slot): the same frames, bit for bit. Between passes an evicted parameter is its host
    tensor again, and the resident parts are where the device is."""
    with cpu_engine(five) as engine:
        for resident, copies in ((0, 5 * passes() + 1), (2, 3 * passes() + 1), (3, 2), (4, 1)):
            frames, parts = generate(engine, **streamed(resident))
            assert torch.equal(frames, resident_frames), resident
            s = parts.streamer
            assert (s.resident, len(s.units), s.copies) == (resident, BLOCKS - resident, copies), resident
            assert len(s.slots) == min(2, BLOCKS - resident)
            report = parts.load_report.strategy
            assert report["dit"] == "private (one buffer)"
            assert report["dit_stream"]["streamed_blocks"] == BLOCKS - resident
            held = {k for k in s.slot_unit if k is not None}
            for k, u in enumerate(s.units):
                slot_ptrs = {t.untyped_storage().data_ptr() for t in s.slots}
                on_slot = [p.untyped_storage().data_ptr() in slot_ptrs for p in u.params]
                assert all(on_slot) if k in held else not any(on_slot), (resident, k)
                if k not in held:
                    assert all(p.data_ptr() == h.data_ptr() for p, h in zip(u.params, u.host))
            # the injection layers of a streamed block travel with it (block 4 injects)
            assert any(p is next(iter(parts.noise_model.audio_injector.injector[2].parameters()))
                       for p in s.units[-1].params) == (resident <= 4)


def test_fp8_and_a_lora_stream_as_they_are_held(five, tmp_path):
    """fp8 with a LoRA (merged into the weights as they are read and quantized): the streamed
    units carry the fp8 bytes (half the traffic of bf16, a quarter of fp32 here), the scales stay
    on the device, and the frames equal the resident fp8 + LoRA run's. Full precision with the
    LoRA (merged by ``patches.lora_merge`` into the host copy before anything streams), and fp8
    multiplied with ``--fp8-matmul scaled-mm``: equal too."""
    from tests.test_fp8 import comfy_lora
    from wan_s2v_runner.shared.spec import LoraRef
    lora = [LoraRef.model_validate(str(comfy_lora(five.ckpt_dir, tmp_path / "lora.safetensors")))]
    with cpu_engine(five) as engine:
        want, _ = generate(engine, dit_quant=DitQuant.FP8, lora=lora, num_clips=1)
        got, parts = generate(engine, dit_quant=DitQuant.FP8, lora=lora, num_clips=1, **streamed(1))
        assert torch.equal(got, want)
        s = parts.streamer
        dtypes = {p.dtype for u in s.units for p in u.params}
        assert torch.float8_e4m3fn in dtypes
        assert s.copies == (BLOCKS - 1) * passes(1) + 1
        # --fp8-matmul scaled-mm (fp8 x fp8, torch's CPU kernel here) reads the same streamed weights
        want, _ = generate(engine, dit_quant=DitQuant.FP8, fp8_matmul="scaled-mm", num_clips=1)
        got, _ = generate(engine, dit_quant=DitQuant.FP8, fp8_matmul="scaled-mm", num_clips=1, **streamed(2))
        assert torch.equal(got, want)
        from patches import lora_merge
        from wan_s2v_runner.loading.lora import merger
        plain, _ = generate(engine, num_clips=1)
        lora_merge.apply(engine[0], merger(lora))  # what apply_for_run does for a full-precision run with a LoRA
        try:
            want, _ = generate(engine, lora=lora, num_clips=1)
            got, _ = generate(engine, lora=lora, num_clips=1, **streamed(0))
        finally:
            lora_merge.restore(engine[0])
        assert torch.equal(got, want) and not torch.equal(want, plain)  # merged, and streamed as merged


@pytest.mark.slow(seconds=60)
def test_compiled_blocks_stream_without_recompiling(five, inductor_cache, monkeypatch):
    """``--compile`` with 4 of 5 blocks streamed: the compiled block reads whatever slot its
    parameters are bound to (no recompile: one graph for the blocks as resident, none added by
    streaming), and the frames equal the compiled resident run's exactly."""
    import torch._dynamo

    from patches import compile_blocks
    for k, v in inductor_cache.items():
        monkeypatch.setenv(k, v)
    with cpu_engine(five) as engine:
        wan, cfg, _ = engine
        compiled = compile_blocks.apply(wan, cfg.param_dtype)
        try:
            want, _ = generate(engine, num_clips=1)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            seen = set(compiled.seen)
            assert seen and graphs > 0  # the resident run compiled the block
            got, parts = generate(engine, num_clips=1, **streamed(1))
            assert torch.equal(got, want)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
            assert compiled.seen == seen
        finally:
            compile_blocks.restore(wan)


def _run(five, d, *flags, env=None):
    d.mkdir()
    return run_cli(["run", *TINY_FLAGS, "--ckpt-dir", str(five.ckpt_dir), "--image", str(five.image), "--audio",
                    str(five.audio), *flags, "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
                    "--runs-root", str(d / "runs")], cwd=d, env=env)


@pytest.mark.slow(seconds=60)
def test_ulysses_and_cfg_parallel_ranks_stream_from_the_nodes_copy(five, resident_frames, tmp_path):
    """Real ranks over gloo: ulysses at 4 ranks with CFG-parallel (SP degree 2 per branch), every
    block streamed from the node's one shared host copy (local rank 0 reads it, the others map
    it), equals one resident process. And a resident 2-rank run that failed in clip 2, resumed at
    one rank streamed, equals it too (streaming is a group setting: a resume may change it)."""
    from fault_worker import fault_env

    from wan_s2v_runner.shared import exit_codes
    with ThreadPoolExecutor(2) as pool:  # the two groups at once: one's start-up overlaps the other's compute
        sp_cfg = pool.submit(_run, five, tmp_path / "sp_cfg", "--nproc", "4", "--cfg-parallel", "--dit-offload",
                             "blocks")
        failed = pool.submit(_run, five, tmp_path / "failed", "--nproc", "2", env=fault_env("1:denoise@2:raise"))
        sp_cfg, failed = sp_cfg.result(), failed.result()
    assert sp_cfg.returncode == 0, sp_cfg.output
    assert torch.equal(torch.load(tmp_path / "sp_cfg" / "f.pt"), resident_frames)
    for rank in range(4):
        events = (next((tmp_path / "sp_cfg" / "runs").glob("*")) / "events" / f"rank{rank}.jsonl").read_text()
        loaded = next(json.loads(e) for e in events.splitlines() if '"loaded"' in e)
        assert loaded["strategy"]["dit"] == "node-shared", rank
        assert loaded["strategy"]["dit_stream"]["streamed_blocks"] == BLOCKS, rank

    assert failed.returncode == exit_codes.RANK_FAILED, failed.output
    run_dir = next((tmp_path / "failed" / "runs").iterdir())
    r = run_cli(["resume", str(run_dir), "--nproc", "1", "--dit-offload", "blocks", "--json"], cwd=tmp_path / "failed")
    assert r.returncode == 0, r.output
    assert json.loads(r.stdout)["resume"]["at_clip"] == 2
    from wan_s2v_runner.shared import media

    n = resident_frames.shape[1]  # a resumed run's raw frames are the clips it made: clip 2 (clip 1 has 8 - 3)
    assert torch.equal(torch.load(tmp_path / "failed" / "f.pt"), resident_frames[:, 5:])
    whole = tmp_path / "whole.mp4"  # and its video is the resident frames' video, byte for byte
    media.save_video_with_audio(resident_frames, 16, five.audio, whole, media.clip_lengths(n, 8))
    assert (tmp_path / "failed" / "o.mp4").read_bytes() == whole.read_bytes()


def test_a_pose_video_streams_the_same(tiny_assets, pose_reference_frames):
    """--pose-video with every block streamed equals the resident one-process frames."""
    with cpu_engine(tiny_assets) as engine:
        frames, _ = generate(engine, pose_video=tiny_assets.pose_video, **streamed(0))
    assert torch.equal(frames, pose_reference_frames)


def test_the_setting_refuses_what_it_cannot_stream(five, monkeypatch):
    """FSDP modes (each rank holds 1/N of the DiT already), --load full, and --resident-blocks
    without streaming: refused with the cause and the fix; the environment sets it."""
    from pydantic import ValidationError

    from wan_s2v_runner.shared.spec import RunSpec
    base = dict(ckpt_dir=five.ckpt_dir, image=five.image, audio=five.audio, prompt="p", device="cpu")
    for extra, words in (({"mode": "fsdp-fixed", "nproc": 2}, "FSDP's own streaming"),
                         ({"mode": "hybrid", "nproc": 2}, "--mode ulysses (any degree)"),
                         ({"load": "full"}, "--load full"),):
        with pytest.raises(ValidationError, match="--dit-offload blocks cannot be combined") as e:
            RunSpec(**base, dit_offload="blocks", **extra)
        assert words in str(e.value)
    with pytest.raises(ValidationError, match="add --dit-offload blocks or drop it"):
        RunSpec(**base, resident_blocks=3)
    assert RunSpec(**base, dit_offload="blocks", nproc=4, cfg_parallel=True).dit_offload is DitOffload.BLOCKS
