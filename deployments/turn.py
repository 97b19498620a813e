"""One chat turn across the three stages, as the ingress runs it.

    1. wait for a slot in the active stream window (FIFO)
    2. speech: open the Talker and Code2Wav streams (Code2Wav with the voice)
    3. start Thinker.generate (text back here; spoken span Thinker -> Talker -> Code2Wav
       directly) and, for speech, Code2Wav.stream (PCM back here)
    4. merge both streams into events as they come; free the slot on the last audio
       piece (text-only: on the last text)
    5. end with exactly one terminal event: Done, or Error (stage failure, timeout)
A cancelled turn (client gone) yields nothing more; it aborts every stage, which frees KV
blocks, Talker slots and Code2Wav stream state. Aborts are idempotent, so every exit path
sends them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.loop import StageFailure
from deployments.metrics import AppMetrics
from deployments.schemas import SAMPLE_RATE, AudioChunk, Done, Error, Event, TextDelta, Usage
from deployments.window import ActiveStreamWindow

log = logging.getLogger(__name__)

_END = object()


@dataclass
class Stages:
    """Handles (DeploymentHandle, or deployments.testing.LocalHandle in-process)."""

    thinker: Any
    talker: Any
    code2wav: Any


@dataclass
class PreparedTurn:
    request_id: str
    thinker_request: Any  # pipeline.handoff.ThinkerRequest
    speech: bool
    voice: np.ndarray | None = None
    seed: int | None = None
    text: bool = True  # False for modalities ["audio"]: text deltas are not sent
    speech_codes: int | None = None  # fixed-length benchmark mode: exactly this many codes
    return_timings: bool = False  # per-stage spans on the Done event (docs/bench.md)
    arrival: float = 0.0  # wall clock: request arrived at the ingress
    prepared: float = 0.0  # wall clock: media decoded, prompt built


class TurnRunner:
    def __init__(self, stages: Stages, window: ActiveStreamWindow, metrics: AppMetrics | None,
                 timeout_s: float):
        self.stages = stages
        self.window = window
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._background: set[asyncio.Task] = set()

    async def run(self, turn: PreparedTurn) -> AsyncIterator[Event]:
        rid = turn.request_id
        now = time.perf_counter()
        # Latencies count from the request's arrival (preprocessing included), like a client's.
        t0 = now - max(0.0, time.time() - turn.arrival) if turn.arrival else now
        slot = None
        gens: list[Any] = []
        pumps: list[asyncio.Task] = []
        outcome = "cancelled"
        deadline = t0 + self.timeout_s
        try:
            self._window_metrics()
            slot = await self._bounded(self.window.acquire(rid), deadline)
            self._window_metrics()
            merged: asyncio.Queue = asyncio.Queue()
            if turn.speech:
                try:
                    await self._bounded(asyncio.gather(
                        self.stages.talker.open.remote(rid, turn.seed, turn.speech_codes),
                        self.stages.code2wav.open.remote(rid, turn.voice)), deadline)
                except asyncio.TimeoutError:
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. a voice the front-end refuses
                    outcome = "error"
                    yield Error(500, f"could not open the speech stages: {_cause(e)}",
                                "stage_error")
                    return
            gens.append(self.stages.thinker.options(stream=True).generate.remote(
                turn.thinker_request))
            if turn.speech:
                gens.append(self.stages.code2wav.options(stream=True).stream.remote(rid))
            for src, gen in zip(("text", "audio"), gens):
                pumps.append(asyncio.get_running_loop().create_task(self._pump(src, gen, merged)))

            marks: dict[str, float] = {}
            pieces: list[tuple[float, float]] = []
            talker: list[tuple[float, float]] = []
            usage, finish = Usage(), "stop"
            ttft = first_audio = last_audio = None
            audio_s, index, open_sources = 0.0, 0, len(gens)
            while open_sources:
                src, item = await self._bounded(merged.get(), deadline)
                if item is _END:
                    open_sources -= 1
                    continue
                if isinstance(item, StageFailure):
                    outcome = "error"
                    yield Error(500, f"{item.stage} failed: {item.message}", "stage_error")
                    return
                if isinstance(item, BaseException):
                    outcome = "error"
                    yield Error(500, f"{src} stream failed: {type(item).__name__}: {item}",
                                "stage_error")
                    return
                if src == "text":
                    if item.text:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        if turn.text:
                            yield TextDelta(item.text)
                    marks.update(getattr(item, "timings", None) or {})
                    usage = Usage(item.prompt_tokens or usage.prompt_tokens,
                                  item.completion_tokens or usage.completion_tokens)
                    if item.finished:
                        finish = item.finish_reason or "stop"
                        if not turn.speech:
                            slot.release()
                else:
                    if getattr(item, "t_end", 0.0):
                        pieces.append((item.t_start, item.t_end))
                    talker.extend(getattr(item, "talker_spans", None) or [])
                    if len(item.pcm):
                        now = time.perf_counter()
                        first_audio = first_audio if first_audio is not None else now - t0
                        last_audio = now - t0
                        audio_s += len(item.pcm) / SAMPLE_RATE
                        yield AudioChunk(item.pcm, index)
                        index += 1
                    if item.is_last:
                        slot.release()
            slot.release()
            self._window_metrics()
            outcome = "ok"
            metrics = {"ttft_s": ttft or 0.0}
            if first_audio is not None:
                metrics.update(first_audio_s=first_audio, rtf=last_audio / max(audio_s, 1e-9))
            self._record(ttft, first_audio, metrics.get("rtf"), audio_s)
            timings = stage_spans(turn, marks, talker, pieces) if turn.return_timings else None
            yield Done(usage, finish, audio_s, metrics, timings)
        except asyncio.TimeoutError:
            outcome = "timeout"
            yield Error(504, f"turn exceeded the {self.timeout_s:g} s request timeout", "timeout")
        finally:
            if slot is not None:
                slot.release()
            for p in pumps:
                p.cancel()
            for g in gens:
                _cancel(g)
            if outcome != "ok":
                self._abort_everywhere(rid)
            if self.metrics is not None:
                self.metrics.outcome(outcome)
            self._window_metrics()

    async def _bounded(self, aw: Any, deadline: float) -> Any:
        return await asyncio.wait_for(aw, timeout=max(0.0, deadline - time.perf_counter()))

    async def _pump(self, src: str, gen: Any, out: asyncio.Queue) -> None:
        try:
            async for item in gen:
                out.put_nowait((src, item))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stage call itself failed (replica died...)
            out.put_nowait((src, e))
        out.put_nowait((src, _END))

    def _abort_everywhere(self, rid: str) -> None:
        """Fire-and-forget: the caller may already be cancelled, so this runs on its own."""
        async def abort() -> None:
            calls = [self.stages.thinker.abort.remote(rid), self.stages.talker.abort.remote(rid),
                     self.stages.code2wav.abort.remote(rid)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    log.warning("abort of %s failed: %r", rid, r)

        # A fresh context: Serve links handle calls made in a request's context to that
        # request and cancels them with it, and this request is being cancelled right now.
        task = asyncio.get_running_loop().create_task(abort(), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _record(self, ttft, first_audio, rtf, audio_s) -> None:
        if self.metrics is None:
            return
        if ttft is not None:
            self.metrics.ttft.observe(ttft)
        if first_audio is not None:
            self.metrics.first_audio.observe(first_audio)
            self.metrics.rtf.observe(rtf)
            self.metrics.audio_seconds.inc(audio_s)

    def _window_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.window(self.window.active, self.window.waiting)


def _cause(e: BaseException) -> str:
    """The innermost message of a (possibly Ray-wrapped) stage exception."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {cause}".splitlines()[0][:500]


def _cancel(gen: Any) -> None:
    cancel = getattr(gen, "cancel", None)
    if cancel is not None:
        try:
            cancel()
        except Exception:
            log.debug("cancel of a stage stream failed", exc_info=True)


def stage_spans(turn: PreparedTurn, marks: dict[str, float], talker: list[tuple[float, float]],
                pieces: list[tuple[float, float]]) -> dict[str, Any]:
    """Per-stage spans of one turn in seconds since it arrived (docs/bench.md section 2.3).
    `queue` runs until the Thinker admits the request (window, stage opens, admission);
    a `talker` span runs from the previous chunk's release (the first prefill for chunk 0)
    to this chunk's release; a `code2wav` span is the engine step that made the chunk."""
    t0 = turn.arrival
    spans: list[dict[str, Any]] = []

    def span(stage: str, start: float | None, end: float | None, **extra: Any) -> None:
        if start and end and end >= start:
            spans.append({"stage": stage, "start": round(start - t0, 6),
                          "end": round(end - t0, 6), **extra})

    req = turn.thinker_request
    span("preprocess", t0, turn.prepared)
    span("queue", turn.prepared, marks.get("admitted"))
    if req.images:
        span("vision_encoder", marks.get("admitted"), marks.get("vision_end"))
    if req.audios:
        span("audio_encoder", marks.get("vision_end"), marks.get("audio_end"))
    span("prefill", marks.get("audio_end"), marks.get("first_token"))
    span("decode", marks.get("first_token"), marks.get("last_token"))
    for i, (start, end) in enumerate(talker):
        span("talker", start, end, chunk=i)
    for i, (start, end) in enumerate(pieces):
        span("code2wav", start, end, chunk=i)
    durations: dict[str, float] = {}
    for s in spans:
        durations[s["stage"]] = round(durations.get(s["stage"], 0.0) + s["end"] - s["start"], 6)
    return {"clock": "seconds since the request arrived", "spans": spans, "durations": durations}
