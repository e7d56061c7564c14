"""The live feed (:mod:`wan_s2v_runner.serve.feed`) over real HTTP: a status page's
stream sends a snapshot of the newest jobs and then only what changed; every stream shares one
read of the queue per tick; a job follower ends when its job is deleted. The diff itself is
checked on :class:`Feed` directly (no server: its read is the test's)."""
from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time

import httpx
import pytest
from conftest import STUB_RANKS, wait_for
from serving import TINY_DEFAULTS, ServerProcess

from wan_s2v_runner.serve.feed import WINDOW, Changes, Feed, Read

#: jobs in the queue before the tests: more than a page's window
FILLED = WINDOW + 50


@pytest.fixture(scope="module")
def busy_server(tiny_assets, tmp_path_factory):
    """A stub-rank server without a token whose queue holds :data:`FILLED` jobs (the stub's
    served group never runs one: the first stays in progress, the rest queued)."""
    d = tmp_path_factory.mktemp("feed") / "server dir"
    s = ServerProcess(d, [*TINY_DEFAULTS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--nproc", "1",
                          "--max-queue", "1000"], env=STUB_RANKS)
    s.http.headers.pop("Authorization")
    files = {"image": ("face.png", tiny_assets.image.read_bytes(), "image/png"),
             "audio": ("voice.wav", tiny_assets.audio.read_bytes(), "audio/wav")}
    r = s.http.post("/v1/videos", files=files, data={"prompt": "first"})
    assert r.status_code == 200, r.text
    s.files = files
    s.wait(r.json()["id"], "in_progress", timeout=60)  # the group took it: the queue moves no more
    with sqlite3.connect(d / "jobs.sqlite") as db:  # the rest as a burst of submissions would leave them
        (spec,) = db.execute("SELECT spec FROM jobs").fetchone()
        now = time.time()
        db.executemany("INSERT INTO jobs (id, status, spec, created_at) VALUES (?, 'queued', ?, ?)",
                       [(f"video_fill{i:04d}", spec, now + i * 1e-3) for i in range(FILLED - 1)])
    yield s
    assert s.stop() == []


class Stream:
    """``GET path`` as server-sent events on a thread: ``events`` is [(event, data)]."""

    def __init__(self, url: str, path: str):
        self.events: list[tuple[str, dict]] = []
        self.client = httpx.Client(base_url=url, timeout=60)
        self.thread = threading.Thread(target=self._read, args=(path,), daemon=True)
        self.stop = False
        self.socket = None  # the stream's connection, once open
        self.thread.start()

    def _read(self, path: str) -> None:
        event = None
        with self.client.stream("GET", path) as r:
            self.socket = r.extensions["network_stream"].get_extra_info("socket")
            for line in r.iter_lines():
                if self.stop:
                    return
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    self.events.append((event, json.loads(line[5:])))

    def close(self) -> None:
        """Hang up as a browser closing its tab does: the connection ends, so the server lets the
        stream go now (a client's ``close`` leaves a stream in use open until the next ping)."""
        self.stop = True
        if self.socket is not None:
            self.socket.shutdown(socket.SHUT_RDWR)
        self.client.close()

    def after(self, n: int, what: str, pred) -> tuple[str, dict]:
        """The first event after the first ``n`` that ``pred`` accepts."""
        return wait_for(lambda: next((e for e in self.events[n:] if pred(e)), None), 30, what, lambda: self.events)


@pytest.mark.slow
def test_a_page_gets_the_newest_jobs_then_only_what_changed(busy_server):
    page = Stream(busy_server.url, "/v1/events")
    try:
        kind, snap = page.after(0, "the snapshot", lambda e: True)
        assert kind == "snapshot"
        ids = [v["id"] for v in snap["videos"]]
        assert len(ids) == WINDOW and ids[-1] == f"video_fill{FILLED - 2:04d}", ids[-3:]  # the newest, oldest first
        assert snap["server"]["queue"]["queued"] + snap["server"]["queue"]["in_progress"] >= FILLED
        places = [v["queue_position"] for v in snap["videos"]]
        assert places == sorted(places) and places[-1] == snap["server"]["queue"]["queued"]

        seen = len(page.events)
        r = busy_server.submit(files=busy_server.files, prompt="newest")
        assert r.status_code == 200, r.text
        new = r.json()["id"]
        _, changes = page.after(seen, "the new job's change", lambda e: any(v["id"] == new for v in e[1]["videos"]))
        assert len(changes["videos"]) <= 2, changes  # the new job (and the counts), not every row again
        assert ids[0] in changes["gone"]  # the oldest of the window left it
        assert changes["server"]["queue"]["queued"] == snap["server"]["queue"]["queued"] + 1

        seen = len(page.events)
        assert busy_server.http.delete(f"/v1/videos/{ids[-1]}").status_code == 200
        _, changes = page.after(seen, "the deletion", lambda e: ids[-1] in e[1]["gone"])
        assert len(changes["videos"]) <= 3
    finally:
        page.close()


@pytest.mark.slow
def test_every_stream_shares_one_read_per_tick(busy_server):
    info = lambda: busy_server.http.get("/v1/server").json()  # noqa: E731
    wait_for(lambda: info()["followers"] == 0, 30, "the last test's stream to be let go")
    streams = [Stream(busy_server.url, "/v1/events") for _ in range(5)]
    streams += [Stream(busy_server.url, f"/v1/videos/video_fill{i:04d}/events") for i in (0, 10, FILLED - 3)]
    try:
        wait_for(lambda: all(s.events for s in streams), 30, "every stream's first event")
        t0, reads0 = time.time(), info()["feed_reads"]
        time.sleep(3)
        now = info()
        ticks = (time.time() - t0) / 0.25
        assert now["followers"] == 8
        assert now["feed_reads"] - reads0 <= ticks + 3, (now["feed_reads"] - reads0, ticks)  # not 8 per tick
        for s in streams[5:]:
            diff = [{k: (a.get(k), b.get(k)) for k in a if a.get(k) != b.get(k)}
                    for (_, a), (_, b) in zip(s.events, s.events[1:])]
            assert [e for e, _ in s.events] == ["video"], diff  # nothing changed: nothing more sent
    finally:
        for s in streams:
            s.close()
    wait_for(lambda: info()["followers"] == 0, 30, "the streams to be let go")


# ----- the diff, on the feed alone -----
async def _drain(lines) -> None:
    async for _ in lines:
        pass


@pytest.mark.slow
def test_a_burst_of_streams_past_the_limit_is_refused_before_any_starts(busy_server):
    """70 event streams opened at once against a limit of 64: 64 start (their first event is the
    snapshot), the other 6 get 429 with the JSON error body, before any byte of a stream."""
    import asyncio

    from wan_s2v_runner.serve.feed import MAX_FOLLOWERS

    def followers() -> int:
        return busy_server.http.get("/v1/server").json()["followers"]

    wait_for(lambda: followers() == 0, 30, "no stream open", busy_server.tail)

    async def burst() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=60, limits=limits) as client:
            go = asyncio.Event()
            answers: list = []
            opened: list = []

            async def one(i: int) -> None:
                await go.wait()
                path = "/v1/events" if i % 2 else f"/v1/videos/video_fill{i:04d}/events"
                async with client.stream("GET", path) as r:
                    kind = r.headers.get("content-type", "")
                    if r.status_code != 200:
                        answers.append((r.status_code, kind, json.loads(await r.aread())))
                        return
                    lines = r.aiter_lines()  # read on, never left: a stream left is a stream closed
                    first = ""
                    async for line in lines:
                        if line.startswith("event:"):
                            first = line[6:].strip()
                            break
                    answers.append((200, kind, {"event": first}))
                    reading = asyncio.create_task(_drain(lines))
                    while len(answers) < 70:  # every stream stays open until all 70 were answered
                        await asyncio.sleep(0.05)
                    opened.append(await asyncio.to_thread(lambda: busy_server.http.get("/v1/server").json()))
                    reading.cancel()

            tasks = [asyncio.create_task(one(i)) for i in range(70)]
            await asyncio.sleep(0.2)
            go.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return answers, opened

    answers, open_then = asyncio.run(burst())
    assert max(o["followers"] for o in open_then) == MAX_FOLLOWERS  # all the streams taken were open at once
    ok = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 429]
    assert len(ok) == MAX_FOLLOWERS and len(refused) == 70 - MAX_FOLLOWERS, [a[:2] for a in answers]
    assert all(a[1].startswith("text/event-stream") and a[2]["event"] in ("snapshot", "video") for a in ok)
    for _, kind, body in refused:  # refused before its stream: JSON, the documented error shape
        assert kind.startswith("application/json") and body["error"]["type"] == "rate_limit_error", body
        assert "event streams are open" in body["error"]["message"]
    wait_for(lambda: followers() == 0, 30, "every stream closed", busy_server.tail)


def _video(vid: str, status: str = "queued", **more) -> dict:
    return {"id": vid, "status": status, "progress": 0, **more}


def _server(**more) -> dict:
    return {"group": "ready", "uptime_s": time.time(), **more}


def test_the_feed_sends_each_follower_only_its_changes():
    import asyncio

    from wan_s2v_runner.serve.feed import Follower

    feed = Feed(server=None, window=2)
    page, job, other = Follower(), Follower("a"), Follower("z")
    feed.followers |= {page, job, other}
    feed._apply(Read(server=_server(), window=["a", "b"], videos={"a": _video("a"), "b": _video("b"), "z": None}))
    assert page.pending.server is not None and set(page.pending.videos) == {"a", "b"}
    assert other.pending.gone == {"z"}
    for f in (page, job, other):
        f.pending = Changes()
    # the clock alone (uptime, a running job's stage seconds): no change
    feed._apply(Read(server=_server(), window=["a", "b"],
                     videos={"a": _video("a"), "b": _video("b", "in_progress", stage_seconds={"load": 1.0})}))
    assert set(page.pending.videos) == {"b"} and page.pending.server is None
    page.pending = Changes()
    feed._apply(Read(server=_server(), window=["a", "b"],
                     videos={"a": _video("a"), "b": _video("b", "in_progress", stage_seconds={"load": 2.0})}))
    assert not page.pending
    # a new job pushes the oldest out; changes a slow follower did not take are merged
    feed._apply(Read(server=_server(group="loading"), window=["b", "c"],
                     videos={"b": _video("b", "in_progress"), "c": _video("c"), "a": _video("a", progress=5)}))
    feed._apply(Read(server=_server(group="ready"), window=["b", "c"],
                     videos={"b": _video("b", "in_progress"), "c": _video("c", progress=1), "a": _video("a")}))
    assert set(page.pending.videos) == {"c"} and page.pending.videos["c"]["progress"] == 1
    assert page.pending.gone == {"a"} and page.pending.server["group"] == "ready"
    assert job.pending.videos["a"]["progress"] == 0  # a job follower: its job, outside the window too
    assert feed.snapshot()["videos"] == [_video("b", "in_progress"), _video("c", progress=1)]
    changes = asyncio.run(page.next(timeout=0.01))
    assert set(changes.videos) == {"c"} and not page.pending


def test_a_follower_past_the_limit_is_refused():
    import asyncio

    from wan_s2v_runner.serve.submissions import Refused

    feed = Feed(server=None, max_followers=1)
    feed._read = lambda watched: Read(server=_server(), window=[], videos={})

    async def two():
        async with feed.follow():
            assert feed.reads == 1 and feed.full
            with pytest.raises(Refused) as e:
                async with feed.follow():
                    pass
            assert e.value.status == 429 and "event streams are open" in e.value.message
        assert not feed.followers and not feed.full

    asyncio.run(two())
