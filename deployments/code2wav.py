"""Code2Wav deployment: a Code2WavEngine behind an EngineLoop.

Per turn: the ingress holds `stream(rid, voice)` open, which clones the voice's initial
state and then yields AudioPiece (float32 24 kHz PCM, in order) until `is_last`; the Talker
calls `push(rid, codes, final)` as chunks arrive (fed to the engine as a CodeChunk). Ready
chunks of several streams are decoded in one engine step (batched across streams). Voices
are resolved here into the engine's VoicePrompt: None is the default voice, a waveform is
reference audio, a stored voice (`register_voice`) keeps its prompt and pins its template;
`voice_support()` says whether reference voices can be built at all (the checkpoint's voice
front end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from deployments.config import AppConfig
from deployments.loop import EngineLoop, StageFailure
from deployments.metrics import StageMetrics
from deployments.stage import (
    AudioPiece,
    NamedVoice,
    Opened,
    Tombstones,
    build_engine,
    check_loop_health,
    engine_scope,
    error_line,
    next_item,
    stage_init,
    stage_stats,
)
from pipeline.handoff import CodeChunk, PcmChunk

VOICE_RATE = 16000  # the ingress decodes reference audio to 16 kHz mono


def _route(out: PcmChunk, step_start: float = 0.0) -> tuple[str, AudioPiece]:
    pcm = out.pcm.reshape(-1).astype(np.float32, copy=False)
    return out.request_id, AudioPiece(pcm, out.finished, step_start, time.time())


class Code2WavServer:
    def __init__(self, app: AppConfig | dict, *, engine_cls: Any = None, source: Any = None):
        from pipeline.checkpoint import ModelSource

        cfg = AppConfig.model_validate(app)
        source = source or ModelSource.open(cfg.model)
        if engine_cls is None:
            from pipeline.code2wav.engine import Code2WavEngine

            engine_cls = Code2WavEngine
        with stage_init(cfg, "code2wav") as device:
            self.engine = build_engine(engine_cls, source, cfg.code2wav.engine, device)
        self.metrics = StageMetrics("code2wav")
        self.metrics.engine_stats = self.engine.stats
        self.loop = EngineLoop(
            self.engine,
            name="code2wav",
            route=lambda out: _route(out, self.loop.step_started_at),
            on_step=self.metrics.on_step,
            on_streams=self.metrics.streams,
            on_failure=self._abort_all,
            scope=engine_scope(cfg, "code2wav"),
        )
        self.timeouts = cfg.timeouts
        self._pushed: dict[str, int] = {}  # codes received per open stream
        self._aborted = Tombstones()
        self._talker_spans: dict[str, list[tuple[float, float]]] = {}
        self._named: dict[str, Any] = {}  # stored voice id -> its prompt (worker thread only)

    def _abort_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:
            engine.abort(rid)

    def _prompt(self, engine: Any, voice: Any) -> Any:
        """The engine's voice spec for None (the default voice), a 16 kHz waveform (reference
        audio, cached by content in the engine's VoiceCache) or a NamedVoice (built once,
        its template pinned). Runs on the worker thread."""
        if voice is None:
            return None
        if isinstance(voice, NamedVoice):
            prompt = self._named.get(voice.voice_id)
            if prompt is None:
                prompt = engine.voices.from_audio(voice.samples, VOICE_RATE)
                self._named[voice.voice_id] = prompt
                engine.pin_voice(prompt)
            return prompt
        return engine.voices.from_audio(voice, VOICE_RATE)

    async def stream(self, rid: str, voice: Any = None) -> AsyncIterator[Any]:
        """One turn's audio: Opened once the stream holds its voice state, then AudioPiece
        (float32 24 kHz PCM, in order) until `is_last`, Heartbeats while waiting for codes, or
        a StageFailure. The default voice (None) cannot be refused, so its open is queued for
        the next step boundary and Opened comes at once: the ingress starts the Thinker without
        waiting for a running chunk (tens of ms). A reference or stored voice is built first,
        so a voice the front end refuses is an error before anything streams. Cancelling the
        stream (the turn is over) frees its state."""
        if rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        q = self.loop.open(rid)
        t = self.timeouts
        try:
            if voice is None:
                self.loop.post(self._open_default(rid, asyncio.get_running_loop()))
            else:
                try:
                    await self.loop.call(lambda e: e.open(rid, self._prompt(e, voice)))
                except Exception as e:  # noqa: BLE001 - the front end refused this voice
                    yield StageFailure(
                        "code2wav",
                        f"the voice could not be used: {error_line(e)}",
                        400,
                        "voice_error",
                    )
                    return
            if rid in self._aborted:  # aborted while the engine was opening it
                return
            self._pushed[rid] = 0
            yield Opened("code2wav")
            while True:
                item = await next_item(q, self.loop, "code2wav", t.heartbeat_s, t.wedge_s)
                if isinstance(item, AudioPiece):
                    item.talker_spans = self._talker_spans.pop(rid, [])
                yield item
                if isinstance(item, StageFailure) or (
                    isinstance(item, AudioPiece) and item.is_last
                ):
                    return
        finally:
            self._release(rid)

    def _open_default(self, rid: str, aloop: asyncio.AbstractEventLoop):
        def open_default(engine: Any) -> None:  # worker thread, before any push of rid
            try:
                engine.open(rid, None)
            except Exception as e:
                aloop.call_soon_threadsafe(
                    self.loop.deliver,
                    rid,
                    StageFailure("code2wav", f"could not open the stream: {type(e).__name__}: {e}"),
                )
                raise

        return open_default

    async def push(
        self,
        rid: str,
        codes: np.ndarray,
        final: bool,
        talker_spans: list[tuple[float, float]] | None = None,
    ) -> bool:
        """Codes (n,) int64 of stream `rid`, in order; False if the stream is gone.
        `talker_spans`: the Talker's (start, end) per chunk, handed on with the audio."""
        if rid not in self._pushed:
            return False
        if talker_spans:
            self._talker_spans.setdefault(rid, []).extend(talker_spans)
        self._pushed[rid] += len(codes)
        if final and self._pushed[rid] == 0:
            # Nothing was spoken: end the stream without running the engine.
            self.loop.deliver(rid, AudioPiece(np.zeros(0, np.float32), True))
            return True
        chunk = CodeChunk(rid, tuple(codes.tolist()), final)
        await self.loop.call(lambda e: e.feed(rid, chunk))
        return True

    async def voice_support(self) -> str | None:
        """None when reference voices can be built; otherwise why not (e.g. the checkpoint
        has no voice front end)."""

        def support(engine: Any) -> str | None:
            try:
                engine.voices.frontend()
            except Exception as e:  # noqa: BLE001 - the reason is what the client is told
                return f"{type(e).__name__}: {e}"
            return None

        return await self.loop.call(support)

    async def register_voice(self, voice_id: str, samples: np.ndarray) -> None:
        """Build a stored voice's prompt and template now, so its first turn pays nothing and
        a clip the front end refuses is refused at upload."""
        voice = NamedVoice(voice_id, np.asarray(samples, dtype=np.float32))
        await self.loop.call(lambda e: self._prompt(e, voice))

    async def forget_voice(self, voice_id: str) -> None:
        def forget(engine: Any) -> None:
            prompt = self._named.pop(voice_id, None)
            if prompt is not None:
                engine.unpin_voice(prompt)

        await self.loop.call(forget)

    def _release(self, rid: str) -> None:
        self._talker_spans.pop(rid, None)
        had = self._pushed.pop(rid, None) is not None
        if had or self.loop.is_open(rid):
            self.loop.close(rid)
            self.loop.post(lambda e: e.abort(rid))

    async def abort(self, rid: str) -> None:
        self._aborted.add(rid)
        q = self.loop.queue(rid)
        if q is not None:  # ends the stream at its next item
            q.put_nowait(StageFailure("code2wav", "aborted", 499, "cancelled"))
        self._release(rid)

    async def stats(self) -> dict[str, Any]:
        engine = await self.loop.call(lambda e: e.stats())
        open_ = len(self.loop.open_keys)
        streams = int(engine["open_streams"])
        leaks = []
        if len(self._pushed) > open_:
            leaks.append(f"{len(self._pushed)} push records for {open_} open streams")
        return stage_stats(
            self.loop,
            self.timeouts.wedge_s,
            engine,
            streams,
            leaks,
            streams=len(self._pushed),
            named_voices=len(self._named),
        )

    def check_health(self) -> None:
        check_loop_health(self.loop, self.timeouts.wedge_s)
