"""vLLM-Omni's OpenAI-shaped duplex wire (`WS /v1/realtime?duplex=1`): OpenAI Realtime
events, the model deciding every unit whether a response runs.

    server: session.queued* (omniray: while every slot is taken) -> session.created
    client: session.update {session: instructions, audio.input.format (pcm16 at 24 or
            16 kHz), omniray.duplex_force}; input_audio_buffer.append {audio: pcm16};
            input_audio_buffer.clear; input_audio_buffer.commit (a no-op: units are timed);
            response.cancel (the response ends at once; the next unit listens)
    server: a speaking run of units is one response: response.created,
            response.output_audio_transcript.delta / response.output_audio.delta (pcm16
            24 kHz) per unit, then the .done events and response.done: completed at the
            model's turn end, cancelled when it listens again (turn_detected) or at the
            client's response.cancel (client_cancelled: nothing of it is sent after).
A refused event is an error event; the session goes on, as OpenAI's does.
"""

from __future__ import annotations

import base64
import secrets
import string
from typing import Any

import numpy as np

from deployments.duplex.backend import FORCES, DuplexInit, UnitResult
from deployments.duplex.official import b64
from deployments.duplex.session import INPUT_RATE, BadEvent, DuplexConnection, Ending

_ID = string.ascii_letters + string.digits
_RATES = (24000, 16000)
_SESSION_KEYS = frozenset({"type", "model", "instructions", "audio", "input_audio_format",
                           "output_audio_format", "output_modalities", "modalities",
                           "turn_detection", "voice", "omniray"})


def new_id(prefix: str) -> str:
    return f"{prefix}_{''.join(secrets.choice(_ID) for _ in range(20))}"


class OpenAIConnection(DuplexConnection):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.instructions: str | None = None
        self.rate = 24000
        self._resampler: Any = None
        self.response: dict[str, Any] | None = None
        self.muted = False  # a cancelled response's later speech is dropped

    # -- events out ----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict:
        return {"type": kind, "event_id": new_id("event"), **fields}

    def error_event(self, code: str, message: str, param: str | None = None) -> dict:
        return self._event("error", error={"type": "invalid_request_error", "code": code,
                                           "message": message, "param": param,
                                           "event_id": None})

    def closed_event(self, reason: str) -> dict | None:
        # OpenAI's wire has no close event: a server-side end is an error event
        if reason in ("idle_timeout", "max_duration"):
            return self.error_event(reason, f"the duplex session ended ({reason})")
        return None

    def _session(self) -> dict:
        return {"id": self.id, "object": "realtime.session", "type": "realtime",
                "model": self.model, "output_modalities": ["audio"],
                "instructions": self.instructions or "",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": self.rate},
                                    "turn_detection": None},
                          "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
                "omniray": {"duplex": True, "duplex_force": self.force}}

    async def start(self) -> None:
        self.out.put(self._event("session.created", session=self._session()))

    def bad_event(self, e: BadEvent) -> Ending | None:
        self.out.put(self.error_event(e.code, e.message, e.param))
        return None

    # -- events in -----------------------------------------------------------------------

    async def on_event(self, obj: dict) -> None:
        kind = obj["type"]
        if kind == "session.update":
            self._update(obj.get("session"))
            self.out.put(self._event("session.updated", session=self._session()))
        elif kind == "input_audio_buffer.append":
            if not self.opened:
                await self.open_backend(DuplexInit(mode="audio",
                                                   system_prompt=self.instructions))
            pcm = b64(obj.get("audio"), "audio")
            self.push_audio(self._to_16k(pcm))
        elif kind == "input_audio_buffer.clear":
            self.units.clear()
            self.out.put(self._event("input_audio_buffer.cleared"))
        elif kind == "input_audio_buffer.commit":
            pass  # units are cut by time; the model decides when it answers
        elif kind == "response.cancel":
            # OpenAI's rule: the response ends now. Units already with the model finish
            # there (the model's context keeps them), but their speech is not sent: the
            # client hears nothing more until the model has listened again.
            self.units.force("listen")
            if self.response is not None:
                self._end_response("cancelled", "client_cancelled")
                self.muted = True
        else:
            raise BadEvent("unsupported_event", f"{kind!r} is not supported on a duplex "
                           f"session (?duplex=1): the model decides every second whether to "
                           f"answer", "type")

    def _update(self, s: Any) -> None:
        if not isinstance(s, dict):
            raise BadEvent("invalid_value", "session.update needs a 'session' object", "session")
        unknown = sorted(set(s) - _SESSION_KEYS)
        if unknown:
            raise BadEvent("unknown_parameter", f"unknown session fields {unknown}",
                           f"session.{unknown[0]}")
        if "instructions" in s:
            if self.opened:
                raise BadEvent("session_started", "instructions are fixed once audio has "
                               "started (they are the session's system prompt)",
                               "session.instructions")
            if not isinstance(s["instructions"], str):
                raise BadEvent("invalid_value", "session.instructions must be a string",
                               "session.instructions")
            self.instructions = s["instructions"]
        rate = self._rate(s)
        if rate is not None and rate != self.rate:
            if self.units.pending_samples or self.opened:
                raise BadEvent("session_started", "the input format is fixed once audio "
                               "has started", "session.audio.input.format")
            self.rate, self._resampler = rate, None
        ext = s.get("omniray")
        if ext is not None:
            if not isinstance(ext, dict) or set(ext) - {"duplex_force"}:
                raise BadEvent("unknown_parameter", "session.omniray takes only duplex_force",
                               "session.omniray")
            if "duplex_force" in ext:
                v = ext["duplex_force"]
                if v is not None and v not in FORCES:
                    raise BadEvent("invalid_value", "session.omniray.duplex_force must be "
                                   "'speak', 'listen' or null", "session.omniray.duplex_force")
                self.force = v
        audio_in = s["audio"].get("input") if isinstance(s.get("audio"), dict) else None
        td = s.get("turn_detection") or (audio_in.get("turn_detection")
                                         if isinstance(audio_in, dict) else None)
        if td is not None:
            raise BadEvent("unsupported_value", "a duplex session has no turn detection: the "
                           "model decides each unit (set turn_detection to null)",
                           "session.turn_detection")

    def _rate(self, s: dict) -> int | None:
        if "input_audio_format" in s:  # the beta shape
            if s["input_audio_format"] != "pcm16":
                raise BadEvent("invalid_value", "input_audio_format must be 'pcm16'",
                               "session.input_audio_format")
        audio = s.get("audio")
        if audio is None:
            return None
        fmt = (audio.get("input") or {}).get("format") if isinstance(audio, dict) else None
        if fmt is None:
            return None
        if (not isinstance(fmt, dict) or fmt.get("type") not in ("audio/pcm", "pcm16")
                or fmt.get("rate", 24000) not in _RATES):
            raise BadEvent("invalid_value", "session.audio.input.format must be "
                           "{type: 'audio/pcm', rate: 24000 | 16000}",
                           "session.audio.input.format")
        return fmt.get("rate", 24000)

    def _to_16k(self, pcm: bytes) -> np.ndarray:
        from pipeline.processing.vad import StreamResampler

        if self._resampler is None:
            self._resampler = StreamResampler(self.rate, INPUT_RATE)
        return self._resampler.push(pcm)

    # -- results -------------------------------------------------------------------------

    def on_text(self, index: int, piece: str) -> None:
        self._say(piece)

    def on_decision(self, index: int, r: UnitResult) -> None:
        if r.is_listen:
            if self.response is not None:
                self._end_response("cancelled", "turn_detected")
            self.muted = False
            return
        self._say(self.rest_of_text(r))

    def _say(self, text: str) -> None:
        """A speaking unit's text (a piece, or the rest at its decision)."""
        if self.muted:  # spoken before the model saw the cancel
            return
        if self.response is None:
            self.response = {"id": new_id("resp"), "item": new_id("item"), "text": ""}
            self.out.put(self._event("response.created", response=self._response_obj(
                "in_progress")))
        if text:
            self.response["text"] += text
            self.out.put(self._event("response.output_audio_transcript.delta",
                                     **self._ref(), delta=text))

    def on_audio(self, index: int, r: UnitResult) -> None:
        # a cancel that came after the decision drops the unit's audio too
        if r.is_listen or self.muted or self.response is None:
            return
        ref = self._ref()
        if r.pcm is not None and len(r.pcm):
            pcm16 = (np.clip(r.pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
            self.out.put(self._event("response.output_audio.delta", **ref,
                                     delta=base64.b64encode(pcm16).decode("ascii")))
        if r.end_of_turn:
            self._end_response("completed", None)

    def _response_obj(self, status: str, reason: str | None = None) -> dict:
        resp = self.response or {}
        obj: dict[str, Any] = {"id": resp.get("id"), "object": "realtime.response",
                               "status": status, "output_modalities": ["audio"]}
        if status != "in_progress":
            obj["status_details"] = ({"type": status, "reason": reason} if reason else None)
            obj["output"] = [{"id": resp.get("item"), "type": "message", "role": "assistant",
                              "status": "completed" if status == "completed" else "incomplete",
                              "content": [{"type": "output_audio",
                                           "transcript": resp.get("text", "")}]}]
            obj["usage"] = self.usage.as_event()
        return obj

    def _ref(self) -> dict[str, Any]:
        assert self.response is not None
        return {"response_id": self.response["id"], "item_id": self.response["item"],
                "output_index": 0, "content_index": 0}

    def _end_response(self, status: str, reason: str | None) -> None:
        ref = self._ref()
        self.out.put(self._event("response.output_audio.done", **ref))
        self.out.put(self._event("response.output_audio_transcript.done", **ref,
                                 transcript=self.response["text"]))
        self.out.put(self._event("response.done", response=self._response_obj(status, reason)))
        self.response = None
