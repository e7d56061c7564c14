"""Schemathesis hooks for the API fuzz run (tests/test_serve_fuzz.py, ``SCHEMATHESIS_HOOKS``):
now and then a path's ``video_id`` is one of the server's real jobs (``WAN_S2V_FUZZ_IDS``), and a
submission's ``image`` and ``audio`` are real inputs on the server (``WAN_S2V_FUZZ_IMAGE``,
``WAN_S2V_FUZZ_AUDIO``, uploaded), so the fuzzed fields reach real jobs: cancel, delete and
content on jobs that run, and jobs with fuzzed settings that the ranks must take and end. A job's
event stream gets only made-up ids (its documented 404; a real job's stream runs until the job
ends)."""
from __future__ import annotations

import os
from pathlib import Path

import schemathesis
from hypothesis import strategies as st

IDS = [i for i in os.environ.get("WAN_S2V_FUZZ_IDS", "").split(",") if i]
#: real inputs replace a body's only in a run of schema-valid cases (``--mode positive``): in a
#: negative one they would make an invalid case valid, and it would rightly be accepted
INPUTS = {name: Path(os.environ[var]).read_bytes() for name, var in
          (("image", "WAN_S2V_FUZZ_IMAGE"), ("audio", "WAN_S2V_FUZZ_AUDIO")) if os.environ.get(var)}
#: what a job made of real inputs leaves out (another input, fuzzed: a job that is refused)
OTHER_INPUTS = ("image", "input_reference", "audio", "tts_text", "pose_video", "tts_prompt_audio", "tts_prompt_text")


@schemathesis.hook
def flatmap_path_parameters(ctx, path_parameters):
    if not IDS or not path_parameters or "video_id" not in path_parameters:
        return st.just(path_parameters)
    if ctx.operation.path.endswith("/events"):  # a real job's stream runs until the job ends: its refusals only
        return st.just(path_parameters)
    return st.one_of(st.just(path_parameters),
                     st.sampled_from(IDS).map(lambda vid: {**path_parameters, "video_id": vid}))


@schemathesis.hook
def flatmap_body(ctx, body):
    if not isinstance(body, dict) or len(INPUTS) < 2:
        return st.just(body)
    real = {k: v for k, v in body.items() if k not in OTHER_INPUTS}
    # every fuzzed setting at once (mostly refused: one out of range is enough), or one at a time
    # (mostly taken: the job reaches the ranks with it)
    one_each = [{"prompt": "fuzzed", k: v, **INPUTS} for k, v in real.items() if k != "prompt"]
    return st.one_of(st.just(body), st.just({"prompt": "fuzzed", **real, **INPUTS}), *map(st.just, one_each))


@schemathesis.serializer("application/sdp")
def sdp_text(ctx, value):
    """A WHEP offer's body (``application/sdp``, a string in the schema): its text as sent. Fuzzed
    text is no offer the server can answer: its 400s, 404s (a made-up session) and 409s."""
    return str(value).encode("utf-8", "surrogatepass")
