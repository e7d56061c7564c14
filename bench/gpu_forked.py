"""``wan-s2v warm`` on a GPU: a run's agent forked from the warm agent against one spawned, on CUDA.

On the CPU the suite proves a forked agent's ranks make one process's frames
(``tests/test_warm_agent.py``). What only a GPU can show: that nothing the warm agent imports
initialises CUDA before it forks (a forked agent whose CUDA was initialised would have to spawn
its ranks fresh, losing the preload; one whose driver was touched could not use the GPU at all),
and what the fork saves of the time from the command to the first denoising step there.

For each of ``--rounds`` rounds, one run spawned (``$WAN_S2V_WARM_AGENT=off``) and one forked,
``--device cuda --nproc 1`` on ``bench/bench_loop.py``'s ``compute`` preset; per run: the seconds
to rank 0's first ``denoise`` stage and to exit, how the agent started (``run.json``
``launcher.agent``), whether the agent had to spawn its ranks (its CUDA line), and whether the
frames (``--frames-out``) equal the first spawned run's, bit for bit.

    python bench/gpu_forked.py --rounds 3 --json out.json
    python bench/gpu_forked.py --device cpu --preset tiny --rounds 1    # smoke test, here
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_loop import PRESETS, ensure_assets, run_argv  # noqa: E402
from bench_startup import WARM_ENV, first_event_t, start_warm  # noqa: E402

SPAWNED_RANKS = "spawning the ranks fresh"  # the agent's line when CUDA was initialised before its fork


def one(a, assets, work: Path, tag: str, warm: Path | None) -> dict:
    args = argparse.Namespace(size=PRESETS[a.preset]["size"], infer_frames=a.infer_frames, num_clips=1, steps=a.steps,
                              seed=42, threads=a.threads, skip_preflight=False)
    argv = run_argv(args, "1", *assets, work, tag)
    argv[argv.index("--device") + 1] = a.device
    env = {**os.environ, WARM_ENV: str(warm) if warm else "off"}
    t0 = time.time()
    with open(work / f"{tag}.out", "w") as fo, open(work / f"{tag}.err", "w") as fe:
        rc = subprocess.run(argv, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                            timeout=a.timeout).returncode
    row: dict = {"tag": tag, "side": "forked" if warm else "spawned", "rc": rc, "wall_s": round(time.time() - t0, 2)}
    err = (work / f"{tag}.err").read_text(errors="replace")
    row["ranks_spawned_not_forked"] = SPAWNED_RANKS in err
    runs = sorted((work / "runs" / tag).glob("*/"))
    if runs:
        step = first_event_t(runs[-1], "stage", "denoise")
        row["to_step_s"] = round(step - t0, 2) if step else None
        try:
            row["agent"] = json.loads((runs[-1] / "run.json").read_text())["launcher"]["agent"]
        except (OSError, ValueError, KeyError):
            row["agent"] = None
    if rc:
        row["stderr_tail"] = err.splitlines()[-15:]
    print(json.dumps({k: v for k, v in row.items() if k != "stderr_tail"}), flush=True)
    if rc:
        print("\n".join(row["stderr_tail"]), file=sys.stderr, flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="compute", choices=sorted(PRESETS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--infer-frames", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    import torch

    assets = ensure_assets(a.cache, a.preset)
    work = Path(tempfile.mkdtemp(prefix="gpu-forked-"))
    warm_proc, sock = start_warm(work)
    rows = []
    try:
        for i in range(a.rounds):
            rows.append(one(a, assets, work, f"spawned{i}", None))
            rows.append(one(a, assets, work, f"forked{i}", sock))
    finally:
        warm_proc.terminate()
        warm_proc.wait(30)
    ref = work / "spawned0.pt"
    same = {}
    for r in rows:
        mine = work / f"{r['tag']}.pt"
        if r["rc"] == 0 and ref.is_file() and mine.is_file():
            x, y = torch.load(ref), torch.load(mine)
            same[r["tag"]] = r["frames_equal_spawned0"] = bool(torch.equal(x, y))
    summary = {}
    for side in ("spawned", "forked"):
        ok = [r for r in rows if r["side"] == side and r["rc"] == 0]
        steps = [r["to_step_s"] for r in ok if r.get("to_step_s")]
        summary[side] = {"runs": len(ok), "of": a.rounds, "to_step_median_s": statistics.median(steps or [0]),
                         "wall_median_s": statistics.median([r["wall_s"] for r in ok] or [0])}
    if summary["spawned"]["to_step_median_s"]:
        summary["forked_to_step_x_spawned"] = round(summary["forked"]["to_step_median_s"]
                                                    / summary["spawned"]["to_step_median_s"], 2)
    summary["frames_equal"] = same
    summary["every_forked_run_forked"] = all((r.get("agent") or {}).get("forked_from_warm_agent")
                                             for r in rows if r["side"] == "forked")
    summary["ranks_forked_everywhere"] = not any(r["ranks_spawned_not_forked"] for r in rows)
    summary["device"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(json.dumps(summary, indent=1))
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    good = (all(r["rc"] == 0 for r in rows) and all(same.values()) and summary["every_forked_run_forked"])
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
