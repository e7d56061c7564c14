"""The server's live feed: one read of the queue per tick, shared by every event stream, and
what changed since the last read sent to each follower.

Every open status page (``GET /v1/events``) and every job follower (``GET /v1/videos/{id}/events``)
is a :class:`Follower` of the server's one :class:`Feed`. While any follower is connected, the
feed reads, every :data:`TICK_S`, the newest :data:`WINDOW` jobs (the primary key's order), the
counts by status (the status index), the queue places of the queued ones (one pass over the
status index) and the jobs followed outside that window, on one worker thread. It compares each
video object with the last one read and hands every follower only what changed: a page gets the
changed videos, the ids that left the window (deleted, or pushed out by newer jobs) and the
server's state when it changed; a job follower gets its job. So the work per tick does not grow
with the followers, and a page's traffic does not grow with the jobs in the queue.

What moves with the clock alone (a running job's stage seconds, the uptime) is not a change. A
follower that reads slower than the feed ticks gets the changes merged, never a backlog. The
followers are bounded (:data:`MAX_FOLLOWERS`): a stream takes its place (:meth:`Feed.reserve`, a
:class:`Ticket`) on the event loop before it starts, so a burst of streams opened at once never
passes the limit, and the ones over it are refused with 429 before any of their stream is sent.
While the queue is unavailable the feed skips its reads and the streams stay open; they hear
again once it answers.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from starlette.concurrency import run_in_threadpool

from wan_s2v_runner.serve.state import Server, server_state, video_objects
from wan_s2v_runner.serve.store.protocol import JobStatus, QueueUnavailable
from wan_s2v_runner.serve.store.rules import PAGE_MAX
from wan_s2v_runner.serve.submissions import Refused

log = logging.getLogger("wan_s2v.serve")

#: how often the feed reads the queue while anyone follows it
TICK_S = 0.25
#: the newest jobs a page follows (as many as one page of ``GET /v1/videos`` holds)
WINDOW = PAGE_MAX
#: event streams open at once (pages and job followers together)
MAX_FOLLOWERS = 64


def settled(video: dict[str, Any]) -> dict[str, Any]:
    """A video object without what moves with the clock alone (a running job's stage seconds)."""
    return {k: v for k, v in video.items() if k != "stage_seconds" or video["status"] != JobStatus.IN_PROGRESS}


def _server_view(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "uptime_s"}


@dataclass
class Changes:
    """What a follower has not been sent yet: the server's state (when it changed), the video
    objects that changed (by id) and the ids that left what it follows."""

    server: Optional[dict[str, Any]] = None
    videos: dict[str, dict[str, Any]] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return self.server is not None or bool(self.videos) or bool(self.gone)

    def merge(self, later: Changes) -> None:
        if later.server is not None:
            self.server = later.server
        for vid, obj in later.videos.items():
            self.videos[vid] = obj
            self.gone.discard(vid)
        for vid in later.gone:
            self.videos.pop(vid, None)
            self.gone.add(vid)


class FeedFailed(Exception):
    """The feed's read failed: every stream ends with this (``event: error``)."""


class Ticket:
    """A stream's place among the feed's followers, taken before the stream starts; it becomes
    the follower (:meth:`Feed.follow`) or is given back (:meth:`release`, at the request's end)."""

    def __init__(self, feed: "Feed"):
        self.feed, self.used, self.released = feed, False, False

    def release(self) -> None:
        if not self.used and not self.released:
            self.released = True
            self.feed.reserved -= 1


class Follower:
    """One event stream: the whole window (``watch`` None: a page) or one job."""

    def __init__(self, watch: Optional[str] = None):
        self.watch = watch
        self.pending = Changes()
        self.failed: Optional[str] = None
        self._wake = asyncio.Event()

    def push(self, changes: Changes) -> None:
        self.pending.merge(changes)
        self._wake.set()

    def fail(self, message: str) -> None:
        self.failed = message
        self._wake.set()

    async def next(self, timeout: float) -> Changes:
        """What changed since the last call (empty after ``timeout`` with no change)."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()
        if self.failed is not None:
            raise FeedFailed(self.failed)
        out, self.pending = self.pending, Changes()
        return out


@dataclass
class Read:
    """One tick's read: the server's state, the window's ids (oldest first) and the video
    objects of the window and of the jobs followed outside it (None: no such job now)."""

    server: dict[str, Any]
    window: list[str]
    videos: dict[str, Optional[dict[str, Any]]]


class Feed:
    """The one reader behind every event stream of ``server`` (see the module's docstring)."""

    def __init__(self, server: Server, tick_s: float = TICK_S, window: int = WINDOW,
                 max_followers: int = MAX_FOLLOWERS):
        self.server, self.tick_s, self.window_size, self.max_followers = server, tick_s, window, max_followers
        self.followers: set[Follower] = set()
        self.reserved = 0  # places taken by streams that have not started following yet
        self.reads = 0  # reads of the queue so far (/v1/server: shared, not one per follower)
        self._state: Optional[dict[str, Any]] = None
        self._window: list[str] = []
        self._videos: dict[str, dict[str, Any]] = {}
        self._views: dict[str, dict[str, Any]] = {}
        self._task: Optional[asyncio.Task] = None
        self._starting = asyncio.Lock()
        self._reading = asyncio.Lock()

    @property
    def full(self) -> Optional[str]:
        """Why one more follower is refused (None: it is taken)."""
        if len(self.followers) + self.reserved < self.max_followers:
            return None
        return (f"{len(self.followers) + self.reserved} event streams are open (the server takes "
                f"{self.max_followers}). Fix: close one, or poll GET /v1/videos/{{id}}")

    def reserve(self) -> Ticket:
        """A place for one more stream (on the event loop: the check and the taking are one step),
        or :class:`Refused` 429."""
        why = self.full
        if why is not None:
            raise Refused(429, why, retry_after=5)
        self.reserved += 1
        return Ticket(self)

    # ----- the read (a worker thread) -----
    def _read(self, watched: set[str]) -> Read:
        queue = self.server.queue
        rows = queue.job_list(limit=self.window_size)
        window = [r.id for r in rows]
        extra = [row for vid in watched - set(window) if (row := queue.job_get(vid)) is not None and not row.deleting]
        objects = video_objects(self.server, rows + extra)
        state = server_state(self.server, counts=queue.job_counts()).model_dump(mode="json")
        videos: dict[str, Optional[dict[str, Any]]] = dict.fromkeys(watched)
        videos.update({o.id: o.model_dump(mode="json") for o in objects})
        return Read(server=state, window=window, videos=videos)

    # ----- what changed (the event loop) -----
    def _apply(self, read: Read) -> None:
        self.reads += 1
        server = read.server if self._state is None or _server_view(read.server) != _server_view(self._state) else None
        self._state = read.server
        changed = {}
        for vid, obj in read.videos.items():
            if obj is None:
                continue
            view = settled(obj)
            if self._views.get(vid) != view:
                changed[vid] = obj
            self._views[vid] = view
        in_window = set(read.window)
        left = [vid for vid in self._window if vid not in in_window]
        self._window = read.window
        self._videos = {vid: obj for vid, obj in read.videos.items() if obj is not None}
        for vid in list(self._views):
            if vid not in self._videos:
                del self._views[vid]
        page = Changes(server=server, videos={v: o for v, o in changed.items() if v in in_window}, gone=set(left))
        for f in self.followers:
            if f.watch is None:
                if page:
                    f.push(page)
            elif f.watch not in read.videos:  # a read that began before it followed: nothing said
                continue
            elif f.watch not in self._videos:
                f.push(Changes(gone={f.watch}))
            else:  # every tick: the stream sends it only when it differs from what it sent
                f.push(Changes(videos={f.watch: self._videos[f.watch]}))

    def _server_alone(self) -> dict[str, Any]:
        """The server's state without asking the queue (its counts as the watch last read them)."""
        seen = self.server.watch.seen
        counts = seen.counts if seen.counts is not None else {st.value: 0 for st in JobStatus}
        return server_state(self.server, counts=counts).model_dump(mode="json")

    def _apply_server(self, state: dict[str, Any]) -> None:
        """A read of the server alone (the queue away): the pages hear it when it changed."""
        if self._state is not None and _server_view(state) == _server_view(self._state):
            return
        self._state = state
        for f in self.followers:
            if f.watch is None:
                f.push(Changes(server=state))

    def snapshot(self) -> dict[str, Any]:
        """The page's first event: the server and the window's videos (oldest first)."""
        return {"server": self._state, "videos": [self._videos[vid] for vid in self._window]}

    def video(self, video_id: str) -> Optional[dict[str, Any]]:
        return self._videos.get(video_id)

    # ----- following -----
    async def _tick_once(self) -> None:
        async with self._reading:  # one read at a time, applied in the order they were made
            watched = {f.watch for f in self.followers if f.watch is not None}
            self._apply(await run_in_threadpool(self._read, watched))

    async def _run(self) -> None:
        try:
            while self.followers:
                await asyncio.sleep(self.tick_s)
                if not self.followers:
                    break
                try:
                    await self._tick_once()
                except QueueUnavailable:  # the jobs wait for the next read; the server's state says why
                    self._apply_server(await run_in_threadpool(self._server_alone))
                    continue
                except Exception as e:
                    log.exception("the live feed's read failed")
                    for f in self.followers:
                        f.fail(f"the server could not read its jobs ({type(e).__name__}: {e}). Fix: reconnect; "
                               "the server's log has the traceback")
                    return
        finally:
            self._task = None

    @asynccontextmanager
    async def follow(self, watch: Optional[str] = None, ticket: Optional[Ticket] = None) -> AsyncIterator[Follower]:
        """A new follower of the whole window (``watch`` None) or of one job, in the place
        ``ticket`` took (none: one is taken now); the feed runs while anyone follows. The first
        read is done before this yields, so :meth:`snapshot` and :meth:`video` are current."""
        ticket = ticket or self.reserve()
        if ticket.released:  # given back already: a place is taken again, or refused
            ticket = self.reserve()
        f = Follower(watch)
        ticket.used = True
        self.reserved -= 1  # the place moves from reserved to followers in one step (no await between)
        self.followers.add(f)
        try:
            async with self._starting:
                if self._task is None or (watch is not None and watch not in self._videos):
                    try:
                        await self._tick_once()  # current before the stream's first event
                    except QueueUnavailable as e:
                        raise FeedFailed(f"{e}. Fix: reconnect in a few seconds") from None
                if self._task is None:
                    self._task = asyncio.get_running_loop().create_task(self._run())
        except BaseException:
            self.followers.discard(f)
            raise
        f.pending = Changes()  # what the reads so far said, the snapshot says
        try:
            yield f
        finally:
            self.followers.discard(f)
