"""A wan-s2v face for a LiveKit Agents voice agent (``pip install 'wan-s2v[livekit]'``).

LiveKit's avatar seam (``livekit.agents.voice.avatar``): the agent streams its TTS to an avatar
participant in the room (``DataStreamAudioOutput``); the avatar's ``AvatarRunner`` hands that speech
to a :class:`~livekit.agents.voice.avatar.VideoGenerator` and publishes what the generator yields,
video and audio kept in sync by ``rtc.AVSynchronizer``. Here:

* :class:`WanS2VVideoGenerator`: the generator, backed by a live session on a ``wan-s2v serve --mode
  live`` server (or any server of its fleet). The agent's speech goes to the session; the session's
  frames come back (the avatar listens with its own blocks while the agent is silent: no frozen
  frame), with the agent's own audio cut where the blocks placed it
  (:mod:`~wan_s2v_runner.integrations.playout`); ``clear_buffer`` is the session's interrupt;
  ``AudioSegmentEnd`` comes out when the segment's last sample plays (the runner then reports
  playback finished to the agent).
* :func:`run_avatar`: the avatar participant: joins a room and runs the runner with the generator;
  ``python -m wan_s2v_runner.integrations.livekit_avatar`` runs it from the environment
  (``LIVEKIT_URL``, ``LIVEKIT_TOKEN``; ``WAN_S2V_URL``, ``WAN_S2V_IMAGE``, optional
  ``WAN_S2V_TOKEN``, ``WAN_S2V_PROMPT``), as LiveKit's avatar examples run theirs.
* :class:`WanS2VAvatar`: the agent side (LiveKit's ``AvatarSession``): mints the avatar's token,
  starts the avatar participant in the agent's process (the GPU work is the wan-s2v server's; here
  only decoding and publishing) and routes the agent's audio to it::

      avatar = WanS2VAvatar(server="http://gpu-box:8000", image="anna.png", prompt="A woman talks")
      await avatar.start(session, room=ctx.room)
      await session.start(agent=agent, room=ctx.room)
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Optional, Union

import numpy as np
from livekit import api, rtc
from livekit.agents.types import ATTRIBUTE_PUBLISH_ON_BEHALF
from livekit.agents.voice.avatar import (
    AudioSegmentEnd,
    AvatarOptions,
    AvatarRunner,
    AvatarSession,
    DataStreamAudioOutput,
    DataStreamAudioReceiver,
    VideoGenerator,
)

from wan_s2v_runner.integrations import playout as po
from wan_s2v_runner.integrations.avatar_feed import AvatarFeed, mono
from wan_s2v_runner.integrations.session_client import AvatarSession as Session
from wan_s2v_runner.integrations.session_client import Ended, VideoFrame

log = logging.getLogger(__name__)

#: the live mode's frames a second
FPS = 16
#: the rate the avatar takes and plays the agent's speech at (the agent's audio output resamples to it)
AUDIO_RATE = 24000
#: the avatar participant's identity in the room
IDENTITY = "wan-s2v-avatar"
#: frames more than this behind the recent blocks' earliest arrival (:meth:`AvatarFeed.earliest`) are
#: skipped while the avatar
#: listens (what queued before the runner took frames, or while it stalled, is not kept as delay)
CATCH_UP_S = 0.5


class WanS2VVideoGenerator(VideoGenerator):
    """LiveKit's video generator backed by a wan-s2v live session (the module docstring). Make it
    with :meth:`open`; :attr:`size` is the video's (width, height) once :meth:`start` returned."""

    def __init__(self, session: Session, audio_rate: int = AUDIO_RATE):
        self.session, self.audio_rate = session, int(audio_rate)
        self.feed = AvatarFeed(session)
        self.out: asyncio.Queue = asyncio.Queue(maxsize=4 * FPS)
        self.size: Optional[tuple[int, int]] = None
        self._first = asyncio.Event()
        self._resampler: Optional[rtc.AudioResampler] = None
        self._resampler_rate = 0
        self._reader: Optional[asyncio.Task] = None
        self._ended_out = False
        self.turn_open = False  # speech pushed whose turn has not ended (its frames are not skipped)

    @classmethod
    async def open(cls, server: str, image: Union[str, Path, bytes], *, token: Optional[str] = None,
                   audio_rate: int = AUDIO_RATE, **fields) -> "WanS2VVideoGenerator":
        """A real-time session opened on ``server`` (``fields``: ``prompt``, ``seed``, ``size``...)."""
        return cls(await Session.open(server, image, token=token, pace="realtime", **fields), audio_rate)

    async def start(self) -> None:
        """The session's media starts flowing; returns once the first frame (its size) is there."""
        self._reader = asyncio.create_task(self._read())
        waiter = asyncio.create_task(self._first.wait())
        await asyncio.wait([waiter, self._reader], return_when=asyncio.FIRST_COMPLETED)
        if not self._first.is_set():
            waiter.cancel()
            self._reader.result()  # its error
            raise RuntimeError(f"wan-s2v session {self.session.id} ended before its first frame")

    async def _read(self) -> None:
        """What the session made onto :attr:`out` (a broken stream ends it: the runner's wait ends with it)."""
        async for epoch, out in self.feed.items():
            if isinstance(out, VideoFrame) and self.size is None:
                self.size = (out.image.shape[1], out.image.shape[0])
                self._first.set()
            await self.out.put((epoch, out))
            if isinstance(out, Ended):
                self._ended_out = True

    # ----- the agent's speech in
    async def push_audio(self, frame: Union[rtc.AudioFrame, AudioSegmentEnd]) -> None:
        if isinstance(frame, AudioSegmentEnd):
            for rest in self._resampler.flush() if self._resampler is not None else []:
                self._speech(rest)
            self.feed.end_turn()
            return
        self.turn_open = True
        if frame.sample_rate != self.audio_rate or frame.num_channels != 1:
            if frame.num_channels != 1:
                pcm = mono(np.frombuffer(frame.data, dtype=np.int16), frame.num_channels)
                frame = rtc.AudioFrame(pcm.tobytes(), frame.sample_rate, 1, pcm.size)
            if frame.sample_rate != self.audio_rate:
                if self._resampler is None or self._resampler_rate != frame.sample_rate:  # (another rate: anew)
                    for rest in self._resampler.flush() if self._resampler is not None else []:
                        self._speech(rest)
                    self._resampler = rtc.AudioResampler(frame.sample_rate, self.audio_rate, num_channels=1)
                    self._resampler_rate = frame.sample_rate
                for out in self._resampler.push(frame):
                    self._speech(out)
                return
        self._speech(frame)

    def _speech(self, frame: rtc.AudioFrame) -> None:
        self.feed.speech(np.frombuffer(frame.data, dtype=np.int16).copy(), self.audio_rate)

    def clear_buffer(self) -> None:
        """The agent was interrupted: the session drops the speech no started block holds, and its
        speech not played yet is not played."""
        self.turn_open = False
        self.feed.interrupt()

    # ----- frames and audio out
    def __aiter__(self) -> AsyncIterator[Union[rtc.VideoFrame, rtc.AudioFrame, AudioSegmentEnd]]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[Union[rtc.VideoFrame, rtc.AudioFrame, AudioSegmentEnd]]:
        while True:
            epoch, item = await self.out.get()
            if self.feed.stale(epoch, item):
                continue  # made before an interrupt
            if isinstance(item, po.TurnEnd):
                self.turn_open = False
            if isinstance(item, VideoFrame) and not self.turn_open and self.feed.lateness \
                    and time.monotonic() - item.t - self.feed.earliest() > CATCH_UP_S:
                continue  # listening, and behind the session's newest blocks: catch up (the runner paces what is left)
            if isinstance(item, VideoFrame):
                h, w = item.image.shape[:2]
                rgba = np.empty((h, w, 4), dtype=np.uint8)
                rgba[..., :3], rgba[..., 3] = item.image, 255
                yield rtc.VideoFrame(w, h, rtc.VideoBufferType.RGBA, rgba.tobytes())
            elif isinstance(item, po.Audio):
                yield rtc.AudioFrame(item.pcm.tobytes(), item.rate, 1, item.pcm.size)
            elif isinstance(item, po.TurnEnd):
                yield AudioSegmentEnd()
            elif isinstance(item, Ended):
                return

    async def aclose(self, wait_s: float = 0.0) -> None:
        """The session ends (its recording completes on the server); its last blocks still come out
        for up to ``wait_s`` (while something iterates), then the iteration ends."""
        await self.feed.close_speech()
        if self._reader is None:
            try:
                await self.session.close()
            except Exception as e:  # noqa: BLE001 - the network's
                log.warning("wan-s2v session %s: not closed cleanly: %s", self.session.id, e)
            return
        if wait_s > 0 and not self._reader.done():
            try:
                await self.session.end()
            except Exception as e:  # noqa: BLE001 - ended already, or the network's (the server's idle rule ends it)
                log.warning("wan-s2v session %s: its end was not taken: %s", self.session.id, e)
            await asyncio.wait([self._reader], timeout=wait_s)
        try:
            await self.session.close()
        except Exception as e:  # noqa: BLE001 - as above
            log.warning("wan-s2v session %s: not closed cleanly: %s", self.session.id, e)
        if not self._reader.done():
            self._reader.cancel()
        failed = (await asyncio.gather(self._reader, return_exceptions=True))[0]
        if isinstance(failed, Exception):
            log.warning("wan-s2v session %s: its media stopped: %r", self.session.id, failed)
        if not self._ended_out:
            while self.out.full():  # nobody reads: the end must still fit
                self.out.get_nowait()
            self.out.put_nowait((self.feed.epoch, Ended(self.session.video or {})))


async def run_avatar(room: rtc.Room, generator: WanS2VVideoGenerator, stop: Optional[asyncio.Event] = None) -> None:
    """The avatar participant in a connected ``room``: LiveKit's runner with ``generator`` until
    ``stop`` is set, the room disconnects or the agent leaves; the session then ends."""
    stop = stop or asyncio.Event()
    runner = None
    try:
        await generator.start()
        w, h = generator.size
        runner = AvatarRunner(room, audio_recv=DataStreamAudioReceiver(room), video_gen=generator,
                              options=AvatarOptions(video_width=w, video_height=h, video_fps=FPS,
                                                    audio_sample_rate=generator.audio_rate, audio_channels=1))
        await runner.start()

        def agent_left(p: rtc.RemoteParticipant) -> None:
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                stop.set()

        room.on("participant_disconnected", agent_left)
        room.on("disconnected", lambda *_: stop.set())
        stopped, done = asyncio.create_task(stop.wait()), asyncio.create_task(runner.wait_for_complete())
        await asyncio.wait([stopped, done], return_when=asyncio.FIRST_COMPLETED)  # or the session's frames ended
        for task in (stopped, done):
            task.cancel()
    finally:
        if runner is not None:
            await runner.aclose()
        await generator.aclose()


class WanS2VAvatar(AvatarSession):
    """The agent side (LiveKit's ``AvatarSession``): see the module docstring. ``server``: a wan-s2v
    server's URL; ``image``: the face; ``token``: the server's API token; ``fields``: the session's
    job fields (``prompt``, ``seed``, ``size``...). LiveKit's URL, key and secret come from the
    arguments or ``LIVEKIT_URL``, ``LIVEKIT_API_KEY``, ``LIVEKIT_API_SECRET``."""

    def __init__(self, server: str, image: Union[str, Path, bytes], *, token: Optional[str] = None,
                 avatar_identity: str = IDENTITY, livekit_url: Optional[str] = None,
                 api_key: Optional[str] = None, api_secret: Optional[str] = None, **fields):
        super().__init__()
        self.server, self.image, self.token, self.fields = server, image, token, fields
        self._identity = avatar_identity
        self.livekit_url = livekit_url or os.environ.get("LIVEKIT_URL")
        self.api_key, self.api_secret = api_key, api_secret
        self._avatar: Optional[asyncio.Task] = None
        self._stop = asyncio.Event()

    @property
    def avatar_identity(self) -> str:
        return self._identity

    @property
    def provider(self) -> str:
        return "wan-s2v"

    async def start(self, agent_session, room: rtc.Room) -> None:
        await super().start(agent_session, room)
        if not self.livekit_url:
            raise ValueError("WanS2VAvatar needs LiveKit's URL: livekit_url= or LIVEKIT_URL")
        avatar_token = (api.AccessToken(self.api_key, self.api_secret)
                        .with_identity(self._identity).with_name("wan-s2v avatar").with_kind("agent")
                        .with_grants(api.VideoGrants(room_join=True, room=room.name))
                        .with_attributes({ATTRIBUTE_PUBLISH_ON_BEHALF: room.local_participant.identity})
                        .to_jwt())
        generator = await WanS2VVideoGenerator.open(self.server, self.image, token=self.token, **self.fields)

        async def avatar() -> None:
            avatar_room = rtc.Room()
            try:
                await avatar_room.connect(self.livekit_url, avatar_token)
                await run_avatar(avatar_room, generator, self._stop)
            except BaseException:
                await generator.aclose()
                raise
            finally:
                await avatar_room.disconnect()

        self._avatar = asyncio.create_task(avatar())
        agent_session.output.replace_audio_tail(DataStreamAudioOutput(
            room, destination_identity=self._identity, sample_rate=AUDIO_RATE,
            wait_remote_track=rtc.TrackKind.KIND_VIDEO, wait_playback_start=True))

    async def aclose(self) -> None:
        self._stop.set()
        if self._avatar is not None:
            await asyncio.gather(self._avatar, return_exceptions=True)
            self._avatar = None
        await super().aclose()


async def _main() -> int:
    env = os.environ
    missing = [k for k in ("LIVEKIT_URL", "LIVEKIT_TOKEN", "WAN_S2V_URL", "WAN_S2V_IMAGE") if not env.get(k)]
    if missing:
        print(f"livekit_avatar: {', '.join(missing)} not set. Fix: LIVEKIT_URL and LIVEKIT_TOKEN (the avatar's "
              "token for the room), WAN_S2V_URL (a wan-s2v serve --mode live server) and WAN_S2V_IMAGE (the face)",
              file=sys.stderr)
        return 2
    fields = {"prompt": env["WAN_S2V_PROMPT"]} if env.get("WAN_S2V_PROMPT") else {}
    generator = await WanS2VVideoGenerator.open(env["WAN_S2V_URL"], env["WAN_S2V_IMAGE"],
                                                token=env.get("WAN_S2V_TOKEN"), **fields)
    room = rtc.Room()
    try:
        await room.connect(env["LIVEKIT_URL"], env["LIVEKIT_TOKEN"])
    except BaseException:
        await generator.aclose()
        raise
    try:
        log.info("wan-s2v avatar in room %s, session %s", room.name, generator.session.id)
        await run_avatar(room, generator)
    finally:
        await room.disconnect()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(_main()))
