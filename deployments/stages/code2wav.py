"""Code2Wav deployment: a Code2WavEngine behind the shared StageServer.

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
from contextlib import aclosing
from typing import Any

import numpy as np

from deployments.config import AppConfig
from deployments.stages.forward import Forwarder
from deployments.stages.server import StageServer
from deployments.wire import AudioPiece, NamedVoice, error_line
from pipeline.code2wav.slots import NoFreeSlot
from pipeline.handoff import CodeChunk, PcmChunk, StageFailure

VOICE_RATE = 16000  # the ingress decodes reference audio to 16 kHz mono


class Code2WavServer(StageServer):
    stage = "code2wav"

    def __init__(self, app: AppConfig | dict, *, engine_cls: Any = None, source: Any = None):
        super().__init__(app, engine_cls=engine_cls, source=source)
        self._pushed: dict[str, int] = {}  # codes received per open stream
        self._talker_spans: dict[str, list[tuple[float, float]]] = {}
        self._named: dict[str, Any] = {}  # stored voice id -> its prompt (worker thread only)

    def _default_engine(self, device: str, settings: dict[str, Any]) -> tuple[Any, dict]:
        from pipeline.code2wav.engine import Code2WavEngine

        return Code2WavEngine, settings

    def _route(self, out: PcmChunk) -> tuple[str, AudioPiece]:
        pcm = out.pcm.reshape(-1).astype(np.float32, copy=False)
        return out.request_id, AudioPiece(pcm, out.finished, self.loop.step_started_at, time.time())

    async def stream(self, rid: str, voice: Any = None) -> AsyncIterator[Any]:
        """One turn's audio: Opened once the stream holds its voice state, then AudioPiece
        (float32 24 kHz PCM, in order) until `is_last`, Heartbeats while waiting for codes, or
        a StageFailure. The default voice (None) cannot be refused, so its open is queued for
        the next step boundary and Opened comes at once: the ingress starts the Thinker without
        waiting for a running chunk (tens of ms). A reference or stored voice is built first,
        so a voice the front end refuses is an error before anything streams. Cancelling the
        stream (the turn is over) frees its state."""
        async with aclosing(self._serve(rid, voice, forward=False)) as items:
            async for item in items:
                yield item

    async def _open(self, rid: str, voice: Any) -> StageFailure | None:
        if voice is None:
            self.loop.post(self._open_default(rid, asyncio.get_running_loop()))
            failure = None
        else:
            failure = await super()._open(rid, voice)
        if failure is None:
            self._pushed[rid] = 0
        return failure

    def _takes_hops(self, rid: str) -> bool:
        return rid in self._pushed

    def _open_default(self, rid: str, aloop: asyncio.AbstractEventLoop):
        def open_default(engine: Any) -> None:  # worker thread, before any push of rid
            try:
                engine.open(rid, None)
            except Exception as e:
                failure = (self._refused(e) if isinstance(e, NoFreeSlot) else StageFailure(
                    "code2wav", f"could not open the stream: {type(e).__name__}: {e}"))
                aloop.call_soon_threadsafe(self.loop.deliver, rid, failure)
                raise

        return open_default

    def _engine_spec(self, engine: Any, voice: Any) -> Any:
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

    def _refused(self, e: Exception) -> StageFailure | None:
        if isinstance(e, NoFreeSlot):
            return StageFailure("code2wav", f"could not open the stream: {e}", 503, "stage_busy")
        # Any other error building a voice is the front end refusing it.
        message = f"the voice could not be used: {error_line(e)}"
        return StageFailure("code2wav", message, 400, "voice_error")

    def _emit(self, rid: str, pieces: list[AudioPiece], fwd: Forwarder | None) -> tuple[list, bool]:
        pieces[0].talker_spans = self._talker_spans.pop(rid, [])
        return pieces, pieces[-1].is_last

    async def push(
        self,
        rid: str,
        codes: np.ndarray,
        final: bool,
        talker_spans: list[tuple[float, float]] | None = None,
    ) -> bool:
        """Codes (n,) int64 of stream `rid`, in order; False if the stream is gone.
        `talker_spans`: the Talker's (start, end) per chunk, handed on with the audio. Codes
        that come before the stream opened wait for it (up to `timeouts.open_s`)."""
        if rid not in self._pushed and not await self._opens(rid):
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
        await self.loop.call(lambda e: self._engine_spec(e, voice))

    async def forget_voice(self, voice_id: str) -> None:
        def forget(engine: Any) -> None:
            prompt = self._named.pop(voice_id, None)
            if prompt is not None:
                engine.unpin_voice(prompt)

        await self.loop.call(forget)

    def _forget(self, rid: str) -> None:
        self._talker_spans.pop(rid, None)
        self._pushed.pop(rid, None)

    def _leaks(self, engine: dict[str, Any]) -> list[str]:
        open_ = len(self.loop.open_keys)
        if len(self._pushed) > open_:
            return [f"{len(self._pushed)} push records for {open_} open streams"]
        return []

    def _extra_stats(self) -> dict[str, Any]:
        return {"streams": len(self._pushed), "named_voices": len(self._named)}
