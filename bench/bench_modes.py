"""Benchmark: each parallel mode side by side with one process, on the same spec, in one run.

Prints wall time, time in denoise, and peak host RSS per rank for every mode, and the ratios to
the 1-process run measured in the same invocation. Defaults use the tiny CPU checkpoint (so it
runs anywhere); pass --ckpt-dir/--image/--audio/--device cuda/--size for a real machine.

    python bench/bench_modes.py                       # CPU, tiny checkpoint, 2 ranks
    python bench/bench_modes.py --nproc 4 --device cuda --ckpt-dir /models/Wan2.2-S2V-14B \
        --image ref.png --audio speech.wav --size 1024*704 --steps 40
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wan_s2v_runner.launcher import launch  # noqa: E402
from wan_s2v_runner.launcher.console import Display  # noqa: E402
from wan_s2v_runner.shared.spec import RunSpec, parse_size  # noqa: E402


def one(spec: RunSpec) -> dict:
    code = launch.run(spec, observers=[Display(rich=False, show_logs=False)])
    runs = sorted(spec.runs_root.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    m = json.loads(runs[-1].read_text())
    if code != 0:
        raise SystemExit(f"{spec.mode.value} x{spec.nproc} failed ({code}): {m['exit']['reason']}")
    rss = [r["host_peak_rss_mb"] for r in m["ranks"].values()]
    gpu = [r["gpu_peak_allocated_mb"] for r in m["ranks"].values()]
    st = m["stage_seconds"]
    return {"mode": spec.mode.value, "nproc": spec.nproc, "wall_s": m["wall_s"],
            "denoise_s": st.get("denoise", 0.0), "load_s": st.get("load", 0.0),
            "max_rss_mb": max(rss), "sum_rss_mb": sum(rss),
            "max_gpu_mb": max(gpu) if all(g is not None for g in gpu) else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ckpt-dir", type=Path)
    ap.add_argument("--image", type=Path)
    ap.add_argument("--audio", type=Path)
    ap.add_argument("--size", default="64*64")
    ap.add_argument("--infer-frames", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", default="ulysses,fsdp-fixed,hybrid")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wan-s2v-bench-"))
    if a.ckpt_dir is None:
        from wan_s2v_runner.demo.assets import ensure_demo_assets
        assets = ensure_demo_assets(work / "demo")
        a.ckpt_dir, a.image, a.audio = assets.ckpt_dir, assets.image, assets.audio
    base = dict(ckpt_dir=a.ckpt_dir, image=a.image, audio=a.audio, prompt="a person talking",
                device=a.device, max_area=parse_size(a.size), infer_frames=a.infer_frames,
                steps=a.steps, seed=42, runs_root=work / "runs")
    rows = [one(RunSpec(**base, nproc=1, output=work / "ref.mp4"))]
    for mode in a.modes.split(","):
        rows.append(one(RunSpec(**base, nproc=a.nproc, mode=mode, output=work / f"{mode}.mp4")))
    ref = rows[0]
    for r in rows:
        r["wall_ratio"] = round(r["wall_s"] / ref["wall_s"], 3)
        r["denoise_ratio"] = round(r["denoise_s"] / ref["denoise_s"], 3) if ref["denoise_s"] else None
        r["max_rss_ratio"] = round(r["max_rss_mb"] / ref["max_rss_mb"], 3)
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    hdr = f"{'mode':<11}{'ranks':>6}{'wall s':>9}{'denoise s':>11}{'load s':>8}{'max RSS MB':>12}" \
          f"{'wall x':>8}{'denoise x':>10}{'RSS x':>7}"
    print(hdr)
    for r in rows:
        name = "1 process" if r is ref else r["mode"]
        print(
            f"{name:<11}{r['nproc']:>6}{r['wall_s']:>9.2f}{r['denoise_s']:>11.2f}{r['load_s']:>8.2f}"
            f"{r['max_rss_mb']:>12.1f}{r['wall_ratio']:>8.2f}"
            f"{(r['denoise_ratio'] or 0):>10.2f}{r['max_rss_ratio']:>7.2f}"
        )
    print(f"(ratios are to the 1-process run above, measured in this invocation; device={a.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
