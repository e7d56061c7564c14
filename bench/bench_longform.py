"""Benchmark for long videos (issue #72): a short and a long ``wan-s2v run`` side by side in one
invocation, on the demo's tiny checkpoint (its VAE is the real architecture: decoding and the
motion re-encode cost what the frames' size makes them cost) with synthetic speech as long as the
long run needs.

Every run: ``--device cpu --nproc 1 --threads 1 --size 512*512 --infer-frames 8 --steps 2
--seed 7``, ``--num-clips`` SHORT (default 4) or LONG (default 24): one rank on one core, the
other core free (as on a GPU machine, where the ranks' work is the GPU's and the video writer's is
the CPU's). ``--base SHA`` runs the same pair on another commit too (a git worktree of it, this
venv), e.g. the commit before the streaming writer. Printed, per code version:

* rank 0's host peak (its ``end`` event: peak RSS) of the short and the long run, the growth, and
  the growth as a share of the extra clips' float32 frames (target: <= 5%);
* seconds per clip: the median time between consecutive clip checkpoints of rank 0, the first
  clip and the last left out (the first decodes fewer frames, the last makes no motion re-encode:
  they are not what a longer video has more of), of each, and long / short (target: <= 1.05);
* disk per clip: the most the run directory and the video beside the output held at once (sampled
  every 0.05 s); what each extra clip of the long run added to it, against what it added to the
  final mp4 (target: <= 2x; the constant part, the events and the carried state, is not per clip);
* time to the first playable second: launch to the first ``preview`` event with a second or more
  of video (the base's preview: the same event, with ``--preview``).

    .venv/bin/python bench/bench_longform.py                          # 4 vs 24 clips at 512x512
    .venv/bin/python bench/bench_longform.py --base aad7014 --markdown
    .venv/bin/python bench/bench_longform.py --short 2 --long 4 --size '128*128'   # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import ensure_assets  # noqa: E402

FPS, SAMPLE_RATE = 16, 16000


def speech(path: Path, seconds: float) -> Path:
    """A voiced-like tone (a pitch track with syllable-rate loudness) of ``seconds``."""
    import soundfile as sf

    t = np.arange(int(SAMPLE_RATE * seconds)) / SAMPLE_RATE
    pitch = 150 + 30 * np.sin(2 * np.pi * 0.7 * t)
    x = 0.3 * np.sin(2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE) * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t))
    sf.write(path, x.astype(np.float32), SAMPLE_RATE)
    return path


def reference(path: Path, w: int, h: int) -> Path:
    """A reference image of ``w`` x ``h`` (the run's size is at most the image's)."""
    from PIL import Image

    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)), ((xx + yy) * 127 // max(1, w + h))], -1)
    Image.fromarray(rgb.astype(np.uint8)).save(path)
    return path


def _du(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            for f in p.rglob("*"):
                try:
                    if f.is_file():
                        total += f.stat().st_size
                except OSError:
                    pass
    return total


def one(code: Path, clips: int, a, assets, audio: Path, work: Path) -> dict:
    ckpt, image = assets
    d = work / f"{code.name}-{clips}"
    d.mkdir(parents=True, exist_ok=True)
    out, runs = d / "o.mp4", d / "runs"
    env = {**os.environ, "PYTHONPATH": str(code), "WAN_S2V_WARM_AGENT": "off"}
    args = [sys.executable, "-m", "wan_s2v_runner", "run", "--device", "cpu", "--nproc", "1", "--threads", "1",
            "--ckpt-dir", str(ckpt), "--image", str(image), "--audio", str(audio), "--size", a.size,
            "--infer-frames", str(a.infer_frames), "--steps", str(a.steps), "--seed", "7", "--num-clips", str(clips),
            "--prompt", "a person talking", "--preview", "--output", str(out), "--runs-root", str(runs)]
    peak_disk, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.05):
            held = [runs, d / "o.partial.mp4", out] + list(d.glob(".o.*"))
            peak_disk[0] = max(peak_disk[0], _du(held))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.time()
    p = subprocess.run(args, cwd=d, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    stop.set()
    th.join()
    if p.returncode != 0:
        sys.exit(f"{code.name} {clips} clips failed (exit {p.returncode}):\n" + "\n".join(
            (p.stdout + p.stderr).splitlines()[-30:]))
    (run_dir,) = list(runs.iterdir())
    events = [json.loads(x) for x in (run_dir / "events" / "rank0.jsonl").read_text().splitlines()]
    marks = [e["t"] for e in events if e["kind"] == "stage" and e.get("stage") == "clip_checkpoint"]
    end = next(e for e in events if e["kind"] == "end")
    playable = next((e["t"] - t0 for e in events if e["kind"] == "preview" and e.get("seconds", 0) >= 1.0), None)
    steady = [b - a for a, b in zip(marks, marks[1:])][:-1]  # clips 2 .. N-1
    return {"clips": clips, "host_peak_mb": end["host_peak_rss_mb"], "s_per_clip": statistics.median(steady),
            "disk_peak": peak_disk[0], "mp4": out.stat().st_size,
            "first_playable_s": playable, "wall": time.time() - t0}


def checkout(sha: str, work: Path) -> Path:
    dest = work / f"base-{sha}"
    if not dest.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(dest), sha], check=True,
                       capture_output=True)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=24)
    ap.add_argument("--size", default="512*512")
    ap.add_argument("--infer-frames", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--base", help="also run the pair on this commit (a git worktree)")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    ap.add_argument("--work", type=Path)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    if a.short < 3:
        ap.error("--short must be 3 or more (seconds per clip leave out the first and the last clip)")
    work = (a.work or Path(tempfile.mkdtemp(prefix="wan-s2v-bench-longform-"))).absolute()
    work.mkdir(parents=True, exist_ok=True)
    ckpt, _, _ = ensure_assets(a.cache, "tiny")
    seconds = (a.long * a.infer_frames) / FPS + 2
    audio = speech(work / "speech.wav", seconds)
    w, h = (int(x) for x in a.size.split("*"))
    assets = (ckpt, reference(work / "reference.png", w, h))  # the size follows the image's
    extra_frames_bytes = (a.long - a.short) * a.infer_frames * 3 * w * h * 4
    codes = [("new", ROOT)] + ([(f"base {a.base}", checkout(a.base, work))] if a.base else [])
    print(f"work directory: {work}", file=sys.stderr, flush=True)
    rows = []
    for name, code in codes:
        short, long = one(code, a.short, a, assets, audio, work), one(code, a.long, a, assets, audio, work)
        grow = long["host_peak_mb"] - short["host_peak_mb"]
        extra = a.long - a.short
        disk = (long["disk_peak"] - short["disk_peak"]) / extra
        mp4 = (long["mp4"] - short["mp4"]) / extra
        rows.append((name, short, long, grow, grow * 2**20 / extra_frames_bytes, disk, mp4))
    head = ["code", "clips", "rank 0 host peak MB", "growth MB (share of extra float32 frames)", "s/clip",
            "long/short s/clip", "disk peak MB", "mp4 MB", "disk per extra clip / its mp4 share",
            "first playable second s"]
    lines = []
    for name, short, long, grow, share, disk, mp4 in rows:
        for r in (short, long):
            is_long = r is long
            lines.append([name, str(r["clips"]), f"{r['host_peak_mb']:.1f}",
                          f"{grow:+.1f} ({share:.1%})" if is_long else "",
                          f"{r['s_per_clip']:.2f}",
                          f"{long['s_per_clip'] / short['s_per_clip']:.3f}" if is_long else "",
                          f"{r['disk_peak'] / 2**20:.1f}", f"{r['mp4'] / 2**20:.2f}",
                          f"{disk / 1024:.0f} KB / {mp4 / 1024:.0f} KB = {disk / mp4:.2f}" if is_long else "",
                          f"{r['first_playable_s']:.1f}" if r["first_playable_s"] is not None else "-"])
    if a.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for ln in lines:
            print("| " + " | ".join(ln) + " |")
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *lines)]
        for ln in [head] + lines:
            print("  ".join(x.ljust(n) for x, n in zip(ln, widths)))
    print(f"\n{a.size}, {a.infer_frames}-frame clips, {a.steps} steps, 1 rank x 1 thread; extra clips' float32 "
          f"frames: {extra_frames_bytes / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
