"""Benchmark for ``--compile`` (issue #46): the DiT compiled against eager, side by side in one
invocation, on the compute-bound preset of ``bench/bench_loop.py`` (a ~410M-parameter DiT at 256x256).

For 1 and 2 ranks (Ulysses) it runs the same 3-job ``wan-s2v batch`` eager and with ``--compile``
(a fresh inductor cache: cold), then one more compiled job on that cache (warm). Printed:

* the steady DiT step (jobs 2 and 3: their ``denoise`` seconds per step, from the job records),
  eager and compiled, and the ratio (target at 1 rank: <= 0.80);
* the compile seconds (the ``compile`` stage) of job 1 cold, of the warm run, and of jobs 2-3
  (none: a group compiles each size once);
* the 3-job batch's wall seconds, eager and compiled, and the ratio;
* the compiled frames against eager's (max abs difference, fp32).

    .venv/bin/python bench/bench_compile.py               # compute preset, 1 and 2 ranks
    .venv/bin/python bench/bench_compile.py --preset tiny --nproc 1   # smoke test
    .venv/bin/python bench/bench_compile.py --markdown    # tables for docs/bench.md

Each rank runs one torch thread: the ranks want idle cores (nothing else running).
"""
from __future__ import annotations

import argparse
import json
import os
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

JOBS = 3


def _batch(common: list[str], work: Path, name: str, jobs: list[dict], extra: list[str], cache: Path) -> dict:
    d = work / name
    d.mkdir(parents=True)
    (d / "jobs.jsonl").write_text("".join(json.dumps({**j, "frames_out": str(d / f"{j['id']}.pt")}) + "\n"
                                          for j in jobs))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "wan_s2v_runner", "batch", str(d / "jobs.jsonl"), *common, *extra,
                        "--output-dir", str(d / "out"), "--runs-root", str(d / "runs")], cwd=d,
                       env=checkout_env({"TORCHINDUCTOR_CACHE_DIR": str(cache)}), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"{name} failed (exit {p.returncode}):\n" + "\n".join((p.stdout + p.stderr).splitlines()[-40:]))
    records = {j["id"]: json.loads((d / "out" / f"{j['id']}.json").read_text()) for j in jobs}
    print(f"{name}: {wall:.1f} s", file=sys.stderr)
    return {"wall": wall, "records": records, "dir": d}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="compute")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "wan-s2v" / "bench")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    import torch

    ckpt, image, audio = ensure_assets(a.cache, a.preset)
    jobs = [{"id": f"job{i + 1}", "seed": 100 + i, "prompt": f"person {i + 1} talking to the camera"}
            for i in range(JOBS)]
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        work = Path(tmp)
        for n in a.nproc:
            common = ["--ckpt-dir", str(ckpt), "--image", str(image), "--audio", str(audio), "--device", "cpu",
                      "--nproc", str(n), "--mode", "ulysses", "--threads", "1", "--size", PRESETS[a.preset]["size"],
                      "--infer-frames", "8", "--num-clips", "1", "--steps", str(a.steps)]
            cache = work / f"inductor-{n}"
            eager = _batch(common, work, f"eager-{n}", jobs, [], cache)
            cold = _batch(common, work, f"compiled-{n}", jobs, ["--compile"], cache)
            warm = _batch(common, work, f"warm-{n}", jobs[:1], ["--compile"], cache)

            def step(run, ids=("job2", "job3")):
                return statistics.mean(run["records"][i]["stage_seconds"]["denoise"] / a.steps for i in ids)

            def comp(run, i):
                return run["records"][i]["stage_seconds"].get("compile", 0.0)
            diff = max((torch.load(cold["dir"] / f"{j['id']}.pt") - torch.load(eager["dir"] / f"{j['id']}.pt"))
                       .abs().max().item() for j in jobs)
            rows.append({"nproc": n, "eager_step": step(eager), "compiled_step": step(cold),
                         "compile_cold": comp(cold, "job1"), "compile_warm": comp(warm, "job1"),
                         "compile_later": comp(cold, "job2") + comp(cold, "job3"),
                         "eager_wall": eager["wall"], "compiled_wall": cold["wall"], "diff": diff})
    load_after = os.getloadavg()[0]

    md = a.markdown

    def row(cells):
        return ("| " + " | ".join(cells) + " |") if md else "  ".join(f"{c:>14}" for c in cells)

    print(row(["ranks", "eager s/step", "compiled s/step", "ratio", "compile s cold", "warm cache",
               "jobs 2-3", f"{JOBS}-job batch eager s", "compiled s", "ratio", "frames max abs diff"]))
    if md:
        print("|" + "---|" * 11)
    for r in rows:
        print(row([str(r["nproc"]), f"{r['eager_step']:.2f}", f"{r['compiled_step']:.2f}",
                   f"{r['compiled_step'] / r['eager_step']:.2f}", f"{r['compile_cold']:.1f}",
                   f"{r['compile_warm']:.1f}", f"{r['compile_later']:.1f}", f"{r['eager_wall']:.1f}",
                   f"{r['compiled_wall']:.1f}", f"{r['compiled_wall'] / r['eager_wall']:.2f}", f"{r['diff']:.2g}"]))
    print(f"\npreset {a.preset}, {a.steps} steps, 1 clip, {JOBS} jobs per batch; load average {load_before:.2f} "
          f"before, {load_after:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
