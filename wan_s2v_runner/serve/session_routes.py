"""The live sessions' HTTP routes, thin (the state: :mod:`.sessions`; the job: the queue's, as any video):

- ``POST /v1/videos/sessions`` (multipart form or JSON, as ``POST /v1/videos``, without speech;
  ``pace``: realtime or speech) -> a :class:`~.protocol.SessionObject`, once a ``--mode live`` group
  of the fleet took it (any server's: :mod:`.sessions`); 429 when none does within
  :data:`CLAIM_WAIT_S` (a session starts at once or not at all: it never waits in the queue);
- ``GET /v1/videos/sessions/{id}``: the session;
- ``POST /v1/videos/sessions/{id}/speech?format=s16le&rate=16000``: speech appended (the body);
- ``POST /v1/videos/sessions/{id}/end_of_speech``: the utterance so far is complete (its tail is
  rendered without waiting for more);
- ``POST /v1/videos/sessions/{id}/interrupt``: the speech not yet in a started block is dropped (a
  voice agent's barge-in): the next block is silent, or the speech appended after;
- ``POST /v1/videos/sessions/{id}/end``: the speech appended is rendered, then the session's video
  job completes (its recording: ``GET /v1/videos/{id}/content``);
- ``GET /v1/videos/sessions/{id}/stream``: the session's video as one growing fragmented MP4, each
  block's fragment as it is written, until the job ends.

Every call from a client counts as the client being there (:data:`~.sessions.IDLE_S`).
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from wan_s2v_runner.serve.protocol import SessionObject
from wan_s2v_runner.serve.routes import ERRORS, STREAM_ERRORS, ServerDep, _fields, _store_job, authorized, job_row
from wan_s2v_runner.serve.sessions import MAX_CHUNK_S, Session, SpeechFormat
from wan_s2v_runner.serve.state import Server, video_object
from wan_s2v_runner.serve.store.protocol import JobStatus
from wan_s2v_runner.serve.submissions import Refused, Upload, build_job, new_id
from wan_s2v_runner.shared.layout import Recipe
from wan_s2v_runner.shared.session_speech import SpeechKind
from wan_s2v_runner.shared.speech_timeline import Pace

sessions_api = APIRouter(prefix="/v1/videos/sessions", dependencies=[Depends(authorized)], responses=ERRORS,
                         tags=["sessions"])
#: how often a stream looks for a new fragment, and asks the queue whether its session's job ended
STREAM_POLL_S = 0.05
STREAM_STATUS_S = 0.5
#: how long a session's create waits for a live group of the fleet to take it (an idle keeper of a
#: shared queue asks every 0.5 s; one server's at once)
CLAIM_WAIT_S = 3.0
CLAIM_POLL_S = 0.05
#: the largest speech body an append takes (a WAV of MAX_CHUNK_S at 48 kHz, 32-bit, with room)
MAX_SPEECH_BYTES = int(MAX_CHUNK_S * 48000 * 4) + 65536


def session_object(server: Server, s: Session) -> SessionObject:
    row = job_row(server, s.id)
    if row.status.terminal:
        server.sessions.ended(s.id)
    base = f"/v1/videos/sessions/{s.id}"
    return SessionObject(id=s.id, state=s.state.value, ended_by=s.ended_by, pace=s.pace.value, speech_s=s.speech_s,
                         interrupts=s.interrupts, stream_url=f"{base}/stream", speech_url=f"{base}/speech",
                         whep_url=f"{base}/whep", video=video_object(server, row))


def _refusal(server: Server) -> Optional[Refused]:
    """Why no session can start now, before one is made (None: try)."""
    spec = server.keeper.group_spec
    if spec.layout.recipe is not Recipe.LIVE:
        return Refused(409, f"this server's groups make clip videos (--mode {spec.mode.value}). Fix: send sessions "
                            "to a server started with --mode live")
    busy = server.watch.not_ready()
    if busy is not None:
        busy = f"the server takes no job now: {busy}"
    elif server.queue.job_counts().get(JobStatus.QUEUED.value, 0):
        busy = "jobs wait in the queue (every live group of the fleet is busy)"
    if busy is None:
        return None
    return Refused(429, f"no live session can start now: {busy}. Fix: retry in a moment (or another server of the "
                        "fleet)", retry_after=5)


def _claimed(server: Server, job_id: str) -> bool:
    """Wait up to :data:`CLAIM_WAIT_S` for a live group of the fleet to take the session's job; a job
    no group took is removed (a session starts at once or not at all). True: taken."""
    deadline = time.monotonic() + CLAIM_WAIT_S
    while time.monotonic() < deadline:
        row = server.queue.job_get(job_id)
        if row is None or row.status is not JobStatus.QUEUED:
            return row is not None
        time.sleep(CLAIM_POLL_S)
    if server.queue.job_delete(job_id) is JobStatus.IN_PROGRESS:  # taken as it was removed: it runs, stop it
        server.cancel_running(job_id)
    server.dirs.remove_job_files(job_id, video=True)
    return False


@sessions_api.post("", status_code=201, openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": {
    "type": "object", "anyOf": [{"required": ["image"]}, {"required": ["input_reference"]}],
    "properties": {"image": {"type": "string", "format": "binary"},
                   "input_reference": {"type": "string", "format": "binary"},
                   "prompt": {"type": "string"}, "seed": {"type": "integer"}, "size": {"type": "string"},
                   "speech_lookahead": {"type": "number"},
                   "pace": {"type": "string", "enum": [p.value for p in Pace]}}}}}}})
async def create_session(request: Request, server: ServerDep) -> SessionObject:
    """Open a live session: the reference image, prompt, size, seed (as a video job); its speech
    comes after, as it is spoken."""
    refused = await run_in_threadpool(_refusal, server)
    if refused is not None:
        raise refused
    fields = await _fields(request, server.policy.max_upload_bytes)
    pace = fields.pop("pace", Pace.REALTIME.value)
    try:
        pace = Pace(pace if isinstance(pace, str) else "")
    except ValueError:
        raise Refused(422, f"pace {pace!r} is not one of {', '.join(p.value for p in Pace)}. Fix: realtime (a live "
                           "call) or speech (as fast as the speech comes)", "pace") from None
    job_id = new_id()
    try:
        spec = await run_in_threadpool(build_job, fields, job_id=job_id, base=server.base,
                                       group=server.keeper.group_spec, videos=server.dirs.videos,
                                       uploads=server.dirs.uploads, policy=server.policy, facts=server.facts,
                                       session=pace)
    finally:
        for value in fields.values():
            if isinstance(value, Upload):
                value.file.close()
    session = server.sessions.open(job_id, server.dirs.speech(job_id), pace)
    try:
        await run_in_threadpool(_store_job, server, job_id, spec.job.model_dump(mode="json"), None, None)
        taken = await run_in_threadpool(_claimed, server, job_id)
    except BaseException:
        server.sessions.forget(job_id)
        raise
    if not taken:
        server.sessions.forget(job_id)
        raise Refused(429, "no live group of the fleet took the session in time (every one is busy). Fix: retry in a "
                           "moment", retry_after=5)
    return await run_in_threadpool(session_object, server, session)


@sessions_api.get("/{session_id}")
def get_session(session_id: str, server: ServerDep) -> SessionObject:
    return session_object(server, server.sessions.touch(session_id))


def _running(server: Server, session_id: str) -> None:
    """A session whose job ended takes nothing more (409)."""
    row = job_row(server, session_id)
    if row.status.terminal:
        server.sessions.ended(session_id)
        raise Refused(409, f"session {session_id}'s video is {row.status.value}. Fix: create a new session",
                      "session_id")


@sessions_api.post("/{session_id}/speech", openapi_extra={"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    "audio/wav": {"schema": {"type": "string", "format": "binary"}}}}})
async def append_speech(session_id: str, request: Request, server: ServerDep,
                        format: SpeechFormat = SpeechFormat.S16LE,  # noqa: A002 - the query's name
                        rate: Optional[int] = Query(None, description="Hz of raw PCM (format s16le or f32le)")
                        ) -> SessionObject:
    """Speech appended to the session: raw mono PCM (``format=s16le`` or ``f32le`` at ``rate``) or a
    WAV/FLAC/OGG file (``format=wav``); at most 10 s an append."""
    from wan_s2v_runner.serve.routes import _read_body

    server.sessions.touch(session_id)
    await run_in_threadpool(_running, server, session_id)
    body = await _read_body(request, MAX_SPEECH_BYTES)
    if len(body) > MAX_SPEECH_BYTES:
        raise Refused(413, f"the speech body is over {MAX_SPEECH_BYTES} bytes. Fix: at most {MAX_CHUNK_S:g} s an "
                           "append", "body")
    s = await run_in_threadpool(server.sessions.append, session_id, body, format, rate)
    return await run_in_threadpool(session_object, server, s)


def _mark(server: Server, session_id: str, kind: SpeechKind) -> SessionObject:
    if kind is not SpeechKind.FINISH:
        _running(server, session_id)
    return session_object(server, server.sessions.mark(session_id, kind))


@sessions_api.post("/{session_id}/end_of_speech")
def end_of_speech(session_id: str, server: ServerDep) -> SessionObject:
    """The utterance so far is complete: its last blocks start without waiting for more speech."""
    return _mark(server, session_id, SpeechKind.END_OF_SPEECH)


@sessions_api.post("/{session_id}/interrupt")
def interrupt(session_id: str, server: ServerDep) -> SessionObject:
    """Drop the speech not yet in a started block (a barge-in): the next block is silent or the new speech."""
    return _mark(server, session_id, SpeechKind.INTERRUPT)


@sessions_api.post("/{session_id}/end")
def end(session_id: str, server: ServerDep) -> SessionObject:
    """End the session: the speech appended is rendered, then its video job completes."""
    return _mark(server, session_id, SpeechKind.FINISH)


@sessions_api.get("/{session_id}/stream", response_class=StreamingResponse, responses={
    **STREAM_ERRORS, 200: {"content": {"video/mp4": {}}, "description": "the session's fragmented MP4, as it grows"}})
async def stream(session_id: str, request: Request, server: ServerDep) -> StreamingResponse:
    """The session's video as it is made: one fragmented MP4 (its init segment, then each block's
    fragment once it is written), until the session's job ends."""
    from wan_s2v_runner.shared import fmp4

    server.sessions.touch(session_id)
    row = await run_in_threadpool(job_row, server, session_id)
    if row.status.terminal:
        raise Refused(409, f"session {session_id} has ended ({row.status.value}). Fix: its recording is GET "
                           f"/v1/videos/{session_id}/content", "session_id")

    async def fragments():
        f, asked = None, 0.0
        try:
            while True:
                if f is None:
                    path = await run_in_threadpool(server.dirs.so_far, session_id)
                    if path is not None:
                        f = open(path, "rb")
                        follower = fmp4.Follower(f)
                if f is not None:
                    data = await run_in_threadpool(follower.read)
                    if data:
                        server.sessions.touch(session_id)
                        yield data
                        continue
                if time.monotonic() - asked < STREAM_STATUS_S:  # the queue asked a few times a second, not each look
                    await asyncio.sleep(STREAM_POLL_S)
                    continue
                asked = time.monotonic()
                now = await run_in_threadpool(job_row, server, session_id)
                if now.status.terminal:
                    if f is not None:
                        data = await run_in_threadpool(follower.read)
                        if data:
                            yield data
                    return
                if await request.is_disconnected():
                    return
                server.sessions.touch(session_id)
                await asyncio.sleep(STREAM_POLL_S)
        finally:
            if f is not None:
                f.close()

    return StreamingResponse(fragments(), media_type="video/mp4", headers={"cache-control": "no-store"})
