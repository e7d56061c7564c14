"""Benchmark (issue #81): a live session's latency against the file-based live run of the same speech,
and a long session's memory and disk.

One run of this script makes, side by side, on one checkpoint (``--preset``), size and rank count:

    run        ``wan-s2v run --mode live`` on the speech file: its first frame and frames a second
    realtime   ``wan-s2v serve --mode live``, a session paced in real time, the same speech sent as a
               microphone sends it (100 ms of PCM every 100 ms): the time from the first sample sent
               to the first fragment of video the client reads from the session's stream, and each
               block's latency (the server's: the arrival of the last sample it needed to its
               fragment in the video) p50 / p95
    speech     the same, ``speech``-paced, the speech sent at once: frames a second (the run's pace)

``--minutes M`` adds a long session (``speech``-paced, 30 s of speech then 30 s of silence, over
and over, sent as fast as the server takes it): the rank group's resident memory (rank 0's
heartbeats) and the server process's, and the server directory's bytes, after the first minute
and at the end, beside the recording's size.

    .venv/bin/python bench/bench_session.py --preset tiny --size 64*64 --seconds 6 --nproc 1
    .venv/bin/python bench/bench_session.py --preset tiny --size 64*64 --seconds 6 --nproc 1 --minutes 60
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TOKEN = "bench-token"
RATE = 16000


def run_file(flags: list[str], work: Path) -> dict:
    out = work / "run"
    out.mkdir(parents=True)
    r = subprocess.run([sys.executable, "-m", "wan_s2v_runner", "run", *flags, "--output", str(out / "o.mp4"),
                        "--runs-root", str(out / "runs")], cwd=out, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(next((out / "runs").glob("*/run.json")).read_text()).get("live") or {}


class Server:
    def __init__(self, group_flags: list[str], work: Path):
        import httpx

        self.dir = work / "served"
        self.dir.mkdir(parents=True)
        self.log = open(self.dir / "server.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "serve", *group_flags, "--token", TOKEN,
                                      "--session-idle", "120", "--server-dir", str(self.dir / "srv"), "--port", "0"],
                                     cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT)
        while not (self.dir / "srv" / "server.json").is_file():
            if self.proc.poll() is not None:
                raise SystemExit(f"the server ended:\n{(self.dir / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)
        url = json.loads((self.dir / "srv" / "server.json").read_text())["url"]
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
        while self.http.get("/health").json()["group"] != "idle":
            time.sleep(0.2)

    def session(self, image: Path, pace: str) -> str:
        with open(image, "rb") as f:
            r = self.http.post("/v1/videos/sessions", files={"image": ("ref.png", f.read(), "image/png")},
                               data={"seed": "42", "pace": pace})
        if r.status_code != 201:
            raise SystemExit(f"the session was refused: {r.text}")
        return r.json()["id"]

    def speak(self, sid: str, pcm: np.ndarray) -> None:
        r = self.http.post(f"/v1/videos/sessions/{sid}/speech", params={"rate": RATE}, content=pcm.tobytes())
        if r.status_code == 429:  # ahead of its video: a moment, then again
            time.sleep(1.0)
            return self.speak(sid, pcm)
        if r.status_code != 200:
            raise SystemExit(f"speech refused: {r.text}")

    def finish(self, sid: str) -> dict:
        self.http.post(f"/v1/videos/sessions/{sid}/end")
        while (v := self.http.get(f"/v1/videos/{sid}").json())["status"] not in ("completed", "failed", "cancelled"):
            time.sleep(0.2)
        if v["status"] != "completed":
            raise SystemExit(f"the session ended {v['status']}: {v.get('error')}")
        return v

    def first_fragment_at(self, sid: str, out: dict) -> threading.Thread:
        """A client reading the session's stream: when its first video fragment (a moof) arrived."""
        def read():
            seen = b""
            with self.http.stream("GET", f"/v1/videos/sessions/{sid}/stream") as r:
                for chunk in r.iter_bytes():
                    seen += chunk
                    if "first" not in out and b"moof" in seen:
                        out["first"] = time.monotonic()
        t = threading.Thread(target=read, daemon=True)
        t.start()
        return t

    def rank0_events(self, kind: str) -> list[dict]:
        group = Path(json.loads((self.dir / "srv" / "group.json").read_text())["run_dir"])
        return [e for e in map(json.loads, (group / "events" / "rank0.jsonl").read_text().splitlines())
                if e.get("kind") == kind]

    def rank0_rss(self) -> list[tuple[float, float]]:
        return [(e["t"], e["rss_mb"]) for e in self.rank0_events("heartbeat") if e.get("rss_mb")]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def realtime(server: Server, image: Path, pcm: np.ndarray) -> dict:
    """A real-time session: 3 s of listening, then the speech as a microphone sends it; the first
    frame that speaks (rank 0's first fragment whose span of speech is not silent) after the first
    sample was sent, and the first fragment the client's stream read after the session opened."""
    opened = time.monotonic()
    sid = server.session(image, "realtime")
    got: dict = {}
    reader = server.first_fragment_at(sid, got)
    time.sleep(3.0)  # the avatar listens first (a call's opening), then speech comes as a microphone sends it
    step = RATE // 10
    t0, sent_at = time.monotonic(), time.time()
    for i in range(0, pcm.size, step):
        server.speak(sid, pcm[i:i + step])
        time.sleep(max(0.0, t0 + (i + step) / RATE - time.monotonic()))
    v = server.finish(sid)
    reader.join(30)
    spoke = [e["t"] for e in server.rank0_events("preview") if e.get("spoken") and e["t"] >= sent_at]
    return {"live": v["live"] or {}, "id": sid, "first_speaking_s": round(spoke[0] - sent_at, 3) if spoke else None,
            "first_fragment_s": round(got["first"] - opened, 3) if "first" in got else None}


def paced_by_speech(server: Server, image: Path, pcm: np.ndarray) -> dict:
    sid = server.session(image, "speech")
    server.speak(sid, pcm)
    return {"live": server.finish(sid)["live"] or {}, "id": sid}


def long_session(server: Server, image: Path, pcm: np.ndarray, minutes: float) -> dict:
    """30 s of speech, 30 s of silence, over and over, for ``minutes`` of video."""
    sid = server.session(image, "speech")
    half = 30 * RATE
    speech = np.resize(pcm, half)
    silence = np.zeros(half, dtype=pcm.dtype)
    t0, marks, sent = time.time(), {}, 0
    server_rss = []
    while sent < minutes * 60 * RATE:
        part = speech if (sent // half) % 2 == 0 else silence
        for i in range(0, half, 5 * RATE):
            server.speak(sid, part[i:i + 5 * RATE])
        sent += half
        server_rss.append((time.time(), _rss_mb(server.proc.pid)))
        if sent >= 60 * RATE and "minute" not in marks:
            marks["minute"] = (time.time(), _du(server.dir))
    v = server.finish(sid)
    end = (time.time(), _du(server.dir))
    recording = (server.dir / "srv" / "videos" / f"{sid}.mp4").stat().st_size
    ranks = server.rank0_rss()
    after_minute = [r for t, r in ranks if t >= marks["minute"][0]]
    return {"minutes": minutes, "wall_s": round(time.time() - t0, 1), "frames": v["frames"],
            "rank0_rss_mb_after_1min": after_minute[0] if after_minute else None,
            "rank0_rss_mb_end": ranks[-1][1] if ranks else None,
            "rank0_rss_mb_max_after_1min": max(after_minute) if after_minute else None,
            "server_rss_mb_1min": next((r for t, r in server_rss if t >= marks["minute"][0]), None),
            "server_rss_mb_end": server_rss[-1][1], "dir_mb_1min": marks["minute"][1] / 2**20,
            "dir_mb_end": end[1] / 2**20, "recording_mb": recording / 2**20, "live": v["live"]}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and "runs" not in p.parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=("tiny", "compute"))
    ap.add_argument("--size", default="64*64")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=0.0, help="also a long session of this many minutes")
    ap.add_argument("--cache", default="~/.cache/wan-s2v/bench")
    a = ap.parse_args(argv)

    from bench_loop import live_inputs

    ckpt, work, image, audio = live_inputs(a.cache, a.preset, a.size, a.seconds, "bench_session_")
    import wave

    with wave.open(str(audio)) as f:
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
    group = ["--mode", "live", "--nproc", str(a.nproc), "--device", "cpu", "--size", a.size, "--ckpt-dir", str(ckpt),
             "--prompt", "a person talking"]
    file_live = run_file([*group, "--image", str(image), "--audio", str(audio), "--seed", "42"], work)
    server = Server(group, work)
    try:
        rt = realtime(server, image, pcm)
        sp = paced_by_speech(server, image, pcm)
        long = long_session(server, image, pcm, a.minutes) if a.minutes else None
    finally:
        server.stop()
    print(f"--preset {a.preset} --size {a.size} --seconds {a.seconds} --nproc {a.nproc} ({os.cpu_count()} CPUs)")
    print("| job | first frame (s) | frames/s | block latency p50 / p95 / max (s) |")
    print("|---|---|---|---|")
    print(f"| run (file) | {file_live.get('first_frame_s')} (from the job's start) | {file_live.get('fps')} | - |")
    lat = rt["live"].get("block_latency_s") or {}
    print(f"| session, realtime, speech at 1x after 3 s of listening | {rt['first_fragment_s']} (open -> the stream's "
          f"first fragment); {rt['first_speaking_s']} (first sample sent -> first speaking frame written) "
          f"| {rt['live'].get('fps')} | {lat.get('p50')} / {lat.get('p95')} / {lat.get('max')} |")
    lat = sp["live"].get("block_latency_s") or {}
    print(f"| session, speech-paced, all its speech sent at once | {sp['live'].get('first_frame_s')} (from the job's "
          f"start) | {sp['live'].get('fps')} | {lat.get('p50')} / {lat.get('p95')} / {lat.get('max')} (the blocks' "
          "queue: every block's speech came at once) |")
    if file_live.get("fps") and sp["live"].get("fps"):
        print(f"speech-paced session / file run frames per second: {sp['live']['fps'] / file_live['fps']:.2f}x")
    if long:
        print(json.dumps(long, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
