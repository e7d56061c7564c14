"""Benchmark for a 32 GB machine's host memory (issue #73): rank 0's host peak of a 1-rank fp8 run
with the DiT streamed, as it ran before (the encoders held for the group's life, the DiT's host
copy in memory) against now (``--release-encoders``: T5 and wav2vec2 let go after they encode and
the DiT read after them; ``--dit-stream-from page-cache``: the DiT's bytes in a file the kernel
maps, its page cache), side by side in one invocation.

The checkpoint is the weight-heavy compute preset (a ~410M-parameter DiT) with a T5 in the real
model's proportion to the fp8 DiT (real: 11.4 GB of T5 beside 16 GB of fp8 DiT; here ~0.3 GB beside
~0.45 GB). Every process of the run is sampled from /proc every ``--interval`` s:

* **held**: RssAnon + RssShmem, the memory a process must hold (what the kernel cannot take back
  without swapping): the number the plan counts and the target (<= 0.60x) is about;
* **rss**: VmRSS, which also counts the mapped file pages resident now (the page cache the
  kernel may drop under pressure and read again).

The page-cache run goes twice: the first writes the DiT's cache file (once per checkpoint), the
second maps it (every later run). The frames of all runs must be equal (``--frames-out``).

    .venv/bin/python bench/bench_host_ram.py --markdown     # ~3 min on 2 cores
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import checkout_env, ensure_assets  # noqa: E402

from wan_s2v_runner.launcher.proctree import descendants, ppid_map  # noqa: E402

#: T5 sized to the real model's proportion to the fp8 DiT (see the docstring)
HEAVY_T5 = {"t5_layers": 6, "t5_dim_attn": 1024, "t5_dim_ffn": 2816, "t5_heads": 16}
MB = 2**20
#: name -> flags (beside the shared ones)
CONFIGS = {
    "before (encoders held, DiT in memory)": ["--dit-stream-from", "memory", "--no-release-encoders"],
    "now, first run (writes the DiT's cache file)": ["--dit-stream-from", "page-cache", "--release-encoders"],
    "now (encoders let go, DiT from the page cache)": ["--dit-stream-from", "page-cache", "--release-encoders"],
}


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class Peaks(threading.Thread):
    """The largest held (RssAnon + RssShmem) and VmRSS of any one descendant of ``root``."""

    def __init__(self, root: int, interval: float):
        super().__init__(daemon=True)
        self.root, self.interval, self.stop = root, interval, threading.Event()
        self.held = self.rss = self.file_at_held = 0

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in descendants([self.root], ppid_map()):
                try:
                    s = _status(pid)
                except (OSError, ValueError):
                    continue
                held = s.get("RssAnon", 0) + s.get("RssShmem", 0)
                if held > self.held:
                    self.held, self.file_at_held = held, s.get("RssFile", 0)
                self.rss = max(self.rss, s.get("VmRSS", 0))
            self.stop.wait(self.interval)


def run(name: str, flags: list[str], assets, work: Path, a) -> dict:
    ckpt, image, audio = assets
    d = work / str(abs(hash(name)))
    d.mkdir()
    cmd = [sys.executable, "-m", "wan_s2v_runner", "run", "--device", "cpu", "--nproc", "1", "--size", "256*256",
           "--steps", str(a.steps), "--num-clips", "1", "--infer-frames", "8", "--seed", "42", "--prompt", "a person",
           "--ckpt-dir", str(ckpt), "--image", str(image), "--audio", str(audio), "--dit-quant", "fp8",
           "--dit-offload", "blocks", "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
           "--runs-root", str(d / "runs"), *flags]
    env = checkout_env()
    env["WAN_S2V_DIT_CACHE_DIR"] = str(work / "dit-cache")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = Peaks(proc.pid, a.interval)
    peaks.start()
    out, _ = proc.communicate(timeout=a.timeout)
    wall = time.perf_counter() - t0
    peaks.stop.set()
    peaks.join()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{out[-3000:]}")
    loaded = {}
    for line in (next((d / "runs").glob("*")) / "events" / "rank0.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("kind") == "loaded":
            loaded = e
    return {"name": name, "held": peaks.held, "rss": peaks.rss, "file": peaks.file_at_held, "wall": wall,
            "frames": d / "f.pt", "stream": (loaded.get("strategy") or {}).get("dit_stream", ""),
            "encoders": (loaded.get("strategy") or {}).get("encoders", "held")}


def main(argv=None) -> int:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--interval", type=float, default=0.02)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    assets = ensure_assets(a.cache, "compute", HEAVY_T5)
    sizes = {f.name: f.stat().st_size for f in assets[0].iterdir() if f.is_file()}
    print(f"checkpoint {assets[0]}: " + ", ".join(f"{k} {v / MB:.0f} MB" for k, v in sorted(sizes.items())
                                                   if v > MB), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-host-ram-") as tmp:
        results = [run(name, flags, assets, Path(tmp), a) for name, flags in CONFIGS.items()]
        want = torch.load(results[0]["frames"])
        equal = all(torch.equal(torch.load(r["frames"]), want) for r in results)
    base = results[0]["held"]
    rows = [(r["name"], f"{r['held'] / MB:.0f}", f"{r['held'] / base:.2f}x", f"{r['rss'] / MB:.0f}",
             f"{r['file'] / MB:.0f}", f"{r['wall']:.1f}", r["encoders"]) for r in results]
    head = ("run (1 rank, fp8, streamed)", "held peak MB", "vs before", "VmRSS peak MB", "file pages at held peak MB",
            "wall s", "encoders")
    if a.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        for row in (head, *rows):
            print("  ".join(f"{c:>14}" if i else f"{c:<48}" for i, c in enumerate(row)))
    print(f"frames equal across the runs: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
