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
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import cli_env, wait_for
from serving import AUTH, TINY_DEFAULTS, TOKEN, ServerProcess, expected_mp4, mp4_of

from wan_s2v_runner.serve.leftovers import group_processes
from wan_s2v_runner.shared import media
from wan_s2v_runner.shared.job_source import SPEC_KEY, JobSource, read_source
from wan_s2v_runner.shared.spec import GroupSpec, read_spec


@pytest.mark.slow
def test_jobs_in_a_row_equal_one_process(server, inputs, tiny_assets, pose_reference_frames, big_reference_frames,
                                         cached_reference, tmp_path):
    """Three jobs: uploads (with a pose video), then paths on the server, then one with step caching;
    the group streams its DiT block by block (``--dit-offload blocks``) for each of them."""
    with open(inputs["image"], "rb") as image, open(inputs["audio"], "rb") as audio, \
            open(tiny_assets.pose_video, "rb") as pose:
        first = server.submit(files={"input_reference": ("me.png", image, "image/png"),
                                     "audio": ("my voice.wav", audio, "audio/wav"),
                                     "pose_video": ("my moves.mp4", pose, "video/mp4")}, seed=42, model="wan2.2-s2v")
    assert first.status_code == 200, first.text
    second = server.submit(image=inputs["image"], audio=inputs["audio"], size="128x128", seed=7,
                           prompt="someone else", solver="dpm++")
    assert second.status_code == 200, second.text
    cached = server.submit(image=inputs["image"], audio=inputs["audio"], seed=42, steps=8, cache="easycache")
    assert cached.status_code == 200, cached.text
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
    server.wait(cached.json()["id"], "completed")
    assert set(done_a["stage_seconds"]) >= {"audio_encode", "denoise", "decode", "save"}
    # one process's frames of each job (made once per test run: conftest's), written as rank 0 writes them
    want = {a["id"]: mp4_of(pose_reference_frames, inputs["audio"], tmp_path / "a.mp4"),
            b["id"]: mp4_of(big_reference_frames, inputs["audio"], tmp_path / "b.mp4"),
            cached.json()["id"]: mp4_of(cached_reference[0], inputs["audio"], tmp_path / "c.mp4")}
    for vid, sha in want.items():
        r = server.http.get(f"/v1/videos/{vid}/content")
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        (tmp_path / "got.mp4").write_bytes(r.content)
        assert media.sha256_file(tmp_path / "got.mp4") == sha == server.video(vid)["sha256"]
    # the cached job reused steps (its decisions are one process's: its mp4 is), and says how many
    assert server.video(cached.json()["id"])["steps_reused"] > 0 and server.video(a["id"])["steps_reused"] is None
    # the group started from its group spec alone: no placeholder inputs, and its spec.json holds no job
    assert not (server.dir / ".group").exists()
    run_dir = Path(json.loads((server.dir / "group.json").read_text())["run_dir"])
    assert type(read_spec(run_dir / "spec.json")) is GroupSpec and read_source(run_dir) is JobSource.INBOX
    assert json.loads((run_dir / "spec.json").read_text())[SPEC_KEY] == "inbox"  # recorded, not inferred
    # each rank streamed its DiT from the node's one host copy, for every job (the same mp4s above)
    for rank in (0, 1):
        loaded = next(json.loads(e) for e in (run_dir / "events" / f"rank{rank}.jsonl").read_text().splitlines()
                      if '"loaded"' in e)
        assert loaded["strategy"]["dit"] == "node-shared" and loaded["strategy"]["dit_stream"]["streamed_blocks"] == 2


@pytest.mark.slow
def test_cancel_queued_and_running(server, inputs):
    paths = {"image": inputs["image"], "audio": inputs["audio"]}
    group_before = httpx.get(f"{server.url}/health").json()
    long = server.submit(**paths, steps=1000, shift=2, prompt="a long one").json()  # still denoising when cancelled
    queued = server.submit(**paths, prompt="never made").json()
    r = server.http.post(f"/v1/videos/{queued['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    wait_for(lambda: (server.video(long["id"]).get("step") or 0) >= 1, 120, "the long job's first step", server.tail)
    r = server.http.post(f"/v1/videos/{long['id']}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested"]
    gone = server.wait(long["id"], "cancelled", timeout=60)
    assert gone["error"]["message"] == "cancelled"
    assert server.http.post(f"/v1/videos/{long['id']}/cancel").json()["status"] == "cancelled"  # idempotent
    after = server.submit(**paths, steps=1, infer_frames=4, num_clips=1).json()
    assert server.wait(after["id"], "completed")["attempts"] == 1
    health = httpx.get(f"{server.url}/health").json()
    assert (health["groups"], health["restarts"]) == (group_before["groups"], group_before["restarts"])  # same ranks
    assert not list((server.dir / "videos").glob(f"{queued['id']}*"))
    assert not list((Path(server.group_dir()) / "inbox").glob("cancel-*"))  # read, acted on, gone


@pytest.mark.slow
def test_refusals_say_why(server, inputs, tmp_path):
    before = len(server.videos())
    uploads = server.dir / "uploads"  # made by the first upload the server keeps (another test's, or none yet)
    uploads_before = set(uploads.iterdir()) if uploads.is_dir() else set()
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
    server_paths = (str(inputs["root"]), str(server.dir), str(server.dir.parent))
    for fields, status, words in cases:
        r = server.submit(**fields)
        assert r.status_code == status and words in r.json()["error"]["message"], (fields, r.text)
        assert not any(p in r.json()["error"]["message"] for p in server_paths), r.text  # no server path, no root
    r = server.submit(files={"image": ("face.png", b"not a png at all", "image/png")}, audio=inputs["audio"])
    assert r.status_code == 422 and r.json()["error"]["param"] == "image", r.text
    assert "preflight inputs.image" in r.json()["error"]["message"] and "uploads" not in r.text, r.text
    r = server.submit(files={"audio": ("big.wav", b"\0" * (2 << 20), "audio/wav")}, image=inputs["image"])
    assert r.status_code == 413 and "over 1 MB" in r.json()["error"]["message"]
    assert server.http.get("/v1/videos/video_nope").status_code == 404
    assert len(server.videos()) == before  # none of them was queued
    assert (set(uploads.iterdir()) if uploads.is_dir() else set()) == uploads_before  # refused uploads are not kept


@pytest.mark.slow
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
    listed = [v for v in server.videos() if v["prompt"].startswith("load ")]
    assert sorted(v["id"] for v in listed) == sorted(accepted)
    assert all(v["attempts"] == 1 for v in listed)
    info = server.http.get("/v1/server").json()  # 10 at once, but never more checked at once than the slots
    assert 1 <= info["decoding_peak"] <= info["decode_slots"] == 2, info


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_job_that_raises_on_every_rank_fails_alone(server, inputs):
    """Both ranks raise at the same point of a served job (a Python error, not a crash): the job
    fails with it, once, and the next job is made by the same rank group (no restart, no reload)."""
    paths = {"image": inputs["image"], "audio": inputs["audio"]}
    before = httpx.get(f"{server.url}/health").json()
    boom = server.submit(**paths, prompt="boom").json()
    nxt = server.submit(**paths, prompt="the next one", steps=1, infer_frames=4, num_clips=1).json()
    failed = server.wait(boom["id"], "failed", timeout=120)
    assert failed["attempts"] == 1 and failed["failures"] == 0, failed
    assert "InjectedFault in stage denoise" in failed["error"]["message"], failed
    assert server.wait(nxt["id"], "completed", timeout=120)["attempts"] == 1
    after = httpx.get(f"{server.url}/health").json()
    assert (after["restarts"], after["groups"]) == (before["restarts"], before["groups"]), (before, after)


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


@pytest.mark.slow
def test_kill_9_then_restart_resumes_exactly_once(server, inputs, engine_cpu, tmp_path):
    paths = {"image": inputs["image"], "audio": inputs["audio"]}
    three = dict(seed=9, infer_frames=4, num_clips=3, steps=3)
    job = server.submit(**paths, prompt="three clips", **three).json()
    later = server.submit(**paths, prompt="queued behind it", steps=1, infer_frames=4, num_clips=1).json()
    wait_for(lambda: (server.video(job["id"]).get("clip") or 0) >= 2, 180, "clip 2", server.tail)
    killed_group = json.loads((server.dir / "group.json").read_text())["run_dir"]
    group = group_processes(killed_group)
    # torchrun and its 2 workers (a worker's child caught between its fork and its exec, rank 0
    # starting the preview's encoder, carries the worker's command line too: not counted)
    assert len({p for p in group if _ppid(_ppid(p)) not in group}) == 3, group
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    server.restart()  # the session's server from here on
    assert "were in progress when the server stopped" in server.text()
    assert server.video(later["id"])["status"] in ("queued", "in_progress", "completed")
    done = server.wait(job["id"], "completed", timeout=180)
    assert done["attempts"] == 2 and done["resumed_at_clip"] >= 2, done
    want = expected_mp4(engine_cpu, inputs["audio"], tmp_path / "whole.mp4", prompt="three clips", **three)
    assert (server.dir / "videos" / f"{job['id']}.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()
    assert done["sha256"] == want
    server.wait(later["id"], "completed")
    made = [ev for f in (server.dir / "runs").glob("*/events/rank0.jsonl")
            for ev in map(json.loads, f.read_text().splitlines())
            if ev["kind"] == "job_done" and ev.get("id") == job["id"]]
    assert len(made) == 1  # finished exactly once, across every rank group
    assert not group_processes(killed_group)  # nothing of the killed server's group is left running


def test_binding_beyond_loopback_needs_auth():
    from wan_s2v_runner.serve.settings import check_bind

    assert check_bind("127.0.0.1", None, False) is None and check_bind("::1", None, False) is None
    assert "--token" in check_bind("0.0.0.0", None, False)
    assert check_bind("0.0.0.0", "t", False) is None and check_bind("10.0.0.5", None, True) is None


@pytest.mark.slow
def test_two_nodes_serve(tiny_assets, inputs, reference_frames, tmp_path):
    """Node 0 serves (API, queue, rank 0); node 1 runs the same command with --node-rank 1 and
    only computes. Jobs made by the 2-node group equal one process's. (Also the suite's check of
    a layout over nodes set by flags: test_multinode sets it by the cluster's variables.)"""
    from ports import named_port

    port = str(named_port())
    common = [*TINY_DEFAULTS, "--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", port, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--allow-dir", str(inputs["root"])]
    env = cli_env()
    (tmp_path / "node1").mkdir()
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "serve", *common, "--node-rank", "1",
                                  "--server-dir", str(tmp_path / "node1")], cwd=tmp_path / "node1", env=env,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        node0 = ServerProcess(tmp_path / "node0", [*common, "--node-rank", "0", "--token", TOKEN])
        try:
            # the job comes to a group that is up: its store holds --master-port (a job's checks
            # once refused it for that: "--master-port N is already in use on this node")
            wait_for(lambda: httpx.get(f"{node0.url}/health").json()["group"] == "idle", 120, "the group",
                     node0.tail)
            job = node0.submit(image=inputs["image"], audio=inputs["audio"], seed=42).json()
            assert "id" in job, job
            done = node0.wait(job["id"], "completed", timeout=180)
            want = mp4_of(reference_frames, inputs["audio"], tmp_path / "want.mp4")
            assert done["sha256"] == want
            assert httpx.get(f"{node0.url}/health").json()["world_size"] == 2
        finally:
            left = node0.stop()
            node1.send_signal(signal.SIGTERM)
            try:
                node1.wait(30)
            except subprocess.TimeoutExpired:
                node1.kill()
    assert left == []  # node 0's server stopped its group before it exited
    text = (tmp_path / "node1.log").read_text()
    assert "node 1 of 2: computing for the server on node 0" in text, text
    assert not (tmp_path / "node1" / "videos").exists()  # node 1 keeps no queue and writes no video


def _metrics(server) -> dict:
    """/metrics parsed by the Prometheus client's own parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


@pytest.mark.slow
def test_metrics_move_as_jobs_run(server, inputs):
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # the token, as every route but /health
    # the jobs other tests left behind on the session's server end first: only this one moves the counts
    wait_for(lambda: (q := httpx.get(f"{server.url}/health").json()["queue"])["queued"] + q["in_progress"] == 0,
             240, "the server's earlier jobs to end", server.tail)
    before = _metrics(server)
    job = server.submit(image=inputs["image"], audio=inputs["audio"], prompt="counted", steps=1, infer_frames=4,
                        num_clips=1).json()
    server.wait(job["id"], "completed")
    # the keeper observes the job's seconds just after the store says completed: a scrape in between
    # sees the status first (the histogram follows within the same keeper step)
    seconds = ("wan_s2v_job_seconds_count", ())
    after = wait_for(lambda: (m := _metrics(server)).get(seconds, 0) > before.get(seconds, 0) and m, 10,
                     "the job's seconds in the histogram", server.tail)
    done = ("wan_s2v_jobs_finished_total", (("status", "completed"),))
    assert after[done] == before.get(done, 0) + 1
    assert after[("wan_s2v_job_seconds_count", ())] == before.get(("wan_s2v_job_seconds_count", ()), 0) + 1
    assert after[("wan_s2v_stage_seconds_count", (("stage", "denoise"),))] >= 1
    jobs = ("wan_s2v_jobs", (("status", "completed"),))
    assert after[jobs] == before[jobs] + 1 and after[("wan_s2v_queue_length", ())] >= 0
    assert after[("wan_s2v_denoise_steps_per_second", (("group", "0"),))] > 0
    assert after[("wan_s2v_rank_group_state", (("group", "0"), ("state", "idle")))] + \
        after[("wan_s2v_rank_group_state", (("group", "0"), ("state", "working")))] == 1
    for rank in ("0", "1"):
        assert after[("wan_s2v_rank_rss_bytes", (("group", "0"), ("rank", rank)))] > 100 * 2**20
    assert ("wan_s2v_rank_group_restarts_total", (("group", "0"),)) in after


def _client(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = cli_env()
    full.pop("WAN_S2V_TOKEN", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "wan_s2v_runner", *args], env=full, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=240)


@pytest.mark.slow
def test_submit_and_jobs_clients(server, inputs, tmp_path):
    """``wan-s2v submit`` uploads, follows (plain lines: not a terminal) and downloads the mp4
    the server made; ``wan-s2v jobs`` lists, shows and cancels; refusals and an absent server
    exit with their documented codes."""
    at = ["--url", server.url]
    dest = tmp_path / "my videos" / "it's mine.mp4"
    r = _client("submit", *at, "--image", str(inputs["image"]), "--audio", str(inputs["audio"]), "--seed", "5",
                "--steps", "2", "--infer-frames", "4", "--num-clips", "2", "--prompt", "from the terminal",
                "--output", str(dest), env={"WAN_S2V_TOKEN": TOKEN})
    assert r.returncode == 0, r.stdout + r.stderr
    vid = r.stderr.split("submitted ")[1].split()[0]
    lines = [line for line in r.stdout.splitlines() if vid in line]
    assert len(lines) >= 3 and "clip 2/2" in r.stdout, r.stdout  # it followed the job through its stages
    assert f"{vid}: completed" in lines[-1] and str(dest) in lines[-1], r.stdout
    assert media.sha256_file(dest) == server.video(vid)["sha256"]
    assert not list(dest.parent.glob(".*"))  # no temporary left

    # long: still denoising when the cancel comes, however slow the clients start on a busy machine
    long = _client("submit", *at, "--token", TOKEN, "--image", str(inputs["image"]), "--audio", str(inputs["audio"]),
                   "--server-paths", "--steps", "1000", "--shift", "2", "--prompt", "long", "--no-wait")
    assert long.returncode == 0, long.stderr
    long_id = long.stdout.strip()
    listed = _client("jobs", *at, "--token", TOKEN, "--json")
    assert {vid, long_id} <= {v["id"] for v in json.loads(listed.stdout)}
    table = _client("jobs", *at, "--token", TOKEN, vid)
    assert table.returncode == 0 and vid in table.stdout and "from the terminal" in table.stdout
    cancel = _client("jobs", *at, "--token", TOKEN, "--cancel", long_id, "--json")
    assert cancel.returncode == 0 and json.loads(cancel.stdout)[0]["id"] == long_id
    assert server.wait(long_id, "cancelled", timeout=60)["status"] == "cancelled"

    refused = _client("submit", *at, "--token", TOKEN, "--image", str(inputs["image"]), "--audio",
                      str(inputs["audio"]), "--infer-frames", "5")
    assert refused.returncode == 3 and "multiple of 4" in refused.stderr, refused.stderr
    no_token = _client("jobs", *at)
    assert no_token.returncode == 3 and "401" in no_token.stderr and "Bearer" in no_token.stderr
    nobody = _client("jobs", "--url", "http://127.0.0.1:9", "--token", TOKEN)
    assert nobody.returncode == 7 and "cannot reach the server" in nobody.stderr


def test_the_api_documents_its_typed_responses():
    """/openapi.json (and /docs) show the video object, the list, the error and the server's state."""
    from wan_s2v_runner.serve.app import create_app

    doc = create_app(server=None).openapi()
    schemas = doc["components"]["schemas"]
    assert {"VideoObject", "VideoList", "ErrorResponse", "ServerInfo", "Health"} <= set(schemas)

    def ref(path: str, method: str, status: str) -> str:
        return doc["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]["$ref"]

    assert ref("/v1/videos", "post", "200").endswith("/VideoObject")
    assert ref("/v1/videos", "get", "200").endswith("/VideoList")
    assert ref("/v1/videos/{video_id}", "get", "200").endswith("/VideoObject")
    assert ref("/v1/videos/{video_id}", "delete", "200").endswith("/VideoDeleted")
    assert ref("/v1/videos/{video_id}/cancel", "post", "200").endswith("/VideoObject")
    assert ref("/v1/videos/{video_id}", "get", "404").endswith("/ErrorResponse")
    assert ref("/v1/server", "get", "200").endswith("/ServerInfo")
    assert ref("/health", "get", "200").endswith("/Health")
    assert schemas["VideoObject"]["properties"]["status"]["$ref"].endswith("/JobStatus")
    # the event streams' refusals before they start, and the queue being away, are documented JSON
    for path in ("/v1/events", "/v1/videos/{video_id}/events"):
        assert ref(path, "get", "429").endswith("/ErrorResponse") and ref(path, "get", "503").endswith("/ErrorResponse")
    assert ref("/v1/videos/{video_id}/events", "get", "404").endswith("/ErrorResponse")
    assert ref("/v1/videos", "post", "503").endswith("/ErrorResponse")
    assert ref("/health/ready", "get", "503").endswith("/ErrorResponse")
