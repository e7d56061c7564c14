"""Benchmark for a run's serial start (issue #48): an earlier commit and this checkout side by
side in one invocation, on the compute preset of ``bench/bench_loop.py``.

The earlier commit (``--base``, default ``HEAD``) runs from a git worktree made for the bench
(removed at the end); this checkout runs as it is, uncommitted changes included. For each layout
(``1``, ``ulysses``, ``ulysses+cfg``: the layouts of bench_loop.py) and each side, one
``python -m wan_s2v_runner run ... --json`` on the same inputs and seed, and per run:

* **to step**: seconds from the command to rank 0 starting its first denoising step (its
  ``denoise`` stage in the run's events), the serial part a user waits through;
* **wall**: seconds from the command to its exit;
* **CPU**: CPU-seconds of the command and everything it started (``RUSAGE_CHILDREN``: the
  launcher, the agent, every rank; with ``--warm``, the forked agent's and its ranks' too, which
  the warm agent reaps);
* with ``--preview-clips N``, one more run per side (``ulysses+cfg --preview --num-clips N``):
  seconds to the first playable video so far (rank 0's ``preview`` event) and its share of the wall.

The table gives each side's ratios: to-step against the base side's, and a 2-rank layout's wall
and CPU against the same side's 1 rank. ``--repeat K`` runs K rounds (base then new, each layout)
and prints each cell's median.

    .venv/bin/python bench/bench_startup.py --markdown                  # compute preset, 4 steps
    .venv/bin/python bench/bench_startup.py --base 7a4caef --repeat 2 --preview-clips 3 --markdown
    .venv/bin/python bench/bench_startup.py --layouts none --preview-clips 3   # the preview rows alone
    .venv/bin/python bench/bench_startup.py --preset tiny --steps 1     # smoke test
    .venv/bin/python bench/bench_startup.py --warm --repeat 3 --markdown   # and with `wan-s2v warm`

Nothing else should run meanwhile: each rank has one torch thread, and a 2-rank layout wants both
cores of this machine (the footer records the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import LAYOUTS, PRESETS, ensure_assets, run_argv  # noqa: E402

DEFAULT_LAYOUTS = ("1", "ulysses", "ulysses+cfg")
PREVIEW_LAYOUT = "ulysses+cfg"
#: the launcher's warm agent setting (wan_s2v_runner/shared/warm_agent.py; an older base ignores it)
WARM_ENV = "WAN_S2V_WARM_AGENT"


def start_warm(work: Path) -> tuple[subprocess.Popen, Path]:
    """``wan-s2v warm`` of this checkout on its own socket, once it listens."""
    sock = work / "warm.sock"
    env = {**os.environ, WARM_ENV: "off"}
    proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "warm", "--socket", str(sock)], cwd=str(ROOT),
                            env=env, stdin=subprocess.DEVNULL, stdout=open(work / "warm.log", "wb"),
                            stderr=subprocess.STDOUT)
    t0 = time.time()
    while not sock.exists():
        if proc.poll() is not None or time.time() - t0 > 300:
            raise SystemExit(f"the warm agent did not start: {(work / 'warm.log').read_text(errors='replace')}")
        time.sleep(0.1)
    print(f"   warm agent ready in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    return proc, sock


def worktree(rev: str, where: Path) -> Path:
    """A detached worktree of ``rev`` under ``where`` (the caller removes it)."""
    path = where / f"base-{rev.replace('/', '_')}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def first_event_t(run_dir: Path, kind: str, stage: Optional[str] = None) -> Optional[float]:
    """The time of rank 0's first event of ``kind`` (and ``stage``) in the run's events."""
    try:
        lines = (run_dir / "events" / "rank0.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("kind") == kind and (stage is None or e.get("stage") == stage):
            return float(e["t"])
    return None


def reaped_cpu_s(pid: Optional[int]) -> float:
    """CPU-seconds of the children ``pid`` has reaped (``cutime + cstime``): a forked agent's and
    its ranks' are the warm agent's children's, not this process's."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def one(a, checkout: Path, side: str, layout: str, assets, work: Path, tag: str, preview: int = 0,
        warm: Optional[Path] = None, warm_pid: Optional[int] = None) -> dict:
    """One run of ``layout`` from ``checkout`` (its agent forked by the warm agent ``warm_pid`` at
    ``warm``, else spawned); its timings."""
    run_args = argparse.Namespace(**{**vars(a), "num_clips": preview or a.num_clips})
    argv = run_argv(run_args, layout, *assets, work, tag)
    argv[0] = str(Path(sys.executable))
    if preview:
        argv.append("--preview")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])),
           WARM_ENV: str(warm) if warm else "off"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    warm_before = reaped_cpu_s(warm_pid)
    t0 = time.time()
    with open(work / f"{tag}.stdout.txt", "w") as fo, open(work / f"{tag}.stderr.txt", "w") as fe:
        rc = subprocess.run(argv, cwd=str(checkout), env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                            timeout=a.timeout).returncode
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    time.sleep(0.2 if warm_pid else 0)  # the warm agent reaps the run's agent once the launcher has its code
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) + reaped_cpu_s(warm_pid) - warm_before
    runs = sorted((work / "runs" / tag).glob("*/"))
    row = {"side": side, "layout": layout, "preview": preview, "rc": rc, "wall_s": wall, "cpu_s": cpu}
    if rc != 0 or not runs:
        tail = (work / f"{tag}.stderr.txt").read_text(errors="replace").splitlines()[-15:]
        print(f"!! {side} {layout} failed (rc {rc}):\n" + "\n".join(tail), file=sys.stderr, flush=True)
        return row
    step_t = first_event_t(runs[-1], "stage", "denoise")
    row["to_step_s"] = step_t - t0 if step_t else None
    try:  # the DiT read while the encoders ran (rank 0's load report): how long, and how long waited for
        overlap = json.loads((runs[-1] / "run.json").read_text())["ranks"]["0"]["load"].get("dit_overlap")
    except (OSError, ValueError, KeyError):
        overlap = None
    if overlap:
        row["dit_read_s"], row["dit_wait_s"] = overlap["read_s"], overlap["waited_s"]
    if preview:
        shown = first_event_t(runs[-1], "preview")
        row["preview_s"] = shown - t0 if shown else None
    dit = (f", DiT read {row['dit_read_s']:.1f} s while encoding, {row['dit_wait_s']:.1f} s waited for"
           if "dit_read_s" in row else "")
    print(f"   {side} {layout}{' preview' if preview else ''}: to step {row.get('to_step_s') or 0:.1f} s, "
          f"wall {wall:.1f} s, CPU {cpu:.1f} s{dit}", file=sys.stderr, flush=True)
    return row


def median(rows: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if r.get(key) is not None and r.get("rc") == 0]
    return statistics.median(vals) if vals else None


def render(rows: list[dict], sides: list[str], layouts: list[str], markdown: bool) -> str:
    def cell(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    def ratio(x, y):
        return None if x is None or not y else x / y

    head = ["side", "layout", "to step s", "to step x base", "wall s", "wall x 1 rank", "CPU s", "CPU x 1 rank",
            "DiT read / waited s"]
    body = []
    for side in sides:
        ones = [r for r in rows if r["side"] == side and r["layout"] == "1" and not r["preview"]]
        wall1, cpu1 = median(ones, "wall_s"), median(ones, "cpu_s")
        for layout in layouts:
            mine = [r for r in rows if r["side"] == side and r["layout"] == layout and not r["preview"]]
            base = [r for r in rows if r["side"] == sides[0] and r["layout"] == layout and not r["preview"]]
            step, wall, cpu = median(mine, "to_step_s"), median(mine, "wall_s"), median(mine, "cpu_s")
            read, waited = median(mine, "dit_read_s"), median(mine, "dit_wait_s")
            body.append([side, layout, cell(step), cell(ratio(step, median(base, "to_step_s")), "{:.2f}x"),
                         cell(wall), cell(ratio(wall, wall1), "{:.2f}x") if layout != "1" else "",
                         cell(cpu), cell(ratio(cpu, cpu1), "{:.2f}x") if layout != "1" else "",
                         f"{read:.1f} / {waited:.1f}" if read is not None else "-"])
    previews = [r for r in rows if r["preview"]]
    if previews:
        for side in sides:
            mine = [r for r in previews if r["side"] == side]
            shown, wall = median(mine, "preview_s"), median(mine, "wall_s")
            body.append([side, f"{PREVIEW_LAYOUT} --preview, {mine[0]['preview']} clips" if mine else "",
                         f"first video {cell(shown)}", f"{cell(ratio(shown, wall), '{:.2f}')} of wall",
                         cell(wall), "", cell(median(mine, "cpu_s")), "", ""])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in [head, *body])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the earlier commit (run from a worktree)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="compute")
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma-separated, or none")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--num-clips", type=int, default=1)
    ap.add_argument("--preview-clips", type=int, default=0, help="also a --preview run of this many clips")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--infer-frames", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--warm", action="store_true", help="a third side: this checkout with a warm agent "
                    "(wan-s2v warm, started once before the rounds; the other sides spawn their agents)")
    a = ap.parse_args(argv)
    a.size, a.skip_preflight = PRESETS[a.preset]["size"], False
    layouts = [x for x in a.layouts.split(",") if x and x != "none"]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown} (one of {', '.join(LAYOUTS)})")
    if layouts and "1" not in layouts:
        layouts.insert(0, "1")
    assets = ensure_assets(a.cache, a.preset)
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        tmp_path = Path(tmp)
        base = worktree(a.base, tmp_path)
        warm_proc, sock = start_warm(tmp_path) if a.warm else (None, None)
        sides = [(f"base {a.base}", base, "base", None), ("new", ROOT, "new", None)]
        if a.warm:
            sides.append(("new, warm agent", ROOT, "warm", sock))
        try:
            for k in range(a.repeat):
                for side, checkout, short, warm in sides:
                    for layout in layouts:
                        tag = f"{short}-{layout.replace('+', '-')}-{k}"
                        rows.append(one(a, checkout, side, layout, assets, tmp_path, tag, warm=warm,
                                        warm_pid=warm_proc.pid if warm else None))
                    if a.preview_clips:
                        rows.append(one(a, checkout, side, PREVIEW_LAYOUT, assets, tmp_path, f"{short}-preview-{k}",
                                        preview=a.preview_clips, warm=warm,
                                        warm_pid=warm_proc.pid if warm else None))
        finally:
            if warm_proc is not None:
                warm_proc.terminate()
                warm_proc.wait()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(render(rows, [s[0] for s in sides], layouts, a.markdown))
    print(f"\npreset {a.preset}, {a.steps} steps, {a.num_clips} clip(s), {a.repeat} round(s), medians; "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"{os.cpu_count()} CPUs; command: bench/bench_startup.py {' '.join(argv or sys.argv[1:])}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
