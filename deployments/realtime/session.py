"""One realtime session: the OpenAI Realtime API's conversation over one WebSocket.

    client events ──> handle() ──> conversation items, the input audio buffer, server VAD
                                   └─> a response: one chat turn of the ingress (all three
                                       stages), its events mapped to the API's
    server events <── send()  <──  session loop and the response task (one at a time)

The session lives in the ingress replica that accepted the socket. A committed turn runs
the ingress's own `chat` with the conversation as its messages (the Thinker's prefix cache
makes the history cheap). At most one response runs at a time; cancelling it (the client's
`response.cancel`, or server VAD hearing speech while it plays) closes the chat turn, which
aborts all three stages, and ends the response with exactly one `response.done`.

Everything is bounded: one event's size, the input buffer's seconds, the conversation's
items, and the replica's history (`HistoryBudget`); past a bound the client gets an `error`
event and the session goes on. Server events wait in the session's Outbox, bounded in bytes:
a client that stops reading has its audio deltas merged, then the session ends (outbound.py).
The socket's end (or the idle timeout) cancels the response and drops everything the
session held.

Deleting or truncating the item a response is writing cancels that response first (its one
`response.done`, status cancelled, goes out before the deletion or truncation), as OpenAI's
server does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from deployments.ingress.media import float_to_int16, pcm16_to_wav
from deployments.realtime import protocol as p
from deployments.realtime.listener import Listener, SpeechStarted
from deployments.realtime.outbound import Outbox, dumps
from deployments.wire import AudioChunk, Done, Error, TextDelta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionLimits:
    max_event_bytes: int = 4 << 20
    max_buffer_s: float = 120.0
    max_items: int = 256
    idle_timeout_s: float = 600.0


# A session whose client has sent no audio yet holds a slot without using what it is for:
# it idles out sooner (the configured timeout applies once audio came).
NO_AUDIO_IDLE_TIMEOUT_S = 60.0
# Conversation history (input audio and text of every session's items) one ingress replica
# holds; past it new items are refused with `history_budget_exceeded` until some are deleted
# or sessions end. Each session's own bounds (items, event size) still apply below it.
HISTORY_BUDGET_BYTES = 1 << 30
# A client event larger than this is parsed (JSON, base64) in a worker thread.
PARSE_INLINE_BYTES = 256 << 10
# How long the session waits for its closing events (an idle timeout's error, a cancelled
# response's done) to reach the socket before it drops them.
CLOSE_FLUSH_S = 5.0


class HistoryBudget:
    """The replica's realtime history: the sum over its sessions (`sessions`: id -> session,
    the replica's own registry; a session without `history_bytes` counts 0) against `limit`
    bytes."""

    def __init__(self, limit: int, sessions: dict[str, Any]):
        self.limit = limit
        self.sessions = sessions

    def used(self) -> int:
        return sum(getattr(s, "history_bytes", 0) for s in self.sessions.values())


def item_bytes(item: p.Item) -> int:
    """What an item holds in memory, near enough: its audio and its text."""
    n = 0
    for c in item.content:
        n += len(c.audio or b"") + len(c.text or "") + len(c.transcript or "")
    return n


@dataclass
class _Assistant:
    """What a response has made of its assistant item so far: its text, and for audio the
    transcript that went out with each audio delta (so a truncate keeps what was heard)."""

    item_id: str
    audio: bool
    text: str = ""
    pending: str = ""  # text not yet sent with an audio delta
    audio_ms: float = 0.0
    segments: list[tuple[float, str]] = field(default_factory=list)  # (start ms, transcript)
    started: float = 0.0  # perf_counter when the response started
    report: dict[str, Any] = field(default_factory=dict)  # omniray's report of the turn

    def heard(self, audio_end_ms: float) -> str:
        return "".join(t for start, t in self.segments if start < audio_end_ms)


@dataclass
class _Running:
    response: p.Response
    task: asyncio.Task
    reason: str = "client_cancelled"


class RealtimeSession:
    """`chat(request dict) -> async iterator of events` is the ingress's handle method;
    `send(text)` writes one text frame."""

    def __init__(
        self,
        chat: Callable[[dict], AsyncIterator[Any]],
        send: Callable[[str], Awaitable[None]],
        *,
        model: str = "omniray",
        beta: bool = False,
        limits: SessionLimits | None = None,
        history: HistoryBudget | None = None,
    ):
        self._chat = chat
        self.model = model
        self.beta = beta
        self.limits = limits or SessionLimits()
        self.id = p.new_id("sess")
        self.cfg = p.SessionConfig()
        self.items: list[p.Item] = []
        self.transcripts: dict[str, _Assistant] = {}  # assistant item id -> its audio/text
        self._rates: dict[str, int] = {}  # item id -> the pcm16 rate of its input audio
        self.listener = Listener(
            self.cfg.input_audio_rate, self.cfg.turn_detection, self.limits.max_buffer_s
        )
        self.running: _Running | None = None
        self.responses = 0
        self.outbox = Outbox(send, self._wire)
        self.history = history
        self.sent_audio = False  # the client has sent input audio
        self.client = ""  # the client's address (socket.py: sessions per client)

    # -- plumbing ------------------------------------------------------------------------

    def _wire(self, event: dict[str, Any]) -> str | None:
        if self.beta:
            event = p.to_beta(event)
            if event is None:
                return None
        return dumps(event)

    async def send(self, event: dict[str, Any]) -> None:
        """Queue one server event (the outbox writes it; see `flush`)."""
        self.outbox.put(event)

    @property
    def history_bytes(self) -> int:
        return sum(item_bytes(it) for it in self.items)

    @property
    def idle_timeout_s(self) -> float:
        if self.sent_audio:
            return self.limits.idle_timeout_s
        return min(self.limits.idle_timeout_s, NO_AUDIO_IDLE_TIMEOUT_S)

    async def run(self, receive: Callable[[], Awaitable[str | bytes | None]]) -> None:
        """Serve the session until the socket closes (`receive` returns None), it idles
        for `idle_timeout_s`, or its client stops reading (`outbox.slow`); then cancel what
        runs and drop everything."""
        await self.send(p.session_created(self.id, self.cfg, model=self.model))
        stopped = asyncio.ensure_future(self.outbox.stopped_event.wait())
        try:
            while True:
                timeout = self.idle_timeout_s
                frame_task = asyncio.ensure_future(receive())
                done, _ = await asyncio.wait({frame_task, stopped}, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if frame_task not in done:
                    frame_task.cancel()
                    with contextlib.suppress(BaseException):
                        await frame_task
                    if stopped in done:  # the client does not read, or the socket failed
                        return
                    await self.send(p.error(
                        "idle_timeout", f"no client event for {timeout:g} s; closing",
                        kind="invalid_request_error"))
                    return
                frame = frame_task.result()
                if frame is None:
                    return
                await self.handle(frame)
        finally:
            stopped.cancel()
            await self.close()

    async def close(self) -> None:
        running = self.running
        if running is not None:
            running.task.cancel()
            with contextlib.suppress(BaseException):
                await running.task
        if self.outbox.stopped is None:  # what is queued (a response's done) still goes out
            await self.outbox.flush(CLOSE_FLUSH_S)
        await self.outbox.close()
        self.items.clear()
        self.transcripts.clear()
        self._rates.clear()
        self.listener.clear()

    async def handle(self, frame: str | bytes) -> None:
        """One client event; returns once the events it caused have been written, so a
        client that does not read is not read either."""
        ev = None
        try:
            if len(frame) > PARSE_INLINE_BYTES:  # megabytes of JSON and base64: a thread's
                ev = await asyncio.to_thread(
                    p.parse_client_event, frame, max_bytes=self.limits.max_event_bytes)
            else:
                ev = p.parse_client_event(frame, max_bytes=self.limits.max_event_bytes)
            await self._dispatch(ev)
        except p.ProtocolError as e:
            if e.event_id is None and ev is not None:
                e.event_id = ev.event_id
            await self.send(p.protocol_error(e))
        await self.outbox.flush()

    async def _dispatch(self, ev: p.ClientEvent) -> None:
        eid = ev.event_id
        if isinstance(ev, p.SessionUpdate):
            cfg = p.apply_session_update(self.cfg, ev.session)
            self.listener.reconfigure(cfg.input_audio_rate, cfg.turn_detection)
            self.cfg = cfg
            await self.send(p.session_updated(self.id, self.cfg, model=self.model))
        elif isinstance(ev, p.AudioAppend):
            await self._append(ev.audio, eid)
        elif isinstance(ev, p.AudioCommit):
            await self._commit(eid)
        elif isinstance(ev, p.AudioClear):
            self.listener.clear()
            await self.send(p.input_audio_buffer_cleared())
        elif isinstance(ev, p.ItemCreate):
            await self._add_item(ev.item, ev.previous_item_id, eid)
        elif isinstance(ev, p.ItemTruncate):
            await self._truncate(ev, eid)
        elif isinstance(ev, p.ItemDelete):
            self._index(ev.item_id, eid)
            await self._cancel_writer_of(ev.item_id)
            i = self._index(ev.item_id, eid)
            del self.items[i]
            self.transcripts.pop(ev.item_id, None)
            self._rates.pop(ev.item_id, None)
            await self.send(p.conversation_item_deleted(ev.item_id))
        elif isinstance(ev, p.ResponseCreate):
            if self.running is not None:
                raise p.ProtocolError(
                    "conversation_already_has_active_response",
                    f"response {self.running.response.id} is still in progress",
                    None,
                    eid,
                )
            cfg = p.apply_session_update(self.cfg, ev.response.patch)
            self._start(cfg, ev.response.metadata)
        elif isinstance(ev, p.ResponseCancel):
            if self.running is None or (
                ev.response_id and ev.response_id != self.running.response.id
            ):
                raise p.ProtocolError(
                    "response_cancel_not_active", "there is no active response to cancel", None, eid
                )
            await self.cancel("client_cancelled")

    # -- input audio ---------------------------------------------------------------------

    async def _append(self, audio: bytes, eid: str | None) -> None:
        self.sent_audio = True
        # Resampling and the VAD model are CPU work: off the event loop, so one session's
        # audio does not hold up the replica's other sessions and requests. The session loop
        # waits for it, so a session's appends still run one at a time, in order.
        for heard in await asyncio.to_thread(self.listener.append, audio):
            td = self.cfg.turn_detection
            if isinstance(heard, SpeechStarted):
                await self.send(p.input_audio_buffer_speech_started(heard.ms, heard.item_id))
                if self.running is not None and td is not None and td.interrupt_response:
                    await self.cancel("turn_detected")  # barge-in
                continue
            await self.send(p.input_audio_buffer_speech_stopped(heard.ms, heard.item_id))
            await self._commit_audio(heard.audio, heard.item_id, None)
            if td is not None and td.create_response and self.running is None:
                self._start(self.cfg, None)

    async def _commit(self, eid: str | None) -> None:
        item_id, audio = self.listener.commit()
        await self._commit_audio(audio, item_id, eid)

    async def _commit_audio(self, audio: bytes, item_id: str, eid: str | None) -> None:
        prev = self.items[-1].id if self.items else None
        item = p.Item(item_id, "user", (p.ContentPart("input_audio", audio=audio),))
        await self.send(p.input_audio_buffer_committed(item_id, prev))
        await self._add_item(item, prev, eid)

    # -- the conversation ----------------------------------------------------------------

    def _index(self, item_id: str, eid: str | None) -> int:
        for i, it in enumerate(self.items):
            if it.id == item_id:
                return i
        raise p.ProtocolError("item_not_found", f"no conversation item {item_id!r}", "item_id", eid)

    async def _add_item(self, item: p.Item, previous_item_id: str | None, eid: str | None) -> None:
        if len(self.items) >= self.limits.max_items:
            raise p.ProtocolError(
                "conversation_full",
                f"the conversation holds at most {self.limits.max_items} items; delete some first",
                None,
                eid,
            )
        size = item_bytes(item)
        if self.history is not None and self.history.used() + size > self.history.limit:
            raise p.ProtocolError(
                "history_budget_exceeded",
                "this server holds no more realtime conversation history right now; "
                "delete items or end sessions first",
                None,
                eid,
            )
        if any(it.id == item.id for it in self.items):
            raise p.ProtocolError(
                "invalid_value",
                f"item id {item.id!r} is already in the conversation",
                "item.id",
                eid,
            )
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self._index(previous_item_id, eid) + 1
        prev = self.items[at - 1].id if at else None
        self.items.insert(at, item)
        if any(c.type == "input_audio" for c in item.content):
            self.sent_audio = True
        self._rates[item.id] = self.cfg.input_audio_rate  # its audio's, if it has any
        # The client's own content is echoed only as far as the API needs (protocol.py).
        await self.send(p.conversation_item_added(item, prev, brief=True))
        await self.send(p.conversation_item_done(item, prev, brief=True))

    async def _cancel_writer_of(self, item_id: str) -> None:
        """Cancel the running response if it writes `item_id`; its response.done goes out
        before this returns."""
        running = self.running
        if running is not None and running.response.output[0].id == item_id:
            await self.cancel("client_cancelled")

    async def _truncate(self, ev: p.ItemTruncate, eid: str | None) -> None:
        i = self._index(ev.item_id, eid)
        item = self.items[i]
        said = self.transcripts.get(item.id)
        if item.role != "assistant" or said is None or not said.audio:
            raise p.ProtocolError(
                "invalid_value", "only an assistant item's audio can be truncated", "item_id", eid
            )
        if ev.content_index != 0:
            raise p.ProtocolError(
                "invalid_value", "the item has one content part", "content_index", eid
            )
        await self._cancel_writer_of(item.id)
        i = self._index(ev.item_id, eid)
        item = self.items[i]
        if ev.audio_end_ms > said.audio_ms + 1:
            raise p.ProtocolError(
                "invalid_value",
                f"audio_end_ms {ev.audio_end_ms} is past "
                f"the item's {said.audio_ms:.0f} ms of audio",
                "audio_end_ms",
                eid,
            )
        heard = said.heard(ev.audio_end_ms)
        said.text, said.audio_ms = heard, float(ev.audio_end_ms)
        said.segments = [s for s in said.segments if s[0] < ev.audio_end_ms]
        self.items[i] = replace(item, content=(p.ContentPart("output_audio", transcript=heard),))
        await self.send(p.conversation_item_truncated(item.id, 0, ev.audio_end_ms))

    def messages(
        self, cfg: p.SessionConfig, items: list[p.Item] | None = None
    ) -> list[dict[str, Any]]:
        """The conversation (or `items`, a snapshot of it) as the chat API's messages."""
        out: list[dict[str, Any]] = []
        if cfg.instructions:
            out.append({"role": "system", "content": cfg.instructions})
        for item in self.items if items is None else items:
            if item.role == "assistant":
                said = self.transcripts.get(item.id)
                text = (
                    said.text
                    if said is not None
                    else "".join(c.text or c.transcript or "" for c in item.content)
                )
                if text:
                    out.append({"role": "assistant", "content": text})
                continue
            parts: list[dict[str, Any]] = []
            for c in item.content:
                if c.type == "input_text":
                    parts.append({"type": "text", "text": c.text or ""})
                elif c.type == "input_audio" and c.audio:
                    data = pcm16_to_wav(c.audio, self._rates.get(item.id, cfg.input_audio_rate))
                    parts.append(
                        {
                            "type": "input_audio",
                            "input_audio": {
                                "data": base64.b64encode(data).decode(),
                                "format": "wav",
                            },
                        }
                    )
            if parts:
                out.append({"role": item.role, "content": parts})
        return out

    # -- responses -----------------------------------------------------------------------

    def _start(self, cfg: p.SessionConfig, metadata: Any) -> None:
        audio = "audio" in cfg.output_modalities
        item = p.Item(
            p.new_id("item"),
            "assistant",
            (
                p.ContentPart(
                    "output_audio" if audio else "output_text",
                    transcript="" if audio else None,
                    text=None if audio else "",
                ),
            ),
        )
        resp = p.Response(p.new_id("resp"), cfg, output=(item,), metadata=metadata)
        self.responses += 1
        task = asyncio.get_running_loop().create_task(self._respond(resp))
        self.running = _Running(resp, task)

    async def cancel(self, reason: str) -> None:
        """Cancel the running response and wait until its response.done has gone out."""
        running = self.running
        if running is None:
            return
        running.reason = reason
        running.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running.task

    def request(
        self, cfg: p.SessionConfig, items: list[p.Item] | None = None
    ) -> dict[str, Any]:
        audio = "audio" in cfg.output_modalities
        req: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(cfg, items),
            "modalities": ["text", "audio"] if audio else ["text"],
        }
        if audio:
            req["audio"] = {"format": "pcm16", "voice": cfg.voice}
        if cfg.ref_audio is not None:
            req["ref_audio"] = cfg.ref_audio
        if cfg.max_output_tokens is not None:
            req["max_tokens"] = cfg.max_output_tokens
        if cfg.temperature is not None:
            req["temperature"] = cfg.temperature
        ext: dict[str, Any] = {}
        if cfg.return_timings:
            ext["return_timings"] = True
        if cfg.fixed_text_tokens is not None:
            ext.update(fixed_text_tokens=cfg.fixed_text_tokens, ignore_eos=True)
            req["max_tokens"] = cfg.fixed_text_tokens
        if cfg.fixed_speech_codes is not None:
            ext["fixed_speech_codes"] = cfg.fixed_speech_codes
        if ext:
            req["omniray"] = ext
        return req

    async def _respond(self, resp: p.Response) -> None:
        item = resp.output[0]
        audio = item.content[0].type == "output_audio"
        said = _Assistant(item.id, audio, started=time.perf_counter())
        self.transcripts[item.id] = said
        rid, iid = resp.id, item.id
        status, reason, error, usage = "failed", None, None, None
        opened = False
        try:
            # The request is the conversation up to now; the assistant item joins it at once,
            # so a cancel at any point below finds (and closes) it there. Building it (WAV
            # and base64 of every audio item) is CPU work: off the event loop, over a
            # snapshot, as the session loop may change the conversation meanwhile.
            items = list(self.items)
            prev = items[-1].id if items else None
            self.items.append(item)
            request = await asyncio.to_thread(self.request, resp.config, items)
            await self.send(p.response_created(resp))
            await self.send(p.response_output_item_added(rid, 0, item))
            await self.send(p.conversation_item_added(item, prev, "in_progress"))
            await self.send(p.response_content_part_added(rid, iid, 0, 0, item.content[0]))
            opened = True
            async with contextlib.aclosing(self._chat(request)) as events:
                async for ev in events:
                    if isinstance(ev, TextDelta | AudioChunk):
                        # The session's own clock, from the response's start (the commit):
                        # these survive a cancel, the turn's own metrics come only with Done.
                        key = "first_text_s" if isinstance(ev, TextDelta) else "first_audio_s"
                        said.report.setdefault(key, round(time.perf_counter() - said.started, 4))
                    if isinstance(ev, TextDelta):
                        said.text += ev.text
                        if audio:
                            said.pending += ev.text
                        else:
                            await self.send(p.response_output_text_delta(rid, iid, 0, 0, ev.text))
                    elif isinstance(ev, AudioChunk):
                        delta, said.pending = said.pending, ""
                        said.segments.append((said.audio_ms, delta))
                        said.audio_ms += ev.seconds * 1000
                        # the audio delta and its transcript delta, as one (outbound.py)
                        self.outbox.put_audio(rid, iid, float_to_int16(ev.pcm).tobytes(), delta)
                    elif isinstance(ev, Done):
                        status = "incomplete" if ev.finish_reason == "length" else "completed"
                        reason = "max_output_tokens" if status == "incomplete" else None
                        usage = p.Usage(ev.usage.prompt_tokens, ev.usage.completion_tokens)
                        said.report["metrics"] = ev.metrics
                        if ev.timings is not None:
                            said.report["timings"] = ev.timings
                    elif isinstance(ev, Error):
                        error = p.ResponseError(
                            ev.reason,
                            ev.message,
                            "invalid_request_error" if ev.status < 500 else "server_error",
                        )
        except asyncio.CancelledError:
            status, reason = (
                "cancelled",
                self.running.reason if self.running else "client_cancelled",
            )
        except Exception as e:
            log.exception("realtime response %s failed", rid)
            error = p.ResponseError("server_error", f"{type(e).__name__}: {e}")
        finally:
            if error is not None:
                status, reason = "failed", None
            elif status == "failed":  # ended without a terminal event
                error = p.ResponseError("server_error", "the turn ended without an outcome")
            await asyncio.shield(self._finish(resp, said, opened, status, reason, error, usage))
            self.running = None

    async def _finish(
        self,
        resp: p.Response,
        said: _Assistant,
        opened: bool,
        status: str,
        reason: str | None,
        error: p.ResponseError | None,
        usage: p.Usage | None,
    ) -> None:
        """The closing events of a response, in order, then exactly one response.done."""
        rid, iid = resp.id, resp.output[0].id
        part = (
            p.ContentPart("output_audio", transcript=said.text)
            if said.audio
            else p.ContentPart("output_text", text=said.text)
        )
        item = replace(resp.output[0], content=(part,))
        item_status = "completed" if status == "completed" else "incomplete"
        for i, it in enumerate(self.items):
            if it.id == iid:
                self.items[i] = item
        if not opened:  # cancelled before its item was announced: it never joined
            self.items = [it for it in self.items if it.id != iid]
            self.transcripts.pop(iid, None)
        try:
            if opened:
                if said.audio:
                    await self.send(p.response_output_audio_done(rid, iid, 0, 0))
                    await self.send(
                        p.response_output_audio_transcript_done(rid, iid, 0, 0, said.text)
                    )
                else:
                    await self.send(p.response_output_text_done(rid, iid, 0, 0, said.text))
                await self.send(p.response_content_part_done(rid, iid, 0, 0, part))
                await self.send(p.response_output_item_done(rid, 0, item, item_status))
                ids = [it.id for it in self.items]
                if iid in ids:  # still in the conversation (a delete cancels first)
                    i = ids.index(iid)
                    prev = self.items[i - 1].id if i else None
                    await self.send(p.conversation_item_done(item, prev, item_status))
            await self.send(
                p.response_done(
                    replace(
                        resp,
                        status=status,
                        reason=reason,
                        error=error,
                        usage=usage,
                        output=(item,) if opened else (),
                        report=said.report or None,
                    )
                )
            )
        except Exception:
            log.debug("realtime response %s: closing events not sent", rid, exc_info=True)

    def stats(self) -> dict[str, Any]:
        return {
            "items": len(self.items),
            "history_bytes": self.history_bytes,
            "buffer_ms": round(self.listener.buffer.ms),
            "responding": self.running is not None,
            "responses": self.responses,
            "outbound": self.outbox.stats(),
        }
