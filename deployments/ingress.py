"""Ingress deployment: the OpenAI-compatible HTTP API and the `chat` handle method.

Routes (FastAPI, built per replica by `__serve_build_asgi_app__`):
    POST /v1/chat/completions   stream (SSE) or not; text and/or audio out
    GET  /v1/models             the one served model
    GET  /health                200 while the replica is up (readiness: `serve status`)
Handle (other Ray apps): `serve.get_app_handle("omniray").options(stream=True)
    .chat.remote(request_dict)` yields deployments.schemas events.

The ingress validates, loads media (data: / allowed file:// / allowed hosts), runs the
Processor (chat template, image slices, audio features) off the event loop, then hands
the turn to TurnRunner (window + stages). Every bad request is a 4xx in the OpenAI error
shape before any stage is touched.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from deployments.config import AppConfig
from deployments.formats import ChunkWriter, completion_body, error_body
from deployments.media import MediaLoader, b64decode, pcm16_to_wav
from deployments.metrics import AppMetrics
from deployments.schemas import (
    ApiError,
    AudioChunk,
    ChatCompletionRequest,
    Done,
    Error,
    Event,
    TextDelta,
    validation_message,
)
from deployments.turn import PreparedTurn, Stages, TurnRunner
from deployments.window import ActiveStreamWindow

_MEDIA_KIND = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


class IngressServer:
    def __init__(self, app: AppConfig | dict, thinker: Any, talker: Any, code2wav: Any, *,
                 source: Any = None):
        from pipeline.checkpoint import ModelSource, default_checkpoint
        from pipeline.processing.processor import MediaLimits, Processor
        from pipeline.tokenizer import TextTokenizer

        cfg = AppConfig.model_validate(app)
        self.cfg = cfg
        source = source or ModelSource.open(cfg.model)
        tokenizer = TextTokenizer.from_dir(source.path or default_checkpoint())
        lim = cfg.limits
        limits = MediaLimits(**{k: getattr(lim, k) for k in MediaLimits.__dataclass_fields__})
        self.processor = Processor(source.config.thinker, tokenizer, limits)
        self.media = MediaLoader(allowed_dir=cfg.allowed_local_media_path,
                                 allowed_hosts=cfg.allowed_media_hosts,
                                 max_bytes=lim.max_media_bytes)
        self.model_names = {cfg.name} | ({Path(cfg.model).name, cfg.model} if cfg.model else set())
        self.window = ActiveStreamWindow(cfg.active_stream_window)
        self.metrics = AppMetrics()
        self.turns = TurnRunner(Stages(thinker, talker, code2wav), self.window, self.metrics,
                                cfg.request_timeout_s)

    def __serve_build_asgi_app__(self) -> Any:
        from deployments.routes import build_routes

        return build_routes(self)

    # -- handle API ----------------------------------------------------------------------

    async def chat(self, request: dict | ChatCompletionRequest) -> AsyncIterator[Event]:
        """Typed events of one turn: TextDelta / AudioChunk ..., then Done or Error."""
        try:
            turn = await self.prepare(self.parse(request))
        except ApiError as e:
            self.metrics.outcome("rejected")
            yield Error(e.status, e.message, "invalid_request")
            return
        async for ev in self.turns.run(turn):
            yield ev

    async def stats(self) -> dict[str, Any]:
        return {"window": self.window.stats()}

    async def reset_window_peaks(self) -> None:
        self.window.reset_peaks()

    # -- validation and preparation ------------------------------------------------------

    def parse(self, obj: Any) -> ChatCompletionRequest:
        if isinstance(obj, ChatCompletionRequest):
            return obj
        if not isinstance(obj, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            return ChatCompletionRequest.model_validate(obj)
        except ValidationError as e:
            msg, param = validation_message(e.errors())
            raise ApiError(400, msg, param=param) from None

    async def prepare(self, req: ChatCompletionRequest) -> PreparedTurn:
        rid = uuid.uuid4().hex[:24]
        arrival = time.time()
        # Decoding and feature extraction are CPU work: keep them off the event loop.
        turn = await asyncio.to_thread(self._prepare, req, rid)
        turn.arrival, turn.prepared = arrival, time.time()
        return turn

    def _prepare(self, req: ChatCompletionRequest, rid: str) -> PreparedTurn:
        from pipeline.handoff import SamplingParams
        from pipeline.processing.errors import MediaError

        if req.model is not None and req.model not in self.model_names:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{self.cfg.name!r}", param="model", code="model_not_found")
        lim = self.cfg.limits
        ext = req.omniray
        max_tokens = req.token_limit or min(lim.default_max_tokens, lim.max_tokens)
        ignore_eos = req.ignore_eos or bool(ext and ext.ignore_eos)
        if ext and ext.fixed_text_tokens:  # exactly N text tokens
            max_tokens, ignore_eos = ext.fixed_text_tokens, True
        if max_tokens > lim.max_tokens:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of "
                                f"{lim.max_tokens}", param="max_tokens")
        try:
            sampling = SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k),
                repetition_penalty=req.repetition_penalty, max_tokens=max_tokens,
                ignore_eos=ignore_eos, seed=req.seed)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        messages = [self._message(i, m) for i, m in enumerate(req.messages)]
        try:
            thinker_req = self.processor.build(messages, speech_output=req.speech,
                                               sampling=sampling, request_id=rid)
            voice = self._voice(req) if req.speech else None
        except MediaError as e:
            raise ApiError(getattr(e, "http_status", 400), str(e)) from None
        except ValueError as e:  # e.g. a template or decoder refusing an odd input
            raise ApiError(400, f"invalid request: {e}") from None
        return PreparedTurn(rid, thinker_req, req.speech, voice, req.seed,
                            text="text" in req.modalities,
                            speech_codes=ext.fixed_speech_codes if ext else None,
                            return_timings=bool(ext and ext.return_timings))

    def _message(self, i: int, m: Any) -> dict[str, Any]:
        if isinstance(m.content, str):
            return {"role": m.role, "content": m.content}
        parts: list[dict[str, Any]] = []
        for j, p in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if p.type == "text":
                parts.append({"type": "text", "text": p.text})
                continue
            if m.role != "user":
                raise ApiError(400, f"{where}: media parts are only allowed in user messages",
                               param=where)
            if p.type == "input_audio":
                data = b64decode(p.input_audio.data, where)
                if p.input_audio.format == "pcm16":
                    data = pcm16_to_wav(data)
                parts.append({"type": "audio", "data": data})
            else:
                ref = getattr(p, p.type)
                parts.append({"type": _MEDIA_KIND[p.type], "data": self.media.load(ref.url, where)})
        return {"role": m.role, "content": parts}

    def _voice(self, req: ChatCompletionRequest) -> np.ndarray | None:
        if req.ref_audio is None:
            return None
        from pipeline.processing.audio import decode_audio

        data = self.media.load(req.ref_audio, "ref_audio")
        return decode_audio(data, max_seconds=self.cfg.limits.max_ref_audio_seconds)

    # -- HTTP helpers (used by routes.py) ------------------------------------------------

    async def sse(self, req: ChatCompletionRequest, turn: PreparedTurn) -> AsyncIterator[str]:
        opts = req.stream_options
        writer = ChunkWriter(turn.request_id, self.cfg.name, req.audio.format,
                             include_usage=opts.include_usage if opts else True)
        async for ev in self.turns.run(turn):
            if isinstance(ev, TextDelta):
                yield writer.text(ev.text)
            elif isinstance(ev, AudioChunk):
                yield writer.audio(ev)
            elif isinstance(ev, Done):
                for s in writer.done(ev):
                    yield s
            elif isinstance(ev, Error):
                for s in writer.error(ev):
                    yield s

    async def complete(self, req: ChatCompletionRequest,
                       turn: PreparedTurn) -> tuple[int, dict[str, Any]]:
        text, pcm = [], []
        async for ev in self.turns.run(turn):
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            elif isinstance(ev, AudioChunk):
                pcm.append(ev.pcm)
            elif isinstance(ev, Error):
                return ev.status, error_body(ev.status, ev.message, ev.reason)
            elif isinstance(ev, Done):
                return 200, completion_body(turn.request_id, self.cfg.name, "".join(text), pcm,
                                            ev, req.audio.format, turn.speech)
        return 500, error_body(500, "turn ended without a terminal event")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.cfg.name, "object": "model",
                                            "created": int(time.time()), "owned_by": "omniray",
                                            "root": self.cfg.model or "tiny"}]}
