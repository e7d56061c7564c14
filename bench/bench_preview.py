"""Benchmark for the video so far (issue #40): a 3-clip ``wan-s2v run`` with ``--preview`` against
the same run without it, alternating, side by side in one invocation, on the compute-bound preset
of ``bench/bench_loop.py`` (a ~410M-parameter DiT at 256x256, built once under ``--cache``) with
2 s of synthetic speech (3 clips of 8 frames need 21 frames: 1.3 s).

Every run: ``--device cpu --nproc 1 --threads 1 --size 256*256 --infer-frames 8 --num-clips 3
--steps N --seed 7``: one rank on one core, the other core free (as on a GPU machine, where the
ranks' work is the GPU's and the mux is the CPU's). Printed:

* each run's wall seconds (launch to exit) and, from rank 0's events, the job's own seconds
  (first event to its last), the median of each, and the ratio preview / plain (target <= 1.02:
  the partial muxes run off the ranks' path);
* time to first playable video: from launch to rank 0's first ``preview`` event (the partial mp4
  after clip 1 is in place), and its share of the run's wall (target <= 0.45);
* whether the final mp4s of both kinds are byte-identical (they must be).

    .venv/bin/python bench/bench_preview.py                 # 2 pairs, 2 steps, compute preset
    .venv/bin/python bench/bench_preview.py --preset tiny   # smoke test (seconds)
    .venv/bin/python bench/bench_preview.py --markdown      # the table for docs/bench.md
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import PRESETS, checkout_env, ensure_assets  # noqa: E402

SPEECH_SECONDS = 2.0


def _run(flags: list[str], cwd: Path, out: Path, preview: bool) -> dict:
    env = checkout_env()
    runs = cwd / "runs"
    before = set(runs.glob("*")) if runs.is_dir() else set()
    args = [sys.executable, "-m", "wan_s2v_runner", "run", *flags, "--output", str(out), "--runs-root", str(runs)]
    t0 = time.time()
    p = subprocess.run(args + (["--preview"] if preview else []), cwd=cwd, env=env, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"a run failed (exit {p.returncode}):\n" + "\n".join((p.stdout + p.stderr).splitlines()[-30:]))
    (run_dir,) = set(runs.glob("*")) - before
    events = [json.loads(line) for line in (run_dir / "events" / "rank0.jsonl").read_text().splitlines()]
    first_playable = next((e["t"] - t0 for e in events if e["kind"] == "preview"), None)
    from wan_s2v_runner.shared import media

    return {"wall": wall, "job": events[-1]["t"] - events[0]["t"], "first_playable": first_playable,
            "sha256": media.sha256_file(out), "clips": max((e.get("clips") or 0) for e in events)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="compute")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2, help="runs of each kind, alternating (default 2)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio

    ckpt, image, _ = ensure_assets(args.cache, args.preset)
    work = Path(tempfile.mkdtemp(prefix="wan-s2v-bench-preview-"))
    speech = make_speech_audio(work / "speech 2s.wav", seconds=SPEECH_SECONDS)
    flags = ["--device", "cpu", "--nproc", "1", "--threads", "1", "--size", PRESETS[args.preset]["size"],
             "--infer-frames", "8", "--num-clips", "3", "--steps", str(args.steps), "--seed", "7",
             "--prompt", "a person talking", "--ckpt-dir", str(ckpt), "--image", str(image), "--audio", str(speech)]
    rows: dict[str, list[dict]] = {"plain": [], "preview": []}
    for i in range(args.pairs):
        for kind in ("plain", "preview") if i % 2 == 0 else ("preview", "plain"):
            r = _run(flags, work, work / f"{kind}{i}.mp4", kind == "preview")
            rows[kind].append(r)
            print(f"{kind} #{i + 1}: wall {r['wall']:.1f} s, job {r['job']:.1f} s, first playable "
                  f"{r['first_playable'] if r['first_playable'] is None else round(r['first_playable'], 1)} s",
                  file=sys.stderr, flush=True)
    assert all(r["clips"] == 3 for rs in rows.values() for r in rs), "a run did not make 3 clips"
    same = len({r["sha256"] for rs in rows.values() for r in rs}) == 1
    med = {k: {m: statistics.median(r[m] for r in rs) for m in ("wall", "job")} for k, rs in rows.items()}
    playable = statistics.median(r["first_playable"] for r in rows["preview"])
    lines = ["| runs | wall s (median) | job s (median) | first playable s | first playable / wall |",
             "|---|---|---|---|---|",
             f"| plain x{args.pairs} | {med['plain']['wall']:.1f} | {med['plain']['job']:.1f} | - | - |",
             f"| --preview x{args.pairs} | {med['preview']['wall']:.1f} | {med['preview']['job']:.1f} | "
             f"{playable:.1f} | **{playable / med['preview']['wall']:.2f}** |",
             f"| preview / plain | **{med['preview']['wall'] / med['plain']['wall']:.3f}** | "
             f"{med['preview']['job'] / med['plain']['job']:.3f} | | |"]
    print("\n".join(lines) if args.markdown else "\n".join(lines).replace("|", " "))
    print(f"\nfinal mp4s byte-identical across every run: {'yes' if same else 'NO'}")
    print(f"targets: partial muxes <= 1.02x wall: {med['preview']['wall'] / med['plain']['wall']:.3f}; first playable "
          f"<= 0.45x wall: {playable / med['preview']['wall']:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
