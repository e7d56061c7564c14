"""``wan-s2v serve``'s FastAPI application: the routes (:mod:`.routes`) over the server's state
(:class:`~.state.Server`, kept in ``app.state``), every refusal as an OpenAI-style error body.

A server without a token trusts whoever can reach it, so it must not let a web page act for a
site: :class:`BrowserGuard` refuses (403) a request whose ``Host`` is a name the server was not
told it answers to (an IP address, ``localhost`` and ``--allow-host`` names pass: a DNS-rebinding
page reaches the server under its own domain name), and one a browser sends for another site
(an ``Origin`` that is not the server's own, or ``Sec-Fetch-Site: cross-site``: a cross-site form
POST needs no CORS preflight). curl, ``wan-s2v submit``, the OpenAI SDK and the status page
(same origin) send neither. With a token, the token is the check.

Cut as vLLM's entrypoints are: thin routes (:mod:`.routes`), typed protocol models
(:mod:`.protocol`), the views they return (:mod:`.state`), and the HTTP launcher apart
(:mod:`.listener`: socket, uvicorn, signals).
"""
from __future__ import annotations

import asyncio
import ipaddress
from typing import Optional
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from wan_s2v_runner.serve.feed import Feed
from wan_s2v_runner.serve.protocol import ErrorDetail, ErrorResponse
from wan_s2v_runner.serve.routes import api, public
from wan_s2v_runner.serve.session_routes import sessions_api
from wan_s2v_runner.serve.state import Server
from wan_s2v_runner.serve.store.protocol import QueueUnavailable, StoreRefused
from wan_s2v_runner.serve.submissions import Refused, scrub
from wan_s2v_runner.serve.whep_routes import whep_api

#: seconds a client is asked to wait before it tries again while the queue is unavailable
RETRY_AFTER_S = 5

#: the error ``type`` of each status (OpenAI's names)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
               503: "service_unavailable", 507: "insufficient_storage"}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   retry_after: Optional[int] = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"),
                                           param=param, code=code))
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def validation_message(errors) -> tuple[str, Optional[str]]:
    """FastAPI's validation errors (a query parameter, a path's) -> one line and the field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body", "header")]
    field = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{field or 'the request'}: {first.get('msg', 'not valid')}{more}. Fix: see GET /docs for what it "
            "takes"), field


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The documented methods of ``path``: its own route's where a route is that very path (e.g.
    ``/v1/videos/sessions``, which ``/v1/videos/{video_id}`` also matches), else those of every
    route whose template matches it."""
    paths = app.openapi()["paths"]
    if path in paths:
        return sorted(m.upper() for m in paths[path])
    methods: set[str] = set()
    for template, operations in paths.items():
        if compile_path(template)[0].match(path):
            methods |= {m.upper() for m in operations}
    return sorted(methods)


def _host_name(host: str) -> str:
    """``Host`` header -> the name without the port (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """ASGI middleware: without a token, refuse what a web page of another site sends (see the
    module's docstring). ``allow_hosts``: names the server answers to besides addresses and
    localhost."""

    def __init__(self, app, allow_hosts: tuple[str, ...] = ()):
        self.app = app
        self.allow_hosts = {h.strip().lower() for h in allow_hosts}

    def refusal(self, headers: dict[str, str]) -> Optional[str]:
        host = headers.get("host", "")
        name = _host_name(host)
        if not (name == "localhost" or _is_address(name) or name in self.allow_hosts):
            return (f"Host {host!r} is not a name this server answers to (a page of another site can reach a "
                    "server without a token under its own name). Fix: use the server's address, or start it "
                    f"with --allow-host {name or 'NAME'} (or a --token)")
        origin = headers.get("origin")
        if origin is not None and urlsplit(origin).netloc.lower() != host.strip().lower():
            return (f"a browser sent this for the page at {origin}, not this server's own. Fix: use the status "
                    "page at / or a client (curl, wan-s2v submit, the OpenAI SDK), or start the server with a --token")
        if headers.get("sec-fetch-site") == "cross-site":
            return ("a browser sent this for a page of another site. Fix: use the status page at / or a client, "
                    "or start the server with a --token")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        why = self.refusal(headers)
        if why is None:
            return await self.app(scope, receive, send)
        return await error_response(403, why, code="cross_site")(scope, receive, send)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="wan-s2v", summary="Wan2.2 S2V-14B: reference image + speech -> talking video",
                  version="0.1.0")
    app.state.server = server
    app.state.feed = Feed(server)
    app.state.decode_slots = asyncio.Semaphore(server.decode_slots if server is not None else 1)

    @app.exception_handler(Refused)
    async def refused(_request: Request, e: Refused) -> JSONResponse:
        message = scrub(e.message, server.roots if server is not None else ())
        return error_response(e.status, message, e.param, e.code, e.retry_after)

    @app.exception_handler(QueueUnavailable)
    async def queue_unavailable(_request: Request, e: QueueUnavailable) -> JSONResponse:
        # the watch decides whether the queue is down (a lock held a moment past its limit is not)
        return error_response(503, f"{e}. Fix: retry in a few seconds; /health says whether the queue is down",
                              code="queue_unavailable", retry_after=RETRY_AFTER_S)

    @app.exception_handler(StoreRefused)
    async def store_refused(_request: Request, e: StoreRefused) -> JSONResponse:
        return error_response(503, f"{e}. Fix: retry later; the server's log has the details",
                              code="queue_unavailable", retry_after=RETRY_AFTER_S)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(422, *validation_message(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 405:  # every method the path takes (Starlette names only one route's)
            allowed = allowed_methods(app, request.url.path)
            r = error_response(405, f"{request.method} is not a method of {request.url.path}. Fix: use "
                                    f"{' or '.join(allowed)}")
            r.headers["Allow"] = ", ".join(allowed)
            return r
        if e.status_code == 404:
            return error_response(404, f"no route {request.url.path!r}. Fix: see GET /docs for the routes")
        return error_response(e.status_code, str(e.detail))

    app.include_router(public)
    app.include_router(sessions_api)  # before /v1/videos/{video_id}'s routes: its paths are longer anyway
    app.include_router(whep_api)  # a session's WebRTC viewers (WHEP); its lifespan closes them
    app.include_router(api)
    if server is not None and server.token is None:
        app.add_middleware(BrowserGuard, allow_hosts=server.settings.allow_host)
    return app
