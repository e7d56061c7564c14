"""Benchmark (issue #80): does a served live group overlap its blocks as ``wan-s2v run`` does?

The same live job (``--mode live --nproc N``, the same checkpoint, image, speech and seed) made
twice in one run of this script, side by side:

    run      ``wan-s2v run``: the job's blocks pipelined over the ranks
    served   ``wan-s2v serve`` with the same group flags, the job submitted over HTTP once the
             group is up (its second job, so that the group's start is not in it)

Each row: the job's ``live`` figures from its record (``run.json`` / the served job's record:
``fps``, frames per second once the first block is out, and ``first_frame_s``), and the wall of
the job's denoise and decode stages. Before issue #80 a served live group checked the stop
collectively at each block, so its ranks moved block by block together (no overlap across blocks);
since, the stop travels with the blocks (``rank/step_control.py``) and the served pace should be the
run's. ``--tree PATH`` runs another checkout's code (its ``wan_s2v_runner`` first on the path),
e.g. the commit before the change, for the before column.

    .venv/bin/python bench/bench_live_served.py --preset compute --size 128*128 --seconds 4 --nproc 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TOKEN = "bench-token"


def _env(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("WAN_S2V_WARM_AGENT", None)
    return env


def run_job(tree: Path, flags: list[str], work: Path) -> dict:
    """``wan-s2v run``: the job's live figures and stage seconds from its run.json."""
    out = work / "run"
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "wan_s2v_runner", "run", *flags, "--output", str(out / "o.mp4"),
                        "--runs-root", str(out / "runs")], cwd=out, env=_env(tree), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    manifest = json.loads(next((out / "runs").glob("*/run.json")).read_text())
    return {"live": manifest.get("live") or {}, "wall_s": round(time.perf_counter() - t0, 1),
            "stage_seconds": manifest.get("stage_seconds") or {}}


def served_job(tree: Path, flags: list[str], image: Path, audio: Path, seed: int, work: Path) -> dict:
    """``wan-s2v serve``: a first job (the group's start), then the measured one; its record."""
    import httpx

    d = work / "served"
    d.mkdir(parents=True)
    group_flags = [f for i, f in enumerate(flags) if f not in ("--image", "--audio", "--seed", "--prompt")
                   and (i == 0 or flags[i - 1] not in ("--image", "--audio", "--seed", "--prompt"))]
    log = open(d / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "serve", *group_flags, "--token", TOKEN,
                             "--allow-dir", str(image.parent), "--allow-dir", str(audio.parent),
                             "--server-dir", str(d / "srv"), "--port", "0"], cwd=d, env=_env(tree),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        while not (d / "srv" / "server.json").is_file():
            if proc.poll() is not None:
                raise SystemExit(f"the server ended:\n{(d / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)
        url = json.loads((d / "srv" / "server.json").read_text())["url"]
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        record = None
        for _ in range(2):
            vid = http.post("/v1/videos", data={"image": str(image), "audio": str(audio), "seed": str(seed),
                                                "prompt": "a person talking"}).json()["id"]
            while (v := http.get(f"/v1/videos/{vid}").json())["status"] not in ("completed", "failed", "cancelled"):
                time.sleep(0.2)
            if v["status"] != "completed":
                raise SystemExit(f"the served job ended {v['status']}: {v.get('error')}")
            record = v
        # the measured job's live figures: rank 0's last live event (the API's object has no "live")
        group = Path(json.loads((d / "srv" / "group.json").read_text())["run_dir"])
        events = [json.loads(x) for x in (group / "events" / "rank0.jsonl").read_text().splitlines() if x.strip()]
        live = [e for e in events if e.get("kind") == "live"][-1]
        return {"live": live, "wall_s": None, "stage_seconds": record.get("stage_seconds") or {}}
    finally:
        proc.terminate()
        proc.wait(120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=("tiny", "compute"))
    ap.add_argument("--size", default="128*128")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--cache", default="~/.cache/wan-s2v/bench")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    a = ap.parse_args(argv)

    from bench_loop import live_inputs

    ckpt, work, image, audio = live_inputs(a.cache, a.preset, a.size, a.seconds, "bench_live_served_")
    flags = ["--mode", "live", "--nproc", str(a.nproc), "--device", "cpu", "--size", a.size, "--ckpt-dir", str(ckpt),
             "--image", str(image), "--audio", str(audio), "--seed", "42", "--prompt", "a person talking"]
    rows = {"run": run_job(a.tree, flags, work), "served": served_job(a.tree, flags, image, audio, 42, work)}
    print(f"tree {a.tree} ({subprocess.run(['git', '-C', str(a.tree), 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}), "  # noqa: E501
          f"--preset {a.preset} --size {a.size} --seconds {a.seconds} --nproc {a.nproc}")
    print("| job | blocks | frames/s after the first block | first frame (s) | denoise + decode (s) |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        live, st = row["live"], row["stage_seconds"]
        busy = round(sum(st.get(k, 0.0) for k in ("denoise", "decode")), 1)
        print(f"| {name} | {live.get('blocks')} | {live.get('fps')} | {live.get('first_frame_s')} | {busy} |")
    fps = [rows[k]["live"].get("fps") for k in ("run", "served")]
    if all(fps):
        print(f"served / run frames per second: {fps[1] / fps[0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
