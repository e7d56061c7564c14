"""The stages of a run: one named vocabulary for the ranks, the launcher and the reports.

A rank announces each stage it enters (``events.EventWriter.stage``); the launcher's hang
watchdog gives each stage its time limit; the console groups and labels stage lines; the failure
report names the stage a rank failed in. All of them ask :class:`Stage` rather than keeping
their own sets of names, so a new or renamed stage is one edit here, and a misspelt one is an
``AttributeError``/``ValueError`` instead of a stage that silently gets the wrong time limit.

Members are strings (``Stage.LOAD == "load"``, ``f"{Stage.LOAD}" == "load"``), so event files,
``run.json`` and the tests' ``WAN_S2V_TEST_FAULT`` keep the plain names. This module imports nothing from
the project.
"""
from __future__ import annotations

from enum import Enum
from typing import Optional, Union


class Stage(str, Enum):
    """Stages in the order a run goes through them.

    ``fingerprint``/``shard`` only in FSDP modes; ``tts`` only with ``--tts-text``;
    ``compile`` (with ``--compile``, before a size's first step);
    ``pose_encode`` (with ``--pose-video``)/``denoise``/``decode``/``motion_encode`` repeat per
    clip; ``tts``/``clip_checkpoint``/``save`` on the first rank only; ``start`` is a rank that has been
    spawned but has not reported a stage yet.
    """

    START = "start"
    INIT_PG = "init_pg"
    ENGINE_IMPORT = "engine_import"
    LOAD = "load"
    FINGERPRINT = "fingerprint"
    SHARD = "shard"
    TTS = "tts"  # the first rank speaks --tts-text (CosyVoice2) before the audio encode
    AUDIO_ENCODE = "audio_encode"
    REF_ENCODE = "ref_encode"
    TEXT_ENCODE = "text_encode"
    RECEIVE_INPUTS = "receive_inputs"  # waiting for the encoding rank's audio/text/latents
    # --compile: the DiT block compiled for a size this process has not run (at that size's first
    # step; a one-off, so it gets the load limit and is listed with the one-off stages)
    COMPILE = "compile"
    POSE_ENCODE = "pose_encode"  # --pose-video: the clip's pose frames read and VAE-encoded
    DENOISE = "denoise"
    DECODE = "decode"
    MOTION_ENCODE = "motion_encode"
    RECEIVE_MOTION = "receive_motion"  # waiting for the decoding rank's next motion latents
    CLIP_CHECKPOINT = "clip_checkpoint"  # the first rank: the clip's fragment in the video, its carried state
    SAVE = "save"  # the first rank: the video finished (its durations written in, renamed to the output)
    IDLE = "idle"  # a served rank group between jobs: each rank reports ``waiting`` while it is alive
    DONE = "done"

    def __str__(self) -> str:  # the plain name, in f-strings and str() alike
        return self.value

    __format__ = str.__format__

    @property
    def is_load_class(self) -> bool:
        """One-off stage whose time grows with model size, storage and CPU speed: the hang
        watchdog allows it ``watchdog_load_s`` (every other stage gets ``watchdog_step_s``)."""
        return self in _LOAD_CLASS

    @property
    def is_step_class(self) -> bool:
        """A denoising step, a per-clip VAE pass, finishing the video: ``watchdog_step_s``."""
        return not self.is_load_class

    @property
    def repeats_per_clip(self) -> bool:
        """Entered once per clip (its console lines and stage events say which clip)."""
        return self in _PER_CLIP

    @property
    def first_rank_only(self) -> bool:
        """Only the first rank goes through it (it writes the mp4)."""
        return self in _FIRST_RANK_ONLY

    @classmethod
    def lookup(cls, name: object) -> Optional["Stage"]:
        """The member named ``name`` (a member or its string), or None for an unknown name:
        for reading event files, which may come from another version of the ranks."""
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            return None

    @classmethod
    def coerce(cls, name: object) -> Union["Stage", str]:
        """The member named ``name``, or ``name`` as a plain string if no stage has that name
        (kept, so a report can still show it)."""
        found = cls.lookup(name)
        return found if found is not None else str(name)


_LOAD_CLASS = frozenset({Stage.START, Stage.INIT_PG, Stage.ENGINE_IMPORT, Stage.LOAD,
                         Stage.FINGERPRINT, Stage.SHARD, Stage.TTS, Stage.AUDIO_ENCODE, Stage.REF_ENCODE,
                         Stage.TEXT_ENCODE, Stage.RECEIVE_INPUTS, Stage.COMPILE})
_PER_CLIP = frozenset({Stage.POSE_ENCODE, Stage.DENOISE, Stage.DECODE, Stage.MOTION_ENCODE, Stage.RECEIVE_MOTION,
                       Stage.CLIP_CHECKPOINT})
_FIRST_RANK_ONLY = frozenset({Stage.TTS, Stage.SAVE, Stage.CLIP_CHECKPOINT})


def gets_load_limit(name: object) -> bool:
    """Whether the hang watchdog gives a rank in stage ``name`` the load limit: load-class
    stages, and any name that is no stage (an event file from another version: the longer
    limit, so an unknown stage is never cut short)."""
    stage = Stage.lookup(name)
    return stage is None or stage.is_load_class
