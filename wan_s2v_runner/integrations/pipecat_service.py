"""A wan-s2v face for a Pipecat voice agent (``pip install 'wan-s2v[pipecat]'``; Pipecat 1.x needs
Python 3.11+).

:class:`WanS2VVideoService` goes where Pipecat's hosted avatars go (Simli, Tavus, HeyGen): between
the TTS and the output transport::

    pipeline = Pipeline([transport.input(), stt, context_aggregator.user(), llm, tts,
                         WanS2VVideoService(server="http://gpu-box:8000", image="anna.png"),
                         transport.output(), context_aggregator.assistant()])

It opens a real-time live session on a ``wan-s2v serve --mode live`` server when the pipeline
starts; the TTS's audio (``TTSAudioRawFrame``) goes to the session and does not pass on: what passes
on is the avatar's frames (``OutputImageRawFrame``, RGB, 16 a second, the listening avatar's while
the bot is silent) and the TTS's own audio, sample for sample, at the media time the session's blocks
placed it (:mod:`~wan_s2v_runner.integrations.playout`), both paced here by the video's clock behind
a small playout delay, so that the transport shows and plays them together. ``TTSStoppedFrame``
passes on when the turn's last sample does (the transport's "bot stopped speaking" then comes when
the lips stop). An ``InterruptionFrame`` is the session's interrupt: speech not yet in a started
block is dropped, and nothing of the interrupted turn plays any more. Each turn's delay from its
first TTS sample to its first sample played, and the session's block latency, are Pipecat metrics
(``TTFBMetricsData`` and ``ProcessingMetricsData``, with ``enable_metrics=True``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Optional, Union

import numpy as np
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    MetricsFrame,
    OutputImageRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.metrics.metrics import ProcessingMetricsData, TTFBMetricsData
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from wan_s2v_runner.integrations import playout as po
from wan_s2v_runner.integrations.avatar_feed import AvatarFeed, mono
from wan_s2v_runner.integrations.session_client import AvatarSession, Ended, VideoFrame

log = logging.getLogger(__name__)

#: how far behind the video's clock the frames and audio are pushed: room for a block's fragment
#: arriving at once (and HTTP's jitter) without a stall
PLAYOUT_DELAY_S = 0.3
#: a frame this late re-anchors the clock (a stall: play on from here instead of catching up in a burst)
LATE_S = 0.5
#: a clock more than this off the recent blocks' earliest arrival (:meth:`AvatarFeed.earliest`) moves
#: to it (while the avatar listens: nothing audible queued)
CATCH_UP_S = 0.1
#: how long the end of the pipeline waits for the session's last blocks to play
END_WAIT_S = 30.0


class WanS2VVideoService(FrameProcessor):
    """The avatar in a Pipecat pipeline (the module docstring). ``server``: a wan-s2v server's URL;
    ``image``: the face (a file or its bytes); ``token``: the server's API token; ``fields``: the
    session's job fields (``prompt``, ``seed``, ``size``...)."""

    def __init__(self, *, server: str, image: Union[str, Path, bytes], token: Optional[str] = None,
                 playout_delay_s: float = PLAYOUT_DELAY_S, **fields):
        super().__init__()
        self.server, self.image, self.token, self.fields = server, image, token, fields
        self.playout_delay_s = playout_delay_s
        self.session: Optional[AvatarSession] = None
        self.feed: Optional[AvatarFeed] = None
        self.paced: asyncio.Queue = asyncio.Queue()
        self.stopped: deque[TTSStoppedFrame] = deque()  # TTSStoppedFrames held until their turn's end plays
        self.turn_began: Optional[float] = None  # when the turn's first TTS sample came (its TTFB's start)
        self.turn_played = False
        self._reader: Optional[asyncio.Task] = None
        self._pacer: Optional[asyncio.Task] = None
        self._ended = asyncio.Event()
        self.closing = False
        self.audio_queued = 0  # Audio items on the pacer's queue (none: the avatar is listening)

    # ----- the pipeline's frames
    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            await self._open()
        elif isinstance(frame, (TTSAudioRawFrame, TTSStoppedFrame)) and (self.session is None or self.closing):
            await self.push_frame(frame, direction)  # no face (the session did not open): the voice goes on
        elif isinstance(frame, TTSAudioRawFrame):
            self._speech(frame)
        elif isinstance(frame, TTSStoppedFrame):
            if self.feed.end_turn():
                self.stopped.append(frame)  # passes on when its turn's last sample does
            else:
                await self.push_frame(frame, direction)  # no speech of its own to wait for
        elif isinstance(frame, InterruptionFrame):
            self._interrupt()
            await self.push_frame(frame, direction)
        elif isinstance(frame, EndFrame):
            await self._close(wait=True)
            await self.push_frame(frame, direction)
        elif isinstance(frame, CancelFrame):
            await self._close(wait=False)
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    def _speech(self, frame: TTSAudioRawFrame) -> None:
        if self.turn_began is None:
            self.turn_began, self.turn_played = time.monotonic(), False
        self.feed.speech(mono(np.frombuffer(frame.audio, dtype=np.int16), frame.num_channels), frame.sample_rate)

    def _interrupt(self) -> None:
        """The session's interrupt; the speech already on the pacer's queue is not pushed (its epoch)."""
        if self.feed is not None:
            self.feed.interrupt()
        self.stopped.clear()
        self.turn_began = None

    # ----- the session
    async def _open(self) -> None:
        try:
            self.session = await AvatarSession.open(self.server, self.image, token=self.token, pace="realtime",
                                                    **self.fields)
        except Exception as e:  # noqa: BLE001 - the server's refusal or the network's (httpx)
            self.session = None
            await self.push_error(f"wan-s2v: could not open a session on {self.server} (the bot speaks without "
                                  f"its face): {e}")
            return
        self.feed = AvatarFeed(self.session)
        self._reader = self.create_task(self._read())
        self._pacer = self.create_task(self._pace())

    async def _read(self) -> None:
        """What the session made onto the pacer's queue (a broken stream: an error frame, and the
        pacer ends: an EndFrame need not wait)."""
        async for epoch, out in self.feed.items():
            if isinstance(out, Ended) and "error" in out.video:
                await self.push_error(f"wan-s2v session {self.session.id}: {out.video['error']}")
            self.audio_queued += isinstance(out, po.Audio)
            await self.paced.put((epoch, out))

    async def _pace(self) -> None:
        """The frames and audio pushed at their media time, :attr:`playout_delay_s` behind the
        earliest any came (the first block's warm-up does not stay in every later one's delay: the
        clock catches up while the avatar listens); a stall re-anchors it (no burst after)."""
        anchor = None
        while True:
            epoch, item = await self.paced.get()
            if isinstance(item, Ended):
                self._ended.set()
                await self._report_metrics(item.video)
                return
            now = time.monotonic()
            if isinstance(item, po.Audio):
                self.audio_queued -= 1
            if self.feed.stale(epoch, item):
                continue  # taken before an interrupt
            earliest = self.feed.earliest()
            if earliest is None:
                earliest = now - item.t
            listening = self.turn_began is None and not self.audio_queued
            if anchor is None or (listening and abs(anchor - (earliest + self.playout_delay_s)) > CATCH_UP_S):
                anchor = earliest + self.playout_delay_s
            elif now - (anchor + item.t) > LATE_S:
                anchor = now - item.t
            wait = anchor + item.t - now
            if wait > 0:
                await asyncio.sleep(wait)
            if self.feed.stale(epoch, item):
                continue  # an interrupt came while it waited
            if isinstance(item, VideoFrame):
                h, w = item.image.shape[:2]
                image = OutputImageRawFrame(image=item.image.tobytes(), size=(w, h), format="RGB")
                image.pts = int(item.t * 1e9)
                await self.push_frame(image)
            elif isinstance(item, po.Audio):
                audio = TTSAudioRawFrame(audio=item.pcm.tobytes(), sample_rate=item.rate, num_channels=1)
                audio.pts = int(item.t * 1e9)
                await self.push_frame(audio)
                if self.turn_began is not None and not self.turn_played:
                    self.turn_played = True
                    self.create_task(self._report_metrics(None, ttfb=time.monotonic() - self.turn_began))
            elif isinstance(item, po.TurnEnd):
                self.turn_began = None
                if self.stopped:
                    await self.push_frame(self.stopped.popleft())

    async def _report_metrics(self, video: Optional[dict], ttfb: Optional[float] = None) -> None:
        """A turn's delay from its first TTS sample to its first sample played (TTFB), and the
        session's block latency at its median (its record's, once it ended)."""
        data = []
        if ttfb is not None:
            data.append(TTFBMetricsData(processor=self.name, value=round(ttfb, 4)))
            try:
                video = (await self.session.status())["video"]
            except Exception:  # noqa: BLE001 - the server's refusal or the network's: no latency this time
                video = None
        p50 = ((video or {}).get("live") or {}).get("block_latency_s", {}).get("p50")
        if p50 is not None:
            data.append(ProcessingMetricsData(processor=self.name, value=p50))
        if data:
            await self.push_frame(MetricsFrame(data=data))

    async def _close(self, wait: bool) -> None:
        """The session ends; ``wait``: what it made still plays (its last blocks), up to
        :data:`END_WAIT_S`. Never raises: whatever fails, the tasks stop and the session is let go."""
        if self.session is None or self.closing:
            return
        self.closing = True
        try:
            await self.feed.close_speech()
            try:
                await self.session.end()
            except Exception as e:  # noqa: BLE001 - ended already, or the network's: the server's idle rule ends it
                log.warning("wan-s2v session %s: its end was not taken: %s", self.session.id, e)
            if wait:
                try:
                    await asyncio.wait_for(self._ended.wait(), END_WAIT_S)
                except asyncio.TimeoutError:
                    log.warning("wan-s2v session %s: its last blocks did not play within %s s", self.session.id,
                                END_WAIT_S)
        finally:
            for task in (self._reader, self._pacer):
                if task is not None:
                    await self.cancel_task(task)
            try:
                await self.session.close()
            except Exception:  # noqa: BLE001 - letting go of the connection
                pass
