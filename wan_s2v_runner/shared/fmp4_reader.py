"""Our fragmented MP4 (:mod:`wan_s2v_runner.shared.fmp4`) read back: its boxes, its tracks, each
fragment's samples, and the media itself decoded fragment by fragment as the file or a stream grows
(:class:`FragmentDecoder`: bytes in, frames and speech out, with their media seconds). Read by a
session's WebRTC viewers on the server (``serve/whep.py``) and by the sessions' client
(``integrations/session_client.py``) from the HTTP stream.

Only what our writer writes is read: an ``avc1`` track with ``avcC`` (each fragment begins with an
IDR frame: a clip or block is encoded by a fresh encoder), an ``mp4a`` track (one AAC encoder for the
whole file, so its decoder is kept across fragments), moof-relative data offsets.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np


# --------------------------------------------------------------------------- the file's boxes
def boxes(data: bytes, start: int = 0, end: Optional[int] = None) -> Iterator[tuple[bytes, int, int, int]]:
    """(type, box start, body start, box end) of each complete box in data[start:end]."""
    end = len(data) if end is None else end
    i = start
    while i + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, i)
        head = 8
        if size == 1 and i + 16 <= end:
            size, head = struct.unpack_from(">Q", data, i + 8)[0], 16
        if size < head or i + size > end:
            return
        yield kind, i, i + head, i + size
        i += size


def child(data: bytes, path: list[bytes], start: int, end: int) -> Optional[tuple[int, int]]:
    """(body start, end) of the first box at ``path`` below data[start:end]."""
    for kind, _, body, stop in boxes(data, start, end):
        if kind == path[0]:
            return (body, stop) if len(path) == 1 else child(data, path[1:], body, stop)
    return None


def descriptor(data: bytes, i: int) -> tuple[int, int, int]:
    """An MPEG-4 descriptor at i: (tag, body start, body end)."""
    tag, n, i = data[i], 0, i + 1
    for _ in range(4):
        b = data[i]
        i += 1
        n = (n << 7) | (b & 0x7F)
        if not b & 0x80:
            break
    return tag, i, i + n


def aac_config(data: bytes, body: int, end: int) -> bytes:
    """The AudioSpecificConfig in an ``esds`` box's body."""
    tag, i, stop = descriptor(data, body + 4)  # after the full box's version and flags
    if tag != 0x03:
        raise ValueError("esds holds no ES descriptor")
    flags = data[i + 2]
    i += 3 + (2 if flags & 0x80 else 0) + (1 + data[i + 3] if flags & 0x40 else 0) + (2 if flags & 0x20 else 0)
    tag, i, stop = descriptor(data, i)
    if tag != 0x04:
        raise ValueError("esds holds no decoder config")
    tag, i, stop = descriptor(data, i + 13)
    if tag != 0x05:
        raise ValueError("esds holds no AudioSpecificConfig")
    return bytes(data[i:stop])


@dataclass(frozen=True)
class Tracks:
    """What a session's init segment says its tracks are."""

    video: int  # track ids
    timescale: int  # the video's ticks a second
    avcc: bytes
    audio: Optional[int] = None
    rate: int = 0  # the audio's samples a second (its timescale)
    asc: bytes = b""
    priming: int = 0  # the audio samples the edit list skips


def read_init(init: bytes) -> Tracks:
    """The tracks of an init segment (``ftyp`` + ``moov``)."""
    moov = child(init, [b"moov"], 0, len(init))
    if moov is None:
        raise ValueError("no moov box")
    video = audio = None
    for kind, _, body, stop in boxes(init, *moov):
        if kind != b"trak":
            continue
        tkhd = child(init, [b"tkhd"], body, stop)
        track = struct.unpack_from(">I", init, tkhd[0] + (20 if init[tkhd[0]] == 1 else 12))[0]
        mdhd = child(init, [b"mdia", b"mdhd"], body, stop)
        timescale = struct.unpack_from(">I", init, mdhd[0] + (20 if init[mdhd[0]] == 1 else 12))[0]
        hdlr = child(init, [b"mdia", b"hdlr"], body, stop)
        handler = init[hdlr[0] + 8:hdlr[0] + 12]
        stsd = child(init, [b"mdia", b"minf", b"stbl", b"stsd"], body, stop)
        entries = list(boxes(init, stsd[0] + 8, stsd[1]))
        if handler == b"vide" and entries and entries[0][0] == b"avc1":
            avcc = child(init, [b"avcC"], entries[0][2] + 78, entries[0][3])
            video = (track, timescale, bytes(init[avcc[0]:avcc[1]]))
        elif handler == b"soun" and entries and entries[0][0] == b"mp4a":
            esds = child(init, [b"esds"], entries[0][2] + 28, entries[0][3])
            elst = child(init, [b"edts", b"elst"], body, stop)
            priming = 0
            if elst is not None and struct.unpack_from(">I", init, elst[0] + 4)[0]:
                v1 = init[elst[0]] == 1
                priming = struct.unpack_from(">q" if v1 else ">i", init, elst[0] + (16 if v1 else 12))[0]
            audio = (track, timescale, aac_config(init, *esds), max(0, priming))
    if video is None:
        raise ValueError("no H.264 video track")
    return Tracks(*video, *(audio or (None, 0, b"", 0)))


@dataclass
class Sample:
    time: int  # its decode time, in its track's timescale
    duration: int
    data: bytes


def fragment_samples(data: bytes, moof: int, moof_end: int) -> dict[int, list[Sample]]:
    """Each track's samples of the fragment whose ``moof`` box spans data[moof:moof_end] (its
    ``mdat`` after it, in ``data``)."""
    out: dict[int, list[Sample]] = {}
    for kind, _, body, stop in boxes(data, moof + 8, moof_end):
        if kind != b"traf":
            continue
        tfhd = child(data, [b"tfhd"], body, stop)
        flags = struct.unpack_from(">I", data, tfhd[0])[0] & 0xFFFFFF
        track = struct.unpack_from(">I", data, tfhd[0] + 4)[0]
        if flags & 0x01:
            raise ValueError("a base data offset in tfhd (only moof-relative offsets are read)")
        at = tfhd[0] + 8 + (4 if flags & 0x02 else 0)
        default_duration = struct.unpack_from(">I", data, at)[0] if flags & 0x08 else 0
        at += 4 if flags & 0x08 else 0
        default_size = struct.unpack_from(">I", data, at)[0] if flags & 0x10 else 0
        tfdt = child(data, [b"tfdt"], body, stop)
        time_ = (struct.unpack_from(">Q", data, tfdt[0] + 4)[0] if data[tfdt[0]] == 1
                 else struct.unpack_from(">I", data, tfdt[0] + 4)[0]) if tfdt else 0
        trun = child(data, [b"trun"], body, stop)
        tflags = struct.unpack_from(">I", data, trun[0])[0] & 0xFFFFFF
        count = struct.unpack_from(">I", data, trun[0] + 4)[0]
        i = trun[0] + 8
        offset = 0
        if tflags & 0x01:
            offset = struct.unpack_from(">i", data, i)[0]
            i += 4
        i += 4 if tflags & 0x04 else 0
        pos, samples = moof + offset, out.setdefault(track, [])
        for _ in range(count):
            duration = default_duration
            size = default_size
            if tflags & 0x100:
                duration = struct.unpack_from(">I", data, i)[0]
                i += 4
            if tflags & 0x200:
                size = struct.unpack_from(">I", data, i)[0]
                i += 4
            i += (4 if tflags & 0x400 else 0) + (4 if tflags & 0x800 else 0)
            samples.append(Sample(time_, duration, bytes(data[pos:pos + size])))
            pos += size
            time_ += duration
    return out


def newest_fragment(f) -> tuple[int, Optional[int]]:
    """Where a late viewer starts in a growing file: (the init segment's end, the start of its
    last complete fragment, None when none is complete yet). Reads the top-level boxes' headers."""
    size = os.fstat(f.fileno()).st_size
    i, init_end, last, moof = 0, 0, None, None
    while i + 8 <= size:
        f.seek(i)
        n, kind = struct.unpack(">I4s", f.read(8))
        if n < 8 or i + n > size:
            break
        if kind == b"moov":
            init_end = i + n
        elif kind == b"moof":
            moof = i
        elif kind == b"mdat" and moof is not None:
            last, moof = moof, None
        i += n
    return init_end, last


# --------------------------------------------------------------------------- decoding
@dataclass
class Media:
    """One fragment's media: its video frames (RGB ``uint8`` [H, W, 3]) and its decoded speech
    (``int16`` mono) at the audio track's rate, each with its media second."""

    video: list = field(default_factory=list)  # (t, frame)
    audio: list = field(default_factory=list)  # (t, pcm)
    #: where its video ends (its last frame's time and duration), media seconds; None: no frame
    video_end: Optional[float] = None
    #: a session's block: its span's start on the speech's timeline (seconds) and where the pushed
    #: speech in it came from, (at, pushed, samples) in 16 kHz samples
    #: (:func:`~wan_s2v_runner.shared.fmp4.speech_runs_box`); None: not said
    runs: Optional[tuple[float, list]] = None


def speech_runs(data: bytes, body: int, end: int) -> Optional[tuple[float, list]]:
    """The block's start (seconds) and its runs, of an ``emsg`` box's body written by
    :func:`~wan_s2v_runner.shared.fmp4.speech_runs_box` (None: another scheme's event)."""
    import json

    from wan_s2v_runner.shared.fmp4 import SPEECH_RUNS_SCHEME

    if data[body] != 1:  # version 1 only (ours)
        return None
    timescale, start = struct.unpack_from(">IQ", data, body + 4)
    i = body + 4 + 20
    scheme_end = data.index(b"\0", i, end)
    if data[i:scheme_end].decode(errors="replace") != SPEECH_RUNS_SCHEME:
        return None
    value_end = data.index(b"\0", scheme_end + 1, end)
    return start / timescale, [tuple(r) for r in json.loads(data[value_end + 1:end])["runs"]]


class FragmentDecoder:
    """Bytes of a growing fMP4 in (:meth:`feed`, any sizes), each complete fragment's media out,
    decoded: its H.264 frames (a decoder a fragment) and its AAC audio (one decoder for the file,
    its priming skipped). ``frames``: video frames as ``av.VideoFrame`` (False: RGB arrays)."""

    def __init__(self, frames: bool = False):
        self.keep_frames = frames
        self.pending = b""
        self.tracks: Optional[Tracks] = None
        self.aac = None
        self.runs: Optional[list] = None  # the next fragment's, read from its emsg

    def set_init(self, init: bytes) -> None:
        import av

        self.tracks = read_init(init)
        if self.tracks.audio is not None:
            self.aac = av.CodecContext.create("aac", "r")
            self.aac.extradata = self.tracks.asc

    def feed(self, data: bytes) -> list[Media]:
        """The media of every fragment ``data`` completed."""
        self.pending += data
        out, done, moof = [], 0, None
        for kind, start, body, end in boxes(self.pending):
            if kind == b"moof":
                moof = (start, end)
                continue
            if kind == b"moov":
                self.set_init(self.pending[:end])
            elif kind == b"emsg":
                self.runs = speech_runs(self.pending, body, end)
            elif kind == b"mdat" and moof is not None:
                if self.tracks is None:
                    raise ValueError("a fragment before the init segment")
                media = self.decode(fragment_samples(self.pending, *moof))
                media.runs, self.runs = self.runs, None
                out.append(media)
            moof, done = None, end
        self.pending = self.pending[done:]  # from a moof still waiting for its mdat on
        return out

    def decode(self, samples: dict[int, list[Sample]]) -> Media:
        import av

        t, out = self.tracks, Media()
        video = samples.get(t.video, [])
        ctx = av.CodecContext.create("h264", "r")  # each fragment begins with an IDR frame
        ctx.extradata = t.avcc
        ctx.thread_count = 1
        frames = []
        for s in video:
            frames += ctx.decode(av.Packet(s.data))
        frames += ctx.decode(None)
        if len(frames) != len(video):
            raise ValueError(f"{len(frames)} frames decoded of a fragment's {len(video)}")
        for s, frame in zip(video, frames):
            out.video.append((s.time / t.timescale, frame if self.keep_frames else frame.to_ndarray(format="rgb24")))
        if video:
            out.video_end = (video[-1].time + video[-1].duration) / t.timescale
        if self.aac is not None:
            for s in samples.get(t.audio, []):
                for frame in self.aac.decode(av.Packet(s.data)):
                    pcm = frame.to_ndarray()
                    pcm = pcm.mean(axis=0) if pcm.ndim == 2 else pcm
                    pcm = np.clip(np.round(pcm * 32767.0), -32768, 32767).astype(np.int16)
                    at = s.time - t.priming
                    if at + pcm.size <= 0:
                        continue
                    if at < 0:
                        pcm, at = pcm[-at:], 0
                    out.audio.append((at / t.rate, pcm))
        return out
