"""Code2Wav deployment: a Code2WavEngine behind an EngineLoop.

Per turn: `open(rid, voice)` clones the voice's initial state; the Talker calls
`push(rid, codes, final)` as chunks arrive; the ingress reads `stream(rid)`, which yields
AudioPiece (float32 24 kHz PCM, in order) until `is_last`. Ready chunks of several streams
are decoded in one engine step (batched across streams). Pieces produced before the
ingress starts reading are kept in the stream's queue. A Talker failure arrives through
`fail(rid, ...)` and ends the stream with a StageFailure.
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
    Tombstones,
    build_engine,
    device_memory,
    stage_init,
    stats_dict,
)


def _route(out: Any, step_start: float = 0.0) -> tuple[str, AudioPiece]:
    stream_id, pcm, is_last = out
    pcm = pcm.detach().float().cpu().numpy() if hasattr(pcm, "detach") else np.asarray(pcm)
    return stream_id, AudioPiece(pcm.reshape(-1).astype(np.float32, copy=False), bool(is_last),
                                 step_start, time.time())


class RealCode2Wav:
    """The real engine behind the `from_source(source, config, device)` protocol, plus the
    voice handling the engine leaves to its caller: None = the checkpoint's default voice,
    a waveform = reference audio through the voice front-end (cached by content)."""

    @staticmethod
    def from_source(source: Any, config: Any, device: str) -> Any:
        import torch

        from pipeline.code2wav.assets import load_code2wav, token2wav_dir
        from pipeline.code2wav.engine import Code2WavEngine
        from pipeline.code2wav.voice import VoiceCache

        # fp32 on every device: the reference runs the flow and HiFT in fp32, and a lower
        # precision would change the audio.
        if source.path is None:  # random-full: full-size random flow + HiFT, default voice
            from pipeline.code2wav.assets import random_code2wav

            c2w_cfg = source.config.code2wav
            flow, hift = random_code2wav(c2w_cfg, seed=0)
            flow, hift = flow.to(device), hift.to(device)
            voice_dir = source.tokenizer_dir  # the tiny default's assets: same voice format
        else:
            flow, hift, c2w_cfg = load_code2wav(source.path, device, torch.float32)
            voice_dir = source.path
        voices = VoiceCache(token2wav_dir(voice_dir))
        engine = Code2WavEngine(flow, hift, c2w_cfg, config, voices=voices)
        engine.warmup()  # default voice's template; CFM graph captures before the first request
        return _VoicedEngine(engine, voices)

    @staticmethod
    def config_class() -> Any:
        from pipeline.code2wav.engine import Code2WavEngineConfig

        return Code2WavEngineConfig


class _VoicedEngine:
    """Turns `open_stream(rid, waveform | None)` into the engine's VoicePrompt call."""

    VOICE_RATE = 16000  # the ingress decodes ref_audio to 16 kHz mono

    def __init__(self, engine: Any, voices: Any):
        self.engine, self.voices = engine, voices

    def open_stream(self, stream_id: str, voice: Any) -> None:
        prompt = self.voices.default() if voice is None else self.voices.from_audio(
            voice, self.VOICE_RATE)
        self.engine.open_stream(stream_id, prompt)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def stats(self) -> dict[str, Any]:
        return {"streams": len(self.engine.streams), **dict(self.engine.counters)}


class Code2WavServer:
    def __init__(self, app: AppConfig | dict, *, engine_cls: Any = None, source: Any = None):
        from pipeline.checkpoint import ModelSource

        cfg = AppConfig.model_validate(app)
        source = source or ModelSource.open(cfg.model)
        config_cls = None if engine_cls else RealCode2Wav.config_class()
        with stage_init(cfg, "code2wav") as device:
            self.engine = build_engine(engine_cls or RealCode2Wav, source, cfg.code2wav.engine,
                                       device, config_cls)
        self.metrics = StageMetrics("code2wav")
        self.metrics.engine_stats = lambda: stats_dict(self.engine.stats())
        self.loop = EngineLoop(self.engine, name="code2wav",
                               route=lambda out: _route(out, self.loop.step_started_at),
                               on_step=self.metrics.on_step, on_failure=self._close_all)
        self._pushed: dict[str, int] = {}  # codes received per open stream
        self._aborted = Tombstones()
        self._talker_spans: dict[str, list[tuple[float, float]]] = {}

    def _close_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:
            engine.close_stream(rid)

    async def open(self, rid: str, voice: np.ndarray | None = None) -> None:
        """Open `rid`'s stream. The default voice (None) cannot be refused, so its open is
        queued for the next step boundary and this returns at once: the ingress starts the
        Thinker without waiting for a running chunk (tens of ms). A reference voice is
        awaited, so a voice the front end refuses is an error before anything streams."""
        if rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        self.loop.open(rid)
        if voice is None:
            self.loop.post(self._open_default(rid, asyncio.get_running_loop()))
            self._pushed[rid] = 0
            return
        try:
            await self.loop.call(lambda e: e.open_stream(rid, voice))
        except BaseException:
            self.loop.close(rid)
            raise
        if rid in self._aborted:  # aborted while the engine was opening it
            self.loop.close(rid)
            self.loop.post(lambda e: e.close_stream(rid))
            raise RuntimeError(f"request {rid} was aborted")
        self._pushed[rid] = 0

    def _open_default(self, rid: str, aloop: asyncio.AbstractEventLoop):
        def open_stream(engine: Any) -> None:  # worker thread, before any push of rid
            try:
                engine.open_stream(rid, None)
            except Exception as e:
                aloop.call_soon_threadsafe(self.loop.deliver, rid, StageFailure(
                    "code2wav", f"could not open the stream: {type(e).__name__}: {e}"))
                raise

        return open_stream

    async def push(self, rid: str, codes: np.ndarray, final: bool,
                   talker_spans: list[tuple[float, float]] | None = None) -> bool:
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
        await self.loop.call(lambda e: e.push_codes(rid, codes.tolist(), final))
        return True

    async def fail(self, rid: str, stage: str, message: str) -> None:
        self.loop.deliver(rid, StageFailure(stage, message))

    async def stream(self, rid: str) -> AsyncIterator[AudioPiece | StageFailure]:
        q = self.loop.queue(rid)
        if q is None:
            yield StageFailure("code2wav", f"stream {rid!r} is not open")
            return
        try:
            while True:
                item = await q.get()
                if isinstance(item, AudioPiece):
                    item.talker_spans = self._talker_spans.pop(rid, [])
                yield item
                if isinstance(item, StageFailure) or item.is_last:
                    return
        finally:
            await self.abort(rid)

    async def abort(self, rid: str) -> None:
        self._aborted.add(rid)
        self._talker_spans.pop(rid, None)
        if self._pushed.pop(rid, None) is None and not self.loop.is_open(rid):
            return
        self.loop.close(rid)
        self.loop.post(lambda e: e.close_stream(rid))

    async def stats(self) -> dict[str, Any]:
        engine = await self.loop.call(
            lambda e: stats_dict(e.stats()) if hasattr(e, "stats") else {})
        return {"open": len(self.loop.open_keys), "streams": len(self._pushed),
                "steps": self.loop.steps, "failures": self.loop.failures, "engine": engine,
                **device_memory()}
