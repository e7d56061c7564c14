"""What an avatar plays, made from a live session's media: its frames, and the speech its client
pushed, replayed from the client's own copy exactly where the session's blocks placed it.

The recording's speech is the session's timeline at 16 kHz through AAC; a voice agent's TTS speaks
at 24 or 48 kHz. So the plugins do not play the stream's speech back: each block of the stream says
where the pushed speech it plays came from (:class:`~wan_s2v_runner.integrations.session_client.SpeechPlaced`:
runs of the pushed stream, counted at 16 kHz), and :class:`Playout` cuts those runs from what the
client pushed, at the rate it pushed them: the audio out is the audio in, sample for sample, placed
where the lips say it.

Turns: a voice agent speaks in turns (a TTS reply; LiveKit's audio segment). :meth:`Playout.end_turn`
marks where the pushed turn ends; :class:`TurnEnd` comes out at the media time its last sample plays
(a framework's "playback finished"). :meth:`Playout.interrupt` (a barge-in) mutes everything pushed so
far: blocks the session had already started still show their frames (the lips finish within a block
or so), their speech is not played.

Pure: items in, items out, no clock (a plugin paces what comes out, or its framework does). Memory:
the pushed speech not yet placed (the server takes at most 60 s ahead of the video) and one block's
pieces not yet released.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from wan_s2v_runner.integrations.session_client import Ended, SpeechChunk, SpeechPlaced, VideoFrame

#: the rate the session counts pushed speech in (its timeline's)
RUNS_RATE = 16000
#: a turn whose marked end lies at most this far past the speech placed so far has ended (the
#: server flushes its resampler at each mark: an utterance of n samples is round(n x 16000 / rate)
#: there, as here; the slack is rounding's)
END_SLACK = 2


@dataclass(frozen=True)
class Audio:
    """Pushed speech to play from media second ``t``: ``int16`` mono at ``rate`` (the pushed rate)."""

    pcm: np.ndarray
    rate: int
    t: float

    @property
    def end(self) -> float:
        return self.t + self.pcm.size / self.rate


@dataclass(frozen=True)
class TurnEnd:
    """The turn's last pushed sample plays at media second ``t``."""

    t: float


Out = Union[VideoFrame, Audio, TurnEnd, Ended]


class Playout:
    """One session's playout (see the module docstring). ``piece_s``: the longest :class:`Audio` piece
    (pieces interleave with the frames by media time)."""

    def __init__(self, piece_s: float = 0.02):
        self.piece_s = piece_s
        self.rate: Optional[int] = None
        self.kept = np.zeros(0, dtype=np.int16)  # pushed samples from self.base on (at self.rate)
        self.base = 0
        self.pushed = 0  # samples pushed, at self.rate
        self.ends: deque[int] = deque()  # turn ends not yet played, at 16 kHz in the pushed stream
        #: (16 kHz sample, pushed sample) where each utterance began: the server resamples each apart
        #: (its resampler is flushed at every mark), so the two counts meet again at each
        self.bounds: deque[tuple[int, int]] = deque([(0, 0)])
        self.mute_before = 0  # at 16 kHz: pushed speech before this was interrupted
        self.pending: list = []  # Audio and TurnEnd not released yet (until a frame at or after them)

    # ----- what the client pushed
    def push(self, pcm: np.ndarray, rate: int) -> None:
        """A copy of speech the client pushed (mono; int16, or float in [-1, 1])."""
        if self.rate is None:
            self.rate = int(rate)
        elif rate != self.rate:
            raise ValueError(f"a session's speech keeps its first rate ({self.rate} Hz), not {rate} Hz")
        a = np.asarray(pcm)
        if a.dtype.kind == "f":
            a = np.clip(np.round(a * 32768.0), -32768, 32767)
        a = a.astype(np.int16).reshape(-1)
        self.kept = np.concatenate([self.kept, a])
        self.pushed += a.size

    def _at16(self, n: int) -> int:
        """The pushed stream's 16 kHz sample (the server's count) at pushed sample ``n``: soxr's
        count, rounded half up."""
        at16, at = self.bounds[-1]
        return at16 + (2 * (n - at) * RUNS_RATE + self.rate) // (2 * self.rate) if self.rate else 0

    def _of16(self, p: int) -> int:
        """The pushed sample (at the pushed rate) at the pushed stream's 16 kHz sample ``p``."""
        at16, at = next((b for b in reversed(self.bounds) if b[0] <= p), self.bounds[0])
        return at + (2 * (p - at16) * self.rate + RUNS_RATE) // (2 * RUNS_RATE)

    def _utterance_ends(self) -> None:
        end = (self._at16(self.pushed), self.pushed)
        if end != self.bounds[-1]:
            self.bounds.append(end)

    def end_turn(self) -> bool:
        """The turn pushed so far is complete (the client marked its end of speech); whether a turn
        end is to come (False: no speech since the last end or interrupt)."""
        end = self._at16(self.pushed)
        added = end > self.mute_before and (not self.ends or end > self.ends[-1])
        if added:
            self.ends.append(end)
        self._utterance_ends()
        return added

    def interrupt(self) -> None:
        """Nothing pushed so far plays any more (nor its turn's end); the client interrupted the session."""
        self.mute_before = self._at16(self.pushed)
        self._utterance_ends()
        self.ends.clear()
        self.pending = [p for p in self.pending if not isinstance(p, (Audio, TurnEnd))]
        self._let_go(self.pushed)

    def _let_go(self, before: int) -> None:
        cut = min(before, self.base + self.kept.size) - self.base
        if cut > 0:
            self.kept = self.kept[cut:].copy()
            self.base += cut

    # ----- what the session made
    def feed(self, item) -> list[Out]:
        """One item of the session's media in; what may be played now out, in media order."""
        if isinstance(item, SpeechPlaced):
            self._placed(item)
            return []
        if isinstance(item, VideoFrame):
            out = [p for p in self.pending if p.t <= item.t]
            self.pending = [p for p in self.pending if p.t > item.t]
            return [*out, item]
        if isinstance(item, Ended):
            out, self.pending = self.pending, []
            return [*out, item]
        if isinstance(item, SpeechChunk):
            return []  # the recording's speech: played from the pushed copy instead
        raise TypeError(f"not a session's media item: {item!r}")

    def _placed(self, block: SpeechPlaced) -> None:
        for t, pushed, n in block.runs:
            self._play(t, pushed, n)
            end = pushed + n
            if self.ends and abs(self.ends[0] - end) <= END_SLACK:
                self._turn_end(t + n / RUNS_RATE)  # its last sample is placed

    def _turn_end(self, t: float) -> None:
        self.ends.popleft()
        self.pending.append(TurnEnd(t))

    def _play(self, t: float, pushed: int, n: int) -> None:
        """The run's audible part as pieces, a :class:`TurnEnd` where a turn ends inside it."""
        lo, hi = max(pushed, self.mute_before), pushed + n
        while self.ends and self.ends[0] < lo - END_SLACK:  # ended before what plays here (muted or passed)
            self.ends.popleft()
        cuts = [e for e in self.ends if lo < e < hi - END_SLACK]
        edges = [lo, *cuts, hi] if lo < hi else []
        for a, b in zip(edges, edges[1:]):
            self._pieces(t + (a - pushed) / RUNS_RATE, self._of16(a), self._of16(b))
            if b in cuts:
                self._turn_end(t + (b - pushed) / RUNS_RATE)
        if self.rate:
            self._let_go(self._of16(hi))
            while len(self.bounds) > 1 and self.bounds[1][0] <= hi:  # utterances no later run reads
                self.bounds.popleft()

    def _pieces(self, t: float, a: int, b: int) -> None:
        """Pushed samples [a, b) (at the pushed rate; ``a`` plays at ``t``) as pieces."""
        lo, hi = max(a, self.base), min(b, self.base + self.kept.size)
        step = max(1, int(self.piece_s * self.rate))
        for i in range(lo, hi, step):
            j = min(hi, i + step)
            pcm = self.kept[i - self.base:j - self.base].copy()
            self.pending.append(Audio(pcm, self.rate, t + (i - a) / self.rate))
