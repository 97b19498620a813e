"""The HTTP API's shapes: the OpenAI-style chat request and its errors (the typed events
that `Ingress.chat` yields to other Ray apps are in deployments/wire.py).

Request (`POST /v1/chat/completions`, vLLM-Omni's omni extensions included):
    messages     list of {role, content}; content is a string or a list of parts:
                 text | image_url | video_url | audio_url | input_audio
    modalities   ["text"] (default) or ["text", "audio"] / ["audio"]
    audio        {"format": wav | pcm16 | pcm | mp3 | opus | aac | flac, "voice": a stored
                 voice's name or id}; the format of the audio pieces
    ref_audio    a data: / file:// URI of a voice to clone (top level or in extra_body)
    sampling     temperature, top_p, top_k, repetition_penalty, seed, max_tokens,
                 ignore_eos (vLLM's fixed-length benchmark mode)

This module imports neither torch nor Ray, so a client app can import it cheaply.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


# ---------------------------------------------------------------------------------------
# Request


class _Strict(BaseModel):
    """Parts reject unknown keys' *types*, but unknown keys themselves are ignored, as
    OpenAI-compatible servers do (clients send vendor extras)."""

    model_config = ConfigDict(extra="ignore")


class URLRef(_Strict):
    url: str = Field(min_length=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: URLRef


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: URLRef


class AudioURLPart(_Strict):
    type: Literal["audio_url"]
    audio_url: URLRef


class InputAudio(_Strict):
    data: str = Field(min_length=1)  # base64 bytes of an audio file
    format: Literal["wav", "mp3", "flac", "ogg", "m4a", "webm", "pcm16"] = "wav"


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[
    TextPart | ImagePart | VideoPart | AudioURLPart | InputAudioPart,
    Field(discriminator="type"),
]


class FunctionCall(_Strict):
    name: str
    arguments: str = ""


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """A chat message. `developer` is OpenAI's newer name for `system`; `tool` carries a tool
    result; an assistant message may have null content when it holds tool calls (history)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content")
        return self


class VoiceID(_Strict):
    id: str = Field(min_length=1)


# OpenAI's built-in voice names: clients send one whenever they ask for audio (the SDK
# requires it), so each selects the checkpoint's own voice rather than failing the request
# (chat and realtime alike).
DEFAULT_VOICES = frozenset({"default", "alloy", "ash", "ballad", "coral", "echo", "fable",
                            "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar"})

AUDIO_OUT_FORMATS = ("wav", "pcm16", "pcm", "mp3", "opus", "aac", "flac")


class AudioOptions(_Strict):
    format: Literal["wav", "pcm16", "pcm", "mp3", "opus", "aac", "flac"] = "wav"
    # A stored voice's name or id (POST /v1/audio/voices), or {"id": ...}; OpenAI's built-in
    # names ("alloy", ...) and "default" select the checkpoint's own voice.
    voice: str | VoiceID | None = None

    @property
    def voice_key(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceID) else self.voice


class StreamOptions(_Strict):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class OmnirayOptions(BaseModel):
    """omniray's request extension (docs/bench.md): fixed lengths for random-weight
    benchmarks, per-stage timings, and the streamed audio shape. Unknown fields are
    ignored."""

    return_timings: bool = False
    ignore_eos: bool = False
    fixed_text_tokens: int | None = Field(None, ge=1)
    fixed_speech_codes: int | None = Field(None, ge=1, le=25 * 600)  # at most 10 min
    stream_format: Literal["openai", "vllm-omni"] | None = None

    model_config = ConfigDict(extra="ignore")


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] = Field(default_factory=lambda: ["text"],
                                                       min_length=1)
    audio: AudioOptions = Field(default_factory=AudioOptions)
    ref_audio: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 or 0 = off (vLLM spells off as -1)
    # At least 0.01: the penalty divides positive logits, and a tiny one overflows them.
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    extra_body: dict[str, Any] | None = None  # some clients nest extras here verbatim
    omniray: OmnirayOptions | None = None
    # OpenAI fields this server cannot honour; a value that changes what the client gets
    # back is refused (_refuse_unsupported) instead of being silently ignored.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stop: Any = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    model_config = ConfigDict(extra="ignore", strict=False)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> ChatCompletionRequest:
        def refuse(field: str, what: str) -> None:
            raise ValueError(f"{field}: {what} is not supported by this server")

        choice = self.tool_choice
        if choice is not None and choice not in ("none", "auto", "required") \
                and not isinstance(choice, dict):
            raise ValueError(f"tool_choice: expected 'none', 'auto', 'required' or "
                             f"{{'type': 'function', ...}}, got {str(choice)[:40]!r}")
        if choice == "required" or isinstance(choice, dict):
            refuse("tool_choice", "forcing a tool call (the model does not call tools)")
        call = self.function_call
        if call is not None and call not in ("none", "auto") and not isinstance(call, dict):
            raise ValueError(f"function_call: expected 'none', 'auto' or {{'name': ...}}, got "
                             f"{str(call)[:40]!r}")
        if isinstance(call, dict):
            refuse("function_call", "forcing a function call")
        fmt = self.response_format
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        if fmt is not None and kind != "text":
            refuse("response_format", f"{kind!r} (only text)")
        if self.logprobs or self.top_logprobs:
            refuse("logprobs", "returning log probabilities")
        if self.stop:
            refuse("stop", "stop sequences")
        if self.logit_bias:
            refuse("logit_bias", "logit bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                refuse(name, f"a non-zero {name} (use repetition_penalty)")
        return self

    @model_validator(mode="after")
    def _lift_extra_body(self) -> ChatCompletionRequest:
        if self.extra_body and self.ref_audio is None:
            ref = self.extra_body.get("ref_audio")
            if ref is not None and not isinstance(ref, str):
                raise ValueError("ref_audio must be a URI string")
            self.ref_audio = ref
        return self

    @property
    def speech(self) -> bool:
        return "audio" in self.modalities

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A pydantic error list -> one readable line and the offending field path.

    For unions (content: str | list of parts) the deepest error is the useful one, and
    the branch names pydantic puts in the path ("str", "list[...]") are dropped.
    """
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = ".".join(str(p) for p in first.get("loc", ())
                   if p != "body" and not (isinstance(p, str) and (p == "str" or "[" in p)))
    msg = first.get("msg", "invalid value")
    return (f"{loc}: {msg}" if loc else msg), (loc or None)
