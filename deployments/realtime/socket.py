"""`WS /v1/realtime` on the ingress: accept the socket, bound the sessions, run one
RealtimeSession over it, and free everything when it ends (Ray Serve's proxy forwards the
socket to the ingress replica that holds the session for its whole life)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from deployments.realtime import protocol as p
from deployments.realtime.session import RealtimeSession, SessionLimits
from deployments.wire import error_line

log = logging.getLogger(__name__)

# Close codes (RFC 6455): policy violation for a wrong model, internal error for a fault of
# ours, try again later when full.
_POLICY, _INTERNAL, _TRY_LATER = 1008, 1011, 1013


@functools.cache
def page() -> str:
    return (Path(__file__).with_name("page.html")).read_text(encoding="utf-8")


def _subprotocol(ws: WebSocket) -> str | None:
    # Browsers cannot set headers, so OpenAI's browser clients name "realtime" (and their
    # key) as subprotocols; accepting one of those is what lets the handshake succeed.
    offered = [s.strip() for s in ws.headers.get("sec-websocket-protocol", "").split(",")]
    return "realtime" if "realtime" in offered else None


def _open(ws: WebSocket) -> bool:
    return (ws.client_state == WebSocketState.CONNECTED
            and ws.application_state == WebSocketState.CONNECTED)


async def _refuse(ws: WebSocket, code: str, message: str, close_code: int,
                  kind: str = "invalid_request_error") -> None:
    await ws.send_text(json.dumps(p.error(code, message, kind=kind)))
    await ws.close(close_code)


async def serve_websocket(server: Any, ws: WebSocket) -> None:
    """One session on `server` (an IngressServer: `chat`, `cfg`, `model_names`,
    `realtime_sessions`, `metrics`)."""
    from deployments.duplex.socket import duplex_wire, serve_duplex

    if (wire := duplex_wire(ws.query_params)) is not None:  # ?mode=audio|video, ?duplex=1
        await serve_duplex(server, ws, wire)
        return
    cfg = server.cfg.realtime
    await ws.accept(subprotocol=_subprotocol(ws))
    model = ws.query_params.get("model")
    if model is not None and model not in server.model_names:
        await _refuse(
            ws,
            "model_not_found",
            f"model {model!r} is not served here (this server serves {server.cfg.name!r})",
            _POLICY,
        )
        return
    if len(server.realtime_sessions) >= cfg.max_sessions:
        await _refuse(
            ws,
            "session_limit_reached",
            f"this replica already holds {cfg.max_sessions} realtime sessions; try again later",
            _TRY_LATER,
        )
        return
    beta = "realtime=v1" in ws.headers.get("openai-beta", "").replace(" ", "")
    limits = SessionLimits(
        max_event_bytes=cfg.max_event_bytes,
        max_buffer_s=cfg.max_buffer_s,
        max_items=cfg.max_items,
        idle_timeout_s=cfg.idle_timeout_s,
    )
    try:
        session = RealtimeSession(
            server.chat, ws.send_text, model=server.cfg.name, beta=beta, limits=limits
        )
    except Exception as e:  # e.g. the server VAD's model cannot be loaded on this host
        log.exception("realtime session could not start")
        await _refuse(ws, "server_error", f"the session could not start: {error_line(e)}",
                      _INTERNAL, kind="server_error")
        return

    async def receive() -> str | bytes | None:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return None
        return msg.get("text") if msg.get("text") is not None else msg.get("bytes")

    server.realtime_sessions[session.id] = session
    server.metrics.realtime_sessions(len(server.realtime_sessions))
    try:
        await session.run(receive)
    except Exception as e:
        if isinstance(e, WebSocketDisconnect) or not _open(ws):  # the client went away
            log.info("realtime session %s: socket closed (%s)", session.id, type(e).__name__)
        else:
            # A fault of ours while handling an event: tell the client and close, rather
            # than leave the socket open and silent until the client gives up.
            log.exception("realtime session %s failed", session.id)
            with contextlib.suppress(Exception):
                await _refuse(ws, "server_error", f"the session failed: {error_line(e)}",
                              _INTERNAL, kind="server_error")
    finally:
        await session.close()
        server.realtime_sessions.pop(session.id, None)
        server.metrics.realtime_sessions(len(server.realtime_sessions))
        if ws.client_state == WebSocketState.CONNECTED:
            try:
                await ws.close()
            except Exception:  # already closing
                log.debug("realtime session %s: close failed", session.id, exc_info=True)
