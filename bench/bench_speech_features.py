"""Benchmark: block-wise streaming speech features vs upstream's whole-file pass, by lookahead and context.

For a synthetic speech (``--seconds``, default 20 s), each block's features by
``wan_s2v_runner.rank.speech_features.BlockFeatures`` (each block's own window of the speech:
``SpeechWindow(lookahead_s, context_s)``) are compared with upstream's
``WanS2V.encode_audio(path, infer_frames=12)`` (the whole file in one pass, sliced per block), on
the video frames upstream gives features for (its zero padding past the speech left out):

* ``upstream``: max |diff| / max |upstream| over every layer, and over the last layer alone;
* ``window``: the windows' own share: the same against upstream's whole-file hidden states
  interpolated on the absolute grid the blocks use (upstream's grid is stretched by the file's
  length: up to 2.7 wav2vec2 frames late at its end; "grid only" is that stretch alone), every
  layer, on the blocks whose window lies inside the speech (the file's end is an edge no live block
  has);
* seconds of wav2vec2 a block takes, against the whole-file pass's per block of speech.

Two encoders: the demo's tiny wav2vec2 (xlsr-53's layout, 32 wide) and wav2vec2-large-xlsr-53's
configuration with random weights (``bench_long_audio.xlsr53_config``); CPU, ``--threads`` torch
threads. Random weights are not the real model's features (they change far more from one frame to
the next, which the grid's stretch turns into distance); ``--ckpt`` runs a checkpoint's wav2vec2.

    .venv/bin/python bench/bench_speech_features.py                 # both, 20 s (~8 min on 1 thread)
    .venv/bin/python bench/bench_speech_features.py --models tiny   # seconds
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def build_encoder(wan, kind: str, tmp: Path, ckpt: Path | None):
    """Upstream's ``AudioEncoder`` holding the wav2vec2 of ``kind``."""
    from wan_s2v_runner.shared.ckpt_layout import WAV2VEC_DIR

    AudioEncoder = wan.modules.s2v.audio_encoder.AudioEncoder
    if kind == "tiny":
        from wan_s2v_runner.demo.tiny_checkpoint import _write_wav2vec
        _write_wav2vec(tmp, wan, seed=4, hidden=32)
        return AudioEncoder(model_id=str(tmp / WAV2VEC_DIR))
    if kind == "ckpt":
        return AudioEncoder(model_id=str(ckpt / WAV2VEC_DIR))
    from bench_long_audio import xlsr53_encoder
    return xlsr53_encoder(wan)


def measure(wan, enc, speech: str, lookaheads, contexts) -> dict:
    import torch

    from wan_s2v_runner.rank import long_audio
    from wan_s2v_runner.rank.speech_features import BlockFeatures, load_speech
    from wan_s2v_runner.shared import speech_windows as sw
    from wan_s2v_runner.shared.speech_windows import SpeechWindow

    cls = type("S2V", (), {"encode_audio": wan.speech2video.WanS2V.encode_audio})
    s2v = cls()
    s2v.audio_encoder, s2v.fps, s2v.audio_sample_m = enc, 16, 0
    s2v.device, s2v.param_dtype = torch.device("cpu"), torch.float32
    with torch.no_grad():
        t0 = time.perf_counter()
        ref, blocks = s2v.encode_audio(speech, infer_frames=12)
        whole_s = time.perf_counter() - t0
        x = long_audio.load_input_values(enc, speech)
        states = torch.cat(enc.model(x, output_hidden_states=True).hidden_states)
    timeline = load_speech(enc, speech)
    n = timeline.numel()
    count = int(sw.conv_frames(n) / 50.0 * 30)
    frames = [i for i in range(12 * blocks) if sw.feature_index(i) < count]  # upstream's, not its padding
    last = states.shape[1] - 1
    on_grid = torch.stack([states[:, min(j, last)] * (1 - w) + states[:, min(j + 1, last)] * w
                           for j, w in map(sw.frame_taps, frames)], -1)  # [layers, C, frames]
    up = ref[0][..., frames]

    def rel(got, want):
        return float((got - want).abs().max() / want.abs().max())

    def rms(got, want):
        return float((got - want).norm() / want.norm())

    out = {"blocks": blocks, "whole_s": whole_s, "grid_only": rel(on_grid, up),
           "grid_only_last": rel(on_grid[-1], up[-1]), "grid_only_rms": rms(on_grid, up), "rows": []}
    for la in lookaheads:
        for ctx in contexts:
            window = SpeechWindow(lookahead_s=la, context_s=ctx)
            bf = BlockFeatures(enc, window, torch.device("cpu"), torch.float32)
            t0 = time.perf_counter()
            got = torch.cat([bf.of_block(timeline, g) for g in range(blocks)], -1)[0][..., frames]
            per_block = (time.perf_counter() - t0) / blocks
            inside = [k for k, i in enumerate(frames) if window.needed_samples(i // 12) <= n]
            row = {"lookahead_s": la, "context_s": ctx, "lag_s": window.lookahead_samples / 16000,
                   "upstream": rel(got, up), "upstream_last": rel(got[-1], up[-1]),
                   "window": rel(got[..., inside], on_grid[..., inside]),
                   "window_last": rel(got[-1][..., inside], on_grid[-1][..., inside]),
                   "window_rms": rms(got[..., inside], on_grid[..., inside]),
                   "upstream_rms": rms(got, up),
                   "inside_blocks": len({frames[k] // 12 for k in inside}),
                   "s_per_block": per_block, "vs_whole": per_block / (whole_s / blocks)}
            out["rows"].append(row)
            print(f"  lookahead {la:g} s, context {ctx:g} s: {json.dumps(row)}", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--models", nargs="*", default=["tiny", "xlsr"], choices=["tiny", "xlsr", "ckpt"])
    ap.add_argument("--ckpt", type=Path, help="a checkpoint directory: its wav2vec2 (--models ckpt)")
    ap.add_argument("--lookahead", type=float, nargs="*", default=[0.0, 0.25, 0.5, 1.0])
    ap.add_argument("--context", type=float, nargs="*", default=[1.0, 2.0, 4.0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from patches import audio_load
    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio
    from wan_s2v_runner.loading.engine import import_wan

    wan = import_wan()
    audio_load.apply(wan)
    results = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        speech = str(make_speech_audio(Path(tmp) / "speech.wav", seconds=a.seconds, seed=3))
        for kind in a.models:
            print(f"{kind}: {a.seconds:g} s of speech, CPU, {a.threads} thread(s)", flush=True)
            enc = build_encoder(wan, kind, Path(tmp) / kind, a.ckpt)
            results[kind] = measure(wan, enc, speech, a.lookahead, a.context)
            del enc
    for kind, r in results.items():
        print(f"\n{kind} ({a.seconds:g} s, {r['blocks']} blocks; whole-file pass {r['whole_s']:.2f} s, "
              f"{r['whole_s'] / r['blocks']:.3f} s a block of speech; grid only: {r['grid_only']:.3f}, "
              f"last layer {r['grid_only_last']:.3f}, rms {r['grid_only_rms']:.3f})\n")
        print("| lookahead (s) | context (s) | lag (s) | vs upstream: all layers | last layer | rms "
              "| window's own: all layers | last layer | rms | s a block | vs whole-file |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
        for w in r["rows"]:
            print(f"| {w['lookahead_s']:g} | {w['context_s']:g} | {w['lag_s']:.2f} | {w['upstream']:.3f} "
                  f"| {w['upstream_last']:.3f} | {w['upstream_rms']:.3f} | {w['window']:.3f} "
                  f"| {w['window_last']:.3f} | {w['window_rms']:.3f} | {w['s_per_block']:.3f} "
                  f"| {w['vs_whole']:.1f}x |")
    print(f"\nbench took {time.perf_counter() - t_start:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
