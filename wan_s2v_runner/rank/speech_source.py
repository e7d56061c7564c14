"""A live job's speech on its decoding rank: where it comes from, and each block's share of it.

One speech pipeline for files and sessions (:class:`BlockSpeech`): the speech's events go into a
:class:`~wan_s2v_runner.shared.speech_timeline.Timeline`, which says when the next block starts and
what it hears; the block's wav2vec2 features are then made from the timeline alone
(:class:`~wan_s2v_runner.rank.speech_features.BlockFeatures`: a pure function of the speech up to the
block's lookahead), and its span of the timeline is what its frames play with. The events:

* :class:`FileEvents`: a file's speech, read as upstream reads it (16 kHz), arrived whole and
  finished, paced by the speech (:attr:`Pace.SPEECH`);
* :class:`SessionEvents`: a live session's, as its server posts them into its speech folder
  (:func:`~wan_s2v_runner.shared.session_speech.take_speech`: a local read on the decoding rank, which runs
  on the server's node).

So a session fed a file's speech in any chunks, ``speech``-paced and then finished, makes the file's
frames bit for bit: the same timeline, the same decisions.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Protocol

import numpy as np
import torch

from wan_s2v_runner.shared import session_speech
from wan_s2v_runner.shared import speech_timeline as st
from wan_s2v_runner.shared.session_speech import SpeechKind
from wan_s2v_runner.shared.speech_windows import SpeechWindow

#: how long the decoding rank sleeps between looks at a session's speech folder while a block waits
POLL_S = 0.01


class SpeechEvents(Protocol):
    #: pushed by a client (a session's): each block says where the pushed speech it plays came from
    pushed: bool

    def take(self) -> list[st.Event]:
        """The events that arrived since the last call, in order."""


class FileEvents:
    """A file's speech: all of it at once, then finished."""

    pushed = False

    def __init__(self, samples: np.ndarray):
        self.events: list[st.Event] = [st.Speech(samples, None), st.Finish(0.0)]

    def take(self) -> list[st.Event]:
        out, self.events = self.events, []
        return out


class SessionEvents:
    """A served session's speech, read from its folder (16-bit PCM at 16 kHz, and marks:
    :func:`~wan_s2v_runner.shared.session_speech.take_speech`)."""

    pushed = True

    def __init__(self, folder: Path, pace: st.Pace):
        self.folder, self.pace = Path(folder), st.Pace(pace)
        self.seq = 0
        self.orphan_said = False

    def take(self) -> list[st.Event]:
        out: list[st.Event] = []
        if not self.orphan_said and session_speech.orphaned(self.folder):  # its server died: the session ends here
            self.orphan_said = True
            return [st.Finish(time.time())]
        for seq, kind, data, posted in session_speech.take_speech(self.folder, self.seq):
            self.seq = seq
            if kind is SpeechKind.PCM:
                pcm = np.frombuffer(data[:len(data) // 2 * 2], dtype="<i2")
                out.append(st.Speech(pcm.astype(np.float32) / 32768.0, posted))
            elif kind is SpeechKind.END_OF_SPEECH:
                out.append(st.EndOfSpeech(posted))
            elif kind is SpeechKind.INTERRUPT:
                out.append(st.Interrupt(posted))
            else:
                out.append(st.Finish(posted))
        return out


class BlockSpeech:
    """The decoding rank's speech for one live job (see the module docstring)."""

    def __init__(self, encoder, window: SpeechWindow, pace: st.Pace, events: SpeechEvents, device: torch.device,
                 dtype: torch.dtype, clock=time.time):
        from wan_s2v_runner.rank.speech_features import BlockFeatures

        self.window, self.events, self.clock = window, events, clock
        self.features_of = BlockFeatures(encoder, window, device, dtype)
        self.timeline = st.Timeline(pace, window.needed_samples, window.blocks_for_samples,
                                    lookahead=window.lookahead_samples)

    def begin(self) -> None:
        """The job's clock starts (a real-time job's block 0 is due now)."""
        self.timeline.start = self.clock()

    def next(self) -> st.Decision:
        """What to do with the next block now (the events that arrived since read first)."""
        for event in self.events.take():
            self.timeline.add(event)
        return self.timeline.decide(self.clock())

    def wait(self, decision: st.Decision) -> None:
        """A short sleep while a block waits (until its due time, or the next look at the speech folder)."""
        pause = POLL_S if decision.until is None else min(POLL_S, max(0.0, decision.until - self.clock()))
        time.sleep(pause)

    def block(self, g: int) -> tuple[torch.Tensor, np.ndarray, Optional[tuple[st.Run, ...]]]:
        """A started block ``g``'s speech features [1, layers, dim, 12], its 0.75 s of the timeline
        (float32, 16 kHz: what its frames play with) and, a pushed speech's, where the pushed speech
        in that span came from (:class:`~wan_s2v_runner.shared.speech_timeline.Run`; None: a file's);
        then what no later block reads goes."""
        s0, s1 = self.window.samples_of_block(g)
        span = self.timeline.block_span(g)
        lo, hi = g * st.BLOCK_SAMPLES, (g + 1) * st.BLOCK_SAMPLES
        runs = tuple(self.timeline.runs_in(lo, hi)) if self.events.pushed else None
        out = self.features_of.of_window(self.timeline.samples(s0, s1), g)
        self.timeline.let_go(min(self.window.samples_of_block(g + 1)[0], (g + 1) * st.BLOCK_SAMPLES))
        return out, span, runs

    def peek_blocks(self) -> int:
        """The job's blocks where known now (a file's: its speech arrived whole and finished; 0: not
        yet, a session's), the events that arrived read first."""
        for event in self.events.take():
            self.timeline.add(event)
        t = self.timeline
        return t.blocks_for(t.speech_end) if t.finishing else 0

    def close(self) -> None:
        """The job ended (what is left of a session's folder is its server's)."""


def file_samples(encoder, path: str) -> np.ndarray:
    """A speech file's samples at 16 kHz, read as upstream reads them."""
    from wan_s2v_runner.rank.speech_features import load_speech

    return load_speech(encoder, path).numpy().astype(np.float32, copy=False)
