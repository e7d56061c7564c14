"""A live job's speech on the block grid: what each block hears, decided when the block starts.

A live job's video is made in blocks of :data:`BLOCK_SAMPLES` of speech (0.75 s); a block's speech
features (:mod:`wan_s2v_runner.shared.speech_windows`) read the speech up to a fixed lookahead past
the block. The **timeline** is that speech on absolute time from the job's start, at 16 kHz: what
the avatar's lips follow and what its recording plays. A file's speech is the whole timeline at once;
a live session's arrives in chunks (:class:`Speech`), with marks (:class:`EndOfSpeech`,
:class:`Interrupt`, :class:`Finish`). :class:`Timeline` places them and answers, for the next block,
:meth:`Timeline.decide`: start it now (:class:`Decision`, with whether it is the last and whether it
holds speech), wait, or end the job.

The rules (pure: numbers in, numbers out; the rank's speech source reads chunks and the clock and
asks):

* **Placement.** Speech is written where the timeline's speech ends (contiguous). When none is
  pending (the avatar was listening), a real-time job holds new speech unplaced and, at each block's
  start, places it as early as it can without running dry: where the speech in hand (``L``
  samples) and what arrives at real time from now on cover every later block's span and lookahead
  when that block starts, ``now + lead - L`` on the timeline's clock (:meth:`Timeline.lead`: a
  block's span, the lookahead and :data:`MARGIN_S`), never before what started blocks read. So a
  microphone's speech (real time) starts ``lead`` after it began, and a voice agent's TTS that sends
  a sentence at once starts with the next block. An utterance marked ended is placed at once. What
  lies between is silence (zeros).
* **Pace** (:class:`Pace`): ``realtime`` starts block ``g`` at its time, ``start + g x 0.75 s``,
  with the speech it has then: a block whose speech has not arrived is silent (the avatar listens);
  ``speech`` starts a block once its speech and lookahead are there (or the speech is marked ended
  or finished): never silence by the clock. A file is ``speech``-paced with its whole speech
  arrived: the same decisions a ``speech``-paced session fed that file in any chunks makes, so the
  two make the same frames.
* **Commitment.** Once a block starts, the timeline up to its :func:`need` is fixed: nothing later
  changes what a started block heard.
* **End of speech** (an utterance is complete): the blocks that hold its tail start without waiting
  for more (silence past it). **Interrupt**: speech not yet in a started block is dropped, including
  the lookahead the last started block read (the next block is silent, or the new speech).
  **Finish**: the speech placed is rendered to its end (a file's count of blocks), then the job ends;
  a finish that comes after the last block with speech started ends the job with one closing block.

**Runs** (:class:`Run`): where each part of the pushed speech landed on the timeline, in the pushed
stream's own sample numbers (the 16 kHz samples of every :class:`Speech` in order, dropped ones
included): a session's client replays its own copy of the speech (the TTS's samples at their rate)
exactly where the lips say it, and tells its speech from the blocks still playing an interrupted
turn. A block's runs travel with its fragment (:meth:`Timeline.runs_in`).

Memory: only the samples a block still needs are held (from the oldest block not yet handed out
less the features' context); a job of any length holds a few seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional, Union

import numpy as np

from wan_s2v_runner.shared.speech_windows import BLOCK_SAMPLES, RATE  # the timeline's rate; a block's span

#: how much earlier than it must, speech after a silence is written (a real-time job): what arrives
#: this much late still makes its block
MARGIN_S = 0.1


class Pace(str, Enum):
    """When a live job's blocks start."""

    REALTIME = "realtime"  # at their time on the clock, silent when no speech arrived (sessions)
    SPEECH = "speech"  # once their speech arrived: never silent by the clock (files; offline sessions)


@dataclass(frozen=True)
class Speech:
    """Speech samples (float32, mono, :data:`RATE`), posted at wall time ``at`` (None: a file's,
    there from the start)."""

    samples: np.ndarray
    at: Optional[float]


@dataclass(frozen=True)
class EndOfSpeech:
    """The utterance so far is complete (a TTS sentence's end)."""

    at: float


@dataclass(frozen=True)
class Interrupt:
    """Drop the speech not yet in a started block (a voice agent's barge-in)."""

    at: float


@dataclass(frozen=True)
class Finish:
    """Render the speech placed, then end the job."""

    at: float


Event = Union[Speech, EndOfSpeech, Interrupt, Finish]


@dataclass(frozen=True)
class Run:
    """``samples`` of the pushed speech from its sample ``pushed`` (the stream of every
    :class:`Speech` in order, 16 kHz) lie on the timeline from its sample ``at``."""

    at: int
    pushed: int
    samples: int

    @property
    def end(self) -> int:
        return self.at + self.samples

    def clip(self, lo: int, hi: int) -> Optional["Run"]:
        """This run's part within the timeline's [lo, hi) (None: none of it)."""
        a, b = max(lo, self.at), min(hi, self.end)
        return Run(a, self.pushed + a - self.at, b - a) if b > a else None


class Verdict(str, Enum):
    START = "start"
    WAIT = "wait"
    END = "end"


@dataclass(frozen=True)
class Decision:
    """What :meth:`Timeline.decide` says of a block."""

    verdict: Verdict
    #: START: no block follows this one
    last: bool = False
    #: START: the block's own span holds speech, a sample not zero (else: silence, the avatar listens)
    speech: bool = False
    #: WAIT: the wall time by which the answer may change without a new event (None: only an event)
    until: Optional[float] = None
    #: START: when the last sample it needs arrived (a block padded with silence: when it started;
    #: None: a file's, all there from the start): where the block's latency is counted from
    ready_at: Optional[float] = None


class Timeline:
    """The speech of one live job (see the module docstring). ``need(g)``: samples block ``g``'s
    features read (its span and the lookahead); ``blocks_for(n)``: blocks a finished speech of ``n``
    samples takes; ``lookahead``: the most samples past its span a block reads."""

    def __init__(self, pace: Pace, need: Callable[[int], int], blocks_for: Callable[[int], int],
                 lookahead: int, start: Optional[float] = None):
        self.pace, self.need, self.blocks_for = Pace(pace), need, blocks_for
        self.lookahead = lookahead
        self.start = start  # wall time of block 0 (realtime)
        self.base = 0  # the absolute sample self.held[0] is
        self.held = np.zeros(0, dtype=np.float32)
        self.committed = 0  # samples fixed by started blocks
        self.speech_end = 0  # where the speech written ends
        self.started = 0  # blocks started
        self.ended_mark = False  # an EndOfSpeech after the last speech
        self.finishing = False
        self.last_given = False  # the last block started was said to be the last
        #: samples of speech dropped by interrupts (the session's record)
        self.dropped = 0
        #: (end sample, posted time) of recent writes: when a block's last needed sample arrived
        self.arrivals: list[tuple[int, Optional[float]]] = []
        #: a real-time job's speech since a silence, not placed yet: (samples, posted time, its first
        #: sample's number in the pushed stream)
        self.unplaced: list[tuple[np.ndarray, Optional[float], int]] = []
        #: samples of speech received (the pushed stream's length)
        self.received = 0
        #: where the pushed speech lies on the timeline (:class:`Run`), from the oldest still held
        self.runs: list[Run] = []

    # ----- events
    def add(self, event: Event) -> None:
        """An event, in the order the session posted them."""
        if isinstance(event, Speech):
            self._write(np.asarray(event.samples, dtype=np.float32).reshape(-1), event.at)
        elif isinstance(event, EndOfSpeech):
            self.ended_mark = True
        elif isinstance(event, Interrupt):
            self._interrupt()
        elif isinstance(event, Finish):
            self.finishing = True
        else:
            raise TypeError(f"not a speech event: {event!r}")

    def lead(self) -> int:
        """How far past the present new speech goes after a silence (realtime): its first block's
        span and lookahead, and :data:`MARGIN_S`."""
        return BLOCK_SAMPLES + self.lookahead + int(MARGIN_S * RATE)

    def _now_sample(self, at: float) -> int:
        if self.start is None:
            return 0
        return int(max(0.0, at - self.start) * RATE)

    def _write(self, samples: np.ndarray, at: Optional[float]) -> None:
        if samples.size == 0:
            return
        if samples.dtype != np.float32 or not np.isfinite(samples).all():
            raise ValueError("speech samples must be finite float32")
        pushed, self.received = self.received, self.received + samples.size
        pending = self.speech_end > self.committed
        if not pending and self.pace is Pace.REALTIME or self.unplaced:  # after a silence: placed at a block's start
            self.unplaced.append((samples, at, pushed))
            self.ended_mark = False
            return
        self._place_at(max(self.committed, self.speech_end), samples, at, pushed)

    def _place_pending(self, g: int, now: float) -> None:
        """Speech held since a silence placed before block ``g`` starts, where it cannot run dry
        (the module docstring), if that is within what block ``g`` reads; else it waits."""
        if not self.unplaced:
            return
        held = sum(part.size for part, _, _ in self.unplaced)
        at_sample = self.committed
        if not (self.ended_mark or self.finishing):  # more may come, at real time at worst
            at_sample = max(at_sample, self._now_sample(now) + self.lead() - held)
        if at_sample >= self.need(g):
            return
        parts, self.unplaced = self.unplaced, []
        for part, at, pushed in parts:
            self._place_at(at_sample, part, at, pushed)
            at_sample += part.size

    def _place_at(self, at_sample: int, samples: np.ndarray, at: Optional[float], pushed: int) -> None:
        self._grow(at_sample + samples.size)
        self.held[at_sample - self.base:at_sample - self.base + samples.size] = samples
        self.speech_end = at_sample + samples.size
        self.ended_mark = False
        self.arrivals.append((self.speech_end, at))
        last = self.runs[-1] if self.runs else None
        if last is not None and last.end == at_sample and last.pushed + last.samples == pushed:
            self.runs[-1] = Run(last.at, last.pushed, last.samples + samples.size)
        else:
            self.runs.append(Run(at_sample, pushed, samples.size))

    def _interrupt(self) -> None:
        """Speech past the started blocks' spans goes (silence instead)."""
        self.dropped += sum(part.size for part, _, _ in self.unplaced)
        self.unplaced = []
        keep = self.started * BLOCK_SAMPLES
        if self.speech_end > keep:
            self.dropped += self.speech_end - max(keep, self.base)
            lo = max(keep, self.base) - self.base
            self.held[lo:] = 0.0
            self.speech_end = keep
            self.runs = [r for r in (run.clip(-1, keep) for run in self.runs) if r is not None]
        self.ended_mark = True

    def _grow(self, end: int) -> None:
        if end - self.base > self.held.size:
            self.held = np.concatenate([self.held, np.zeros(end - self.base - self.held.size, dtype=np.float32)])

    # ----- blocks
    def due(self, g: int) -> Optional[float]:
        """The wall time block ``g`` starts at (realtime; None: by its speech)."""
        if self.pace is not Pace.REALTIME or self.start is None:
            return None
        return self.start + g * BLOCK_SAMPLES / RATE

    def _ready_at(self, g: int, now: float) -> Optional[float]:
        """When block ``g`` could start: its speech up to :func:`need` there (``now`` where it did not
        all arrive: the block starts padded with silence) and, a real-time job's, its time come
        (speech that came early waits for its block's time: that wait is the pace, not latency).
        None: a file's (all there from the start). The arrivals no later block asks about go."""
        need, at = self.need(g), now
        for i, (end, posted) in enumerate(self.arrivals):
            if end >= need:
                del self.arrivals[:i]
                at = posted
                break
        else:
            self.arrivals = self.arrivals[-1:]
            if self.arrivals and self.arrivals[-1][1] is None:  # a file's speech, padded past its end
                return None
        if at is None:
            return None
        due = self.due(g)
        return at if due is None else max(at, due)

    def decide(self, now: float) -> Decision:
        """What to do with the next block (:attr:`started`) at wall time ``now``."""
        g = self.started
        if self.pace is Pace.REALTIME:
            due = self.due(g)
            if not self.finishing and due is not None and now < due:
                return Decision(Verdict.WAIT, until=due)
            self._place_pending(g, now)
        need = self.need(g)
        total = self.blocks_for(self.speech_end)
        holds_speech = bool(self.samples(g * BLOCK_SAMPLES, (g + 1) * BLOCK_SAMPLES).any())
        if self.finishing:
            if g < total or not self.last_given:  # a closing block when the last one started was not said last
                return self._start(g, last=g + 1 >= total, speech=holds_speech, now=now)
            return Decision(Verdict.END)
        if self.pace is Pace.SPEECH:
            if self.speech_end >= need or (self.ended_mark and g < total):
                return self._start(g, last=False, speech=holds_speech, now=now)
            return Decision(Verdict.WAIT)
        return self._start(g, last=False, speech=holds_speech, now=now)

    def _start(self, g: int, last: bool, speech: bool, now: float) -> Decision:
        ready_at = self._ready_at(g, now)
        self.committed = max(self.committed, self.need(g))
        self._grow(self.committed)
        self.started = g + 1
        self.last_given = last
        return Decision(Verdict.START, last=last, speech=speech, ready_at=ready_at)

    def samples(self, lo: int, hi: int) -> np.ndarray:
        """The timeline's samples [lo, hi) (absolute; zeros past what is held): a block's features'
        window or its span for the recording. Only a started block's may be asked."""
        if lo < self.base:
            raise ValueError(f"samples from {lo} were let go (held from {self.base})")
        out = np.zeros(max(0, hi - lo), dtype=np.float32)
        have = self.held[max(0, lo - self.base):max(0, hi - self.base)]
        out[:have.size] = have
        return out

    def block_span(self, g: int) -> np.ndarray:
        """Block ``g``'s own 0.75 s of the timeline (what its frames play with)."""
        return self.samples(g * BLOCK_SAMPLES, (g + 1) * BLOCK_SAMPLES)

    def runs_in(self, lo: int, hi: int) -> list[Run]:
        """The pushed speech on the timeline's [lo, hi) (a started block's span: fixed)."""
        return [r for r in (run.clip(lo, hi) for run in self.runs) if r is not None]

    def let_go(self, before: int) -> None:
        """Samples before ``before`` are no longer asked for."""
        cut = min(before, self.base + self.held.size) - self.base
        if cut > 0:
            self.held = self.held[cut:].copy()
            self.base += cut
        self.runs = [r for r in self.runs if r.end > self.base]

    def silent_until(self) -> int:
        """The sample up to which nothing but silence can still come (committed zeros included)."""
        return self.committed
