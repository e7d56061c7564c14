"""Benchmark for the rank group that makes several videos from one load (issue #26): K jobs through
``wan-s2v batch`` against the same K jobs as separate ``wan-s2v run`` launches, side by side in one
invocation, on the compute-bound preset of ``bench/bench_loop.py`` (a ~410M-parameter DiT at
256x256, built once under ``--cache``).

The jobs differ in seed (and prompt); all use ``--device cpu --nproc 2 --threads 1 --size 256*256
--infer-frames 8 --num-clips 1 --steps N``. Printed:

* each separate run's wall seconds (launch to exit) and their sum, the batch's wall seconds, and
  the ratio batch / separate (target <= 0.80: no start-up, import or load per job);
* per batch job (its record, ``ID.json``): its wall seconds from being taken to its mp4 written,
  the sum of its own stage seconds, and their ratio (target <= 1.03 from the second job on:
  nothing runs between jobs but the jobs);
* each rank's peak RSS after each job (its ``job_done`` event) and the growth from job 1 to job K
  (target <= 5%: nothing accumulates from job to job);
* whether every batch job's frames equal its separate run's (``--frames-out``: exact).

    .venv/bin/python bench/bench_batch.py                      # 4 jobs, 2 steps, compute preset
    .venv/bin/python bench/bench_batch.py --preset tiny --steps 1   # smoke test (seconds)
    .venv/bin/python bench/bench_batch.py --markdown           # tables for docs/bench.md

Each rank runs one torch thread: the 2 ranks want 2 idle cores (nothing else running).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import PRESETS, checkout_env, ensure_assets  # noqa: E402


def _cli(args: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    env = checkout_env()
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "wan_s2v_runner", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL)
    return time.time() - t0, p


def _check(p: subprocess.CompletedProcess, what: str) -> None:
    if p.returncode != 0:
        sys.exit(f"{what} failed (exit {p.returncode}):\n" + "\n".join((p.stdout + p.stderr).splitlines()[-40:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="compute")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "wan-s2v" / "bench")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    ckpt, image, audio = ensure_assets(a.cache, a.preset)
    common = ["--ckpt-dir", str(ckpt), "--image", str(image), "--audio", str(audio), "--device", "cpu",
              "--nproc", "2", "--threads", "1", "--size", PRESETS[a.preset]["size"], "--infer-frames", "8",
              "--num-clips", "1", "--steps", str(a.steps)]
    jobs = [{"id": f"job{i + 1}", "seed": 100 + i, "prompt": f"person {i + 1} talking to the camera"}
            for i in range(a.jobs)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        work = Path(tmp)
        separate = []
        for job in jobs:
            d = work / "separate" / job["id"]
            d.mkdir(parents=True)
            secs, p = _cli(["run", *common, "--seed", str(job["seed"]), "--prompt", job["prompt"],
                            "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
                            "--runs-root", str(d / "runs")], d)
            _check(p, f"run {job['id']}")
            separate.append(secs)
            print(f"run {job['id']}: {secs:.1f} s", file=sys.stderr)
        b = work / "batch"
        b.mkdir()
        (b / "jobs.jsonl").write_text("".join(json.dumps({**job, "frames_out": str(b / f"{job['id']}.pt")}) + "\n"
                                              for job in jobs))
        batch_s, p = _cli(["batch", str(b / "jobs.jsonl"), *common, "--output-dir", str(b / "out"),
                           "--runs-root", str(b / "runs")], b)
        _check(p, "batch")
        print(f"batch: {batch_s:.1f} s", file=sys.stderr)
        import torch
        records = [json.loads((b / "out" / f"{job['id']}.json").read_text()) for job in jobs]
        exact = [torch.equal(torch.load(b / f"{job['id']}.pt"), torch.load(work / "separate" / job["id"] / "f.pt"))
                 for job in jobs]
        run_dir = next((b / "runs").iterdir())
        rss: dict[int, list[float]] = {}
        for f in sorted((run_dir / "events").glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                ev = json.loads(line)
                if ev.get("kind") == "job_done":
                    rss.setdefault(int(ev["rank"]), []).append(ev["host_peak_rss_mb"])
    load_after = os.getloadavg()[0]

    md = a.markdown
    sep = " | " if md else "  "

    def row(cells):
        return ("| " + sep.join(cells) + " |") if md else sep.join(f"{c:>14}" for c in cells)

    print(row(["", "wall s", "ratio"]))
    if md:
        print("|---|---|---|")
    print(row([f"{a.jobs} runs", f"{sum(separate):.1f}", "1.00"]))
    print(row(["batch", f"{batch_s:.1f}", f"{batch_s / sum(separate):.2f}"]))
    print()
    print(row(["job", "run s", "batch wall s", "stage sum s", "wall/stages", "frames equal"]))
    if md:
        print("|---|---|---|---|---|---|")
    for job, secs, rec, eq in zip(jobs, separate, records, exact):
        stages = sum(rec["stage_seconds"].values())
        print(row([job["id"], f"{secs:.1f}", f"{rec['wall_s']:.2f}", f"{stages:.2f}",
                   f"{rec['wall_s'] / stages:.3f}", "yes" if eq else "NO"]))
    print()
    print(row(["rank", *[f"RSS MB after job {i + 1}" for i in range(a.jobs)], "growth"]))
    if md:
        print("|" + "---|" * (a.jobs + 2))
    for r, values in sorted(rss.items()):
        print(row([str(r), *[f"{v:.0f}" for v in values], f"{(values[-1] / values[0] - 1) * 100:+.1f}%"]))
    print(f"\npreset {a.preset}, {a.jobs} jobs, {a.steps} steps; load average {load_before:.2f} before, "
          f"{load_after:.2f} after")
    return 0 if all(exact) else 1


if __name__ == "__main__":
    sys.exit(main())
