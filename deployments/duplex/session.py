"""One duplex socket's session, whatever its wire: input audio cut into the reference's
units, the units run in order on the backend, results handed to the wire, server events
sent through a bounded outbox, and the session's time limits.

A wire (official.py, openai_shape.py) subclasses `DuplexConnection` with its event
parsing (`on_event`), its start (`start`) and its rendering of results (`on_decision`,
`on_audio`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deployments.config import DuplexSettings
from deployments.duplex.backend import DuplexInit, UnitResult
from deployments.duplex.manager import DuplexManager, Refused
from deployments.wire import error_line

log = logging.getLogger(__name__)

INPUT_RATE = 16000      # the audio encoder's rate: what a unit's samples are
OUTPUT_RATE = 24000     # Token2Wav's
# A unit's audio: what the official demo's server hands MiniCPMODuplex.streaming_prefill
# per unit, `chunk_ms` of the client's stream, the first unit included (the reference pads
# that one to its `first_chunk_ms` itself, with leading silence).
# TODO(integrator): read it from pipeline.duplex.config.DuplexConfig (chunk_ms) once merged.
UNIT_MS = 1000

# Close codes (RFC 6455)
NORMAL, POLICY, INTERNAL, TRY_LATER = 1000, 1008, 1011, 1013
_FINAL_SEND_S = 5.0  # how long the last events (error, closed) may take to reach the client


class BadEvent(Exception):
    """A client event the session refuses (its wire decides whether that ends it)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class Unit:
    audio: np.ndarray
    frames: list | None
    force: str | None


class UnitAssembler:
    """Input audio (16 kHz float32, any chunking) -> whole units of `UNIT_MS`; the latest
    camera frame and a one-unit force decision go with the unit being filled."""

    def __init__(self, unit_ms: int = UNIT_MS, rate: int = INPUT_RATE):
        self.size = round(unit_ms * rate / 1000)
        self.units = 0
        self._parts: list[np.ndarray] = []
        self._have = 0
        self._frame: Any = None
        self._force: str | None = None

    def frame(self, image: Any) -> None:
        self._frame = image

    def force(self, decision: str) -> None:
        self._force = decision

    def clear(self) -> None:
        self._parts, self._have, self._frame, self._force = [], 0, None, None

    def push(self, audio: np.ndarray) -> list[Unit]:
        out = []
        while len(audio):
            take = min(self.size - self._have, len(audio))
            self._parts.append(audio[:take])
            self._have += take
            audio = audio[take:]
            if self._have == self.size:
                frames = [self._frame] if self._frame is not None else None
                out.append(Unit(np.concatenate(self._parts), frames, self._force))
                self.units += 1
                self.clear()
        return out

    @property
    def pending_samples(self) -> int:
        return self._have


class Outbox:
    """Server events for one socket, sent in order by one writer task. `put` never waits:
    a client that stops reading makes the unsent bytes grow, and past `max_bytes` the
    session ends (`overflowed` is set) instead of holding ever more of its output."""

    def __init__(self, send: Callable[[str], Awaitable[None]], max_bytes: int):
        self._send = send
        self.max_bytes = max_bytes
        self._q: deque[str] = deque()
        self.unsent = 0
        self.overflowed = asyncio.Event()
        self._ready = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self.failed: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    def put(self, event: dict, *, final: bool = False) -> None:
        """Queue one event; `final` ones (the error or close that ends a session) are
        queued past the bound, so the client still learns why it ends."""
        text = json.dumps(event, separators=(",", ":"))
        if not final and self.unsent + len(text) > self.max_bytes:
            self.overflowed.set()
            return
        self._q.append(text)
        self.unsent += len(text)
        self._empty.clear()
        self._ready.set()

    async def _run(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._q:
                    text = self._q[0]
                    await self._send(text)
                    self._q.popleft()
                    self.unsent -= len(text)
                self._empty.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the socket is gone; the session sees it
            self.failed = e
            self._empty.set()

    async def drain(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._empty.wait(), timeout)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._q.clear()
        self.unsent = 0


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    audio_output_tokens: int = 0

    def add(self, r: UnitResult) -> None:
        self.input_tokens += r.prefill_tokens
        self.output_tokens += len(r.token_ids)
        self.audio_output_tokens += len(r.codes)

    def as_event(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
                "output_tokens_details": {"audio_tokens": self.audio_output_tokens}}


@dataclass
class Ending:
    """Why the session ends: a normal close (`code` None) or an error event first."""

    reason: str
    code: str | None = None
    message: str = ""
    close_code: int = NORMAL


@dataclass
class _Clock:
    started: float = field(default_factory=time.monotonic)
    received_s: float = 0.0


class DuplexConnection:
    """The wire-independent half of a duplex socket (see the module docstring)."""

    def __init__(self, manager: DuplexManager, session_id: str, send: Callable[[str],
                 Awaitable[None]], *, mode: str, model: str, limits: Any):
        self.manager = manager
        self.settings: DuplexSettings = manager.settings
        self.id = session_id
        self.mode = mode                  # "audio" | "video"
        self.model = model
        self.limits = limits              # LimitSettings (voices, frames)
        self.out = Outbox(send, self.settings.max_outbound_bytes)
        self.units = UnitAssembler()
        self.usage = Usage()
        self.force: str | None = None     # the session's standing decision, if any
        self.started = False             # holds a slot: a refused socket gets no closed event
        self.opened = False
        self._pending: asyncio.Queue[Unit] = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._clock = _Clock()
        self._ending: asyncio.Future[Ending] = asyncio.get_running_loop().create_future()
        self.unit_index = 0
        self.streamed = ""               # the unit's text sent so far, piece by piece

    # -- what a wire provides ------------------------------------------------------------

    async def start(self) -> None:
        """Events once the session holds a slot (before the first client event)."""

    async def on_event(self, obj: dict) -> None:
        raise NotImplementedError

    def on_text(self, index: int, piece: str) -> None:
        """A piece of a speaking unit's text, before its decision (`streamed` holds the
        unit's pieces so far, this one included)."""
        raise NotImplementedError

    def on_decision(self, index: int, result: UnitResult) -> None:
        """A unit's decision and text (its codes and PCM not yet made); the text past what
        `on_text` sent is `rest_of_text(result)`."""
        raise NotImplementedError

    def _on_text(self, piece: str) -> None:
        self.streamed += piece
        self.on_text(self.unit_index, piece)

    def rest_of_text(self, result: UnitResult) -> str:
        """The unit's text that its pieces did not send (all of it when none went)."""
        if result.text.startswith(self.streamed):
            return result.text[len(self.streamed):]
        return ""  # pieces are a prefix of the text (DuplexBackend); nothing is sent twice

    def on_audio(self, index: int, result: UnitResult) -> None:
        """The same unit once its audio is made (after `on_decision`; a listening unit's
        too, with none)."""
        raise NotImplementedError

    def error_event(self, code: str, message: str, param: str | None = None) -> dict:
        raise NotImplementedError

    def bad_event(self, e: BadEvent) -> Ending | None:
        """A refused client event: the official wire ends the session (its clients treat
        every error as fatal); the OpenAI-shaped one reports it and goes on."""
        return Ending("invalid_event", e.code, e.message, POLICY)

    def closed_event(self, reason: str) -> dict | None:
        return None

    def queued_event(self, position: int, eta_s: float, length: int) -> dict:
        return {"type": "session.queued", "position": position,
                "estimated_wait_s": eta_s, "queue_length": length}

    # -- life ----------------------------------------------------------------------------

    def end(self, ending: Ending) -> None:
        if not self._ending.done():
            self._ending.set_result(ending)

    async def open_backend(self, init: DuplexInit) -> None:
        try:
            await self.manager.open(self.id, init)
        except ValueError as e:  # the model side refused an option or the voice
            raise BadEvent("invalid_value", error_line(e)) from None
        self.opened = True
        self._clock = _Clock()  # real time starts with the session
        self._worker = asyncio.get_running_loop().create_task(self._run_units())

    def push_audio(self, audio: np.ndarray) -> None:
        """Queue 16 kHz audio; whole units go to the backend in order. Input further ahead
        of real time than `max_ahead_s` is refused (a live stream cannot be), and so is a
        session whose units wait longer than that for the model."""
        if not len(audio):
            return
        c = self._clock
        c.received_s += len(audio) / INPUT_RATE
        ahead = c.received_s - (time.monotonic() - c.started)
        if ahead > self.settings.max_ahead_s:
            raise Refused("input_too_fast", f"input audio is {ahead:.1f} s ahead of real "
                          f"time (at most {self.settings.max_ahead_s:g} s): send it as it "
                          f"is captured", POLICY)
        for unit in self.units.push(audio):
            if unit.force is None:
                unit.force = self.force
            self._pending.put_nowait(unit)
        behind = self._pending.qsize() * UNIT_MS / 1000
        if behind > self.settings.max_ahead_s:
            # the model runs this session's units slower than they come: a live
            # conversation that lags ever further is over, and its input must not pile up
            raise Refused("server_behind", f"{behind:g} s of input wait for the model, over "
                          f"{self.settings.max_ahead_s:g} s: the server is overloaded",
                          TRY_LATER)

    async def _run_units(self) -> None:
        backend = self.manager.backend
        while True:
            unit = await self._pending.get()
            try:
                # the text goes out as the model draws it, the decision with the rest of the
                # text as soon as the model has it, the audio after
                self.streamed = ""
                result = await backend.unit(self.id, unit.audio, unit.frames, unit.force,
                                            self._on_text)
                self.on_decision(self.unit_index, result)
                if not result.is_listen:
                    result.codes, result.pcm = await backend.speech(self.id)
            except Exception as e:  # noqa: BLE001 - a failed unit ends its session
                log.exception("duplex session %s: unit %d failed", self.id, self.unit_index)
                self.end(Ending("server_error", "server_error",
                                f"the model failed on unit {self.unit_index}: "
                                f"{type(e).__name__}: {e}", INTERNAL))
                return
            self.usage.add(result)
            self.on_audio(self.unit_index, result)
            self.unit_index += 1

    async def run(self, receive: Callable[[], Awaitable[str | bytes | None]]) -> Ending:
        """Read client events until the session ends; returns why."""
        self.started = True
        await self.start()
        deadline = time.monotonic() + self.settings.max_session_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return Ending("max_duration")
            wait = min(self.settings.idle_timeout_s, left)
            recv = asyncio.ensure_future(receive())
            overflow = asyncio.ensure_future(self.out.overflowed.wait())
            done, _ = await asyncio.wait({recv, self._ending, overflow}, timeout=wait,
                                         return_when=asyncio.FIRST_COMPLETED)
            overflow.cancel()
            if recv not in done:
                recv.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await recv
            if self._ending.done():
                return self._ending.result()
            if overflow in done:
                return Ending("client_too_slow", "client_too_slow",
                              f"over {self.settings.max_outbound_bytes} bytes of server "
                              f"events are waiting for the client to read them", TRY_LATER)
            if not done:
                if time.monotonic() >= deadline:
                    return Ending("max_duration")
                return Ending("idle_timeout")
            msg = recv.result()
            if msg is None:
                return Ending("client_gone")
            try:
                await self.on_event(self._parse(msg))
            except BadEvent as e:
                ending = self.bad_event(e)
                if ending is not None:
                    return ending
            except Refused as e:
                return Ending(e.code, e.code, e.message, e.close_code)
            if self._ending.done():
                return self._ending.result()

    def _parse(self, msg: str | bytes) -> dict:
        if isinstance(msg, bytes):
            raise BadEvent("invalid_event", "events are JSON text frames, got a binary frame")
        if len(msg) > self.settings.max_event_bytes:
            raise BadEvent("event_too_large", f"an event is at most "
                           f"{self.settings.max_event_bytes} bytes, got {len(msg)}")
        try:
            obj = json.loads(msg)
        except ValueError as e:
            raise BadEvent("invalid_json", f"the event is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
            raise BadEvent("invalid_event", "an event is a JSON object with a string 'type'")
        return obj

    async def stop(self) -> None:
        """Stop the units and free the backend's session (again: a no-op)."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._worker
        await self.manager.close(self.id)

    async def finish(self, ending: Ending, socket_open: bool) -> None:
        """Tell the client why the session ends (when it is still there); stop sending."""
        try:
            if socket_open and ending.reason != "client_gone":
                if ending.code is not None:
                    self.out.put(self.error_event(ending.code, ending.message), final=True)
                closed = self.closed_event(ending.reason) if self.started else None
                if closed is not None:
                    self.out.put(closed, final=True)
                await self.out.drain(_FINAL_SEND_S)
        finally:
            await self.out.close()
