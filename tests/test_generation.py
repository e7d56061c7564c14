"""Our generation loop: at one process it gives exactly upstream ``WanS2V.generate``'s frames
(CPU, fp32; 2 clips, both solvers, with and without --start-from-ref; without it the dead
initial-motion encode is skipped), and CFG-parallel layouts
(2 ranks, the VAE on rank 0) give exactly one process's frames over real gloo ranks.
(hybrid + --cfg-parallel, FSDP across the CFG branches, is in tests/test_lora.py; CFG 2 x SP 3
over 6 ranks in tests/test_any_degree.py.)"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_FLAGS, run_frames
from wan_s2v_runner.shared.layout import Layout, Mode


@pytest.mark.parametrize("solver, start_from_ref", [("unipc", False), ("dpm++", True)])
def test_our_loop_equals_upstream_generate(engine_cpu, solver, start_from_ref):
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.generation import S2VGenerator
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for

    wan, cfg, spec = engine_cpu
    spec = spec.model_copy(update={"solver": solver, "start_from_ref": start_from_ref, "seed": 7, "num_clips": 2})
    upstream = wan.WanS2V(config=cfg, checkpoint_dir=str(spec.ckpt_dir), device_id=0, rank=0)
    with torch.no_grad():
        ref = upstream.generate(
            input_prompt=spec.prompt, ref_image_path=str(spec.image), audio_path=str(spec.audio),
            enable_tts=False, tts_prompt_audio=None, tts_prompt_text=None, tts_text=None,
            num_repeat=spec.num_clips, pose_video=None, max_area=spec.max_area,
            infer_frames=spec.infer_frames, shift=spec.shift, sample_solver=spec.solver,
            sampling_steps=spec.steps, guide_scale=spec.guide_scale, n_prompt=spec.negative_prompt,
            seed=spec.seed, offload_model=False, init_first_frame=spec.start_from_ref)
    del upstream
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0)
    stages, encoded = [], []
    engine_encode = parts.shell.vae.encode
    parts.shell.vae.encode = lambda videos: encoded.append(videos[0].shape[1]) or engine_encode(videos)
    ours = S2VGenerator(parts, plan, hooks=_recording(stages)).generate(request_for(spec))
    assert ours.shape == ref.shape == (3, 2 * 8 - (0 if start_from_ref else 3), 64, 64)
    assert torch.equal(ours, ref), f"max abs diff {(ours - ref).abs().max()}"
    # frames encoded: the reference image, the initial motion (73 frames) only when its latents are
    # read (--start-from-ref; else the first clip drops them), the motion re-encode after clip 1
    assert encoded == [1] + ([73] if start_from_ref else []) + [73]
    # ... with the text k/v cache serving every step after the first (upstream's model has none)
    from patches import context_cache
    cache = context_cache.stats(parts.noise_model)
    assert cache["kv_misses"] == 2 * len(parts.noise_model.blocks) and cache["kv_hits"] > cache["kv_misses"]
    assert stages.count("denoise") == 2 and stages.count("decode") == 2  # progress from the loop


def _recording(stages):
    from wan_s2v_runner.rank.generation import Hooks
    return Hooks(stage=lambda s, **k: stages.append(str(s)))



@pytest.mark.parametrize("extra, cfg, sp, vae_split", [
    # rank 0 runs the VAE alone and broadcasts the motion latents
    (["--nproc", "2", "--cfg-parallel", "--no-vae-parallel"], 2, 1, False),
    # CFG 2 x SP 3 over 6 ranks: tests/test_any_degree.py
])
def test_cfg_parallel_equals_one_process(tiny_assets, reference_frames, tmp_path, extra, cfg, sp, vae_split):
    frames, run_dir = run_frames(tiny_assets, tmp_path / "cfg", TINY_FLAGS, *extra)
    manifest = json.loads((run_dir / "run.json").read_text())
    assert torch.equal(frames, reference_frames), f"max abs diff {(frames - reference_frames).abs().max()}"
    lay = manifest["layout"]
    assert (lay["cfg_degree"], lay["ulysses_degree"], lay["vae_parallel"]) == (cfg, sp, vae_split)
