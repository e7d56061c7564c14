"""Patch: report stages (audio/ref/text encode, clip j/M, decode, motion re-encode) and denoising
steps (step i/N) as events.

Upstream: ``WanS2V.generate`` iterates ``for i, t in enumerate(tqdm(timesteps))`` once per clip,
with ``tqdm`` imported by name into ``wan.speech2video``; nothing else reports progress. Before
the clips it calls ``encode_audio``, ``vae.encode`` (reference image, then the initial motion
frames) and ``text_encoder`` (prompt, negative prompt); after each clip's denoising it calls
``vae.decode`` and then ``vae.encode`` on the last frames (motion latents for the next clip).
Change: rebind ``wan.speech2video.tqdm`` to a wrapper that yields the same items and emits a
``progress`` event per step (clip index counted by the number of loops started), and wrap the
pipeline *instance's* ``encode_audio``, ``vae.encode``, ``vae.decode`` and ``text_encoder`` to
emit stage events (``audio_encode``, ``ref_encode`` before the first clip / ``motion_encode``
after one, ``decode``, ``text_encode``). So each stage's wall time in ``run.json`` is that
stage's own work. Values computed are untouched; only events are written.
Proof: tests/test_supervision.py (the manifest has every stage with a time; progress reaches
the last step of the last clip).
"""
from __future__ import annotations

import functools

from wan_s2v_runner.stages import Stage


class _Counter:
    def __init__(self, events, total_steps: int):
        self.events = events
        self.total_steps = total_steps
        self.clip = 0
        self.total_clips = None

    def enter(self, stage: Stage, **data) -> None:
        """Emit a stage event unless the rank is already in that stage (back-to-back calls)."""
        if self.events.current_stage != stage:
            self.events.stage(stage, **data)

    def tqdm(self, iterable, *args, **kwargs):
        self.clip += 1
        n = len(iterable) if hasattr(iterable, "__len__") else self.total_steps
        self.events.stage(Stage.DENOISE, clip=self.clip, clips=self.total_clips, steps=n)
        for i, item in enumerate(iterable):
            self.events.fault_point(Stage.DENOISE)
            yield item
            self.events.step(clip=self.clip, clips=self.total_clips, step=i + 1, steps=n)


class _StageOnCall:
    """Calls ``target`` after entering a stage; every other attribute goes to ``target``.

    Used for ``pipeline.text_encoder`` (a plain object whose ``__call__`` cannot be replaced on
    the instance); the engine also reads ``text_encoder.model``, which passes through.
    """

    def __init__(self, target, on_call):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_on_call", on_call)

    def __call__(self, *a, **k):
        self._on_call()
        return self._target(*a, **k)

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __setattr__(self, name, value):
        setattr(self._target, name, value)


def apply(wan, pipeline, events, total_steps: int, num_clips=None) -> _Counter:
    counter = _Counter(events, total_steps)
    wan.speech2video.tqdm = counter.tqdm

    encode_audio = pipeline.encode_audio

    @functools.wraps(encode_audio)
    def encode_audio_reporting(*a, **k):
        counter.enter(Stage.AUDIO_ENCODE)
        emb, nr = encode_audio(*a, **k)
        counter.total_clips = min(num_clips, nr) if num_clips else nr
        events.emit("clips", clips=counter.total_clips)
        return emb, nr

    pipeline.encode_audio = encode_audio_reporting

    vae_encode, vae_decode = pipeline.vae.encode, pipeline.vae.decode

    @functools.wraps(vae_encode)
    def vae_encode_reporting(*a, **k):
        counter.enter(Stage.REF_ENCODE if counter.clip == 0 else Stage.MOTION_ENCODE)
        return vae_encode(*a, **k)

    @functools.wraps(vae_decode)
    def vae_decode_reporting(*a, **k):
        counter.enter(Stage.DECODE)
        return vae_decode(*a, **k)

    pipeline.vae.encode = vae_encode_reporting
    pipeline.vae.decode = vae_decode_reporting
    if not isinstance(pipeline.text_encoder, _StageOnCall):
        pipeline.text_encoder = _StageOnCall(
            pipeline.text_encoder, lambda: counter.enter(Stage.TEXT_ENCODE, clips=counter.total_clips))
    return counter
