"""FastAPI routes of the ingress. Every refusal is an OpenAI-shaped error with a 4xx:
malformed JSON, schema violations, unknown routes and methods included; nothing a client
sends can produce a 500 or leave the connection hanging. Bodies are bounded before they
are read in full (`limits.max_body_bytes`) and JSON nesting before it is parsed
(`limits.max_json_depth`); every refusal is counted in the app's metrics.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.ingress.formats import error_body
from deployments.ingress.schemas import ApiError
from deployments.ingress.window import QueueFull
from deployments.ingress.voices import max_upload_bytes

_ESCAPE = re.compile(rb"\\.", re.S)  # a backslash escape inside a JSON string
_STRING = re.compile(rb'"[^"]*"')  # a JSON string once escapes are gone
_DEPTH_CHUNK = 1 << 24


def json_depth(body: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text, without parsing it: strings are cut
    out (escapes first, so an escaped quote cannot end one), then the brackets' running sum.
    Linear and in C (regex, numpy), in pieces so a huge body needs little memory."""
    rest = _STRING.sub(b"", _ESCAPE.sub(b"", body))
    depth = deepest = 0
    for i in range(0, len(rest), _DEPTH_CHUNK):
        b = np.frombuffer(rest[i:i + _DEPTH_CHUNK], dtype=np.uint8)
        step = ((b == 0x5B) | (b == 0x7B)).astype(np.int64) - ((b == 0x5D) | (b == 0x7D))
        if step.size:
            run = np.cumsum(step) + depth
            deepest = max(deepest, int(run.max()))
            depth = int(run[-1])
    return deepest


def _json_type(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind in ("", "application/json", "text/plain") or kind.endswith("+json")


async def read_body(request: Request, limit: int, *, json_body: bool = True) -> bytes:
    """The request body, refused with a 413 as soon as it passes `limit` bytes (a declared
    Content-Length over it is refused before anything is read). `json_body`: a body sent as
    a form (or any other non-JSON type) that is not JSON text is refused with a 415 that
    says what is expected (curl's `-d` labels JSON as a form, so JSON text passes)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes, over the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # Starlette's cache: form() and json() read it from here
    kind = request.headers.get("content-type", "")
    if json_body and not _json_type(kind) and body.lstrip()[:1] not in (b"{", b"["):
        raise ApiError(415, f"request body must be JSON (Content-Type: application/json), "
                            f"not {kind.split(';', 1)[0][:80]}", code="unsupported_media_type")
    return body


def parse_json(body: bytes, max_depth: int) -> Any:
    if json_depth(body) > max_depth:
        raise ApiError(400, f"request body nests deeper than {max_depth} levels")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError: decoding, and ints > 4300 digits
        raise ApiError(400, f"request body is not valid JSON: {str(e)[:200]}") from None


def _error(status: int, message: str, code: Any = None, param: str | None = None) -> JSONResponse:
    body = error_body(status, message, code)
    body["error"]["param"] = param
    return JSONResponse(body, status_code=status)


def build_routes(server: Any) -> FastAPI:
    app = FastAPI(title="omniray", docs_url=None, redoc_url=None)
    limits = server.cfg.limits

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        if e.status < 500:
            server.refused(e)
        return _error(e.status, e.message, e.code, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        server.refused(ApiError(e.status_code, str(e.detail)))
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        server.refused(ApiError(400, "invalid request"))
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

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return server.model_card(model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        obj = parse_json(await read_body(request, limits.max_body_bytes), limits.max_json_depth)
        req = server.parse(obj)
        try:  # a full queue answers before the request's media is decoded
            server.turns.check_admission(req.speech)
        except QueueFull as e:
            server.refused(ApiError(503, str(e), code="queue_full"))
            return JSONResponse(error_body(503, f"server busy: {e}", "queue_full"), 503,
                                headers={"Retry-After": str(e.retry_after_s)})
        turn = await server.prepare(req)
        if req.stream:
            return StreamingResponse(server.sse(req, turn), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Request-Id": turn.request_id})
        status, payload = await server.complete(req, turn)
        headers = None
        if status == 503 and (payload.get("error") or {}).get("code") == "queue_full":
            wait = server.turns.likely_group(req.speech).window.retry_after_s()
            headers = {"Retry-After": str(wait)}  # filled between the check and its turn
        return JSONResponse(payload, status_code=status, headers=headers)

    # -- realtime (OpenAI's Realtime API over a WebSocket, and the page that talks to it) ----

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        from deployments.realtime.socket import serve_websocket

        await serve_websocket(server, ws)

    @app.get("/realtime")
    async def realtime_page() -> HTMLResponse:
        from deployments.realtime.socket import page

        return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})

    # -- stored voices (OpenAI's custom voices: client.audio.voices.create / delete) --------

    @app.post("/v1/audio/voices")
    async def create_voice(request: Request) -> dict[str, Any]:
        # bounded by what a clip of max_ref_audio_seconds needs, before it is read or parsed
        limit = min(limits.max_body_bytes, max_upload_bytes(limits.max_ref_audio_seconds))
        body = await read_body(request, limit, json_body=False)
        name, audio, consent = await _voice_upload(request, body, server)
        info = await server.add_voice(name, audio, consent)
        return info.as_openai()

    @app.get("/v1/audio/voices")
    async def list_voices() -> dict[str, Any]:
        return {"object": "list", "data": [v.as_openai() for v in server.voices.list()]}

    @app.get("/v1/audio/voices/{voice_id}")
    async def get_voice(voice_id: str) -> dict[str, Any]:
        try:
            info, _ = server.voices.get(voice_id)
        except ApiError as e:
            raise ApiError(e.status, e.message, param="voice_id", code=e.code) from None
        return info.as_openai()

    @app.delete("/v1/audio/voices/{voice_id}")
    async def delete_voice(voice_id: str) -> dict[str, Any]:
        return (await server.delete_voice(voice_id)).as_openai_deleted()

    return app


async def _voice_upload(request: Request, body: bytes, server: Any) -> tuple[str, bytes, Any]:
    """(name, audio bytes, consent) from multipart form data (what the openai SDK sends:
    `name`, `audio_sample` file, `consent`) or JSON (`audio_sample` as base64 or a data:
    URI)."""
    from deployments.ingress.media import b64decode

    limits = server.cfg.limits
    kind = request.headers.get("content-type", "")
    if (not kind.startswith("multipart/form-data") and not _json_type(kind)
            and body.lstrip()[:1] != b"{"):
        raise ApiError(415, "a voice upload is multipart/form-data (name, audio_sample, "
                            f"consent) or JSON, not {kind.split(';', 1)[0][:80]}",
                       code="unsupported_media_type")
    if kind.startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=1, max_fields=16,
                                      max_part_size=limits.max_body_bytes)
        except Exception as e:  # noqa: BLE001 - a malformed form is the client's error
            raise ApiError(400, f"malformed multipart form: {e}") from None
        sample = form.get("audio_sample")
        if sample is None or isinstance(sample, str):
            raise ApiError(400, "audio_sample: a file part is required", param="audio_sample")
        audio = await sample.read()
        name, consent = form.get("name"), form.get("consent")
    else:
        obj = parse_json(body, limits.max_json_depth)
        if not isinstance(obj, dict):
            raise ApiError(400, "request body must be a JSON object")
        name, consent, sample = obj.get("name"), obj.get("consent"), obj.get("audio_sample")
        if not isinstance(sample, str) or not sample:
            raise ApiError(400, "audio_sample: base64 audio or a data: URI is required",
                           param="audio_sample")
        if sample.startswith("data:"):
            audio = server.media.load(sample, "audio_sample")
        else:
            audio = b64decode(sample, "audio_sample")
    if not isinstance(name, str):
        raise ApiError(400, "name: a voice name is required", param="name")
    if consent is not None and not isinstance(consent, str):
        raise ApiError(400, "consent must be a string", param="consent")
    return name, audio, consent
