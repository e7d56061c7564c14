"""Live sessions on a server: a live job whose speech arrives over time (issue #81).

A session is a video job like any other (the queue's row, its attempt's folder, its video growing
in ``ID.partial.mp4`` and, once it ends, ``ID.mp4`` with its record), made by a ``--mode live``
group, whose spec says ``session`` (its :class:`~wan_s2v_runner.shared.speech_timeline.Pace`) and
whose speech comes through this module: each append is checked and converted here (16-bit PCM at
16 kHz, the rate the speech features read) and posted, in order, into the session's speech folder
(:func:`~wan_s2v_runner.shared.session_speech.post_speech`), where the group's decoding rank reads it as its
blocks start (:mod:`wan_s2v_runner.rank.speech_source`). Marks go the same way: end of speech,
interrupt, end (finish).

What a session must not do, refused with 4xx while the session lives on: a chunk of the wrong shape
(an odd byte count, a rate not allowed or changed mid-session, NaN or inf), one longer than
:data:`MAX_CHUNK_S`, speech arriving more than :data:`AHEAD_S` ahead of real time (a client
flooding it), any append after the session's end. A session that hears from no client for
``idle_s`` seconds is ended by the server (its recording kept: it becomes the job's video).

Where a session runs: its job goes to the pool's queue like any other and whichever free live group
of the fleet claims it first makes it (the create call waits a moment for a claim, else it is
refused with 429: a session never waits in the queue). Its speech folder, its growing video and its
recording are in the (shared) directory, so the server that opened it serves its speech, its stream
and its viewers whichever server's group makes it. The session's state (its order of events, its
idle clock) is the opening server's, in memory: while the session is open that server touches the
folder's :data:`~wan_s2v_runner.shared.session_speech.ALIVE` mark every second, and a group whose session's
mark grew stale (the server died) ends it by itself, its recording kept
(:mod:`wan_s2v_runner.rank.speech_source`). A session is never run twice: a group that fails under
it fails it (live jobs do not resume).
"""
from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from wan_s2v_runner.serve.submissions import Refused
from wan_s2v_runner.shared import session_speech
from wan_s2v_runner.shared.session_speech import SpeechKind
from wan_s2v_runner.shared.speech_timeline import Pace
from wan_s2v_runner.shared.speech_windows import RATE

log = logging.getLogger("wan_s2v.sessions")

#: the rates an append may state (PCM); a WAV's own rate must be one of them
RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
#: the most speech one append carries
MAX_CHUNK_S = 10.0
#: how far ahead of real time (since the session opened) its speech may have arrived
AHEAD_S = 60.0
#: a session with no client for this long is ended by the server (its recording kept)
IDLE_S = 30.0
#: an ended session is let go this long after its job ended (its video and record stay the queue's):
#: a served hour holds the sessions that run and the last few minutes' ended ones
FORGET_S = 600.0


class SpeechFormat(str, Enum):
    """How an append's body holds its speech (``format=``)."""

    S16LE = "s16le"  # 16-bit little-endian mono PCM at ``rate``
    F32LE = "f32le"  # 32-bit float little-endian mono PCM at ``rate``
    WAV = "wav"  # a WAV (or FLAC, OGG) file: its own rate, mono


class SessionState(str, Enum):
    OPEN = "open"  # speech may be appended
    ENDING = "ending"  # ended (by its client, or idle): the speech placed is being rendered
    ENDED = "ended"  # its job ended


@dataclass
class Session:
    """One session's server side."""

    id: str
    folder: Path
    pace: Pace
    opened: float
    last_seen: float
    seq: int = 0
    samples: int = 0  # speech posted, at 16 kHz
    rate: Optional[int] = None  # the rate its PCM appends state (fixed by the first)
    state: SessionState = SessionState.OPEN
    ended_by: Optional[str] = None  # "client" or "idle"
    interrupts: int = 0
    ended_at: Optional[float] = None  # when its job ended (it is let go :data:`FORGET_S` after)
    resampler: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, kind: SpeechKind, data: bytes = b"") -> None:
        self.seq += 1
        session_speech.post_speech(self.folder, self.seq, kind, data)

    @property
    def speech_s(self) -> float:
        return round(self.samples / RATE, 3)


def _floats(body: bytes, fmt: SpeechFormat, rate: Optional[int]) -> tuple[np.ndarray, int]:
    """An append's speech as mono float32 samples and their rate (:class:`Refused` 400/415 when it
    cannot be)."""
    if fmt is SpeechFormat.WAV:
        import soundfile

        try:
            data, got = soundfile.read(io.BytesIO(body), dtype="float32", always_2d=True)
        except Exception as e:  # noqa: BLE001 - any decoder error is the client's body
            raise Refused(415, f"the speech does not decode as audio ({type(e).__name__}). Fix: send a WAV, FLAC or "
                               "OGG file, or raw PCM with format=s16le", "body") from None
        if data.shape[1] != 1:
            raise Refused(400, f"the speech has {data.shape[1]} channels. Fix: send mono speech", "body")
        if got not in RATES:
            raise Refused(400, f"the speech's rate {got} Hz is not taken. Fix: one of {', '.join(map(str, RATES))}",
                          "body")
        return data[:, 0], int(got)
    if rate is None or rate not in RATES:
        raise Refused(400, f"rate {rate} is not taken. Fix: rate= one of {', '.join(map(str, RATES))} (Hz)", "rate")
    width = 2 if fmt is SpeechFormat.S16LE else 4
    if len(body) % width:
        raise Refused(400, f"{len(body)} bytes is not a whole number of {fmt.value} samples ({width} bytes each). "
                           "Fix: send whole samples", "body")
    if fmt is SpeechFormat.S16LE:
        return np.frombuffer(body, dtype="<i2").astype(np.float32) / 32768.0, rate
    samples = np.frombuffer(body, dtype="<f4").astype(np.float32)
    if not np.isfinite(samples).all():
        raise Refused(400, "the speech holds NaN or inf samples. Fix: send finite samples in [-1, 1]", "body")
    return samples, rate


def to_pcm16k(samples: np.ndarray, rate: int, resampler, last: bool = False) -> tuple[bytes, object]:
    """Samples at ``rate`` -> 16-bit PCM at 16 kHz (a session's own streaming resampler, kept
    across its appends: chunk boundaries make no seam; at 16 kHz the samples pass unchanged).
    ``last``: the utterance ends here: what the resampler still holds comes out too (an utterance of
    ``n`` samples then makes exactly ``round(n x 16000 / rate)``: a client counts its speech as the
    server does, ``integrations/playout``), and the next one starts a fresh resampler (None)."""
    if rate != RATE:
        if resampler is None:
            import soxr

            resampler = soxr.ResampleStream(rate, RATE, 1, dtype="float32", quality="HQ")
        samples = resampler.resample_chunk(np.ascontiguousarray(samples, dtype=np.float32), last=last)
    pcm = np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32768.0), -32768, 32767).astype("<i2")
    return pcm.tobytes(), None if last else resampler


class Sessions:
    """The server's open sessions, by id (see the module docstring)."""

    def __init__(self, idle_s: float = IDLE_S, clock: Callable[[], float] = time.time,
                 rendered: Callable[[str], float] = lambda job_id: 0.0,
                 job_ended: Callable[[str], bool] = lambda job_id: False):
        """``rendered(id)``: seconds of a session's video made so far (how far ahead of it a
        ``speech``-paced session's speech may arrive); ``job_ended(id)``: whether its video job ended
        (the sweep lets the session go: a served hour holds only the sessions that run)."""
        self.idle_s, self.clock, self.rendered, self.job_ended = idle_s, clock, rendered, job_ended
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._sweeper: Optional[threading.Thread] = None

    def open(self, job_id: str, folder: Path, pace: Pace) -> Session:
        Path(folder).mkdir(parents=True, exist_ok=True)
        session_speech.mark_alive(folder)
        now = self.clock()
        s = Session(job_id, Path(folder), Pace(pace), opened=now, last_seen=now)
        with self._lock:
            self._sessions[job_id] = s
            if self._sweeper is None:  # the idle sessions' end, on a thread of its own from the first session on
                self._sweeper = threading.Thread(target=self._sweep_forever, name="wan-s2v-sessions", daemon=True)
                self._sweeper.start()
        return s

    def forget(self, job_id: str) -> None:
        """A session whose job was never queued."""
        with self._lock:
            self._sessions.pop(job_id, None)

    def _sweep_forever(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_s / 4))
            try:
                self.sweep()
                self._mark_alive()
            except Exception:  # noqa: BLE001 - the next sweep tries again
                log.exception("the sessions' sweep failed")

    def get(self, job_id: str) -> Session:
        with self._lock:
            s = self._sessions.get(job_id)
        if s is None:
            raise Refused(404, f"no live session {job_id!r} on this server. Fix: create one with POST "
                               "/v1/videos/sessions", "session_id")
        return s

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def touch(self, job_id: str) -> Session:
        s = self.get(job_id)
        s.last_seen = self.clock()
        return s

    def _mark_alive(self) -> None:
        """The open and ending sessions' folders say this server still holds them; a session whose job
        ended is marked so, and let go :data:`FORGET_S` after."""
        now = self.clock()
        for s in self.all():
            if s.state is not SessionState.ENDED and self.job_ended(s.id):
                self.ended(s.id)
            if s.state is SessionState.ENDED:
                if now - (s.ended_at or now) > FORGET_S:
                    with self._lock:
                        self._sessions.pop(s.id, None)
                continue
            try:
                session_speech.mark_alive(s.folder)
            except OSError as e:  # the folder's filesystem: the next sweep tries again
                log.warning("session %s: its alive mark could not be written: %s", s.id, e)

    def _open_one(self, job_id: str) -> Session:
        s = self.touch(job_id)
        if s.state is not SessionState.OPEN:
            raise Refused(409, f"session {job_id} has ended ({s.ended_by or 'its job ended'}). Fix: create a new "
                               "session", "session_id")
        return s

    def append(self, job_id: str, body: bytes, fmt: SpeechFormat, rate: Optional[int]) -> Session:
        """Speech appended (checked, converted, posted)."""
        s = self._open_one(job_id)
        samples, rate = _floats(body, SpeechFormat(fmt), rate)
        if samples.size > MAX_CHUNK_S * rate:
            raise Refused(413, f"{samples.size / rate:.1f} s of speech in one append. Fix: at most {MAX_CHUNK_S:g} s "
                               "an append (send it in parts)", "body")
        with s.lock:
            if s.rate is not None and rate != s.rate:
                raise Refused(409, f"rate {rate} Hz after {s.rate} Hz in this session. Fix: keep one rate for a "
                                   "session (or create a new one)", "rate")
            since = self.clock() - s.opened if s.pace is Pace.REALTIME else self.rendered(s.id)
            ahead = (s.samples + samples.size * RATE / rate) / RATE - since
            if ahead > AHEAD_S:
                raise Refused(429, f"this session's speech would be {ahead:.0f} s ahead of its video. Fix: send it "
                                   f"no more than {AHEAD_S:g} s ahead of when it is spoken", retry_after=1)
            pcm, s.resampler = to_pcm16k(samples, rate, s.resampler)
            s.rate = rate
            if pcm:
                s.post(SpeechKind.PCM, pcm)
                s.samples += len(pcm) // 2
        return s

    def mark(self, job_id: str, kind: SpeechKind) -> Session:
        """End of speech, an interrupt or the end (the session ends: :attr:`SessionState.ENDING`)."""
        s = self.touch(job_id)
        with s.lock:
            if s.state is not SessionState.OPEN:
                if kind is SpeechKind.FINISH:
                    return s  # ended already: the same answer again
                raise Refused(409, f"session {job_id} has ended. Fix: create a new session", "session_id")
            if kind is SpeechKind.INTERRUPT:
                s.interrupts += 1
            if s.resampler is not None:  # the utterance ends: its resampler's tail, then a fresh one
                pcm, s.resampler = to_pcm16k(np.zeros(0, dtype=np.float32), s.rate, s.resampler, last=True)
                if pcm:
                    s.post(SpeechKind.PCM, pcm)
                    s.samples += len(pcm) // 2
            s.post(kind)
            if kind is SpeechKind.FINISH:
                s.state, s.ended_by = SessionState.ENDING, "client"
        return s

    def sweep(self) -> list[str]:
        """Sessions no client heard from for :attr:`idle_s` are ended (their recording kept); the ids."""
        now, out = self.clock(), []
        for s in self.all():
            if s.state is SessionState.OPEN and now - s.last_seen > self.idle_s:
                with s.lock:
                    try:
                        s.post(SpeechKind.FINISH)
                    except OSError as e:  # its folder: tried again at the next sweep
                        log.warning("session %s: its end could not be posted: %s", s.id, e)
                        continue
                    s.state, s.ended_by = SessionState.ENDING, "idle"
                log.info("session %s heard from no client for %.0f s: ended, its recording kept", s.id, self.idle_s)
                out.append(s.id)
        return out

    def ended(self, job_id: str) -> None:
        """The session's job ended: nothing more is taken."""
        with self._lock:
            s = self._sessions.get(job_id)
        if s is not None and s.state is not SessionState.ENDED:
            s.state, s.ended_at = SessionState.ENDED, self.clock()
