"""Our generation loop: at one process it gives exactly upstream ``WanS2V.generate``'s frames
(CPU, fp32; 2 clips, both solvers, with and without --start-from-ref; without it the dead
initial-motion encode is skipped; with a pose video, its second clip padded), and CFG-parallel
layouts (2 ranks, the VAE on rank 0) give exactly one process's frames over real gloo ranks, the
speech made by --tts-text (the CosyVoice stand-in, tests/data/cosyvoice_standin) on rank 0.
(hybrid + --cfg-parallel, FSDP across the CFG branches, is in tests/test_lora.py; CFG 2 x SP 3
over 6 ranks in tests/test_any_degree.py.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_FLAGS, one_process_frames, run_cli

STANDIN = Path(__file__).parent / "data" / "cosyvoice_standin"
if str(STANDIN) not in sys.path:  # the test reads the stand-in's own expected waveform
    sys.path.append(str(STANDIN))
from wan_s2v_runner.shared.layout import Layout, Mode  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("solver, start_from_ref, pose", [("unipc", False, False), ("dpm++", True, True)])
def test_our_loop_equals_upstream_generate(engine_cpu, tiny_assets, solver, start_from_ref, pose):
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for

    wan, cfg, spec = engine_cpu
    spec = spec.model_copy(update={"solver": solver, "start_from_ref": start_from_ref, "seed": 7, "num_clips": 2,
                                   "pose_video": tiny_assets.pose_video if pose else None})
    upstream = wan.WanS2V(config=cfg, checkpoint_dir=str(spec.ckpt_dir), device_id=0, rank=0)
    with torch.no_grad():
        ref = upstream.generate(
            input_prompt=spec.prompt, ref_image_path=str(spec.image), audio_path=str(spec.audio),
            enable_tts=False, tts_prompt_audio=None, tts_prompt_text=None, tts_text=None,
            num_repeat=spec.num_clips, pose_video=str(spec.pose_video) if pose else None, max_area=spec.max_area,
            infer_frames=spec.infer_frames, shift=spec.shift, sample_solver=spec.solver,
            sampling_steps=spec.steps, guide_scale=spec.guide_scale, n_prompt=spec.negative_prompt,
            seed=spec.seed, offload_model=False, init_first_frame=spec.start_from_ref)
    del upstream
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0)
    stages, encoded = [], []
    engine_encode = parts.shell.vae.encode
    parts.shell.vae.encode = lambda videos: encoded.append(videos[0].shape[1]) or engine_encode(videos)
    ours = JobShell(parts, plan, hooks=_recording(stages)).generate(request_for(spec))
    assert ours.shape == ref.shape == (3, 2 * 8 - (0 if start_from_ref else 3), 64, 64)
    assert torch.equal(ours, ref), f"max abs diff {(ours - ref).abs().max()}"
    # frames encoded: the reference image, the initial motion (73 frames) only when its latents are
    # read (--start-from-ref; else the first clip drops them), the motion re-encode after clip 1
    # and with a pose video each clip's 9 condition frames (8 + the chunk's first), before its denoising
    assert encoded == [1] + ([73] if start_from_ref else []) + ([9] if pose else []) + [73] + ([9] if pose else [])
    # ... with the text k/v cache serving every step after the first (upstream's model has none)
    from patches import context_cache
    cache = context_cache.stats(parts.noise_model)
    assert cache["kv_misses"] == 2 * len(parts.noise_model.blocks) and cache["kv_hits"] > cache["kv_misses"]
    assert stages.count("denoise") == 2 and stages.count("decode") == 2  # progress from the loop
    assert stages.count("pose_encode") == (2 if pose else 0)


@pytest.mark.slow
def test_a_groups_jobs_reuse_their_text_encodings(engine_cpu, tiny_assets):
    """A rank group keeps the T5 encoding of each text it has seen (rank.encoders.TextContexts): a
    second job with the same prompt runs T5 not at all, a new prompt only for itself (the default
    negative prompt is kept), and every job's frames are the ones a fresh group makes."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.encoders import TextContexts
    from wan_s2v_runner.rank.job_shell import Hooks, JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for

    wan, cfg, spec = engine_cpu
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0)
    t5, encoded = parts.shell.text_encoder, []

    class Counting:  # T5 as the loop calls it, counting the texts it encodes
        model = t5.model

        def __call__(self, texts, device):
            encoded.extend(texts)
            return t5(texts, device)

    parts.shell.text_encoder = Counting()
    texts, seen = TextContexts(), []
    hooks = Hooks(stage=lambda s, **k: seen.append(k["texts_encoded"]) if str(s) == "text_encode" else None)

    def job(prompt, memo):
        return JobShell(parts, plan, hooks, memo).generate(request_for(spec.model_copy(update={"prompt": prompt})))

    first = job("a person talking", texts)
    again = job("a person talking", texts)
    other = job("a person singing", texts)
    assert seen == [2, 0, 1] and len(encoded) == 3 and encoded[2] == "a person singing"
    assert texts.hits == 3 and texts.misses == 3
    assert torch.equal(first, again)
    assert torch.equal(other, job("a person singing", TextContexts()))  # a fresh group's memo


def _recording(stages):
    from wan_s2v_runner.rank.job_shell import Hooks
    return Hooks(stage=lambda s, **k: stages.append(str(s)))



@pytest.mark.parametrize("extra, cfg, sp, vae_split", [
    # rank 0 runs the VAE alone and broadcasts the motion latents
    (["--nproc", "2", "--cfg-parallel", "--no-vae-parallel"], 2, 1, False),
    # CFG 2 x SP 3 over 6 ranks: tests/test_any_degree.py
])
@pytest.mark.slow
def test_cfg_parallel_equals_one_process(engine_cpu, tiny_assets, tmp_path, extra, cfg, sp, vae_split):
    """... with the speech spoken from text: rank 0 runs the TTS stand-in once, writes the speech
    beside the mp4, the ranks' frames equal one process given that wav as --audio, and the mp4's
    audio is the stand-in's waveform."""
    import soundfile as sf
    from cosyvoice.cli.cosyvoice import SAMPLE_RATE, expected_speech

    from wan_s2v_runner.shared.cosyvoice import MODEL_FILES

    model = tmp_path / "CosyVoice2-0.5B"
    model.mkdir()
    for name in MODEL_FILES:
        (model / name).write_bytes(b"stand-in")
    text = "Hi there. Bye!"
    d = tmp_path / "cfg"
    d.mkdir()
    r = run_cli(["run", *TINY_FLAGS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--image", str(tiny_assets.image),
                 "--tts-text", text, "--tts-prompt-audio", str(tiny_assets.audio), "--cosyvoice-dir", str(STANDIN),
                 "--cosyvoice-model", str(model), "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
                 "--runs-root", str(d / "runs"), *extra], cwd=d)
    assert r.returncode == 0, r.output
    assert "WARN inputs.tts" in r.output and "cross-lingual" in r.output  # the 1 s prompt: outside 5-15 s
    frames, run_dir = torch.load(d / "f.pt"), next((d / "runs").glob("*"))
    manifest = json.loads((run_dir / "run.json").read_text())
    speech, rate = sf.read(str(d / "o.speech.wav"), dtype="float32")
    prompt_rms = float(torch.from_numpy(librosa_16k(tiny_assets.audio)).pow(2).mean().sqrt())
    want = torch.cat(expected_speech(text, prompt_rms), dim=1)[0].numpy()
    assert rate == SAMPLE_RATE and np.array_equal(speech, want), "the speech is not what the TTS gave"
    expected = one_process_frames(engine_cpu, audio=d / "o.speech.wav")
    assert torch.equal(frames, expected), f"max abs diff {(frames - expected).abs().max()}"
    assert frames.shape[1] == 13  # 2 clips: 0.78 s of speech
    heard = mp4_audio(d / "o.mp4", rate)
    n = min(len(heard), len(want)) - 2048  # AAC's priming and last frame aside
    assert n > 0.5 * rate and np.corrcoef(heard[1024:n], want[1024:n])[0, 1] > 0.95
    tts_ranks = [rank for rank, info in manifest["ranks"].items() if "tts" in info.get("stage_seconds", {})]
    assert tts_ranks == ["0"], manifest["ranks"]
    lay = manifest["layout"]
    assert (lay["cfg_degree"], lay["ulysses_degree"], lay["vae_parallel"]) == (cfg, sp, vae_split)


def librosa_16k(path):
    import librosa
    return librosa.load(str(path), sr=16000, mono=True)[0]


def mp4_audio(path, rate: int) -> "np.ndarray":
    """An mp4's audio track, decoded to mono float32 at ``rate`` by the bundled ffmpeg."""
    import subprocess

    from wan_s2v_runner.shared.media import ffmpeg_exe
    p = subprocess.run([ffmpeg_exe(), "-nostdin", "-loglevel", "error", "-i", str(path), "-map", "0:a:0", "-ac", "1",
                        "-ar", str(rate), "-f", "f32le", "-"], capture_output=True, check=True)
    return np.frombuffer(p.stdout, dtype=np.float32)
