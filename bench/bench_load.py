"""Benchmark for loading (issue #9, lean loading): what each layout costs the host while the
ranks load the weights, at 1 and 2 ranks, side by side in one invocation.

For each layout it runs ``python -m wan_s2v_runner run`` (the compute preset of
``bench_loop.py``: a ~410M-parameter DiT, 1.6 GB in fp32; one short clip) and samples, every
``--interval`` seconds, every process of the run (launcher, torchrun, ranks) from /proc: RSS
(``status``), PSS (``smaps_rollup``), the resident pages of the checkpoint files each process has
mapped (``smaps``), and the bytes it read with read() (``io``: rchar). A rank's load window runs
from its ``load`` event to its first event of a non-load stage (``fingerprint`` and ``shard``
belong to loading), from the run's event files. Reported per layout:

* load s: the longest load window over the ranks;
* peak RSS per rank during load (max over ranks), and its ratio to the same mode at 1 rank;
* node peak PSS during load: the largest sum of PSS over all the run's processes at one sample
  inside any rank's load window, and its ratio to the same mode at 1 rank (PSS splits a shared
  page between the processes that map it, so a page cache shared by the ranks counts once);
* checkpoint bytes per rank (max over ranks), a lower bound: bytes read() during the load window
  plus the largest sampled resident size of mapped checkpoint files (safetensors are memory-mapped
  and unmapped once copied, so a sample can miss part of a mapping's life). An exact count needs
  the loader's own counter (issue #9's shard loader);
* whether the frames equal the 1-rank run's.

    .venv/bin/python bench/bench_load.py --markdown            # compute preset, every layout
    .venv/bin/python bench/bench_load.py --preset tiny --layouts ulysses@1,ulysses  # smoke test

Sampling costs a little CPU on the bench's own process (smaps of a few processes every
--interval); the ratios compare runs measured the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import PRESETS, checkout_env, ensure_assets  # noqa: E402

from wan_s2v_runner.launcher.proctree import descendants, ppid_map  # noqa: E402
from wan_s2v_runner.shared.layout import LoadStrategy, Mode  # noqa: E402

#: layout -> (nproc, mode, --load); "@1" = the same mode on one rank (the ratio's reference);
#: "full:" = upstream's loading (every rank reads whole files: the baseline lean loading is
#: measured against)
_MODES = tuple(m.value for m in Mode)
LAYOUTS = {}
for _load in LoadStrategy:
    _pre = "" if _load is LoadStrategy.LEAN else f"{_load.value}:"
    LAYOUTS.update({f"{_pre}{m}@1": (1, m, _load.value) for m in _MODES})
    LAYOUTS.update({f"{_pre}{m}": (2, m, _load.value) for m in _MODES})


# --------------------------------------------------------------------------- /proc sampling
def _kb(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def _rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


@dataclass
class Sample:
    t: float
    rss: dict[int, int] = field(default_factory=dict)  # pid -> bytes
    pss: dict[int, int] = field(default_factory=dict)
    ckpt_mapped: dict[int, int] = field(default_factory=dict)  # resident pages of checkpoint files
    rchar: dict[int, int] = field(default_factory=dict)


def sample(pids: list[int], ckpt: str) -> Sample:
    s = Sample(time.time())
    for pid in pids:
        try:
            s.rss[pid] = _kb(Path(f"/proc/{pid}/status").read_text(), "VmRSS:") * 1024
            s.pss[pid] = _kb(Path(f"/proc/{pid}/smaps_rollup").read_text(), "Pss:") * 1024
            s.rchar[pid] = _rchar(pid)
            mapped, inside = 0, False
            for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
                if line[:1] in "0123456789abcdef" and "-" in line.split(None, 1)[0]:  # a mapping's header
                    head = line.split(None, 5)
                    inside = len(head) == 6 and head[5].startswith(ckpt)
                elif inside and line.startswith("Rss:"):
                    mapped += int(line.split()[1]) * 1024
            s.ckpt_mapped[pid] = mapped
        except (OSError, ValueError):
            continue
    return s


class Sampler(threading.Thread):
    def __init__(self, root: int, ckpt: Path, interval: float):
        super().__init__(daemon=True)
        self.root, self.ckpt, self.interval = root, str(ckpt.resolve()), interval
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = sorted(descendants([self.root], ppid_map()) | {self.root})
            self.samples.append(sample(pids, self.ckpt))
            self.stop.wait(self.interval)


# --------------------------------------------------------------------------- one run
def loaded_bytes(run_dir: Path) -> dict[int, int]:
    """rank -> checkpoint bytes its loader read (the ``loaded`` event; lean loading counts them)."""
    out = {}
    for f in sorted((run_dir / "events").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("kind") == "loaded" and "bytes_read_total" in e:
                out[int(e["rank"])] = int(e["bytes_read_total"])
    return out


def load_windows(run_dir: Path) -> dict[int, tuple[int, float, float]]:
    """rank -> (pid, load start, load end) from the run's event files: from the ``load`` stage to
    the first stage that is not loading (the input encodes that follow are not loading)."""
    from wan_s2v_runner.shared.stages import Stage
    LOADING = {Stage.LOAD, Stage.FINGERPRINT, Stage.SHARD}

    out = {}
    for f in sorted((run_dir / "events").glob("*.jsonl")):
        pid, start, end = None, None, None
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("kind") == "hello":
                pid = e.get("pid")
            if e.get("kind") != "stage":
                continue
            st = Stage.lookup(e.get("stage"))
            if st is Stage.LOAD and start is None:
                start = e["t"]
            elif start is not None and end is None and st is not None and st not in LOADING:
                end = e["t"]
        if pid and start:
            out[int(f.stem.replace("rank", ""))] = (pid, start, end or time.time())
    return out


def measure(a, name: str, assets, work: Path) -> dict:
    nproc, mode, load = LAYOUTS[name]
    ckpt, image, audio = assets
    tag = name.replace("@", "-at-").replace(":", "-")
    argv = [sys.executable, "-m", "wan_s2v_runner", "run", "--ckpt-dir", str(ckpt), "--image", str(image),
            "--audio", str(audio), "--prompt", "a person talking", "--device", "cpu", "--threads", "1",
            "--size", PRESETS[a.preset]["size"], "--infer-frames", "4", "--num-clips", "1",
            "--steps", str(a.steps), "--seed", "42", "--nproc", str(nproc), "--mode", mode, "--load", load,
            "--output", str(work / f"{tag}.mp4"), "--frames-out", str(work / f"{tag}.pt"),
            "--runs-root", str(work / "runs" / tag)]
    env = checkout_env()
    print(f"== {name}: {' '.join(argv[3:])}", file=sys.stderr, flush=True)
    with open(work / f"{tag}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, ckpt, a.interval)
        sampler.start()
        rc = proc.wait(timeout=a.timeout)
        sampler.stop.set()
        sampler.join()
    runs = sorted((work / "runs" / tag).glob("*"))
    if rc != 0 or not runs:
        print((work / f"{tag}.log").read_text()[-3000:], file=sys.stderr)
        return {"name": name, "rc": rc}
    windows = load_windows(runs[-1])
    counted = loaded_bytes(runs[-1])
    samples = sampler.samples

    def inside(s: Sample, w) -> bool:
        return w[1] <= s.t <= w[2]

    rss, read = {}, {}
    for rank, w in windows.items():
        pid = w[0]
        mine = [s for s in samples if inside(s, w) and pid in s.rss]
        if not mine:
            continue
        rss[rank] = max(s.rss[pid] for s in mine)
        read[rank] = (
            counted.get(rank, 0)
            if any(counted.values())
            else (
                max(0, mine[-1].rchar.get(pid, 0) - mine[0].rchar.get(pid, 0))
                + max(s.ckpt_mapped.get(pid, 0) for s in mine)
            )
        )
    node = [sum(s.pss.values()) for s in samples if any(inside(s, w) for w in windows.values())]
    return {"name": name, "rc": rc, "nproc": nproc, "mode": mode, "load": load, "counted": any(counted.values()),
            "load_s": max(w[2] - w[1] for w in windows.values()),
            "rss_rank_max": max(rss.values(), default=None), "rss": rss,
            "node_pss_peak": max(node, default=None), "read_rank_max": max(read.values(), default=None),
            "read": read, "samples": len(samples), "frames": work / f"{tag}.pt"}


# --------------------------------------------------------------------------- table
def table(results: list[dict], markdown: bool) -> str:
    import torch

    gb = 2**30
    ok = [r for r in results if r.get("rc") == 0]
    ref = {(r["mode"], r["load"]): r for r in ok if r["nproc"] == 1}
    full = {(r["mode"], r["nproc"]): r for r in ok if r["load"] == LoadStrategy.FULL}
    frames = {r["name"]: torch.load(r["frames"]) for r in ok}
    # the frames a mode must give: its own 1-rank run with upstream's loading (else lean's)
    ref_frames = {
        m: frames[r["name"]] for (m, load), r in sorted(ref.items(), key=lambda kv: kv[0][1] == LoadStrategy.FULL)
    }
    head = ["layout", "load", "ranks", "load s", "vs full", "RSS/rank GB", "vs 1 rank", "node PSS GB",
            "vs 1 rank", "ckpt bytes/rank GB", "frames == full@1"]
    rows = []
    for r in results:
        if r.get("rc") != 0:
            rows.append([r["name"], "-", "-", "failed"] + ["-"] * 7)
            continue
        one, base = ref.get((r["mode"], r["load"])), full.get((r["mode"], r["nproc"]))
        want = ref_frames.get(r["mode"])
        same = "-" if want is None else ("yes" if torch.equal(frames[r["name"]], want) else "NO")

        def ratio(key, other):
            return f"{r[key] / other[key]:.2f}" if other and r.get(key) and other.get(key) else "-"  # noqa: B023

        read = f"{r['read_rank_max'] / gb:.3f}" + ("" if r["counted"] else " (>=)")
        rows.append([r["name"], r["load"], str(r["nproc"]), f"{r['load_s']:.1f}",
                     ratio("load_s", base) if r["load"] == LoadStrategy.LEAN else "-",
                     f"{r['rss_rank_max'] / gb:.2f}", ratio("rss_rank_max", one),
                     f"{r['node_pss_peak'] / gb:.2f}", ratio("node_pss_peak", one), read, same])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in [head] + rows]
    return "\n".join(lines)


def sampled_run_parser(description: str, layouts) -> argparse.ArgumentParser:
    """The flags of a bench that runs ``wan-s2v run`` per layout under the /proc sampler (this one,
    ``bench_fp8.py``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="compute", choices=sorted(PRESETS))
    p.add_argument("--layouts", default=",".join(layouts), help=f"comma list of {', '.join(layouts)}")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--interval", type=float, default=0.1, help="seconds between /proc samples")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    p.add_argument("--markdown", action="store_true")
    return p


def main(argv=None) -> int:
    p = sampled_run_parser(__doc__.split("\n\n")[0], LAYOUTS)
    a = p.parse_args(argv)
    names = [n for n in a.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    assets = ensure_assets(a.cache, a.preset)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="wan-s2v-bench-load-") as tmp:
        results = [measure(a, n, assets, Path(tmp)) for n in names]
        print(table(results, a.markdown))
    print(f"\npreset {a.preset}, {a.steps} step(s), /proc sampled every {a.interval:g} s; "
          f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0 if all(r.get("rc") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
