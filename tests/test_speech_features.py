"""Block-wise streaming speech features (``wan_s2v_runner.shared.speech_windows``, the rules;
``wan_s2v_runner.rank.speech_features``, the rank's side).

The demo checkpoint's tiny wav2vec2 (xlsr-53's layout, 32 wide), built here, loaded by upstream's
``AudioEncoder``; upstream's ``WanS2V.encode_audio`` on a shell holding what it reads.

* the rules: upstream's frame picks, today's block count (``num_repeat``), the windows' spans;
* causality: a block's features are a function of the speech up to ``needed_samples(g)`` only,
  and of all of its window; speech grown by chunks of any size makes the file's bits; speech past
  the end is silence;
* the distance from upstream's whole-file features, within :data:`BOUND_UPSTREAM` (upstream's
  length-stretched grid's, :data:`BOUND_GRID`); the windows' own share (against upstream's
  whole-file hidden states on the same absolute grid) within :data:`BOUND_WINDOW`, which no
  lookahead breaks.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import encode_audio_shell

from wan_s2v_runner.rank import long_audio
from wan_s2v_runner.rank.speech_features import BlockFeatures, load_speech
from wan_s2v_runner.shared import speech_windows as sw
from wan_s2v_runner.shared.speech_windows import SpeechWindow

#: block features vs upstream's ``encode_audio`` (12-frame buckets), every layer, the video frames
#: within the speech: max |diff| <= BOUND_UPSTREAM * max |upstream|. Measured 0.982 (8 s): upstream's
#: grid, not the windows: its interpolation is stretched by the file's length (the last feature lands
#: on the last wav2vec2 frame: 1.3 frames, 27 ms, later than its time here), and the tiny model's
#: random features change as much from one frame to the next as they are large (the whole-file
#: states on the absolute grid alone: 0.974). :data:`BOUND_GRID` checks that this is the cause.
BOUND_UPSTREAM = 1.05
#: upstream's whole-file hidden states on upstream's own stretched grid vs its ``encode_audio``
#: (measured 2.4e-5: F.interpolate's float weights)
BOUND_GRID = 1e-4
#: the windows' own share: block features vs upstream's whole-file hidden states interpolated on
#: the absolute grid, every layer, the blocks whose window lies inside the speech. Measured 0.168
#: with the default window (the positional conv reaches 64 frames, 1.28 s, past the lookahead); a
#: zero lookahead: 0.248
BOUND_WINDOW = 0.2
SECONDS = 8.0


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio

    return str(make_speech_audio(Path(tmp_path_factory.mktemp("speech")) / "speech.wav", seconds=SECONDS, seed=3))


@pytest.fixture(scope="module")
def timeline(tiny_w2v, speech):
    return load_speech(tiny_w2v, speech)


@pytest.fixture(scope="module")
def features(tiny_w2v):
    return BlockFeatures(tiny_w2v, SpeechWindow(), torch.device("cpu"), torch.float32)


def shell(audio_wan, tiny_w2v, param_dtype=torch.float32):
    return encode_audio_shell(audio_wan, tiny_w2v, param_dtype)


# ----- the rules


def test_the_grid_picks_upstreams_features_on_absolute_time(audio_wan):
    picks = audio_wan.modules.s2v.audio_encoder.get_sample_indices(30, 10**6, 16, 48_000, fixed_start=0)
    assert [sw.feature_index(i) for i in range(48_000)] == picks.tolist()
    for i in range(200):
        j, w = sw.frame_taps(i)
        assert j + w == pytest.approx(sw.feature_index(i) * 5 / 3) and w in (0.0, 1 / 3, 2 / 3)
    assert sw.BLOCK_SECONDS == 0.75 and sw.BLOCK_SAMPLES == 12_000 and (sw.STRIDE, sw.RECEPTIVE) == (320, 400)


@pytest.mark.parametrize("window", [SpeechWindow(), SpeechWindow(0.0, 0.0), SpeechWindow(0.25, 1.0),
                                    SpeechWindow(1.0, 4.0)])
def test_a_blocks_window_holds_its_frames_context_and_lookahead(window):
    assert window.lookahead_frames == {0.0: 0, 0.25: 13, 0.5: 25, 1.0: 50}[window.lookahead_s]
    spans = [window.samples_of_block(g) for g in range(40)]
    for g, (s0, s1) in enumerate(spans):
        lo, hi = window.frames_of_block(g)
        taps = [sw.frame_taps(i) for i in window.video_frames_of_block(g)]
        assert lo == taps[0][0] and hi == taps[-1][0] + 2 and all(lo <= j < j + 1 < hi for j, _ in taps)
        first, end = window.window_frames(g)
        assert first == max(0, lo - window.context_frames) and end == hi + window.lookahead_frames
        assert (s0, s1) == (first * 320, (end - 1) * 320 + 400) == (s0, window.needed_samples(g))
        assert sw.conv_frames(s1 - s0) == end - first
        assert g * 12_000 - s0 <= window.context_samples and s1 - (g + 1) * 12_000 <= window.lookahead_samples
    assert all(b[1] > a[1] and b[0] >= a[0] for a, b in zip(spans, spans[1:]))
    assert window.context_samples == max(g * 12_000 - s0 for g, (s0, _) in enumerate(spans))
    assert window.lookahead_samples == max(0, *(s1 - (g + 1) * 12_000 for g, (_, s1) in enumerate(spans)))


def test_the_default_lookahead_is_at_most_a_second():
    assert 0 < SpeechWindow().lookahead_s <= 1.0 and SpeechWindow().lookahead_samples <= 16_000
    for bad in (dict(lookahead_s=-0.02), dict(context_s=float("nan")), dict(lookahead_s=True),
                dict(context_s="1")):
        with pytest.raises(ValueError, match="seconds"):
            SpeechWindow(**bad)


def test_blocks_for_samples_is_upstreams_num_repeat(audio_wan):
    ae = audio_wan.modules.s2v.audio_encoder
    enc = ae.AudioEncoder.__new__(ae.AudioEncoder)
    enc.video_rate = 30

    def upstream(n):
        z = ae.linear_interpolation(torch.zeros(1, long_audio.conv_frames(cfg, n), 1), 50, 30)
        return enc.get_audio_embed_bucket_fps(z, fps=16, batch_frames=12, m=0)[1]

    cfg = SimpleNamespace(conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_stride=(5, 2, 2, 2, 2, 2, 2))
    edges = [n for n in range(720, 160_001, 1) if SpeechWindow.blocks_for_samples(n)
             != SpeechWindow.blocks_for_samples(n - 1)]
    assert len(edges) == 13  # one block more every 0.75 s
    lengths = {720, 721, 1_000, 4_567, 12_000, 16_000, 65_680, 160_000}  # N = 205: upstream's float count
    lengths |= {n + d for n in edges for d in (-1, 0, 1)}
    for n in sorted(lengths):
        assert SpeechWindow.blocks_for_samples(n) == upstream(n), n
    assert SpeechWindow.blocks_for_samples(0) == SpeechWindow.blocks_for_samples(719) == 1  # upstream fails here


def test_the_count_and_the_features_layout_match_upstreams_call(audio_wan, tiny_w2v, speech, timeline):
    ref, blocks = shell(audio_wan, tiny_w2v, torch.bfloat16).encode_audio(speech, infer_frames=12)
    assert blocks == SpeechWindow.blocks_for_samples(timeline.numel()) == 11
    got = BlockFeatures(tiny_w2v, SpeechWindow(), torch.device("cpu"), torch.bfloat16).of_block(timeline, 3)
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref[..., :12].shape == (1, 25, 32, 12)


def test_speech_is_read_as_upstream_reads_it_before_the_processor(tiny_w2v, speech, timeline):
    assert timeline.dtype == torch.float32 and timeline.ndim == 1 and timeline.numel() == int(SECONDS * 16000)
    normalised = tiny_w2v.processor(timeline.numpy(), sampling_rate=16000, return_tensors="pt").input_values
    assert torch.equal(normalised, long_audio.load_input_values(tiny_w2v, speech))


# ----- causality


def test_a_block_reads_the_speech_up_to_its_need_and_no_further(features, timeline):
    window = features.window
    rng = np.random.default_rng(0)
    for g in (0, 1, 4, 7):
        need = window.needed_samples(g)
        s0, _ = window.samples_of_block(g)
        cut = features.of_block(timeline[:need], g)
        beyond = torch.cat([timeline[:need], torch.from_numpy(rng.standard_normal(48_000).astype(np.float32))])
        assert torch.equal(features.of_block(beyond, g), cut)
        for at in (need - 1, (s0 + need) // 2, s0):  # inside the window: it changes
            moved = timeline[:need].clone()
            moved[at] += 0.25
            assert not torch.equal(features.of_block(moved, g), cut), (g, at)
        if s0 > 0:  # before the window: it does not
            moved = timeline[:need].clone()
            moved[:s0] = torch.from_numpy(rng.standard_normal(s0).astype(np.float32))
            assert torch.equal(features.of_block(moved, g), cut)


def test_speech_grown_by_chunks_makes_the_files_bits(features, timeline):
    window, n = features.window, timeline.numel()
    whole = [features.of_block(timeline, g) for g in range(SpeechWindow.blocks_for_samples(n))]
    rng = np.random.default_rng(1)
    grown, got = torch.zeros(0), []
    while grown.numel() < n:  # 1 ms .. 3 s at a time; each block as soon as its need is there
        size = int(rng.integers(16, 48_001))
        grown = torch.cat([grown, timeline[grown.numel():grown.numel() + size].clone()])
        while len(got) < len(whole) and window.needed_samples(len(got)) <= grown.numel():
            got.append(features.of_block(grown, len(got)))
    assert 0 < len(got) < len(whole)  # the last blocks' lookahead lies past the speech
    got += [features.of_block(grown, g) for g in range(len(got), len(whole))]  # the speech ended
    assert all(torch.equal(a, b) for a, b in zip(got, whole))


def test_speech_past_the_end_is_silence(features, timeline):
    padded = torch.cat([timeline, torch.zeros(40_000)])
    for g in range(SpeechWindow.blocks_for_samples(timeline.numel()) + 2):
        assert torch.equal(features.of_block(timeline, g), features.of_block(padded, g)), g
    s0, s1 = features.window.samples_of_block(2)
    window = np.zeros(s1 - s0, dtype=np.float32)
    window[:] = timeline[s0:s1].numpy()
    assert torch.equal(features.of_window(window, 2), features.of_block(timeline, 2))
    with pytest.raises(ValueError, match="window"):
        features.of_window(window[:-1], 2)


def test_a_conv_stack_off_the_rule_is_refused(tiny_w2v):
    cfg = SimpleNamespace(conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_stride=(5, 2, 2, 2, 2, 2, 4))
    with pytest.raises(RuntimeError, match="assumes 400 every 320"):
        BlockFeatures(SimpleNamespace(model=SimpleNamespace(config=cfg)), SpeechWindow(), "cpu", torch.float32)
    with pytest.raises(RuntimeError, match="30"):
        BlockFeatures(SimpleNamespace(model=tiny_w2v.model, video_rate=25), SpeechWindow(), "cpu", torch.float32)


# ----- the distance from upstream's whole-file pass


def _within_speech(n: int, blocks: int) -> list[int]:
    """The video frames upstream gives features (not its zero padding past the speech)."""
    features = int(sw.conv_frames(n) / 50.0 * 30)
    return [i for i in range(12 * blocks) if sw.feature_index(i) < features]


def test_the_block_features_are_near_upstreams_whole_file_features(audio_wan, tiny_w2v, speech, timeline):
    ref, blocks = shell(audio_wan, tiny_w2v).encode_audio(speech, infer_frames=12)
    n = timeline.numel()
    frames = _within_speech(n, blocks)
    with torch.no_grad():  # upstream's hidden states of the whole file, on the absolute grid
        x = long_audio.load_input_values(tiny_w2v, speech)
        states = torch.cat(tiny_w2v.model(x, output_hidden_states=True).hidden_states)
    last = states.shape[1] - 1
    on_grid = torch.stack([states[:, min(j, last)] * (1 - w) + states[:, min(j + 1, last)] * w
                           for j, w in map(sw.frame_taps, frames)], -1)  # [layers, C, frames]
    # upstream's own grid: 30-fps feature k at k (N - 1) / (M - 1), not k 5 / 3
    stretch = last / (int(sw.conv_frames(n) / 50.0 * 30) - 1)
    stretched = []
    for i in frames:
        p = sw.feature_index(i) * stretch
        j, w = int(p), p - int(p)
        stretched.append(states[:, j] * (1 - w) + states[:, min(j + 1, last)] * w)
    upstream_grid = ref[0][..., frames]
    assert float((torch.stack(stretched, -1) - upstream_grid).abs().max() / upstream_grid.abs().max()) <= BOUND_GRID

    # the blocks whose (default) window lies inside the speech: the file's end is no edge for them
    inside = [k for k, i in enumerate(frames) if SpeechWindow().needed_samples(i // 12) <= n]
    assert len(inside) >= 8 * 12

    def distance(window):
        bf = BlockFeatures(tiny_w2v, window, torch.device("cpu"), torch.float32)
        got = torch.cat([bf.of_block(timeline, g) for g in range(blocks)], -1)[0][..., frames]
        upstream = float((got - ref[0][..., frames]).abs().max() / ref[0][..., frames].abs().max())
        own = float((got[..., inside] - on_grid[..., inside]).abs().max() / on_grid.abs().max())
        return upstream, own

    upstream, own = distance(SpeechWindow())
    assert upstream <= BOUND_UPSTREAM and own <= BOUND_WINDOW, (upstream, own)
    _, own_now = distance(SpeechWindow(lookahead_s=0.0, context_s=SpeechWindow().context_s))
    assert own_now > BOUND_WINDOW and own_now > 1.3 * own, (own_now, own)
