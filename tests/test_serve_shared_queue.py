"""One queue across servers (``wan-s2v serve --queue postgresql://... --shared-dir DIR``) against a
real PostgreSQL: a throwaway cluster of Debian's package (tests/pg_cluster.py; skipped, with the
reason, only where it cannot run), a fresh database per test.

- The store itself (:class:`~wan_s2v_runner.launcher.serve.pg_queue.PgJobQueue`): the schema made
  once at its version; two servers claiming at once never take the same job; a lease that runs
  out gives the job back, and its old holder can no longer end it; a cancel asked anywhere reaches
  the holder's heartbeat; a server started again takes its own jobs back at once.
- Two real servers (one real rank each, the tiny checkpoint) on loopback: a 3-clip job's server is
  killed -9 (with its ranks) after its first clip; the other server takes the job when the lease
  runs out and finishes it from its clip checkpoint, with the bytes of an uninterrupted run, once;
  both answer for it; the killed server started again on the same database loses nothing. Then
  50 submissions from 10 clients spread over both: every accepted one completes exactly once.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import wait_for
from serving import TINY_DEFAULTS, ServerProcess, expected_mp4

from wan_s2v_runner.launcher.serve.queue import Beat, JobStatus, Reaped
from wan_s2v_runner.shared import media

LEASE_S = 3


@pytest.fixture(scope="module")
def cluster():
    import pg_cluster

    c = pg_cluster.start()
    if isinstance(c, str):
        pytest.skip(c)
    yield c
    c.stop()


def test_the_store_shared_by_two_servers(cluster):
    from wan_s2v_runner.launcher.serve import pg_queue
    from wan_s2v_runner.launcher.serve.pg_queue import PgJobQueue

    # two servers claiming at once: every job taken once, by one of them
    url = cluster.database()
    a, b = PgJobQueue(url, "a", lease_s=1), PgJobQueue(url, "b", lease_s=1)
    assert a.migrate() == b.migrate() == pg_queue.SCHEMA_VERSION  # made once, then only read
    for i in range(20):
        a.add(f"j{i:02d}", {"n": i}, max_queued=100)
    claimed: dict[str, list[str]] = {"a": [], "b": []}

    def drain(store, name):
        while (row := store.claim_next()) is not None:
            claimed[name].append(row.id)

    threads = [threading.Thread(target=drain, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed["a"] + claimed["b"]) == [f"j{i:02d}" for i in range(20)]
    for s in (a, b):
        s.close()

    # leases: a's runs out (no heartbeat), b renews its own
    url = cluster.database()
    a, b = PgJobQueue(url, "a", lease_s=1), PgJobQueue(url, "b", lease_s=1)
    a.add("k1", {}, 10)
    a.add("k2", {}, 10)
    assert a.claim_next().id == "k1" and b.claim_next().id == "k2" and b.claim_next() is None
    for _ in range(3):
        time.sleep(0.5)
        assert b.heartbeat({"k2": {"clip": 1}}) == Beat()
    assert b.reap() == Reaped(requeued=("k1",)) and b.get("k2").status is JobStatus.IN_PROGRESS
    assert a.heartbeat({"k1": None}).lost == {"k1"}  # a hears it holds k1 no more: it stops it
    assert not a.finish("k1", JobStatus.COMPLETED)  # and cannot end it
    assert a.get("k1").status is JobStatus.QUEUED
    again = b.claim_next()
    assert again.id == "k1" and again.runs == 2  # back in the queue, taken again
    assert b.cancel("k2") is JobStatus.IN_PROGRESS and "k2" in b.heartbeat({"k2": {"clip": 2}}).cancel
    assert a.get("k2").progress == {"clip": 2}  # what the other servers show
    b2 = PgJobQueue(url, "b", lease_s=30)  # b started again: its own jobs back at once
    assert sorted(b2.recover()) == ["k1", "k2"]
    # each keeper of a server holds its jobs under its own name; the server takes all back at start
    a.add("k3", {}, 10)
    a.add("k4", {}, 10)
    k0, k1 = b2.for_keeper(0), b2.for_keeper(1)
    first, second = k0.claim_next(), k1.claim_next()
    assert {first.id, second.id} <= {"k1", "k2", "k3", "k4"} and first.id != second.id
    assert k1.heartbeat({first.id: None}).lost == {first.id} and not k1.finish(first.id, JobStatus.FAILED)
    assert sorted(b2.recover()) == sorted([first.id, second.id])
    # a job deleted while a server that died held it: the row goes with the lease
    held = k0.claim_next()
    assert a.delete(held.id) is JobStatus.IN_PROGRESS
    with b2._db.transaction():
        b2._db.execute("UPDATE jobs SET lease_until = 0 WHERE id = %s", (held.id,))
    assert held.id in b2.reap().deleted and a.get(held.id) is None
    # every time in the table is the database's clock: a server an hour out changes none of them
    (db_now,) = a._db.execute(f"SELECT {pg_queue._NOW} AS t").fetchone().values()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(time, "time", lambda: float(db_now) + 3600)
        a.add("t1", {}, 10)
        assert a.cancel("t1") is JobStatus.CANCELLED
    row = a.get("t1")
    assert abs(row.created_at - float(db_now)) < 60 and abs(row.finished_at - float(db_now)) < 60, row
    with b2._db.transaction():
        b2._db.execute("UPDATE wan_s2v_schema SET version = 99")
    with pytest.raises(RuntimeError, match="schema is version 99"):
        PgJobQueue(url, "c", lease_s=30)
    for s in (a, b, b2, k0, k1):
        s.close()


def _shared_server(name, tmp_path, tiny_assets, url):
    s = ServerProcess(tmp_path / name, [*TINY_DEFAULTS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--nproc", "1",
                                        "--queue", url, "--shared-dir", str(tmp_path / "shared dir"),
                                        "--lease-s", str(LEASE_S)])
    s.http.headers.pop("Authorization")
    wait_for(lambda: s.http.get("/health").json()["group"] == "idle", 120, f"{name}'s group", s.tail)
    return s


def _job_done_events(server_dir) -> list[str]:
    return [e["id"] for log in server_dir.glob("runs/*/events/rank0.jsonl")
            for e in map(json.loads, log.read_text().splitlines()) if e["kind"] == "job_done"]


@pytest.mark.slow(seconds=90)
def test_two_servers_share_one_queue_and_a_lost_server_loses_nothing(cluster, tiny_assets, engine_cpu, tmp_path):
    from wan_s2v_runner.launcher.serve.keeper import group_processes

    url = cluster.database()
    (tmp_path / "a dir").mkdir()
    (tmp_path / "b dir").mkdir()
    with ThreadPoolExecutor(2) as pool:  # both start at once
        started = {n: pool.submit(_shared_server, f"{n} dir/server", tmp_path, tiny_assets, url) for n in "ab"}
        servers = {n: f.result() for n, f in started.items()}
    files = {"image": ("face.png", tiny_assets.image.read_bytes(), "image/png"),
             "audio": ("voice.wav", tiny_assets.audio.read_bytes(), "audio/wav")}
    try:
        job = {"seed": "8", "infer_frames": "4", "num_clips": "3", "steps": "16"}
        vid = servers["b"].http.post("/v1/videos", files=files, data=job).json()["id"]
        # its first clip made (its checkpoint written), on whichever server took it
        wait_for(lambda: (v := servers["a"].video(vid))["status"] == "in_progress" and (v["clip"] or 0) >= 2
                     and v, 120, "the job's second clip", servers["a"].tail)
        running = next(n for n, s in servers.items() if s.http.get("/health").json()["current"] == vid)
        lost, kept = servers[running], servers["b" if running == "a" else "a"]
        group = lost.group_dir()
        lost.proc.kill()  # the server and its machine, gone: kill -9, and its ranks with it
        for pid in group_processes(group):
            os.kill(pid, signal.SIGKILL)
        t_lost = time.time()
        done = kept.wait(vid, "completed", "failed", timeout=180)
        assert done["status"] == "completed", done
        assert done["attempts"] == 2 and done["resumed_at_clip"] >= 2, done
        assert time.time() - t_lost < 120
        want = expected_mp4(engine_cpu, tiny_assets.audio, tmp_path / "want.mp4", seed=8, infer_frames=4,
                            num_clips=3, steps=16)
        got = kept.http.get(f"/v1/videos/{vid}/content")
        (tmp_path / "got.mp4").write_bytes(got.content)
        assert media.sha256_file(tmp_path / "got.mp4") == want  # the uninterrupted run's bytes
        assert _job_done_events(kept.dir).count(vid) == 1

        lost.restart()  # the same server again, on the same database and directories (its group loads meanwhile)
        lost.http.headers.pop("Authorization", None)
        assert lost.video(vid)["status"] == "completed" and lost.video(vid)["sha256"] == done["sha256"]

        # 50 submissions from 10 clients, spread over both servers: none lost, none made twice
        def submit(i: int):
            s = servers["a" if i % 2 else "b"]
            r = s.http.post("/v1/videos", files=files, data={"seed": str(100 + i), "steps": "1", "infer_frames": "4",
                                                             "num_clips": "1"})
            return r.status_code, r.json()
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(submit, range(50)))
        accepted = [body["id"] for code, body in answers if code == 200]
        assert len(accepted) == 50, [a for a in answers if a[0] != 200][:3]
        # every server restarted on the same database while the 50 are being made: nothing lost
        wait_for(lambda: sum(v["status"] == "completed" for v in servers["a"].videos() if v["id"] in accepted) >= 4,
                 120, "the first of the 50", servers["a"].tail)
        with ThreadPoolExecutor(2) as pool:
            assert any(v["status"] != "completed" for v in servers["b"].videos() if v["id"] in accepted)
            assert list(pool.map(lambda s: s.stop(), servers.values())) == [[], []]  # SIGTERM: no rank left
            list(pool.map(lambda s: s.restart(), servers.values()))
        for s in servers.values():
            s.http.headers.pop("Authorization", None)
        assert {v["id"] for v in servers["b"].videos()} >= {vid, *accepted}
        for jid in accepted:
            servers["a"].wait(jid, "completed", "failed", timeout=300)
        listed = {v["id"]: v["status"] for v in servers["b"].videos()}
        assert all(listed[j] == "completed" for j in accepted)
        made = _job_done_events(servers["a"].dir) + _job_done_events(servers["b"].dir)
        assert sorted(j for j in made if j in set(accepted)) == sorted(accepted)  # each exactly once
        assert {j for j in made if j in set(accepted)} & set(_job_done_events(servers["a"].dir))
        assert {j for j in made if j in set(accepted)} & set(_job_done_events(servers["b"].dir))
    finally:
        for s in servers.values():
            s.stop()
    assert not list((tmp_path / "shared dir" / "uploads").iterdir())  # every ended job's uploads went
