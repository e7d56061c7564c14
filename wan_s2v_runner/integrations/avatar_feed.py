"""One live session as a voice-agent plugin drives it (the Pipecat service's and the LiveKit
generator's one engine): the agent's speech in (sent by a
:class:`~wan_s2v_runner.integrations.session_client.SpeechSender`, kept by a
:class:`~wan_s2v_runner.integrations.playout.Playout`), interrupts counted, and the session's media
out as what to play (:meth:`AvatarFeed.items`), with how late the video comes (:meth:`AvatarFeed.earliest`:
the recent blocks' first frames, their arrival less their media time; a block's frames arrive at
once, so its first frame's is the one that says it). The plugins keep only their framework's part:
frame types, pacing, their lifecycle.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import AsyncIterator, Optional

import numpy as np

from wan_s2v_runner.integrations import playout as po
from wan_s2v_runner.integrations.session_client import AvatarSession, Ended, SpeechPlaced, SpeechSender, VideoFrame

log = logging.getLogger(__name__)

#: the blocks whose first frames' arrivals say how late the video comes
RECENT_BLOCKS = 8


def mono(pcm: np.ndarray, channels: int) -> np.ndarray:
    """Interleaved int16 samples of ``channels`` as one channel (their mean)."""
    if channels == 1:
        return pcm
    return pcm.reshape(-1, channels).mean(axis=1).round().astype(np.int16)


class AvatarFeed:
    """A session's speech in and media out for a plugin (see the module docstring)."""

    def __init__(self, session: AvatarSession):
        self.session = session
        self.playout = po.Playout()
        self.sender: Optional[SpeechSender] = None  # made at the first speech: the session's rate is its
        self.epoch = 0  # interrupts so far: what was made before the newest is not played
        self.lateness: deque = deque(maxlen=RECENT_BLOCKS)

    # ----- the agent's speech
    def speech(self, pcm: np.ndarray, rate: int) -> None:
        """int16 mono samples at ``rate``: sent to the session, kept to be played where it lands."""
        if self.sender is None:
            self.sender = SpeechSender(self.session, rate)
            self.sender.start()
        self.playout.push(pcm, rate)
        self.sender.pcm(pcm)

    def end_turn(self) -> bool:
        """The agent's turn so far is complete; whether a turn end is to come (False: no speech of
        its own since the last end or interrupt)."""
        if self.sender is not None:
            self.sender.end_of_speech()
        return self.playout.end_turn()

    def interrupt(self) -> None:
        """The agent was interrupted: the session drops what no started block holds, and nothing
        pushed so far plays any more."""
        self.epoch += 1
        self.playout.interrupt()
        if self.sender is not None:
            self.sender.interrupt()

    def stale(self, epoch: int, item) -> bool:
        """Whether ``item``, made at ``epoch``, is speech an interrupt since then silenced."""
        return epoch != self.epoch and isinstance(item, (po.Audio, po.TurnEnd))

    def earliest(self) -> Optional[float]:
        """The least lateness of the recent blocks' first frames (seconds; None: none yet)."""
        return min(self.lateness) if self.lateness else None

    # ----- the session's media
    async def items(self) -> AsyncIterator[tuple[int, po.Out]]:
        """What to play, in media order, each with the epoch it was made at; last :class:`Ended`
        (its video object; a broken stream's: ``{"error": ...}``, logged)."""
        new_block = True
        try:
            async for item in self.session.media():
                if isinstance(item, VideoFrame) and new_block:
                    self.lateness.append(time.monotonic() - item.t)
                new_block = isinstance(item, SpeechPlaced) or (new_block and not isinstance(item, VideoFrame))
                epoch = self.epoch
                for out in self.playout.feed(item):
                    yield epoch, out
                if isinstance(item, Ended):
                    return
        except Exception as e:  # noqa: BLE001 - the stream broke (the network's, the server's)
            log.warning("wan-s2v session %s: its video stopped: %r", self.session.id, e)
            yield self.epoch, Ended({"error": f"its video stopped: {e}"})

    async def close_speech(self) -> None:
        """What is queued is sent (never raises)."""
        if self.sender is not None:
            await self.sender.close()
