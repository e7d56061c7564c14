"""Live sessions (issue #81): speech that arrives over time, on the tiny checkpoint, CPU fp32.

* the timeline's rules (:mod:`wan_s2v_runner.shared.speech_timeline`), numbers in and out: a file and
  the same speech in random chunks make the same decisions (``speech`` pace); a real-time job's
  blocks start on the clock, silent where no speech arrived, new speech after a silence goes far
  enough ahead to make its block; end of speech, interrupt and finish; what it holds stays bounded;
* a session fed a file's speech in random chunks (1 ms .. 3 s) while its blocks run, then finished,
  makes the file's frames bit for bit (one process: the loop a ``--nproc 1`` worker runs);
* its recording plays the speech it rendered, block by block, in sync (samples against frames).
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from wan_s2v_runner.shared import session_speech
from wan_s2v_runner.shared import speech_timeline as st
from wan_s2v_runner.shared.session_speech import SpeechKind
from wan_s2v_runner.shared.speech_windows import BLOCK_SAMPLES, RATE, SpeechWindow

W = SpeechWindow()


def _timeline(pace: st.Pace, start: float | None = None) -> st.Timeline:
    return st.Timeline(pace, W.needed_samples, W.blocks_for_samples, W.lookahead_samples, start=start)


def _chunks(samples: np.ndarray, rng: random.Random, lo_s: float = 0.001, hi_s: float = 3.0) -> list[np.ndarray]:
    out, at = [], 0
    while at < samples.size:
        n = max(1, int(np.exp(rng.uniform(np.log(lo_s), np.log(hi_s))) * RATE))  # log-uniform: many sizes
        out.append(samples[at:at + n])
        at += n
    return out


def _run(t: st.Timeline, clock: float = 0.0, limit: int = 1000) -> list[st.Decision]:
    out = []
    while len(out) < limit:
        d = t.decide(clock)
        if d.verdict is not st.Verdict.START:
            return out + [d]
        out.append(d)
    return out


def test_a_file_and_its_speech_in_random_chunks_make_the_same_blocks():
    rng = random.Random(5)
    speech = np.random.default_rng(1).uniform(-0.5, 0.5, int(4.3 * RATE)).astype(np.float32)
    whole = _timeline(st.Pace.SPEECH)
    whole.add(st.Speech(speech, 0.0))
    whole.add(st.Finish(0.0))
    want = _run(whole)
    assert want[-1].verdict is st.Verdict.END and want[-2].last
    blocks = len(want) - 1
    assert blocks == W.blocks_for_samples(speech.size) and sum(d.speech for d in want[:-1]) == blocks
    spans = [whole.samples(g * BLOCK_SAMPLES, (g + 1) * BLOCK_SAMPLES) for g in range(blocks)]

    chunked = _timeline(st.Pace.SPEECH)
    got, seen = [], []
    for chunk in _chunks(speech, rng):
        chunked.add(st.Speech(chunk, 0.0))
        while True:  # blocks start as their speech and lookahead arrive, never sooner
            d = chunked.decide(0.0)
            if d.verdict is not st.Verdict.START:
                assert d.verdict is st.Verdict.WAIT
                break
            g = chunked.started - 1
            assert chunked.speech_end >= W.needed_samples(g)
            got.append(d)
            seen.append(chunked.samples(g * BLOCK_SAMPLES, (g + 1) * BLOCK_SAMPLES))
    chunked.add(st.Finish(0.0))
    for d in _run(chunked):
        if d.verdict is st.Verdict.START:
            g = chunked.started - 1
            seen.append(chunked.samples(g * BLOCK_SAMPLES, (g + 1) * BLOCK_SAMPLES))
        got.append(d)
    assert got == want
    assert all(np.array_equal(a, b) for a, b in zip(seen, spans))
    # an end of speech (no finish) starts the blocks that hold its tail, then waits
    marked = _timeline(st.Pace.SPEECH)
    marked.add(st.Speech(speech, 0.0))
    marked.add(st.EndOfSpeech(0.0))
    ds = _run(marked)
    assert len(ds) == blocks + 1 and ds[-1].verdict is st.Verdict.WAIT and not any(d.last for d in ds[:-1])


def test_a_realtime_job_listens_in_silence_and_speaks_what_arrives_in_time():
    t = _timeline(st.Pace.REALTIME, start=100.0)
    assert t.decide(99.0) == st.Decision(st.Verdict.WAIT, until=100.0)
    first = t.decide(100.0)
    assert first.verdict is st.Verdict.START and not first.speech  # nothing said yet: the avatar listens
    assert t.decide(100.5).until == 100.75
    # speech arriving at 100.9 s, at real time (a microphone): written a lead ahead, every block in time
    arrive, spoken = 100.9, np.full(int(2.0 * RATE), 0.25, dtype=np.float32)
    clock, fed, decisions = 100.75, 0, []
    while clock < 106.0:
        while fed < spoken.size and arrive + (fed + 1600) / RATE <= clock:  # 100 ms chunks as they are spoken
            t.add(st.Speech(spoken[fed:fed + 1600], arrive + fed / RATE))
            fed += 1600
        d = t.decide(clock)
        if d.verdict is st.Verdict.START:
            g = t.started - 1
            if d.speech:  # a speaking block had its speech and lookahead when it started
                assert t.speech_end >= W.needed_samples(g) or fed == spoken.size, g
            decisions.append(d)
        clock = d.until if d.verdict is st.Verdict.WAIT else clock
    # silence, speech (contiguous: no gap inside it), silence again; the blocks on the clock
    assert t.started == int((106.0 - 100.0) / 0.75) == len(decisions) + 1  # block 0 above
    said = [d.speech for d in decisions]
    assert said[0] is False and True in said and said[-1] is False
    timeline = np.concatenate([t.samples(g * BLOCK_SAMPLES, (g + 1) * BLOCK_SAMPLES) for g in range(t.started)])
    nonzero = np.flatnonzero(timeline)
    assert nonzero.size == spoken.size and nonzero[-1] - nonzero[0] + 1 == spoken.size
    # it starts no later than a lead (and the block it falls in) after it began to arrive
    assert nonzero[0] <= int((arrive - 100.0) * RATE) + t.lead() + BLOCK_SAMPLES
    # a TTS that sends its sentence at once: spoken from the next block's start on, no lead to wait
    burst = _timeline(st.Pace.REALTIME, start=0.0)
    assert burst.decide(0.0).verdict is st.Verdict.START
    burst.add(st.Speech(spoken, 0.3))
    d = burst.decide(0.75)
    assert d.speech and np.flatnonzero(burst.samples(0, W.needed_samples(1)))[0] == W.needed_samples(0)


def test_an_interrupt_drops_the_speech_not_yet_in_a_started_block_and_a_finish_closes():
    t = _timeline(st.Pace.SPEECH)
    t.add(st.Speech(np.full(10 * RATE, 0.5, dtype=np.float32), 0.0))
    for _ in range(3):
        assert t.decide(0.0).verdict is st.Verdict.START
    t.add(st.Interrupt(1.0))
    assert t.speech_end == 3 * BLOCK_SAMPLES and t.dropped == 10 * RATE - 3 * BLOCK_SAMPLES
    # the lookahead the last started block read is silence now: the next block is silent
    assert not t.samples(3 * BLOCK_SAMPLES, W.needed_samples(2)).any()
    # an interrupt ends the utterance: nothing waits for more of it; new speech is the next block's
    t.add(st.Speech(np.full(RATE, -0.5, dtype=np.float32), 1.1))
    assert t.speech_end == W.needed_samples(2) + RATE  # after the lookahead already read, never inside a started block
    t.add(st.Finish(1.2))
    rest = _run(t)
    assert rest[-1].verdict is st.Verdict.END and rest[-2].last and rest[0].speech
    # a finish after the last block with speech started: one closing block, said last
    r = _timeline(st.Pace.REALTIME, start=0.0)
    assert r.decide(0.0).verdict is st.Verdict.START
    r.add(st.Finish(0.1))
    closing = r.decide(0.1)
    assert closing.verdict is st.Verdict.START and closing.last and r.decide(0.2).verdict is st.Verdict.END


def test_each_blocks_runs_say_where_its_pushed_speech_came_from():
    """A real-time session fed random chunks at random times, with silences and an interrupt: every
    block's span is exactly its runs' samples of the pushed stream (the speech of every
    :class:`Speech` in order, dropped ones included), zeros elsewhere; and the runs held stay few."""
    rng, pyrng = np.random.default_rng(4), random.Random(4)
    pushed = np.zeros(0, dtype=np.float32)
    t = _timeline(st.Pace.REALTIME, start=0.0)
    for g in range(120):
        now = g * 0.75
        if g in (12, 50, 51, 90) or pyrng.random() < 0.15:  # bursts of speech, a TTS's sentence or a trickle
            for chunk in _chunks(rng.uniform(-0.5, 0.5, int(pyrng.uniform(0.2, 4) * RATE)).astype(np.float32),
                                 pyrng, hi_s=1.0):
                chunk = np.where(chunk == 0, 0.25, chunk).astype(np.float32)  # no zero: zeros mean silence here
                t.add(st.Speech(chunk, now))
                pushed = np.concatenate([pushed, chunk])
        if g == 52:
            t.add(st.Interrupt(now))
        assert t.decide(now).verdict is st.Verdict.START
        lo, hi = g * BLOCK_SAMPLES, (g + 1) * BLOCK_SAMPLES
        want = np.zeros(BLOCK_SAMPLES, dtype=np.float32)
        for run in t.runs_in(lo, hi):
            assert lo <= run.at and run.end <= hi and run.samples > 0
            want[run.at - lo:run.end - lo] = pushed[run.pushed:run.pushed + run.samples]
        assert np.array_equal(t.block_span(g), want), g
        t.let_go(min(W.samples_of_block(g + 1)[0], hi))
        assert len(t.runs) <= 8
    assert t.dropped > 0 and t.received == pushed.size


def test_what_a_timeline_holds_stays_bounded():
    t = _timeline(st.Pace.REALTIME, start=0.0)
    rng = np.random.default_rng(2)
    most = 0
    for g in range(2000):  # 25 minutes of blocks, speech and silence alternating every 30 s
        now = g * 0.75
        if (g // 40) % 2 == 0:
            t.add(st.Speech(rng.uniform(-0.1, 0.1, BLOCK_SAMPLES).astype(np.float32), now))
        d = t.decide(now)
        assert d.verdict is st.Verdict.START
        s0, _ = W.samples_of_block(g)
        t.samples(s0, W.needed_samples(g))
        t.let_go(min(W.samples_of_block(g + 1)[0], (g + 1) * BLOCK_SAMPLES))
        most = max(most, t.held.size)
    assert most < 10 * RATE, most  # seconds, not minutes


# --------------------------------------------------------------------------- the loop
@pytest.fixture(scope="module")
def speech16k(tmp_path_factory) -> Path:
    """2.6 s of speech at 16 kHz, 16-bit (4 blocks): what a session's PCM is."""
    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio

    return make_speech_audio(tmp_path_factory.mktemp("session") / "speech.wav", seconds=2.6, seed=8)


def _pcm(path: Path) -> np.ndarray:
    import wave

    with wave.open(str(path), "rb") as f:
        assert f.getframerate() == RATE and f.getsampwidth() == 2 and f.getnchannels() == 1
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")


def _live_shell(engine_cpu, hooks=None):
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine_cpu
    plan = RankPlan(Layout.for_mode(Mode.LIVE, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                            components.LoadSettings.of(spec))
    return JobShell(parts, plan, hooks)


class Recording:
    """A sink keeping each block's frames and its span of the speech."""

    def __init__(self):
        self.blocks, self.speech, self.counts = [], [], []

    def frames(self, index, frames, count, speech=None):
        self.blocks.append(frames)
        self.speech.append(speech)
        self.counts.append(count)

    def clip_done(self, state, count):
        pass


@pytest.mark.slow
def test_a_session_fed_in_random_chunks_while_it_runs_makes_the_files_frames(engine_cpu, speech16k, tmp_path):
    from wan_s2v_runner.rank.job_contract import Hooks
    from wan_s2v_runner.rank.speech_source import SessionEvents
    from wan_s2v_runner.rank.worker import request_for

    wan, cfg, spec = engine_cpu
    job = spec.model_copy(update={"audio": speech16k, "seed": 42, "mode": "live"})
    want = _live_shell(engine_cpu).generate(request_for(job))

    folder = tmp_path / "speech"
    folder.mkdir()
    pcm = _pcm(speech16k)
    rng = random.Random(11)
    chunks = _chunks(pcm, rng)
    assert len(chunks) > 4 and min(c.size for c in chunks) < RATE // 10

    def feed():  # chunks of 1 ms .. 3 s, at random moments while the blocks run, then the finish
        seq = 0
        for chunk in chunks:
            time.sleep(rng.uniform(0.0, 0.3))
            seq += 1
            session_speech.post_speech(folder, seq, SpeechKind.PCM, chunk.astype("<i2").tobytes())
        session_speech.post_speech(folder, seq + 1, SpeechKind.FINISH)

    sink = Recording()
    hooks = Hooks(speech_events=SessionEvents(folder, st.Pace.SPEECH), sink=sink)
    feeder = threading.Thread(target=feed)
    feeder.start()
    session = spec.model_copy(update={"audio": None, "session": st.Pace.SPEECH, "seed": 42, "mode": "live"})
    _live_shell(engine_cpu, hooks).generate(request_for(session))
    feeder.join()
    got = torch.cat(sink.blocks, dim=2)[0]
    assert torch.equal(got, want), (got - want).abs().max()
    # the recording's speech: each block's 0.75 s of the timeline, the file's samples then silence
    spans = np.concatenate([span.samples for span in sink.speech])
    assert all(span.ready_at is not None for span in sink.speech)  # a session's: when its speech was there
    assert spans.size == len(sink.blocks) * BLOCK_SAMPLES >= pcm.size
    assert np.array_equal(spans[:pcm.size], pcm.astype(np.float32) / 32768.0) and not spans[pcm.size:].any()
    # a block's count: unknown (None) until the finish arrived, the total after; the last one knows it
    assert sink.counts[-1] == len(sink.blocks) and set(sink.counts[:-1]) == {None}


# --------------------------------------------------------------------------- a served session
def frames_blocks(frames) -> int:
    from wan_s2v_runner.shared import live_recipe

    return next(b for b in range(1, 1000) if live_recipe.video_frames(b) == frames.shape[1])


def _video_packets(path) -> list[bytes]:
    import av

    with av.open(str(path)) as c:
        return [bytes(p) for p in c.demux(c.streams.video[0]) if p.size]


def _rgb_frames(path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])]


async def _through_the_client(url: str, image: Path, pcm: np.ndarray):
    """A speech-paced session through the sessions' client: its media as it came, its end, its recording."""
    from serving import TOKEN

    from wan_s2v_runner.integrations.session_client import AvatarSession, Ended, SpeechChunk, SpeechPlaced, VideoFrame

    frames, speech, ended, placed = [], [], [], []
    async with await AvatarSession.open(url, image, token=TOKEN, pace="speech", seed=42) as session:
        async def watch():
            async for item in session.media():
                {VideoFrame: frames, SpeechChunk: speech, Ended: ended, SpeechPlaced: placed}[type(item)].append(item)
        watcher = asyncio.create_task(watch())
        for chunk in _chunks(pcm, random.Random(6)):
            await session.push(chunk, rate=16000)
        await session.end()
        await watcher
        recording = await session.recording()
    return frames, speech, ended[0], recording, placed


def _audio(path) -> tuple[np.ndarray, int]:
    import av

    with av.open(str(path)) as c:
        stream = c.streams.audio[0]
        out = [f.to_ndarray().reshape(-1) for f in c.decode(stream)]
        return np.concatenate(out), stream.rate


@pytest.mark.slow(seconds=90)
def test_a_served_session_over_five_ranks(tiny_assets, inputs, engine_cpu, speech16k, tmp_path):
    """``wan-s2v serve --mode live --nproc 5``, its sessions over HTTP:

    1. ``speech``-paced, fed the file's speech in random chunks while it runs, then ended: its
       recording's video is the file's one-process frames, packet for packet (the same frames, the
       same encoder), and so is what its stream sent while it ran; bad chunks are 4xx and it lives on;
    2. while it runs a second session is refused with 429 (one live group);
    3. ``realtime``-paced, speech then an interrupt mid-utterance, then no client: the server ends it
       after ``--session-idle``; its recording keeps the speech it rendered and stays in sync (its
       speech's samples span its frames)."""
    from serving import TINY_DEFAULTS, TOKEN, ServerProcess

    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared import media

    wan, cfg, spec = engine_cpu
    frames = _live_shell(engine_cpu).generate(request_for(spec.model_copy(update={"audio": speech16k, "seed": 42})))
    want = media.save_video_with_audio(frames, cfg.sample_fps, speech16k, tmp_path / "want.mp4",
                                       media.clip_lengths(frames.shape[1], 12))
    s = ServerProcess(tmp_path / "server", [*TINY_DEFAULTS, "--mode", "live", "--nproc", "5", "--ckpt-dir",
                                            str(tiny_assets.ckpt_dir), "--token", TOKEN, "--allow-dir",
                                            str(inputs["root"]), "--session-idle", "4"])
    try:
        wait_idle = lambda: s.http.get("/health").json()["group"] == "idle"  # noqa: E731
        from conftest import wait_for

        wait_for(wait_idle, 180, "the live group to load", s.tail)
        made = s.http.post("/v1/videos/sessions", json={"image": str(inputs["image"]), "seed": 42, "pace": "speech"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert made.json()["state"] == "open" and made.json()["stream_url"].endswith("/stream")
        assert s.http.post("/v1/videos/sessions", json={"image": str(inputs["image"])}).status_code == 429
        got_stream = bytearray()

        def follow():
            with s.http.stream("GET", f"/v1/videos/sessions/{sid}/stream", timeout=180) as r:
                assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
                for chunk in r.iter_bytes():
                    got_stream.extend(chunk)

        follower = threading.Thread(target=follow)
        follower.start()
        url = f"/v1/videos/sessions/{sid}/speech"
        for bad, params, code in ((b"\x01\x02\x03", {"rate": 16000}, 400),  # half a sample
                                  (np.array([np.nan], "<f4").tobytes(), {"format": "f32le", "rate": 16000}, 400),
                                  (b"\0\0", {"rate": 12345}, 400),
                                  (b"\0\0" * int(11 * 16000), {"rate": 16000}, 413)):
            r = s.http.post(url, params=params, content=bad)
            assert r.status_code == code, (params, r.text)
        rng = random.Random(3)
        pcm = _pcm(speech16k)
        for chunk in _chunks(pcm, rng):
            r = s.http.post(url, params={"format": "s16le", "rate": 16000}, content=chunk.tobytes())
            assert r.status_code == 200, r.text
            time.sleep(rng.uniform(0, 0.2))
        assert s.http.post(f"/v1/videos/sessions/{sid}/end").json()["state"] == "ending"
        assert s.http.post(url, params={"rate": 16000}, content=b"\0\0").status_code == 409  # ended: no more
        done = s.wait(sid, "completed")
        follower.join(60)
        assert done["frames"] == list(frames.shape), done
        (tmp_path / "got.mp4").write_bytes(s.http.get(f"/v1/videos/{sid}/content").content)
        packets = _video_packets(tmp_path / "got.mp4")
        assert packets == _video_packets(want)
        (tmp_path / "streamed.mp4").write_bytes(bytes(got_stream))
        assert _video_packets(tmp_path / "streamed.mp4") == packets  # the stream: the same fragments as they came
        assert s.http.get(f"/v1/videos/sessions/{sid}").json()["state"] == "ended"
        figures = done["live"]  # the session's record: its pace and its blocks' latency
        assert figures["first_frame_s"] > 0 and figures["fps"] > 0, figures
        lat = figures["block_latency_s"]
        assert lat["blocks"] == frames_blocks(frames) and 0 < lat["p50"] <= lat["p95"] <= lat["max"] < 60, lat

        # the sessions' client (integrations/session_client.py): the same speech, its decoded frames
        # the recording's exactly, its speech spanning them
        wait_for(wait_idle, 60, "the group to be free", s.tail)
        frames_seen, speech_seen, ended, recording, placed = asyncio.run(
            _through_the_client(s.url, inputs["image"], pcm))
        (tmp_path / "client.mp4").write_bytes(recording)
        assert _video_packets(tmp_path / "client.mp4") == packets
        decoded = _rgb_frames(tmp_path / "client.mp4")
        assert [f.index for f in frames_seen] == list(range(len(decoded))) == list(range(frames.shape[1]))
        assert all(np.array_equal(f.image, d) for f, d in zip(frames_seen, decoded))
        assert frames_seen[1].t - frames_seen[0].t == 1 / 16 and ended.video["status"] == "completed"
        heard = sum(c.pcm.size for c in speech_seen) / speech_seen[0].rate
        assert abs(heard - len(decoded) / 16) <= 1 / 16 + 2048 / 16000, heard
        # where the pushed speech lies, block by block (speech-paced: all of it, in order, from 0 s)
        runs = [r for block in placed for r in block.runs]
        assert [b.t for b in placed] == [g * 0.75 for g in range(frames_blocks(frames))]  # one a block
        assert runs[0][:2] == (0.0, 0) and sum(n for _, _, n in runs) == pcm.size
        assert all(b[1] == a[1] + a[2] and b[0] == a[0] + a[2] / 16000 for a, b in zip(runs, runs[1:]))

        # a real-time session: a second of speech, interrupted after it started, then no client at all
        wait_for(wait_idle, 60, "the group to be free", s.tail)
        rt = s.http.post("/v1/videos/sessions", json={"image": str(inputs["image"]), "seed": 7}).json()
        said = (np.sin(np.arange(6 * 16000) / 16000 * 2 * np.pi * 220) * 12000).astype("<i2")
        assert s.http.post(f"/v1/videos/sessions/{rt['id']}/speech", params={"rate": 16000},
                           content=said.tobytes()).status_code == 200
        wait_for(lambda: (s.video(rt["id"]).get("blocks_done") or 0) >= 3, 60, "a few blocks", s.tail)
        assert s.http.post(f"/v1/videos/sessions/{rt['id']}/interrupt").json()["interrupts"] == 1
        running = s.video(rt["id"])["live"]  # while it runs: its pace, and its latency in /metrics
        assert running["fps"] > 0 and running["block_latency_s"]["blocks"] >= 1, running
        assert 'wan_s2v_session_block_latency_seconds{group="0",quantile="p95"}' in s.http.get("/metrics").text
        ended = s.wait(rt["id"], "completed", timeout=120)  # nobody calls again: --session-idle ends it
        (tmp_path / "rt.mp4").write_bytes(s.http.get(f"/v1/videos/{rt['id']}/content").content)
        audio, rate = _audio(tmp_path / "rt.mp4")
        video_frames = ended["frames"][1]
        assert rate == 16000 and abs(audio.size / rate - video_frames / 16) <= 1 / 16 + 2048 / rate, (
            audio.size, video_frames)
        loud = np.abs(audio) > 0.05
        assert loud.any() and loud.sum() < said.size  # it spoke, and less than all: the interrupt dropped the rest
    finally:
        assert s.stop() == []


def test_a_blocks_latency_counts_from_when_it_could_start():
    """From the arrival of the last sample it needed; a real-time block's speech that came early waits
    for its time (the pace, not latency); silence: from its start; a file's: none."""
    t = _timeline(st.Pace.SPEECH)
    t.add(st.Speech(np.ones(W.needed_samples(0) - 1, np.float32), 5.0))
    assert t.decide(6.0).verdict is st.Verdict.WAIT
    t.add(st.Speech(np.ones(1, np.float32), 7.0))
    assert t.decide(8.0).ready_at == 7.0
    r = _timeline(st.Pace.REALTIME, start=100.0)
    r.add(st.Speech(np.ones(5 * RATE, np.float32), 99.0))  # all of it early
    first = r.decide(100.0)
    assert first.ready_at == 100.0 and first.speech  # in hand before its time: spoken at once, counted from its time
    g = 3
    while r.started < g:
        r.decide(r.due(r.started))
    assert r.decide(r.due(g)).ready_at == r.due(g)
    f = _timeline(st.Pace.SPEECH)
    f.add(st.Speech(np.ones(RATE, np.float32), None))
    f.add(st.Finish(0.0))
    assert [d.ready_at for d in _run(f)] == [None] * (W.blocks_for_samples(RATE) + 1)


def test_the_doctor_says_whether_a_session_keeps_up_with_real_time():
    """On recorded machines: one H100 falls behind at 704x384 and names the largest usual size that keeps
    up; five A100s keep up at that size; a CPU has no estimate (skip, never a guess)."""
    from test_live import _live_ctx

    from wan_s2v_runner.preflight import checks_live
    from wan_s2v_runner.preflight.core import Status

    one = checks_live.check_session(_live_ctx("h100_1x", nproc=1))
    assert one.status is Status.WARN and not one.data["realtime"] and one.data["fps"] < 16, one
    best = one.data["largest_realtime_size"]
    assert best and f"--size {best}" in one.fix
    at_best = checks_live.check_session(_live_ctx("h100_1x", nproc=1, max_area=best))
    assert at_best.status is Status.OK and at_best.data["fps"] >= 16, at_best
    bigger = checks_live.SESSION_SIZES[checks_live.SESSION_SIZES.index(best) - 1]
    assert checks_live.check_session(_live_ctx("h100_1x", nproc=1, max_area=bigger)).status is Status.WARN
    five = checks_live.check_session(_live_ctx("a100_8x_nvlink", nproc=5, max_area="640*360"))
    assert five.status is Status.OK and five.data["speech_to_frames_s"] > W.lookahead_s + 0.75, five
    assert checks_live.check_session(_live_ctx("cpu_only", nproc=1, device="cpu")).status is Status.SKIP


@pytest.mark.slow(seconds=60)
def test_a_fleet_runs_a_session_on_a_free_live_group_of_any_server(cluster, tiny_assets, engine_cpu, speech16k,
                                                                   tmp_path):
    """Two ``--mode live`` servers sharing a queue and a directory, A of one rank, B of two (rank 0 runs
    the first two steps and decodes the blocks in flight behind, each block's speech features
    travelling with its latents). Two sessions opened on A: whichever group takes the first, the
    second is taken by the other (a free live group of any server); A serves both (speech in, the
    stream out: the folder, the growing video and the recording are the shared directory's); a third,
    with both groups busy, is refused with 429 and leaves nothing in the queue. Both, fed the file's
    speech in random chunks and ended, are the file's one-process frames, packet for packet: over one
    rank and over two."""
    from serving import shared_server

    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared import media

    wan, cfg, spec = engine_cpu
    frames = _live_shell(engine_cpu).generate(request_for(spec.model_copy(update={"audio": speech16k, "seed": 42})))
    want = _video_packets(media.save_video_with_audio(frames, cfg.sample_fps, speech16k, tmp_path / "want.mp4",
                                                      media.clip_lengths(frames.shape[1], 12)))
    url, shared = cluster.database(), tmp_path / "shared"
    shared.mkdir()
    live = ("--mode", "live", "--session-idle", "30")
    a = shared_server(tmp_path / "a" / "server", tiny_assets.ckpt_dir, url, shared, 3, *live)
    b = shared_server(tmp_path / "b" / "server", tiny_assets.ckpt_dir, url, shared, 3, *live, "--nproc", "2")
    try:
        image = {"image": ("ref.png", tiny_assets.image.read_bytes(), "image/png")}
        opened = []
        for _ in range(2):
            r = a.http.post("/v1/videos/sessions", files=image, data={"seed": "42", "pace": "speech"})
            assert r.status_code == 201, r.text
            opened.append(r.json()["id"])
        third = a.http.post("/v1/videos/sessions", files=image, data={"seed": "3"})
        assert third.status_code == 429 and third.headers.get("retry-after"), third.text
        assert {v["id"] for v in a.videos()} == set(opened)  # the refused one is gone
        sid = opened[1]
        streamed = bytearray()

        def follow():
            with a.http.stream("GET", f"/v1/videos/sessions/{sid}/stream", timeout=120) as r:
                for chunk in r.iter_bytes():
                    streamed.extend(chunk)

        follower = threading.Thread(target=follow)
        follower.start()
        pcm = _pcm(speech16k)
        for n, session in enumerate(opened):
            for chunk in _chunks(pcm, random.Random(4 + n)):
                assert a.http.post(f"/v1/videos/sessions/{session}/speech", params={"rate": 16000},
                                   content=chunk.tobytes()).status_code == 200
            a.http.post(f"/v1/videos/sessions/{session}/end")
        for session in opened:
            assert a.wait(session, "completed", timeout=120)["frames"] == list(frames.shape)
            (tmp_path / f"{session}.mp4").write_bytes(a.http.get(f"/v1/videos/{session}/content").content)
            assert _video_packets(tmp_path / f"{session}.mp4") == want, session
        follower.join(60)
        made = {name: [e["id"] for e in rank0_of(srv.dir, "job")] for name, srv in (("a", a), ("b", b))}
        assert sorted(made["a"] + made["b"]) == sorted(opened) and len(made["b"]) == 1, made
        (tmp_path / "streamed.mp4").write_bytes(bytes(streamed))
        assert _video_packets(tmp_path / "streamed.mp4") == want
    finally:
        a.stop()
        b.stop()


def rank0_of(server_dir: Path, kind: str) -> list[dict]:
    from serving import rank0_events

    return rank0_events(server_dir, kind)


def frames_of_speech(samples: int) -> int:
    from wan_s2v_runner.shared import live_recipe

    return live_recipe.video_frames(W.blocks_for_samples(samples))


def test_a_session_whose_server_died_ends_by_itself(tmp_path):
    """The opening server touches the session folder's alive mark while it holds the session; a group
    whose session's mark grew stale (its server died) takes that as the session's end."""
    import os

    from wan_s2v_runner.rank.speech_source import SessionEvents

    folder = tmp_path / "speech"
    folder.mkdir()
    session_speech.mark_alive(folder)
    session_speech.post_speech(folder, 1, SpeechKind.PCM, np.zeros(160, "<i2").tobytes())
    events = SessionEvents(folder, st.Pace.REALTIME)
    assert [type(e) for e in events.take()] == [st.Speech] and events.take() == []
    stale = time.time() - session_speech.ORPHAN_S - 1
    os.utime(folder / session_speech.ALIVE, (stale, stale))
    ended = events.take()
    assert [type(e) for e in ended] == [st.Finish] and events.take() == []  # said once


def test_a_long_sessions_rope_rows_are_upstreams_table_rows(engine_cpu):
    """The live DiT makes only the RoPE rows a forward reads (a session's video of any length holds no
    table as long as it): at block 6000 (an hour and a quarter in, past upstream's 1024 positions) its
    rows equal upstream's whole table's, bit for bit, for the block's tokens and the reference's."""
    from live_reference import upstream_rope

    from wan_s2v_runner.rank.live_dit import LiveDiT
    from wan_s2v_runner.shared import live_recipe

    dit = LiveDiT(_live_shell(engine_cpu).parts.noise_model)
    frame, h, w = 6000 * live_recipe.BLOCK_LATENT_FRAMES, 4, 4
    got = dit._rope(3 * h * w, frame, 3, h, w, "cpu")
    assert torch.equal(got, upstream_rope(dit, 3 * h * w, frame, 3, h, w, positions=frame + 64))
    ref = live_recipe.ref_position(frame, 30)
    want = upstream_rope(dit, h * w, ref, 1, h, w, positions=ref + 8)
    assert torch.equal(dit._rope(h * w, ref, 1, h, w, "cpu"), want)
    assert not torch.equal(got, dit._rope(3 * h * w, frame + 3, 3, h, w, "cpu"))  # the next block's differ
