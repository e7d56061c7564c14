"""Benchmark for the live mode (issue #74): frames per second and time to the first frame of the
live path (``--mode live``: 4 causal steps a 12-frame block) against the clip loop at the same
size and speech, in one process, one after another, on the same loaded model.

The rows:

    clip loop      upstream's recipe: 80-frame clips, 40 unipc steps, CFG 4.5 (2 DiT passes a step)
    clip 4-step    the clip loop at 4 steps without CFG (--steps 4 --guide-scale 1): the same DiT
                   passes a frame as live, over whole clips
    live           LiveAvatar's recipe: blocks of 12 frames, 4 steps, no CFG, per-step K/V caches

Each row: the video's frames, the seconds from the job's start (inputs encoded) to its end, frames
per second over that, the seconds until the first frames reached the sink (what a viewer waits),
and the frames per second after those (the pace once it streams; a one-clip video has none). The
tiny demo checkpoint by default (``--preset compute``: bench_loop's 410M-parameter DiT, where the
DiT's arithmetic dominates as on a GPU) at ``--size`` with ``--seconds`` of synthetic speech; one
torch thread.

    .venv/bin/python bench/bench_live.py                 # tiny, 128x128, 3 s of speech
    .venv/bin/python bench/bench_live.py --preset compute --size 128*128 --seconds 3 --markdown  # docs/live.md
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Sink:
    def __init__(self):
        self.t0, self.first, self.n = time.perf_counter(), None, 0

    def frames(self, clip, frames, num_clips):
        if self.first is None:
            self.first = time.perf_counter() - self.t0
            self.first_n = frames.shape[2]
        self.n += frames.shape[2]

    def clip_done(self, state, num_clips):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=("tiny", "compute"))
    ap.add_argument("--size", default="128*128")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--cache", default="~/.cache/wan-s2v/bench")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)

    from bench_loop import ensure_assets

    from wan_s2v_runner.demo.synthetic_inputs import make_reference_image, make_speech_audio
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.rank.block_pipeline import BlockPipeline
    from wan_s2v_runner.rank.clip_steps import ClipSteps
    from wan_s2v_runner.rank.job_shell import Hooks, JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import engine_config, request_for
    from wan_s2v_runner.shared.layout import Layout, Mode
    from wan_s2v_runner.shared.spec import RunSpec

    torch.set_num_threads(1)
    ckpt, _, _ = ensure_assets(Path(a.cache), a.preset)
    w, h = (int(v) for v in a.size.split("*"))
    tmp = Path(tempfile.mkdtemp(prefix="bench_live_"))
    image = make_reference_image(tmp / "ref.png", width=w, height=h, seed=0)
    audio = make_speech_audio(tmp / "speech.wav", seconds=a.seconds, seed=0)
    from patches import apply_for_run
    wan = import_wan()
    base = RunSpec(ckpt_dir=ckpt, image=image, audio=audio, prompt="a person talking", device="cpu",
                   max_area=w * h, seed=42)
    cfg = engine_config(wan, base)
    apply_for_run(wan, base, cfg.param_dtype)
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(ckpt), plan, torch.device("cpu"), 0, components.LoadSettings.of(base))
    rows = []
    for name, make, spec in (
            ("clip loop (40 steps, CFG)", ClipSteps, base),
            ("clip loop (4 steps, no CFG)", ClipSteps, base.model_copy(update={"steps": 4, "guide_scale": 1.0})),
            ("live (4 causal steps a block)", BlockPipeline, base)):
        sink = Sink()
        gen = JobShell(parts, plan, Hooks(sink=sink), driver=make)
        t0 = time.perf_counter()
        sink.t0 = t0
        gen.generate(request_for(spec))
        wall = time.perf_counter() - t0
        after = (sink.n - sink.first_n) / (wall - sink.first) if sink.n > sink.first_n else None
        rows.append((name, sink.n, wall, sink.n / wall, sink.first, after))
        print(f"{name}: {sink.n} frames in {wall:.1f} s", file=sys.stderr, flush=True)
    ref = rows[0][3]
    head = ["path", "frames", "seconds", "frames/s", "x clip loop", "first frames after (s)",
            "frames/s after the first"]
    body = [[n, str(f), f"{s:.1f}", f"{fps:.2f}", f"{fps / ref:.1f}x", f"{first:.1f}",
             f"{after:.2f}" if after is not None else "- (one clip)"] for n, f, s, fps, first, after in rows]
    if a.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in body:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head] + body:
            print("  ".join(c.ljust(30 if i == 0 else 12) for i, c in enumerate(r)))
    print(f"\n{a.preset} preset, {w}x{h}, {a.seconds:g} s of speech, CPU, 1 torch thread, fp32; "
          f"torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
