"""``wan-s2v serve --replicas 2`` over real HTTP: two rank groups of one real rank each (the tiny
checkpoint), each on its own CPU core, taking jobs from one queue.

- 4 jobs: every one completes with exactly the mp4 one process makes for its settings; both
  groups made some, and at the same time;
- ``/health`` and ``/v1/server`` show each group with what it holds, ``/metrics`` labels each;
- each group's rank runs on its own core (the worker's affinity);
- a group whose rank is killed restarts alone (its restarts count 1, the other's 0), and the
  server goes on making videos.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import wait_for
from serving import TINY_DEFAULTS, ServerProcess, expected_mp4

from wan_s2v_runner.shared import media


@pytest.fixture(scope="module")
def replicated(tiny_assets, tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas") / "server dir"
    s = ServerProcess(d, [*TINY_DEFAULTS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--nproc", "2", "--replicas", "2"])
    s.http.headers.pop("Authorization")
    s.files = {"image": ("face.png", tiny_assets.image.read_bytes(), "image/png"),
               "audio": ("voice.wav", tiny_assets.audio.read_bytes(), "audio/wav")}
    wait_for(lambda: [r["group"] for r in s.http.get("/health").json()["replicas"]] == ["idle", "idle"], 120,
             "both groups loaded", s.tail)
    yield s
    assert s.stop() == []


def _run_dir(server, index: int) -> str:
    name = "group.json" if index == 0 else f"group-{index}.json"
    return json.loads((server.dir / name).read_text())["run_dir"]


def _worker_pid(run_dir: str) -> int:
    events = (json.loads(line) for line in open(os.path.join(run_dir, "events", "rank0.jsonl")))
    return next(e["pid"] for e in events if e["kind"] == "hello")


def _affinity(pid: int) -> str:
    status = open(f"/proc/{pid}/status").read()
    return next(line.split(":")[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


@pytest.mark.slow(seconds=30)
def test_two_groups_share_the_queue_and_make_the_same_videos(replicated, engine_cpu, tiny_assets, tmp_path):
    s = replicated
    seeds = [3, 4, 5, 6]
    ids = {}
    for seed in seeds:
        r = s.http.post("/v1/videos", files=s.files, data={"seed": str(seed)})
        assert r.status_code == 200, r.text
        ids[r.json()["id"]] = seed
    for vid in ids:
        s.wait(vid, "completed", "failed", timeout=240)
    records = {vid: json.loads((s.dir / "videos" / f"{vid}.json").read_text()) for vid in ids}
    for vid, seed in ids.items():
        want = expected_mp4(engine_cpu, tiny_assets.audio, tmp_path / f"{seed}.mp4", seed=seed)
        assert s.video(vid)["status"] == "completed" and media.sha256_file(s.dir / "videos" / f"{vid}.mp4") == want

    # both groups made videos, at the same time
    made_by = {}
    for index in (0, 1):
        log = os.path.join(_run_dir(s, index), "events", "rank0.jsonl")
        made_by[index] = {e["id"] for e in map(json.loads, open(log)) if e["kind"] == "job_done"}
    assert made_by[0] and made_by[1] and made_by[0] | made_by[1] >= set(ids), made_by
    spans = sorted((r["started"], r["finished"]) for r in records.values())
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), spans  # one started before another ended

    # each group on its own core, shown in /health, /v1/server and /metrics
    health = s.http.get("/health").json()
    assert [(r["index"], r["holds"]) for r in health["replicas"]] == [(0, "CPU 0"), (1, "CPU 1")], health
    assert s.http.get("/health/ready").status_code == 200
    state = s.http.get("/v1/server").json()
    assert [(r["group"], r["rank"]) for r in state["ranks"]] == [(0, 0), (1, 0)], state["ranks"]
    assert [_affinity(_worker_pid(_run_dir(s, i))) for i in (0, 1)] == ["0", "1"]
    metrics = s.http.get("/metrics").text
    assert 'wan_s2v_rank_group_restarts_total{group="1"}' in metrics and 'group="0",state=' in metrics


@pytest.mark.slow
def test_a_group_that_fails_restarts_alone(replicated):
    s = replicated
    before = {r["index"]: r["restarts"] for r in s.http.get("/health").json()["replicas"]}
    old = _run_dir(s, 1)
    os.kill(_worker_pid(old), signal.SIGKILL)
    assert s.http.get("/health/ready").status_code == 200  # group 0 still takes jobs
    wait_for(lambda: _run_dir(s, 1) != old and s.http.get("/health").json()["replicas"][1]["group"] == "idle", 120,
             "group 1 started again", s.tail)
    after = {r["index"]: r["restarts"] for r in s.http.get("/health").json()["replicas"]}
    assert after == {0: before[0], 1: before[1] + 1}, (before, after)
    t0 = time.time()
    r = s.http.post("/v1/videos", files=s.files, data={"seed": "9"})
    assert s.wait(r.json()["id"], "completed", timeout=180)["status"] == "completed"
    assert time.time() - t0 < 180


# ----- the split itself (no server) -----
def test_the_split_gives_each_group_its_share():
    from wan_s2v_runner.serve.replicas import ReplicaError, cpu_text, split
    from wan_s2v_runner.shared.spec import GroupSpec

    gpu = GroupSpec(ckpt_dir="/ckpt", nproc=8, cfg_parallel=True, master_port=29600)
    two = split(gpu, 2, gpus=[str(i) for i in range(8)])
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in two] == ["0,1,2,3", "4,5,6,7"]
    assert [(r.spec.nproc, r.spec.cfg_parallel, r.spec.master_port) for r in two] == [(4, True, 29600),
                                                                                       (4, True, 29601)]
    assert [r.holds for r in split(gpu, 4, gpus=list("abcdefgh"))] == ["GPU a,b", "GPU c,d", "GPU e,f", "GPU g,h"]
    cpu = GroupSpec(ckpt_dir="/ckpt", device="cpu", nproc=4, threads=2)
    assert [r.spec.cpus for r in split(cpu, 2, cpus=range(8))] == ["0-3", "4-7"]
    assert [r.spec.cpu_list for r in split(cpu.model_copy(update={"cpus": "0-1,6,9"}), 2)] == [[0, 1], [6, 9]]
    assert cpu_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and split(cpu, 1)[0].spec is cpu
    for group, n, kw, why in [
        (gpu, 8, {"gpus": list("abcdefgh")}, "world size must be even"),  # CFG-parallel on 1 rank
        (gpu, 3, {"gpus": list("abcdefgh")}, "does not divide --nproc 8"),
        (gpu, 2, {"gpus": ["0", "1"]}, "needs 8 GPUs; 2 are visible"),
        (cpu, 4, {"cpus": [0, 1]}, "needs at least 4 cores"),
        (gpu.model_copy(update={"nnodes": 2}), 2, {"gpus": list("abcdefgh")}, "one node's ranks"),
    ]:
        with pytest.raises(ReplicaError, match=why) as e:
            split(group, n, **kw)
        assert "Fix:" in str(e.value)
