"""Every message that crosses a process in the app, and how it travels.

Stage -> ingress (small; payloads never come back this way): every stage call the ingress
keeps open for a turn is a stream (Thinker.generate, Talker.session, Code2Wav.stream), so
the turn's state in a stage lives exactly as long as that stream. Idle streams send a
`Heartbeat` every `timeouts.heartbeat_s` (or a `pipeline.handoff.StageFailure` when the
engine loop is wedged), so a stage that is alive but stuck is told apart from one that is
merely slow. The stage-to-stage messages are pipeline/handoff.py's.

Ingress -> other Ray apps (`Ingress.chat`, in order): TextDelta*, AudioChunk* (interleaved
as produced), then exactly one terminal event: Done (usage) or Error (reason).

This module imports neither torch nor Ray, so a client app can import it cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

SAMPLE_RATE = 24000  # Code2Wav output rate


# ---------------------------------------------------------------------------------------
# Stage -> ingress


@dataclass
class TextOut:
    """Thinker -> ingress: a text delta (possibly several engine steps coalesced)."""

    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] | None = None  # the Thinker engine's wall-clock marks


@dataclass(frozen=True)
class NamedVoice:
    """A stored voice (POST /v1/audio/voices): its prompt is built once, kept for as long as
    the voice exists, and its initial-state template stays cached (pinned) in the engine."""

    voice_id: str
    samples: np.ndarray  # 16 kHz mono float32


@dataclass
class Opened:
    """First item of a speech stage's stream: the stage now holds the turn's state."""

    stage: str


@dataclass
class Heartbeat:
    """An open stream with nothing to say for `timeouts.heartbeat_s`; its engine loop is
    healthy."""

    stage: str


@dataclass
class AudioPiece:
    """Code2Wav -> ingress: mono float32 PCM at 24 kHz; is_last closes the stream."""

    pcm: np.ndarray
    is_last: bool
    t_start: float = 0.0  # wall clock of the engine step that produced it
    t_end: float = 0.0
    talker_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------
# How a call travels


# Serve sends a call through a replica's gRPC server when its handle says
# `_by_reference=False`: no Ray task and no object store, faster than an actor call for a
# small call or a streamed item (bench/hops.py). That server takes messages of
# up to 4 MiB, so calls carrying more than this go as actor calls, whose arrays pass
# through the object store without a copy.
GRPC_MAX_ARG_BYTES = 2 * 2**20


def via(handle: Any, grpc: bool, nbytes: int = 0) -> Any:
    """`handle` for a call carrying `nbytes` of arrays: over Serve's gRPC data plane if
    `grpc` (AppConfig.stage_transport) and they fit, else as a Ray actor call."""
    if grpc and nbytes <= GRPC_MAX_ARG_BYTES:
        return handle.options(_by_reference=False)
    return handle


def error_line(e: BaseException) -> str:
    """The innermost message of a (possibly Ray-wrapped) exception, on one short line."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"[:300]


# ---------------------------------------------------------------------------------------
# Ingress -> other Ray apps (handle API)


@dataclass
class TextDelta:
    text: str
    kind: Literal["text"] = "text"
    # the turn's token counts once this text is out (the stream's running usage)
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class AudioChunk:
    """One Code2Wav piece: mono float32 PCM in [-1, 1] at `sample_rate`; `index` counts
    pieces of this request from 0, so a client can check order."""

    pcm: np.ndarray
    index: int
    sample_rate: int = SAMPLE_RATE
    kind: Literal["audio"] = "audio"

    @property
    def seconds(self) -> float:
        return len(self.pcm) / self.sample_rate


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass
class Done:
    """Terminal: the turn finished. finish_reason is "stop" | "length"."""

    usage: Usage
    finish_reason: str = "stop"
    audio_seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # ttft_s, first_audio_s, rtf
    timings: dict[str, Any] | None = None  # per-stage spans when asked for (docs/bench.md)
    kind: Literal["done"] = "done"


@dataclass
class Error:
    """Terminal: the turn failed. status is an HTTP-like code (4xx bad input, 5xx server,
    504 timeout, 499 cancelled); reason is a short machine-readable tag."""

    status: int
    message: str
    reason: str = "error"
    kind: Literal["error"] = "error"


Event = TextDelta | AudioChunk | Done | Error
