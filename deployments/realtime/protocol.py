"""The OpenAI Realtime protocol of `WS /v1/realtime`: client events parsed into typed events,
the session configuration, and server events built as plain dicts.

Clients may write either spelling of the API: the GA one (`openai.types.realtime`) or the
beta one that sessions opened with `OpenAI-Beta: realtime=v1` still send
(`openai.types.beta.realtime`), e.g. `output_modalities` or `modalities`,
`audio.input.format` or `input_audio_format`, `max_output_tokens` or
`max_response_output_tokens`. Server events are built in the GA shape; `to_beta` rewrites one
for a beta session.

Where omniray differs from OpenAI's API, on purpose:
- input audio is pcm16 at 24 kHz, or at 16 kHz (`audio.input.format.rate: 16000`, or
  `session.omniray.input_audio_rate` beside beta's "pcm16"): the audio encoder consumes
  16 kHz, so a client that has it skips a resampling pass;
- output audio is pcm16 at 24 kHz, what Code2Wav produces;
- OpenAI's built-in voice names ("alloy", ...) select the checkpoint's own voice; any other
  name is a stored voice; `session.omniray.ref_audio` (a data: URI or a stored voice's name)
  clones a voice and is passed on untouched;
- `temperature` (a beta session field) is accepted in both spellings, 0..2 as in the chat API;
- fields of the official API that omniray has no counterpart for (tools, tracing,
  transcription, noise reduction, speed, ...) are accepted and ignored, so that stock clients,
  which send them on every update, work; a field the API does not define is refused.

Checks are split in two: `parse_client_event` checks an event's structure and which setting
each field names; `apply_session_update` checks the settings' values. Both raise
ProtocolError, which the session turns into an `error` event.

No Ray, no torch.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from deployments.ingress.schemas import DEFAULT_VOICES

INPUT_RATES = (24000, 16000)
OUTPUT_RATE = 24000

Modality = Literal["text", "audio"]
Role = Literal["user", "assistant", "system"]
PartType = Literal["input_text", "input_audio", "output_text", "output_audio"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]
ResponseStatus = Literal["in_progress", "completed", "cancelled", "incomplete", "failed"]


class ProtocolError(Exception):
    """A client event the server refuses. `code`: invalid_event, unknown_event,
    invalid_value, unsupported or payload_too_large; `param`: the dotted path of the field;
    `event_id`: the client event's id when known."""

    def __init__(
        self, code: str, message: str, param: str | None = None, event_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id


_ID_CHARS = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    """An id in the API's form: `item_`, `resp_`, `event_`, `sess_` + 21 random letters."""
    return prefix + "_" + "".join(secrets.choice(_ID_CHARS) for _ in range(21))


# ---------------------------------------------------------------------------------------
# Session configuration


@dataclass(frozen=True)
class TurnDetection:
    """Server VAD settings (the API's defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    type: Literal["server_vad"] = "server_vad"


@dataclass(frozen=True)
class SessionConfig:
    instructions: str = ""
    # ("audio",): speech plus its transcript; ("text",): text only.
    output_modalities: tuple[Modality, ...] = ("audio",)
    input_audio_rate: int = 24000  # pcm16, one of INPUT_RATES
    turn_detection: TurnDetection | None = TurnDetection()
    voice: str | None = None  # a stored voice's name; None: the checkpoint's own voice
    ref_audio: str | None = None  # opaque: a data: URI or a stored voice's name
    max_output_tokens: int | None = None  # None: "inf"
    temperature: float | None = None  # None: the model's default
    # omniray.return_timings: response.done's response carries the turn's per-stage spans
    return_timings: bool = False
    # omniray.fixed_text_tokens / fixed_speech_codes: exact lengths, for benchmarks on
    # random weights (the chat API's omniray extension of the same names)
    fixed_text_tokens: int | None = None
    fixed_speech_codes: int | None = None


@dataclass(frozen=True)
class SessionPatch:
    """The settings a session.update (or response.create) names, by SessionConfig-side name
    (`_CHECKS`), with their values as sent and the dotted path each was sent at."""

    values: Mapping[str, Any] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)


def _invalid(param: str, message: str) -> ProtocolError:
    return ProtocolError("invalid_value", f"{param}: {message}", param)


def _unsupported(param: str, message: str) -> ProtocolError:
    return ProtocolError("unsupported", f"{param}: {message}", param)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _known(obj: Mapping[str, Any], path: str, allowed: frozenset[str] | set[str]) -> None:
    for key in obj:
        if key not in allowed:
            p = _join(path, str(key))
            raise ProtocolError("invalid_value", f"unknown field {p}", p)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: object, param: str, lo: int, hi: int | None = None) -> int:
    if not _is_int(v) or v < lo or (hi is not None and v > hi):  # type: ignore[operator]
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise _invalid(param, f"expected an integer {bound}")
    return v  # type: ignore[return-value]


def _opt_int(v: object, param: str, lo: int, hi: int) -> int | None:
    return None if v is None else _int(v, param, lo, hi)


def _number(v: object, param: str, lo: float, hi: float) -> float:
    if (
        not isinstance(v, int | float)
        or isinstance(v, bool)
        or not math.isfinite(v)
        or not lo <= v <= hi
    ):
        raise _invalid(param, f"expected a number in {lo}..{hi}")
    return float(v)


def _bool(v: object, param: str) -> bool:
    if not isinstance(v, bool):
        raise _invalid(param, "expected true or false")
    return v


def _str(v: object, param: str, *, nonempty: bool = False) -> str:
    if not isinstance(v, str) or (nonempty and not v):
        raise _invalid(param, "expected a non-empty string" if nonempty else "expected a string")
    return v


def _opt_str(v: object, param: str) -> str | None:
    return None if v is None else _str(v, param)


def _check_instructions(v: object, p: str) -> str:
    return "" if v is None else _str(v, p)


def _check_modalities(v: object, p: str) -> tuple[Modality, ...]:
    # GA: ["audio"] or ["text"]; beta: ["text", "audio"] or ["text"]. Audio always comes
    # with its transcript, so any list naming audio means audio.
    if not isinstance(v, list) or not v or any(m not in ("text", "audio") for m in v):
        raise _invalid(p, 'expected ["audio"] or ["text"]')
    return ("audio",) if "audio" in v else ("text",)


def _check_format(v: object, p: str, rates: tuple[int, ...]) -> int:
    """An audio format in either spelling -> its pcm16 sample rate."""
    if isinstance(v, str):  # beta: "pcm16" is 24 kHz
        if v == "pcm16":
            return 24000
        if v in ("g711_ulaw", "g711_alaw"):
            raise _unsupported(p, f"{v} is not supported; use pcm16")
        raise _invalid(p, 'expected "pcm16"')
    if not isinstance(v, dict):
        raise _invalid(p, 'expected {"type": "audio/pcm", "rate": 24000}')
    _known(v, p, {"type", "rate"})
    kind = v.get("type")
    if kind in ("audio/pcmu", "audio/pcma"):
        raise _unsupported(f"{p}.type", f"{kind} is not supported; use audio/pcm")
    if kind not in (None, "audio/pcm"):
        raise _invalid(f"{p}.type", 'expected "audio/pcm"')
    rate = v.get("rate")
    if rate is None:
        return 24000
    if not _is_int(rate) or rate not in rates:
        raise _invalid(f"{p}.rate", f"expected one of {', '.join(map(str, rates))}")
    return rate


def _check_input_format(v: object, p: str) -> int:
    return _check_format(v, p, INPUT_RATES)


def _check_rate(v: object, p: str) -> int:
    if not _is_int(v) or v not in INPUT_RATES:
        raise _invalid(p, f"expected one of {', '.join(map(str, INPUT_RATES))}")
    return v  # type: ignore[return-value]


def _check_output_format(v: object, p: str) -> int:
    return _check_format(v, p, (OUTPUT_RATE,))


_TURN_FIELDS = frozenset(
    {
        "type",
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
        # defined by the API, ignored: no idle prompt, no semantic VAD
        "idle_timeout_ms",
        "eagerness",
    }
)
_MAX_PADDING_MS = 10_000  # bounds the audio the VAD keeps before speech
_MAX_SILENCE_MS = 60_000


def _check_turn_detection(v: object, p: str) -> TurnDetection | None:
    # The whole object is replaced: fields left out take the defaults, not earlier values.
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _invalid(p, 'expected {"type": "server_vad", ...} or null')
    _known(v, p, _TURN_FIELDS)
    kind = v.get("type")
    if kind == "semantic_vad":
        raise _unsupported(f"{p}.type", "semantic_vad is not supported; use server_vad or null")
    if kind not in (None, "server_vad"):
        raise _invalid(f"{p}.type", 'expected "server_vad"')
    d = TurnDetection()

    def get(key: str, check: Callable[[object, str], Any], default: Any) -> Any:
        return default if v.get(key) is None else check(v[key], f"{p}.{key}")

    return TurnDetection(
        threshold=get("threshold", lambda x, q: _number(x, q, 0.0, 1.0), d.threshold),
        prefix_padding_ms=get(
            "prefix_padding_ms", lambda x, q: _int(x, q, 0, _MAX_PADDING_MS), d.prefix_padding_ms
        ),
        silence_duration_ms=get(
            "silence_duration_ms",
            lambda x, q: _int(x, q, 0, _MAX_SILENCE_MS),
            d.silence_duration_ms,
        ),
        create_response=get("create_response", _bool, d.create_response),
        interrupt_response=get("interrupt_response", _bool, d.interrupt_response),
    )


def _check_voice(v: object, p: str) -> str | None:
    if isinstance(v, dict):  # GA custom voice {"id": ...}
        _known(v, p, {"id"})
        v, p = v.get("id"), f"{p}.id"
    if v is None:
        return None
    name = _str(v, p, nonempty=True)
    # Clients send a built-in voice whenever they ask for audio: it selects the
    # checkpoint's own voice instead of failing the session (as the chat API does).
    return None if name in DEFAULT_VOICES else name


def _check_ref_audio(v: object, p: str) -> str | None:
    return None if v is None else _str(v, p, nonempty=True)


def _check_max_tokens(v: object, p: str) -> int | None:
    if v is None or v == "inf":
        return None
    if not _is_int(v) or v < 1:  # type: ignore[operator]
        raise _invalid(p, 'expected an integer >= 1 or "inf"')
    return v  # type: ignore[return-value]


def _check_temperature(v: object, p: str) -> float | None:
    return None if v is None else _number(v, p, 0.0, 2.0)


# Patch name -> (SessionConfig field it sets, or None for a fixed setting; its value check).
_CHECKS: dict[str, tuple[str | None, Callable[[object, str], Any]]] = {
    "instructions": ("instructions", _check_instructions),
    "output_modalities": ("output_modalities", _check_modalities),
    "input_audio_format": ("input_audio_rate", _check_input_format),
    "output_audio_format": (None, _check_output_format),
    "turn_detection": ("turn_detection", _check_turn_detection),
    "voice": ("voice", _check_voice),
    "ref_audio": ("ref_audio", _check_ref_audio),
    "max_output_tokens": ("max_output_tokens", _check_max_tokens),
    "temperature": ("temperature", _check_temperature),
    "input_audio_rate": ("input_audio_rate", _check_rate),
    "return_timings": ("return_timings", _bool),
    "fixed_text_tokens": ("fixed_text_tokens", lambda v, p: _opt_int(v, p, 1, 4096)),
    "fixed_speech_codes": ("fixed_speech_codes", lambda v, p: _opt_int(v, p, 1, 25 * 600)),
}


def apply_session_update(cfg: SessionConfig, patch: SessionPatch) -> SessionConfig:
    """`cfg` with the patch's settings; settings the patch leaves out keep their values.
    Raises ProtocolError (param: the field's path as sent) for a bad value."""
    changes: dict[str, Any] = {}
    for name, (attr, check) in _CHECKS.items():  # in this order: the rate after the format
        if name not in patch.values:
            continue
        value = check(patch.values[name], patch.params.get(name, name))
        if attr is not None:
            changes[attr] = value
    # `omniray.input_audio_rate` gives beta's "pcm16" (24 kHz by name) another rate; with
    # a GA format that names its own rate, the two must agree.
    fmt = patch.values.get("input_audio_format")
    named = fmt.get("rate") if isinstance(fmt, dict) else None
    if "input_audio_rate" in patch.values and named not in (None, changes["input_audio_rate"]):
        p = patch.params.get("input_audio_rate", "input_audio_rate")
        raise _invalid(p, f"disagrees with {patch.params.get('input_audio_format')}.rate")
    return replace(cfg, **changes)


# ---------------------------------------------------------------------------------------
# Which setting each field of session.update / response.create names, in both spellings


_IGNORE = object()  # a field of the official API that omniray accepts and ignores

_SESSION_SPEC: dict[str, Any] = {
    "type": _IGNORE,  # checked before the walk
    "instructions": "instructions",
    "output_modalities": "output_modalities",
    "modalities": "output_modalities",  # beta
    "max_output_tokens": "max_output_tokens",
    "max_response_output_tokens": "max_output_tokens",  # beta
    "temperature": "temperature",  # beta
    "voice": "voice",  # beta
    "input_audio_format": "input_audio_format",  # beta
    "output_audio_format": "output_audio_format",  # beta
    "turn_detection": "turn_detection",  # beta
    "audio": {
        "input": {
            "format": "input_audio_format",
            "turn_detection": "turn_detection",
            "noise_reduction": _IGNORE,
            "transcription": _IGNORE,
        },
        "output": {"format": "output_audio_format", "voice": "voice", "speed": _IGNORE},
    },
    # `has_ref_audio` is only reported (session_object), so a session sent back passes.
    "omniray": {
        "ref_audio": "ref_audio",
        "input_audio_rate": "input_audio_rate",
        "return_timings": "return_timings",
        "fixed_text_tokens": "fixed_text_tokens",
        "fixed_speech_codes": "fixed_speech_codes",
        "has_ref_audio": _IGNORE,
    },
    # No counterpart in omniray: tools and prompts, tracing, truncation, transcription and
    # noise reduction (beta spellings), speed; `model` is chosen by the URL, and `id`,
    # `object`, `expires_at` let a client send back a session object it was given.
    **dict.fromkeys(
        (
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "prompt",
            "reasoning",
            "include",
            "tracing",
            "truncation",
            "client_secret",
            "input_audio_transcription",
            "input_audio_noise_reduction",
            "speed",
            "model",
            "id",
            "object",
            "expires_at",
        ),
        _IGNORE,
    ),
}

_RESPONSE_SPEC: dict[str, Any] = {
    "instructions": "instructions",
    "output_modalities": "output_modalities",
    "modalities": "output_modalities",  # beta
    "max_output_tokens": "max_output_tokens",
    "max_response_output_tokens": "max_output_tokens",  # beta
    "temperature": "temperature",  # beta
    "voice": "voice",  # beta
    "output_audio_format": "output_audio_format",  # beta
    "audio": {"output": {"format": "output_audio_format", "voice": "voice"}},
    # conversation, input and metadata are checked before the walk
    **dict.fromkeys(
        (
            "conversation",
            "input",
            "metadata",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "prompt",
            "reasoning",
        ),
        _IGNORE,
    ),
}


def _walk(
    obj: object, path: str, spec: Mapping[str, Any], values: dict[str, Any], params: dict[str, str]
) -> None:
    if obj is None:
        return
    if not isinstance(obj, dict):
        raise _invalid(path, "expected an object")
    for key, value in obj.items():
        p = _join(path, key)
        target = spec.get(key)
        if target is None:
            raise ProtocolError("invalid_value", f"unknown field {p}", p)
        if target is _IGNORE:
            continue
        if isinstance(target, dict):
            _walk(value, p, target, values, params)
        elif target in values:
            raise _invalid(p, f"sets the same setting as {params[target]}; send one of them")
        else:
            values[target] = value
            params[target] = p


def _session_patch(obj: object, path: str) -> SessionPatch:
    if not isinstance(obj, dict):
        raise _invalid(path, "expected an object")
    kind = obj.get("type")
    if kind == "transcription":
        raise _unsupported(f"{path}.type", "transcription sessions are not supported")
    if kind not in (None, "realtime"):
        raise _invalid(f"{path}.type", 'expected "realtime"')
    values: dict[str, Any] = {}
    params: dict[str, str] = {}
    _walk(obj, path, _SESSION_SPEC, values, params)
    return SessionPatch(MappingProxyType(values), MappingProxyType(params))


# ---------------------------------------------------------------------------------------
# Conversation items


@dataclass(frozen=True)
class ContentPart:
    type: PartType
    text: str | None = None  # input_text, output_text
    audio: bytes | None = field(default=None, repr=False)  # input_audio: pcm16, session rate
    transcript: str | None = None  # input_audio (when known), output_audio


@dataclass(frozen=True)
class Item:
    id: str
    role: Role
    content: tuple[ContentPart, ...] = ()
    type: Literal["message"] = "message"


# Role -> part type as sent (GA, then beta's names for the assistant's) -> our part type.
_PART_TYPES: dict[str, dict[str, PartType]] = {
    "user": {"input_text": "input_text", "input_audio": "input_audio"},
    "system": {"input_text": "input_text"},
    "assistant": {
        "output_text": "output_text",
        "output_audio": "output_audio",
        "text": "output_text",
        "audio": "output_audio",
    },
}
_UNSUPPORTED_PARTS = frozenset({"input_image", "item_reference"})
_UNSUPPORTED_ITEMS = frozenset({"function_call", "function_call_output", "item_reference"})
_MAX_ID = 64


def _pcm16(v: object, param: str) -> bytes:
    if not isinstance(v, str):
        raise _invalid(param, "expected base64-encoded pcm16 audio")
    try:
        data = base64.b64decode(v, validate=True)
    except ValueError:  # binascii.Error, or a non-ASCII string
        raise _invalid(param, "not valid base64") from None
    if len(data) % 2:
        raise _invalid(param, "pcm16 audio needs an even number of bytes")
    return data


def _id(v: object, param: str) -> str:
    s = _str(v, param, nonempty=True)
    if len(s) > _MAX_ID:
        raise _invalid(param, f"at most {_MAX_ID} characters")
    return s


def _part(obj: object, path: str, role: str) -> ContentPart:
    if not isinstance(obj, dict):
        raise _invalid(path, "expected a content part object")
    sent = obj.get("type")
    if sent in _UNSUPPORTED_PARTS:
        raise _unsupported(f"{path}.type", f"{sent} content is not supported")
    kind = _PART_TYPES[role].get(sent) if isinstance(sent, str) else None
    if kind is None:
        raise _invalid(
            f"{path}.type", f"a {role} message takes parts of type {', '.join(_PART_TYPES[role])}"
        )
    if kind in ("input_text", "output_text"):
        _known(obj, path, {"type", "text"})
        return ContentPart(kind, text=_str(obj.get("text"), f"{path}.text"))
    _known(obj, path, {"type", "audio", "transcript"})
    transcript = _opt_str(obj.get("transcript"), f"{path}.transcript")
    if kind == "input_audio":
        return ContentPart(
            kind, audio=_pcm16(obj.get("audio"), f"{path}.audio"), transcript=transcript
        )
    # An assistant's earlier audio enters the conversation as its transcript, which is
    # what the model reads back, so audio bytes sent with it are not kept.
    return ContentPart(kind, transcript=transcript or "")


def _item(obj: object, path: str) -> Item:
    if not isinstance(obj, dict):
        raise _invalid(path, "expected an item object")
    kind = obj.get("type", "message")
    if kind != "message":
        if isinstance(kind, str) and (kind in _UNSUPPORTED_ITEMS or kind.startswith("mcp_")):
            raise _unsupported(f"{path}.type", f"{kind} items are not supported")
        raise _invalid(f"{path}.type", 'expected "message"')
    _known(obj, path, {"id", "type", "role", "content", "object", "status"})
    item_id = new_id("item") if obj.get("id") is None else _id(obj["id"], f"{path}.id")
    role = obj.get("role")
    if role not in _PART_TYPES:
        raise _invalid(f"{path}.role", 'expected "user", "assistant" or "system"')
    content = obj.get("content", [])
    if not isinstance(content, list):
        raise _invalid(f"{path}.content", "expected a list of content parts")
    parts = tuple(_part(c, f"{path}.content[{i}]", role) for i, c in enumerate(content))
    return Item(item_id, role, parts)


# The longest text (or transcript) of a client's own item that its echo carries back.
ECHO_MAX_CHARS = 16 << 10


def _echo(text: str | None, brief: bool) -> str | None:
    return None if brief and text is not None and len(text) > ECHO_MAX_CHARS else text


def item_object(
    item: Item, status: ItemStatus = "completed", *, beta: bool = False, brief: bool = False
) -> dict:
    """The item as the API shows it. Audio bytes are never echoed back (the API sends them
    as deltas, or not at all for the client's own audio): audio parts carry the transcript.
    `brief` (the echo of an item the client created): a text or transcript longer than
    ECHO_MAX_CHARS is sent as null. The client has it; the API's item types make both
    optional, and echoing it would let a client multiply what the server sends it."""
    content: list[dict[str, Any]] = []
    for part in item.content:
        if part.type in ("input_text", "output_text"):
            text = part.text or ""
            content.append({"type": part.type, "text": _echo(text, brief)})
        else:
            content.append({"type": part.type, "transcript": _echo(part.transcript, brief)})
    obj = {
        "id": item.id,
        "object": "realtime.item",
        "type": item.type,
        "status": status,
        "role": item.role,
        "content": content,
    }
    return _item_to_beta(obj) if beta else obj


# ---------------------------------------------------------------------------------------
# Client events


@dataclass(frozen=True)
class SessionUpdate:
    session: SessionPatch
    event_id: str | None = None


@dataclass(frozen=True)
class AudioAppend:
    audio: bytes = field(repr=False)  # pcm16 at the session's input rate
    event_id: str | None = None


@dataclass(frozen=True)
class AudioCommit:
    event_id: str | None = None


@dataclass(frozen=True)
class AudioClear:
    event_id: str | None = None


@dataclass(frozen=True)
class ItemCreate:
    item: Item
    previous_item_id: str | None = None
    event_id: str | None = None


@dataclass(frozen=True)
class ItemTruncate:
    item_id: str
    content_index: int
    audio_end_ms: int
    event_id: str | None = None


@dataclass(frozen=True)
class ItemDelete:
    item_id: str
    event_id: str | None = None


@dataclass(frozen=True)
class ResponseOverrides:
    """One response's settings over the session's: `apply_session_update(cfg, patch)` gives
    the response's config."""

    patch: SessionPatch = SessionPatch()
    metadata: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ResponseCreate:
    response: ResponseOverrides = ResponseOverrides()
    event_id: str | None = None


@dataclass(frozen=True)
class ResponseCancel:
    response_id: str | None = None
    event_id: str | None = None


ClientEvent = (
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ItemTruncate
    | ItemDelete
    | ResponseCreate
    | ResponseCancel
)

_BASE = frozenset({"type", "event_id"})


def _session_update(obj: dict, eid: str | None) -> SessionUpdate:
    _known(obj, "", _BASE | {"session"})
    if "session" not in obj:
        raise _invalid("session", "required")
    return SessionUpdate(_session_patch(obj["session"], "session"), eid)


def _audio_append(obj: dict, eid: str | None) -> AudioAppend:
    _known(obj, "", _BASE | {"audio"})
    return AudioAppend(_pcm16(obj.get("audio"), "audio"), eid)


def _audio_commit(obj: dict, eid: str | None) -> AudioCommit:
    _known(obj, "", _BASE)
    return AudioCommit(eid)


def _audio_clear(obj: dict, eid: str | None) -> AudioClear:
    _known(obj, "", _BASE)
    return AudioClear(eid)


def _item_create(obj: dict, eid: str | None) -> ItemCreate:
    _known(obj, "", _BASE | {"item", "previous_item_id"})
    prev = obj.get("previous_item_id")
    return ItemCreate(
        _item(obj.get("item"), "item"), None if prev is None else _id(prev, "previous_item_id"), eid
    )


def _item_truncate(obj: dict, eid: str | None) -> ItemTruncate:
    _known(obj, "", _BASE | {"item_id", "content_index", "audio_end_ms"})
    return ItemTruncate(
        _id(obj.get("item_id"), "item_id"),
        _int(obj.get("content_index"), "content_index", 0),
        _int(obj.get("audio_end_ms"), "audio_end_ms", 0),
        eid,
    )


def _item_delete(obj: dict, eid: str | None) -> ItemDelete:
    _known(obj, "", _BASE | {"item_id"})
    return ItemDelete(_id(obj.get("item_id"), "item_id"), eid)


def _metadata(v: object, p: str) -> Mapping[str, str] | None:
    # The API's metadata rule: at most 16 pairs, keys up to 64 and values up to 512 chars.
    if v is None:
        return None
    if (
        not isinstance(v, dict)
        or len(v) > 16
        or any(
            not isinstance(k, str) or len(k) > 64 or not isinstance(x, str) or len(x) > 512
            for k, x in v.items()
        )
    ):
        raise _invalid(p, "expected at most 16 string pairs (keys <= 64, values <= 512 chars)")
    return MappingProxyType(dict(v))


def _response_create(obj: dict, eid: str | None) -> ResponseCreate:
    _known(obj, "", _BASE | {"response"})
    body = obj.get("response")
    if body is None:
        return ResponseCreate(ResponseOverrides(), eid)
    if not isinstance(body, dict):
        raise _invalid("response", "expected an object")
    if body.get("conversation") not in (None, "auto"):
        raise _unsupported(
            "response.conversation",
            'only "auto" is supported (no responses outside the conversation)',
        )
    if body.get("input"):
        raise _unsupported("response.input", "responses over a custom input are not supported")
    metadata = _metadata(body.get("metadata"), "response.metadata")
    values: dict[str, Any] = {}
    params: dict[str, str] = {}
    _walk(body, "response", _RESPONSE_SPEC, values, params)
    patch = SessionPatch(MappingProxyType(values), MappingProxyType(params))
    return ResponseCreate(ResponseOverrides(patch, metadata), eid)


def _response_cancel(obj: dict, eid: str | None) -> ResponseCancel:
    _known(obj, "", _BASE | {"response_id"})
    rid = obj.get("response_id")
    return ResponseCancel(None if rid is None else _id(rid, "response_id"), eid)


_PARSERS: dict[str, Callable[[dict, str | None], ClientEvent]] = {
    "session.update": _session_update,
    "input_audio_buffer.append": _audio_append,
    "input_audio_buffer.commit": _audio_commit,
    "input_audio_buffer.clear": _audio_clear,
    "conversation.item.create": _item_create,
    "conversation.item.truncate": _item_truncate,
    "conversation.item.delete": _item_delete,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
}
# Client events of the official API that omniray does not implement.
_UNSUPPORTED_EVENTS = frozenset(
    {"conversation.item.retrieve", "output_audio_buffer.clear", "transcription_session.update"}
)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_client_event(text: str | bytes, *, max_bytes: int) -> ClientEvent:
    """One client event (a WebSocket message) -> its typed event; ProtocolError if refused.
    The size is checked before anything is parsed."""
    # A str's UTF-8 size is at least its length, so a long one is refused without encoding.
    if len(text) > max_bytes or (
        isinstance(text, str) and len(text.encode("utf-8", "surrogatepass")) > max_bytes
    ):
        raise ProtocolError("payload_too_large", f"an event may be at most {max_bytes} bytes")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
        raise ProtocolError("invalid_event", f"the event is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_event", "an event must be a JSON object")
    eid = obj.get("event_id")
    if eid is not None and not isinstance(eid, str):
        raise ProtocolError("invalid_value", "event_id: expected a string", "event_id")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_event", "the event has no string `type`", "type", eid)
    parser = _PARSERS.get(kind)
    if parser is None:
        if kind in _UNSUPPORTED_EVENTS:
            raise ProtocolError("unsupported", f"{kind} is not supported", "type", eid)
        raise ProtocolError("unknown_event", f"unknown event type {kind[:80]!r}", "type", eid)
    try:
        return parser(obj, eid)
    except ProtocolError as e:
        e.event_id = eid
        raise


# ---------------------------------------------------------------------------------------
# Session and response objects


def _pcm(rate: int) -> dict[str, Any]:
    return {"type": "audio/pcm", "rate": rate}


def _turn_object(td: TurnDetection | None) -> dict[str, Any] | None:
    if td is None:
        return None
    return {
        "type": td.type,
        "threshold": td.threshold,
        "prefix_padding_ms": td.prefix_padding_ms,
        "silence_duration_ms": td.silence_duration_ms,
        "create_response": td.create_response,
        "interrupt_response": td.interrupt_response,
    }


def session_object(
    session_id: str, cfg: SessionConfig, *, beta: bool = False, model: str = "omniray"
) -> dict[str, Any]:
    """The session as `session.created` / `session.updated` carry it. `omniray` reports
    whether a voice to clone is set (the URI itself can be megabytes: never echoed)."""
    obj: dict[str, Any] = {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": list(cfg.output_modalities),
        "instructions": cfg.instructions,
        "max_output_tokens": cfg.max_output_tokens or "inf",
        "audio": {
            "input": {
                "format": _pcm(cfg.input_audio_rate),
                "turn_detection": _turn_object(cfg.turn_detection),
                "transcription": None,
                "noise_reduction": None,
            },
            "output": {"format": _pcm(OUTPUT_RATE), "voice": cfg.voice, "speed": 1.0},
        },
        "tools": [],
        "omniray": {"has_ref_audio": cfg.ref_audio is not None},
    }
    if cfg.temperature is not None:
        obj["temperature"] = cfg.temperature
    return _session_to_beta(obj) if beta else obj


@dataclass(frozen=True)
class ResponseError:
    code: str
    message: str
    type: str = "server_error"


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # input tokens served from the prefix cache


_REASONS: dict[str, frozenset[str]] = {
    "cancelled": frozenset({"turn_detected", "client_cancelled"}),
    "incomplete": frozenset({"max_output_tokens"}),
}


@dataclass(frozen=True)
class Response:
    """One response: `config` is its effective settings (the session's with the
    response.create overrides); `reason` for cancelled / incomplete, `error` for failed."""

    id: str
    config: SessionConfig
    status: ResponseStatus = "in_progress"
    output: tuple[Item, ...] = ()
    reason: str | None = None
    error: ResponseError | None = None
    usage: Usage | None = None
    metadata: Mapping[str, str] | None = None
    # omniray's own report of the turn (latencies; spans when the session asked for them),
    # as the `omniray` field of the response object
    report: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        allowed = _REASONS.get(self.status)
        if allowed is None and self.reason is not None:
            raise ValueError(f"a {self.status} response has no reason, got {self.reason!r}")
        if allowed is not None and self.reason not in allowed:
            raise ValueError(f"a {self.status} response needs a reason in {sorted(allowed)}")
        if (self.error is not None) != (self.status == "failed"):
            raise ValueError("a failed response, and only a failed one, carries an error")


def response_object(resp: Response) -> dict[str, Any]:
    """The response as response.created / response.done carry it (GA shape)."""
    details: dict[str, Any] | None = None
    if resp.reason is not None:
        details = {"type": resp.status, "reason": resp.reason}
    elif resp.error is not None:
        details = {
            "type": "failed",
            "error": {
                "type": resp.error.type,
                "code": resp.error.code,
                "message": resp.error.message,
            },
        }
    item_status: ItemStatus = (
        "in_progress"
        if resp.status == "in_progress"
        else "completed"
        if resp.status == "completed"
        else "incomplete"
    )
    usage = None
    if resp.usage is not None:
        u = resp.usage
        usage = {
            "total_tokens": u.input_tokens + u.output_tokens,
            "input_tokens": u.input_tokens,
            "output_tokens": u.output_tokens,
            "input_token_details": {"cached_tokens": u.cached_tokens},
        }
    cfg = resp.config
    obj: dict[str, Any] = {
        "object": "realtime.response",
        "id": resp.id,
        "status": resp.status,
        "status_details": details,
        "output": [item_object(item, item_status) for item in resp.output],
        "output_modalities": list(cfg.output_modalities),
        "audio": {"output": {"format": _pcm(OUTPUT_RATE), "voice": cfg.voice}},
        "max_output_tokens": cfg.max_output_tokens or "inf",
        "metadata": None if resp.metadata is None else dict(resp.metadata),
        "usage": usage,
    }
    if cfg.temperature is not None:
        obj["temperature"] = cfg.temperature
    if resp.report is not None:
        obj["omniray"] = dict(resp.report)
    return obj


# ---------------------------------------------------------------------------------------
# Server events (GA shape; `to_beta` for beta sessions)


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def session_created(session_id: str, cfg: SessionConfig, *, model: str = "omniray") -> dict:
    return _event("session.created", session=session_object(session_id, cfg, model=model))


def session_updated(session_id: str, cfg: SessionConfig, *, model: str = "omniray") -> dict:
    return _event("session.updated", session=session_object(session_id, cfg, model=model))


def error(
    code: str,
    message: str,
    param: str | None = None,
    event_id: str | None = None,
    *,
    kind: str = "invalid_request_error",
) -> dict:
    """An `error` event; `kind` is the API's error type (invalid_request_error for the
    client's mistakes, server_error for ours)."""
    return _event(
        "error",
        error={
            "type": kind,
            "code": code,
            "message": message,
            "param": param,
            "event_id": event_id,
        },
    )


def protocol_error(e: ProtocolError) -> dict:
    return error(e.code, e.message, e.param, e.event_id)


def input_audio_buffer_speech_started(audio_start_ms: int, item_id: str) -> dict:
    return _event(
        "input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=item_id
    )


def input_audio_buffer_speech_stopped(audio_end_ms: int, item_id: str) -> dict:
    return _event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id)


def input_audio_buffer_committed(item_id: str, previous_item_id: str | None) -> dict:
    return _event(
        "input_audio_buffer.committed", item_id=item_id, previous_item_id=previous_item_id
    )


def input_audio_buffer_cleared() -> dict:
    return _event("input_audio_buffer.cleared")


def conversation_item_added(
    item: Item, previous_item_id: str | None, status: ItemStatus = "completed", *,
    brief: bool = False,
) -> dict:
    """GA `conversation.item.added`; a beta session gets it as `conversation.item.created`.
    `brief`: see item_object."""
    return _event(
        "conversation.item.added", previous_item_id=previous_item_id,
        item=item_object(item, status, brief=brief),
    )


def conversation_item_done(
    item: Item, previous_item_id: str | None, status: ItemStatus = "completed", *,
    brief: bool = False,
) -> dict:
    """GA only: `to_beta` drops it."""
    return _event(
        "conversation.item.done", previous_item_id=previous_item_id,
        item=item_object(item, status, brief=brief),
    )


def conversation_item_truncated(item_id: str, content_index: int, audio_end_ms: int) -> dict:
    return _event(
        "conversation.item.truncated",
        item_id=item_id,
        content_index=content_index,
        audio_end_ms=audio_end_ms,
    )


def conversation_item_deleted(item_id: str) -> dict:
    return _event("conversation.item.deleted", item_id=item_id)


def response_created(response: Response) -> dict:
    return _event("response.created", response=response_object(response))


def response_done(response: Response) -> dict:
    return _event("response.done", response=response_object(response))


def response_output_item_added(
    response_id: str, output_index: int, item: Item, status: ItemStatus = "in_progress"
) -> dict:
    return _event(
        "response.output_item.added",
        response_id=response_id,
        output_index=output_index,
        item=item_object(item, status),
    )


def response_output_item_done(
    response_id: str, output_index: int, item: Item, status: ItemStatus = "completed"
) -> dict:
    return _event(
        "response.output_item.done",
        response_id=response_id,
        output_index=output_index,
        item=item_object(item, status),
    )


def _part_object(part: ContentPart) -> dict[str, Any]:
    # The content_part events name output parts "audio" / "text" in both spellings.
    if part.type == "output_audio":
        return {"type": "audio", "transcript": part.transcript or ""}
    if part.type == "output_text":
        return {"type": "text", "text": part.text or ""}
    raise ValueError(f"a response's content part is output_audio or output_text, not {part.type}")


def response_content_part_added(
    response_id: str, item_id: str, output_index: int, content_index: int, part: ContentPart
) -> dict:
    return _event(
        "response.content_part.added",
        response_id=response_id,
        item_id=item_id,
        output_index=output_index,
        content_index=content_index,
        part=_part_object(part),
    )


def response_content_part_done(
    response_id: str, item_id: str, output_index: int, content_index: int, part: ContentPart
) -> dict:
    return _event(
        "response.content_part.done",
        response_id=response_id,
        item_id=item_id,
        output_index=output_index,
        content_index=content_index,
        part=_part_object(part),
    )


def _content_event(
    kind: str, response_id: str, item_id: str, output_index: int, content_index: int, **fields: Any
) -> dict:
    return _event(
        kind,
        response_id=response_id,
        item_id=item_id,
        output_index=output_index,
        content_index=content_index,
        **fields,
    )


def response_output_audio_delta(
    response_id: str, item_id: str, output_index: int, content_index: int, delta_b64: str
) -> dict:
    """`delta_b64`: base64 of pcm16 at 24 kHz."""
    return _content_event(
        "response.output_audio.delta",
        response_id,
        item_id,
        output_index,
        content_index,
        delta=delta_b64,
    )


def response_output_audio_done(
    response_id: str, item_id: str, output_index: int, content_index: int
) -> dict:
    return _content_event(
        "response.output_audio.done", response_id, item_id, output_index, content_index
    )


def response_output_audio_transcript_delta(
    response_id: str, item_id: str, output_index: int, content_index: int, delta: str
) -> dict:
    return _content_event(
        "response.output_audio_transcript.delta",
        response_id,
        item_id,
        output_index,
        content_index,
        delta=delta,
    )


def response_output_audio_transcript_done(
    response_id: str, item_id: str, output_index: int, content_index: int, transcript: str
) -> dict:
    return _content_event(
        "response.output_audio_transcript.done",
        response_id,
        item_id,
        output_index,
        content_index,
        transcript=transcript,
    )


def response_output_text_delta(
    response_id: str, item_id: str, output_index: int, content_index: int, delta: str
) -> dict:
    return _content_event(
        "response.output_text.delta", response_id, item_id, output_index, content_index, delta=delta
    )


def response_output_text_done(
    response_id: str, item_id: str, output_index: int, content_index: int, text: str
) -> dict:
    return _content_event(
        "response.output_text.done", response_id, item_id, output_index, content_index, text=text
    )


# ---------------------------------------------------------------------------------------
# The beta spelling


_BETA_NAMES = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    **{
        k: k
        for k in (
            "session.created",
            "session.updated",
            "error",
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "input_audio_buffer.cleared",
            "conversation.item.truncated",
            "conversation.item.deleted",
            "response.created",
            "response.done",
            "response.output_item.added",
            "response.output_item.done",
            "response.content_part.added",
            "response.content_part.done",
        )
    },
}
_GA_ONLY = frozenset({"conversation.item.done"})
_BETA_PARTS = {"output_text": "text", "output_audio": "audio"}


def _beta_modalities(modalities: list[str]) -> list[str]:
    # Beta spells audio output (which always carries its transcript) as ["text", "audio"].
    return ["text", "audio"] if "audio" in modalities else ["text"]


def _item_to_beta(item: dict[str, Any]) -> dict[str, Any]:
    content = [{**c, "type": _BETA_PARTS.get(c["type"], c["type"])} for c in item["content"]]
    return {**item, "content": content}


def _session_to_beta(s: dict[str, Any]) -> dict[str, Any]:
    audio_in, audio_out = s["audio"]["input"], s["audio"]["output"]
    # `model` is left out: the beta schema lists only OpenAI's models. Beta's "pcm16" is
    # 24 kHz; the input rate actually in use is reported in the extension.
    beta: dict[str, Any] = {
        "object": s["object"],
        "id": s["id"],
        "modalities": _beta_modalities(s["output_modalities"]),
        "instructions": s["instructions"],
        "voice": audio_out["voice"],
        "input_audio_format": "pcm16",
        "output_audio_format": "pcm16",
        "input_audio_transcription": None,
        "turn_detection": audio_in["turn_detection"],
        "max_response_output_tokens": s["max_output_tokens"],
        "tools": [],
        "omniray": {**s["omniray"], "input_audio_rate": audio_in["format"]["rate"]},
    }
    if "temperature" in s:
        beta["temperature"] = s["temperature"]
    return beta


def _response_to_beta(r: dict[str, Any]) -> dict[str, Any]:
    beta = {k: v for k, v in r.items() if k not in ("audio", "output_modalities", "output")}
    beta["modalities"] = _beta_modalities(r["output_modalities"])
    beta["output_audio_format"] = "pcm16"
    beta["voice"] = r["audio"]["output"]["voice"]
    beta["output"] = [_item_to_beta(item) for item in r["output"]]
    return beta


def to_beta(event: dict[str, Any]) -> dict[str, Any] | None:
    """A GA server event in the beta names and shapes, for a session opened with
    `OpenAI-Beta: realtime=v1`; None for a GA-only event (not sent to beta sessions)."""
    kind = event["type"]
    if kind in _GA_ONLY:
        return None
    if kind not in _BETA_NAMES:
        raise ValueError(f"no beta form for server event {kind!r}")
    out = {**event, "type": _BETA_NAMES[kind]}
    if "session" in out:
        out["session"] = _session_to_beta(out["session"])
    if "item" in out:
        out["item"] = _item_to_beta(out["item"])
    if "response" in out:
        out["response"] = _response_to_beta(out["response"])
    return out
