"""Events -> OpenAI / vLLM-Omni wire shapes (SSE chunks and the non-streamed body).

Streamed (`text/event-stream`), one `data:` line per chunk, then `data: [DONE]`. Two shapes
of the audio, picked by the request's `omniray.stream_format`, else vLLM-Omni's for a request
in its dialect (schemas.ChatCompletionRequest.vllm_omni), else the app's `stream_format`:

  openai (default), OpenAI's streamed audio:
    text     {"choices": [{"delta": {"content": "..."}}]}          when no audio is asked for
    speech   {"choices": [{"delta": {"audio": {"id", "transcript": "..."}}}]}   the text
             {"choices": [{"delta": {"audio": {"id", "data": <base64 audio bytes>}}}]}
             {"choices": [{"delta": {"audio": {"id", "expires_at"}}}]}          the last update
  vllm-omni (what `vllm bench serve --omni` reads), a top-level "modality" on every chunk:
    text     {"modality": "text", "choices": [{"delta": {"content": "..."}}]}
    audio    {"modality": "audio", "choices": [{"delta": {"content": <base64 audio bytes>},
              "audio_metadata": {...}}]}
Both end with a chunk carrying finish_reason, then a usage chunk (choices: []), or, when the
turn fails after the stream started, one {"error": {...}} chunk; then [DONE].

Audio bytes: `wav` sends each piece as a complete WAV file; the other formats
(ingress/audio_encoding.py) send pieces of one stream: the pieces concatenated are one
valid file (pcm16: raw 24 kHz samples).
Non-streamed: choices[0].message.content (text) and choices[0].message.audio
{id, data: base64 of the whole reply, expires_at, transcript}, plus audio_metadata (OpenAI's
shape and vLLM-Omni's alike: it merges the audio into the text's choice).
Models (`GET /v1/models`): one card per served name, as vLLM lists its served model names.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import numpy as np

from deployments.ingress.audio_encoding import StreamEncoder, canonical_format, encode_whole
from deployments.wire import SAMPLE_RATE, AudioChunk, Done, Error

AUDIO_TTL_S = 24 * 3600  # expires_at: how long a client may refer to the audio


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def audio_metadata(fmt: str, frames: int) -> dict[str, Any]:
    return {"format": canonical_format(fmt), "sample_rate_hz": SAMPLE_RATE,
            "frame_count": frames, "channels": 1}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChunkWriter:
    """Builds the SSE chunks of one streamed response."""

    def __init__(self, rid: str, model: str, audio_format: str, include_usage: bool,
                 stream_format: str = "openai", speech: bool = False,
                 continuous_usage: bool = False):
        self.id = f"chatcmpl-{rid}"
        self.audio_id = f"audio-{rid}"
        self.model = model
        self.created = int(time.time())
        self.audio_format = canonical_format(audio_format)
        self.include_usage = include_usage
        # vLLM's `continuous_usage_stats`: every chunk carries the running usage
        self.continuous_usage = include_usage and continuous_usage
        self.usage: dict[str, int] | None = None
        self.openai = stream_format == "openai"
        self.speech = speech
        self.encoder = StreamEncoder(self.audio_format, SAMPLE_RATE) if speech else None
        self._role_sent: set[str] = set()

    def _chunk(self, modality: str, choices: list[dict[str, Any]], **extra: Any) -> str:
        head = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}
        if not self.openai:
            head["modality"] = modality
        if self.continuous_usage and self.usage is not None and "usage" not in extra:
            extra["usage"] = self.usage
        return sse({**head, "choices": choices, **extra})

    def _delta(self, modality: str, **fields: Any) -> dict[str, Any]:
        key = "assistant" if self.openai else modality
        if key not in self._role_sent:
            self._role_sent.add(key)
            fields = {"role": "assistant", **fields}
        return fields

    def _choice(self, delta: dict[str, Any], **extra: Any) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "finish_reason": None, **extra}]

    def text(self, text: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> str:
        if self.continuous_usage:
            self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}
        if self.openai and self.speech:  # OpenAI: with audio out, the text is the transcript
            delta = self._delta("text", audio={"id": self.audio_id, "transcript": text})
        else:
            delta = self._delta("text", content=text)
        return self._chunk("text", self._choice(delta))

    def audio(self, ev: AudioChunk) -> str:
        data = self.encoder.encode(ev.pcm)
        return self._audio_bytes(data, len(ev.pcm)) if data else ""

    def _audio_bytes(self, data: bytes, frames: int) -> str:
        if self.openai:
            return self._chunk("audio", self._choice(
                self._delta("audio", audio={"id": self.audio_id, "data": b64(data)})))
        return self._chunk("audio", self._choice(
            self._delta("audio", content=b64(data)),
            audio_metadata=audio_metadata(self.audio_format, frames)))

    def done(self, ev: Done) -> list[str]:
        out = []
        if self.encoder is not None:
            tail = self.encoder.finish()
            if tail:
                out.append(self._audio_bytes(tail, 0))
            if self.openai:
                out.append(self._chunk("audio", self._choice(
                    {"audio": {"id": self.audio_id,
                               "expires_at": int(time.time()) + AUDIO_TTL_S}})))
        out.append(self._chunk("text", [{"index": 0, "delta": {},
                                         "finish_reason": ev.finish_reason}]))
        if self.include_usage:
            extra = {"timings": ev.timings} if ev.timings else {}
            out.append(self._chunk("text", [], usage=ev.usage.as_dict(), metrics=ev.metrics,
                                   **extra))
        return out + [SSE_DONE]

    def error(self, ev: Error) -> list[str]:
        self.close()
        return [sse(error_body(ev.status, ev.message, ev.reason)), SSE_DONE]

    def close(self) -> None:
        """Free the encoder (the stream ended early)."""
        if self.encoder is not None:
            self.encoder.close()


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None,
                      "code": code if code is not None else status}}


def completion_body(rid: str, model: str, text: str, pcm: list[np.ndarray], done: Done,
                    audio_format: str, speech: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": done.finish_reason}
    if speech:
        joined = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
        message["audio"] = {"id": f"audio-{rid}", "data": b64(encode_whole(joined, audio_format)),
                            "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": text}
        choice["audio_metadata"] = audio_metadata(audio_format, len(joined))
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": done.usage.as_dict(),
            "metrics": done.metrics}


def model_card(name: str, served: list[str]) -> dict[str, Any]:
    """One served name's card; `root` is the checkpoint's own name (never a server path)."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "omniray",
            "root": served[-1], "parent": None}


def models_body(served: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(name, served) for name in served]}
