"""The voice-agent plugins (issue #82) on a real ``wan-s2v serve --mode live --nproc 1`` (the tiny
checkpoint on CPU, real-time sessions over HTTP on loopback), each as its framework drives it:

* Pipecat: a pipeline run by Pipecat's own runner (``WorkerRunner``), a TTS stand-in fed from a speech file -> our
  service -> a capturing sink: the images come in media order, one per frame the session's
  recording holds; a turn's audio out is its audio in, sample for sample, where the recording's
  speech is (the lips' place); its ``TTSStoppedFrame`` passes when its last sample does; an
  ``InterruptionFrame`` mid-turn stops the turn's audio at once; the turn's delay and the session's
  block latency arrive as Pipecat metrics;
* LiveKit: the ``VideoGenerator`` driven with LiveKit's own frame types (no LiveKit server here):
  ``rtc.AudioFrame`` in, ``rtc.VideoFrame``/``rtc.AudioFrame``/``AudioSegmentEnd`` out, the same
  rules; ``clear_buffer`` is the interrupt;
* the playout's rules alone (:mod:`wan_s2v_runner.integrations.playout`): turns split inside a
  run, a turn ended by the timeline going on without it, an interrupted turn muted.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from wan_s2v_runner.integrations import playout as po
from wan_s2v_runner.integrations.session_client import Ended, SpeechPlaced, VideoFrame

FPS = 16
RATE = 24000  # the TTS stand-in's
BLOCK_FRAMES = 12
#: audio that may still come out after an interrupt: what was on its way (Pipecat's pieces already
#: pushed downstream, 20 ms each), never the interrupted turn's rest
INTERRUPT_S = 0.1
pipecat_python = pytest.mark.skipif(sys.version_info < (3, 11), reason="pipecat-ai 1.x needs Python 3.11+")


@pytest.fixture(scope="module")
def turns(tmp_path_factory) -> tuple[np.ndarray, np.ndarray]:
    """Two TTS replies at 24 kHz int16: 1.5 s, then 3 s (the second is interrupted)."""
    import soxr

    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio

    out = []
    for seconds, seed in ((1.5, 3), (3.0, 4)):
        path = make_speech_audio(tmp_path_factory.mktemp("tts") / "reply.wav", seconds=seconds, seed=seed)
        pcm16 = _wav(path).astype(np.float32) / 32768.0
        out.append(np.clip(np.round(soxr.resample(pcm16, 16000, RATE) * 32768), -32768, 32767).astype(np.int16))
    return out[0], out[1]


def _wav(path: Path) -> np.ndarray:
    import wave

    with wave.open(str(path), "rb") as f:
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")


def _recording(s, sid: str, dest: Path) -> tuple[int, np.ndarray]:
    """The session's recording: its frame count and its speech (float, 16 kHz)."""
    import av
    from conftest import wait_for

    wait_for(lambda: s.video(sid)["status"] == "completed", 60, "the session's video to complete", s.tail)
    dest.write_bytes(s.http.get(f"/v1/videos/{sid}/content").content)
    with av.open(str(dest)) as c:
        frames = sum(1 for _ in c.decode(c.streams.video[0]))
    with av.open(str(dest)) as c:
        speech = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(c.streams.audio[0])])
    return frames, speech


def _lag_ms(played: np.ndarray, at: float, recording: np.ndarray) -> float:
    """Where ``played`` (24 kHz, from media second ``at``) best matches the recording's speech, less
    where it was played, in ms (the recording is the session's timeline through AAC)."""
    import soxr

    mine = soxr.resample(played.astype(np.float32) / 32768.0, RATE, 16000)
    start, span = int(round(at * 16000)), 160
    best = max(range(-span, span + 1), key=lambda d: float(np.dot(
        mine, recording[start + d:start + d + mine.size]) if start + d >= 0 else -1e9))
    return best / 16.0


async def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# ----------------------------------------------------------------------------- the playout's rules
def _placed(t: float, *runs) -> SpeechPlaced:
    return SpeechPlaced(t, tuple((at / 16000, pushed, n) for at, pushed, n in runs))


def _frame(t: float) -> VideoFrame:
    return VideoFrame(np.zeros((2, 2, 3), np.uint8), t, int(t * FPS))


def test_the_playout_replays_pushed_speech_where_the_runs_place_it_and_ends_turns():
    p = po.Playout(piece_s=0.25)
    a = np.arange(1, 24001, dtype=np.int16)  # 1 s at 24 kHz
    p.push(a, RATE)
    p.end_turn()
    b = -np.arange(1, 12001, dtype=np.int16)  # 0.5 s, right after: placed contiguously
    p.push(b, RATE)
    p.end_turn()
    out = p.feed(_placed(0.0, (8000, 0, 4000)))  # block 0: from 0.5 s on, a's first 0.25 s
    assert out == []  # held until a frame at or after it
    out = [*p.feed(_frame(0.6875)), *p.feed(_placed(0.75, (12000, 4000, 12000))), *p.feed(_frame(1.4375)),
           *p.feed(_placed(1.5, (24000, 16000, 8000))), *p.feed(_frame(2.1875)), *p.feed(_placed(2.25)),
           *p.feed(_frame(2.9375)), *p.feed(Ended({"status": "completed"}))]
    audio = [o for o in out if isinstance(o, po.Audio)]
    assert np.array_equal(np.concatenate([o.pcm for o in audio]), np.concatenate([a, b]))
    assert [round(o.t, 4) for o in audio][:2] == [0.5, 0.75]
    ends = [o for o in out if isinstance(o, po.TurnEnd)]
    assert [e.t for e in ends] == pytest.approx([1.5, 2.0])  # each where its last sample plays
    kinds = [type(o).__name__ for o in out]
    assert kinds.index("TurnEnd") > max(i for i, o in enumerate(out) if isinstance(o, po.Audio) and o.t < 1.5)
    ts = [o.t for o in out if not isinstance(o, Ended)]
    assert ts == sorted(ts)  # media order


def test_an_interrupted_turn_is_muted_and_its_end_never_comes():
    p = po.Playout()
    p.push(np.ones(48000, np.int16), RATE)
    p.end_turn()
    p.feed(_placed(0.0, (0, 0, 12000)))
    p.interrupt()  # blocks already started still play the old speech: their frames only
    p.push(np.full(2400, 7, np.int16), RATE)  # the next reply
    p.end_turn()
    out = [*p.feed(_frame(0.6875)), *p.feed(_placed(0.75, (12000, 12000, 12000))), *p.feed(_frame(1.4375)),
           *p.feed(_placed(1.5, (26000, 32000, 1600))), *p.feed(_frame(2.1875)), *p.feed(_placed(2.25)),
           *p.feed(_frame(2.9375))]
    audio = [o for o in out if isinstance(o, po.Audio)]
    assert np.array_equal(np.concatenate([o.pcm for o in audio]), np.full(2400, 7, np.int16))
    assert audio[0].t == 1.625 and [e.t for e in out if isinstance(e, po.TurnEnd)] == pytest.approx([1.725])


# ----------------------------------------------------------------------------- Pipecat
@pipecat_python
@pytest.mark.slow(seconds=14)
def test_a_pipecat_pipeline_with_a_wan_s2v_face(live_server, inputs, turns, tmp_path):
    from conftest import wait_for
    from pipecat.frames.frames import (
        EndFrame,
        InterruptionFrame,
        MetricsFrame,
        OutputImageRawFrame,
        TTSAudioRawFrame,
        TTSStartedFrame,
        TTSStoppedFrame,
    )
    from pipecat.metrics.metrics import TTFBMetricsData
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.workers.runner import WorkerRunner
    from serving import TOKEN

    from wan_s2v_runner.integrations.pipecat_service import WanS2VVideoService

    first, second = turns
    got: list = []  # (monotonic time, frame) as the sink saw them

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            got.append((time.monotonic(), frame))
            await self.push_frame(frame, direction)

    def audio_of(frames) -> np.ndarray:
        return np.concatenate([np.frombuffer(f.audio, np.int16) for f in frames]) if frames else np.zeros(0, np.int16)

    def saw(kind) -> list:
        return [f for _, f in got if isinstance(f, kind)]

    wait_for(lambda: live_server.http.get("/health").json()["group"] == "idle", 60, "the live group", live_server.tail)
    face = WanS2VVideoService(server=live_server.url, image=inputs["image"], token=TOKEN, seed=42)
    task = PipelineWorker(Pipeline([face, Sink()]), params=PipelineParams(enable_metrics=True))

    def tts(pcm: np.ndarray) -> list:
        step = RATE // 50  # 20 ms frames, as a streaming TTS sends them (faster than real time)
        return [TTSStartedFrame(), *(TTSAudioRawFrame(audio=pcm[i:i + step].tobytes(), sample_rate=RATE,
                                                      num_channels=1) for i in range(0, pcm.size, step)),
                TTSStoppedFrame()]

    async def bot():
        workers = WorkerRunner(handle_sigint=False)
        await workers.add_workers(task)
        runner = asyncio.create_task(workers.run())
        try:
            await _until(lambda: saw(OutputImageRawFrame), 30, "the listening avatar's first frame")
            await task.queue_frames(tts(first))
            await _until(lambda: saw(TTSStoppedFrame), 30, "the first reply to play")
            at_stop = len(got)
            await task.queue_frames(tts(second))
            await _until(lambda: audio_of(saw(TTSAudioRawFrame)).size >= first.size + RATE // 2, 30, "the second reply")
            heard_at_interrupt = audio_of(saw(TTSAudioRawFrame)).size - first.size
            images_at_interrupt = len(saw(OutputImageRawFrame))
            await task.queue_frame(InterruptionFrame())
            await _until(lambda: len(saw(OutputImageRawFrame)) >= images_at_interrupt + 2 * BLOCK_FRAMES, 30,
                         "two blocks after the interrupt")
            await task.queue_frame(EndFrame())
            await asyncio.wait_for(asyncio.shield(runner), 60)
            return at_stop, heard_at_interrupt
        finally:
            if not runner.done():
                await task.cancel()
                await asyncio.wait([runner], timeout=10)

    at_stop, heard_at_interrupt = asyncio.run(bot())
    sid = face.session.id
    frames, recording = _recording(live_server, sid, tmp_path / "pipecat.mp4")

    images = saw(OutputImageRawFrame)
    assert [i.pts for i in images] == [round(k * 1e9 / FPS) for k in range(len(images))]  # media order, none lost
    assert len(images) == frames and images[0].size == (64, 64) and images[0].format == "RGB"
    played = saw(TTSAudioRawFrame)
    heard = audio_of(played)
    assert np.array_equal(heard[:first.size], first)  # the first reply: sample for sample
    assert saw(TTSStoppedFrame) and got.index(next(g for g in got if isinstance(g[1], TTSStoppedFrame))) < at_stop
    stop_i = next(i for i, (_, f) in enumerate(got) if isinstance(f, TTSStoppedFrame))
    assert all(not isinstance(f, TTSAudioRawFrame) for _, f in got[stop_i + 1:at_stop])  # it passed after the last
    rest = heard[first.size:]
    assert np.array_equal(rest, second[:rest.size]) and rest.size < second.size  # a prefix: the interrupt cut it
    assert rest.size - heard_at_interrupt <= INTERRUPT_S * RATE, (rest.size, heard_at_interrupt)
    assert len(saw(TTSStoppedFrame)) == 1  # the interrupted reply's never passes
    assert abs(_lag_ms(first, played[0].pts / 1e9, recording)) <= 2.0  # where the lips are
    ttfb = [d for m in saw(MetricsFrame) for d in m.data if isinstance(d, TTFBMetricsData)]
    assert ttfb and all(0 < d.value < 10 for d in ttfb) and ttfb[0].processor == face.name


# ----------------------------------------------------------------------------- LiveKit
@pytest.mark.slow(seconds=12)
def test_a_livekit_video_generator_backed_by_a_session(live_server, inputs, turns, tmp_path):
    from conftest import wait_for
    from livekit import rtc
    from livekit.agents.voice.avatar import AudioSegmentEnd
    from serving import TOKEN

    from wan_s2v_runner.integrations.livekit_avatar import WanS2VVideoGenerator

    first, second = turns
    out: list = []

    def heard() -> np.ndarray:
        parts = [np.frombuffer(f.data, np.int16) for f in out if isinstance(f, rtc.AudioFrame)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    async def push(gen, pcm: np.ndarray) -> None:
        step = RATE // 100  # LiveKit's 10 ms frames
        for i in range(0, pcm.size, step):
            part = pcm[i:i + step]
            await gen.push_audio(rtc.AudioFrame(part.tobytes(), RATE, 1, part.size))
        await gen.push_audio(AudioSegmentEnd())

    async def avatar():
        gen = await WanS2VVideoGenerator.open(live_server.url, inputs["image"], token=TOKEN, seed=42)
        await gen.start()

        async def collect():
            async for frame in gen:
                out.append(frame)
        collector = asyncio.create_task(collect())
        await push(gen, first)
        await _until(lambda: any(isinstance(f, AudioSegmentEnd) for f in out), 30, "the first segment to end")
        await push(gen, second)
        await _until(lambda: heard().size >= first.size + RATE // 2, 30, "the second segment")
        at_clear = heard().size - first.size
        frames_at_clear = sum(isinstance(f, rtc.VideoFrame) for f in out)
        gen.clear_buffer()
        await _until(lambda: sum(isinstance(f, rtc.VideoFrame) for f in out) >= frames_at_clear + 2 * BLOCK_FRAMES, 30,
                     "two blocks after the clear")
        await gen.aclose(wait_s=30)  # the last blocks come out, then the frames end
        await asyncio.wait_for(collector, 5)
        return gen.session.id, gen.size, at_clear

    wait_for(lambda: live_server.http.get("/health").json()["group"] == "idle", 60, "the live group", live_server.tail)
    sid, size, at_clear = asyncio.run(avatar())
    frames, recording = _recording(live_server, sid, tmp_path / "livekit.mp4")

    video = [f for f in out if isinstance(f, rtc.VideoFrame)]
    assert len(video) == frames and size == (64, 64) and video[0].type == rtc.VideoBufferType.RGBA
    got = heard()
    assert np.array_equal(got[:first.size], first)
    ends = [i for i, f in enumerate(out) if isinstance(f, AudioSegmentEnd)]
    last_first = max(i for i, f in enumerate(out) if isinstance(f, rtc.AudioFrame)
                     and sum(g.samples_per_channel for g in out[:i + 1] if isinstance(g, rtc.AudioFrame)) <= first.size)
    assert len(ends) == 1 and ends[0] == last_first + 1  # right after its last sample; none for the cleared one
    rest = got[first.size:]
    assert np.array_equal(rest, second[:rest.size]) and rest.size - at_clear <= INTERRUPT_S * RATE
    # in sync: the frames before the first audio frame are its media time's
    before = sum(1 for f in out[:next(i for i, f in enumerate(out) if isinstance(f, rtc.AudioFrame))]
                 if isinstance(f, rtc.VideoFrame))
    assert abs(before / FPS - _first_speech_s(recording)) <= 1.5 / FPS + 0.05


def _first_speech_s(recording: np.ndarray) -> float:
    return float(np.argmax(np.abs(recording) > 0.02)) / 16000


def test_the_server_counts_each_utterances_speech_as_the_playout_does(tmp_path):
    """The server's resampler is flushed at each mark: an utterance of n samples at any rate is
    round(n x 16000 / rate) samples of the session's speech, as the playout counts it, whatever the
    chunks (so a turn's end and a run's samples meet exactly)."""
    import random

    from wan_s2v_runner.serve.sessions import Sessions
    from wan_s2v_runner.shared.session_speech import SpeechKind
    from wan_s2v_runner.shared.speech_timeline import Pace

    rng = random.Random(9)
    for rate in (24000, 32000, 44100, 8000):  # 32 kHz: counts that land on a half, rounded up by soxr
        sessions = Sessions()
        s = sessions.open(f"video_{rate}", tmp_path / str(rate), Pace.REALTIME)
        p = po.Playout()
        for kind in (SpeechKind.END_OF_SPEECH, SpeechKind.INTERRUPT, SpeechKind.END_OF_SPEECH):
            n = rng.randint(1, 3 * rate)
            pcm = np.random.default_rng(n).integers(-3000, 3000, n).astype("<i2")
            at = 0
            while at < n:
                k = rng.randint(1, rate // 2)
                sessions.append(s.id, pcm[at:at + k].tobytes(), "s16le", rate)
                p.push(pcm[at:at + k], rate)
                at += k
            sessions.mark(s.id, kind)
            if kind is SpeechKind.END_OF_SPEECH:
                p.end_turn()
            else:
                p.interrupt()
            assert s.samples == p._at16(p.pushed), (rate, kind)
