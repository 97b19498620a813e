"""Per-request records and the summary metrics of a benchmark run.

The definitions follow `vllm bench serve --omni` so our numbers compare with the reference PR:

- TTFT: request send -> first SSE event with ``modality == "text"`` that carries text.
- Audio TTFP: request send -> first SSE event with ``modality == "audio"``.
- Audio RTF: (last audio event - request send) / audio seconds. Queueing, TTFT and TTFP are
  all inside the numerator, so RTF at c=4 also measures how long a request waited.
- E2E latency: request send -> end of the stream.
- Max ITL: per request, the largest gap between two consecutive text events (after the
  first): how long its decode was held up at worst, e.g. by another request's encoders
  and prefill. Summarized over requests like the latencies.
- Request throughput: completed requests / round wall time.
- Audio throughput: sum of audio seconds / round wall time.

All times on a record are ``time.perf_counter()`` seconds on the client. ``summarize`` pools
records (usually all measured rounds of one concurrency) and reports mean / median / std /
percentiles; throughputs are computed per round and their median is reported.
"""

from __future__ import annotations

import io
import itertools
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)

# Stage names the server reports in `timings.spans` (docs/bench.md). Others are kept as given.
STAGES: tuple[str, ...] = (
    "queue",
    "preprocess",
    "vision_encoder",
    "audio_encoder",
    "prefill",
    "decode",
    "talker",
    "code2wav",
)


# ----------------------------------------------------------------------------- WAV parsing


def wav_frames(data: bytes) -> tuple[int, int]:
    """(frames, sample_rate) of one RIFF/WAVE byte string, read from its header.

    Streaming writers often put 0 or 0xFFFFFFFF in the data-chunk size; then the frame count
    comes from the bytes actually present after the header.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE payload")
    pos = 12
    sample_rate = channels = bits = None
    while pos + 8 <= len(data):
        cid = data[pos : pos + 4]
        (size,) = struct.unpack("<I", data[pos + 4 : pos + 8])
        body = pos + 8
        if cid == b"fmt ":
            _fmt, channels, sample_rate, _brate, _align, bits = struct.unpack(
                "<HHIIHH", data[body : body + 16]
            )
        elif cid == b"data":
            if sample_rate is None:
                raise ValueError("WAV data chunk before fmt chunk")
            present = len(data) - body
            if size == 0 or size == 0xFFFFFFFF or size > present:
                size = present
            bytes_per_frame = max(1, channels * (bits // 8))
            return size // bytes_per_frame, sample_rate
        pos = body + size + (size & 1)  # chunks are word aligned
    raise ValueError("WAV without a data chunk")


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """Mono float [-1, 1] or int16 samples -> a 16-bit PCM WAV byte string."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


# ----------------------------------------------------------------------------- records


@dataclass
class AudioEvent:
    """One audio SSE event: when it arrived and how many seconds of audio it carried."""

    t: float
    seconds: float


@dataclass
class RequestRecord:
    """Everything the client saw for one request (times are perf_counter seconds)."""

    request_id: str
    item_id: str = ""
    round: int = 0
    concurrency: int = 1
    warmup: bool = False
    t_send: float = 0.0
    t_end: float | None = None
    t_first_text: float | None = None
    t_first_audio: float | None = None
    text_events: list[float] = field(default_factory=list)
    audio_events: list[AudioEvent] = field(default_factory=list)
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] | None = None
    server_metrics: dict[str, Any] = field(default_factory=dict)  # the usage chunk's `metrics`
    error: str | None = None
    answer: str | None = None  # the dataset's correct letter, if any
    predicted: str | None = None  # the letter parsed from `text`
    meta: dict[str, Any] = field(default_factory=dict)  # data set labels (type, duration)

    @property
    def ok(self) -> bool:
        return self.error is None and self.t_end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.t_first_text is None else self.t_first_text - self.t_send

    @property
    def ttfp(self) -> float | None:
        return None if self.t_first_audio is None else self.t_first_audio - self.t_send

    @property
    def e2e(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_send

    @property
    def audio_seconds(self) -> float:
        return float(sum(e.seconds for e in self.audio_events))

    @property
    def audio_latency(self) -> float | None:
        """Last audio event - request send (the RTF numerator)."""
        if not self.audio_events:
            return None
        return self.audio_events[-1].t - self.t_send

    @property
    def rtf(self) -> float | None:
        lat, sec = self.audio_latency, self.audio_seconds
        if lat is None or sec <= 0:
            return None
        return lat / sec

    @property
    def completion_tokens(self) -> int | None:
        n = self.usage.get("completion_tokens") if self.usage else None
        return int(n) if n is not None else None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (completion tokens - 1), as vLLM's bench computes it."""
        n, e2e, ttft = self.completion_tokens, self.e2e, self.ttft
        if n is None or n < 2 or e2e is None or ttft is None:
            return None
        return (e2e - ttft) / (n - 1)

    @property
    def max_itl(self) -> float | None:
        """Largest gap between two consecutive text events; None with fewer than two."""
        ev = self.text_events
        if len(ev) < 2:
            return None
        return max(b - a for a, b in itertools.pairwise(ev))

    @property
    def correct(self) -> bool | None:
        if self.answer is None:
            return None
        return self.predicted is not None and self.predicted == self.answer.strip().upper()

    def stage_durations(self) -> dict[str, float]:
        """Seconds per stage from the server's timings (sum of spans, or its `durations`)."""
        return stage_durations(self.timings)

    def timeline(self, t0: float) -> dict[str, Any]:
        """JSON-ready view with all times relative to `t0` (the round start)."""

        def rel(t: float | None) -> float | None:
            return None if t is None else t - t0

        return {
            "request_id": self.request_id,
            "item_id": self.item_id,
            "round": self.round,
            "concurrency": self.concurrency,
            "warmup": self.warmup,
            "ok": self.ok,
            "error": self.error,
            "t_send": rel(self.t_send),
            "t_first_text": rel(self.t_first_text),
            "t_first_audio": rel(self.t_first_audio),
            "t_end": rel(self.t_end),
            "ttft": self.ttft,
            "ttfp": self.ttfp,
            "e2e": self.e2e,
            "audio_seconds": self.audio_seconds,
            "audio_latency": self.audio_latency,
            "rtf": self.rtf,
            "tpot": self.tpot,
            "max_itl": self.max_itl,
            "text_events": [t - t0 for t in self.text_events],
            "audio_events": [[e.t - t0, e.seconds] for e in self.audio_events],
            "text": self.text,
            "usage": self.usage,
            "timings": self.timings,
            "server_metrics": self.server_metrics,
            "stage_durations": self.stage_durations(),
            "answer": self.answer,
            "predicted": self.predicted,
            "correct": self.correct,
            "meta": self.meta,
        }

    @classmethod
    def from_timeline(cls, d: dict[str, Any]) -> "RequestRecord":
        """Inverse of `timeline` (times stay relative to the round start)."""
        rec = cls(
            request_id=d["request_id"],
            item_id=d.get("item_id", ""),
            round=d.get("round", 0),
            concurrency=d.get("concurrency", 1),
            warmup=d.get("warmup", False),
            t_send=d["t_send"],
            t_end=d.get("t_end"),
            t_first_text=d.get("t_first_text"),
            t_first_audio=d.get("t_first_audio"),
            text_events=list(d.get("text_events", [])),
            audio_events=[AudioEvent(t, s) for t, s in d.get("audio_events", [])],
            text=d.get("text", ""),
            usage=d.get("usage") or {},
            timings=d.get("timings"),
            server_metrics=d.get("server_metrics") or {},
            error=d.get("error"),
            answer=d.get("answer"),
            predicted=d.get("predicted"),
            meta=d.get("meta") or {},
        )
        return rec


# Where a turn's first audio was made, in the server's spans (seconds since arrival): its
# first token, the Talker's first chunk (its first prefill to its release) and the Code2Wav
# step that made the first audio; and the two chunks' lengths. Then when the ingress got that
# audio (its own `first_audio_s`, same origin): Code2Wav's step to the ingress, and the
# ingress to the client (TTFP), are the two hops after it.
FIRST_AUDIO_MARKS = ("first_token", "talker_start", "talker_released", "code2wav_start",
                     "code2wav_end", "talker", "code2wav", "ingress")


def first_audio_marks(timings: dict[str, Any] | None) -> dict[str, float]:
    """FIRST_AUDIO_MARKS found in a server `timings` object (docs/bench.md), in seconds."""
    out: dict[str, float] = {}
    for span in (timings or {}).get("spans", []) or []:
        stage, chunk = span.get("stage"), span.get("chunk")
        try:
            start, end = float(span["start"]), float(span["end"])
        except (KeyError, TypeError, ValueError):
            continue
        if stage == "decode":
            out["first_token"] = start
        elif stage in ("talker", "code2wav") and chunk == 0:
            first, last = ("talker_start", "talker_released") if stage == "talker" else (
                "code2wav_start", "code2wav_end")
            out[first], out[last], out[stage] = start, end, end - start
    return out


def stage_durations(timings: dict[str, Any] | None) -> dict[str, float]:
    """Per-stage seconds from a server `timings` object (docs/bench.md).

    Explicit `durations` win; otherwise span lengths are summed per stage (a stage such as
    code2wav has one span per chunk).
    """
    if not timings:
        return {}
    if isinstance(timings.get("durations"), dict):
        return {k: float(v) for k, v in timings["durations"].items() if v is not None}
    out: dict[str, float] = {}
    for span in timings.get("spans", []) or []:
        try:
            out[span["stage"]] = out.get(span["stage"], 0.0) + float(span["end"]) - float(
                span["start"]
            )
        except (KeyError, TypeError, ValueError):
            continue
    return out


# ----------------------------------------------------------------------------- summaries


def distribution(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean / median / std / min / max / p<q> of `values` (NaN when there are none)."""
    if len(values) == 0:
        nan = float("nan")
        d = {"n": 0, "mean": nan, "median": nan, "std": nan, "min": nan, "max": nan}
        d.update({f"p{_pct_name(q)}": nan for q in percentiles})
        return d
    a = np.asarray(values, dtype=np.float64)
    d = {
        "n": int(a.size),
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
    }
    for q in percentiles:
        d[f"p{_pct_name(q)}"] = float(np.percentile(a, q))
    return d


def _pct_name(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q).replace(".", "_")


@dataclass
class RoundResult:
    """One measured round: its records and its wall time (first send -> last end)."""

    concurrency: int
    round: int
    t_start: float
    t_stop: float
    records: list[RequestRecord]

    @property
    def duration(self) -> float:
        return self.t_stop - self.t_start

    def throughput(self) -> dict[str, float]:
        ok = [r for r in self.records if r.ok]
        dur = max(self.duration, 1e-9)
        toks = sum(r.completion_tokens or 0 for r in ok)
        return {
            "duration_s": self.duration,
            "completed": len(ok),
            "failed": len(self.records) - len(ok),
            "request_throughput": len(ok) / dur,
            "audio_throughput": sum(r.audio_seconds for r in ok) / dur,
            "output_token_throughput": toks / dur,
        }


# metric name -> (record attribute, scale to the reported unit)
LATENCY_METRICS: dict[str, tuple[str, float]] = {
    "ttft_ms": ("ttft", 1e3),
    "audio_ttfp_ms": ("ttfp", 1e3),
    "e2el_ms": ("e2e", 1e3),
    "audio_rtf": ("rtf", 1.0),
    "tpot_ms": ("tpot", 1e3),
    "max_itl_ms": ("max_itl", 1e3),
    "audio_duration_s": ("audio_seconds", 1.0),
}


def summarize(
    rounds: Sequence[RoundResult], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    """Summary of the measured rounds of one concurrency.

    Latency metrics pool every successful request of every round. Throughputs are computed per
    round; the reported value is their median, and the per-round values are kept.
    """
    records = [r for rnd in rounds for r in rnd.records if not r.warmup]
    ok = [r for r in records if r.ok]
    per_round = [rnd.throughput() for rnd in rounds]
    out: dict[str, Any] = {
        "concurrency": rounds[0].concurrency if rounds else None,
        "num_rounds": len(rounds),
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "per_round": per_round,
    }
    for key in ("request_throughput", "audio_throughput", "output_token_throughput",
                "duration_s"):
        vals = [p[key] for p in per_round]
        out[key] = float(np.median(vals)) if vals else float("nan")
    for name, (attr, scale) in LATENCY_METRICS.items():
        vals = [getattr(r, attr) for r in ok]
        if attr == "audio_seconds":  # text-only replies have no audio duration
            vals = [v for v in vals if v]
        vals = [v * scale for v in vals if v is not None]
        out[name] = distribution(vals, percentiles)
    stages: dict[str, list[float]] = {}
    for r in ok:
        for k, v in r.stage_durations().items():
            stages.setdefault(k, []).append(v * 1e3)
    out["stages_ms"] = {k: distribution(v, percentiles) for k, v in _ordered(stages).items()}
    marks: dict[str, list[float]] = {}
    for r in ok:
        found = first_audio_marks(r.timings)
        if found and isinstance(r.server_metrics.get("first_audio_s"), (int, float)):
            found["ingress"] = float(r.server_metrics["first_audio_s"])
        for k, v in found.items():
            marks.setdefault(k, []).append(v * 1e3)
    out["first_audio_ms"] = {k: distribution(marks[k], percentiles)
                             for k in FIRST_AUDIO_MARKS if k in marks}
    graded = [r.correct for r in ok if r.correct is not None]
    out["accuracy"] = (sum(graded) / len(graded)) if graded else None
    out["graded"] = len(graded)
    return out


def _ordered(d: dict[str, Any]) -> dict[str, Any]:
    known = [k for k in STAGES if k in d]
    return {k: d[k] for k in known + sorted(k for k in d if k not in STAGES)}


def headline(summary: dict[str, Any]) -> dict[str, float]:
    """The figures compared against a baseline."""

    def med(name: str) -> float:
        return summary.get(name, {}).get("median", float("nan"))

    return {
        "request_throughput": summary.get("request_throughput", float("nan")),
        "audio_throughput": summary.get("audio_throughput", float("nan")),
        "ttft_ms": med("ttft_ms"),
        "audio_ttfp_ms": med("audio_ttfp_ms"),
        "audio_rtf": med("audio_rtf"),
        "e2el_ms": med("e2el_ms"),
    }


def ratio(value: float, base: float) -> float:
    """value / base, NaN when either is missing or base is 0."""
    if value is None or base is None or not math.isfinite(value) or not math.isfinite(base):
        return float("nan")
    if base == 0:
        return float("nan")
    return value / base


def records_to_json(records: Iterable[RequestRecord], t0: float) -> list[dict[str, Any]]:
    return [r.timeline(t0) for r in records]
