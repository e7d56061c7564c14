"""One queue across servers (``wan-s2v serve --queue postgresql://... --shared-dir DIR``) against a
real PostgreSQL: a throwaway cluster of Debian's package (tests/pg_cluster.py; skipped, with the
reason, only where it cannot run), a fresh database per test.

- What only the shared store does (:class:`~wan_s2v_runner.serve.store.postgres.PgJobStore`;
  the contract both stores keep is tests/test_store_contract.py): leases renewed and reaped, a
  claim whose answer was lost found again, the database's clock, the schema migrated from its
  first version.
- Two real servers (one real rank each, the tiny checkpoint) on loopback: a 3-clip job's server is
  killed -9 (with its ranks) while the job is held at its second clip (a test fault); the other
  server takes the job when the lease runs out and finishes it from its clip checkpoint, with the
  bytes of an uninterrupted run, once; both answer for it; the killed server started again on the
  same database loses nothing. Then 50 submissions from 10 clients spread over both: every
  accepted one completes exactly once.
"""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import wait_for
from fault_worker import fault_env
from serving import HELD_JOB, rank0_events, shared_server

from wan_s2v_runner.serve.store.protocol import Beat, Held, JobStatus
from wan_s2v_runner.shared import media

LEASE_S = 3


def test_the_shared_store_leases_clocks_and_schema(cluster):
    """What only the shared store does (the contract both keep: tests/test_store_contract.py):
    leases renewed by the heartbeat and reaped when they run out, a claim whose answer was lost
    found again instead of made twice, the database's clock for every time in the table, a
    schema migrated from its first version, and a wan-s2v older than the schema refused."""
    import psycopg

    from wan_s2v_runner.serve.store import postgres
    from wan_s2v_runner.serve.store.postgres import PgJobStore

    url = cluster.database()
    with psycopg.connect(url, autocommit=True) as db:  # a queue made by the first schema, with a job in it
        db.execute("CREATE TABLE wan_s2v_schema (version INTEGER NOT NULL)")
        db.execute("INSERT INTO wan_s2v_schema VALUES (1)")
        for sql in postgres.MIGRATIONS[1]:
            db.execute(sql)
        db.execute("INSERT INTO jobs (id, status, spec, created_at, runs) VALUES ('old', 'queued', '{}', 1, 1)")
    a, b = PgJobStore(url, "a", lease_s=1), PgJobStore(url, "b", lease_s=1)
    assert a.migrate() == b.migrate() == postgres.SCHEMA_VERSION  # made once, then only read
    old = a.job_get("old")
    assert old.attempt == 1 and old.pool == "default"  # the first schema's row, in the new one
    assert a.job_claim_next().id == "old" and a.job_claim_next() is None
    a.job_insert("k1", {}, 10)
    a.job_insert("k2", {}, 10)
    k1, k2 = a.job_claim_next(), b.job_claim_next()
    assert (k1.id, k2.id) == ("k1", "k2")
    for _ in range(3):  # b renews its own; a's (and "old"'s) run out
        time.sleep(0.5)
        assert b.lease_renew({"k2": Held(k2.attempt, {"clip": 1})}) == Beat()
    assert sorted(b.lease_reap().requeued) == ["k1", "old"] and b.job_get("k2").status is JobStatus.IN_PROGRESS
    assert a.job_get("k2").progress == {"clip": 1}  # what the other servers show
    assert a.lease_renew({"k1": Held(k1.attempt)}).lost == {"k1"}  # reaped: lost even before another claim
    # a claim whose answer was lost is found again, not made twice
    a.job_insert("k3", {}, 10)
    a._unsure_claim = "lost-answer"
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE jobs SET status = 'in_progress', owner = 'a', attempt = attempt + 1, "
                   "claim_id = 'lost-answer' WHERE id = 'k3'")
    assert a.job_claim_next().id == "k3" and a._unsure_claim is None
    with psycopg.connect(url, autocommit=True) as db:  # its lease renewed from now: it dated from the lost claim
        (left,) = db.execute(f"SELECT lease_until - {postgres._NOW} FROM jobs WHERE id = 'k3'").fetchone()
    assert 0 < left <= a.lease_s
    # each keeper of a server holds its jobs under its own name; the server takes all back at start
    k0 = b.store_for_keeper(0)
    held = k0.job_claim_next()
    assert held is not None and held.id in ("k1", "old")
    again = PgJobStore(url, "b", lease_s=30)
    assert held.id in again.job_recover() and not k0.job_finish(held.id, held.attempt, JobStatus.COMPLETED)
    # a job deleted while a server that died held it: the row goes with the lease
    held = k0.job_claim_next()
    assert a.job_delete(held.id) is JobStatus.IN_PROGRESS
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE jobs SET lease_until = 0 WHERE id = %s", (held.id,))
    assert held.id in again.lease_reap().deleted and a.job_get(held.id) is None
    # every time in the table is the database's clock: a server an hour out changes none of them
    with psycopg.connect(url, autocommit=True) as db:
        (db_now,) = db.execute(f"SELECT {postgres._NOW}").fetchone()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(time, "time", lambda: float(db_now) + 3600)
        a.job_insert("t1", {}, 10)
        assert a.job_cancel("t1") is JobStatus.CANCELLED
    row = a.job_get("t1")
    assert abs(row.created_at - float(db_now)) < 60 and abs(row.finished_at - float(db_now)) < 60, row
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE wan_s2v_schema SET version = 99")
    with pytest.raises(RuntimeError, match="schema is version 99"):
        PgJobStore(url, "c", lease_s=30)
    for s in (a, b, again, k0):
        s.close()


def _shared_server(name, tmp_path, tiny_assets, url, env=None):
    (tmp_path / "shared dir").mkdir(exist_ok=True)  # the fleet's mount: never made by a server
    return shared_server(tmp_path / name, tiny_assets.ckpt_dir, url, tmp_path / "shared dir", LEASE_S, env=env)


def _job_done_events(server_dir) -> list[str]:
    return [e["id"] for e in rank0_events(server_dir, "job_done")]


@pytest.mark.slow(seconds=90)
def test_two_servers_share_one_queue_and_a_lost_server_loses_nothing(cluster, tiny_assets, held_job_mp4, tmp_path):
    from wan_s2v_runner.serve.leftovers import group_processes

    url = cluster.database()
    (tmp_path / "a dir").mkdir()
    (tmp_path / "b dir").mkdir()
    # the job holds at its second clip until the test releases it (a test fault): still running
    # when its server is killed, however fast this machine; the other server's resumed run goes on
    release = tmp_path / "server lost"
    env = fault_env("0:denoise@2:wait", WAN_S2V_TEST_RELEASE=str(release))
    with ThreadPoolExecutor(2) as pool:  # both start at once
        started = {n: pool.submit(_shared_server, f"{n} dir/server", tmp_path, tiny_assets, url, env) for n in "ab"}
        servers = {n: f.result() for n, f in started.items()}
    files = {"image": ("face.png", tiny_assets.image.read_bytes(), "image/png"),
             "audio": ("voice.wav", tiny_assets.audio.read_bytes(), "audio/wav")}
    try:
        job = HELD_JOB
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
        release.touch()
        done = kept.wait(vid, "completed", "failed", timeout=180)
        assert done["status"] == "completed", done
        assert done["attempts"] == 2 and done["resumed_at_clip"] >= 2, done
        assert time.time() - t_lost < 120
        want = held_job_mp4
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
