"""A scripted stand-in for omniray's streaming chat API, with known timings.

It speaks the wire format of docs/bench.md (SSE chunks with a top-level `modality`, base64 WAV
audio chunks, usage and `timings` at the end), so it doubles as an executable example of that
format for the server side. The benchmark tests measure it and compare against the script.

Per request (times in seconds after the request arrived, all multiplied by `time_scale`):
  1. wait for a slot (`capacity` requests run at once; the wait is reported as stage "queue"),
  2. text events at `text_times` (after the wait),
  3. audio events at `audio_times` carrying `audio_seconds` each,
  4. a final usage + timings event at `end_time`, then `data: [DONE]`.

With `omniray.fixed_speech_codes` = n in the request, the audio becomes ceil(n / 25) chunks of
25 codes (1 s) with the remainder last, 40 ms of audio per code, spaced `audio_times` apart.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

CODES_PER_SECOND = 25  # Talker speech codes per second of audio


def pcm_wav(seconds: float, sample_rate: int) -> bytes:
    """A silent 16-bit mono WAV of `seconds`."""
    frames = int(round(seconds * sample_rate))
    data = b"\x00\x00" * frames
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
        + b"fmt " + struct.pack("<I", 16) + fmt
        + b"data" + struct.pack("<I", len(data)) + data
    )


@dataclass
class FakeScript:
    """When each event of a request is sent (seconds after its slot was granted)."""

    text_times: tuple[float, ...] = (0.10, 0.12)
    text: tuple[str, ...] = ("B", ".")
    audio_times: tuple[float, ...] = (0.20, 0.30, 0.35)
    audio_seconds: tuple[float, ...] = (1.0, 1.0, 0.28)
    end_time: float = 0.36
    capacity: int = 1_000_000
    time_scale: float = 1.0
    sample_rate: int = 24000
    prompt_tokens: int = 100


@dataclass
class FakeServerState:
    script: FakeScript
    bodies: list[dict[str, Any]] = field(default_factory=list)
    sem: asyncio.Semaphore | None = None


STATE = web.AppKey("state", FakeServerState)


def _chunk(rid: str, modality: str, delta: dict[str, Any], **choice_extra: Any) -> bytes:
    obj = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "fake",
        "modality": modality,
        "choices": [{"index": 0, "delta": delta, "finish_reason": None, **choice_extra}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _audio_plan(script: FakeScript, body: dict[str, Any]) -> list[tuple[float, float]]:
    ext = body.get("omniray") or {}
    n = ext.get("fixed_speech_codes")
    if n is None:
        return list(zip(script.audio_times, script.audio_seconds))
    sizes = [CODES_PER_SECOND] * (n // CODES_PER_SECOND)
    if n % CODES_PER_SECOND:
        sizes.append(n % CODES_PER_SECOND)
    t0 = script.audio_times[0]
    step = (script.audio_times[1] - script.audio_times[0]) if len(script.audio_times) > 1 else 0.05
    return [(t0 + i * step, k / CODES_PER_SECOND) for i, k in enumerate(sizes)]


def _text_plan(script: FakeScript, body: dict[str, Any]) -> list[tuple[float, str]]:
    ext = body.get("omniray") or {}
    n = ext.get("fixed_text_tokens")
    if n is None:
        return list(zip(script.text_times, script.text))
    t0 = script.text_times[0]
    step = (script.text_times[1] - script.text_times[0]) if len(script.text_times) > 1 else 0.01
    return [(t0 + i * step, "x ") for i in range(math.ceil(n / 4))]  # 4 tokens per event


async def _chat(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    sc = state.script
    t_arrive = asyncio.get_running_loop().time()
    body = await request.json()
    state.bodies.append(body)
    if not body.get("stream"):
        return web.json_response({"error": "fake server only streams"}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    assert state.sem is not None
    async with state.sem:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        queue_s = t0 - t_arrive
        s = sc.time_scale
        rid = "chatcmpl-fake"

        async def at(t: float) -> None:
            await asyncio.sleep(max(0.0, t0 + t * s - loop.time()))

        texts = _text_plan(sc, body)
        audios = _audio_plan(sc, body)
        events: list[tuple[float, bytes]] = []
        for t, txt in texts:
            events.append((t, _chunk(rid, "text", {"content": txt})))
        for t, sec in audios:
            b64 = base64.b64encode(pcm_wav(sec, sc.sample_rate)).decode()
            meta = {"format": "wav", "sample_rate_hz": sc.sample_rate,
                    "frame_count": int(round(sec * sc.sample_rate)), "channels": 1}
            events.append((t, _chunk(rid, "audio", {"content": b64}, audio_metadata=meta)))
        events.sort(key=lambda e: e[0])
        for t, payload in events:
            await at(t)
            await resp.write(payload)
        await at(sc.end_time)
        final: dict[str, Any] = {
            "id": rid, "object": "chat.completion.chunk", "model": "fake", "modality": "text",
            "choices": [],
            "usage": {"prompt_tokens": sc.prompt_tokens,
                      "completion_tokens": max(1, 4 * len(texts)),
                      "total_tokens": sc.prompt_tokens + 4 * len(texts)},
        }
        if (body.get("omniray") or {}).get("return_timings"):
            final["timings"] = _timings(queue_s, texts, audios, s)
        await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _timings(queue_s: float, texts: list, audios: list, s: float) -> dict[str, Any]:
    """Spans consistent with the script: encoders and prefill before the first text event."""
    q = queue_s
    t_text = q + texts[0][0] * s if texts else q
    spans = [
        {"stage": "queue", "start": 0.0, "end": q},
        {"stage": "preprocess", "start": q, "end": q + 0.1 * (t_text - q)},
        {"stage": "vision_encoder", "start": q + 0.1 * (t_text - q), "end": q + 0.4 * (t_text - q)},
        {"stage": "audio_encoder", "start": q + 0.4 * (t_text - q), "end": q + 0.5 * (t_text - q)},
        {"stage": "prefill", "start": q + 0.5 * (t_text - q), "end": t_text},
    ]
    if texts:
        spans.append({"stage": "decode", "start": t_text, "end": q + texts[-1][0] * s})
    prev = t_text
    for i, (t, _sec) in enumerate(audios):
        end = q + t * s
        mid = prev + 0.7 * (end - prev)
        spans.append({"stage": "talker", "start": prev, "end": mid, "chunk": i})
        spans.append({"stage": "code2wav", "start": mid, "end": end, "chunk": i})
        prev = end
    return {"clock": "seconds since the request arrived", "spans": spans}


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})


def make_app(script: FakeScript) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app[STATE] = FakeServerState(script)

    async def on_startup(app: web.Application) -> None:
        app[STATE].sem = asyncio.Semaphore(script.capacity)

    app.on_startup.append(on_startup)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _models)
    return app


class FakeServerThread:
    """Runs the fake server on 127.0.0.1 (ephemeral port) in a background thread.

    >>> with FakeServerThread(FakeScript()) as srv:
    ...     srv.url  # http://127.0.0.1:<port>
    """

    def __init__(self, script: FakeScript | None = None, port: int = 0) -> None:
        self.script = script or FakeScript()
        self.port = port
        self.app = make_app(self.script)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return self.app[STATE].bodies

    def __enter__(self) -> "FakeServerThread":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def __exit__(self, *exc: Any) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

