"""Ingress deployment: the OpenAI-compatible HTTP API and the `chat` handle method.

Routes (FastAPI, built per replica by `__serve_build_asgi_app__`):
    POST /v1/chat/completions        stream (SSE) or not; text and/or audio out
    GET  /v1/models[/{id}]           the served names (the configured one, the checkpoint's own)
    POST/GET /v1/audio/voices, GET/DELETE /v1/audio/voices/{id}   stored voices
    GET  /health                     200 while the replica is up (readiness: `serve status`)
Handle (other Ray apps): `serve.get_app_handle("omniray").options(stream=True)
    .chat.remote(request_dict)` yields deployments.wire events; `stats()` returns the
    window, every stage's stats and the app's invariants (`idle`, `leaks`).

The ingress validates, loads media (data: / allowed file:// / allowed hosts), runs the
Processor (chat template, image slices, audio features) off the event loop, keeping what
it made of each media part in a MediaCache (a follow-up turn re-sends the conversation's
media), then hands the turn to TurnRunner (window + stages). Every bad request is a 4xx
in the OpenAI error shape before any stage is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deployments.config import AppConfig
from deployments.duplex.backend import StageBackend
from deployments.duplex.manager import DuplexManager
from deployments.ingress.formats import (
    ChunkWriter,
    completion_body,
    error_body,
    model_card,
    models_body,
)
from deployments.ingress.media import MediaLoader, b64decode, pcm16_to_wav
from deployments.ingress.schemas import (
    DEFAULT_VOICES,
    ApiError,
    ChatCompletionRequest,
    check_talker_sampling,
    validation_message,
)
from deployments.ingress.turn import Group, PreparedTurn, Stages, TurnRunner
from deployments.ingress.voices import VoiceInfo, VoiceStore, without_paths
from deployments.ingress.window import ActiveStreamWindow
from deployments.metrics import AppMetrics
from deployments.wire import AudioChunk, Done, Error, Event, NamedVoice, TextDelta, error_line

log = logging.getLogger(__name__)
_MEDIA_KIND = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
_STATUS_REASON = {400: "invalid_request", 404: "not_found", 409: "conflict",
                  413: "too_large", 422: "invalid_request"}


def refusal_reason(e: ApiError) -> str:
    """The metrics reason of a refusal: its code when it has a name, else by status."""
    if isinstance(e.code, str):
        return e.code
    return _STATUS_REASON.get(e.status, f"http_{e.status}")


class IngressServer:
    def __init__(self, app: AppConfig | dict, thinker: Any, talker: Any, code2wav: Any, *,
                 source: Any = None):
        """thinker / talker / code2wav: one stage group's handles, or lists of them (one
        per group, in group order)."""
        from pipeline.checkpoint import ModelSource, cache_dir, default_checkpoint
        from pipeline.processing.media_cache import MediaCache
        from pipeline.processing.processor import MediaLimits, Processor
        from pipeline.tokenizer import TextTokenizer

        cfg = AppConfig.model_validate(app)
        self.cfg = cfg
        source = source or ModelSource.open(cfg.model)
        tokenizer = TextTokenizer.from_dir(source.path or default_checkpoint())
        lim = cfg.limits
        limits = MediaLimits(**{k: getattr(lim, k) for k in MediaLimits.__dataclass_fields__})
        # A follow-up turn re-sends the conversation's media: keep what processing made of it
        # (a copy made beside the request: it is only sent on from here).
        self.media_cache = MediaCache(lim.media_cache_bytes, store_in_background=True)
        self._building = 0  # requests being decoded (prepare) right now
        self.processor = Processor(source.config.thinker, tokenizer, limits,
                                   special_tokens_in_text=cfg.special_tokens_in_text,
                                   media_cache=self.media_cache)
        self.media = MediaLoader(allowed_dir=cfg.allowed_local_media_path,
                                 allowed_hosts=cfg.allowed_media_hosts,
                                 max_bytes=lim.max_media_bytes,
                                 allowed_networks=cfg.allowed_media_networks)
        # The served names (listed), and the checkpoint folder's path and name (accepted).
        self.served_names = cfg.served_model_names(source.config.raw)
        self.model_names = set(self.served_names) | (
            {Path(cfg.model).name, cfg.model} if cfg.model else set())
        self.talker_config = source.config.talker  # what sampling_params_list's entry 1 meets
        self.metrics = AppMetrics()
        handles = [h if isinstance(h, list | tuple) else [h] for h in (thinker, talker, code2wav)]
        if len({len(h) for h in handles}) != 1:
            raise ValueError("one thinker, talker and code2wav handle per group")
        n = len(handles[0])
        # Autoscaled groups past min_groups start with no replicas (app.scaling_options).
        always = cfg.min_groups if cfg.autoscaled else n
        grpc = cfg.stage_transport == "grpc"
        self.groups = [Group(f"g{i}" if n > 1 else "", Stages(*hs, grpc=grpc),
                             ActiveStreamWindow(cfg.window_per_ingress()),
                             scalable=i >= always, asleep=i >= always)
                       for i, hs in enumerate(zip(*handles))]
        self.stages = self.groups[0].stages  # what is asked of any one group (voice support)
        hold = cfg.talker_mode == "streaming"  # full_span never holds
        self.turns = TurnRunner(self.groups, self.metrics, cfg.request_timeout_s, cfg.timeouts,
                                idle_s=cfg.group_idle_s,
                                hold_rows=source.config.talker.streaming_text_chunk * hold)
        voices_dir = Path(cfg.voices_dir).expanduser() if cfg.voices_dir else cache_dir() / "voices"
        self.voices = VoiceStore(voices_dir, max_seconds=lim.max_ref_audio_seconds,
                                 max_voices=lim.max_voices)
        self._voice_support: tuple[str | None] | None = None  # (reason,) once asked
        self.realtime_sessions: dict[str, Any] = {}  # id -> RealtimeSession on this replica
        # full-duplex sessions (WS /v1/realtime?mode= / ?duplex=1), resident in the Thinkers
        self.duplex = DuplexManager(cfg.duplex, StageBackend(self.groups, cfg.ingress.num_replicas))
        from pipeline.processing.vad import silero_problem

        # Realtime sessions start with server VAD on: a host without its model says so here
        # (and in stats), not first in a session's error.
        self.server_vad_problem = silero_problem()
        if self.server_vad_problem is not None:
            log.warning("realtime server VAD unavailable, sessions will fail to start: %s",
                        self.server_vad_problem)
        from deployments.stages.gc_watch import freeze_startup_objects

        freeze_startup_objects()  # the tokenizer's and processor's tables: out of full GCs

    def __serve_build_asgi_app__(self) -> Any:
        from deployments.ingress.routes import build_routes

        return build_routes(self)

    # -- handle API ----------------------------------------------------------------------

    async def chat(self, request: dict | ChatCompletionRequest) -> AsyncIterator[Event]:
        """Typed events of one turn: TextDelta / AudioChunk ..., then Done or Error."""
        try:
            turn = await self.prepare(self.parse(request))
        except ApiError as e:
            self.refused(e)
            yield Error(e.status, e.message, refusal_reason(e))
            return
        async for ev in self.turns.run(turn):
            yield ev

    def refused(self, e: ApiError) -> None:
        """Count a request refused before it became a turn."""
        self.metrics.outcome("rejected", refusal_reason(e))

    async def stats(self) -> dict[str, Any]:
        """The window, the processed-media cache, every stage's stats, and the app's
        invariants: `idle` (no turn in flight and every stage holds nothing) and `leaks`
        (accounting that does not add up; empty unless something is broken)."""
        async def one(handle: Any) -> dict[str, Any]:
            try:
                return await asyncio.wait_for(handle.stats.remote(), self.cfg.timeouts.open_s)
            except Exception as e:  # noqa: BLE001 - a dead stage is reported, not raised
                return {"error": error_line(e)}

        self.turns.sleep_idle()
        names = ("thinker", "talker", "code2wav")
        # A sleeping group has no replicas; a call would wake it (and wait for the start).
        keys = [(f"{n}-{g.name}" if g.name else n, getattr(g.stages, n))
                for g in self.groups if not g.asleep for n in names]
        stages = dict(zip([k for k, _ in keys], await asyncio.gather(
            *(one(h) for _, h in keys))))
        windows = [g.window.stats() for g in self.groups]
        window = {k: sum(w[k] for w in windows) for k in windows[0]}
        in_flight = self.turns.in_flight
        speech = sum(in_flight.values())
        leaks = [f"{n}: {leak}" for n, st in stages.items() for leak in st.get("leaks", [])]
        if window["active"] + window["waiting"] > speech:
            leaks.append(f"window: {window['active']} active + {window['waiting']} waiting "
                         f"for {speech} speech turns in flight")
        duplex = self.duplex.stats()
        leaks += duplex["leaks"]
        idle = (not in_flight and window["active"] == 0 and window["waiting"] == 0
                and duplex["idle"] and all(st.get("idle", False) for st in stages.values()))
        return {"window": window, "turns": {"in_flight": len(in_flight), "speech": speech},
                "groups": [g.stats() for g in self.groups],
                "media_cache": self.media_cache_stats(), "stages": stages, "idle": idle,
                "realtime": {"sessions": len(self.realtime_sessions),
                             "history_bytes": sum(getattr(r, "history_bytes", 0)
                                                  for r in self.realtime_sessions.values()),
                             "outbound_bytes": sum(r.outbox.bytes for r in
                                                   self.realtime_sessions.values()
                                                   if hasattr(r, "outbox")),
                             "server_vad": self.server_vad_problem or "ok"},
                "duplex": duplex, "leaks": leaks}

    def media_cache_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self.media_cache.stats())

    async def reset_window_peaks(self) -> None:
        for g in self.groups:
            g.window.reset_peaks()

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
        if req.speech and (req.ref_audio is not None or self._stored_voice(req)):
            await self.require_voices("ref_audio" if req.ref_audio is not None else "audio.voice")
        loop = asyncio.get_running_loop()

        def on_media(items: list[Any]) -> None:  # a decode thread
            loop.call_soon_threadsafe(self._prefetch, items, req.speech)

        # A video's frames go a few at a time while it decodes only when this replica builds
        # no other request: with several at once its cores are what they compete for.
        alone = self._building == 0
        self._building += 1
        # Decoding and feature extraction are CPU work: keep them off the event loop.
        try:
            turn = await asyncio.to_thread(self._prepare, req, rid, on_media, alone)
        finally:  # on the event loop: the metrics' running totals are updated by one thread
            self._building -= 1
            self.metrics.media_cache(self.media_cache_stats())
        turn.arrival, turn.prepared = arrival, time.time()
        return turn

    def _prefetch(self, items: list[Any], speech: bool) -> None:
        """Media ready while the rest of the request still decodes (a video's frames, an
        audio part's clip), to the Thinker the turn will most likely go to (the only one with
        one group): its encoders work on them while this replica finishes the request. Best
        effort: a failed call costs the turn nothing but the head start."""
        thinker = self.turns.likely_group(speech).stages.thinker

        async def send() -> None:
            try:
                await asyncio.wait_for(thinker.prefetch.remote(items), self.cfg.timeouts.hop_s)
            except Exception as e:  # noqa: BLE001 - the turn's own call will tell
                log.info("prefetch of %d media did not land: %s", len(items), error_line(e))

        self.turns.in_background(send())

    async def require_voices(self, param: str) -> None:
        """400 unless the checkpoint can build reference voices (its voice front end)."""
        if self._voice_support is None:
            try:
                reason = await asyncio.wait_for(self.stages.code2wav.voice_support.remote(),
                                                self.cfg.timeouts.open_s)
            except Exception as e:  # noqa: BLE001 - the stage is down: ask again next time
                raise ApiError(503, f"Code2Wav is not answering: {error_line(e)}",
                               code="stage_unavailable", type="server_error") from None
            self._voice_support = (reason,)
        reason = self._voice_support[0]
        if reason is not None:  # the stage's reason names files: the client gets no paths
            raise ApiError(400, f"{param}: voice cloning is not available on this server: "
                                f"{without_paths(reason)}", param=param,
                           code="voices_unavailable")

    @staticmethod
    def _stored_voice(req: ChatCompletionRequest) -> str | None:
        key = req.audio.voice_key
        return None if key is None or key.lower() in DEFAULT_VOICES else key

    def _prepare(
        self, req: ChatCompletionRequest, rid: str, on_media: Any = None,
        frames_while_decoding: bool = True,
    ) -> PreparedTurn:
        from pipeline.handoff import SamplingParams
        from pipeline.processing.errors import MediaError

        if req.model is not None and req.model not in self.model_names:
            raise ApiError(404, f"model {req.model[:64]!r} does not exist; this server serves "
                                f"{' and '.join(map(repr, self.served_names))}",
                           param="model", code="model_not_found")
        check_talker_sampling(req, self.talker_config)
        lim = self.cfg.limits
        ext = req.omniray
        max_tokens = req.token_limit or min(lim.default_max_tokens, lim.max_tokens)
        ignore_eos = req.ignore_eos or bool(ext and ext.ignore_eos)
        if ext and ext.fixed_text_tokens:  # exactly N text tokens
            max_tokens, ignore_eos = ext.fixed_text_tokens, True
        if max_tokens > lim.max_tokens:
            field = ("omniray.fixed_text_tokens" if ext and ext.fixed_text_tokens
                     else "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
            raise ApiError(400, f"{field} {max_tokens} is over this server's limit of "
                                f"{lim.max_tokens}", param=field)
        try:
            sampling = SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k),
                repetition_penalty=req.repetition_penalty, max_tokens=max_tokens,
                ignore_eos=ignore_eos, seed=req.seed)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        messages = [self._message(i, m) for i, m in enumerate(req.messages)]
        try:
            voice = self._voice(req) if req.speech else None
            thinker_req = self.processor.build(messages, speech_output=req.speech,
                                               sampling=sampling, request_id=rid,
                                               enable_thinking=req.enable_thinking,
                                               on_media=on_media,
                                               frames_while_decoding=frames_while_decoding)
        except MediaError as e:
            raise ApiError(getattr(e, "http_status", 400), str(e)) from None
        except ValueError as e:  # e.g. a template or decoder refusing an odd input
            raise ApiError(400, f"invalid request: {e}") from None
        return PreparedTurn(rid, thinker_req, req.speech, voice, req.talker_seed,
                            text="text" in req.modalities,
                            speech_codes=ext.fixed_speech_codes if ext else None,
                            return_timings=bool(ext and ext.return_timings))

    def _message(self, i: int, m: Any) -> dict[str, Any]:
        role, content = m.role, m.content
        if role == "developer":  # OpenAI's newer name for the system message
            role = "system"
        if role == "tool":  # a tool's result goes back to the model as user text
            return {"role": "user", "content": tool_response_text(i, content)}
        if content is None:
            content = ""
        if m.tool_calls:  # assistant history: the calls it made, as text after its reply
            calls = tool_calls_text(m.tool_calls)
            content = calls if not content else (
                f"{content}\n{calls}" if isinstance(content, str)
                else [*content, {"type": "text", "text": calls}])
        if isinstance(content, str):
            return {"role": role, "content": content}
        m = m.model_copy(update={"role": role, "content": content})
        parts: list[dict[str, Any]] = []
        for j, p in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if isinstance(p, dict):  # the tool-call text added above
                parts.append(p)
                continue
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

    def _voice(self, req: ChatCompletionRequest) -> Any:
        """None (the checkpoint's voice), a decoded `ref_audio`, or a stored voice."""
        stored = self._stored_voice(req)
        if req.ref_audio is not None:
            if stored is not None:
                raise ApiError(400, "give either ref_audio or a stored audio.voice, not both",
                               param="audio.voice")
            from pipeline.processing.audio import decode_audio

            data = self.media.load(req.ref_audio, "ref_audio")
            return decode_audio(data, max_seconds=self.cfg.limits.max_ref_audio_seconds)
        if stored is None:
            return None
        try:
            info, samples = self.voices.get(stored)
        except ApiError as e:
            raise ApiError(400, f"audio.voice: {e.message}; upload it with POST "
                                "/v1/audio/voices", param="audio.voice",
                           code="voice_not_found") from None
        return NamedVoice(info.id, samples)

    # -- stored voices (routes.py) -------------------------------------------------------

    async def add_voice(self, name: str, audio: bytes, consent: str | None) -> VoiceInfo:
        await self.require_voices("audio_sample")
        info = await asyncio.to_thread(self.voices.add, name, audio, consent)
        _, samples = self.voices.get(info.id)
        try:  # every group's Code2Wav builds it (a turn may go to any group)
            await asyncio.wait_for(asyncio.gather(*(
                g.stages.code2wav.register_voice.remote(info.id, samples) for g in self.groups)),
                self.cfg.timeouts.open_s)
        except Exception as e:  # noqa: BLE001 - refused by the front end, or the stage is down
            await asyncio.to_thread(self.voices.delete, info.id)
            raise ApiError(400, f"audio_sample: the voice front end could not use the clip: "
                                f"{error_line(e)}", param="audio_sample",
                           code="voice_error") from None
        return info

    async def delete_voice(self, key: str) -> VoiceInfo:
        info = await asyncio.to_thread(self.voices.delete, key)
        # every group's Code2Wav forgets its prompt and template; one that is down has none
        await asyncio.gather(*(asyncio.wait_for(g.stages.code2wav.forget_voice.remote(info.id),
                                                self.cfg.timeouts.abort_s)
                               for g in self.groups), return_exceptions=True)
        return info

    # -- HTTP helpers (used by routes.py) ------------------------------------------------

    def stream_format(self, req: ChatCompletionRequest) -> str:
        ext = req.omniray
        return ext.stream_format if ext and ext.stream_format else self.cfg.stream_format

    async def sse(self, req: ChatCompletionRequest, turn: PreparedTurn) -> AsyncIterator[str]:
        opts = req.stream_options
        writer = ChunkWriter(turn.request_id, self.response_model(req), req.audio.format,
                             include_usage=opts.include_usage if opts else True,
                             stream_format=self.stream_format(req), speech=turn.speech,
                             continuous_usage=bool(opts and opts.continuous_usage_stats))
        try:
            # closed on leaving, so that a stream ended here also ends the turn at once
            async with contextlib.aclosing(self.turns.run(turn)) as events:
                async for ev in events:
                    if isinstance(ev, TextDelta):
                        yield writer.text(ev.text, ev.prompt_tokens, ev.completion_tokens)
                    elif isinstance(ev, AudioChunk):
                        chunk = writer.audio(ev)
                        if chunk:
                            yield chunk
                    elif isinstance(ev, Done):
                        for s in writer.done(ev):
                            yield s
                    elif isinstance(ev, Error):
                        for s in writer.error(ev):
                            yield s
        except Exception as e:
            # A fault of ours mid-stream (the headers are out): the client gets an error
            # event and [DONE], not a stream cut off, and the turn is ended above.
            log.exception("turn %s: its stream failed", turn.request_id)
            for s in writer.error(Error(500, f"internal error: {error_line(e)}",
                                        "internal_error")):
                yield s
        finally:
            writer.close()

    async def complete(self, req: ChatCompletionRequest,
                       turn: PreparedTurn) -> tuple[int, dict[str, Any]]:
        text, pcm = [], []
        async with contextlib.aclosing(self.turns.run(turn)) as events:
            async for ev in events:
                if isinstance(ev, TextDelta):
                    text.append(ev.text)
                elif isinstance(ev, AudioChunk):
                    pcm.append(ev.pcm)
                elif isinstance(ev, Error):
                    return ev.status, error_body(ev.status, ev.message, ev.reason)
                elif isinstance(ev, Done):
                    return 200, completion_body(turn.request_id, self.response_model(req),
                                                "".join(text),
                                                pcm, ev, req.audio.format, turn.speech)
        return 500, error_body(500, "turn ended without a terminal event")

    def response_model(self, req: ChatCompletionRequest) -> str:
        """The `model` of a response: the served name the request gave (as vLLM answers),
        else the configured name."""
        return req.model if req.model in self.served_names else self.cfg.name

    def models(self) -> dict[str, Any]:
        return models_body(self.served_names)

    def model_card(self, model_id: str | None = None) -> dict[str, Any]:
        if model_id is not None and model_id not in self.model_names:
            raise ApiError(404, f"model {model_id[:64]!r} does not exist; this server serves "
                                f"{' and '.join(map(repr, self.served_names))}",
                           param="model", code="model_not_found")
        name = model_id if model_id in self.served_names else self.cfg.name
        return model_card(name, self.served_names)


def tool_calls_text(calls: list[Any]) -> str:
    """An assistant's tool calls as the text the model wrote them in (Qwen3's chat template:
    one <tool_call> block of {"name", "arguments"} each, the arguments string as given)."""
    blocks = []
    for c in calls:
        args = c.function.arguments.strip() or "{}"
        blocks.append('<tool_call>\n{"name": ' + json.dumps(c.function.name, ensure_ascii=False)
                      + ', "arguments": ' + args + "}\n</tool_call>")
    return "\n".join(blocks)


def tool_response_text(i: int, content: Any) -> str:
    """A tool message's result (Qwen3's chat template: a user turn with <tool_response>)."""
    if isinstance(content, list):
        for j, p in enumerate(content):
            if p.type != "text":
                where = f"messages.{i}.content.{j}"
                raise ApiError(400, f"{where}: media parts are only allowed in user messages",
                               param=where)
        content = "\n".join(p.text for p in content)
    return f"<tool_response>\n{content}\n</tool_response>"
