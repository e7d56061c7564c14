"""``wan-s2v serve``: the HTTP API (FastAPI on uvicorn) over the queue and the resident rank group.

Routes, in the shape of OpenAI's video API (as vLLM-Omni and FastVideo serve it):

- ``POST /v1/videos`` (multipart form, or JSON with paths): a job -> its video object, ``queued``;
  refused with 4xx and ``{"error": {"message", "type", "param", "code"}}`` (:mod:`.requests`);
- ``GET /v1/videos``: every job (``{"object": "list", "data": [...]}``);
- ``GET /v1/videos/{id}``: the video object: ``status``, ``progress`` (percent), and ours:
  ``stage``, ``clip``/``clips``, ``step``/``steps``, ``eta_s``, ``stage_seconds``,
  ``queue_position``, ``error``;
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
- ``GET /v1/events``: the whole server (``/v1/server``'s state and every job) as server-sent
  events, whenever it changes;
- ``GET /metrics``: Prometheus text format (:mod:`.metrics`);
- ``GET /``: the status page (:mod:`.page`: files shipped in the package, no CDN). The page itself
  is public; it asks for the token once and sends it with each request.

With ``--token`` every route but ``/health`` wants ``Authorization: Bearer TOKEN``. The server
binds 127.0.0.1 unless told otherwise; another address needs ``--token`` or an explicit
``--insecure-no-auth``.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.datastructures import UploadFile

from wan_s2v_runner.launcher.serve import page
from wan_s2v_runner.launcher.serve.keeper import (
    GROUP_FILE,
    Keeper,
    ServerDirs,
    remove_partial_videos,
    wait_for_leftovers,
)
from wan_s2v_runner.launcher.serve.metrics import CONTENT_TYPE, ServerMetrics
from wan_s2v_runner.launcher.serve.queue import JobQueue, JobRow, JobStatus, QueueFull
from wan_s2v_runner.launcher.serve.requests import Policy, Refused, Upload, VideoJobFields, build_job, new_id
from wan_s2v_runner.shared import atomic, exit_codes
from wan_s2v_runner.shared.events import steps_done
from wan_s2v_runner.shared.spec import RunSpec

MODEL = "wan2.2-s2v-14b"
#: the file a started server writes in its directory: its URL and pid (clients and tests read it)
SERVER_FILE = "server.json"
#: how often the events stream looks for a change
EVENTS_POLL_S = 0.25
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: what /health (no token) tells of :func:`server_state` (not the ranks' hosts, not the LoRAs)
HEALTH_FIELDS = ("group", "restarts", "groups", "current", "last_error", "queue", "uptime_s", "model")


@dataclass
class Server:
    """Everything the routes use."""

    queue: JobQueue
    keeper: Keeper
    dirs: ServerDirs
    base: dict[str, Any]  # the command's values: the group's settings and each job's defaults
    policy: Policy
    max_queue: int
    token: Optional[str] = None
    facts: Any = None  # the machine's facts, probed once (preflight of each job)
    metrics: Optional[ServerMetrics] = None


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def percent(row: JobRow, live: Optional[dict]) -> int:
    if row.status is JobStatus.COMPLETED:
        return 100
    if not live or not live.get("steps") or not live.get("clips"):
        return 0
    return min(99, int(100 * steps_done(live) / (live["clips"] * live["steps"])))


def video_object(server: Server, row: JobRow) -> dict[str, Any]:
    live = server.keeper.live(row.id) if row.status is JobStatus.IN_PROGRESS else None
    record = row.record or {}
    spec = row.spec
    obj: dict[str, Any] = {
        "id": row.id, "object": "video", "model": MODEL, "status": row.status.value,
        "progress": percent(row, live), "created_at": int(row.created_at),
        "started_at": int(row.started_at) if row.started_at else None,
        "completed_at": int(row.finished_at) if row.finished_at and row.status is JobStatus.COMPLETED else None,
        "prompt": spec.get("prompt"), "seed": spec.get("seed"), "max_area": spec.get("max_area"),
        "queue_position": server.queue.position(row.id) if row.status is JobStatus.QUEUED else None,
        "stage": None, "clip": None, "clips": None, "step": None, "steps": None, "eta_s": None,
        "stage_seconds": record.get("stage_seconds"), "wall_s": record.get("wall_s"),
        "resumed_at_clip": record.get("resumed_at_clip"), "attempts": row.runs, "failures": row.failures,
        "cancel_requested": row.cancel_requested,
        "error": ({"code": row.status.value, "message": row.error}
                  if row.status in (JobStatus.FAILED, JobStatus.CANCELLED) and row.error else None),
    }
    if live:
        obj.update(live)
    if row.status is JobStatus.COMPLETED:
        obj["frames"] = record.get("frames")
        obj["sha256"] = (record.get("output") or {}).get("sha256")
    return obj


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def job_fields(server: Server) -> list[dict[str, Any]]:
    """The submission fields, in the spec's order, with their type, limits, choices, description
    and the server's default (what a job gets when it leaves the field out)."""
    schema = VideoJobFields.model_json_schema()
    defs = schema.get("$defs", {})
    out = []
    for name, prop in schema["properties"].items():
        kinds = [k for k in prop.get("anyOf", [prop]) if k.get("type") != "null"]
        kind = kinds[0] if kinds else {}
        if "$ref" in kind:
            kind = defs.get(kind["$ref"].rsplit("/", 1)[-1], {})
        # what a job that leaves the field out gets: the server's flag, else the spec's own default
        info = RunSpec.model_fields[name]
        default = server.base[name] if name in server.base else (None if info.is_required() else info.default)
        out.append({"name": name, "type": kind.get("type", "string"), "enum": kind.get("enum"),
                    "minimum": kind.get("minimum", kind.get("exclusiveMinimum")),
                    "maximum": kind.get("maximum"), "description": prop.get("description", ""),
                    "default": _jsonable(getattr(default, "value", default))})
    return out


def server_state(server: Server) -> dict[str, Any]:
    """What the status page shows of the server (changes as the group works)."""
    k, spec = server.keeper, server.keeper.group_spec
    layout = spec.layout
    return {"model": MODEL, "group": k.state.value, "restarts": k.restarts, "groups": k.groups,
            "current": k.current, "last_error": k.last_error, "uptime_s": round(time.time() - k.started_at, 1),
            "queue": server.queue.counts(), "ranks": k.ranks,
            "layout": {"mode": spec.mode.value, "world_size": spec.world_size, "nnodes": spec.nnodes,
                       "nproc": spec.nproc, "cfg_degree": layout.cfg_degree, "sp_degree": layout.sp_degree,
                       "vae_parallel": layout.vae_parallel, "device": spec.device,
                       "attention": getattr(spec.attention, "value", spec.attention)},
            "loras": [str(lora) for lora in spec.lora]}


def _settled(video: dict[str, Any]) -> dict[str, Any]:
    """A video object without what moves with the clock alone (a running job's stage seconds):
    an event stream sends a new one only when something else changed."""
    return {k: v for k, v in video.items() if k != "stage_seconds" or video["status"] != "in_progress"}


async def _changes(request: Request, read, view, every_s: float):
    """``read()`` (on a worker thread: it queries SQLite) every ``every_s`` while the client is
    connected, yielding it whenever ``view`` of it changed."""
    from starlette.concurrency import run_in_threadpool

    last = None
    while not await request.is_disconnected():
        now = await run_in_threadpool(read)
        seen = view(now)
        if seen != last:
            last = seen
            yield now
        await asyncio.sleep(every_s)


async def _fields(request: Request) -> dict[str, Any]:
    """The submission's fields: a multipart/urlencoded form (files as :class:`Upload`) or JSON."""
    kind = request.headers.get("content-type", "")
    if kind.startswith("application/json"):
        try:
            body = await request.json()
        except ValueError as e:
            raise Refused(400, f"the body is not JSON ({e}). Fix: send a JSON object or a multipart form") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body is not a JSON object. Fix: send {\"prompt\": ..., \"image\": ..., ...}")
        return body
    try:
        form = await request.form(max_files=4, max_fields=64)
    except Exception as e:  # starlette's own refusal of a malformed form
        raise Refused(400, f"the form cannot be read ({e}). Fix: send multipart/form-data") from None
    out: dict[str, Any] = {}
    for key, value in form.multi_items():
        if key in out:
            raise Refused(422, f"{key}: sent twice. Fix: send each field once", key)
        out[key] = Upload(value.filename or "", value.file) if isinstance(value, UploadFile) else value
    return out


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="wan-s2v", summary="Wan2.2 S2V-14B: reference image + speech -> talking video",
                  version="0.1.0")

    @app.exception_handler(Refused)
    async def refused(_request: Request, e: Refused) -> JSONResponse:
        return _error(e.status, e.message, e.param)

    def authorized(request: Request) -> None:
        if server.token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip().encode(), server.token.encode()):
            raise Refused(401, "missing or wrong token. Fix: send the header 'Authorization: Bearer TOKEN' "
                               "with the server's --token")

    def job(video_id: str) -> JobRow:
        row = server.queue.get(video_id)
        if row is None:
            raise Refused(404, f"no video {video_id!r} on this server. Fix: list them with GET /v1/videos",
                          "video_id")
        return row

    guarded = [Depends(authorized)]

    @app.get("/health")
    def health() -> dict[str, Any]:
        state = server_state(server)
        layout = state["layout"]
        return {"status": "ok", **{k: state[k] for k in HEALTH_FIELDS},
                "mode": layout["mode"], "world_size": layout["world_size"], "cfg_parallel": layout["cfg_degree"] == 2,
                "device": layout["device"]}

    @app.get("/v1/server", dependencies=guarded)
    def server_info() -> dict[str, Any]:
        return {**server_state(server), "fields": job_fields(server), "auth": server.token is not None,
                "max_upload_mb": server.policy.max_upload_bytes // 2**20}

    @app.get("/metrics", dependencies=guarded)
    def metrics() -> Response:
        if server.metrics is None:
            raise Refused(404, "this server keeps no metrics")
        return Response(server.metrics.text(), media_type=CONTENT_TYPE)

    def snapshot() -> dict[str, Any]:
        return {"server": server_state(server), "videos": [video_object(server, row) for row in server.queue.all()]}

    @app.get("/v1/events", dependencies=guarded, response_class=EventSourceResponse)
    async def all_events(request: Request):
        """The server and every job, whenever any of it changes (the status page's feed)."""
        def view(now: dict) -> dict:
            return {"server": {k: v for k, v in now["server"].items() if k != "uptime_s"},
                    "videos": [_settled(o) for o in now["videos"]]}

        async for now in _changes(request, snapshot, view, EVENTS_POLL_S * 2):
            yield ServerSentEvent(data=now, event="server", id=str(time.time()))

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(page.INDEX, media_type="text/html")

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> FileResponse:
        if name not in page.ASSETS:
            raise Refused(404, f"no page file {name!r}")
        return FileResponse(page.ROOT / name, media_type=page.ASSETS[name])

    @app.post("/v1/videos", dependencies=guarded,
              openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": {
                  "type": "object", "properties": {
                      "image": {"type": "string", "format": "binary", "description": "reference image (or its path)"},
                      "input_reference": {"type": "string", "format": "binary", "description": "= image"},
                      "audio": {"type": "string", "format": "binary", "description": "speech audio (or its path)"},
                      "pose_video": {"type": "string", "format": "binary", "description": "pose video (or its path)"},
                      "tts_prompt_audio": {"type": "string", "format": "binary",
                                           "description": "voice prompt for tts_text (or its path)"},
                      **VideoJobFields.model_json_schema()["properties"]}}}}}})
    async def create(request: Request) -> dict[str, Any]:
        from starlette.concurrency import run_in_threadpool

        fields = await _fields(request)
        job_id = new_id()
        spec = await run_in_threadpool(build_job, fields, job_id=job_id, base=server.base,
                                       videos=server.dirs.videos, uploads=server.dirs.uploads,
                                       policy=server.policy, facts=server.facts)
        try:
            server.queue.add(job_id, json.loads(spec.model_dump_json()), server.max_queue)
        except QueueFull as e:
            raise Refused(429, f"the queue is full: {e}. Fix: retry when jobs have finished") from None
        return video_object(server, server.queue.get(job_id))

    @app.get("/v1/videos", dependencies=guarded)
    def list_videos() -> dict[str, Any]:
        return {"object": "list", "data": [video_object(server, row) for row in server.queue.all()]}

    @app.get("/v1/videos/{video_id}", dependencies=guarded)
    def get_video(video_id: str) -> dict[str, Any]:
        return video_object(server, job(video_id))

    @app.get("/v1/videos/{video_id}/content", dependencies=guarded)
    def content(video_id: str) -> FileResponse:
        row = job(video_id)
        if row.status is not JobStatus.COMPLETED:
            raise Refused(409, f"video {video_id} is {row.status.value}, not completed. Fix: wait for status "
                               "completed (GET /v1/videos/{id} or its /events)", "video_id")
        videos = server.dirs.videos.resolve()
        path = (videos / f"{row.id}.mp4").resolve()
        if path.parent != videos or not path.is_file():
            raise Refused(404, f"video {video_id}'s file is gone from the server. Fix: submit the job again")
        return FileResponse(path, media_type="video/mp4", filename=f"{row.id}.mp4")

    @app.delete("/v1/videos/{video_id}", dependencies=guarded)
    def cancel(video_id: str) -> dict[str, Any]:
        row = job(video_id)
        if row.status in (JobStatus.COMPLETED, JobStatus.FAILED):
            raise Refused(409, f"video {video_id} is already {row.status.value}. Fix: nothing to cancel",
                          "video_id")
        status = server.queue.cancel(video_id)
        if status is JobStatus.IN_PROGRESS:
            server.keeper.cancel_running(video_id)
        return video_object(server, job(video_id))

    @app.get("/v1/videos/{video_id}/events", dependencies=guarded, response_class=EventSourceResponse)
    async def events(video_id: str, request: Request):
        job(video_id)  # 404 before the stream starts
        async for obj in _changes(request, lambda: video_object(server, job(video_id)), _settled, EVENTS_POLL_S):
            yield ServerSentEvent(data=obj, event="video", id=str(time.time()))
            if JobStatus(obj["status"]).terminal:
                return

    return app


# --------------------------------------------------------------------------- the command
def check_bind(host: str, token: Optional[str], insecure: bool) -> Optional[str]:
    """Why the server must not start with this address and auth (None: it may)."""
    if host in LOOPBACK or token or insecure:
        return None
    return (f"--host {host} exposes the server beyond this machine with no auth. Fix: add --token TOKEN "
            "(clients send 'Authorization: Bearer TOKEN'), or --insecure-no-auth if the network is yours alone")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_server(server: Server, host: str, port: int) -> int:
    """Serve until SIGINT/SIGTERM: the keeper's group in the background, uvicorn in front; then
    stop the group and make sure nothing of it is left running."""
    import uvicorn

    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}"
    remove_partial_videos(server.dirs.videos)
    recovered = server.queue.recover()
    if recovered:
        print(f"serve: {len(recovered)} job(s) were in progress when the server stopped; they resume first: "
              f"{', '.join(recovered)}", flush=True)
    # uvicorn handles SIGINT/SIGTERM while it runs and, once it has shut down, restores the
    # handlers it found and raises the signal again: with the default SIGTERM handler that would
    # end this process before the rank group is stopped (a torchrun left behind). So the handlers
    # it finds are ours: stop the start-up before uvicorn runs, nothing after it.
    uvicorn_running = threading.Event()

    def on_signal(sig: int, _frame) -> None:
        if not uvicorn_running.is_set():
            raise SystemExit(exit_codes.INTERRUPTED)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.keeper.start()
        atomic.write_text(server.dirs.root / SERVER_FILE, json.dumps({"url": url, "pid": os.getpid()}))
        print(f"serve: {url} (POST /v1/videos, GET /health); server directory {server.dirs.root}", flush=True)
        config = uvicorn.Config(create_app(server), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        uvicorn_running.set()
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        print("serve: stopping the rank group (a job in progress resumes when the server starts again)",
              file=sys.stderr, flush=True)
        if server.keeper.is_alive():
            server.keeper.shutdown()
        left = wait_for_leftovers(server.dirs.root / GROUP_FILE, grace_s=5.0)
        if left:
            print(f"serve: stopped what the rank group left running (pids {', '.join(map(str, left))})",
                  file=sys.stderr, flush=True)
        (server.dirs.root / SERVER_FILE).unlink(missing_ok=True)
        server.queue.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
