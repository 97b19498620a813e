"""The duplex socket on the ingress: which wire a `/v1/realtime` socket speaks, its slot
(queued, refused), its session, and everything freed when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import string
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from deployments.duplex.manager import DuplexManager, Refused
from deployments.duplex.official import OfficialConnection
from deployments.duplex.openai_shape import OpenAIConnection
from deployments.duplex.session import INTERNAL, POLICY, DuplexConnection, Ending

log = logging.getLogger(__name__)
_ID = string.ascii_letters + string.digits
# What each wire's clients offer as a subprotocol (the SDK: map.realtime; browsers using
# OpenAI's shape: realtime); accepting it is what lets their handshake succeed.
_SUBPROTOCOLS = ("map.realtime", "realtime")
_EARLY_EVENTS = 16  # client events read ahead of the session's handling of them


def duplex_wire(query: Any) -> str | None:
    """`official` for `?mode=audio|video`, `openai` for `?duplex=1`, None for the turn-based
    realtime API (everything else)."""
    if query.get("mode") is not None:
        return "official"
    if query.get("duplex") in ("1", "true"):
        return "openai"
    return None


def manager_for(server: Any) -> DuplexManager:
    """The replica's DuplexManager (`server.duplex`, made by the ingress)."""
    return server.duplex


def _subprotocol(ws: WebSocket) -> str | None:
    offered = [s.strip() for s in ws.headers.get("sec-websocket-protocol", "").split(",")]
    return next((p for p in _SUBPROTOCOLS if p in offered), None)


def _open(ws: WebSocket) -> bool:
    return (ws.client_state == WebSocketState.CONNECTED
            and ws.application_state == WebSocketState.CONNECTED)


async def serve_duplex(server: Any, ws: WebSocket, wire: str) -> None:
    """One duplex session on `server` (an IngressServer: `cfg`, `model_names`)."""
    manager = manager_for(server)
    await ws.accept(subprotocol=_subprotocol(ws))
    session_id = "sess_" + "".join(secrets.choice(_ID) for _ in range(20))
    cls = OfficialConnection if wire == "official" else OpenAIConnection
    mode = ws.query_params.get("mode", "audio")
    conn: DuplexConnection = cls(manager, session_id, ws.send_text,
                                 mode=mode if mode in ("audio", "video") else "audio",
                                 model=server.cfg.name, limits=server.cfg.limits)

    # One reader for the socket's whole life: a client that goes while it waits in the
    # queue leaves the queue at once (nothing else reads its socket then); what it sends
    # meanwhile waits here (a few events; past them the reader waits too: TCP's backpressure).
    inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue(maxsize=_EARLY_EVENTS)
    gone = asyncio.Event()

    async def read() -> None:
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                await inbox.put(msg.get("text") if msg.get("text") is not None
                                else msg.get("bytes"))
        except Exception:  # noqa: BLE001 - a broken socket is a gone client
            log.debug("duplex session %s: socket read failed", session_id, exc_info=True)
        finally:
            gone.set()
            with contextlib.suppress(asyncio.QueueFull):
                inbox.put_nowait(None)

    async def receive() -> str | bytes | None:
        if gone.is_set() and inbox.empty():
            return None
        return await inbox.get()

    async def queued(position: int, eta_s: float, length: int) -> None:
        conn.out.put(conn.queued_event(position, eta_s, length))

    async def session() -> Ending:
        async with manager.slot(session_id, queued):
            try:
                return await conn.run(receive)
            finally:  # the backend's session is gone before its slot goes to the queue
                await conn.stop()

    ending = Ending("client_gone")
    reader = asyncio.get_running_loop().create_task(read())
    try:
        model = ws.query_params.get("model")
        if mode not in ("audio", "video"):
            raise Refused("invalid_mode", f"mode must be 'audio' or 'video', got {mode!r}",
                          POLICY)
        if model is not None and model not in server.model_names:
            raise Refused("model_not_found", f"model {model!r} is not served here (this "
                          f"server serves {server.cfg.name!r})", POLICY)
        task = asyncio.ensure_future(session())
        left = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not conn.started:  # it went while queued
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                ending = await task
        finally:
            left.cancel()
            task.cancel()
    except Refused as e:
        ending = Ending(e.code, e.code, e.message, e.close_code)
    except WebSocketDisconnect:
        ending = Ending("client_gone")
    except Exception as e:  # a fault of ours: tell the client rather than go silent
        if _open(ws):
            log.exception("duplex session %s failed", session_id)
            ending = Ending("server_error", "server_error",
                            f"the session failed: {type(e).__name__}: {e}", INTERNAL)
    finally:
        reader.cancel()
        await conn.stop()
        await conn.finish(ending, _open(ws) and not gone.is_set())
        if ws.client_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.close(ending.close_code)
