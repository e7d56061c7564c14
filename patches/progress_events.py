"""Patch: report denoising progress (clip j/M, step i/N) and stages as events.

Upstream: ``WanS2V.generate`` iterates ``for i, t in enumerate(tqdm(timesteps))`` once per clip,
with ``tqdm`` imported by name into ``wan.speech2video``; nothing else reports progress.
Change: rebind ``wan.speech2video.tqdm`` to a wrapper that yields the same items and emits a
``progress`` event per step (clip index counted by the number of loops started), and wrap the
pipeline *instance's* ``encode_audio``, ``text_encoder`` and ``vae.decode`` to emit stage events.
Values computed are untouched; only events are written.
Proof: tests/test_supervision.py (the manifest has every stage, progress reaches the last step).
"""
from __future__ import annotations

import functools


class _Counter:
    def __init__(self, events, total_steps: int):
        self.events = events
        self.total_steps = total_steps
        self.clip = 0
        self.total_clips = None

    def tqdm(self, iterable, *args, **kwargs):
        self.clip += 1
        self.events.stage("denoise", clip=self.clip, clips=self.total_clips)
        n = len(iterable) if hasattr(iterable, "__len__") else self.total_steps
        for i, item in enumerate(iterable):
            self.events.fault_point("denoise")
            yield item
            self.events.step(clip=self.clip, clips=self.total_clips, step=i + 1, steps=n)


def _wrap_stage(events, stage, fn):
    @functools.wraps(fn)
    def wrapped(*a, **k):
        events.stage(stage)
        return fn(*a, **k)
    return wrapped


def apply(wan, pipeline, events, total_steps: int, num_clips=None) -> _Counter:
    counter = _Counter(events, total_steps)
    wan.speech2video.tqdm = counter.tqdm

    encode_audio = pipeline.encode_audio

    @functools.wraps(encode_audio)
    def encode_audio_reporting(*a, **k):
        events.stage("audio_encode")
        emb, nr = encode_audio(*a, **k)
        counter.total_clips = min(num_clips, nr) if num_clips else nr
        events.stage("text_encode", clips=counter.total_clips)
        return emb, nr

    pipeline.encode_audio = encode_audio_reporting
    pipeline.vae.decode = _wrap_stage(events, "decode", pipeline.vae.decode)
    return counter
