"""FastAPI routes of the ingress. Every refusal is an OpenAI-shaped error with a 4xx:
malformed JSON, schema violations, unknown routes and methods included; nothing a client
sends can produce a 500 or leave the connection hanging.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.formats import error_body
from deployments.schemas import ApiError


def _error(status: int, message: str, code: Any = None, param: str | None = None) -> JSONResponse:
    body = error_body(status, message, code)
    body["error"]["param"] = param
    return JSONResponse(body, status_code=status)


def build_routes(server: Any) -> FastAPI:
    app = FastAPI(title="omniray", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.message, e.code, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, str(e.errors()[:1]))

    @app.exception_handler(Exception)
    async def _server_error(_: Request, e: Exception) -> JSONResponse:
        # A bug, not the client's fault: still the OpenAI shape, never a bare 500 page.
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        limit = server.cfg.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes, over the limit of {limit}")
        body = await request.body()
        if len(body) > limit:
            raise ApiError(413, f"request body is {len(body)} bytes, over the limit of {limit}")
        try:
            obj = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        req = server.parse(obj)
        turn = await server.prepare(req)
        if req.stream:
            return StreamingResponse(server.sse(req, turn), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Request-Id": turn.request_id})
        status, payload = await server.complete(req, turn)
        return JSONResponse(payload, status_code=status)

    return app
