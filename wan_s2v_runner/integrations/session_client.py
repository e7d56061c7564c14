"""A live session's client (asyncio): open a session on a ``wan-s2v serve --mode live`` server (or any
server of its fleet), push speech as it is spoken, interrupt, and receive the avatar's decoded video
frames and the speech they play, with their media times, as the server makes them; end, and get the
session's recording as a video job. The engine behind the voice-agent plugins, usable alone::

    from wan_s2v_runner.integrations.session_client import AvatarSession, SpeechChunk, VideoFrame

    async with await AvatarSession.open("http://127.0.0.1:8000", "anna.png", prompt="A woman talks") as s:
        async def show():
            async for item in s.media():                  # frames and speech, as they are made
                if isinstance(item, VideoFrame):
                    display(item.image, at=item.t)        # RGB uint8 [H, W, 3], media seconds
                elif isinstance(item, SpeechChunk):
                    play(item.pcm, item.rate, at=item.t)  # int16 mono
        viewer = asyncio.create_task(show())
        for pcm in tts_chunks():                          # int16 mono at 24 kHz, say
            await s.push(pcm, rate=24000)
        await s.end()                                     # the rest is rendered, then the video completes
        await viewer
    print(s.video["id"])                                  # GET /v1/videos/{id}/content: the recording

The media comes from the session's stream (``GET .../stream``: one growing fragmented MP4), decoded
here fragment by fragment (:class:`~wan_s2v_runner.shared.fmp4_reader.FragmentDecoder`): the same
frames as the recording's, exactly. Errors are the server's one line (:class:`SessionError`, its
status and message).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Union

import numpy as np

#: the video objects' statuses at which a job has ended
TERMINAL = ("completed", "failed", "cancelled")
#: the most speech one append of :class:`SpeechSender` carries (the server takes up to 10 s)
SEND_MAX_S = 5.0
#: how long :class:`SpeechSender` keeps offering an append the server found too far ahead (429)
RETRY_FOR_S = 60.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VideoFrame:
    """A frame of the avatar's video: RGB ``uint8`` [H, W, 3], its media second, its index."""

    image: np.ndarray
    t: float
    index: int


@dataclass(frozen=True)
class SpeechChunk:
    """The speech the video plays (what the session placed, silence where it listened): ``int16``
    mono at ``rate``, from media second ``t``."""

    pcm: np.ndarray
    rate: int
    t: float


@dataclass(frozen=True)
class SpeechPlaced:
    """Where the speech pushed to the session lies in a block of its video (read before the block's
    frames): ``t``, the block's start on the speech's media time; each run is (media second it
    starts at, its first sample in the session's pushed speech counted at 16 kHz, its samples at
    16 kHz); none: the block is silent (the avatar listens). The
    plugins replay their own copy of the speech from these (:mod:`~wan_s2v_runner.integrations.playout`)."""

    t: float
    runs: tuple


@dataclass(frozen=True)
class Ended:
    """The session's video job ended: its video object (``status``, ``live`` figures, ...)."""

    video: dict


class SessionError(Exception):
    """The server refused a call: its HTTP status and its one-line message (cause and fix)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def _pcm_body(speech: Union[bytes, np.ndarray]) -> tuple[bytes, str]:
    """Speech as an append's body and format: bytes are s16le; an int16 array s16le; a float array f32le."""
    if isinstance(speech, (bytes, bytearray, memoryview)):
        return bytes(speech), "s16le"
    a = np.asarray(speech)
    if a.ndim != 1:
        raise ValueError(f"speech must be mono: one dimension (got {a.shape})")
    if a.dtype == np.int16:
        return a.astype("<i2").tobytes(), "s16le"
    if a.dtype.kind == "f":
        return a.astype("<f4").tobytes(), "f32le"
    raise ValueError(f"speech must be int16 or float samples (got {a.dtype})")


class AvatarSession:
    """One open live session (see the module docstring). Make it with :meth:`open`."""

    def __init__(self, http, info: dict, owns_http: bool = True):
        self.http, self.info, self.owns_http = http, info, owns_http
        #: the session's video object once it ended (:meth:`wait`, or the media's :class:`Ended`)
        self.video: Optional[dict] = None

    @property
    def id(self) -> str:
        return self.info["id"]

    # ----- opening
    @classmethod
    async def open(cls, url: str, image: Union[str, Path, bytes], *, token: Optional[str] = None,
                   pace: str = "realtime", timeout: float = 60.0, **fields: Any) -> "AvatarSession":
        """Open a session on the server at ``url``: ``image`` (a file, its bytes), ``pace``
        (``realtime``: blocks at their time, silent where no speech came; ``speech``: as the speech
        comes), and any job field (``prompt``, ``seed``, ``size``, ``speech_lookahead``, ...). A 429
        (no live group free) is a :class:`SessionError`: retry, or ask another server."""
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout)
        data = Path(image).read_bytes() if not isinstance(image, (bytes, bytearray)) else bytes(image)
        form = {k: str(v) for k, v in {**fields, "pace": pace}.items() if v is not None}
        try:
            r = await http.post("/v1/videos/sessions", files={"image": ("reference", data)}, data=form)
            info = cls._answer(r)
        except BaseException:
            await http.aclose()
            raise
        return cls(http, info)

    @staticmethod
    def _answer(r) -> dict:
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - not the server's error body (a proxy's, say)
                message = r.text[:300]
            raise SessionError(r.status_code, message)
        return r.json()

    async def _call(self, method: str, path: str, **kw) -> dict:
        self.info = self._answer(await self.http.request(method, f"/v1/videos/sessions/{self.id}{path}", **kw))
        return self.info

    # ----- speech
    async def push(self, speech: Union[bytes, np.ndarray], rate: int = 16000) -> dict:
        """Speech appended: mono samples at ``rate`` (int16 or float in [-1, 1], or s16le bytes); any
        size up to 10 s a call. Returns the session."""
        body, fmt = _pcm_body(speech)
        return await self._call("POST", "/speech", params={"format": fmt, "rate": rate}, content=body,
                                headers={"content-type": "application/octet-stream"})

    async def end_of_speech(self) -> dict:
        """The utterance so far is complete: its last blocks start without waiting for more."""
        return await self._call("POST", "/end_of_speech")

    async def interrupt(self) -> dict:
        """Drop the speech not yet in a started block (a barge-in)."""
        return await self._call("POST", "/interrupt")

    async def end(self) -> dict:
        """End the session: what was pushed is rendered, then its video job completes."""
        return await self._call("POST", "/end")

    async def status(self) -> dict:
        """The session now (``state``, ``speech_s``, its ``video`` object with its ``live`` figures)."""
        return await self._call("GET", "")

    # ----- media
    async def media(self) -> AsyncIterator[Union[SpeechPlaced, VideoFrame, SpeechChunk, Ended]]:
        """The session's frames and the speech they play, decoded, in the order the server made
        them (each block: :class:`SpeechPlaced`, its frames, its speech), then :class:`Ended` once
        its job ended."""
        from wan_s2v_runner.shared import fmp4
        from wan_s2v_runner.shared.fmp4_reader import FragmentDecoder

        decoder, index = FragmentDecoder(), 0
        async with self.http.stream("GET", f"/v1/videos/sessions/{self.id}/stream", timeout=None) as r:
            if r.status_code >= 400:
                await r.aread()
                self._answer(r)
            async for data in r.aiter_bytes():
                for fragment in await asyncio.to_thread(decoder.feed, data):
                    if fragment.runs is not None:
                        start, runs = fragment.runs
                        rate = fmp4.SPEECH_RUNS_RATE
                        yield SpeechPlaced(start, tuple((at / rate, pushed, n) for at, pushed, n in runs))
                    for t, image in fragment.video:
                        yield VideoFrame(image, t, index)
                        index += 1
                    for t, pcm in fragment.audio:
                        yield SpeechChunk(pcm, decoder.tracks.rate, t)
        yield Ended(await self.wait())

    async def wait(self, timeout: Optional[float] = None, poll_s: float = 0.2) -> dict:
        """The session's video object once its job ended (completed: the recording is
        ``GET /v1/videos/{id}/content``)."""
        async def ended() -> dict:
            while True:
                v = self._answer(await self.http.get(f"/v1/videos/{self.id}"))
                if v["status"] in TERMINAL:
                    return v
                await asyncio.sleep(poll_s)
        self.video = await asyncio.wait_for(ended(), timeout)
        return self.video

    async def recording(self) -> bytes:
        """The completed session's mp4."""
        r = await self.http.get(f"/v1/videos/{self.id}/content")
        if r.status_code >= 400:
            self._answer(r)
        return r.content

    # ----- closing
    async def close(self) -> None:
        """End the session if it is open, and let the connection go."""
        try:
            if self.info.get("state") == "open":
                await self.end()
        except SessionError:  # ended already (its job, or the server's idle rule)
            pass
        finally:
            if self.owns_http:
                await self.http.aclose()

    async def __aenter__(self) -> "AvatarSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class SpeechSender:
    """Speech handed over in order from a framework's callbacks (never awaiting the network there),
    sent by one task: what queued while an append was on the wire goes as one append (a TTS's 10 ms
    frames do not become a hundred requests a second), in order: an interrupt goes after what was
    queued before it (the session drops that speech itself; the server counts every sample pushed,
    as :mod:`~wan_s2v_runner.integrations.playout` does). An append the server finds too far ahead
    of the video (429) waits its Retry-After and goes again; any other failure is logged and the rest
    goes on (:attr:`failures` counts them: the plugins' audio is then off by what was lost)."""

    def __init__(self, session: AvatarSession, rate: int, retry_for_s: float = RETRY_FOR_S):
        self.session, self.rate, self.retry_for_s = session, int(rate), retry_for_s
        self.items: deque = deque()  # ("pcm", int16 array) | ("end" | "interrupt" | "stop", None)
        self.wake = asyncio.Event()
        self.task: Optional[asyncio.Task] = None
        self.failures = 0

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    def _put(self, kind: str, pcm=None) -> None:
        self.items.append((kind, pcm))
        self.wake.set()

    def pcm(self, pcm: np.ndarray) -> None:
        """int16 mono samples at :attr:`rate`."""
        self._put("pcm", np.asarray(pcm, dtype=np.int16).reshape(-1))

    def end_of_speech(self) -> None:
        self._put("end")

    def interrupt(self) -> None:
        self._put("interrupt")

    async def _run(self) -> None:
        limit = int(SEND_MAX_S * self.rate)
        while True:
            while not self.items:
                self.wake.clear()
                await self.wake.wait()
            kind, pcm = self.items.popleft()
            if kind == "stop":
                return
            if kind == "pcm":
                parts, n = [pcm[:limit]], min(pcm.size, limit)
                if pcm.size > limit:  # one item over an append's limit: its rest goes next
                    self.items.appendleft(("pcm", pcm[limit:]))
                while n < limit and self.items and self.items[0][0] == "pcm":
                    more = self.items.popleft()[1]
                    if n + more.size > limit:
                        self.items.appendleft(("pcm", more[limit - n:]))
                        more = more[:limit - n]
                    parts.append(more)
                    n += more.size
            await self._send(kind, np.concatenate(parts) if kind == "pcm" else None)

    async def _send(self, kind: str, pcm) -> None:
        deadline = asyncio.get_running_loop().time() + self.retry_for_s
        while True:
            try:
                if kind == "pcm":
                    await self.session.push(pcm, self.rate)
                elif kind == "end":
                    await self.session.end_of_speech()
                else:
                    await self.session.interrupt()
                return
            except SessionError as e:
                if e.status == 429 and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(1.0)  # ahead of the video: its Retry-After
                    continue
                error = e
            except Exception as e:  # noqa: BLE001 - the network's (httpx): the session's state is the server's
                error = e
            self.failures += 1
            log.warning("wan-s2v session %s: %s not taken: %s", self.session.id, kind, error)
            return

    async def close(self) -> None:
        """What is queued is sent, then the task ends (never raises)."""
        if self.task is not None:
            self._put("stop")
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
