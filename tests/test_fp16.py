"""``--dtype`` (issue #73, part 2): the DiT and T5 computed in fp16 on GPUs without bf16 units, a
few layers kept in fp32, and a guard that stops the job at the first non-finite activation
(``wan_s2v_runner.shared.precision``, ``patches.fp16_compute``); and ``--release-encoders``: T5 and
wav2vec2 let go once they have encoded, the DiT read after them (``loading.components``).

What is proven here, on the CPU (fp16 under the CPU's autocast computes what a GPU's autocast
does): the rule that picks the dtype; fp16 frames within a stated bound of fp32 (and nearer than
bf16's); the fp32 layers compute in fp32; every layout in fp16 equals one rank in fp16 exactly
(real ranks); the guard names the block, the step and the clip, every rank stops at the same
point (a flag on one rank alone stops them all), and its fix (``--fp32-blocks``) runs; bf16 on a
GPU and fp32 never take the patch; releasing the encoders changes no frame.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import TINY_FLAGS, asset_flags, cpu_engine, once_per_run, one_process_frames, run_cli, run_frames

from patches import fp16_compute
from patches.fp16_compute import NonFiniteActivation
from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.precision import ComputeDtype, element_bytes, resolve

#: the tiny checkpoint's first clip in fp16 against fp32 (frames in [-1, 1]): measured 6.0e-4 max
#: and 2.9e-5 mean absolute (bf16: 1.05e-2 and 2.8e-4): the bound asserted
FP16_FRAMES_BOUND = (2e-3, 2e-4)


def test_the_dtype_rule():
    """auto: bf16 where the GPU has bf16 units (cc >= 8.0; the oldest GPU decides), fp16 below,
    fp32 on the CPU, bf16 when the capability is unknown; an explicit choice is kept."""
    assert resolve(ComputeDtype.AUTO, "cpu")[0] is ComputeDtype.FP32
    assert resolve("auto", "cuda", [(7, 0), (7, 0)])[0] is ComputeDtype.FP16
    assert resolve("auto", "cuda", [(7, 5)])[0] is ComputeDtype.FP16
    assert resolve("auto", "cuda", [(8, 0)])[0] is ComputeDtype.BF16
    assert resolve("auto", "cuda", [(9, 0), (7, 5)])[0] is ComputeDtype.FP16
    assert resolve("auto", "cuda", [None])[0] is ComputeDtype.BF16
    assert resolve("fp16", "cpu")[0] is ComputeDtype.FP16 and resolve("bf16", "cuda", [(7, 0)])[0] is ComputeDtype.BF16
    assert "no bf16 units" in resolve("auto", "cuda", [(7, 0)])[1]
    assert [element_bytes(d) for d in (ComputeDtype.FP16, ComputeDtype.BF16, ComputeDtype.FP32)] == [2, 2, 4]


@pytest.fixture(scope="module")
def fp16_one_clip(tiny_assets, tmp_path_factory):
    """One process's frames for the tiny spec's first clip in fp16 (what every fp16 layout is held to)."""
    def make():
        with cpu_engine(tiny_assets) as engine:
            return one_process_frames(engine, dtype=ComputeDtype.FP16, num_clips=1)
    return once_per_run(tmp_path_factory, "fp16_one_clip", make)


def _load(engine, **updates):
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import engine_config
    from wan_s2v_runner.shared.layout import Layout, Mode
    wan, _, spec = engine
    spec = spec.model_copy(update=updates)
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    return components.load(wan, engine_config(wan, spec), str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                           components.LoadSettings.of(spec)), spec


@pytest.mark.slow(seconds=15)
def test_fp16_frames_are_near_fp32_and_the_fp32_layers_compute_in_fp32(tiny_assets, fp16_one_clip):
    """fp16 frames within the bound of fp32, not equal (fp16 is used), nearer than bf16's; in a
    forward the patch embedding, time embedding and head compute in fp32 and a block's Linears in
    fp16; the guard and the fp32 layers are in the load report."""
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared.layout import Layout, Mode
    with cpu_engine(tiny_assets) as engine:
        full = one_process_frames(engine, num_clips=1)
        bf16 = one_process_frames(engine, dtype=ComputeDtype.BF16, num_clips=1)
        parts, spec = _load(engine, dtype=ComputeDtype.FP16, num_clips=1)
        seen = {}
        model = parts.noise_model
        for name in ("patch_embedding", "time_embedding.0", "time_projection.1", "head.head", "blocks.0.ffn.0",
                     "blocks.0.self_attn.q", "blocks.0.norm3"):
            def note(m, a, out, name=name):
                seen.setdefault(name, (a[0].dtype, out.dtype))
            model.get_submodule(name).register_forward_hook(note)
        again = JobShell(parts, RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)).generate(request_for(spec))
    assert torch.equal(again, fp16_one_clip)
    d, db = (fp16_one_clip - full).abs(), (bf16 - full).abs()
    assert torch.isfinite(fp16_one_clip).all()
    assert 0 < d.max() <= FP16_FRAMES_BOUND[0] and d.mean() <= FP16_FRAMES_BOUND[1], (d.max(), d.mean())
    assert d.mean() < db.mean() / 3, (d.mean(), db.mean())
    for name in ("patch_embedding", "time_embedding.0", "time_projection.1", "head.head", "blocks.0.norm3"):
        assert seen[name][1] == torch.float32, (name, seen[name])
    assert seen["blocks.0.ffn.0"][1] == seen["blocks.0.self_attn.q"][1] == torch.float16, seen
    assert model.blocks[0].ffn[0].weight.dtype == model.patch_embedding.weight.dtype == torch.float16
    compute = parts.load_report.strategy["compute"]
    assert "fp32_layers 11" in compute and "guard" in compute and "cpu_autocast torch.float16" in compute


def test_bf16_on_a_gpu_and_fp32_do_not_take_the_patch():
    """A lever leaves the path without it unchanged: bf16 on CUDA and fp32 anywhere get no fp32
    layers, no guard, no autocast wrapper (the model's forward is its class's)."""
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch_embedding = torch.nn.Conv3d(2, 2, 1)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    for dtype, device in ((torch.bfloat16, "cuda"), (torch.float32, "cpu"), (torch.float32, "cuda")):
        m = Tiny()
        assert fp16_compute.apply(m, dtype, (), device) == {}
        assert "forward" not in vars(m) and "forward" not in vars(m.patch_embedding)
        assert fp16_compute.guard_of(m) is None
    m = Tiny()
    done = fp16_compute.apply(m, torch.float16, (), "cuda")
    assert done["fp32_layers"] == 1 and "forward" in vars(m.patch_embedding) and "forward" not in vars(m)
    assert fp16_compute.apply(m, torch.float16, (), "cuda") is done  # once per loaded model


@pytest.mark.slow(seconds=200)
def test_every_layout_in_fp16_equals_one_rank(tiny_assets, fp16_one_clip, tmp_path):
    """Real ranks in fp16: every mode, with and without CFG-parallel (fsdp-fixed: FSDP's mixed
    precision in fp16, the fp32 layers inside its units; ulysses and hybrid: sequence parallel,
    Ulysses' attention in fp16), each at 2 ranks, equal one process in fp16 exactly; each rank's
    load report says fp16."""
    for name, flags in (("fsdp", ["--mode", "fsdp-fixed"]), ("fsdp_cfg", ["--mode", "fsdp-fixed", "--cfg-parallel"]),
                        ("ulysses", ["--mode", "ulysses"]), ("ulysses_cfg", ["--mode", "ulysses", "--cfg-parallel"]),
                        ("hybrid", ["--mode", "hybrid"]), ("hybrid_cfg", ["--mode", "hybrid", "--cfg-parallel"])):
        got, run_dir = run_frames(tiny_assets, tmp_path / name, TINY_FLAGS, "--num-clips", "1", "--nproc", "2",
                                  "--dtype", "fp16", *flags)
        assert torch.equal(got, fp16_one_clip), (name, (got - fp16_one_clip).abs().max())
        for rank in (0, 1):
            events = (run_dir / "events" / f"rank{rank}.jsonl").read_text()
            assert "torch.float16: fp32_layers 11" in events and '"compute_dtype": "fp16"' in events, name


def overflowing_checkpoint(src, dst):
    """The tiny checkpoint with block 1's FFN scaled so its output reaches ~1e6: finite in fp32,
    beyond fp16's 65504 (the weights themselves stay within fp16's range)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, symlinks=True)
    path = dst / "diffusion_pytorch_model.safetensors"
    t = load_file(str(path))
    for key, to in (("blocks.1.ffn.0.weight", 40.0), ("blocks.1.ffn.2.weight", 3e4)):
        w = t[key].float()
        t[key] = (w * (to / w.abs().max())).to(t[key].dtype)
    os.remove(path)
    save_file(t, str(path))
    return dst


@pytest.fixture(scope="module")
def hot_ckpt(tiny_assets, tmp_path_factory):
    return overflowing_checkpoint(tiny_assets.ckpt_dir, tmp_path_factory.mktemp("hot") / "ckpt")


@pytest.mark.slow(seconds=20)
def test_the_guard_names_the_block_and_its_fix_runs(tiny_assets, hot_ckpt):
    """On a checkpoint whose block 1 overflows fp16: fp32 frames are finite; fp16 stops at block 1,
    step 1 of clip 1, naming the fixes; with ``--fp32-blocks 1`` (that block's Linears in fp32)
    the run ends with finite frames."""
    with cpu_engine(tiny_assets) as engine:
        wan, cfg, spec = engine
        engine = (wan, cfg, spec.model_copy(update={"ckpt_dir": hot_ckpt}))
        assert torch.isfinite(one_process_frames(engine, num_clips=1)).all()
        with pytest.raises(NonFiniteActivation) as e:
            one_process_frames(engine, dtype=ComputeDtype.FP16, num_clips=1)
        fixed = one_process_frames(engine, dtype=ComputeDtype.FP16, num_clips=1, fp32_blocks=[1])
    assert (e.value.block, e.value.step, e.value.clip) == (1, 1, 1)
    msg = str(e.value)
    assert "DiT block 1 at step 1/2 of clip 1" in msg and "--dtype bf16" in msg and "--fp32-blocks 1" in msg
    assert torch.isfinite(fixed).all()


@pytest.mark.slow(seconds=40)
def test_a_non_finite_block_fails_every_rank_at_the_same_point(tiny_assets, hot_ckpt, tmp_path):
    """Real ranks, CFG-parallel (each half runs its own pass): the run fails with the guard's
    cause, the rank-failed exit code, and no output video."""
    flags = list(asset_flags(tiny_assets))
    flags[flags.index("--ckpt-dir") + 1] = str(hot_ckpt)
    r = run_cli(["run", *TINY_FLAGS, *flags, "--num-clips", "1", "--nproc", "2", "--cfg-parallel", "--dtype", "fp16",
                 "--output", str(tmp_path / "o.mp4"), "--runs-root", str(tmp_path / "runs")], cwd=tmp_path)
    assert r.returncode == exit_codes.RANK_FAILED, r.output
    assert "non-finite activation (inf or NaN) in DiT block 1 at step 1/2 of clip 1" in r.output
    assert not (tmp_path / "o.mp4").exists()


def _flagging_rank(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from wan_s2v_runner.rank.step_control import Lockstep, Signal
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    except Exception as e:  # noqa: BLE001 - said to the test, not lost in the child
        q.put((rank, f"{type(e).__name__}: {e}"))
        return
    try:
        model = torch.nn.Module()
        model.blocks = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
        model.forward = lambda x: model.blocks[2](model.blocks[1](model.blocks[0](x)))
        guard = fp16_compute.Guard(model)
        x = torch.ones(4)
        torch.nn.Module.__call__(model, x)  # a clean step: nothing to say
        clean = Lockstep(torch.device("cpu"), lambda: None, guard, reuses=False).after_step(0, 0, -1.0)
        if rank == 0:  # only rank 0's tokens overflow, and only rank 0 hears its server cancel
            x[1] = float("inf")
        torch.nn.Module.__call__(model, x)
        stop = (lambda: Signal.CANCELLED) if rank == 0 else (lambda: None)
        message = Lockstep(torch.device("cpu"), stop, guard, reuses=False).after_step(1, 0, 0.25 if rank == 0 else -1)
        error = message.error(2, "clip")
        q.put((rank, (clean.stops, message.fault, message.signal, message.measure, type(error).__name__,
                      getattr(error, "block", None), getattr(error, "step", None))))
    except Exception as e:  # noqa: BLE001 - said to the test, not lost in the child
        q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_a_flag_on_one_rank_stops_every_rank():
    """Two gloo ranks, a non-finite value on rank 0's tokens only: the guard calls no collective,
    the loop's step message carries the flag, and both ranks fail at the same step for the same
    block (the fault before the server's cancel, which the message carries too, with rank 0's
    cache measure)."""
    import multiprocessing as mp

    from ports import named_port

    from wan_s2v_runner.rank.step_control import Signal
    ctx = mp.get_context("spawn")  # not a fork of this worker: its threads (torch's pools) stay behind
    q = ctx.Queue()
    port = named_port()
    procs = [ctx.Process(target=_flagging_rank, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    want = (False, 0, Signal.CANCELLED, 0.25, "NonFiniteActivation", 0, 2)
    assert got == {0: want, 1: want}, got


@pytest.mark.slow(seconds=15)
def test_released_encoders_change_no_frame(tiny_assets):
    """``--release-encoders``: the DiT read after the encoders (deferred), T5 and wav2vec2 let go
    after they encode, T5 built again for a later job's new prompt: the frames of both jobs equal
    those of a group that keeps them."""
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared.layout import Layout, Mode
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    out = {}
    with cpu_engine(tiny_assets) as engine:
        for release in (False, True):
            parts, spec = _load(engine, num_clips=1, release_encoders=release)
            assert parts.dit_loading is release  # deferred: read when the first step needs it
            g = JobShell(parts, plan)
            first = g.generate(request_for(spec))
            held = (parts.shell.text_encoder is not None, parts.shell.audio_encoder is not None)
            second = g.generate(request_for(spec.model_copy(update={"prompt": "another prompt"})))
            out[release] = (first, second, held, dict(parts.load_report.strategy))
    assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])
    assert out[False][2] == (True, True) and out[True][2] == (False, False)
    assert out[True][3]["encoders"] == "let go after they encode, the DiT read after them"
    assert out[True][3]["dit_load"].startswith("after the encoders were let go")


@pytest.mark.slow(seconds=15)
def test_fp16_with_a_streamed_dit_and_fp8_storage(tiny_assets, fp16_one_clip):
    """fp16 with the DiT streamed block by block equals it resident exactly; with fp8 storage (the
    weights dequantized into fp16 per call, as on cards without fp8 units) the frames are finite
    and near fp16's (measured 1.7e-3 max), and ``--fp32-blocks`` takes fp8 Linears too."""
    with cpu_engine(tiny_assets) as engine:
        streamed = one_process_frames(engine, num_clips=1, dtype=ComputeDtype.FP16, dit_offload="blocks")
        fp8 = one_process_frames(engine, num_clips=1, dtype=ComputeDtype.FP16, dit_quant="fp8")
        fp8_fp32_blocks = one_process_frames(engine, num_clips=1, dtype=ComputeDtype.FP16, dit_quant="fp8",
                                             fp32_blocks=[0, 1])
    assert torch.equal(streamed, fp16_one_clip)
    assert torch.isfinite(fp8).all() and 0 < (fp8 - fp16_one_clip).abs().max() <= 5e-3
    assert not torch.equal(fp8, fp8_fp32_blocks) and (fp8 - fp8_fp32_blocks).abs().max() <= 2e-3


def test_the_guard_checks_the_output_after_the_last_block():
    """An overflow after the last block (its audio injection, the head) is caught at the output:
    the job fails naming the DiT's output and the dtype fixes (no block to keep in fp32)."""
    from wan_s2v_runner.rank.step_control import StepMessage, guard_fault

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])
    model.forward = lambda x: [model.blocks[1](model.blocks[0](x)) * torch.tensor([1.0, float("inf")])]
    guard = fp16_compute.Guard(model)
    torch.nn.Module.__call__(model, torch.ones(2))  # no raise inside the forward: the loop asks
    error = StepMessage().with_fault(guard_fault(guard), 0, 0).error(2, "clip")
    assert isinstance(error, NonFiniteActivation)
    assert error.block is None and "the DiT's output" in str(error) and "--fp32-blocks" not in str(error)
    assert guard.take() is None  # taken: the flags start again
    model.forward = lambda x: [model.blocks[1](model.blocks[0](x))]
    torch.nn.Module.__call__(model, torch.ones(2))
    assert guard.take() is None  # nothing non-finite


def test_a_runs_digest_records_the_dtype_only_where_it_is_not_the_devices_old_one(tiny_assets):
    """Runs and pools made before ``--dtype`` keep their digest (auto, and the device's old dtype:
    bf16 on CUDA, fp32 on the CPU, record nothing); a V100's settled fp16 does not match them."""
    from wan_s2v_runner.serve.fleet import frame_settings
    from wan_s2v_runner.shared.resume import spec_digest
    from wan_s2v_runner.shared.spec import RunSpec
    base = dict(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, audio=tiny_assets.audio, prompt="p")
    cuda = {d: spec_digest(RunSpec(**base, device="cuda", dtype=d)) for d in ("auto", "bf16", "fp16", "fp32")}
    assert cuda["auto"] == cuda["bf16"] and len({cuda["auto"], cuda["fp16"], cuda["fp32"]}) == 3
    cpu = {d: spec_digest(RunSpec(**base, device="cpu", dtype=d)) for d in ("auto", "fp32", "fp16")}
    assert cpu["auto"] == cpu["fp32"] != cpu["fp16"]
    assert spec_digest(RunSpec(**base, device="cuda", dtype="fp16", fp32_blocks=[3])) != cuda["fp16"]
    settings = {d: frame_settings(RunSpec(**base, device="cuda", dtype=d)) for d in ("auto", "bf16", "fp16")}
    assert settings["auto"] == settings["bf16"] and settings["fp16"]["dtype"] == "fp16"
