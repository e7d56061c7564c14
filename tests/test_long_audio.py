"""Long speech through wav2vec2 in windows (``wan_s2v_runner.rank.long_audio``, issue #72 item 4).

The demo checkpoint's tiny wav2vec2 (xlsr-53's layout: the layer-norm conv encoder with the real
strides, the 128-frame positional conv, 25 hidden states; 32 wide), built here, loaded by
upstream's ``AudioEncoder``; upstream's ``WanS2V.encode_audio`` on a shell holding what it reads.

* speech that fits one window is upstream's own call, bit for bit;
* the windowed code with one window is upstream's single pass bit for bit, and its tail is
  upstream's ``encode_audio`` on the windowed features;
* long speech (24 s, 7 windows of 6 s with 1.5 s of overlap) is within :data:`BOUND` of the single
  pass in every hidden state, the input state (before attention) within :data:`BOUND_INPUT`; an
  overlap shorter than the positional conv's reach (64 frames) breaks both bounds.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import encode_audio_shell

from wan_s2v_runner.rank import long_audio
from wan_s2v_runner.rank.long_audio import Windows
from wan_s2v_runner.shared import encoder_placement as ep

#: every hidden state, windowed vs the single pass: max |diff| <= BOUND * max |single|
#: (measured here 3.4e-3: attention sees the window, not the file; no overlap: 0.24)
BOUND = 1e-2
#: the input state (conv features + positional conv, before any attention): float rounding only
#: (measured 5.6e-7; an overlap of 50 frames: 0.076)
BOUND_INPUT = 1e-5
#: windows small enough that 24 s of speech takes several: 6 s, 1.5 s of overlap on each side
SMALL = Windows(window=300, overlap=75)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio

    d = tmp_path_factory.mktemp("speech")
    return {s: str(make_speech_audio(Path(d) / f"{s}.wav", seconds=s, seed=3)) for s in (3.0, 24.0)}


def shell(audio_wan, tiny_w2v, param_dtype=torch.bfloat16):
    return encode_audio_shell(audio_wan, tiny_w2v, param_dtype)


def seconds_of(path):
    from wan_s2v_runner.rank.encoders import audio_seconds
    return audio_seconds(path)


def test_speech_that_fits_one_window_is_upstreams_own_call(audio_wan, tiny_w2v, speech, monkeypatch):
    s2v = shell(audio_wan, tiny_w2v)
    path = speech[3.0]
    ref = s2v.encode_audio(path, infer_frames=16)
    calls = []
    upstream = s2v.encode_audio
    s2v.encode_audio = lambda p, infer_frames: calls.append(p) or upstream(p, infer_frames=infer_frames)
    monkeypatch.setattr(long_audio, "extract_audio_feat", lambda *a, **k: pytest.fail("windowed"))
    for windows in (None, SMALL):  # 3 s: 149 frames, one window of either
        got = long_audio.encode_audio(s2v, path, 16, seconds_of(path), windows)
        assert torch.equal(got[0], ref[0]) and got[1] == ref[1]
    assert long_audio.encode_audio(s2v, path, 16, None, SMALL)[1] == ref[1]  # length unknown: upstream's
    assert calls == [path] * 3
    # the rank's entry point takes the same call
    from wan_s2v_runner.rank import encoders
    got = encoders.encode_audio(s2v, ep.AudioEncoderDevice.CPU, torch.device("cpu"), path, 16)
    assert torch.equal(got[0], ref[0]) and calls == [path] * 4


def test_one_window_of_the_windowed_code_is_upstreams_single_pass(tiny_w2v, speech):
    path = speech[24.0]
    with torch.no_grad():
        ref = tiny_w2v.extract_audio_feat(path, return_all_layers=True)
        got = long_audio.extract_audio_feat(tiny_w2v, path, Windows(window=2000, overlap=100))
    assert got.shape == ref.shape and torch.equal(got, ref)


def test_the_windowed_features_go_through_upstreams_encode_audio(audio_wan, tiny_w2v, speech, monkeypatch):
    """Long speech: upstream's ``encode_audio`` given the windowed features returns what ours does."""
    path = speech[24.0]
    s2v = shell(audio_wan, tiny_w2v)
    with torch.no_grad():
        got = long_audio.encode_audio(s2v, path, 16, seconds_of(path), SMALL)
        feat = long_audio.extract_audio_feat(tiny_w2v, path, SMALL)
        monkeypatch.setattr(tiny_w2v, "extract_audio_feat", lambda p, return_all_layers: feat)
        ref = s2v.encode_audio(path, infer_frames=16)
    assert got[1] == ref[1] and got[0].dtype == ref[0].dtype and torch.equal(got[0], ref[0])
    assert got[0].shape[:3] == (1, 25, 32)


def _distance(got, ref):
    """max |diff| / max |ref| for each hidden state."""
    return [float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref)]


def test_long_speech_is_within_the_bound_of_the_single_pass(tiny_w2v, speech):
    path = speech[24.0]
    with torch.no_grad():
        x = long_audio.load_input_values(tiny_w2v, path)
        single = torch.cat(tiny_w2v.model(x, output_hidden_states=True).hidden_states)
        frames = single.shape[1]
        assert frames == long_audio.conv_frames(tiny_w2v.model.config, x.shape[-1]) == 1199
        assert len(SMALL.spans(frames)) == 7

        d = _distance(long_audio.hidden_states(tiny_w2v.model, x, SMALL), single)
        assert d[0] <= BOUND_INPUT and max(d) <= BOUND, d
        assert max(d[1:]) > BOUND_INPUT  # attention does see the window (the bound is not vacuous)
        # after upstream's interpolation to 30 fps too (what the buckets pick from)
        z = long_audio.extract_audio_feat(tiny_w2v, path, SMALL)
        zref = tiny_w2v.extract_audio_feat(path, return_all_layers=True)
        assert max(_distance(z, zref)) <= BOUND

        # the bounds bite: no overlap, or less than the positional conv's 64 frames
        for bad in (Windows(window=300, overlap=0), Windows(window=300, overlap=50)):
            d = _distance(long_audio.hidden_states(tiny_w2v.model, x, bad), single)
            assert d[0] > BOUND_INPUT and max(d) > BOUND, (bad, d)


@pytest.mark.parametrize("windows", [SMALL, Windows(), Windows(window=129, overlap=64)])
def test_the_windows_tile_the_speech_each_keeping_its_centre(windows):
    for frames in list(range(1, 2000, 37)) + [windows.window, windows.window + 1, 30_000, 30_001]:
        spans = windows.spans(frames)
        assert spans[0][0] == 0 and spans[-1][1] == frames
        assert [lo for _, _, lo, _ in spans] == [0] + [hi for _, _, _, hi in spans[:-1]]  # tiled, in order
        assert spans[-1][3] == frames
        for i, (a, b, lo, hi) in enumerate(spans):
            assert 0 <= a <= lo < hi <= b <= frames and b - a <= windows.window
            assert i == 0 or lo - a >= windows.overlap
            assert i == len(spans) - 1 or b - hi >= windows.overlap
        if windows.splits(frames):
            step = windows.window - 2 * windows.overlap
            assert len(spans) == -(-(frames - windows.window) // step) + 1
        else:
            assert spans == [(0, frames, 0, frames)]
    with pytest.raises(ValueError):
        Windows(window=100, overlap=50)


def test_a_group_norm_wav2vec2_keeps_the_single_pass():
    """wav2vec2-base's GroupNorm over time in the first conv layer is a global statistic."""
    from types import SimpleNamespace

    calls = []
    enc = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(feat_extract_norm="group")))
    s2v = SimpleNamespace(audio_encoder=enc, encode_audio=lambda p, infer_frames: calls.append(p) or ("up", 1))
    assert long_audio.encode_audio(s2v, "long.wav", 16, 600.0) == ("up", 1) and calls == ["long.wav"]
    assert not long_audio.windowable(enc.model.config)


def test_the_gpu_rule_plans_for_one_window_beyond_one_window(monkeypatch):
    """One rule (``encoder_placement.encode_bytes``) for the plan and the rank: up to a window
    (60 s) upstream's estimate; beyond, one window's activations plus features linear in length."""
    from types import SimpleNamespace

    from wan_s2v_runner.rank import encoders

    w = 317_000_000
    assert not ep.windowed(ep.WINDOW_S) and ep.windowed(ep.WINDOW_S + 1)
    assert ep.encode_bytes(w, 60.0) == ep.encode_bytes(w, 60.0, windows=False)
    ten, twenty = ep.encode_bytes(w, 600.0), ep.encode_bytes(w, 1200.0)
    per_minute = ep.encode_bytes(w, 660.0) - ten
    assert twenty - ten == pytest.approx(10 * per_minute, rel=1e-4)  # linear in the speech's length
    assert ten < 12 * 2**30 < 54 * 2**30 < ep.encode_bytes(w, 600.0, windows=False)  # the file's scores
    # the rank's rule: ten minutes go to a 48 GB GPU, unless the encoder is never windowed
    monkeypatch.setattr(encoders, "audio_seconds", lambda path: 600.0)
    monkeypatch.setattr(encoders, "_free_bytes", lambda device: 48 * 2**30)
    for norm, where in (("layer", ep.AudioEncoderDevice.GPU), ("group", ep.AudioEncoderDevice.CPU)):
        cfg = SimpleNamespace(feat_extract_norm=norm, hidden_size=1024, num_attention_heads=16,
                              num_hidden_layers=24)
        model = SimpleNamespace(config=cfg, parameters=lambda: [torch.empty(w, device="meta")])
        assert encoders.placement(SimpleNamespace(model=model), torch.device("cuda"), "long.wav")[0] is where
