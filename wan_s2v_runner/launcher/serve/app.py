"""``wan-s2v serve``'s FastAPI application: the routes (:mod:`.routes`) over the server's state
(:class:`~.state.Server`, kept in ``app.state``), every refusal as an OpenAI-style error body.

Cut as vLLM's entrypoints are: thin routes (:mod:`.routes`), typed protocol models
(:mod:`.protocol`), the views they return (:mod:`.state`), and the HTTP launcher apart
(:mod:`.http`: socket, uvicorn, signals).
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from wan_s2v_runner.launcher.serve.protocol import ErrorDetail, ErrorResponse
from wan_s2v_runner.launcher.serve.requests import Refused
from wan_s2v_runner.launcher.serve.routes import api, public
from wan_s2v_runner.launcher.serve.state import Server

#: the error ``type`` of each status (OpenAI's names)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"),
                                           param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="wan-s2v", summary="Wan2.2 S2V-14B: reference image + speech -> talking video",
                  version="0.1.0")
    app.state.server = server

    @app.exception_handler(Refused)
    async def refused(_request: Request, e: Refused) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    app.include_router(public)
    app.include_router(api)
    return app
