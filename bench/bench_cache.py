"""Benchmark for step caching (``--cache``, issue #58): the same run uncached and at a few
thresholds, side by side in one invocation, at 1 rank and 2 ranks (Ulysses), on the compute
preset of ``bench/bench_loop.py`` (random weights).

Per run: the steps computed and reused (run.json's ``step_cache``), the DiT passes computed
(2 a computed step: CFG), the wall from the command to its exit, the seconds in the denoise stage,
and the frames' distance from the uncached run of the same layout (max and mean absolute difference, in
[-1, 1] units, and PSNR). Random weights: the distance says nothing about how a trained model's
lips follow the speech; choose a threshold on real weights (docs/bench.md gives the published
figures for trained Wan models).

    .venv/bin/python bench/bench_cache.py --markdown                       # 20 steps, off/0.05/0.2, 1 and 2 ranks
    .venv/bin/python bench/bench_cache.py --thresholds 0.05 --layouts 1    # one threshold, 1 rank
    .venv/bin/python bench/bench_cache.py --preset tiny --steps 8          # smoke test (seconds)

Nothing else should run meanwhile (each rank has one torch thread; 2 ranks want both cores).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import LAYOUTS, PRESETS, ensure_assets, run_argv  # noqa: E402


def one(a, layout: str, cache: str, assets, work: Path) -> dict:
    tag = f"{layout}-{cache.replace(':', '_')}"
    argv = run_argv(a, layout, *assets, work, tag) + ["--cache", cache]
    t0 = time.time()
    r = subprocess.run(argv, cwd=str(ROOT), capture_output=True, text=True, timeout=a.timeout)
    wall = time.time() - t0
    if r.returncode != 0:
        print(f"!! {tag} failed (rc {r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr, flush=True)
        return {"layout": layout, "cache": cache, "rc": r.returncode}
    manifest = json.loads(r.stdout)
    sc = manifest.get("step_cache") or {}
    steps = a.steps * a.num_clips
    computed = sc.get("steps_computed", steps)
    row = {"layout": layout, "cache": cache, "rc": 0, "wall_s": wall, "frames": str(work / f"{tag}.pt"),
           "denoise_s": manifest["stage_seconds"].get("denoise"), "steps": steps, "computed": computed,
           "reused": sc.get("steps_reused", 0), "passes": 2 * computed,
           "reused_at": [c["reused"] for c in sc.get("clips", [])]}
    print(f"   {layout} --cache {cache}: {computed}/{steps} steps computed, wall {wall:.1f} s, "
          f"denoise {row['denoise_s']:.1f} s", file=sys.stderr, flush=True)
    return row


def distance(a_pt: str, b_pt: str) -> tuple[float, float, float]:
    import torch
    a, b = torch.load(a_pt), torch.load(b_pt)
    d = (a.double() - b.double()).abs()
    mse = float((d ** 2).mean())
    psnr = math.inf if mse == 0 else 10 * math.log10(4.0 / mse)  # frames in [-1, 1]: peak-to-peak 2
    return float(d.max()), float(d.mean()), psnr


def render(rows: list[dict], markdown: bool) -> str:
    head = ["layout", "cache", "steps computed", "DiT passes", "wall s", "wall x off", "denoise s",
            "max abs diff", "mean abs diff", "PSNR dB", "reused steps"]
    body = []
    for r in rows:
        if r.get("rc"):
            body.append([r["layout"], r["cache"], "failed"] + [""] * (len(head) - 3))
            continue
        off = next(o for o in rows if o["layout"] == r["layout"] and o["cache"] == "off" and not o.get("rc"))
        mx, mean, psnr = distance(r["frames"], off["frames"])
        body.append([r["layout"], r["cache"], f"{r['computed']}/{r['steps']}", str(r["passes"]),
                     f"{r['wall_s']:.1f}", f"{r['wall_s'] / off['wall_s']:.2f}x", f"{r['denoise_s']:.1f}",
                     f"{mx:.4f}", f"{mean:.5f}", "inf" if psnr == math.inf else f"{psnr:.1f}",
                     " ".join(",".join(map(str, c)) for c in r["reused_at"]) or "-"])
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in [head, *body])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="compute")
    ap.add_argument("--layouts", default="1,ulysses", help="comma-separated layouts of bench_loop.py")
    ap.add_argument("--thresholds", default="0.05,0.2", help="easycache thresholds, comma-separated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-clips", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--infer-frames", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--cache-dir", type=Path, default=Path("~/.cache/wan-s2v/bench"), dest="cache")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    a.size, a.skip_preflight = PRESETS[a.preset]["size"], False
    layouts = [x for x in a.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown} (one of {', '.join(LAYOUTS)})")
    caches = ["off"] + [f"easycache:{float(t)!r}" for t in a.thresholds.split(",") if t]
    assets = ensure_assets(a.cache, a.preset)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        rows = [one(a, layout, cache, assets, Path(tmp)) for layout in layouts for cache in caches]
        print(render(rows, a.markdown))
    print(f"\npreset {a.preset}, {a.steps} steps x {a.num_clips} clip(s), CFG on (2 passes a computed step), "
          f"{a.threads} thread(s) a rank; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
