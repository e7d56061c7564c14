"""A live session's WebRTC egress over HTTP, in the WHEP shape (draft-ietf-wish-whep), thin (the
viewers and their media: :mod:`.whep`):

- ``POST /v1/videos/sessions/{id}/whep`` with ``Content-Type: application/sdp`` (the viewer's SDP
  offer: recvonly video and audio, ICE candidates gathered) -> ``201 Created``, the SDP answer
  (``application/sdp``) and ``Location``: the viewer's resource. 400: the body is not an offer this
  server can answer; 404: no such session; 409: the session's video ended; 415: not
  ``application/sdp``; 429: as many viewers as a session (or the server) takes;
- ``DELETE /v1/videos/sessions/{id}/whep/{viewer}``: the viewer ends (200).

No trickle ICE (a ``PATCH`` is 405): the offer carries its candidates, the answer the server's. Auth
as every API route. The viewers end with the session's video, and at the server's shutdown (this
router's lifespan).
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from wan_s2v_runner.serve.protocol import ErrorResponse
from wan_s2v_runner.serve.routes import ERRORS, ServerDep, authorized, job_row
from wan_s2v_runner.serve.sessions import SessionState
from wan_s2v_runner.serve.state import Server
from wan_s2v_runner.serve.store.protocol import QueueUnavailable, StoreRefused
from wan_s2v_runner.serve.submissions import Refused
from wan_s2v_runner.serve.whep import SessionMedia, Viewers

#: the largest SDP offer taken (a browser's, with its candidates, is a few KiB)
MAX_SDP_BYTES = 64 * 1024


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    viewers = getattr(app.state, "whep", None)
    if viewers is not None:  # the server stops: every peer connection closed
        await viewers.close_all()


whep_api = APIRouter(prefix="/v1/videos/sessions", dependencies=[Depends(authorized)], tags=["sessions"],
                     responses={**ERRORS, 415: {"model": ErrorResponse}}, lifespan=_lifespan)


def viewers_of(request: Request) -> Viewers:
    """The app's viewers (made with its first)."""
    viewers = getattr(request.app.state, "whep", None)
    if viewers is None:
        viewers = request.app.state.whep = Viewers()
    return viewers


def session_media(server: Server, session_id: str) -> SessionMedia:
    """What a viewer is told of its session: its growing file, whether its job ended, its touch."""

    def ended() -> bool:
        try:
            return job_row(server, session_id).status.terminal
        except Refused:  # deleted
            return True
        except (QueueUnavailable, StoreRefused):  # asked again at the next look
            return False

    def touch() -> None:
        try:
            server.sessions.touch(session_id)
        except Refused:
            pass

    return SessionMedia(find=lambda: server.dirs.so_far(session_id), ended=ended, touch=touch)


def _watchable(server: Server, session_id: str) -> bool:
    """Whether the session's video has begun (a viewer then starts at its newest block); 409 when
    its job ended."""
    row = job_row(server, session_id)
    if row.status.terminal or server.sessions.get(session_id).state is SessionState.ENDED:
        server.sessions.ended(session_id)
        raise Refused(409, f"session {session_id}'s video has ended ({row.status.value}). Fix: its recording is GET "
                           f"/v1/videos/{session_id}/content", "session_id")
    return server.dirs.so_far(session_id) is not None


async def _offer(request: Request) -> str:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/sdp":
        raise Refused(415, f"the body is {kind or 'of no type'}, not an SDP offer. Fix: POST the offer with "
                           "Content-Type: application/sdp (WHEP)", "body")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_SDP_BYTES:
            raise Refused(413, f"the SDP offer is over {MAX_SDP_BYTES // 1024} KiB. Fix: send the offer alone",
                          "body")
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        raise Refused(400, "the SDP offer is not UTF-8 text. Fix: POST the offer's SDP as it is", "body") from None


@whep_api.post("/{session_id}/whep", status_code=201, response_class=Response, responses={
    201: {"description": "the SDP answer; Location: the viewer (DELETE it to stop)",
          "content": {"application/sdp": {"schema": {"type": "string"}}},
          "headers": {"Location": {"schema": {"type": "string"}, "description": "the viewer's resource"}}}},
    openapi_extra={"requestBody": {"required": True, "content": {"application/sdp": {"schema": {"type": "string"}}}}})
async def whep_offer(session_id: str, request: Request, server: ServerDep) -> Response:
    """Watch the session over WebRTC (WHEP): the body is the viewer's SDP offer (recvonly video and
    audio); the answer sends the session's video and the speech it plays, from its newest block
    (from its first when the session's video has not begun), at real time, until it ends."""
    server.sessions.touch(session_id)
    offer = await _offer(request)
    late = await run_in_threadpool(_watchable, server, session_id)
    viewer, answer = await viewers_of(request).open(session_id, offer, session_media(server, session_id), late)
    return Response(answer, status_code=201, media_type="application/sdp",
                    headers={"Location": f"/v1/videos/sessions/{session_id}/whep/{viewer.id}",
                             "cache-control": "no-store"})


@whep_api.delete("/{session_id}/whep/{viewer_id}", response_class=Response,
                 responses={200: {"description": "the viewer ended"}})
async def whep_end(session_id: str, viewer_id: str, request: Request) -> Response:
    """End a viewer (its peer connection closed)."""
    viewers = viewers_of(request)
    viewer = viewers.viewers.get(viewer_id)
    if viewer is None or viewer.session_id != session_id:
        raise Refused(404, f"no WebRTC viewer {viewer_id!r} of session {session_id!r}. Fix: the Location of its "
                           "POST .../whep (a viewer whose session ended is gone already)", "viewer_id")
    await viewers.close(viewer_id)
    return Response(status_code=200)
