"""A live session's media as WebRTC tracks, for WHEP viewers (issue #81): the room between the
session's growing fragmented MP4 (:mod:`wan_s2v_runner.shared.fmp4`, written by its rank group
one fragment a block) and aiortc's peer connections on the server's asyncio loop (uvicorn's).
The routes are :mod:`.whep_routes`; this module knows no HTTP and no queue: a viewer is given a
:class:`SessionMedia` (where the file is, whether the job ended, the session touched).

Each viewer (:class:`Viewer`) reads the file from an open fd (:class:`SessionReader`: the rename
of the finished file does not end the read), decodes each fragment's H.264 frames and AAC audio
with PyAV, and hands them to two aiortc tracks (:func:`session_track`) that aiortc encodes for
the viewer (VP8 or H.264, Opus). Both tracks wait on one :class:`MediaClock`: a frame or an audio
packet goes out when its media time (the fMP4's decode times) is due, so the two stay in sync and
play at real time, never slower: a block that comes after its time (the group slower than real
time, a late joiner) re-anchors the clock and goes out at once. A viewer that joins a session
whose video has begun starts at its newest block; one that joined before starts at the first.
At most :data:`AHEAD_S` of decoded media is held a viewer (the file is the buffer).

A viewer ends when its session's job has ended and everything the file holds was sent, when its
connection fails or never comes up (:data:`CONNECT_S`), on DELETE, and at the server's shutdown
(:meth:`Viewers.close_all`). The server holds at most :data:`MAX_PER_SESSION` viewers a session
and :data:`MAX_VIEWERS` in all (each costs a decode and an encode: docs/live.md).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from wan_s2v_runner.serve.submissions import Refused
from wan_s2v_runner.shared import fmp4
from wan_s2v_runner.shared.fmp4_reader import FragmentDecoder, Media, Tracks, newest_fragment

log = logging.getLogger("wan_s2v.whep")

#: viewers one session takes at once, and the server in all (each costs a decode and an encode)
MAX_PER_SESSION = 4
MAX_VIEWERS = 16
#: a viewer whose connection is not up this long after its answer is closed
CONNECT_S = 30.0
#: how often a viewer looks for a new fragment, and asks whether the session's job ended
POLL_S = 0.05
STATUS_S = 0.5
#: the media seconds a viewer holds decoded at most (two blocks); the file holds the rest
AHEAD_S = 1.5
#: media that comes this much after its time re-anchors the clock (it goes out at once)
LATE_S = 0.02
#: an audio packet's span (WebRTC's usual 20 ms: one Opus frame each)
AUDIO_PTIME = Fraction(1, 50)
#: the video's RTP clock
VIDEO_RATE = 90000


# --------------------------------------------------------------------------- decoding
@dataclass
class Decoded:
    """One fragment's media: video frames and 20 ms audio frames, each with its media second."""

    video: list = field(default_factory=list)  # (t, av.VideoFrame)
    audio: list = field(default_factory=list)  # (t, av.AudioFrame)


class SessionReader:
    """A session's growing fMP4, followed from an open fd and decoded fragment by fragment
    (blocking: a viewer calls it in a thread). ``late``: start at the newest fragment there is
    when it first opens the file (a viewer that joined a running video), else at the first."""

    def __init__(self, find: Callable[[], Optional[Path]], late: bool):
        self.find, self.late = find, late
        self.f = None
        self.follower: Optional[fmp4.Follower] = None
        self.decoder = FragmentDecoder(frames=True)
        self.tracks: Optional[Tracks] = None
        self.audio = np.zeros(0, np.int16)  # decoded audio not yet sent, from media sample audio_at
        self.audio_at: Optional[int] = None
        self.video_end = 0  # media samples (audio rate) the video sent so far spans
        self.first_t: Optional[float] = None
        self.lock = threading.Lock()  # a read and the close, never at once
        self.closed = False

    def _open(self) -> bool:
        if self.f is not None or self.closed:
            return self.f is not None
        path = self.find()
        if path is None:
            return False
        try:
            self.f = open(path, "rb")
        except FileNotFoundError:  # renamed in between: the next look finds the finished file
            return False
        self.follower = fmp4.Follower(self.f)
        if self.late:
            init_end, last = newest_fragment(self.f)
            if last is not None:
                self.f.seek(0)
                self._set_tracks(self.f.read(init_end))
                self.follower.at = last
        return True

    def _set_tracks(self, init: bytes) -> None:
        self.decoder.set_init(init)
        self.tracks = self.decoder.tracks

    def read(self) -> Optional[Decoded]:
        """The next fragment's media (None: none is complete yet)."""
        with self.lock:
            return self._read() if self._open() else None

    def _read(self) -> Optional[Decoded]:
        data = self.follower.read()  # complete boxes only: at most whole fragments
        fragments = self.decoder.feed(data) if data else []
        self.tracks = self.decoder.tracks
        if not fragments:
            return None
        out = Decoded()
        for media in fragments:
            self._take(media, out)
        return out

    def _take(self, media: Media, out: Decoded) -> None:
        """A decoded fragment's frames timed for the video track's RTP clock, its speech into the
        20 ms frames up to the video's end."""
        t = self.tracks
        for at, frame in media.video:
            frame.pts = round(at * VIDEO_RATE)
            frame.time_base = Fraction(1, VIDEO_RATE)
            out.video.append((at, frame))
        if media.video:
            self.first_t = out.video[0][0] if self.first_t is None else self.first_t
            self.video_end = round(media.video_end * t.rate)
        for at, pcm in media.audio:
            self._add_audio(round(at * t.rate), pcm)
        if t.audio is not None:
            out.audio += self._audio_frames(last=False)

    def _add_audio(self, at: int, pcm: np.ndarray) -> None:
        start = round((self.first_t or 0.0) * self.tracks.rate)
        if at + pcm.size <= start:  # before the first frame this viewer gets (priming, a late join)
            return
        if at < start:
            pcm, at = pcm[start - at:], start
        if self.audio_at is None:
            self.audio_at = at
        self.audio = np.concatenate([self.audio, pcm])

    def _audio_frames(self, last: bool) -> list:
        """The audio up to the video's end in 20 ms frames (with ``last``, the rest padded)."""
        import av

        out, rate = [], self.tracks.rate
        n = int(rate * AUDIO_PTIME)
        if self.audio_at is None:
            return out
        until = self.video_end - self.audio_at
        while (self.audio.size >= n and until >= n) or (last and self.audio.size and until > 0):
            chunk = self.audio[:min(n, until)]  # never past the video's end
            if chunk.size < n:
                chunk = np.concatenate([chunk, np.zeros(n - chunk.size, np.int16)])
            frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = rate, self.audio_at, Fraction(1, rate)
            out.append((self.audio_at / rate, frame))
            self.audio, self.audio_at, until = self.audio[n:], self.audio_at + n, until - n
        return out

    def rest(self) -> Decoded:
        """At the end: the audio left up to the video's end."""
        with self.lock:
            if self.tracks is None or self.tracks.audio is None:
                return Decoded()
            return Decoded(audio=self._audio_frames(last=True))

    def close(self) -> None:
        with self.lock:
            if self.f is not None:
                self.f.close()
            self.f, self.closed = None, True


# --------------------------------------------------------------------------- the tracks
class MediaClock:
    """A viewer's one clock for its tracks: media second ``t`` is due at loop time ``origin + t``.
    Media that comes later than its time (:data:`LATE_S`) moves the origin: it goes out at once,
    and what follows it keeps its pace (real time, never slower)."""

    def __init__(self):
        self.origin: Optional[float] = None

    def due(self, t: float, now: float) -> float:
        if self.origin is None or self.origin + t < now - LATE_S:
            self.origin = now - t
        return self.origin + t


def session_track(kind: str, feed: "Feed"):
    """An aiortc track of ``kind`` ("video" or "audio") that plays ``feed``'s frames of that kind
    when the feed's clock says they are due."""
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

    class _Track(MediaStreamTrack):
        def __init__(self):
            super().__init__()
            self.kind = kind

        async def recv(self):
            got = await feed.take(kind)
            if got is None:
                self.stop()
                raise MediaStreamError
            return got

    return _Track()


@dataclass
class SessionMedia:
    """What a viewer is told of its session (each called in a thread): ``find`` the growing
    file (None until it exists), whether the session's job ``ended``, ``touch`` the session (a
    watching viewer counts as its client being there)."""

    find: Callable[[], Optional[Path]]
    ended: Callable[[], bool]
    touch: Callable[[], None]


class Feed:
    """One viewer's decoded media, read ahead of its tracks by at most :data:`AHEAD_S`, and taken
    by them on the viewer's :class:`MediaClock`. ``kinds``: the tracks it feeds (what the answer
    sends; the other kind's frames are let go)."""

    def __init__(self, media: SessionMedia, late: bool, kinds: tuple[str, ...] = ("video", "audio")):
        self.media, self.kinds = media, kinds
        self.reader = SessionReader(media.find, late)
        self.clock = MediaClock()
        self.queues: dict[str, deque] = {"video": deque(), "audio": deque()}
        self.done = False  # the session's video ended and everything is queued
        self.finished: set[str] = set()  # the kinds whose track took the end
        self.started = asyncio.Event()  # a track asked: the connection is up
        self.changed = asyncio.Condition()

    async def take(self, kind: str):
        """The next frame of ``kind`` when it is due; None at the end."""
        self.started.set()
        q = self.queues[kind]
        async with self.changed:
            await self.changed.wait_for(lambda: q or self.done)
            if not q:
                self.finished.add(kind)
                self.changed.notify_all()
                return None
            t, frame = q.popleft()
            self.changed.notify_all()  # the reader may read on
        loop = asyncio.get_running_loop()
        now = loop.time()
        wait = self.clock.due(t, now) - now
        if wait > 0:
            await asyncio.sleep(wait)
        return frame

    async def _push(self, got: Decoded, done: bool = False) -> None:
        async with self.changed:
            for kind in self.kinds:
                self.queues[kind].extend(got.video if kind == "video" else got.audio)
            self.done = done
            self.changed.notify_all()

    def queued_s(self) -> float:
        """The most media seconds a track of this feed has queued."""
        return max((q[-1][0] - q[0][0] for q in self.queues.values() if q), default=0.0)

    async def run(self) -> None:
        """Read the session's video until its job ended and the file is read to its end."""
        await self.started.wait()
        ended, asked = False, 0.0
        loop = asyncio.get_running_loop()
        try:
            while True:
                async with self.changed:  # the tracks take what is queued first
                    await self.changed.wait_for(lambda: self.queued_s() < AHEAD_S)
                got = await asyncio.to_thread(self.reader.read)
                if got is not None:
                    await self._push(got)
                    continue
                if ended:
                    break
                if loop.time() - asked >= STATUS_S:
                    asked = loop.time()
                    await asyncio.to_thread(self.media.touch)
                    ended = await asyncio.to_thread(self.media.ended)
                    if ended:
                        continue  # one more read: what was written before it ended
                await asyncio.sleep(POLL_S)
            await self._push(await asyncio.to_thread(self.reader.rest), done=True)
        finally:
            await asyncio.to_thread(self.reader.close)


# --------------------------------------------------------------------------- the viewers
@dataclass
class Viewer:
    """One WHEP viewer: its peer connection and what it plays."""

    id: str
    session_id: str
    pc: object  # aiortc.RTCPeerConnection
    feed: Feed
    kinds: tuple[str, ...]
    connected: bool = False
    tasks: list = field(default_factory=list)
    closed: bool = False


def _offer_kinds(sdp: str) -> tuple[str, ...]:
    """The media kinds an offer asks to receive (a WHEP offer's recvonly or sendrecv sections);
    :class:`Refused` 400 when it is no SDP offer or asks for nothing this server sends."""
    from aiortc import sdp as aiortc_sdp

    if not sdp.lstrip().startswith("v=0"):
        raise Refused(400, "the body is not an SDP offer (it does not start with v=0). Fix: POST the offer of an "
                           "RTCPeerConnection with recvonly video and audio transceivers as application/sdp", "body")
    try:
        parsed = aiortc_sdp.SessionDescription.parse(sdp)
    except Exception as e:  # noqa: BLE001 - any parse error is the client's SDP
        raise Refused(400, f"the SDP offer does not parse ({type(e).__name__}: {e}). Fix: POST the offer of an "
                           "RTCPeerConnection as application/sdp", "body") from None
    kinds = tuple(m.kind for m in parsed.media if m.kind in ("video", "audio") and m.direction in ("recvonly",
                                                                                                    "sendrecv"))
    if not kinds:
        raise Refused(400, "the SDP offer receives no video or audio. Fix: offer recvonly video and audio "
                           "transceivers (WHEP: the server sends, the viewer receives)", "body")
    return kinds


class Viewers:
    """The server's WHEP viewers, by id (at most :data:`MAX_PER_SESSION` a session and
    :data:`MAX_VIEWERS` in all); every method runs on the server's event loop."""

    def __init__(self, per_session: int = MAX_PER_SESSION, most: int = MAX_VIEWERS, connect_s: float = CONNECT_S):
        self.per_session, self.most, self.connect_s = per_session, most, connect_s
        self.viewers: dict[str, Viewer] = {}

    def of(self, session_id: str) -> list[Viewer]:
        return [v for v in self.viewers.values() if v.session_id == session_id]

    def _room(self, session_id: str) -> None:
        if len(self.of(session_id)) >= self.per_session:
            raise Refused(429, f"session {session_id} has {self.per_session} viewers already. Fix: DELETE a viewer "
                               "that is gone (its Location), or watch GET .../stream", retry_after=5)
        if len(self.viewers) >= self.most:
            raise Refused(429, f"this server has {self.most} WebRTC viewers already. Fix: retry later, or watch the "
                               "session's GET .../stream", retry_after=5)

    async def open(self, session_id: str, offer: str, media: SessionMedia, late: bool) -> tuple[Viewer, str]:
        """A viewer for ``offer`` (an SDP offer): its id and the SDP answer."""
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

        kinds = _offer_kinds(offer)
        self._room(session_id)
        # host candidates only: no STUN server is asked (the viewer's checks reach the server's addresses)
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        feed = Feed(media, late)
        viewer = Viewer(secrets.token_hex(8), session_id, pc, feed, kinds)
        self.viewers[viewer.id] = viewer  # counted from now: a second offer meanwhile sees it
        try:
            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
            except Exception as e:  # noqa: BLE001 - what aiortc cannot take is the client's SDP
                raise Refused(400, f"the SDP offer is not one this server can answer ({type(e).__name__}: {e}). Fix: "
                                   "POST the offer of an RTCPeerConnection with recvonly video and audio "
                                   "transceivers", "body") from None
            for kind in dict.fromkeys(kinds):
                pc.addTrack(session_track(kind, feed))
            await pc.setLocalDescription(await pc.createAnswer())
            # the tracks the answer sends (a kind whose codecs did not match is not sent)
            viewer.kinds = tuple(t.kind for t in pc.getTransceivers()
                                 if t.sender.track is not None and t.currentDirection in ("sendonly", "sendrecv"))
            if not viewer.kinds:
                raise Refused(400, "no codec of the SDP offer is one this server sends. Fix: offer VP8 or H.264 "
                                   "video and Opus audio (as browsers do)", "body")
            feed.kinds = viewer.kinds
        except BaseException:
            self.viewers.pop(viewer.id, None)
            await pc.close()
            raise

        @pc.on("connectionstatechange")
        async def changed() -> None:
            if pc.connectionState == "connected":
                viewer.connected = True
            elif pc.connectionState in ("failed", "closed"):
                await self.close(viewer.id)

        viewer.tasks = [asyncio.ensure_future(self._play(viewer)),
                        asyncio.ensure_future(self._connect_or_close(viewer))]
        log.info("whep viewer %s of session %s: %s", viewer.id, session_id, ", ".join(viewer.kinds))
        return viewer, pc.localDescription.sdp

    async def _play(self, viewer: Viewer) -> None:
        """Feed the viewer until its session's video ends, then close it once its tracks sent all."""
        feed = viewer.feed
        try:
            await feed.run()
            left_s = feed.queued_s()
            async with feed.changed:  # what is queued goes out at real time (or the connection is gone)
                await asyncio.wait_for(feed.changed.wait_for(lambda: feed.finished >= set(viewer.kinds)),
                                       left_s + self.connect_s)
        except asyncio.CancelledError:
            return
        except asyncio.TimeoutError:
            log.info("whep viewer %s: its tracks did not take the end of the video; closed", viewer.id)
        except Exception:  # noqa: BLE001 - one viewer's failure is its own
            log.exception("whep viewer %s of session %s failed", viewer.id, viewer.session_id)
        await self.close(viewer.id)

    async def _connect_or_close(self, viewer: Viewer) -> None:
        try:
            await asyncio.sleep(self.connect_s)
        except asyncio.CancelledError:
            return
        if not viewer.connected and not viewer.feed.started.is_set():
            log.info("whep viewer %s: no connection after %.0f s, closed", viewer.id, self.connect_s)
            await self.close(viewer.id)

    async def close(self, viewer_id: str) -> bool:
        """End a viewer (its connection closed, its file let go); False when there is none."""
        viewer = self.viewers.pop(viewer_id, None)
        if viewer is None or viewer.closed:
            return False
        viewer.closed = True
        me = asyncio.current_task()
        for task in viewer.tasks:
            if task is not me:
                task.cancel()
        await viewer.pc.close()
        if viewer.feed.reader.f is not None:
            await asyncio.to_thread(viewer.feed.reader.close)
        return True

    async def close_all(self) -> None:
        """Every viewer ended (the server is stopping)."""
        for viewer_id in list(self.viewers):
            await self.close(viewer_id)
