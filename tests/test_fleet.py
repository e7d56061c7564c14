"""A fleet under the faults fleets meet (issue #45), over real HTTP on loopback with a real
PostgreSQL (a throwaway cluster, tests/pg_cluster.py) and real ranks on the tiny checkpoint:

- a server frozen (SIGSTOP, its ranks with it) past its lease and then woken writes nothing into
  the shared directory once its lease is lost (every file's bytes and time compared), while the
  other server finishes the job once, byte for byte a lone run's;
- the database restarted, then stopped for 20 s, while jobs run and others are submitted: 503
  ``queue_unavailable`` with the cause and a Retry-After, ``/health`` saying why and since when
  (answering within a second), ``/health/ready`` 503, the groups going on; nothing lost, nothing
  made twice, no group restarted;
- a server with other weights refused (exit code 8, the difference named), and taken in a pool of
  its own; a shared directory that is missing, not mounted (an empty directory) or read-only
  refused (exit code 9), each with its cause.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import cli_env, run_cli, wait_for
from fault_worker import fault_env
from serving import HELD_JOB, TINY_DEFAULTS, rank0_events, shared_server

from wan_s2v_runner.launcher.proctree import pids_with_cmdline
from wan_s2v_runner.shared import exit_codes, media
from wan_s2v_runner.shared.node_agent import AGENT_MODULE

LEASE_S = 3


def _files(assets) -> dict:
    return {"image": ("face.png", assets.image.read_bytes(), "image/png"),
            "audio": ("voice.wav", assets.audio.read_bytes(), "audio/wav")}


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: (size, mtime in ns, sha256); a file or a directory removed while
    it is read (a server clearing a job's work directory) is left out (``os.walk`` skips a
    directory gone before it is listed, where ``rglob`` raised)."""
    out = {}
    paths = (Path(d) / f for d, _, files in os.walk(root) for f in files)
    for path in sorted(paths):
        try:
            if path.is_file():
                st = path.stat()
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, digest)
        except FileNotFoundError:
            continue
    return out


def _two_servers(tmp_path, tiny_assets, url, *more, env: dict | None = None):
    shared = tmp_path / "shared dir"
    shared.mkdir()
    with ThreadPoolExecutor(2) as pool:
        made = {n: pool.submit(shared_server, tmp_path / f"{n} dir" / "server", tiny_assets.ckpt_dir, url, shared,
                               LEASE_S, *more, env=env) for n in "ab"}
        return {n: f.result() for n, f in made.items()}, shared


def _tree(pid: int, server_dir: Path) -> list[int]:
    """``pid`` and every process under it, and the processes of the rank groups under ``server_dir``
    (their agent is the warm agent's child, not the server's)."""
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid, *pids_with_cmdline(AGENT_MODULE.encode(), str(server_dir).encode())]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def freeze(pid: int, server_dir: Path) -> list[int]:
    """SIGSTOP ``pid`` and everything under it and its rank groups' processes (:func:`_tree`), again
    until no process is new (one started while the others were being stopped is stopped too); the
    frozen pids, ``pid`` first."""
    frozen: list[int] = []
    for _ in range(10):
        new = [p for p in _tree(pid, server_dir) if p not in frozen]
        if not new:
            return frozen
        for p in reversed(new):  # children first
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                continue
            frozen.append(p)
        time.sleep(0.1)
    return frozen


@pytest.mark.slow(seconds=100)
def test_a_server_frozen_past_its_lease_writes_nothing_once_it_lost_the_job(cluster, tiny_assets, held_job_mp4,
                                                                            tmp_path):
    url = cluster.database()
    # the job holds at its second clip until the test releases it (a test fault): in hand when its
    # server is frozen, however fast this machine; released, both holders' ranks go on
    release = tmp_path / "frozen"
    servers, shared = _two_servers(tmp_path, tiny_assets, url,
                                   env=fault_env("0:denoise@2:wait", WAN_S2V_TEST_RELEASE=str(release)))
    frozen = []
    try:
        job = HELD_JOB
        vid = servers["b"].http.post("/v1/videos", files=_files(tiny_assets), data=job).json()["id"]
        # its first clip made (its checkpoint written), on whichever server took it
        wait_for(lambda: (v := servers["a"].video(vid))["status"] == "in_progress" and (v["clip"] or 0) >= 2
                 and v, 120, "the job's second clip", servers["a"].tail)
        name = next(n for n, s in servers.items() if s.http.get("/health").json()["current"] == vid)
        paused, other = servers[name], servers["b" if name == "a" else "a"]
        frozen = freeze(paused.proc.pid, paused.dir)  # the server, torchrun, the ranks and their encoders: a VM frozen
        release.touch()
        done = other.wait(vid, "completed", "failed", timeout=180)
        assert done["status"] == "completed" and done["attempts"] == 2 and done["resumed_at_clip"] >= 2, done
        # the other server removes the finished job's uploads just after its end is committed (what
        # the status read above can see first): the directory as it leaves it
        def left_as_finished():
            files = snapshot(shared)
            return None if any(p.startswith(f"uploads/{vid}") or ".work" in p for p in files) else files
        finished = wait_for(left_as_finished, 30, "the finished job's uploads and work removed", other.tail)
        assert f"videos/{vid}.mp4" in finished and not any(".work" in p for p in finished)
        # woken, the ranks first (a VM's processes do not wake in step): they go on with the job for
        # seconds before their server can learn it lost the job
        for pid in frozen:
            if pid != paused.proc.pid:
                os.kill(pid, signal.SIGCONT)
        time.sleep(5)
        os.kill(paused.proc.pid, signal.SIGCONT)
        # it learns it lost the job, its ranks stop it, its group takes the next one
        wait_for(lambda: "lease ran out and the job was taken back" in paused.text(), 60, "the lost lease", paused.tail)
        wait_for(lambda: (h := paused.http.get("/health").json())["current"] is None and h["group"] == "idle", 60,
                 "the woken server's group idle", paused.tail)
        time.sleep(2 * LEASE_S)  # what it would still write, it would have written by now
        assert snapshot(shared) == finished  # not a byte, not a time changed: nothing written after the loss
        assert [e["id"] for e in rank0_events(paused.dir, "job_lost")] == [vid]
        made = [e["id"] for s in servers.values() for e in rank0_events(s.dir, "job_done")]
        assert made == [vid]  # made once
        want = held_job_mp4
        assert media.sha256_file(shared / "videos" / f"{vid}.mp4") == want == done["sha256"]
        assert paused.http.get("/health").json()["restarts"] == 0
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        for s in servers.values():
            s.stop()


@pytest.mark.slow(seconds=120)
def test_a_database_restart_and_outage_lose_nothing_and_make_nothing_twice(cluster, tiny_assets, tmp_path):
    url = cluster.database()
    # every job holds at its first clip's denoising until the outage begins (a test fault): the
    # groups have their jobs in hand when the database goes, however fast this machine is
    release = tmp_path / "outage began"
    servers, shared = _two_servers(tmp_path, tiny_assets, url,
                                   env=fault_env("0:denoise@1:wait", WAN_S2V_TEST_RELEASE=str(release)))
    files = _files(tiny_assets)
    keys: dict[str, str] = {}

    def submit(i: int, s) -> str:
        """Submit job ``i`` until it is accepted: retried after a 503, its Idempotency-Key the same.
        Held until the outage begins (the test fault), then denoised while the database is away."""
        key = keys.setdefault(str(i), f"job-{i}-{uuid.uuid4().hex}")
        while True:
            r = s.http.post("/v1/videos", files=files, headers={"Idempotency-Key": key},
                            data={"seed": str(i), "infer_frames": "4", "num_clips": "2", "steps": "8"})
            if r.status_code == 200:
                return r.json()["id"]
            assert r.status_code == 503 and r.json()["error"]["code"] in ("queue_unavailable", "not_ready"), r.text
            time.sleep(float(r.headers["Retry-After"]) / 5)

    try:
        ids = [submit(i, servers["ab"[i % 2]]) for i in range(4)]
        wait_for(lambda: all(s.http.get("/health").json()["current"] for s in servers.values()), 120,
                 "both groups working", servers["a"].tail)
        cluster.restart()  # a failover: every connection cut
        ids.append(submit(4, servers["a"]))
        assert submit(4, servers["b"]) == ids[-1]  # the same request again: the same job, not a second
        cluster.halt()
        t_down = time.time()
        release.touch()
        try:
            a = servers["a"]
            wait_for(lambda: a.http.get("/health").json()["status"] == "degraded", 10, "the outage seen", a.tail)
            t0 = time.time()
            health = a.http.get("/health")
            assert time.time() - t0 < 1.0 and health.status_code == 200
            state = health.json()["queue_state"]
            assert not state["up"] and "does not answer" in state["error"] and state["down_since"] >= t_down - 2
            t0 = time.time()
            ready = a.http.get("/health/ready")
            assert time.time() - t0 < 1.0 and ready.status_code == 503 and "queue is unavailable" in ready.text
            r = a.http.post("/v1/videos", files=files, data={"seed": "99"})
            assert r.status_code == 503 and r.headers["Retry-After"], r.text
            assert r.json()["error"]["code"] == "queue_unavailable"
            r = servers["b"].http.get(f"/v1/videos/{ids[0]}")
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
            assert "does not answer" in r.json()["error"]["message"] and r.headers["Retry-After"]
            # a client submitting now: wan-s2v submit sends the same request again until it is taken
            client = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "submit", "--url", a.url, "--no-wait",
                                       "--image", str(tiny_assets.image), "--audio", str(tiny_assets.audio),
                                       "--seed", "77", "--infer-frames", "4", "--num-clips", "1", "--steps", "2"],
                                      env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(max(0.0, 20 - (time.time() - t_down)))  # 20 s without a database
            for s in servers.values():  # nothing restarted, and the groups went on denoising meanwhile
                h = s.http.get("/health").json()
                assert h["restarts"] == 0 and h["group"] in ("working", "idle"), h
            # no job made a step before the release, which came after the database went away
            steps = [e for s in servers.values() for e in rank0_events(s.dir, "progress")
                     if t_down < e["t"] < t_down + 20]
            assert steps, "no denoising step was made while the database was away"
        finally:
            cluster.start()
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0 and out.strip().startswith("video_"), err
        assert "sending it again" in err and "does not answer" in err, err
        ids.append(out.strip())
        for vid in ids:
            done = servers["b"].wait(vid, "completed", "failed", "cancelled", timeout=300)
            assert done["status"] == "completed", done
        listed = [v["id"] for v in servers["a"].videos()]
        assert sorted(listed) == sorted(ids)  # nothing lost, nothing doubled by the retries
        made = [e["id"] for s in servers.values() for e in rank0_events(s.dir, "job_done")]
        assert sorted(made) == sorted(ids)  # each made once: no lease was handed over by the outage
        for s in servers.values():
            h = s.http.get("/health").json()
            assert h["restarts"] == 0 and h["status"] == "ok" and h["queue_state"]["up"], h
        assert s.http.get("/health/ready").status_code == 200
    finally:
        for s in servers.values():
            s.stop()
    assert not any((shared / "uploads").iterdir())  # every ended job's uploads went


def _serve(server_dir: Path, ckpt: Path, url: str, shared: Path, *more: str):
    """``wan-s2v serve`` on the fleet, expected to be refused before it serves: its result."""
    server_dir.mkdir(parents=True, exist_ok=True)
    return run_cli(["serve", *TINY_DEFAULTS, "--ckpt-dir", str(ckpt), "--nproc", "1", "--queue", url,
                    "--shared-dir", str(shared), "--lease-s", str(LEASE_S), "--server-dir", str(server_dir),
                    "--port", "0", "--skip-preflight", *more], cwd=server_dir, timeout=120)


@pytest.mark.slow(seconds=60)
def test_one_fleet_one_model_and_a_shared_directory_that_is_shared(cluster, tiny_assets, tmp_path):
    from wan_s2v_runner.demo.tiny_checkpoint import build_tiny_checkpoint

    url = cluster.database()
    shared = tmp_path / "shared dir"
    shared.mkdir()
    first = shared_server(tmp_path / "first" / "server", tiny_assets.ckpt_dir, url, shared, LEASE_S)
    try:
        marker = json.loads((shared / ".wan-s2v-fleet.json").read_text())  # the fleet and its queue, named
        assert len(marker["fleet"]) == 32 and marker["queue"] == url
        # other weights (the same shapes, another seed): refused, the difference named
        other = build_tiny_checkpoint(tmp_path / "other ckpt", seed=1)  # the demo's is seed 0
        r = _serve(tmp_path / "other" / "server", other, url, shared)
        assert r.returncode == exit_codes.FLEET_MISMATCH, r.output
        line = [x for x in r.stderr.splitlines() if x.startswith("error:")][-1]
        assert "weights (dit, t5, vae, wav2vec2)" in line and "pool 'default'" in line and "--pool NAME" in line
        # ... and taken in a pool of its own: it claims only that pool's jobs
        lora = shared_server(tmp_path / "pooled" / "server", other, url, shared, LEASE_S, "--pool", "other-weights")
        try:
            vid = lora.http.post("/v1/videos", files=_files(tiny_assets), data={"steps": "1"}).json()["id"]
            done = first.wait(vid, "completed", "failed", timeout=120)
            assert done["status"] == "completed" and done["pool"] == "other-weights", done
            assert done["identity"] == lora.http.get("/health").json()["queue_state"]["identity"]
            assert done["identity"] != first.http.get("/health").json()["queue_state"]["identity"]
            assert [e["id"] for e in rank0_events(lora.dir, "job_done")] == [vid]
            record = (shared / "videos" / f"{vid}.json").read_text()
            assert done["identity"] in record and '"pool": "other-weights"' in record
        finally:
            lora.stop()

        # the shared directory: missing, not mounted (an empty directory where the mount should be), read-only
        r = _serve(tmp_path / "s1" / "server", tiny_assets.ckpt_dir, url, tmp_path / "nowhere")
        assert r.returncode == exit_codes.SHARED_DIR and "is missing" in r.stderr, r.output
        empty = tmp_path / "empty mount point"
        empty.mkdir()
        r = _serve(tmp_path / "s2" / "server", tiny_assets.ckpt_dir, url, empty)
        assert r.returncode == exit_codes.SHARED_DIR, r.output
        assert "no fleet marker" in r.stderr and "not mounted" in r.stderr, r.output
        assert not any(empty.iterdir())  # nothing written where the mount should be
    finally:
        first.stop()


@pytest.mark.slow(seconds=30)
def test_a_read_only_shared_directory_is_refused_and_one_that_goes_read_only_stops_claims(cluster, tiny_assets,
                                                                                        tmp_path):
    """A read-only mount of the fleet's shared directory (a bind mount: the tests run as root)."""
    url = cluster.database()
    shared, ro = tmp_path / "shared dir", tmp_path / "read-only view"
    shared.mkdir()
    ro.mkdir()
    first = shared_server(tmp_path / "first" / "server", tiny_assets.ckpt_dir, url, shared, LEASE_S)
    try:
        mounted = subprocess.run(["mount", "--bind", str(shared), str(ro)], capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"no bind mounts here ({mounted.stderr.strip()}): a read-only directory cannot be made")
        try:
            assert subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)]).returncode == 0
            r = _serve(tmp_path / "s3" / "server", tiny_assets.ckpt_dir, url, ro)
            assert r.returncode == exit_codes.SHARED_DIR and "read-only" in r.stderr, r.output
        finally:
            subprocess.run(["umount", str(ro)])
        # the shared directory of a running server goes away (unmounted): not ready, no claims, uploads 503
        hidden = tmp_path / "hidden"
        shutil.move(str(shared), str(hidden))
        shared.mkdir()  # an empty directory where the mount was
        wait_for(lambda: first.http.get("/health/ready").status_code == 503, 20, "not ready", first.tail)
        h = first.http.get("/health").json()
        assert h["status"] == "degraded" and "no fleet marker" in h["queue_state"]["shared_dir_problem"]
        r = first.http.post("/v1/videos", files=_files(tiny_assets), data={"steps": "1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and str(shared) not in r.text
        shared.rmdir()
        shutil.move(str(hidden), str(shared))  # mounted again
        wait_for(lambda: first.http.get("/health/ready").status_code == 200, 20, "ready again", first.tail)
    finally:
        first.stop()


def test_the_identity_names_what_differs():
    from wan_s2v_runner.serve.fleet import differences, digest_of

    a = {"weights": {"dit": "1", "t5": "2"}, "engine": "e", "settings": {"device": "cpu", "loras": []}}
    b = {"weights": {"dit": "9", "t5": "2"}, "engine": "e", "settings": {"device": "cpu", "loras": [["x", 1.0]]}}
    assert differences(a, b) == ["weights (dit)", "frame-deciding settings (loras)"]
    assert digest_of(a) == digest_of(dict(reversed(list(a.items())))) != digest_of(b)



def test_a_live_group_never_joins_a_clip_groups_pool_on_any_device(tmp_path):
    """Another recipe is another video: a live group (--mode live) and a clip group with the same
    weights have different identities on the CPU as on a GPU (the CPU's identity names no layout),
    so a CPU live server is refused by the clip servers' pool, naming the recipe."""
    from wan_s2v_runner.serve.fleet import digest_of, frame_settings, mismatch
    from wan_s2v_runner.serve.store.sqlite import SqliteJobStore
    from wan_s2v_runner.shared.spec import GroupSpec

    def identity(**kw):
        return {"weights": {"dit": "w"}, "checkpoint": "c", "engine": "e",
                "settings": frame_settings(GroupSpec(ckpt_dir="/x", **kw))}

    for device in ("cpu", "cuda"):
        clips, live = identity(device=device, nproc=2), identity(device=device, mode="live", nproc=2)
        assert digest_of(clips) != digest_of(live) and live["settings"]["recipe"] == "live", device
        assert "recipe" not in clips["settings"]  # a clip pool recorded before keeps its identity
    cpu = [identity(device="cpu", mode=m, nproc=2) for m in ("ulysses", "fsdp-fixed", "hybrid")]
    assert len({digest_of(i) for i in cpu}) == 1  # on the CPU every layout of the clips makes one video

    store = SqliteJobStore(tmp_path / "jobs.sqlite")
    clips, live = identity(device="cpu"), identity(device="cpu", mode="live")
    assert store.pool_join(digest_of(clips), clips, "clip-server").created_pool
    joined = store.pool_join(digest_of(live), live, "live-server")
    assert not joined.matches(digest_of(live)) and joined.pool.joined_by == "clip-server"
    assert "frame-deciding settings (recipe) differ from pool 'default'" in mismatch(joined, live, "default")
