"""Events -> OpenAI / vLLM-Omni wire shapes (SSE chunks and the non-streamed body).

Streamed (`text/event-stream`), one `data:` line per chunk, then `data: [DONE]`:
    text   {"object": "chat.completion.chunk", "modality": "text",
            "choices": [{"index": 0, "delta": {"content": "..."}}]}
    audio  {"modality": "audio", "choices": [{"index": 0, "delta": {"content": <base64 WAV
            of this piece, or raw pcm16>}, "audio_metadata": {...}}]}
    end    a chunk with finish_reason, then a usage chunk (choices: [])
    error  {"error": {...}} (OpenAI error shape), then [DONE]
Non-streamed: choices[0].message.content (text) and choices[0].message.audio
{id, data: base64 WAV of the whole reply, expires_at, transcript}, plus audio_metadata.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import numpy as np

from deployments.media import float_to_int16, wav_bytes_int16
from deployments.schemas import SAMPLE_RATE, AudioChunk, Done, Error


def encode_audio(pcm: np.ndarray, fmt: str) -> str:
    pcm16 = float_to_int16(pcm)
    data = wav_bytes_int16(pcm16, SAMPLE_RATE) if fmt == "wav" else pcm16.tobytes()
    return base64.b64encode(data).decode("ascii")


def audio_metadata(fmt: str, frames: int) -> dict[str, Any]:
    return {"format": "wav" if fmt == "wav" else "pcm16", "sample_rate_hz": SAMPLE_RATE,
            "frame_count": frames, "channels": 1}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChunkWriter:
    """Builds the SSE chunks of one streamed response."""

    def __init__(self, rid: str, model: str, audio_format: str, include_usage: bool):
        self.id = f"chatcmpl-{rid}"
        self.model = model
        self.created = int(time.time())
        self.audio_format = audio_format
        self.include_usage = include_usage
        self._role_sent: set[str] = set()

    def _chunk(self, modality: str, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "modality": modality, "choices": choices, **extra})

    def _delta(self, modality: str, content: str) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": content}
        if modality not in self._role_sent:
            self._role_sent.add(modality)
            delta["role"] = "assistant"
        return delta

    def text(self, text: str) -> str:
        return self._chunk("text", [{"index": 0, "delta": self._delta("text", text),
                                     "finish_reason": None}])

    def audio(self, ev: AudioChunk) -> str:
        choice = {"index": 0, "delta": self._delta("audio", encode_audio(ev.pcm, self.audio_format)),
                  "finish_reason": None,
                  "audio_metadata": audio_metadata(self.audio_format, len(ev.pcm))}
        return self._chunk("audio", [choice])

    def done(self, ev: Done) -> list[str]:
        out = [self._chunk("text", [{"index": 0, "delta": {}, "finish_reason": ev.finish_reason}])]
        if self.include_usage:
            extra = {"timings": ev.timings} if ev.timings else {}
            out.append(self._chunk("text", [], usage=ev.usage.as_dict(), metrics=ev.metrics,
                                   **extra))
        return out + [SSE_DONE]

    def error(self, ev: Error) -> list[str]:
        body = error_body(ev.status, ev.message, ev.reason)
        return [sse(body), SSE_DONE]


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
        message["audio"] = {"id": f"audio-{rid}", "data": encode_audio(joined, audio_format),
                            "expires_at": int(time.time()) + 24 * 3600, "transcript": text}
        choice["audio_metadata"] = audio_metadata(audio_format, len(joined))
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": done.usage.as_dict(),
            "metrics": done.metrics}
