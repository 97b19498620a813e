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
    sampling_params_list   vLLM-Omni's per-stage sampling: [Thinker, Talker, Code2Wav]
    chat_template_kwargs   the chat template's switches (enable_thinking, use_tts_template)

vLLM-Omni's dialect (docs/api.md "vLLM-Omni clients"): a request carrying
`sampling_params_list`, `chat_template_kwargs` or `stream_options.continuous_usage_stats`,
`modalities: null`, or asking for audio without OpenAI's required `audio.voice` is answered
in vLLM-Omni's stream shape; `modalities` null, or left out beside `sampling_params_list`,
means every output (text and audio), as vLLM-Omni reads it.

This module imports neither torch nor Ray, so a client app can import it cheaply.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


# ---------------------------------------------------------------------------------------
# Request


class FieldError(ValueError):
    """A refusal about one field: `validation_message` reports `param` as the error's
    param (pydantic keeps the exception in the error's context)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


# Sampling fields, one definition for the top-level fields and vLLM-Omni's per-stage entries.
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1)]  # -1 or 0 = off (vLLM spells off as -1)
# At least 0.01: the penalty divides positive logits, and a tiny one overflows them.
RepetitionPenalty = Annotated[float, Field(ge=0.01, le=10.0)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
MaxTokens = Annotated[int, Field(ge=1)]


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


# The Thinker's turn terminators, <|tts_eos|> and <|im_end|> (pipeline.handoff.SamplingParams
# .stop_ids): it always stops on them, and vLLM-Omni forces the same pair, so an entry
# restating them changes nothing.
THINKER_STOP_IDS = frozenset({151704, 151645})


class StageSampling(BaseModel):
    """One entry of vLLM-Omni's `sampling_params_list`: vLLM's SamplingParams keys, each typed
    and bounded as the top-level field of that name. Other keys are kept (extra) so that the
    stage's rule (`_stage_keys`) refuses them by name."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    max_tokens: MaxTokens | None = None
    ignore_eos: bool | None = None
    n: int | None = Field(None, ge=1, le=1)
    min_tokens: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    logprobs: int | None = None
    detokenize: bool | None = None
    skip_special_tokens: bool | None = None

    model_config = ConfigDict(extra="allow")


_THINKER_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens",
                 "ignore_eos")
# The Talker's sampler is one per engine (inside its CUDA graphs): per request, only its
# seed is honoured, and these are checked against the served Talker (check_talker_sampling).
_TALKER_CHECKED = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens",
                   "stop_token_ids")
_STAGES = ("Thinker", "Talker", "Code2Wav")


def _stage_keys(entry: StageSampling, i: int) -> dict[str, Any]:
    """Stage i's entry -> the keys to apply to it (Thinker: its sampling fields; Talker: its
    seed and the keys check_talker_sampling compares); refuses, naming it, every key this
    server has no counterpart for, unless its value is what the stage does anyway."""
    given = {k: v for k, v in entry.model_dump(exclude_unset=True).items() if v is not None}
    where = f"sampling_params_list.{i}"
    for key in entry.model_extra or {}:
        raise FieldError(f"{where}.{key}", f"not a sampling field of the {_STAGES[i]} on this "
                                           "server")
    if i == 2:  # Code2Wav runs the flow and the vocoder: it samples nothing
        return {}

    def refuse(key: str, what: str) -> None:
        raise FieldError(f"{where}.{key}", what)

    if given.get("stop"):
        refuse("stop", "stop sequences are not supported by this server")
    for key in ("presence_penalty", "frequency_penalty"):
        if given.get(key):
            refuse(key, f"a non-zero {key} is not supported (use repetition_penalty)")
    if "logprobs" in given:
        refuse("logprobs", "returning log probabilities is not supported by this server")
    if given.get("min_p"):
        refuse("min_p", "min_p sampling is not supported by this server")
    if given.get("min_tokens"):
        refuse("min_tokens", "a minimum length is not supported by this server")
    if i == 0:
        if set(given.get("stop_token_ids", ())) - THINKER_STOP_IDS:
            refuse("stop_token_ids", f"the Thinker stops on {sorted(THINKER_STOP_IDS)} only")
        for key in ("detokenize", "skip_special_tokens"):
            if given.get(key) is False:
                refuse(key, "false is not supported: the reply's text is always detokenized "
                            "without special tokens")
        return {k: v for k, v in given.items() if k in _THINKER_KEYS}
    if given.get("ignore_eos"):
        refuse("ignore_eos", "the Talker always stops at its end code (omniray's "
                             "fixed_speech_codes is the fixed-length mode)")
    # detokenize / skip_special_tokens: the Talker's codes are never text, either value is moot
    return {k: v for k, v in given.items() if k in _TALKER_CHECKED or k == "seed"}


def check_talker_sampling(req: ChatCompletionRequest, talker: Any) -> None:
    """400 unless sampling_params_list's Talker entry asks for what the served Talker does
    (`talker`: its TalkerConfig, the checkpoint's tts_config): its sampler's temperature,
    top_p, top_k and repetition_penalty, a max_tokens at or above its own bound
    (`max_new_tokens` codes a reply), and its end code as the only stop id."""
    own = {"temperature": talker.temperature, "top_p": talker.top_p, "top_k": talker.top_k,
           "repetition_penalty": talker.repetition_penalty}
    for key, value in req.talker_sampling.items():
        param = f"sampling_params_list.1.{key}"
        if key in own and not math.isclose(value, own[key], rel_tol=1e-6, abs_tol=1e-9):
            raise ApiError(400, f"{param}: the Talker samples with {key} {own[key]} (the "
                                f"checkpoint's tts_config); a per-request {key} is not "
                                "supported, leave it out or send that value", param=param)
        if key == "max_tokens" and value < talker.max_new_tokens:
            raise ApiError(400, f"{param}: a cap below the Talker's own "
                                f"{talker.max_new_tokens} codes a reply is not supported",
                           param=param)
        if key == "stop_token_ids" and set(value) - {talker.eos_code}:
            raise ApiError(400, f"{param}: the Talker stops on its end code "
                                f"[{talker.eos_code}] only", param=param)


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] = Field(default_factory=lambda: ["text"],
                                                       min_length=1)
    audio: AudioOptions = Field(default_factory=AudioOptions)
    ref_audio: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Seed | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    extra_body: dict[str, Any] | None = None  # some clients nest extras here verbatim
    omniray: OmnirayOptions | None = None
    # vLLM-Omni's per-stage sampling, [Thinker, Talker, Code2Wav] (apply_stage_sampling).
    sampling_params_list: list[StageSampling | None] | None = Field(None, max_length=3)
    # The chat template's switches, as vLLM passes them to it (apply_template_kwargs).
    chat_template_kwargs: dict[str, Any] | None = None
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

    # Set by the validators below: what the request's vLLM-Omni fields asked of the stages.
    _vllm_omni: bool = PrivateAttr(False)
    _talker_seed: int | None = PrivateAttr(None)
    _talker_sampling: dict[str, Any] = PrivateAttr(default_factory=dict)
    _enable_thinking: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _vllm_omni_dialect(cls, data: Any, handler: Any) -> ChatCompletionRequest:
        """vLLM-Omni's request shape: its fields may come nested in `extra_body`, and
        `modalities` null (or left out beside `sampling_params_list`) asks for every output
        (text and audio). A request with a field of vLLM's that OpenAI's API does not define
        (`sampling_params_list`, `chat_template_kwargs`, `stream_options.
        continuous_usage_stats`), with `modalities` null, or asking for audio without
        OpenAI's required `audio.voice`, is streamed in vLLM-Omni's shape unless
        `omniray.stream_format` says otherwise (for text alone that shape is OpenAI's plus
        a `modality` key, which vLLM's text clients read alike)."""
        dialect = False
        if isinstance(data, dict):
            data = dict(data)
            nested = data.get("extra_body")
            if isinstance(nested, dict):
                for key in ("sampling_params_list", "chat_template_kwargs"):
                    if data.get(key) is None and nested.get(key) is not None:
                        data[key] = nested[key]
            every_output = data.get("sampling_params_list") is not None or (
                "modalities" in data and data["modalities"] is None)
            if every_output and data.get("modalities") is None:
                data["modalities"] = ["text", "audio"]
            usage = data.get("stream_options")
            dialect = every_output or data.get("chat_template_kwargs") is not None or (
                isinstance(usage, dict) and "continuous_usage_stats" in usage)
        req = handler(data)
        if dialect or (req.speech and req.audio.voice is None):
            req._vllm_omni = True
            ext = req.omniray or OmnirayOptions()
            if ext.stream_format is None:
                req.omniray = ext.model_copy(update={"stream_format": "vllm-omni"})
        return req

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

    @model_validator(mode="after")
    def apply_stage_sampling(self) -> ChatCompletionRequest:
        """vLLM-Omni's `sampling_params_list`: entry 0 samples the Thinker, entry 1 the
        Talker, entry 2 (Code2Wav, which samples nothing) is validated and not read. Per
        key, an entry's value wins over the top-level field (vLLM-Omni: the list wins per
        stage); keys it leaves out keep the top-level value or the default."""
        entries = self.sampling_params_list or []
        self._talker_seed = self.seed
        if entries and entries[0] is not None:
            for key, value in _stage_keys(entries[0], 0).items():
                setattr(self, key, value)
                if key == "max_tokens":  # the Thinker's limit is the entry's
                    self.max_completion_tokens = None
            self._talker_seed = self.seed  # the Thinker's seed, unless the Talker's says
        if len(entries) > 1 and entries[1] is not None:
            keys = _stage_keys(entries[1], 1)
            if "seed" in keys:
                self._talker_seed = keys.pop("seed")
            self._talker_sampling = keys
        if len(entries) > 2 and entries[2] is not None:
            _stage_keys(entries[2], 2)
        return self

    @model_validator(mode="after")
    def apply_template_kwargs(self) -> ChatCompletionRequest:
        """`chat_template_kwargs`: the switches MiniCPM-o 4.5's chat template reads are
        honoured (`enable_thinking`) or, where the server always renders one side, accepted
        on that side and refused on the other (`use_tts_template`: the prompt always ends
        with <|tts_bos|>, as the reference's streamed decode starts; `add_generation_prompt`:
        a reply is always generated; `tools`: tool definitions are not rendered). Keys the
        template does not read change nothing there and are ignored, as in vLLM."""
        kwargs = self.chat_template_kwargs or {}
        for key in ("enable_thinking", "use_tts_template", "add_generation_prompt"):
            if key in kwargs and not isinstance(kwargs[key], bool):
                raise FieldError(f"chat_template_kwargs.{key}", "must be true or false")
        self._enable_thinking = kwargs.get("enable_thinking", False)
        if kwargs.get("use_tts_template") is False:
            raise FieldError("chat_template_kwargs.use_tts_template",
                             "false is not supported: the prompt always ends with <|tts_bos|>, "
                             "as the reference's streamed decode builds it")
        if kwargs.get("add_generation_prompt") is False:
            raise FieldError("chat_template_kwargs.add_generation_prompt",
                             "false is not supported: the server always generates a reply")
        if kwargs.get("tools"):
            raise FieldError("chat_template_kwargs.tools",
                             "tool definitions are not rendered into the prompt by this server")
        return self

    @property
    def vllm_omni(self) -> bool:
        """The request speaks vLLM-Omni's dialect (see `_vllm_omni_dialect`)."""
        return self._vllm_omni

    @property
    def talker_seed(self) -> int | None:
        """The Talker's sampling seed: sampling_params_list's entry 1, else the Thinker's."""
        return self._talker_seed if self.sampling_params_list else self.seed

    @property
    def talker_sampling(self) -> dict[str, Any]:
        """Entry 1's Talker keys besides `seed`, for check_talker_sampling."""
        return self._talker_sampling

    @property
    def enable_thinking(self) -> bool:
        return self._enable_thinking

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
    for e in errors:  # a FieldError names its own field
        err = (e.get("ctx") or {}).get("error")
        if isinstance(err, FieldError):
            return str(err), err.param
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = ".".join(str(p) for p in first.get("loc", ())
                   if p != "body" and not (isinstance(p, str) and (p == "str" or "[" in p)))
    msg = first.get("msg", "invalid value")
    return (f"{loc}: {msg}" if loc else msg), (loc or None)
