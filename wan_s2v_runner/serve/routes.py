"""The HTTP routes, thin: each reads the :class:`~.state.Server` from the app, asks the queue,
the keeper or :mod:`.submissions`, and returns a typed model (:mod:`.protocol`).

- ``POST /v1/videos`` (multipart form, or JSON with paths): a job -> its video object, ``queued``;
  refused with 4xx and an :class:`~.protocol.ErrorResponse` (:mod:`.submissions` says why);
- ``GET /v1/videos``: every job (a :class:`~.protocol.VideoList`);
- ``GET /v1/videos/{id}``: the video object: ``status``, ``progress`` (percent), and ours:
  ``stage``, ``unit`` and the position in it (a clip job's ``clip``/``clips``, ``step``/``steps``,
  ``clips_done``/``clips_total``; a live job's ``block``/``blocks``, ``blocks_done``/``blocks_total``),
  ``eta_s``, ``stage_seconds``, ``queue_position``, ``error``;
- ``GET /v1/videos/{id}/content``: the mp4, once completed (only files in the server's
  ``videos/`` folder are ever served);
- ``DELETE /v1/videos/{id}``: cancel (a queued job is dropped, a running one stops at the next
  denoising step; the ranks stay up);
- ``GET /v1/videos/{id}/events``: the video object as server-sent events, whenever it changes,
  until the job ends;
- ``GET /health``: the server and its rank group (no token needed);
- ``GET /v1/server``: the server for the status page: model, mode and layout, LoRAs, uptime,
  the group's state, each rank's stage and memory, and the job fields with the server's defaults
  (the page's form is built from them);
- ``GET /v1/events``: the status page's feed as server-sent events: a snapshot (the server's
  state and the newest jobs), then only what changed (:mod:`.feed`, one read shared by every stream);
- ``GET /metrics``: Prometheus text format (:mod:`.metrics`);
- ``GET /``: the status page (:mod:`.page`: files shipped in the package, no CDN). The page itself
  is public; it asks for the token once and sends it with each request.

With a token every route but ``/health`` and the page wants ``Authorization: Bearer TOKEN``.
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Annotated, Any, Literal, Optional
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, Response
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from wan_s2v_runner.serve import page
from wan_s2v_runner.serve.dirs import keep_so_far
from wan_s2v_runner.serve.feed import Feed, FeedFailed, Ticket, settled
from wan_s2v_runner.serve.metrics import CONTENT_TYPE
from wan_s2v_runner.serve.progress import GroupState
from wan_s2v_runner.serve.protocol import (
    ErrorDetail,
    ErrorResponse,
    Health,
    ServerInfo,
    VideoDeleted,
    VideoList,
    VideoObject,
)
from wan_s2v_runner.serve.retention import space_refusal
from wan_s2v_runner.serve.state import Server, health, job_fields, server_state, video_object, video_objects
from wan_s2v_runner.serve.store.protocol import IdempotencyConflict, JobRow, JobStatus, QueueFull
from wan_s2v_runner.serve.store.rules import PAGE_MAX
from wan_s2v_runner.serve.submissions import (
    INPUT_NAMES,
    Refused,
    Upload,
    VideoJobFields,
    build_job,
    idempotency_key,
    new_id,
    request_hash,
    storage_refusal,
)

log = logging.getLogger("wan_s2v.serve")

#: what every guarded route may answer besides its own model (503: the queue or the shared directory is
#: unavailable, with the cause and a Retry-After)
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409,
                                                                                       413, 422, 429, 503, 507)}
#: what an event stream answers instead of its stream (before it starts): JSON, as every refusal (a
#: ``model`` would be documented in the stream's own media type)
_JSON_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
STREAM_ERRORS: dict[int | str, dict[str, Any]] = {
    **{code: {"description": "refused before the stream starts", "content": _JSON_ERROR} for code in ERRORS},
    404: {"description": "no such video", "content": _JSON_ERROR},
    429: {"description": "as many event streams are open as the server takes", "content": _JSON_ERROR}}


def the_server(request: Request) -> Server:
    return request.app.state.server


#: a route's server (FastAPI's dependency: the routes never hold it themselves)
ServerDep = Annotated[Server, Depends(the_server)]


def authorized(request: Request) -> None:
    token = the_server(request).token
    if token is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip().encode(), token.encode()):
        raise Refused(401, "missing or wrong token. Fix: send the header 'Authorization: Bearer TOKEN' "
                           "with the server's token")


def followed_job(video_id: str, request: Request) -> JobRow:
    """The job an event stream follows (404 before the stream starts)."""
    return job_row(the_server(request), video_id)


def job_row(server: Server, video_id: str) -> JobRow:
    row = server.queue.job_get(video_id)
    if row is None or row.deleting:  # deleted (a running one goes when its ranks stop it)
        raise Refused(404, f"no video {video_id!r} on this server. Fix: list them with GET /v1/videos", "video_id")
    return row


#: a submission's files: each input under each of its names (the multipart form takes no more)
UPLOAD_FIELDS = tuple(name for names in INPUT_NAMES.values() for name in names)
#: a JSON submission's largest body and deepest nesting (a job is a flat object of a few fields)
MAX_JSON_BYTES = 64 * 1024
MAX_JSON_DEPTH = 4


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, counted as it streams: never more than ``limit`` plus one chunk is held."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Refused(413, f"the body is over {limit // 1024} KiB. Fix: send the job's fields only (files as a "
                               "multipart form)")
    return bytes(body)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _json_body(raw: bytes) -> Any:
    """A JSON body: finite numbers only (``NaN``, ``Infinity`` refused), nested at most
    :data:`MAX_JSON_DEPTH` deep."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise Refused(400, f"the body is not JSON ({e}). Fix: send a JSON object or a multipart form") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise Refused(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels. Fix: send a flat JSON object "
                           "of the job's fields")
    return value


class BoundedMultiPart(MultiPartParser):
    """Starlette's multipart parser, counting each file as it streams: a file over
    ``max_file_bytes`` stops the parse before its next chunk is written (the server never holds
    more than the limit plus one chunk of it); what was spooled is closed (removed)."""

    def __init__(self, headers, stream, *, max_file_bytes: int, max_text_bytes: int = MAX_JSON_BYTES, **kw):
        super().__init__(headers, stream, max_part_size=max_text_bytes, **kw)
        self.max_file_bytes, self.max_text_bytes = max_file_bytes, max_text_bytes
        self.too_big: Optional[str] = None
        self.text_too_big = False
        self._sizes: dict[int, int] = {}
        self._text = 0

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._current_part
        if part.file is not None:
            size = self._sizes.get(id(part), 0) + end - start
            self._sizes[id(part)] = size
            if size > self.max_file_bytes:
                self.too_big = part.field_name
                raise MultiPartException(f"{part.field_name}: over {self.max_file_bytes} bytes")
        else:  # the text fields together: as much as a JSON body may hold
            self._text += end - start
            if self._text > self.max_text_bytes:
                self.text_too_big = True
                raise MultiPartException(f"the form's fields are over {self.max_text_bytes} bytes")
        super().on_part_data(data, start, end)


async def _form(request: Request, max_file_bytes: int):
    kind = request.headers.get("content-type", "")
    if kind.startswith("multipart/form-data"):
        parser = BoundedMultiPart(request.headers, request.stream(), max_file_bytes=max_file_bytes,
                                  max_files=len(UPLOAD_FIELDS),
                                  max_fields=64)
        try:
            return (await parser.parse()).multi_items()
        except MultiPartException as e:
            if parser.text_too_big or "maximum size" in str(e):
                raise Refused(413, f"the form's fields are over {MAX_JSON_BYTES // 1024} KiB together. Fix: send the "
                                   "job's fields only (files as file parts)") from None
            if parser.too_big:
                raise Refused(413, f"{parser.too_big}: the upload is over {max_file_bytes // 2**20} MB. Fix: send "
                                   "a smaller file (or start the server with a larger --max-upload-mb)",
                              parser.too_big) from None
            raise Refused(400, f"the form cannot be read ({e}). Fix: send multipart/form-data") from None
    body = await _read_body(request, MAX_JSON_BYTES)  # a urlencoded form: fields only, no files
    try:
        return parse_qsl(body.decode("utf-8"), keep_blank_values=True)
    except (UnicodeDecodeError, ValueError) as e:
        raise Refused(400, f"the form cannot be read ({e}). Fix: send multipart/form-data") from None


async def _fields(request: Request, max_file_bytes: int) -> dict[str, Any]:
    """The submission's fields: a multipart/urlencoded form (files as :class:`Upload`) or JSON."""
    kind = request.headers.get("content-type", "")
    if kind.startswith("application/json"):
        body = _json_body(await _read_body(request, MAX_JSON_BYTES))
        if not isinstance(body, dict):
            raise Refused(400, "the body is not a JSON object. Fix: send {\"prompt\": ..., \"image\": ..., ...}")
        return body
    out: dict[str, Any] = {}
    for key, value in await _form(request, max_file_bytes):
        if key in out:
            raise Refused(422, f"{key}: sent twice. Fix: send each field once", key)
        out[key] = Upload(value.filename or "", value.file) if isinstance(value, UploadFile) else value
    return out


def _ended(status: int, message: str) -> ServerSentEvent:
    """What an event stream says last when it cannot go on: a follower never waits on a stream that died."""
    body = ErrorResponse(error=ErrorDetail(message=message, type="stream_error", code=str(status)))
    return ServerSentEvent(data=body.model_dump(), event="error", id=str(time.time()))


def the_feed(request: Request) -> Feed:
    return request.app.state.feed


async def feed_room(request: Request):
    """A place among the feed's followers, taken before the stream starts (on the event loop: no
    two requests take the last place), or 429 there; given back when the request ends."""
    ticket = the_feed(request).reserve()
    try:
        yield ticket
    finally:
        ticket.release()


FeedDep = Annotated[Feed, Depends(the_feed)]
#: an event stream's place: refused before the stream starts when the streams open are at the limit
FollowDep = Annotated[Ticket, Depends(feed_room, scope="request")]


#: the page and /health: no token
public = APIRouter()
#: everything else: the token when the server has one
api = APIRouter(dependencies=[Depends(authorized)], responses=ERRORS)


@public.get("/health")
def get_health(server: ServerDep) -> Health:
    return health(server)


@public.get("/health/ready", responses={503: {"model": ErrorResponse, "description": "the server takes no job "
                                                                                    "now: the cause"}})
def get_ready(server: ServerDep) -> Health:
    """200 while the server takes jobs: its queue answers, its shared directory passes its check
    and a rank group can take a job (idle or working); else 503 with the cause: a load balancer's
    or Kubernetes' readiness check (no token needed, as /health). It never waits on the database."""
    why = server.watch.not_ready()
    if why is not None:
        raise Refused(503, f"{why}. Fix: wait; /health says since when", code="not_ready")
    state = health(server)
    if state.group not in (GroupState.IDLE, GroupState.WORKING):
        raise Refused(503, f"no rank group is ready (the server's groups: {state.group}). Fix: wait; /health "
                           "says what each group does", code="not_ready")
    return state


@public.get("/", include_in_schema=False)
def index() -> FileResponse:
    return FileResponse(page.INDEX, media_type="text/html")


@public.get("/static/{name}", include_in_schema=False)
def static(name: str) -> FileResponse:
    if name not in page.ASSETS:
        raise Refused(404, f"no page file {name!r}")
    return FileResponse(page.ROOT / name, media_type=page.ASSETS[name])


@api.get("/v1/server")
def server_info(server: ServerDep, feed: FeedDep) -> ServerInfo:
    return ServerInfo(**server_state(server).model_dump(), fields=job_fields(server), auth=server.token is not None,
                      max_upload_mb=server.policy.max_upload_bytes // 2**20, decode_slots=server.decode_slots,
                      decoding_peak=server.decoding_peak, followers=len(feed.followers), feed_reads=feed.reads)


@api.get("/metrics", responses={200: {"description": "Prometheus text format",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(server: ServerDep) -> Response:
    if server.metrics is None:
        raise Refused(404, "this server keeps no metrics")
    return Response(server.metrics.text(), media_type=CONTENT_TYPE)


@api.get("/v1/events", response_class=EventSourceResponse, responses=STREAM_ERRORS)
async def all_events(request: Request, ticket: FollowDep):
    """The status page's feed (:mod:`.feed`): ``event: snapshot`` first (the server and the newest
    jobs), then ``event: changes`` with only what changed (``server`` when it changed, the changed
    ``videos``, the ids ``gone`` from the newest jobs)."""
    feed = ticket.feed
    try:
        async with feed.follow(ticket=ticket) as follower:
            yield ServerSentEvent(data=feed.snapshot(), event="snapshot", id=str(feed.reads))
            while not await request.is_disconnected():
                changed = await follower.next(timeout=4 * feed.tick_s)
                if changed:
                    yield ServerSentEvent(data={"server": changed.server, "videos": list(changed.videos.values()),
                                                "gone": sorted(changed.gone)}, event="changes", id=str(feed.reads))
    except FeedFailed as e:
        yield _ended(503, str(e))


_FILE = {"type": "string", "format": "binary"}


def _form_field(prop: dict[str, Any]) -> dict[str, Any]:
    """A job field's JSON schema as a form field: a form has no null (a field left out is the default)."""
    kinds = [k for k in prop.get("anyOf", ()) if k.get("type") != "null"]
    if len(kinds) != 1:
        return prop
    return {**{k: v for k, v in prop.items() if k != "anyOf"}, **kinds[0]}


@api.post("/v1/videos", openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": {
    "type": "object",
    # the reference image (as image or input_reference) and the speech (audio, or tts_text to speak)
    "allOf": [{"anyOf": [{"required": ["image"]}, {"required": ["input_reference"]}]},
              {"anyOf": [{"required": ["audio"]}, {"required": ["tts_text"]}]}],
    "additionalProperties": False,
    "properties": {
        **{name: _form_field(prop) for name, prop in VideoJobFields.model_json_schema()["properties"].items()},
        **{name: {**_FILE, "description": f"{field}: the file (or, as a text field, its path on the server)"}
           for field, names in INPUT_NAMES.items() for name in names},
        "seconds": {"type": "string", "description": "the video's length, s (OpenAI's: as many clips as it takes; "
                                                     "or num_clips)"},
        "size": {"type": "string", "description": "= max_area, as WIDTHxHEIGHT (the image's aspect is kept)"},
        "model": {"type": "string", "description": "accepted and ignored (the server runs one model)"}}}}}}})
async def create(request: Request, server: ServerDep) -> VideoObject:
    """Queue a job (the form's or JSON's fields, checked: :mod:`.submissions`). A request sent again
    with the same ``Idempotency-Key`` gives the job the first one made."""
    key = idempotency_key(request.headers.get("idempotency-key"))
    why = server.watch.not_ready()  # the queue down or the shared directory failing: said before any upload
    if why is not None:
        raise Refused(503, f"the server takes no job now: {why}. Fix: retry later (another server of the fleet may "
                           "take it)", code="queue_unavailable" if server.watch.seen.queue_error else "not_ready",
                      retry_after=5)
    try:  # off the event loop: a shared directory that hangs hangs this request, not the server
        full = await run_in_threadpool(space_refusal, server.dirs.videos, server.settings.min_free_mb)
    except OSError as e:
        raise storage_refusal(e, "the job") from None
    if full:
        raise Refused(507, full)
    fields = await _fields(request, server.policy.max_upload_bytes)
    job_id = new_id()
    try:
        digest = await run_in_threadpool(request_hash, fields) if key else None
        async with request.app.state.decode_slots:  # a bounded number checked at once; the rest wait
            server.decoding += 1
            server.decoding_peak = max(server.decoding_peak, server.decoding)
            try:
                spec = await run_in_threadpool(build_job, fields, job_id=job_id, base=server.base,
                                               group=server.keeper.group_spec, videos=server.dirs.videos,
                                               uploads=server.dirs.uploads, policy=server.policy, facts=server.facts)
            finally:
                server.decoding -= 1
    finally:  # the spooled uploads (copied to uploads/ID/ when accepted)
        for value in fields.values():
            if isinstance(value, Upload):
                value.file.close()
    return await run_in_threadpool(_store_job, server, job_id, json.loads(spec.job.model_dump_json()), key, digest)


def _store_job(server: Server, job_id: str, spec: dict, key: Optional[str], digest: Optional[str]) -> VideoObject:
    """The checked job into the queue (its uploads are in ``uploads/ID/`` already)."""
    from wan_s2v_runner.serve.store.protocol import NotStorable, QueueUnavailable

    try:
        added = server.queue.job_insert(job_id, spec, server.settings.max_queue, idempotency_key=key,
                                        request_hash=digest)
    except QueueUnavailable:
        raise  # it may have landed: its uploads stay (a retry with the key finds the job; else retention sweeps them)
    except BaseException as e:  # not queued: what it wrote (its uploads) goes
        server.dirs.remove_job_files(job_id, video=False)
        if isinstance(e, QueueFull):
            raise Refused(429, f"the queue is full: {e}. Fix: retry when jobs have finished", retry_after=30) from None
        if isinstance(e, IdempotencyConflict):
            raise Refused(409, f"Idempotency-Key {key!r} was sent before with another request (video {e}). Fix: use "
                               "a new key for a new request", "Idempotency-Key") from None
        if isinstance(e, NotStorable):
            raise Refused(422, f"{e}. Fix: send text without NUL characters") from None
        raise
    if added.row.id != job_id:  # the same request again: the job the first made, and none of this one's files
        server.dirs.remove_job_files(job_id, video=False)
    return video_object(server, added.row)


@api.get("/v1/videos")
def list_videos(server: ServerDep, after: Optional[str] = None, limit: int = Query(20, ge=1, le=PAGE_MAX),
                order: Literal["asc", "desc"] = "desc") -> VideoList:
    """A page of videos, newest first unless ``order=asc``; the next page: ``after=`` its ``last_id``."""
    try:
        rows, more = server.queue.job_page(after, limit, order)
    except KeyError:
        raise Refused(404, f"no video {after!r} to list after. Fix: pass a last_id this server gave", "after") from None
    data = video_objects(server, rows)
    return VideoList(data=data, has_more=more, first_id=data[0].id if data else None,
                     last_id=data[-1].id if data else None)


@api.get("/v1/videos/{video_id}")
def get_video(video_id: str, server: ServerDep) -> VideoObject:
    return video_object(server, job_row(server, video_id))


@api.get("/v1/videos/{video_id}/content", response_class=FileResponse,
         responses={200: {"content": {"video/mp4": {}, "image/jpeg": {}},
                          "description": "the mp4; variant=partial: the video so far (while it runs, and after it "
                                         "was cancelled or failed); variant=thumbnail: the first frame (from the "
                                         "first clip on)"},
                    206: {"content": {"video/mp4": {}},
                          "description": "variant=partial with a Range header (bytes=START-[END]): that part of the "
                                         "video so far (it only grows at its end: a follower asks for what is new)"},
                    416: {"description": "variant=partial: the Range starts at or past what is playable now"}})
def content(video_id: str, server: ServerDep, request: Request,
            variant: Literal["video", "thumbnail", "spritesheet", "partial"] = "video") -> Response:
    row = job_row(server, video_id)
    if variant == "spritesheet":
        raise Refused(404, "this server makes no spritesheets. Fix: ask for variant=video, partial or thumbnail",
                      "variant")
    if variant == "partial":
        partial = server.dirs.so_far(row.id)
        if row.status in (JobStatus.QUEUED, JobStatus.COMPLETED) or partial is None:
            fix = ("ask for variant=video" if row.status is JobStatus.COMPLETED else
                   "wait for preview_clips in the video object (after the first clip of a job of more than one)")
            raise Refused(404, f"video {video_id} has no video so far ({row.status.value}). Fix: {fix}", "variant")
        return growing_file(partial, request.headers.get("range"))
    path = server.dirs.video(row.id)
    if variant == "thumbnail":
        thumb = server.dirs.thumbnail(row.id)
        if not thumb.is_file() and row.status is JobStatus.COMPLETED and path.is_file():
            from wan_s2v_runner.shared import media

            media.first_frame_jpeg(path, thumb)
        thumb = server.dirs.newest(row.id, thumb)
        if thumb is None:
            raise Refused(404 if row.status.terminal else 409,
                          f"video {video_id} has no first frame yet ({row.status.value}). Fix: ask again once its "
                          "first clip is made", "video_id")
        return FileResponse(thumb, media_type="image/jpeg", filename=thumb.name)
    if row.status is not JobStatus.COMPLETED:
        raise Refused(409, f"video {video_id} is {row.status.value}, not completed. Fix: wait for status "
                           "completed (GET /v1/videos/{id} or its /events), or ask for variant=partial", "video_id")
    if not path.is_file():
        raise Refused(404, f"video {video_id}'s file is gone from the server. Fix: submit the job again")
    return FileResponse(path, media_type="video/mp4", filename=path.name)


@api.post("/v1/videos/{video_id}/cancel")
def cancel(video_id: str, server: ServerDep) -> VideoObject:
    """Cancel: a queued job is dropped, a running one stops at its next denoising step (the ranks
    stay up); its record stays (status ``cancelled``)."""
    row = job_row(server, video_id)
    if row.status in (JobStatus.COMPLETED, JobStatus.FAILED):
        raise Refused(409, f"video {video_id} is already {row.status.value}. Fix: nothing to cancel", "video_id")
    status = server.queue.job_cancel(video_id)
    if status is JobStatus.IN_PROGRESS:
        server.cancel_running(video_id)
    elif row.status is JobStatus.QUEUED and status is JobStatus.CANCELLED:  # no rank group holds it now
        keep_so_far(server.dirs, video_id)  # an interrupted attempt's video so far stays
        server.dirs.remove_job_files(video_id, video=False)
    return video_object(server, job_row(server, video_id))


@api.delete("/v1/videos/{video_id}")
def delete(video_id: str, server: ServerDep) -> VideoDeleted:
    """Delete the video, its files and its record, as OpenAI's API does; a running job is
    cancelled first (at its next step) and removed when it stops."""
    job_row(server, video_id)
    status = server.queue.job_delete(video_id)
    if status is JobStatus.IN_PROGRESS:
        server.cancel_running(video_id)
    elif status is not None:
        server.dirs.remove_job_files(video_id, video=True)
    return VideoDeleted(id=video_id)


@api.get("/v1/videos/{video_id}/events", response_class=EventSourceResponse, responses=STREAM_ERRORS)
async def events(video_id: str, request: Request, row: Annotated[JobRow, Depends(followed_job)], ticket: FollowDep):
    """The video object whenever it changes (``event: video``), until the job ends."""
    feed = ticket.feed
    try:
        async with feed.follow(row.id, ticket=ticket) as follower:
            obj, last = feed.video(row.id), None
            while obj is not None:
                if settled(obj) != last:
                    last = settled(obj)
                    yield ServerSentEvent(data=obj, event="video", id=str(feed.reads))
                    if JobStatus(obj["status"]).terminal:
                        return
                if await request.is_disconnected():
                    return
                changed = await follower.next(timeout=4 * feed.tick_s)
                obj = None if row.id in changed.gone else changed.videos.get(row.id, obj)
    except FeedFailed as e:
        yield _ended(503, str(e))
        return
    yield _ended(404, f"video {row.id!r} was deleted. Fix: list the server's videos with GET /v1/videos")


def growing_file(path, range_header: Optional[str]) -> Response:
    """A growing video (the video so far) as far as it is playable now (its last complete
    fragment: :func:`~wan_s2v_runner.shared.fmp4.playable_length`; the writer appends while this
    is sent, so the length is fixed first and no more is read). ``Range: bytes=START-[END]`` gets
    206 and that part, so a follower fetches only what is new."""
    from starlette.responses import StreamingResponse

    from wan_s2v_runner.shared import fmp4

    size = fmp4.playable_length(path)
    start, end, status = 0, size, 200
    headers = {"accept-ranges": "bytes", "content-disposition": f'attachment; filename="{path.name}"'}
    if range_header:
        import re

        m = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
        if m is None or int(m.group(1)) >= size or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            return Response(status_code=416, headers={"content-range": f"bytes */{size}"})
        start, status = int(m.group(1)), 206
        end = min(size, int(m.group(2)) + 1) if m.group(2) else size
        headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
    headers["content-length"] = str(end - start)

    def chunks():
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                data = f.read(min(left, 1 << 20))
                if not data:
                    return
                left -= len(data)
                yield data

    return StreamingResponse(chunks(), status_code=status, media_type="video/mp4", headers=headers)
