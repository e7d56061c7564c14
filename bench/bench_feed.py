"""Benchmark for the server's API under a full queue and open status pages (issue #38, point 8):
how long a submission (``POST /v1/videos``, multipart with an image and a WAV, as the page and the
OpenAI SDK send it) takes to answer, in three conditions measured one after the other on one
server, in one invocation:

* ``empty``: one job in the queue, nobody following;
* ``10k jobs``: ``--jobs`` jobs in the queue (put straight into its SQLite file, as a burst of
  submissions would leave them), nobody following;
* ``10k jobs + followers``: the same, with ``--pages`` status-page feeds (``GET /v1/events``, the
  stream the page reads) and ``--followers`` job followers (``GET /v1/videos/{id}/events``) open,
  and the pages also polling ``GET /v1/server`` once a second as a page's form would not (a
  harsher client than the page).

Printed per condition: the API process's CPU share over 3 s with no submission (what the open
streams cost it), the submission latency p50 / p95 / max (ms, ``--submissions`` each, one
after the other), the feed's reads of the queue per second (one per tick, shared by every
stream), and the bytes a page received per second (only what changed reaches it).

The rank group is the test suite's stub (``tests/stub_rank.py``: a served group that never runs a
job): the subject is the API process, and a GPU rank group costs the API process nothing.

    .venv/bin/python bench/bench_feed.py             # 10,000 jobs, 5 pages, 5 followers, 40 submissions
    .venv/bin/python bench/bench_feed.py --markdown  # the table for docs/bench.md
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import served  # noqa: E402

STUB = {"WAN_S2V_RANK_WORKER": "tests.stub_rank"}
JOB_FLAGS = ["--device", "cpu", "--size", "64*64", "--infer-frames", "8", "--steps", "2", "--nproc", "1"]


class Follower:
    """One event stream on a thread, counting the bytes it receives."""

    def __init__(self, url: str, path: str):
        self.bytes = 0
        self.events = 0
        self.stop = False
        self.client = httpx.Client(base_url=url, timeout=None)
        self.thread = threading.Thread(target=self._read, args=(path,), daemon=True)
        self.thread.start()

    def _read(self, path: str) -> None:
        try:
            with self.client.stream("GET", path) as r:
                for chunk in r.iter_bytes():
                    self.bytes += len(chunk)
                    self.events += chunk.count(b"\n\n")
                    if self.stop:
                        return
        except httpx.HTTPError:
            return

    def close(self) -> None:
        self.stop = True
        self.client.close()


def _submit_times(http: httpx.Client, files: dict, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = http.post("/v1/videos", files=files, data={"prompt": f"bench {i}"})
        out.append((time.perf_counter() - t0) * 1000)
        if r.status_code != 200:
            sys.exit(f"a submission was refused: {r.status_code} {r.text}")
    return out


def _cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system, /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _row(name: str, ms: list[float], reads_per_s: float, page_bps: float, cpu: float) -> dict:
    q = statistics.quantiles(ms, n=20)
    return {"condition": name, "p50": statistics.median(ms), "p95": q[18], "max": max(ms),
            "reads_per_s": reads_per_s, "page_bps": page_bps, "cpu": cpu}


def _measure_all(args, proc, url: str, server_dir: Path, assets, followers: list) -> list[dict]:
    """The three conditions on the running server ``proc`` at ``url`` (``followers``: the streams
    it opens, for the caller to close)."""
    http = httpx.Client(base_url=url, timeout=60)
    files = {"image": ("face.png", assets.image.read_bytes(), "image/png"),
             "audio": ("voice.wav", assets.audio.read_bytes(), "audio/wav")}

    def measure(name: str) -> dict:
        time.sleep(2)  # the API process idle but for the followers: its CPU share
        reads0, bytes0 = http.get("/v1/server").json().get("feed_reads", 0), [f.bytes for f in followers]
        t0, cpu0 = time.time(), _cpu_s(proc.pid)
        time.sleep(3)
        cpu = (_cpu_s(proc.pid) - cpu0) / (time.time() - t0)
        ms = _submit_times(http, files, args.submissions)
        dt = time.time() - t0
        reads = (http.get("/v1/server").json().get("feed_reads", 0) - reads0) / dt
        pages = followers[:args.pages]
        page_bps = (statistics.mean(f.bytes - b for f, b in zip(pages, bytes0)) / dt) if pages else 0.0
        return _row(name, ms, reads, page_bps, cpu)

    _submit_times(http, files, 3)  # warm: the first submission imports what checks media
    rows = [measure("empty")]
    with sqlite3.connect(server_dir / "jobs.sqlite") as db:
        (spec,) = db.execute("SELECT spec FROM jobs LIMIT 1").fetchone()
        now = time.time()
        db.executemany("INSERT INTO jobs (id, status, spec, created_at) VALUES (?, 'queued', ?, ?)",
                       [(f"video_bench{i:06d}", spec, now + i * 1e-6) for i in range(args.jobs)])
    rows.append(measure(f"{args.jobs:,} jobs"))
    followers += [Follower(url, "/v1/events") for _ in range(args.pages)]
    step = max(1, args.jobs // max(1, args.followers))
    followers += [Follower(url, f"/v1/videos/video_bench{i * step:06d}/events") for i in range(args.followers)]
    deadline = time.time() + 60
    while not all(f.events for f in followers):
        if time.time() > deadline:
            sys.exit("the event streams did not start")
        time.sleep(0.1)
    stop_polling = threading.Event()

    def poll_server():  # each page also asks for the server now and then
        with httpx.Client(base_url=url, timeout=60) as c:
            while not stop_polling.wait(1.0 / max(1, args.pages)):
                c.get("/v1/server")

    threading.Thread(target=poll_server, daemon=True).start()
    info = http.get("/v1/server").json()
    rows.append(measure(f"{args.jobs:,} jobs + {args.pages} pages + {args.followers} followers"))
    stop_polling.set()
    rows[-1]["followers"] = info.get("followers")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--pages", type=int, default=5)
    ap.add_argument("--followers", type=int, default=5)
    ap.add_argument("--submissions", type=int, default=40)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    from wan_s2v_runner.demo.assets import ensure_demo_assets

    work = Path(tempfile.mkdtemp(prefix="wan-s2v-bench-feed-"))
    assets = ensure_demo_assets(work / "assets")
    server_dir = work / "server dir"
    flags = [*JOB_FLAGS, "--ckpt-dir", str(assets.ckpt_dir), "--max-queue", str(args.jobs + 10 * args.submissions)]
    followers: list[Follower] = []
    with served(flags, server_dir, work / "server.log", work, extra_env=STUB, start_s=120) as (proc, url):
        try:
            rows = _measure_all(args, proc, url, server_dir, assets, followers)
        finally:
            for f in followers:
                f.close()

    head = "| condition | API CPU idle % | submission p50 ms | p95 ms | max ms | feed reads/s | bytes/s per page |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['condition']} | {100 * r['cpu']:.0f} | {r['p50']:.0f} | {r['p95']:.0f} | {r['max']:.0f} | "
                     f"{r['reads_per_s']:.1f} | {r['page_bps']:.0f} |")
    print("\n".join(lines) if args.markdown else "\n".join(lines).replace("|", " "))
    worst = rows[-1]["max"]
    print(f"\nthe target: a submission answers within 200 ms with {args.jobs:,} jobs queued, {args.pages} pages and "
          f"{args.followers} followers open: max {worst:.0f} ms -> {'met' if worst <= 200 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
