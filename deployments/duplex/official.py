"""The official MiniCPM-o Realtime V1 wire (`WS /v1/realtime?mode=audio|video&model=...`),
as OpenBMB's `openbmb-realtime` SDK and the demo's page speak it.

    server: session.queued* (position, estimated_wait_s, queue_length) -> session.queue_done
    client: session.init {payload: system_prompt, config, voice, max_slice_nums}
    server: session.created {session_id}
    client: input.append {input: audio (base64 16 kHz float32), force_listen, video_frames}
    server, per unit: response.listen | response.output_text.delta* {text, end_of_turn}
            (the text in pieces as it is drawn, the last with the turn's end)
            + response.output_audio.delta {audio: base64 24 kHz float32};
            response.done {usage} after a turn's last unit
    client: session.close {reason}      server: session.closed {reason, usage}
    error {error: {code, message}} ends the session (the SDK treats every error as fatal).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from deployments.duplex.backend import FORCES, DuplexInit, UnitResult
from deployments.duplex.session import INPUT_RATE, BadEvent, DuplexConnection, Ending

# session.init config keys: the SDK's own, and the reference MiniCPMODuplex sampling
# kwargs (pipeline.duplex.config.DuplexConfig names) with their allowed ranges.
_REFERENCE_KEYS: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0.0, 2.0), "top_k": (int, 1, 1000), "top_p": (float, 0.0, 1.0),
    "listen_prob_scale": (float, 0.0, 100.0), "force_listen_count": (int, 0, 1000),
    "max_new_speak_tokens_per_chunk": (int, 1, 200),
    "text_repetition_penalty": (float, 0.5, 2.0),
}
# Accepted for the SDK, without effect on this model's duplex mode (docs/api.md says so).
_IGNORED_KEYS = frozenset({"length_penalty", "max_tokens", "max_kv_tokens", "vision_hd",
                           "generate_audio", "chunk_ms", "sample_rate", "ls_mode"})
_PAYLOAD_KEYS = frozenset({"system_prompt", "config", "voice", "max_slice_nums"})
_MAX_SLICES = 9      # MiniCPM-V's slicing never makes more
_MAX_FRAMES = 4      # per input.append: one is used per unit, the latest


def b64(data: str, param: str) -> bytes:
    if not isinstance(data, str):
        raise BadEvent("invalid_value", f"{param} must be a base64 string", param)
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, binascii.Error):
        raise BadEvent("invalid_value", f"{param} is not valid base64", param) from None


def float32_audio(data: str, param: str) -> np.ndarray:
    raw = b64(data, param)
    if len(raw) % 4:
        raise BadEvent("invalid_audio", f"{param} must be 32-bit float PCM (a multiple of 4 "
                       f"bytes), got {len(raw)} bytes", param)
    audio = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(audio).all():
        raise BadEvent("invalid_audio", f"{param} holds NaN or infinite samples", param)
    return audio


def _number(v: Any, kind: type, lo: float, hi: float, param: str) -> float | int:
    ok = isinstance(v, int | float) and not isinstance(v, bool)
    if kind is int:
        ok = ok and float(v).is_integer()
    if not ok or not math.isfinite(v) or not lo <= v <= hi:
        what = "an integer" if kind is int else "a number"
        raise BadEvent("invalid_value", f"{param} must be {what} in [{lo:g}, {hi:g}], "
                       f"got {v!r}", param)
    return kind(v)


def _force(v: Any, param: str) -> str | None:
    if v is not None and v not in FORCES:
        raise BadEvent("invalid_value", f"{param} must be 'speak', 'listen' or null, got {v!r}",
                       param)
    return v


class OfficialConnection(DuplexConnection):
    async def start(self) -> None:
        self.out.put({"type": "session.queue_done"})

    def error_event(self, code: str, message: str, param: str | None = None) -> dict:
        return {"type": "error", "error": {"code": code, "message": message,
                                           **({"param": param} if param else {})}}

    def closed_event(self, reason: str) -> dict:
        return {"type": "session.closed", "session_id": self.id, "reason": reason,
                "usage": self.usage.as_event()}

    async def on_event(self, obj: dict) -> None:
        kind = obj["type"]
        if kind == "session.init":
            if self.opened:
                raise BadEvent("invalid_event", "session.init was already sent")
            await self.open_backend(self._init(obj.get("payload", {})))
            self.out.put({"type": "session.created", "session_id": self.id,
                          "mode": self.mode, "model": self.model})
        elif kind == "input.append":
            if not self.opened:
                raise BadEvent("invalid_event", "send session.init before input.append")
            self._append(obj.get("input"))
        elif kind == "session.close":
            reason = obj.get("reason", "user_stop")
            self.end(Ending(reason if isinstance(reason, str) and len(reason) <= 64
                            else "user_stop"))
        else:
            raise BadEvent("unknown_event", f"unknown event type {kind!r} (this wire takes "
                           f"session.init, input.append and session.close)")

    def _init(self, payload: Any) -> DuplexInit:
        if not isinstance(payload, dict):
            raise BadEvent("invalid_value", "session.init payload must be an object", "payload")
        unknown = sorted(set(payload) - _PAYLOAD_KEYS)
        if unknown:
            raise BadEvent("unknown_parameter", f"unknown session.init payload keys {unknown}",
                           f"payload.{unknown[0]}")
        prompt = payload.get("system_prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise BadEvent("invalid_value", "payload.system_prompt must be a string",
                           "payload.system_prompt")
        config = payload.get("config") or {}
        if not isinstance(config, dict):
            raise BadEvent("invalid_value", "payload.config must be an object", "payload.config")
        options: dict[str, Any] = {}
        audio_out = True
        for key, v in config.items():
            p = f"payload.config.{key}"
            if key in _REFERENCE_KEYS:
                options[key] = _number(v, *_REFERENCE_KEYS[key], p)
            elif key == "seed":  # seeded sampling: the same draws in the same order
                options["seed"] = _number(v, int, 0, 2**31 - 1, p)
            elif key == "duplex_force":
                self.force = _force(v, p)
            elif key == "tts_enabled":
                if not isinstance(v, bool):
                    raise BadEvent("invalid_value", f"{p} must be a boolean", p)
                audio_out = v
            elif key not in _IGNORED_KEYS:
                raise BadEvent("unknown_parameter", f"unknown config key {key!r}", p)
        slices = payload.get("max_slice_nums", 1)
        slices = _number(slices, int, 1, _MAX_SLICES, "payload.max_slice_nums")
        ref, prompt_wav = self._voice(payload.get("voice") or {})
        return DuplexInit(mode=self.mode, system_prompt=prompt, ref_audio=ref,
                          prompt_wav=prompt_wav, max_slice_nums=slices, audio_out=audio_out,
                          options=options)

    def _voice(self, voice: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
        if not isinstance(voice, dict):
            raise BadEvent("invalid_value", "payload.voice must be an object", "payload.voice")
        unknown = sorted(set(voice) - {"ref_audio_base64", "tts_ref_audio_base64"})
        if unknown:
            raise BadEvent("unknown_parameter", f"unknown voice keys {unknown}",
                           f"payload.voice.{unknown[0]}")
        out = []
        for key in ("ref_audio_base64", "tts_ref_audio_base64"):
            if not voice.get(key):
                out.append(None)
                continue
            p = f"payload.voice.{key}"
            audio = float32_audio(voice[key], p)
            limit = self.limits.max_ref_audio_seconds
            if len(audio) > limit * INPUT_RATE:
                raise BadEvent("audio_too_long", f"{p} is {len(audio) / INPUT_RATE:.1f} s, "
                               f"over the limit of {limit:g} s", p)
            out.append(audio)
        ref, tts = out
        return ref, tts if tts is not None else ref

    def _append(self, payload: Any) -> None:
        if not isinstance(payload, dict):
            raise BadEvent("invalid_value", "input.append needs an 'input' object", "input")
        unknown = sorted(set(payload) - {"audio", "force_listen", "video_frames"})
        if unknown:
            raise BadEvent("unknown_parameter", f"unknown input keys {unknown}",
                           f"input.{unknown[0]}")
        frames = payload.get("video_frames")
        if frames:
            if self.mode != "video":
                raise BadEvent("invalid_event", "video_frames need a video session "
                               "(connect with ?mode=video)", "input.video_frames")
            if not isinstance(frames, list) or len(frames) > _MAX_FRAMES:
                raise BadEvent("invalid_value", f"input.video_frames must be a list of at most "
                               f"{_MAX_FRAMES} base64 JPEG frames", "input.video_frames")
            self.units.frame(self._frame(frames[-1]))
        force = payload.get("force_listen", False)
        if not isinstance(force, bool):
            raise BadEvent("invalid_value", "input.force_listen must be a boolean",
                           "input.force_listen")
        if force:
            self.units.force("listen")
        audio = payload.get("audio", "")
        if audio:
            self.push_audio(float32_audio(audio, "input.audio"))

    def _frame(self, data: str) -> Any:
        from pipeline.processing.errors import MediaError
        from pipeline.processing.image import decode_image

        raw = b64(data, "input.video_frames")
        try:
            return decode_image(raw, max_pixels=self.limits.max_image_pixels,
                                max_aspect_ratio=self.limits.max_image_aspect_ratio)
        except MediaError as e:
            raise BadEvent("invalid_image", f"input.video_frames: {e}",
                           "input.video_frames") from None

    def on_text(self, index: int, piece: str) -> None:
        self.out.put({"type": "response.output_text.delta", "unit": index, "text": piece,
                      "end_of_turn": False})

    def on_decision(self, index: int, r: UnitResult) -> None:
        if r.is_listen:
            self.out.put({"type": "response.listen", "unit": index})
            return
        # the unit's last text delta carries its turn's end (a unit with its text all sent
        # and the turn going on needs none)
        rest = self.rest_of_text(r)
        if rest or r.end_of_turn or not self.streamed:
            self.out.put({"type": "response.output_text.delta", "unit": index, "text": rest,
                          "end_of_turn": r.end_of_turn})

    def on_audio(self, index: int, r: UnitResult) -> None:
        if r.is_listen:
            return
        if r.pcm is not None and len(r.pcm):
            pcm = np.ascontiguousarray(r.pcm, dtype="<f4")
            self.out.put({"type": "response.output_audio.delta", "unit": index,
                          "audio": base64.b64encode(pcm.tobytes()).decode("ascii")})
        if r.end_of_turn:
            self.out.put({"type": "response.done", "unit": index,
                          "usage": self.usage.as_event()})
