"""``wan-s2v serve`` over real HTTP on loopback, on the tiny checkpoint, with a real 2-rank group.

One server (module-scoped) takes every test in turn, the way a server lives: jobs in a row equal
one process's frames (an upload and paths, different sizes, seeds and solvers; their progress as
server-sent events); cancel (a queued job, a running one; the ranks stay up); refusals with a
4xx and the cause (auth, paths outside the allowed roots, bad fields, a corrupt upload, a big
upload, preflight); 50 submissions from concurrent clients (each queued and completed, or
refused with a reason; none lost or duplicated); a job that kills a rank twice is failed, the
group restarts and goes on; and last, kill -9 of the server in the middle of a job: on restart
the queue is intact and the interrupted job resumes from its clip checkpoint, completed once,
its mp4 byte-identical to an uninterrupted run's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, one_process_frames, wait_for
from wan_s2v_runner.shared import media

TOKEN = "s3cret token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: the module's jobs: the tiny spec (as TINY_FLAGS) is the server's default
TINY_DEFAULTS = ["--device", "cpu", "--size", "64*64", "--infer-frames", "8", "--steps", "2",
                 "--prompt", "a person talking", "--watchdog-load", "120"]
SERVER_FLAGS = [*TINY_DEFAULTS, "--nproc", "2"]
#: a job that kills rank 1 at its first denoising step (test-only fault, matched on the prompt)
POISON = "1:denoise#poison:exit"


class ServerProcess:
    """``python -m wan_s2v_runner serve`` in a subprocess; its URL from SERVER_DIR/server.json."""

    def __init__(self, server_dir: Path, flags: list[str], env: dict | None = None):
        self.dir, self.log = server_dir, server_dir.parent / f"{server_dir.name}.{time.time():.0f}.log"
        (server_dir / "server.json").unlink(missing_ok=True)
        full = dict(os.environ)
        full["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([full["PYTHONPATH"]] if full.get("PYTHONPATH") else []))
        full.update(env or {})
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "serve", *flags,
                                      "--server-dir", str(server_dir), "--port", "0"],
                                     cwd=server_dir.parent, env=full, stdin=subprocess.DEVNULL,
                                     stdout=self.out, stderr=subprocess.STDOUT)
        wait_for(lambda: (server_dir / "server.json").is_file() or self.proc.poll() is not None, 120, "server.json")
        assert self.proc.poll() is None, self.text()
        self.url = json.loads((server_dir / "server.json").read_text())["url"]
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=60)

    def text(self) -> str:
        self.out.flush()
        return self.log.read_text()

    def tail(self) -> str:
        """The log's end, for a failed wait."""
        return self.text()[-3000:]

    def video(self, vid: str) -> dict:
        r = self.http.get(f"/v1/videos/{vid}")
        assert r.status_code == 200, r.text
        return r.json()

    def submit(self, files: dict | None = None, **fields) -> httpx.Response:
        return self.http.post("/v1/videos", data={k: str(v) for k, v in fields.items()}, files=files)

    def wait(self, vid: str, *states: str, timeout: float = 180) -> dict:
        return wait_for(lambda: (v := self.video(vid))["status"] in states and v, timeout,
                        f"{vid} to be {'/'.join(states)}", self.tail)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()
        self.out.close()


@pytest.fixture(scope="module")
def inputs(tiny_assets, tmp_path_factory):
    """The allowed root with the tiny inputs in it, a file outside it and a symlink escaping it."""
    allowed = tmp_path_factory.mktemp("allowed inputs")
    for name in ("image", "audio"):
        src = getattr(tiny_assets, name)
        (allowed / src.name).write_bytes(src.read_bytes())
    outside = tmp_path_factory.mktemp("outside") / "speech.wav"
    outside.write_bytes(tiny_assets.audio.read_bytes())
    (allowed / "escape.wav").symlink_to(outside)
    return {"root": allowed, "image": allowed / tiny_assets.image.name, "audio": allowed / tiny_assets.audio.name,
            "outside": outside, "escape": allowed / "escape.wav"}


@pytest.fixture(scope="module")
def server(tiny_assets, inputs, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve") / "server dir"
    flags = [*SERVER_FLAGS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--token", TOKEN,
             "--allow-dir", str(inputs["root"]), "--max-queue", "6", "--max-upload-mb", "1"]
    s = ServerProcess(d, flags, env={"WAN_S2V_TEST_FAULT": POISON})
    s.flags = flags
    yield s
    s.stop()


def expected_mp4(engine_cpu, audio: Path, dest: Path, **updates) -> str:
    """sha256 of the mp4 one process makes for the tiny spec with ``updates``."""
    frames = one_process_frames(engine_cpu, **updates)
    media.save_video_with_audio(frames, engine_cpu[1].sample_fps, audio, dest)
    return media.sha256_file(dest)


def test_jobs_in_a_row_equal_one_process(server, inputs, engine_cpu, tmp_path):
    with open(inputs["image"], "rb") as image, open(inputs["audio"], "rb") as audio:
        first = server.submit(files={"input_reference": ("me.png", image, "image/png"),
                                     "audio": ("my voice.wav", audio, "audio/wav")}, seed=42, model="wan2.2-s2v")
    assert first.status_code == 200, first.text
    second = server.submit(image=inputs["image"], audio=inputs["audio"], size="128x128", seed=7,
                           prompt="someone else", solver="dpm++")
    assert second.status_code == 200, second.text
    a, b = first.json(), second.json()
    assert a["status"] == "queued" and a["object"] == "video" and a["id"] != b["id"]
    assert a["id"].startswith("video_") and len(a["id"]) == 30  # random, not a counter

    seen = []  # the second job's progress, as server-sent events
    with server.http.stream("GET", f"/v1/videos/{b['id']}/events", timeout=180) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data:"):
                seen.append(json.loads(line[5:]))
    assert seen[-1]["status"] == "completed" and seen[-1]["progress"] == 100
    steps = [(v["clip"], v["step"]) for v in seen if v["status"] == "in_progress" and v["step"]]
    assert steps == sorted(steps) and len(set(steps)) >= 2, seen  # it moved, in order
    assert all(v["steps"] == 2 and v["clips"] == 2 for v in seen if v["step"])

    done_a = server.wait(a["id"], "completed")
    assert set(done_a["stage_seconds"]) >= {"audio_encode", "denoise", "decode", "mux"}
    want = {a["id"]: expected_mp4(engine_cpu, inputs["audio"], tmp_path / "a.mp4"),
            b["id"]: expected_mp4(engine_cpu, inputs["audio"], tmp_path / "b.mp4", seed=7, max_area=128 * 128,
                                  prompt="someone else", solver="dpm++")}
    for vid, sha in want.items():
        r = server.http.get(f"/v1/videos/{vid}/content")
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        (tmp_path / "got.mp4").write_bytes(r.content)
        assert media.sha256_file(tmp_path / "got.mp4") == sha == server.video(vid)["sha256"]


def test_cancel_queued_and_running(server, inputs):
    paths = {"image": inputs["image"], "audio": inputs["audio"]}
    long = server.submit(**paths, steps=40, prompt="a long one").json()
    queued = server.submit(**paths, prompt="never made").json()
    r = server.http.delete(f"/v1/videos/{queued['id']}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    wait_for(lambda: (server.video(long["id"]).get("step") or 0) >= 1, 120, "the long job's first step", server.tail)
    r = server.http.delete(f"/v1/videos/{long['id']}")
    assert r.status_code == 200 and r.json()["cancel_requested"]
    gone = server.wait(long["id"], "cancelled", timeout=60)
    assert gone["error"]["message"] == "cancelled"
    assert server.http.delete(f"/v1/videos/{long['id']}").json()["status"] == "cancelled"  # idempotent
    after = server.submit(**paths, steps=1, infer_frames=4, num_clips=1).json()
    assert server.wait(after["id"], "completed")["attempts"] == 1
    health = httpx.get(f"{server.url}/health").json()
    assert health["groups"] == 1 and health["restarts"] == 0  # the same ranks took the next job
    assert not list((server.dir / "videos").glob(f"{queued['id']}*"))


def test_refusals_say_why(server, inputs, tmp_path):
    before = len(server.http.get("/v1/videos").json()["data"])
    uploads_before = set((server.dir / "uploads").iterdir())
    paths = {"image": inputs["image"], "audio": inputs["audio"]}
    # auth: every route but /health
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/videos", data={k: str(v) for k, v in paths.items()})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/videos", headers={"Authorization": "Bearer wrong"}).status_code == 401
    cases = [
        (dict(paths, audio=inputs["outside"]), 403, "outside the directories this server reads"),
        (dict(paths, audio=inputs["escape"]), 403, "outside the directories this server reads"),  # a symlink out
        (dict(paths, audio=f"{inputs['root']}/../outside/speech.wav"), 403, "contains '..'"),
        (dict(paths, audio="speech.wav"), 400, "not an absolute path"),
        (dict(paths, audio=inputs["root"] / "missing.wav"), 422, "preflight inputs.audio"),
        (dict(paths, infer_frames=5), 422, "multiple of 4"),
        (dict(paths, steps=0), 422, "steps: Input should be greater than 0"),
        (dict(paths, nproc=4), 422, "nproc: not a job field"),
        ({"image": inputs["image"]}, 422, "audio: required"),
    ]
    for fields, status, words in cases:
        r = server.submit(**fields)
        assert r.status_code == status and words in r.json()["error"]["message"], (fields, r.text)
    r = server.submit(files={"image": ("face.png", b"not a png at all", "image/png")}, audio=inputs["audio"])
    assert r.status_code == 422 and r.json()["error"]["param"] == "image", r.text
    assert "preflight inputs.image" in r.json()["error"]["message"]
    r = server.submit(files={"audio": ("big.wav", b"\0" * (2 << 20), "audio/wav")}, image=inputs["image"])
    assert r.status_code == 413 and "over 1 MB" in r.json()["error"]["message"]
    assert server.http.get("/v1/videos/video_nope").status_code == 404
    assert len(server.http.get("/v1/videos").json()["data"]) == before  # none of them was queued
    assert set((server.dir / "uploads").iterdir()) == uploads_before  # refused uploads are not kept


def test_fifty_concurrent_submissions(server, inputs):
    """10 clients submit 50 tiny jobs at once to a queue that takes 6 waiting jobs: each is
    queued (and completes) or refused with 429 and the reason; none is lost or duplicated."""
    def submit(i: int) -> tuple[int, dict]:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
            r = c.post("/v1/videos", data={"image": str(inputs["image"]), "audio": str(inputs["audio"]),
                                           "prompt": f"load {i}", "seed": str(i), "steps": "1",
                                           "infer_frames": "4", "num_clips": "1"})
            return r.status_code, r.json()

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(submit, range(50)))
    accepted = [body["id"] for code, body in answers if code == 200]
    refused = [body for code, body in answers if code != 200]
    assert {code for code, _ in answers} <= {200, 429}, answers
    assert all("the queue is full" in body["error"]["message"] for body in refused)
    assert 6 <= len(accepted) < 50 and len(set(accepted)) == len(accepted)
    for vid in accepted:
        server.wait(vid, "completed", timeout=120)
    listed = [v for v in server.http.get("/v1/videos").json()["data"] if v["prompt"].startswith("load ")]
    assert sorted(v["id"] for v in listed) == sorted(accepted)
    assert all(v["attempts"] == 1 for v in listed)


def test_a_job_that_kills_the_ranks_twice_is_failed(server, inputs):
    """A rank dies in the job (twice: it is retried once): the job is failed with the cause, the
    server restarts the group each time and answers meanwhile, and the next job is made."""
    paths = {"image": inputs["image"], "audio": inputs["audio"]}
    restarts = httpx.get(f"{server.url}/health").json()["restarts"]
    poison = server.submit(**paths, prompt="poison pill").json()
    nxt = server.submit(**paths, prompt="the next one", steps=1, infer_frames=4, num_clips=1).json()
    answers = []

    def probe():  # the HTTP side while the ranks fail and restart
        while server.video(poison["id"])["status"] != "failed":
            answers.append(httpx.get(f"{server.url}/health", timeout=5).json()["group"])
            time.sleep(0.2)

    t = threading.Thread(target=probe)
    t.start()
    failed = server.wait(poison["id"], "failed", timeout=240)
    t.join()
    assert failed["failures"] == 2 and failed["attempts"] == 2
    assert "failed 2 times" in failed["error"]["message"] and "rank 1" in failed["error"]["message"]
    assert "restarting" in answers or "loading" in answers
    assert server.wait(nxt["id"], "completed", timeout=180)["attempts"] == 1
    assert httpx.get(f"{server.url}/health").json()["restarts"] == restarts + 2


def test_kill_9_then_restart_resumes_exactly_once(server, inputs, engine_cpu, tmp_path):
    paths = {"image": inputs["image"], "audio": inputs["audio"]}
    three = dict(seed=9, infer_frames=4, num_clips=3, steps=4)
    job = server.submit(**paths, prompt="three clips", **three).json()
    later = server.submit(**paths, prompt="queued behind it", steps=1, infer_frames=4, num_clips=1).json()
    wait_for(lambda: (server.video(job["id"]).get("clip") or 0) >= 2, 180, "clip 2", server.tail)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    restarted = ServerProcess(server.dir, server.flags)
    try:
        assert "were in progress when the server stopped" in restarted.text()
        assert restarted.video(later["id"])["status"] in ("queued", "in_progress", "completed")
        done = restarted.wait(job["id"], "completed", timeout=180)
        assert done["attempts"] == 2 and done["resumed_at_clip"] >= 2, done
        want = expected_mp4(engine_cpu, inputs["audio"], tmp_path / "whole.mp4", prompt="three clips", **three)
        assert (restarted.dir / "videos" / f"{job['id']}.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()
        assert done["sha256"] == want
        restarted.wait(later["id"], "completed")
        made = [ev for f in (server.dir / "runs").glob("*/events/rank0.jsonl")
                for ev in map(json.loads, f.read_text().splitlines())
                if ev["kind"] == "job_done" and ev.get("id") == job["id"]]
        assert len(made) == 1  # finished exactly once, across every rank group
    finally:
        restarted.stop()


def test_binding_beyond_loopback_needs_auth():
    from wan_s2v_runner.launcher.serve.app import check_bind

    assert check_bind("127.0.0.1", None, False) is None and check_bind("::1", None, False) is None
    assert "--token" in check_bind("0.0.0.0", None, False)
    assert check_bind("0.0.0.0", "t", False) is None and check_bind("10.0.0.5", None, True) is None


def test_queue_moves(tmp_path):
    """The queue's rules, on a real SQLite file: a full queue refuses, a job put back after a
    restart goes first, a job that took its group down twice is failed, cancels."""
    from wan_s2v_runner.launcher.serve.queue import JobQueue, JobStatus, QueueFull

    q = JobQueue(tmp_path / "jobs.sqlite")
    for name in ("a", "b"):
        q.add(name, {"prompt": name}, max_queued=2)
    with pytest.raises(QueueFull):
        q.add("c", {}, max_queued=2)
    assert q.claim_next().id == "a" and q.position("b") == 1
    q.close()
    q = JobQueue(tmp_path / "jobs.sqlite")  # the server again: "a" was in progress
    assert q.recover() == ["a"] and q.get("a").status is JobStatus.QUEUED
    q.add("c", {}, max_queued=3)
    assert q.claim_next().id == "a"  # the interrupted job first
    assert q.group_failed("a", "rank 1 died") is JobStatus.QUEUED
    assert q.claim_next().id == "a" and q.get("a").runs == 3
    assert q.group_failed("a", "rank 1 died") is JobStatus.FAILED and "failed 2 times" in q.get("a").error
    assert q.cancel("c") is JobStatus.CANCELLED  # queued: dropped at once
    assert q.claim_next().id == "b" and q.cancel("b") is JobStatus.IN_PROGRESS and q.get("b").cancel_requested
    assert q.counts() == {"queued": 0, "in_progress": 1, "completed": 0, "failed": 1, "cancelled": 1}


def test_two_nodes_serve(tiny_assets, inputs, engine_cpu, tmp_path):
    """Node 0 serves (API, queue, rank 0); node 1 runs the same command with --node-rank 1 and
    only computes. Jobs made by the 2-node group equal one process's."""
    from test_multinode import _free_port

    port = str(_free_port())
    common = [*TINY_DEFAULTS, "--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", port, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--allow-dir", str(inputs["root"])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    (tmp_path / "node1").mkdir()
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "serve", *common, "--node-rank", "1",
                                  "--server-dir", str(tmp_path / "node1")], cwd=tmp_path / "node1", env=env,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        node0 = ServerProcess(tmp_path / "node0", [*common, "--node-rank", "0", "--token", TOKEN])
        try:
            job = node0.submit(image=inputs["image"], audio=inputs["audio"], seed=42).json()
            done = node0.wait(job["id"], "completed", timeout=180)
            want = expected_mp4(engine_cpu, inputs["audio"], tmp_path / "want.mp4")
            assert done["sha256"] == want
            assert httpx.get(f"{node0.url}/health").json()["world_size"] == 2
        finally:
            node0.stop()
            node1.send_signal(signal.SIGTERM)
            try:
                node1.wait(30)
            except subprocess.TimeoutExpired:
                node1.kill()
    text = (tmp_path / "node1.log").read_text()
    assert "node 1 of 2: computing for the server on node 0" in text, text
    assert not (tmp_path / "node1" / "videos").exists()  # node 1 keeps no queue and writes no video
