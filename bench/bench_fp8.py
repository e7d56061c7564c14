"""Benchmark for ``--dit-quant fp8`` (issue #47): memory, speed and distance from full precision,
full precision against fp8 side by side in one invocation, on the compute preset (a ~410M-parameter
DiT, 1.6 GB in fp32: the weight-heavy part of the run).

Two parts:

* **runs** (``python -m wan_s2v_runner run``, one clip, ``--steps`` steps): each layout with the
  DiT in full precision (fp32 on the CPU) and in fp8, every process sampled from /proc every
  ``--interval`` s (``bench_load``'s sampler): rank 0's peak RSS and the node's peak PSS over the
  whole run, the run's wall, and how far the fp8 frames are from the same layout's
  full-precision frames (max and mean absolute; frames in [-1, 1]);
* **one DiT pass** in this process, on the preset's real shapes with random inputs (the
  conditional pass of a step): seconds per pass, and the DiT output's max and mean absolute
  difference (and its mean magnitude, for scale).

    .venv/bin/python bench/bench_fp8.py --markdown               # ~12 min on 2 cores
    .venv/bin/python bench/bench_fp8.py --preset tiny --layouts 1  # smoke test
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_load import Sampler, load_windows, sampled_run_parser  # noqa: E402
from bench_loop import PRESETS, checkout_env, ensure_assets  # noqa: E402

#: layout -> (nproc, extra flags)
LAYOUTS = {"1": (1, ["--mode", "ulysses"]), "fsdp-fixed": (2, ["--mode", "fsdp-fixed"]),
           "ulysses+cfg": (2, ["--mode", "ulysses", "--cfg-parallel"])}
GB = 2**30


def run(a, layout: str, quant: str, assets, work: Path) -> dict:
    nproc, flags = LAYOUTS[layout]
    ckpt, image, audio = assets
    tag = f"{layout}-{quant}".replace("+", "-")
    argv = [sys.executable, "-m", "wan_s2v_runner", "run", "--ckpt-dir", str(ckpt), "--image", str(image),
            "--audio", str(audio), "--prompt", "a person talking", "--device", "cpu", "--threads", "1",
            "--size", PRESETS[a.preset]["size"], "--infer-frames", "4", "--num-clips", "1",
            "--steps", str(a.steps), "--seed", "42", "--nproc", str(nproc), *flags, "--dit-quant", quant,
            "--output", str(work / f"{tag}.mp4"), "--frames-out", str(work / f"{tag}.pt"),
            "--runs-root", str(work / "runs" / tag)]
    print(f"== {tag}: {' '.join(argv[3:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    with open(work / f"{tag}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=str(ROOT), env=checkout_env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, ckpt, a.interval)
        sampler.start()
        rc = proc.wait(timeout=a.timeout)
        sampler.stop.set()
        sampler.join()
    wall = time.time() - t0
    runs = sorted((work / "runs" / tag).glob("*"))
    if rc != 0 or not runs:
        print((work / f"{tag}.log").read_text()[-3000:], file=sys.stderr)
        return {"layout": layout, "quant": quant, "rc": rc}
    pids = {rank: w[0] for rank, w in load_windows(runs[-1]).items()}
    rank0 = max((s.rss.get(pids.get(0), 0) for s in sampler.samples), default=0)
    node = max((sum(s.pss.values()) for s in sampler.samples), default=0)
    return {"layout": layout, "quant": quant, "rc": rc, "wall": wall, "rank0_rss": rank0, "node_pss": node,
            "frames": work / f"{tag}.pt"}


def one_pass(a) -> list[dict]:
    """Seconds of one conditional DiT pass and its output, full precision and fp8, same inputs."""
    import copy

    import torch

    from patches import attention, context_cache
    from wan_s2v_runner.demo.random_weights import dit_kwargs, random_dit_inputs
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.loading.quantize import quantize_loaded
    from wan_s2v_runner.preflight.geometry import token_counts

    torch.set_num_threads(1)
    ckpt, _, _ = ensure_assets(a.cache, a.preset)
    wan = import_wan()
    attention.apply(wan, "sdpa")
    full = wan.modules.s2v.model_s2v.WanModel_S2V.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    full = full.eval().requires_grad_(False)
    fp8 = copy.deepcopy(full)
    quantize_loaded(fp8)  # the rule loading uses (loading.quantize), on weights in memory
    w, h = (int(x) for x in PRESETS[a.preset]["size"].split("*"))
    cfg = full.config
    motion = int(cfg.get("motion_frames", dit_kwargs(wan)["motion_frames"]))
    x, t, cond, _ = random_dit_inputs(int(cfg["audio_dim"]), motion, token_counts(h, w, 80), 80,
                                      torch.device("cpu"), torch.float32, False)
    out = []
    for name, model in (("full precision", full), ("fp8", fp8)):
        context_cache.apply(model)
        with torch.no_grad():
            model(x, t=t, **cond)  # warm-up
            t0 = time.perf_counter()
            y = model(x, t=t, **cond)
            out.append({"name": name, "s": time.perf_counter() - t0, "y": torch.stack(list(y))})
        print(f"one pass, {name}: {out[-1]['s']:.1f} s", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    p = sampled_run_parser(__doc__.split("\n\n")[0], LAYOUTS)
    p.add_argument("--no-pass", action="store_true", help="skip the in-process DiT pass")
    a = p.parse_args(argv)
    import torch

    assets = ensure_assets(a.cache, a.preset)
    load0 = os.getloadavg()[0]
    sep = " | " if a.markdown else "  "
    with tempfile.TemporaryDirectory(prefix="wan-s2v-bench-fp8-") as tmp:
        results = [run(a, lay, q, assets, Path(tmp)) for lay in a.layouts.split(",") if lay
                   for q in ("none", "fp8")]
        head = ["layout", "DiT", "wall s", "rank 0 peak RSS GB", "vs full", "node peak PSS GB", "vs full",
                "frames vs full: max", "mean"]
        print(("| " if a.markdown else "") + sep.join(head) + (" |" if a.markdown else ""))
        if a.markdown:
            print("|" + "---|" * len(head))
        full = {r["layout"]: r for r in results if r.get("rc") == 0 and r["quant"] == "none"}
        for r in results:
            if r.get("rc") != 0:
                row = [r["layout"], r["quant"], "failed"] + ["-"] * 6
            else:
                f = full.get(r["layout"])
                d = (torch.load(r["frames"]) - torch.load(f["frames"])).abs() if f else None
                row = [r["layout"], "fp32" if r["quant"] == "none" else "fp8", f"{r['wall']:.1f}",
                       f"{r['rank0_rss'] / GB:.2f}", f"{r['rank0_rss'] / f['rank0_rss']:.2f}" if f else "-",
                       f"{r['node_pss'] / GB:.2f}", f"{r['node_pss'] / f['node_pss']:.2f}" if f else "-",
                       f"{d.max():.2e}" if d is not None else "-", f"{d.mean():.2e}" if d is not None else "-"]
            print(("| " if a.markdown else "") + sep.join(row) + (" |" if a.markdown else ""))
    if not a.no_pass:
        passes = one_pass(a)
        d = (passes[1]["y"] - passes[0]["y"]).abs()
        print()
        head = ["one conditional DiT pass", "s", "vs full", "output vs full: max", "mean", "mean |output|"]
        print(("| " if a.markdown else "") + sep.join(head) + (" |" if a.markdown else ""))
        if a.markdown:
            print("|" + "---|" * len(head))
        for i, r in enumerate(passes):
            row = [r["name"], f"{r['s']:.2f}", f"{r['s'] / passes[0]['s']:.2f}",
                   f"{d.max():.2e}" if i else "-", f"{d.mean():.2e}" if i else "-", f"{r['y'].abs().mean():.3f}"]
            print(("| " if a.markdown else "") + sep.join(row) + (" |" if a.markdown else ""))
    print(f"\npreset {a.preset}, {a.steps} step(s), one thread per rank; load average {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    return 0 if all(r.get("rc") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
