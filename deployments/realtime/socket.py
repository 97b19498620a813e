"""`WS /v1/realtime` on the ingress: accept the socket, bound the sessions, run one
RealtimeSession over it, and free everything when it ends (Ray Serve's proxy forwards the
socket to the ingress replica that holds the session for its whole life).

Sessions are bounded per replica (`realtime.max_sessions`), per client address (at most
half of them, so one client cannot hold them all) and by the replica's history budget (a
new session is refused while the budget is spent)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from deployments.ingress.voices import without_paths
from deployments.realtime import protocol as p
from deployments.realtime.outbound import SLOW_READER_CLOSE, within
from deployments.realtime.session import (
    HISTORY_BUDGET_BYTES,
    HistoryBudget,
    RealtimeSession,
    SessionLimits,
)
from deployments.wire import error_line

log = logging.getLogger(__name__)

# Close codes (RFC 6455): policy violation for a wrong model, internal error for a fault of
# ours, try again later when full.
_POLICY, _INTERNAL, _TRY_LATER = 1008, 1011, 1013
CLOSE_TIMEOUT_S = 5.0


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


def client_limit(max_sessions: int) -> int:
    """Sessions one client address may hold on a replica: half of them, rounded up."""
    return max(1, -(-max_sessions // 2))


def _client(ws: WebSocket) -> str:
    return ws.client.host if ws.client is not None else ""


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
    client = _client(ws)
    mine = sum(1 for s in server.realtime_sessions.values()
               if getattr(s, "client", None) == client)
    if mine >= client_limit(cfg.max_sessions):
        await _refuse(
            ws,
            "session_limit_reached",
            f"this client already holds {mine} realtime sessions on this replica, the most "
            "one client may; close one first",
            _TRY_LATER,
        )
        return
    history = HistoryBudget(HISTORY_BUDGET_BYTES, server.realtime_sessions)
    if history.used() >= history.limit:
        await _refuse(
            ws,
            "session_limit_reached",
            "this replica's realtime sessions hold all the conversation history it keeps; "
            "try again later",
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
            server.chat, ws.send_text, model=server.cfg.name, beta=beta, limits=limits,
            history=history,
        )
    except Exception as e:  # e.g. the server VAD's model cannot be loaded on this host
        log.exception("realtime session could not start")
        await _refuse(ws, "server_error",
                      f"the session could not start: {without_paths(error_line(e))}",
                      _INTERNAL, kind="server_error")
        return

    async def receive() -> str | bytes | None:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return None
        return msg.get("text") if msg.get("text") is not None else msg.get("bytes")

    session.client = client
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
                await within(_refuse(ws, "server_error",
                                     f"the session failed: {without_paths(error_line(e))}",
                                     _INTERNAL, kind="server_error"), CLOSE_TIMEOUT_S)
    finally:
        await session.close()
        server.realtime_sessions.pop(session.id, None)
        server.metrics.realtime_sessions(len(server.realtime_sessions))
        if ws.client_state == WebSocketState.CONNECTED:
            code, reason = 1000, ""
            if session.outbox.slow:  # no error event: the client is not reading them
                code, reason = SLOW_READER_CLOSE, session.outbox.stopped or ""
                log.info("realtime session %s closed: %s", session.id, reason)
            # A client that does not read may not take the close frame either.
            closed = await within(ws.close(code, reason[:120]), CLOSE_TIMEOUT_S)
            if closed is None or closed.cancelled() or closed.exception() is not None:
                log.debug("realtime session %s: close did not complete (already closing, "
                          "or the client does not read)", session.id)
