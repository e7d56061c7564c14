"""Fragmented MP4 (ISO/IEC 14496-12), written box by box: the file a long video grows into.

A fragmented MP4 is an init segment (``ftyp`` + a ``moov`` that describes the tracks and holds no
samples) followed by fragments (``moof`` + ``mdat``), each one complete: a player opens the file at
any moment and plays every fragment written so far, and the finished video is the same file. The
video writer (:mod:`wan_s2v_runner.rank.video_writer`) appends one fragment per clip (its H.264
frames and the AAC frames of its span of the speech), so a clip costs O(1) whatever the length.

Why our own boxes, not FFmpeg's mov muxer (which the encoders come from, through PyAV): the muxer
cuts a fragment only when the next keyframe arrives or the file is closed (PyAV cannot ask it to
flush one), so the newest clip would stay unplayable until the next clip is made; and it numbers
fragments and decode times per process, so a resumed run could not continue the file so that it is
byte for byte the uninterrupted one. Here a fragment is a pure function of its clip's packets and
the counts before it (:class:`Position`), and the init segment of the first clip's encoder headers.

What the boxes say (only what players need): an ``avc1`` video track (the encoder's SPS/PPS in
``avcC``; every sample's duration, size and sync flag in its fragment's ``trun``; no B-frames, so
decode order is presentation order), an ``mp4a`` audio track (the AAC ``AudioSpecificConfig`` in
``esds``; an edit list skipping the encoder's priming samples), ``mvex``/``trex`` defaults, and at
:func:`finished` the movie's duration written into the fields the init segment left at zero.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Optional

#: the video track's ticks per frame (the timescale is fps x this: 16 fps -> 16384, as FFmpeg's)
TICKS_PER_FRAME = 1024
#: the movie header's timescale (milliseconds)
MOVIE_TIMESCALE = 1000
#: the samples an AAC frame decodes to
AAC_FRAME = 1024
VIDEO_TRACK, AUDIO_TRACK = 1, 2
#: sample flags: a sync sample (depends on nothing), and a non-sync one (depends on others)
SYNC, NON_SYNC = 0x02000000, 0x01010000
_MATRIX = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)


def box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return box(kind, struct.pack(">I", (version << 24) | flags), *payload)


# --------------------------------------------------------------------------- H.264 bitstream
def nal_units(data: bytes) -> list[bytes]:
    """The NAL units of an Annex-B byte stream (start codes 00 00 01 / 00 00 00 01)."""
    units, i, n = [], 0, len(data)
    starts = []
    while True:
        j = data.find(b"\x00\x00\x01", i)
        if j < 0:
            break
        starts.append(j + 3)
        i = j + 3
    for k, s in enumerate(starts):
        end = starts[k + 1] - 3 if k + 1 < len(starts) else n
        unit = data[s:end]
        if k + 1 < len(starts) and unit.endswith(b"\x00"):  # the 4-byte start code's leading zero
            unit = unit[:-1]
        if unit:
            units.append(unit)
    return units


def is_annex_b(data: bytes) -> bool:
    return data.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01"))


def length_prefixed(data: bytes) -> bytes:
    """An access unit as MP4 stores it: each NAL unit after its 4-byte length (Annex-B input is
    converted; input already length-prefixed is returned as it is)."""
    if not is_annex_b(data):
        return bytes(data)
    return b"".join(struct.pack(">I", len(u)) + u for u in nal_units(data))


def avc_config(extradata: bytes) -> bytes:
    """The ``avcC`` record (AVCDecoderConfigurationRecord) of an encoder's SPS and PPS (Annex-B
    extradata, as libx264 gives it; an ``avcC`` record is returned as it is)."""
    if not is_annex_b(extradata):
        return bytes(extradata)
    units = nal_units(extradata)
    sps = [u for u in units if u[0] & 0x1F == 7]
    pps = [u for u in units if u[0] & 0x1F == 8]
    if not sps or not pps:
        raise ValueError("the H.264 encoder's headers hold no SPS or PPS")
    out = struct.pack(">BBBBB", 1, sps[0][1], sps[0][2], sps[0][3], 0xFF)  # 4-byte NAL lengths
    out += struct.pack(">B", 0xE0 | len(sps)) + b"".join(struct.pack(">H", len(s)) + s for s in sps)
    out += struct.pack(">B", len(pps)) + b"".join(struct.pack(">H", len(p)) + p for p in pps)
    return out


# --------------------------------------------------------------------------- the tracks
@dataclass(frozen=True)
class VideoFormat:
    width: int
    height: int
    fps: int
    avcc: bytes  # avc_config(...)

    @property
    def timescale(self) -> int:
        return self.fps * TICKS_PER_FRAME


@dataclass(frozen=True)
class AudioFormat:
    sample_rate: int
    channels: int
    asc: bytes  # the AAC AudioSpecificConfig (the encoder's extradata)
    priming: int  # samples the decoder drops first (the encoder's delay)
    bit_rate: int


def _descriptor(tag: int, body: bytes) -> bytes:
    n = len(body)  # the size in 4 bytes of 7 bits each, as FFmpeg writes it
    size = bytes([0x80 | (n >> 21) & 0x7F, 0x80 | (n >> 14) & 0x7F, 0x80 | (n >> 7) & 0x7F, n & 0x7F])
    return bytes([tag]) + size + body


def _esds(audio: AudioFormat) -> bytes:
    dsi = _descriptor(0x05, audio.asc)
    dcd = _descriptor(0x04, struct.pack(">BB", 0x40, 0x15) + (0).to_bytes(3, "big")
                      + struct.pack(">II", audio.bit_rate, audio.bit_rate) + dsi)
    es = _descriptor(0x03, struct.pack(">HB", AUDIO_TRACK, 0) + dcd + _descriptor(0x06, b"\x02"))
    return full_box(b"esds", 0, 0, es)


def _empty_tables() -> bytes:
    return (full_box(b"stts", 0, 0, struct.pack(">I", 0)) + full_box(b"stsc", 0, 0, struct.pack(">I", 0))
            + full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)) + full_box(b"stco", 0, 0, struct.pack(">I", 0)))


def _dinf() -> bytes:
    return box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))


def _tkhd(track: int, volume: int, width: int = 0, height: int = 0) -> bytes:
    return full_box(b"tkhd", 0, 3, struct.pack(">IIIII", 0, 0, track, 0, 0), b"\0" * 8,
                    struct.pack(">hhhH", 0, 0, volume, 0), _MATRIX, struct.pack(">II", width << 16, height << 16))


def _mdhd(timescale: int) -> bytes:
    return full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, timescale, 0, 0x55C4, 0))  # language "und"


def _hdlr(kind: bytes, name: bytes) -> bytes:
    return full_box(b"hdlr", 0, 0, struct.pack(">I4s", 0, kind), b"\0" * 12, name + b"\0")


def _video_trak(v: VideoFormat) -> bytes:
    entry = box(b"avc1", b"\0" * 6, struct.pack(">H", 1), b"\0" * 16, struct.pack(">HH", v.width, v.height),
                struct.pack(">III", 0x00480000, 0x00480000, 0), struct.pack(">H", 1), b"\0" * 32,
                struct.pack(">Hh", 0x18, -1), box(b"avcC", v.avcc))
    stbl = box(b"stbl", full_box(b"stsd", 0, 0, struct.pack(">I", 1), entry), _empty_tables())
    minf = box(b"minf", full_box(b"vmhd", 0, 1, b"\0" * 8), _dinf(), stbl)
    return box(b"trak", _tkhd(VIDEO_TRACK, 0, v.width, v.height),
               box(b"mdia", _mdhd(v.timescale), _hdlr(b"vide", b"VideoHandler"), minf))


def _audio_trak(a: AudioFormat) -> bytes:
    entry = box(b"mp4a", b"\0" * 6, struct.pack(">H", 1), b"\0" * 8, struct.pack(">HHHH", a.channels, 16, 0, 0),
                struct.pack(">I", (a.sample_rate << 16) if a.sample_rate < 65536 else 0), _esds(a))
    stbl = box(b"stbl", full_box(b"stsd", 0, 0, struct.pack(">I", 1), entry), _empty_tables())
    minf = box(b"minf", full_box(b"smhd", 0, 0, b"\0" * 4), _dinf(), stbl)
    # the edit: the track starts after the encoder's priming samples (whole length: duration 0)
    edts = box(b"edts", full_box(b"elst", 0, 0, struct.pack(">IIihh", 1, 0, a.priming, 1, 0)))
    return box(b"trak", _tkhd(AUDIO_TRACK, 0x0100), edts,
               box(b"mdia", _mdhd(a.sample_rate), _hdlr(b"soun", b"SoundHandler"), minf))


def _trex(track: int) -> bytes:
    return full_box(b"trex", 0, 0, struct.pack(">IIIII", track, 1, 0, 0, 0))


def init_segment(video: VideoFormat, audio: Optional[AudioFormat]) -> bytes:
    """``ftyp`` + ``moov``: the tracks, no samples; durations zero until :func:`finished`."""
    ftyp = box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isomiso5iso6avc1mp41")
    mvhd = full_box(b"mvhd", 0, 0, struct.pack(">IIII", 0, 0, MOVIE_TIMESCALE, 0), struct.pack(">IH", 0x10000, 0x100),
                    b"\0" * 10, _MATRIX, b"\0" * 24, struct.pack(">I", 3))
    tracks = _video_trak(video) + (_audio_trak(audio) if audio is not None else b"")
    mvex = box(b"mvex", full_box(b"mehd", 1, 0, struct.pack(">Q", 0)), _trex(VIDEO_TRACK),
               *([_trex(AUDIO_TRACK)] if audio is not None else []))
    return ftyp + box(b"moov", mvhd, tracks, mvex)


# --------------------------------------------------------------------------- fragments
@dataclass(frozen=True)
class Position:
    """Where the next fragment starts: its sequence number, each track's decode time (video in
    frames, audio in samples of the encoded stream, priming included) and the file's length."""

    fragments: int = 0
    frames: int = 0
    audio_samples: int = 0
    size: int = 0

    def as_dict(self) -> dict:
        return {"fragments": self.fragments, "frames": self.frames, "audio_samples": self.audio_samples,
                "size": self.size}

    @classmethod
    def from_dict(cls, d: dict) -> "Position":
        return cls(int(d["fragments"]), int(d["frames"]), int(d["audio_samples"]), int(d["size"]))


@dataclass
class Fragment:
    """One clip's samples: its video frames (length-prefixed access units, with a sync flag each)
    and the AAC frames the audio encoder gave for its span (each ``AAC_FRAME`` samples)."""

    video: list[tuple[bytes, bool]] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    #: boxes written before its ``moof`` (a session's block: :func:`speech_runs_box`)
    before: bytes = b""


#: the ``emsg`` scheme of a session's speech runs (:func:`speech_runs_box`)
SPEECH_RUNS_SCHEME = "urn:wan-s2v:speech-runs:1"
#: the speech runs' timescale: the timeline's samples (16 kHz)
SPEECH_RUNS_RATE = 16000


def speech_runs_box(start: int, duration: int, runs) -> bytes:
    """An ``emsg`` (ISO/IEC 23009-1 event message, version 1) written before a live session's block:
    where the pushed speech its span plays came from, as JSON ``{"runs": [[at, pushed, samples],
    ...]}`` (timeline samples from ``start`` for ``duration``; ``pushed``: the sample of the session's
    pushed 16 kHz speech stream). Players skip it; the session's client reads it
    (:class:`~wan_s2v_runner.shared.fmp4_reader.FragmentDecoder`) to replay its own speech where the
    lips say it."""
    import json

    data = json.dumps({"runs": [[r.at, r.pushed, r.samples] for r in runs]}, separators=(",", ":")).encode()
    return full_box(b"emsg", 1, 0, struct.pack(">IQII", SPEECH_RUNS_RATE, start, duration, 0),
                    SPEECH_RUNS_SCHEME.encode() + b"\0", b"\0", data)


def _traf(track: int, decode_time: int, data_offset: int, samples: list[tuple[int, int, Optional[int]]]) -> bytes:
    """A track's run: (duration, size, flags or None) per sample."""
    with_flags = samples[0][2] is not None
    flags = 0x001 | 0x100 | 0x200 | (0x400 if with_flags else 0)
    rows = b"".join(struct.pack(">III", d, s, f) if with_flags else struct.pack(">II", d, s) for d, s, f in samples)
    trun = full_box(b"trun", 0, flags, struct.pack(">Ii", len(samples), data_offset), rows)
    return box(b"traf", full_box(b"tfhd", 0, 0x020000, struct.pack(">I", track)),  # default-base-is-moof
               full_box(b"tfdt", 1, 0, struct.pack(">Q", decode_time)), trun)


def fragment(frag: Fragment, at: Position) -> tuple[bytes, Position]:
    """``moof`` + ``mdat`` of ``frag`` appended at ``at``, and the position after it."""
    vdata = b"".join(d for d, _ in frag.video)
    adata = b"".join(frag.audio)
    vsamples = [(TICKS_PER_FRAME, len(d), SYNC if key else NON_SYNC) for d, key in frag.video]
    asamples = [(AAC_FRAME, len(d), None) for d in frag.audio]

    def moof(offsets: tuple[int, int]) -> bytes:
        trafs = b""
        if vsamples:
            trafs += _traf(VIDEO_TRACK, at.frames * TICKS_PER_FRAME, offsets[0], vsamples)
        if asamples:
            trafs += _traf(AUDIO_TRACK, at.audio_samples, offsets[1], asamples)
        return box(b"moof", full_box(b"mfhd", 0, 0, struct.pack(">I", at.fragments + 1)), trafs)

    size = len(moof((0, 0)))  # the offsets do not change the boxes' sizes
    out = frag.before + moof((size + 8, size + 8 + len(vdata))) + box(b"mdat", vdata, adata)
    return out, Position(at.fragments + 1, at.frames + len(frag.video), at.audio_samples + len(frag.audio) * AAC_FRAME,
                         at.size + len(out))


def video_config(init: bytes) -> bytes:
    """The ``avcC`` record an init segment holds (what a continued file's clips must match)."""
    (stsd,) = _find(init, [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsd"])[:1]
    j = init.index(b"avcC", stsd)
    return bytes(init[j + 4:j - 4 + struct.unpack(">I", init[j - 4:j])[0]])


def playable_length(path) -> int:
    """How much of a growing file a player can be given now: up to the end of its last complete
    fragment (``moof`` + its ``mdat``), or of the init segment before any; 0 before that. Reads
    only the top-level boxes' headers (two a clip), never the samples."""
    size = os.path.getsize(path)
    good, i, have_moov, open_moof = 0, 0, False, False
    with open(path, "rb") as f:
        while i + 8 <= size:
            f.seek(i)
            n, kind = struct.unpack(">I4s", f.read(8))
            if n < 8 or i + n > size:
                break
            i += n
            if kind == b"moov":
                have_moov, good = True, i
            elif kind == b"moof":
                open_moof = True
            elif kind == b"mdat" and open_moof and have_moov:
                open_moof, good = False, i
    return good


class Follower:
    """A growing file read as it grows, complete top-level boxes only (the init segment, then each
    fragment once its ``mdat`` is whole), from an open file: the writer's rename of the finished
    file does not end the read (the same file), so a stream follows a job from its first fragment
    to its last."""

    def __init__(self, f):
        self.f = f
        self.at = 0

    def read(self) -> bytes:
        """What became complete since the last read (b"": nothing yet)."""
        size = os.fstat(self.f.fileno()).st_size
        end, i = self.at, self.at
        while i + 8 <= size:
            self.f.seek(i)
            n, kind = struct.unpack(">I4s", self.f.read(8))
            if n < 8 or i + n > size:
                break
            i += n
            if kind != b"moof":  # a fragment's moof goes with its mdat
                end = i
        if end == self.at:
            return b""
        self.f.seek(self.at)
        data = self.f.read(end - self.at)
        self.at = end
        return data


def video_size(init: bytes) -> tuple[int, int]:
    """(height, width) of an init segment's video track (its ``tkhd``, 16.16 fixed point)."""
    (trak,) = _find(init, [b"moov", b"trak"])[:1]
    (tkhd,) = _find(init, [b"tkhd"], trak + 8, trak + struct.unpack(">I", init[trak:trak + 4])[0])
    w, h = struct.unpack(">II", init[tkhd + 8 + 76:tkhd + 8 + 84])
    return h >> 16, w >> 16


# --------------------------------------------------------------------------- finishing
def _find(data: bytes, path: list[bytes], start: int = 0, end: Optional[int] = None) -> list[int]:
    """Offsets of every box at ``path`` (box types from the top) within data[start:end]."""
    end = len(data) if end is None else end
    found, i = [], start
    while i + 8 <= end:
        size, kind = struct.unpack(">I4s", data[i:i + 8])
        if size < 8:
            break
        if kind == path[0]:
            if len(path) == 1:
                found.append(i)
            else:
                inner = i + 8 + (4 if kind in (b"meta",) else 0)
                found += _find(data, path[1:], inner, i + size)
        i += size
    return found


def finished(init: bytes, frames: int, fps: int, audio_samples: Optional[int], sample_rate: Optional[int]) -> bytes:
    """``init`` with the movie's duration filled in (``mvhd``, ``mehd``, each ``tkhd`` and ``mdhd``):
    players show the length and seek without reading every fragment. Same size as ``init``."""
    out = bytearray(init)
    seconds_v = frames / fps
    movie = round(seconds_v * MOVIE_TIMESCALE)
    (mvhd,) = _find(out, [b"moov", b"mvhd"])
    struct.pack_into(">I", out, mvhd + 12 + 12, movie)
    (mehd,) = _find(out, [b"moov", b"mvex", b"mehd"])
    struct.pack_into(">Q", out, mehd + 12, movie)
    for n, trak in enumerate(_find(out, [b"moov", b"trak"])):
        audio = n == 1
        if audio and (audio_samples is None or not sample_rate):
            continue
        media = audio_samples if audio else frames * TICKS_PER_FRAME
        track_movie = round(media / (sample_rate if audio else fps * TICKS_PER_FRAME) * MOVIE_TIMESCALE)
        (tkhd,) = _find(out, [b"tkhd"], trak + 8, trak + struct.unpack(">I", out[trak:trak + 4])[0])
        struct.pack_into(">I", out, tkhd + 12 + 16, track_movie)
        (mdhd,) = _find(out, [b"mdia", b"mdhd"], trak + 8, trak + struct.unpack(">I", out[trak:trak + 4])[0])
        struct.pack_into(">I", out, mdhd + 12 + 12, media)
    return bytes(out)
