"""Benchmark (issue #82): what a voice agent's user waits for, through each plugin, on one served
live group (``wan-s2v serve --mode live``).

One run makes, on one checkpoint (``--preset``), size and rank count, a real-time session per plugin
and ``--turns`` TTS replies of ``--reply`` seconds each (24 kHz, sent as a streaming TTS sends them:
20 ms frames, faster than real time), a few seconds apart:

    pipecat   ``WanS2VVideoService`` in a Pipecat pipeline (its own runner) before a capturing sink:
              per reply, the time from its first TTS frame queued to its first audio frame at the
              sink (what the transport plays: the avatar's lips with it), the playout delay included
    livekit   ``WanS2VVideoGenerator`` driven as LiveKit's ``AvatarRunner`` drives it (its frames
              taken as they come, the runner's own pacing aside): per reply, the first frame pushed
              to its first audio frame out

and, for both, where each reply's audio lies against the session's recording (the lips' place), in
ms, and the session's block latency (the server's, p50 / p95).

    .venv/bin/python bench/bench_voice_agents.py --preset tiny --size 64*64
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RATE = 24000


def _replies(audio: Path, seconds: float, turns: int) -> list[np.ndarray]:
    import wave

    import soxr

    with wave.open(str(audio)) as f:
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    pcm = soxr.resample(pcm, 16000, RATE)
    n = int(seconds * RATE)
    out = []
    for k in range(turns):
        part = np.resize(np.roll(pcm, -k * RATE // 3), n)  # a different stretch each reply
        out.append(np.clip(np.round(part * 32768), -32768, 32767).astype(np.int16))
    return out


def _recording_speech(server, sid: str, work: Path) -> np.ndarray:
    import av

    while server.http.get(f"/v1/videos/{sid}").json()["status"] != "completed":
        time.sleep(0.2)
    path = work / f"{sid}.mp4"
    path.write_bytes(server.http.get(f"/v1/videos/{sid}/content").content)
    with av.open(str(path)) as c:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(c.streams.audio[0])])


def _lag_ms(played: np.ndarray, at: float, recording: np.ndarray) -> float:
    import soxr

    mine = soxr.resample(played.astype(np.float32) / 32768.0, RATE, 16000)[:8000]
    start, span = int(round(at * 16000)), 320
    best = max(range(-span, span + 1), key=lambda d: float(np.dot(mine, recording[start + d:start + d + mine.size]))
               if start + d >= 0 and start + d + mine.size <= recording.size else -1e9)
    return best / 16.0


async def pipecat_run(url: str, image: Path, replies: list[np.ndarray], gap_s: float) -> dict:
    from bench_session import TOKEN
    from pipecat.frames.frames import EndFrame, OutputImageRawFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.workers.runner import WorkerRunner

    from wan_s2v_runner.integrations.pipecat_service import WanS2VVideoService

    seen: list = []

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            seen.append((time.monotonic(), frame))
            await self.push_frame(frame, direction)

    face = WanS2VVideoService(server=url, image=image, token=TOKEN, seed=42)
    worker = PipelineWorker(Pipeline([face, Sink()]), params=PipelineParams(enable_metrics=True))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    while not any(isinstance(f, OutputImageRawFrame) for _, f in seen):  # the session's first frame
        await asyncio.sleep(0.02)
    await asyncio.sleep(2.0)  # the avatar listens first
    delays, firsts = [], []
    for pcm in replies:
        n_before = sum(1 for _, f in seen if isinstance(f, TTSAudioRawFrame))
        step = RATE // 50
        t0 = time.monotonic()
        await worker.queue_frames([TTSStartedFrame(), *(TTSAudioRawFrame(audio=pcm[i:i + step].tobytes(),
                                   sample_rate=RATE, num_channels=1) for i in range(0, pcm.size, step)),
                                   TTSStoppedFrame()])
        while True:
            audio = [(t, f) for t, f in seen if isinstance(f, TTSAudioRawFrame)][n_before:]
            if audio:
                delays.append(audio[0][0] - t0)
                firsts.append(audio[0][1].pts / 1e9)
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(pcm.size / RATE + gap_s)
    sid = face.session.id
    await worker.queue_frame(EndFrame())
    await asyncio.wait_for(running, 120)
    return {"sid": sid, "delays": delays, "firsts": firsts}


async def livekit_run(url: str, image: Path, replies: list[np.ndarray], gap_s: float) -> dict:
    from bench_session import TOKEN
    from livekit import rtc
    from livekit.agents.voice.avatar import AudioSegmentEnd

    from wan_s2v_runner.integrations.livekit_avatar import WanS2VVideoGenerator

    gen = await WanS2VVideoGenerator.open(url, image, token=TOKEN, seed=42)
    await gen.start()
    out: list = []

    async def collect():
        async for frame in gen:
            out.append((time.monotonic(), frame))
    collector = asyncio.create_task(collect())
    await asyncio.sleep(2.0)
    delays, firsts = [], []
    for pcm in replies:
        n_before = sum(1 for _, f in out if isinstance(f, rtc.AudioFrame))
        t0 = time.monotonic()
        for i in range(0, pcm.size, RATE // 100):
            part = pcm[i:i + RATE // 100]
            await gen.push_audio(rtc.AudioFrame(part.tobytes(), RATE, 1, part.size))
        await gen.push_audio(AudioSegmentEnd())
        while True:
            audio = [(t, f) for t, f in out if isinstance(f, rtc.AudioFrame)][n_before:]
            if audio:
                delays.append(audio[0][0] - t0)
                video_before = sum(1 for _, f in out[:out.index(audio[0])] if isinstance(f, rtc.VideoFrame))
                firsts.append(video_before / 16)
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(pcm.size / RATE + gap_s)
    sid = gen.session.id
    await gen.aclose(wait_s=60)
    await collector
    return {"sid": sid, "delays": delays, "firsts": firsts}


def _row(name: str, r: dict, replies, recording: np.ndarray, live: dict) -> str:
    d = np.array(r["delays"])
    lags = [_lag_ms(p, t, recording) for p, t in zip(replies, r["firsts"])]
    lat = live.get("block_latency_s") or {}
    return (f"| {name} | {np.median(d):.3f} / {d.max():.3f} | {min(lags):+.1f} .. {max(lags):+.1f} "
            f"| {lat.get('p50')} / {lat.get('p95')} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=("tiny", "compute"))
    ap.add_argument("--size", default="64*64")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--reply", type=float, default=2.0, help="seconds of each TTS reply")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds of listening after each reply")
    ap.add_argument("--cache", default="~/.cache/wan-s2v/bench")
    a = ap.parse_args(argv)

    from bench_loop import live_inputs
    from bench_session import Server

    ckpt, work, image, audio = live_inputs(a.cache, a.preset, a.size, 6.0, "bench_voice_agents_")
    replies = _replies(audio, a.reply, a.turns)
    group = ["--mode", "live", "--nproc", str(a.nproc), "--device", "cpu", "--size", a.size, "--ckpt-dir", str(ckpt),
             "--prompt", "a person talking"]
    server = Server(group, work)
    try:
        rows = []
        for name, run in (("pipecat (playout delay 0.3 s included)", pipecat_run), ("livekit", livekit_run)):
            while server.http.get("/health").json()["group"] != "idle":
                time.sleep(0.2)
            r = asyncio.run(run(str(server.http.base_url).rstrip("/"), image, replies, a.gap))
            recording = _recording_speech(server, r["sid"], work)
            live = server.http.get(f"/v1/videos/{r['sid']}").json().get("live") or {}
            rows.append(_row(name, r, replies, recording, live))
    finally:
        server.stop()
    print(f"--preset {a.preset} --size {a.size} --nproc {a.nproc} --turns {a.turns} --reply {a.reply} "
          f"({os.cpu_count()} CPUs)")
    print("| plugin | reply's first TTS frame -> its first audio out, median / max (s) | its audio vs the "
          "recording's speech (ms) | block latency p50 / p95 (s) |")
    print("|---|---|---|---|")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
