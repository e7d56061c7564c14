"""Benchmark for issue #72 (item 4): long speech through wav2vec2, one pass vs windows.

wav2vec2 with wav2vec2-large-xlsr-53's configuration (24 layers, 1024 wide, 16 heads, the layer-norm
conv encoder; random weights, built from the config: nothing is downloaded), on the CPU, one torch
thread. Each case runs in a fresh process (its own peak RSS): the speech's features as upstream's
``AudioEncoder.extract_audio_feat(path, return_all_layers=True)`` computes them in one pass
("single"), and as ``wan_s2v_runner.rank.long_audio.extract_audio_feat`` does in windows
("windowed", the runner's window and overlap unless given). Printed: seconds, peak RSS and its
rise over the process before the encode (the model, the speech), per case, and the ratios side by
side; the single pass is measured at --single seconds of speech (O(T^2): 10 minutes would take ~26
minutes here) and extrapolated beyond from a fit of its measured points (time a*T + b*T^2, memory
linear); where the speech fits one window the windowed encode is that single pass itself. The
windowed features at the longest measured single-pass length are compared with the single pass's
(max |diff| / max |single|, per hidden state: worst, median, and the input state's).

The full run exceeds ten minutes on one thread: the windowed encode of ten minutes alone takes
~7.5 (about 0.75 s a second of speech); --quick measures 1.5 minutes of speech only.

    .venv/bin/python bench/bench_long_audio.py            # 1, 5, 10 min; single pass at 60 and 90 s (~15 min)
    .venv/bin/python bench/bench_long_audio.py --quick    # 1.5 min only (~4 min)
    .venv/bin/python bench/bench_long_audio.py --ckpt /path/to/Wan2.2-S2V-14B   # the real wav2vec2's weights
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GB = 1e9


def xlsr53_config():
    """wav2vec2-large-xlsr-53's shape (its config.json), dropout off."""
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(
        vocab_size=33, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        conv_dim=(512,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        conv_bias=True, feat_extract_norm="layer", do_stable_layer_norm=True, num_conv_pos_embeddings=128,
        num_conv_pos_embedding_groups=16, hidden_act="gelu", layer_norm_eps=1e-5,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)


def xlsr53_encoder(wan):
    """Upstream's ``AudioEncoder`` holding wav2vec2-large-xlsr-53's shape with random weights (seed 0)
    and its feature extractor's settings: its parts built here (no hub)."""
    import torch
    from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

    AudioEncoder = wan.modules.s2v.audio_encoder.AudioEncoder
    torch.manual_seed(0)
    enc = AudioEncoder.__new__(AudioEncoder)
    enc.model = Wav2Vec2ForCTC(xlsr53_config()).eval()
    enc.processor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                             do_normalize=True, return_attention_mask=True)
    enc.video_rate = 30
    return enc


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The process's peak RSS while the body runs (polled every 5 ms)."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def case(a) -> dict:
    """One measurement (in this process): prints its JSON line."""
    import torch

    torch.set_num_threads(1)
    from patches import audio_load
    from wan_s2v_runner.loading.engine import import_wan

    wan = import_wan()
    audio_load.apply(wan)  # 16 kHz wav read directly (librosa's first-load imports are not the subject)
    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio
    from wan_s2v_runner.rank import long_audio

    if a.ckpt:
        from wan_s2v_runner.shared.ckpt_layout import WAV2VEC_DIR
        enc = wan.modules.s2v.audio_encoder.AudioEncoder(model_id=str(a.ckpt / WAV2VEC_DIR))
    else:
        enc = xlsr53_encoder(wan)
    speech = make_speech_audio(Path(a.tmp) / f"speech-{a.seconds:g}.wav", seconds=a.seconds)
    windows = long_audio.Windows(round(a.window * 50), round(a.overlap * 50))
    before = _rss()
    with torch.no_grad(), PeakRss() as peak:
        t0 = time.perf_counter()
        if a.case == "single":
            z = enc.extract_audio_feat(str(speech), return_all_layers=True)
        else:
            z = long_audio.extract_audio_feat(enc, str(speech), windows)
        seconds = time.perf_counter() - t0
    out = {"case": a.case, "speech_s": a.seconds, "time_s": round(seconds, 2), "peak_gb": peak.peak / GB,
           "rise_gb": (peak.peak - before) / GB, "features_gb": z.numel() * 4 / GB,
           "windows": len(windows.spans(long_audio.conv_frames(enc.model.config, int(a.seconds * 16000))))}
    ref = Path(a.tmp) / f"single-{a.seconds:g}.pt"
    if a.case == "single" and a.save:
        torch.save(z.contiguous(), ref)
    if a.case == "windowed" and ref.exists():
        single = torch.load(ref)
        rel = [float((z[i] - single[i]).abs().max() / single[i].abs().max()) for i in range(z.shape[0])]
        out["rel_max"], out["rel_median"] = max(rel), sorted(rel)[len(rel) // 2]
        out["rel_state0"] = rel[0]
    print(json.dumps(out), flush=True)
    return out


def run_case(kind: str, seconds: float, a, tmp: str, save: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--case", kind, "--seconds", str(seconds), "--tmp", tmp,
           "--window", str(a.window), "--overlap", str(a.overlap)] + (["--save"] if save else []) \
        + (["--ckpt", str(a.ckpt)] if a.ckpt else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"{kind} {seconds} s failed ({p.returncode})")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"  {kind:8s} {seconds / 60:5.2f} min: {row['time_s']:7.1f} s, peak {row['peak_gb']:.2f} GB "
          f"(+{row['rise_gb']:.2f} GB)" + (f", {row['windows']} window(s)" if kind == "windowed" else ""), flush=True)
    return row


def fit_single(points: list[dict]):
    """time(T) = a*T + b*T^2 and rise(T) = c + d*T through the measured single passes (least squares)."""
    import numpy as np

    t = np.array([p["speech_s"] for p in points], float)
    a, b = np.linalg.lstsq(np.stack([t, t * t], 1), np.array([p["time_s"] for p in points]), rcond=None)[0]
    d, c = np.polyfit(t, [p["rise_gb"] for p in points], 1)
    return (lambda s: a * s + b * s * s), (lambda s: c + d * s)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the table at 1.5 minutes only (~4 minutes)")
    ap.add_argument("--minutes", type=float, nargs="*", help="speech lengths for the table (default 1 5 10)")
    ap.add_argument("--single", type=float, nargs="*", default=[60.0, 90.0],
                    help="seconds of speech the single pass is measured at (the rest extrapolated); the "
                         "windowed features are compared with the single pass at the longest")
    ap.add_argument("--window", type=float, default=None, help="window seconds (default: the runner's)")
    ap.add_argument("--overlap", type=float, default=None, help="overlap seconds each side (default: the runner's)")
    ap.add_argument("--ckpt", type=Path, help="a checkpoint directory: its wav2vec2 instead of random weights")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--case", choices=["single", "windowed"], help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from wan_s2v_runner.shared import encoder_placement as ep

    a.window = ep.WINDOW_S if a.window is None else a.window
    a.overlap = ep.OVERLAP_S if a.overlap is None else a.overlap
    if a.case:
        return case(a)
    minutes = a.minutes or ([1.5] if a.quick else [1.0, 5.0, 10.0])
    longest = max(a.single)
    print(f"wav2vec2-large-xlsr-53 config, {'weights of ' + str(a.ckpt) if a.ckpt else 'random weights'}, CPU, "
          f"1 thread; window {a.window:g} s, overlap {a.overlap:g} s each side", flush=True)
    t_start = time.perf_counter()

    def one_window(seconds: float) -> bool:
        return ep.speech_frames(seconds) <= round(a.window * 50)

    with tempfile.TemporaryDirectory() as tmp:
        singles = [run_case("single", s, a, tmp, save=s == longest) for s in sorted(a.single)]
        measured = {p["speech_s"]: p for p in singles}
        windowed = {}
        for s in sorted({m * 60 for m in minutes} | {longest}):
            if one_window(s) and s in measured:  # one window: the single pass itself (the same call)
                windowed[s] = dict(measured[s], case="windowed")
            else:
                windowed[s] = run_case("windowed", s, a, tmp)
    time_at, rise_at = fit_single(singles)
    rows = []
    print("\n| speech | single pass: time | peak RSS rise | windowed: time | peak RSS rise | windows "
          "| time single/windowed | memory single/windowed |\n|---|---|---|---|---|---|---|---|")
    for m in minutes:
        s, w = m * 60, windowed[m * 60]
        got = measured.get(s)
        st, sr = (got["time_s"], got["rise_gb"]) if got else (time_at(s), rise_at(s))
        mark = "" if got else "~"
        rows.append({"minutes": m, "single_time_s": st, "single_rise_gb": sr, "single_measured": bool(got),
                     "windowed_time_s": w["time_s"], "windowed_rise_gb": w["rise_gb"], "windowed_peak_gb": w["peak_gb"],
                     "windows": w["windows"], "features_gb": w["features_gb"]})
        print(f"| {m:g} min | {mark}{st:.1f} s | {mark}{sr:.2f} GB | {w['time_s']:.1f} s | {w['rise_gb']:.2f} GB "
              f"| {w['windows']} | {mark}{st / w['time_s']:.2f}x | {mark}{sr / max(w['rise_gb'], 1e-9):.2f}x |")
    print(f"\n~: extrapolated from the single pass measured at {', '.join(f'{s:g}' for s in sorted(a.single))} s "
          f"(time a*T + b*T^2, memory linear). Peak RSS rise: over the process before the encode (the model: "
          f"{singles[0]['peak_gb'] - singles[0]['rise_gb']:.2f} GB RSS). One window: the single pass itself.")
    far = windowed[longest]
    if "rel_max" in far:
        print(f"windowed vs single at {longest:g} s ({far['windows']} windows): max |diff| / max |single| per "
              f"hidden state (after the interpolation to 30 fps): worst {far['rel_max']:.2e}, median "
              f"{far['rel_median']:.2e}, the input state (before attention) {far['rel_state0']:.2e}")
    print(f"bench took {time.perf_counter() - t_start:.0f} s")
    out = {"window_s": a.window, "overlap_s": a.overlap, "singles": singles, "rows": rows,
           "distance": {k: far.get(k) for k in ("speech_s", "windows", "rel_max", "rel_median", "rel_state0")}}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
