"""Options of one full-duplex session: the reference `MiniCPMODuplex` keyword arguments,
under the same names and with the same defaults."""

from __future__ import annotations

from dataclasses import dataclass

DECODE_MODES = ("sampling", "greedy")
SLIDING_WINDOW_MODES = ("off", "basic", "context")


@dataclass(frozen=True)
class DuplexConfig:
    max_new_speak_tokens_per_chunk: int = 20
    decode_mode: str = "sampling"  # "sampling" | "greedy"
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    listen_prob_scale: float = 1.0
    listen_top_k: int | None = None
    text_repetition_penalty: float = 1.05
    text_repetition_window_size: int = 512
    force_listen_count: int = 0
    tts_temperature: float = 0.8
    tts_repetition_penalty: float = 1.05
    chunk_ms: int = 1000
    first_chunk_ms: int = 1035
    cnn_redundancy_ms: int = 20
    sample_rate: int = 16000
    sliding_window_mode: str = "off"  # "off" | "basic" | "context"
    basic_window_high_tokens: int = 4000
    basic_window_low_tokens: int = 3500
    context_previous_max_tokens: int = 500
    context_max_units: int = 24

    def __post_init__(self) -> None:
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        if self.sliding_window_mode not in SLIDING_WINDOW_MODES:
            raise ValueError(
                f"sliding_window_mode must be one of {SLIDING_WINDOW_MODES}, "
                f"got {self.sliding_window_mode!r}"
            )
        if self.max_new_speak_tokens_per_chunk < 1:
            raise ValueError("max_new_speak_tokens_per_chunk must be >= 1")
        if self.decode_mode == "sampling":
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0, got {self.temperature}")
            if not 0.0 <= self.top_p <= 1.0:
                raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.text_repetition_penalty <= 0:
            raise ValueError("text_repetition_penalty must be > 0")
        if self.text_repetition_window_size < 1:
            raise ValueError("text_repetition_window_size must be >= 1")
        if self.listen_top_k is not None and self.listen_top_k < 0:
            raise ValueError("listen_top_k must be >= 0 or None")
        if self.force_listen_count < 0:
            raise ValueError("force_listen_count must be >= 0")
        if self.sample_rate != 16000:
            raise ValueError("the audio encoder takes 16 kHz input: sample_rate must be 16000")
        if self.chunk_ms <= 0 or self.first_chunk_ms <= 0 or self.cnn_redundancy_ms < 0:
            raise ValueError("chunk_ms and first_chunk_ms must be > 0, cnn_redundancy_ms >= 0")
        if self.sliding_window_mode == "basic" and not (
            0 < self.basic_window_low_tokens <= self.basic_window_high_tokens
        ):
            raise ValueError(
                "basic window: need 0 < basic_window_low_tokens <= basic_window_high_tokens"
            )
        if self.sliding_window_mode == "context" and (
            self.context_max_units < 1 or self.context_previous_max_tokens < 0
        ):
            raise ValueError(
                "context window: need context_max_units >= 1, context_previous_max_tokens >= 0"
            )


def unit_tokens_max(cfg: DuplexConfig, query_num: int, max_slice_nums: int = 1) -> int:
    """The most rows one unit adds to a session's context (one frame, as the wires send):
    <unit>; the frame's source image and, when it slices, at most `max_slice_nums` slices,
    each `query_num` rows between two markers; the audio at 10 rows a second (the first
    unit's `first_chunk_ms`, rounded up, and one more for the encoder's redundancy); the
    decision and at most `max_new_speak_tokens_per_chunk` tokens, the chunk terminator and
    </unit>."""
    images = 1 + (max_slice_nums if max_slice_nums > 1 else 0)
    audio = -(-max(cfg.chunk_ms, cfg.first_chunk_ms) // 100) + 1
    return 1 + images * (query_num + 2) + audio + 1 + cfg.max_new_speak_tokens_per_chunk + 2


def session_tokens_max(cfg: DuplexConfig, query_num: int, max_slice_nums: int = 1) -> int | None:
    """A session's context at most: the basic window slides after the unit that takes it
    past `basic_window_high_tokens`, so it holds that mark and one unit; None for the other
    modes (`context` keeps a prefix and a previous text of any length, `off` grows)."""
    if cfg.sliding_window_mode != "basic":
        return None
    return cfg.basic_window_high_tokens + unit_tokens_max(cfg, query_num, max_slice_nums)
