"""Code2Wav deployment: a Code2WavEngine behind an EngineLoop.

Per turn: the ingress holds `stream(rid, voice)` open, which clones the voice's initial
state and then yields AudioPiece (float32 24 kHz PCM, in order) until `is_last`; the Talker
calls `push(rid, codes, final)` as chunks arrive. Ready chunks of several streams are
decoded in one engine step (batched across streams). Stored voices (`register_voice`) keep
their prompt and pin their template; `voice_support()` says whether reference voices can be
built at all (the checkpoint's voice front end).
"""

from __future__ import annotations

import asyncio
import dataclasses
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
            from pipeline.code2wav.assets import random_code2wav, random_vocoder

            c2w_cfg = source.config.code2wav
            flow, _ = random_code2wav(c2w_cfg, seed=0)
            hift = random_vocoder(c2w_cfg, 0, "minicpmo-utils-1.0.7")  # the causal one, as released
            flow, hift = flow.to(device), hift.to(device)
            voice_dir = source.tokenizer_dir  # the tiny default's assets: same voice format
        else:
            flow, hift, c2w_cfg = load_code2wav(source.path, device, torch.float32)
            voice_dir = source.path
        voices = VoiceCache(token2wav_dir(voice_dir))
        if torch.device(device).type != "cuda" and config.token2wav_compile_estimator:
            # Inductor on CPU needs a C++ compiler and minutes of start-up; the knob is for GPUs
            config = dataclasses.replace(config, token2wav_compile_estimator=False)
        engine = Code2WavEngine(flow, hift, c2w_cfg, config, voices=voices)
        engine.warmup()  # default voice's template; CFM graph captures before the first request
        return _VoicedEngine(engine, voices)

    @staticmethod
    def config_class() -> Any:
        from pipeline.code2wav.engine import Code2WavEngineConfig

        return Code2WavEngineConfig


class _VoicedEngine:
    """Turns `open_stream(rid, None | waveform | NamedVoice)` into the engine's VoicePrompt
    call."""

    VOICE_RATE = 16000  # the ingress decodes reference audio to 16 kHz mono

    def __init__(self, engine: Any, voices: Any):
        self.engine, self.voices = engine, voices
        self.named: dict[str, Any] = {}  # voice id -> VoicePrompt

    def prompt(self, voice: Any) -> Any:
        if voice is None:
            return self.voices.default()
        if isinstance(voice, NamedVoice):
            prompt = self.named.get(voice.voice_id)
            if prompt is None:
                prompt = self.voices.from_audio(voice.samples, self.VOICE_RATE)
                self.named[voice.voice_id] = prompt
                self.engine.pin_voice(prompt)
            return prompt
        return self.voices.from_audio(voice, self.VOICE_RATE)

    def open_stream(self, stream_id: str, voice: Any) -> None:
        self.engine.open_stream(stream_id, self.prompt(voice))

    def prepare_voice(self, voice: NamedVoice) -> None:
        self.prompt(voice)

    def forget_voice(self, voice_id: str) -> None:
        prompt = self.named.pop(voice_id, None)
        if prompt is not None:
            self.engine.unpin_voice(prompt)

    def voice_support(self) -> str | None:
        try:
            self.voices.frontend()
        except Exception as e:  # noqa: BLE001 - the reason is what the client is told
            return f"{type(e).__name__}: {e}"
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def stats(self) -> dict[str, Any]:
        return {"streams": len(self.engine.streams), "named_voices": len(self.named),
                **dict(self.engine.counters)}


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
                               on_step=self.metrics.on_step, on_streams=self.metrics.streams,
                               on_failure=self._close_all, scope=engine_scope(cfg, "code2wav"))
        self.timeouts = cfg.timeouts
        self._pushed: dict[str, int] = {}  # codes received per open stream
        self._aborted = Tombstones()
        self._talker_spans: dict[str, list[tuple[float, float]]] = {}

    def _close_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:
            engine.close_stream(rid)

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
                    await self.loop.call(lambda e: e.open_stream(rid, voice))
                except Exception as e:  # noqa: BLE001 - the front end refused this voice
                    yield StageFailure("code2wav", f"the voice could not be used: "
                                       f"{error_line(e)}", 400, "voice_error")
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
                if isinstance(item, StageFailure) or (isinstance(item, AudioPiece)
                                                      and item.is_last):
                    return
        finally:
            self._release(rid)

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

    async def voice_support(self) -> str | None:
        """None when reference voices can be built; otherwise why not (e.g. the checkpoint
        has no voice front end)."""
        return await self.loop.call(
            lambda e: e.voice_support() if hasattr(e, "voice_support") else None)

    async def register_voice(self, voice_id: str, samples: np.ndarray) -> None:
        """Build a stored voice's prompt and template now, so its first turn pays nothing and
        a clip the front end refuses is refused at upload."""
        voice = NamedVoice(voice_id, np.asarray(samples, dtype=np.float32))
        await self.loop.call(lambda e: e.prepare_voice(voice) if hasattr(e, "prepare_voice")
                             else None)

    async def forget_voice(self, voice_id: str) -> None:
        await self.loop.call(lambda e: e.forget_voice(voice_id) if hasattr(e, "forget_voice")
                             else None)

    def _release(self, rid: str) -> None:
        self._talker_spans.pop(rid, None)
        had = self._pushed.pop(rid, None) is not None
        if had or self.loop.is_open(rid):
            self.loop.close(rid)
            self.loop.post(lambda e: e.close_stream(rid))

    async def abort(self, rid: str) -> None:
        self._aborted.add(rid)
        q = self.loop.queue(rid)
        if q is not None:  # ends the stream at its next item
            q.put_nowait(StageFailure("code2wav", "aborted", 499, "cancelled"))
        self._release(rid)

    async def stats(self) -> dict[str, Any]:
        engine = await self.loop.call(
            lambda e: stats_dict(e.stats()) if hasattr(e, "stats") else {})
        open_ = len(self.loop.open_keys)
        streams = engine.get("streams", 0)
        leaks = []
        if len(self._pushed) > open_:
            leaks.append(f"{len(self._pushed)} push records for {open_} open streams")
        return stage_stats(self.loop, self.timeouts.wedge_s, engine, streams, leaks,
                           streams=len(self._pushed))

    def check_health(self) -> None:
        check_loop_health(self.loop, self.timeouts.wedge_s)
