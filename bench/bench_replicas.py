"""Benchmark for replicas (issue #39): a queue of jobs on ``wan-s2v serve --replicas 2`` (two rank
groups of 1 rank, each on its own core) against one group of 2 ranks, in the server's default
layout (Ulysses SP 2) and in the fastest 2-rank layout here (``--cfg-parallel``: CFG 2), side by
side in one invocation, on the compute-bound preset of ``bench/bench_loop.py`` (a
~410M-parameter DiT at 256x256, built once under ``--cache``).

Each server: ``--device cpu --nproc 2 --threads 1 --size 256*256 --infer-frames 8 --steps N``;
the jobs (``--jobs``, different seeds, 1 clip each) are submitted at once as paths once every
group is loaded. Printed per server: the total wall (first submission to last mp4 written; target
replicas <= 0.88x of one group) and each job's latency (submitted to its mp4 written), and whether
every job's mp4 is the same on both (it must be: a job's frames do not depend on the layout).

    .venv/bin/python bench/bench_replicas.py                 # 4 jobs, 2 steps, compute preset
    .venv/bin/python bench/bench_replicas.py --preset tiny   # smoke test (seconds)
    .venv/bin/python bench/bench_replicas.py --markdown      # the table for docs/bench.md
    .venv/bin/python bench/bench_replicas.py --device cuda --nproc 8 --replicas 4 --jobs 16 \
        --ckpt-dir ./Wan2.2-S2V-14B --size 1024*704                                   # a GPU node
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import PRESETS, ensure_assets, served  # noqa: E402


def servers(nproc: int, replicas: int) -> dict[str, list[str]]:
    """The servers compared: ``replicas`` groups, and one group of ``nproc`` ranks in the default
    layout (Ulysses) and with the CFG split."""
    per = nproc // replicas
    return {f"--replicas {replicas} x {per} rank{'s' if per > 1 else ''}": ["--replicas", str(replicas)],
            f"1 group x {nproc} ranks (Ulysses SP {nproc})": [],
            f"1 group x {nproc} ranks (CFG-parallel)": ["--cfg-parallel"]}


def _serve(name: str, flags: list[str], work: Path, jobs: int, image: Path, audio: Path) -> dict:
    d = work / name.split()[0].strip("-")
    log = work / f"{d.name}.log"
    with served([*flags, "--allow-dir", str(image.parent), "--allow-dir", str(audio.parent)], d, log, work) \
            as (proc, url):
        http = httpx.Client(base_url=url, timeout=60)
        deadline = time.time() + 600
        while {r["group"] for r in http.get("/health").json()["replicas"]} != {"idle"}:
            if proc.poll() is not None or time.time() > deadline:
                sys.exit(f"{name}: the groups did not load (see {log})")
            time.sleep(0.5)
        t0 = time.time()
        submitted = {}
        for i in range(jobs):
            r = http.post("/v1/videos", json={"image": str(image), "audio": str(audio), "seed": 100 + i,
                                              "num_clips": 1})
            r.raise_for_status()
            submitted[r.json()["id"]] = (time.time(), 100 + i)
        done: dict[str, dict] = {}
        while len(done) < jobs:
            for vid in submitted.keys() - done.keys():
                v = http.get(f"/v1/videos/{vid}").json()
                if v["status"] in ("completed", "failed", "cancelled"):
                    if v["status"] != "completed":
                        sys.exit(f"{name}: job {vid} {v['status']}: {v.get('error')}")
                    done[vid] = json.loads((d / "videos" / f"{vid}.json").read_text())
            time.sleep(0.5)
    last = max(rec["finished"] for rec in done.values())
    return {"wall": last - t0,
            "latency": sorted(rec["finished"] - submitted[vid][0] for vid, rec in done.items()),
            "sha": {submitted[vid][1]: rec["output"]["sha256"] for vid, rec in done.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="compute")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the node (default 2)")
    ap.add_argument("--replicas", type=int, default=2, help="groups of the replicated server (default 2)")
    ap.add_argument("--ckpt-dir", type=Path, help="another checkpoint (a real one on a GPU node) in place of the "
                                                  "preset's; the preset's image and speech stay")
    ap.add_argument("--size", help="the jobs' size (default: the preset's)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    ckpt, image, audio = ensure_assets(args.cache, args.preset)
    ckpt = args.ckpt_dir.expanduser().absolute() if args.ckpt_dir else ckpt
    work = Path(tempfile.mkdtemp(prefix="wan-s2v-bench-replicas-"))
    common = ["--device", args.device, "--nproc", str(args.nproc), "--threads", "1",
              "--size", args.size or PRESETS[args.preset]["size"],
              "--infer-frames", "8", "--steps", str(args.steps), "--prompt", "a person talking",
              "--ckpt-dir", str(ckpt)]
    out = {}
    for name, flags in servers(args.nproc, args.replicas).items():
        out[name] = _serve(name, [*common, *flags], work, args.jobs, image, audio)
        print(f"{name}: wall {out[name]['wall']:.1f} s", file=sys.stderr, flush=True)
    replicas, *wide = out.values()
    lines = ["| server | jobs | total wall s | replicas / this | job latency s (each, sorted) |",
             "|---|---|---|---|---|"]
    for name, r in out.items():
        lines.append(f"| {name} | {args.jobs} | {r['wall']:.1f} | {replicas['wall'] / r['wall']:.2f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['latency'])} |")
    print("\n".join(lines) if args.markdown else "\n".join(lines).replace("|", " "))
    same = all(r["sha"] == replicas["sha"] for r in wide)
    print(f"\nevery job's mp4 the same on every server: {'yes' if same else 'NO'}")
    for name, r in zip(list(out)[1:], wide):
        print(f"target: replicas <= 0.88x of one group's total wall ({name}): {replicas['wall'] / r['wall']:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
