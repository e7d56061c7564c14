"""Upstream's other inputs: the pose video, text-to-speech, and the sub-models checked before spawn.

In process, against upstream's own code (CPU, fp32): the pose reader gives decord's frames (what
upstream reads with); each clip's condition latents equal upstream ``load_pose_cond``'s, clip by
clip, with a short video's padding (and a later clip's pose is not dropped). The whole loop with a
pose video equals upstream ``generate(pose_video=...)``: tests/test_generation.py (2 clips). Every
layout with a pose video equals one process: tests/test_any_degree.py (Ulysses over 3 ranks, CFG 2
x SP 3 over 6), tests/test_parity.py (fsdp-fixed, hybrid). TTS over real ranks with the CosyVoice
stand-in: tests/test_generation.py's CFG-parallel run. Here also: preflight refusals (a file that
is no video, a short video said in one line, a missing CosyVoice model, sub-models that do not fit
the DiT) and upstream's flag spellings.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from wan_s2v_runner.cli import main as cli
from wan_s2v_runner.preflight import CheckContext, Status, run_checks
from wan_s2v_runner.preflight.core import find
from wan_s2v_runner.preflight.probe import probe_machine
from wan_s2v_runner.shared import exit_codes

STANDIN = Path(__file__).parent / "data" / "cosyvoice_standin"


def _check(tiny_assets, group: str, id: str, **values):
    vals = dict(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, audio=tiny_assets.audio,
                prompt="a person talking", device="cpu", nproc=1, max_area=64 * 64, infer_frames=8)
    vals.update(values)
    r = find(run_checks(CheckContext.for_values(vals, probe_machine()), [group]), id)
    assert r is not None
    return r


def test_reader_gives_decords_frames(tmp_path):
    """The frames upstream reads (decord, every round(fps/16)-th from the first) = ours, at a width
    that is no multiple of 32 and 29.97 fps (every 2nd frame)."""
    from decord import VideoReader

    from wan_s2v_runner.demo.synthetic_inputs import make_pose_video
    from wan_s2v_runner.shared.pose_video import PoseFrames, sampled_indices, video_facts

    path = make_pose_video(tmp_path / "pose.mp4", width=100, height=70, frames=23, fps=29.97)
    vr = VideoReader(str(path))
    facts = video_facts(path)
    assert (facts.frames, facts.width, facts.height, facts.interval()) == (len(vr), 100, 70, 2)
    want = sampled_indices(len(vr), vr.get_avg_fps(), 3 * 5)
    assert want == list(range(0, 23, 2))  # 12 of the 15 three clips of 5 take
    frames = PoseFrames(path, infer_frames=5, num_clips=3)
    ours = [frames.clip(r) for r in (0, 1, 2, 1)]  # clip 2 again: the stream restarts
    frames.close()
    theirs = vr.get_batch(want).asnumpy()
    assert [len(c) for c in ours] == [5, 5, 2, 5]
    assert np.array_equal(np.concatenate(ours[:3]), theirs) and np.array_equal(ours[3], theirs[5:10])


def test_condition_latents_equal_upstream_load_pose_cond(engine_cpu, tiny_assets):
    """Per clip, what our loop conditions on = upstream's COND[r]: 3 clips of 8 frames from a
    15-frame sampling (clip 2 padded by 1, clip 3 all padding); clip 2's pose is really there."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.pose import PoseCondition
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine_cpu
    parts = components.load(wan, cfg, str(spec.ckpt_dir), RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0),
                            torch.device("cpu"), 0)
    s2v = parts.shell
    with torch.no_grad():
        upstream = s2v.load_pose_cond(str(tiny_assets.pose_video), num_repeat=3, infer_frames=8, size=(64, 64))
        ours = PoseCondition(str(tiny_assets.pose_video), (64, 64), 8, 3, torch.float32, torch.device("cpu"),
                             encode=lambda px: torch.stack(s2v.vae.encode(px)), band=lambda x: x)
        got = [ours.latents(r) for r in range(3)]
        ours.close()
    assert len(upstream) == 3
    for r in range(3):
        assert torch.equal(got[r], upstream[r]), f"clip {r + 1}: max abs diff {(got[r] - upstream[r]).abs().max()}"
    assert not torch.equal(got[1], got[2]), "clip 2's pose frames were lost (it equals the all-padding clip 3)"


def test_preflight_reads_the_pose_video(tiny_assets, tmp_path):
    short = _check(tiny_assets, "inputs", "inputs.pose_video", pose_video=tiny_assets.pose_video, num_clips=2)
    assert short.status is Status.WARN, short
    assert "30 frames 84x80 at 25 fps (every 2nd frame" in short.finding
    assert "15 of the 16 frames 2 clips take; the last 1 are padded" in short.finding
    assert "at least 31 frames" in short.fix
    enough = _check(tiny_assets, "inputs", "inputs.pose_video", pose_video=tiny_assets.pose_video, num_clips=1)
    assert enough.status is Status.OK and "all 8 frames of 1 clip" in enough.finding
    fake = tmp_path / "pose.mp4"
    fake.write_bytes(tiny_assets.image.read_bytes())  # a PNG named .mp4
    image = _check(tiny_assets, "inputs", "inputs.pose_video", pose_video=fake)
    assert image.status is Status.FAIL and "pose.mp4 is a PNG image, not a video" in image.finding, image
    fake.write_text("not a video at all\n" * 50)
    bad = _check(tiny_assets, "inputs", "inputs.pose_video", pose_video=fake)
    assert bad.status is Status.FAIL and "does not decode as a video" in bad.finding, bad
    assert "ffmpeg -i IN" in bad.fix
    gone = _check(tiny_assets, "inputs", "inputs.pose_video", pose_video=tmp_path / "nope.mp4")
    assert gone.status is Status.FAIL and "does not exist" in gone.finding


@pytest.mark.slow
def test_preflight_refuses_tts_without_its_model(tiny_assets, tmp_path, capsys):
    code = STANDIN
    model = tmp_path / "CosyVoice2-0.5B"
    values = dict(audio=None, tts_text="Hello there.", tts_prompt_audio=tiny_assets.audio,
                  cosyvoice_dir=code, cosyvoice_model=model)
    r = _check(tiny_assets, "inputs", "inputs.tts", **values)
    assert r.status is Status.FAIL and f"{model} lacks cosyvoice2.yaml" in r.finding, r
    assert "huggingface-cli download FunAudioLLM/CosyVoice2-0.5B" in r.fix
    nocode = _check(tiny_assets, "inputs", "inputs.tts", **{**values, "cosyvoice_dir": tmp_path})
    assert nocode.status is Status.FAIL and "no CosyVoice code at" in nocode.finding
    from wan_s2v_runner.shared.cosyvoice import MODEL_FILES
    model.mkdir()
    for name in MODEL_FILES:
        (model / name).write_bytes(b"stand-in")
    good = _check(tiny_assets, "inputs", "inputs.tts", **values)
    assert good.status is Status.WARN and "cross-lingual" in good.finding and "5-15 s" in good.finding, good
    # the whole command: refused before anything is spawned, exit 3, the cause on one line
    rc = cli.main(["run", "--ckpt-dir", str(tiny_assets.ckpt_dir), "--image", str(tiny_assets.image),
                   "--prompt", "p", "--device", "cpu", "--size", "64*64", "--tts-text", "Hello there.",
                   "--tts-prompt-audio", str(tiny_assets.audio), "--output", str(tmp_path / "o.mp4"),
                   "--runs-root", str(tmp_path / "runs")])
    err = capsys.readouterr()
    assert rc == exit_codes.PREFLIGHT, err
    assert "inputs.tts" in err.out + err.err and "CosyVoice" in err.out + err.err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_speech_is_required_once(tiny_assets):
    from pydantic import ValidationError

    from wan_s2v_runner.shared.spec import RunSpec
    base = dict(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, prompt="p")
    with pytest.raises(ValidationError, match="got neither"):
        RunSpec(**base)
    with pytest.raises(ValidationError, match="got both"):
        RunSpec(**base, audio=tiny_assets.audio, tts_text="hi", tts_prompt_audio=tiny_assets.audio)
    with pytest.raises(ValidationError, match="needs --tts-prompt-audio"):
        RunSpec(**base, tts_text="hi")
    spec = RunSpec(**base, tts_text="hi", tts_prompt_audio=tiny_assets.audio, output="/tmp/x/v.mp4")
    assert spec.speech == Path("/tmp/x/v.speech.wav")
    assert spec.cosyvoice_paths == (tiny_assets.ckpt_dir / "CosyVoice", tiny_assets.ckpt_dir / "CosyVoice2-0.5B")


def test_resume_of_a_tts_run_names_its_missing_speech(tiny_assets, tmp_path):
    """`wan-s2v resume` of a --tts-text run whose OUTPUT.speech.wav is gone: one line, cause and fix
    (it was a bare FileNotFoundError from hashing the file)."""
    from wan_s2v_runner.shared import resume
    from wan_s2v_runner.shared.spec import RunSpec

    spec = RunSpec(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, prompt="p", tts_text="hi",
                   tts_prompt_audio=tiny_assets.audio, output=tmp_path / "v.mp4")
    progress = resume.Progress(tmp_path / "run", 1, 2, {})
    with pytest.raises(resume.ResumeError, match=r"its speech .*v\.speech\.wav is missing \(--tts-text wrote it.*Fix"):
        resume.check(progress, spec)


@pytest.mark.parametrize("part, edit, needle", [
    ("wav2vec2-large-xlsr-53-english/config.json", lambda c: c.update(hidden_size=48),
     "model.safetensors: holds 24 layers of width 32, its config.json says 24 of 48"),
    ("wav2vec2-large-xlsr-53-english/config.json", lambda c: c.update(num_hidden_layers=12),
     "holds 24 layers of width 32, its config.json says 12 of 32"),
    ("config.json", lambda c: c.update(audio_dim=48), "config.json: audio_dim 48, but the audio encoder gives 32-wide"),
    ("config.json", lambda c: c.update(cond_dim=8), "Wan2.1_VAE.pth: 16 latent channels, the DiT's cond_dim is 8"),
    ("google/umt5-xxl/tokenizer.json", None, "google/umt5-xxl/tokenizer.json: does not load as a tokenizer"),
])
def test_preflight_refuses_sub_models_that_do_not_fit(tiny_assets, tmp_path, part, edit, needle):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_assets.ckpt_dir, ckpt)
    path = ckpt / part
    if edit is None:
        path.write_text('{"version": "1.0", "model": {"type": "Unigram", "vocab": "broken"}}')
    else:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    r = _check(tiny_assets, "checkpoint", "ckpt.submodels", ckpt_dir=ckpt)
    assert r.status is Status.FAIL and needle in r.finding, r
    assert "Wan2.2-S2V-14B" in r.fix
    ok = _check(tiny_assets, "checkpoint", "ckpt.submodels")
    assert ok.status is Status.OK and "audio encoder 24 layers x 32 (the DiT reads 25 states)" in ok.finding, ok


def test_nan_audio_is_refused(tiny_assets, tmp_path):
    import soundfile as sf
    x = np.sin(np.arange(16000) / 10).astype(np.float32)
    x[100] = np.nan
    sf.write(str(tmp_path / "nan.wav"), x, 16000, subtype="FLOAT")
    r = _check(tiny_assets, "inputs", "inputs.audio", audio=tmp_path / "nan.wav")
    assert r.status is Status.FAIL and "1 samples that are NaN or infinite" in r.finding


def test_upstream_flags(tiny_assets, capsys):
    from wan_s2v_runner.launcher.upstream_flags import UpstreamFlagError, translate

    known = cli._option_strings(cli.build_parser())
    notes = []
    got = translate(["--ckpt_dir", "D", "--num_clip", "2", "--sample_steps=3", "--base_seed", "7", "--pose_video",
                     "p.mp4", "--offload_model", "False", "--convert_model_dtype", "--task", "s2v-14B",
                     "--watchdog_step", "9"], known, warn=notes.append)
    assert got == ["--ckpt-dir", "D", "--num-clips", "2", "--steps=3", "--seed", "7", "--pose-video", "p.mp4",
                   "--no-offload-model", "--watchdog-step", "9"]
    assert len(notes) == 2 and all("has no effect here" in n for n in notes)
    with pytest.raises(UpstreamFlagError, match=r"Fix: --mode hybrid --nproc 8"):
        translate(["--ulysses_size", "8", "--dit_fsdp", "--t5_fsdp"], known)
    with pytest.raises(UpstreamFlagError, match=r"Fix: --mode fsdp-fixed"):
        translate(["--dit_fsdp", "--t5_fsdp"], known)
    with pytest.raises(UpstreamFlagError, match="prompt extension calls an LLM"):
        translate(["--use_prompt_extend"], known)
    assert cli.main(["run", "--task", "t2v-A14B"]) == exit_codes.USAGE
    assert "s2v-14B only" in capsys.readouterr().err
    from wan_s2v_runner.launcher.upstream_flags import doc_block
    assert doc_block() in (Path(__file__).parent.parent / "docs" / "upstream-flags.md").read_text(), (
        "docs/upstream-flags.md is stale: "
        "python -m wan_s2v_runner.launcher.upstream_flags --write docs/upstream-flags.md"
    )
