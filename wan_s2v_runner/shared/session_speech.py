"""A live session's speech folder: how its server hands the speech to the rank that starts its
blocks (``rank/speech_source.py``), in order, as it comes. Not the group's inbox (the jobs'): a
session's folder is its own, in the server's (shared) directory, so whichever group of the fleet
makes the session reads it there.

The server writes one file an event, ``<seq>.<kind>`` (:class:`SpeechKind`; the sequence from 1;
by temp name then rename, :func:`post_speech`); the rank takes them in their order
(:func:`take_speech`: a gap stops the read, none is skipped) and removes each as it reads it. While
the server holds the session it touches the folder's :data:`ALIVE` mark every second; a mark older
than :data:`ORPHAN_S` says the server died (:func:`orphaned`).
"""
from __future__ import annotations

import os
import time
from enum import Enum
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import atomic

#: a session's folder's mark that the server that opened it still holds it (touched every second)
ALIVE = ".alive"
#: a session whose alive mark is older than this is ended by the group that makes it (its server died)
ORPHAN_S = 120.0


def mark_alive(folder: Path) -> None:
    path = Path(folder) / ALIVE
    path.touch()
    os.utime(path)


def orphaned(folder: Path, now: Optional[float] = None) -> bool:
    """Whether no server has touched the session's alive mark for :data:`ORPHAN_S`."""
    try:
        seen = (Path(folder) / ALIVE).stat().st_mtime
    except FileNotFoundError:
        return False  # a folder made without a server (a test's, a file's): no server to lose
    return (time.time() if now is None else now) - seen > ORPHAN_S


class SpeechKind(str, Enum):
    """What a session's speech event file holds (its suffix)."""

    PCM = "pcm"  # speech: 16-bit little-endian mono PCM at 16 kHz (the server converted what came)
    END_OF_SPEECH = "eos"  # the utterance so far is complete
    INTERRUPT = "interrupt"  # drop the speech not yet in a started block
    FINISH = "finish"  # render the speech placed, then end the job


def post_speech(folder: Path, seq: int, kind: SpeechKind, data: bytes = b"") -> Path:
    """One speech event of a session (written by temp name then rename: rank 0 never reads half)."""
    path = Path(folder) / f"{seq:010d}.{SpeechKind(kind).value}"
    atomic.atomic_write(path, lambda p: p.write_bytes(data), need=len(data))
    return path


def take_speech(folder: Path, after: int) -> list[tuple[int, SpeechKind, bytes, float]]:
    """The session's events posted after sequence number ``after``, in order, each (seq, kind, data,
    posted wall time), removed as they are read. A gap in the numbers (an event still being renamed
    into place) stops the read there: events are taken in their order, none skipped."""
    try:
        names = sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return []
    out = []
    want = after + 1
    for name in names:
        stem, _, suffix = name.partition(".")
        try:
            seq, kind = int(stem), SpeechKind(suffix)
        except ValueError:
            continue
        if seq < want:
            continue
        if seq != want:
            break
        path = Path(folder) / name
        try:
            posted = path.stat().st_mtime
            data = path.read_bytes()
            path.unlink()
        except OSError:
            break
        out.append((seq, kind, data, posted))
        want += 1
    return out
