"""Async closed-loop load generator for omniray's OpenAI-compatible streaming API.

Stages of one benchmark (`run_benchmark`), per concurrency c in the list:
  1. warmup: `num_warmups` requests at concurrency c; recorded with warmup=True, never counted.
  2. `num_rounds` measured rounds of `num_prompts` requests each. A round is closed-loop: c
     workers each send a request, wait for the stream to end, then take the next one.
  3. `summarize` pools the rounds (metrics.py).

One request (`send_request`): POST /v1/chat/completions with stream=true, then the SSE stream is
parsed as bytes arrive; every event is stamped with perf_counter when its last byte was read.
The wire format (including the `omniray` request extension and the `timings` response field)
is in docs/bench.md; tests/fake_server.py implements it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.metrics import AudioEvent, RequestRecord, RoundResult, wav_frames


@dataclass
class RequestSpec:
    """One prompt to send: chat messages plus what grading needs."""

    item_id: str
    messages: list[dict[str, Any]]
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClientOptions:
    """Request shape and client behaviour.

    fixed_text_tokens / fixed_speech_codes / ignore_eos: the fixed-length mode for random-weight
    checkpoints (docs/bench.md); None leaves the server's normal stopping rules.
    """

    url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/chat/completions"
    model: str = "omniray"
    max_tokens: int = 256
    temperature: float = 0.0
    modalities: tuple[str, ...] = ("text", "audio")
    audio_format: str = "wav"
    return_timings: bool = True
    ignore_eos: bool = False
    fixed_text_tokens: int | None = None
    fixed_speech_codes: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    retries: int = 2  # connection errors before any response byte only

    @property
    def full_url(self) -> str:
        return self.url.rstrip("/") + self.endpoint


def build_payload(spec: RequestSpec, opts: ClientOptions) -> dict[str, Any]:
    """The JSON body for one request."""
    body: dict[str, Any] = {
        "model": opts.model,
        "messages": spec.messages,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "modalities": list(opts.modalities),
        "max_tokens": opts.max_tokens,
        "temperature": opts.temperature,
    }
    if "audio" in opts.modalities:
        body["audio"] = {"format": opts.audio_format}
    # The client reads vLLM-Omni's shape (a top-level `modality`); omniray streams OpenAI's
    # `delta.audio` unless asked (servers without the extension ignore the field).
    ext: dict[str, Any] = {"stream_format": "vllm-omni"}
    if opts.return_timings:
        ext["return_timings"] = True
    if opts.ignore_eos or opts.fixed_text_tokens is not None or opts.fixed_speech_codes is not None:
        ext["ignore_eos"] = True
        body["ignore_eos"] = True  # vLLM's spelling, for servers without the extension
    if opts.fixed_text_tokens is not None:
        ext["fixed_text_tokens"] = int(opts.fixed_text_tokens)
        # ignore_eos + max_tokens = N already gives exactly N tokens on a vLLM-style server
        body["max_tokens"] = int(opts.fixed_text_tokens)
    if opts.fixed_speech_codes is not None:
        ext["fixed_speech_codes"] = int(opts.fixed_speech_codes)
    body["omniray"] = ext
    body.update(opts.extra_body)
    return body


def encode_body(spec: RequestSpec, opts: ClientOptions) -> bytes:
    return json.dumps(build_payload(spec, opts)).encode()


# ----------------------------------------------------------------------------- SSE parsing


class SSEParser:
    """Incremental Server-Sent-Events parser: feed bytes, get complete `data` payloads."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        # normalise on the whole buffer: a \r\n pair may straddle two network chunks
        self._buf = (self._buf + chunk).replace(b"\r\n", b"\n")
        out: list[str] = []
        while True:
            cut = self._buf.find(b"\n\n")
            if cut < 0:
                break
            event, self._buf = self._buf[:cut], self._buf[cut + 2 :]
            data = [
                ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")
            ]
            if data:
                out.append(b"\n".join(data).decode("utf-8"))
        return out

    def flush(self) -> list[str]:
        rest = self.feed(b"\n\n") if self._buf.strip() else []
        self._buf = b""
        return rest


def audio_chunk_seconds(chunk: dict[str, Any]) -> float:
    """Seconds of audio in one `modality == "audio"` event.

    The payload is a base64 WAV in `choices[0].delta.content` (or `delta.audio.data`); its header
    gives frames and rate. Falls back to `audio_metadata` {frame_count, sample_rate_hz}.
    """
    choices = chunk.get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    b64 = delta.get("content")
    if not b64 and isinstance(delta.get("audio"), dict):
        b64 = delta["audio"].get("data")
    meta = chunk.get("audio_metadata") or choices[0].get("audio_metadata") or {}
    if b64:
        try:
            raw = base64.b64decode(b64)
            frames, sr = wav_frames(raw)
            return frames / sr
        except (ValueError, binascii.Error):
            fmt = meta.get("format")
            if fmt in ("pcm", "pcm16") and meta.get("sample_rate_hz"):
                ch = int(meta.get("channels", 1) or 1)
                return len(base64.b64decode(b64)) / 2 / ch / float(meta["sample_rate_hz"])
    if meta.get("frame_count") and meta.get("sample_rate_hz"):
        return float(meta["frame_count"]) / float(meta["sample_rate_hz"])
    return 0.0


def _find_timings(chunk: dict[str, Any]) -> dict[str, Any] | None:
    for holder in (chunk, chunk.get("usage") or {}, chunk.get("metrics") or {}):
        t = holder.get("timings") if isinstance(holder, dict) else None
        if isinstance(t, dict):
            return t
    return None


def _apply_event(rec: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    if chunk.get("error"):
        rec.error = f"server error: {chunk['error']}"
        return
    t = _find_timings(chunk)
    if t is not None:
        rec.timings = t
    if chunk.get("usage"):
        rec.usage = {k: v for k, v in chunk["usage"].items() if k != "timings"}
    if isinstance(chunk.get("metrics"), dict):  # the server's own per-request figures
        rec.server_metrics = {k: v for k, v in chunk["metrics"].items() if k != "timings"}
    choices = chunk.get("choices") or []
    if not choices:
        return
    modality = chunk.get("modality") or "text"
    if modality == "audio":
        seconds = audio_chunk_seconds(chunk)
        if rec.t_first_audio is None:
            rec.t_first_audio = now
        rec.audio_events.append(AudioEvent(now, seconds))
        return
    text = (choices[0].get("delta") or {}).get("content")
    if modality == "text" and text:
        if rec.t_first_text is None:
            rec.t_first_text = now
        rec.text_events.append(now)
        rec.text += text


async def send_request(
    session: aiohttp.ClientSession,
    spec: RequestSpec,
    opts: ClientOptions,
    rec: RequestRecord,
    body: bytes | None = None,
) -> RequestRecord:
    """Send one streaming request and fill `rec` with its timeline. Never raises.

    `body` is the pre-encoded JSON (run_round encodes all bodies before the clock starts, so
    multi-megabyte media never stall the event loop while other streams are being timed).
    """
    if body is None:
        body = encode_body(spec, opts)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    attempt = 0
    while True:
        parser = SSEParser()
        rec.t_send = time.perf_counter()
        got_bytes = False
        try:
            async with session.post(opts.full_url, data=body, headers=headers) as resp:
                if resp.status != 200:
                    txt = (await resp.text())[:500]
                    rec.error = f"HTTP {resp.status}: {txt}"
                    rec.t_end = time.perf_counter()
                    return rec
                done = False
                async for chunk in resp.content.iter_any():
                    got_bytes = True
                    now = time.perf_counter()
                    for data in parser.feed(chunk):
                        if data.strip() == "[DONE]":
                            done = True
                            continue
                        _apply_event(rec, json.loads(data), now)
                now = time.perf_counter()
                for data in parser.flush():
                    if data.strip() != "[DONE]":
                        _apply_event(rec, json.loads(data), now)
                    else:
                        done = True
                rec.t_end = now
                if not done and rec.error is None:
                    rec.error = "stream ended without [DONE]"
                return rec
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            if not got_bytes and attempt < opts.retries:
                attempt += 1
                await asyncio.sleep(0.2 * attempt)
                continue
            rec.error = f"{type(e).__name__}: {e}"
        except asyncio.TimeoutError:
            rec.error = f"timeout after {opts.timeout_s} s"
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            rec.error = f"bad SSE payload: {e}"
        rec.t_end = None
        return rec


# ----------------------------------------------------------------------------- progress


class Progress:
    """tqdm when available and stderr is a terminal; else a line every ~10 %; or nothing."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total, self.desc, self.n, self._bar = total, desc, 0, None
        self.enabled = enabled and total > 0
        self._next_pct = 10
        if self.enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
            except ImportError:
                pass

    def update(self, k: int = 1) -> None:
        self.n += k
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(k)
            return
        pct = 100 * self.n // self.total
        if pct >= self._next_pct or self.n == self.total:
            print(f"  {self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)
            self._next_pct = (pct // 10 + 1) * 10

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------------------- rounds


async def run_round(
    session: aiohttp.ClientSession,
    specs: Sequence[RequestSpec],
    opts: ClientOptions,
    concurrency: int,
    round_index: int,
    warmup: bool = False,
    progress: Progress | None = None,
    on_record: Callable[[RequestRecord, RequestSpec], None] | None = None,
) -> RoundResult:
    """Send `specs` closed-loop with `concurrency` workers; wall time is first send -> last end."""
    queue: asyncio.Queue[tuple[int, RequestSpec]] = asyncio.Queue()
    for i, s in enumerate(specs):
        queue.put_nowait((i, s))
    records: list[RequestRecord | None] = [None] * len(specs)
    bodies = [encode_body(s, opts) for s in specs]
    tag = "w" if warmup else f"r{round_index}"

    async def worker() -> None:
        while True:
            try:
                i, spec = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            rec = RequestRecord(
                request_id=f"c{concurrency}-{tag}-{i}-{uuid.uuid4().hex[:6]}",
                item_id=spec.item_id,
                round=round_index,
                concurrency=concurrency,
                warmup=warmup,
                answer=spec.answer,
                meta=dict(spec.meta),
            )
            await send_request(session, spec, opts, rec, bodies[i])
            if on_record is not None:
                on_record(rec, spec)
            records[i] = rec
            if progress is not None:
                progress.update()

    t_start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(specs))))))
    t_stop = time.perf_counter()
    done = [r for r in records if r is not None]
    return RoundResult(concurrency, round_index, t_start, t_stop, done)


@dataclass
class BenchConfig:
    """What to run: concurrency list, warmups and rounds."""

    concurrencies: tuple[int, ...] = (1,)
    num_prompts: int = 20
    num_rounds: int = 3
    num_warmups: int = 2
    progress: bool = True


def schedule(
    specs: Sequence[RequestSpec], n: int, offset: int
) -> list[RequestSpec]:
    """`n` specs starting at `offset`, cycling through the data set."""
    if not specs:
        raise ValueError("empty data set")
    return [specs[(offset + i) % len(specs)] for i in range(n)]


async def run_benchmark(
    specs: Sequence[RequestSpec],
    opts: ClientOptions,
    cfg: BenchConfig,
    on_record: Callable[[RequestRecord, RequestSpec], None] | None = None,
    on_rounds: Callable[[int, str], None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Warmup + measured rounds per concurrency. `on_rounds(c, "start" | "end")` is called
    around each concurrency's measured rounds (a server-side snapshot, e.g. stage counters).

    Returns {concurrency: {"warmup": RoundResult | None, "rounds": [RoundResult, ...]}}.
    Items are taken in order: warmups first, then round 0, 1, ... so a data set with at least
    num_warmups + num_rounds * num_prompts items never repeats a clip within one concurrency, and
    the offset runs on across concurrencies, so a set of len(concurrencies) times that size never
    repeats a clip at all (repeats would hit the server's encoder cache).
    """
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    out: dict[int, dict[str, Any]] = {}
    offset = 0
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        for c in cfg.concurrencies:
            entry: dict[str, Any] = {"warmup": None, "rounds": []}
            if cfg.num_warmups > 0:
                wspecs = schedule(specs, cfg.num_warmups, offset)
                offset += cfg.num_warmups
                bar = Progress(len(wspecs), f"c={c} warmup", cfg.progress)
                entry["warmup"] = await run_round(
                    session, wspecs, opts, c, -1, warmup=True, progress=bar, on_record=on_record
                )
                bar.close()
            if on_rounds is not None:
                on_rounds(c, "start")
            for r in range(cfg.num_rounds):
                rspecs = schedule(specs, cfg.num_prompts, offset)
                offset += cfg.num_prompts
                bar = Progress(len(rspecs), f"c={c} round {r + 1}/{cfg.num_rounds}", cfg.progress)
                entry["rounds"].append(
                    await run_round(session, rspecs, opts, c, r, progress=bar, on_record=on_record)
                )
                bar.close()
            if on_rounds is not None:
                on_rounds(c, "end")
            out[c] = entry
    return out
