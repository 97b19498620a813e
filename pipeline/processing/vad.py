"""Realtime input audio: a streaming resampler and server-side voice activity detection.

- `StreamResampler`: pcm16 (little-endian bytes) or float32 chunks at the client's rate ->
  float32 at 16 kHz, chunk by chunk through `soxr.ResampleStream` (quality HQ, the soxr_hq
  family `pipeline.processing.audio` resamples with); the chunks concatenate to exactly what
  the one-shot `soxr.resample` gives for the whole signal.
- `SileroVAD`: the Silero VAD ONNX model (shipped inside the `silero-vad` package; only its
  file is used, run with onnxruntime on the CPU) over 512-sample windows at 16 kHz, with the
  64 samples of context and the recurrent state it carries between windows.
- `ServerVAD`: the Realtime API's `turn_detection: server_vad` on top of it: speech start and
  stop events in milliseconds from the first sample fed (`audio_start_ms` / `audio_end_ms`).

Every buffer is bounded: the resampler keeps at most one odd byte (soxr's own state is
fixed-size) and the detector at most one partial window.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

import numpy as np
import onnxruntime as ort
import soxr

VAD_SAMPLE_RATE = 16000
WINDOW = 512  # samples per Silero window at 16 kHz (32 ms)
CONTEXT = 64  # trailing samples of the previous window the model sees before each window
STATE_SHAPE = (2, 1, 128)
NEG_THRESHOLD_GAP = 0.15  # Silero's exit hysteresis: speech ends below threshold - 0.15
NEG_THRESHOLD_MIN = 0.01  # ... floored here, as Silero's get_speech_timestamps does
RESAMPLE_QUALITY = "HQ"  # soxr's name for the soxr_hq recipe


# ---------------------------------------------------------------------------------------
# Resampling


class StreamResampler:
    """Resamples a stream of chunks from `in_rate` to `out_rate` (mono float32 out).

    `push` takes pcm16 little-endian bytes (scaled by 1/32768, as soundfile reads pcm16) or
    a float32 array. A pcm16 chunk of odd length keeps its last byte for the next chunk:
    the Realtime API's input is one byte stream that clients may split anywhere, so only
    the stream as a whole has to be whole samples; `flush` raises ValueError if a half
    sample is left at the end. Equal rates skip soxr (no delay, samples as they come).
    """

    def __init__(self, in_rate: int, out_rate: int = VAD_SAMPLE_RATE) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._odd = b""
        self._soxr: soxr.ResampleStream | None = None
        self.reset()

    def reset(self) -> None:
        self._odd = b""
        if self.in_rate != self.out_rate:
            self._soxr = soxr.ResampleStream(
                self.in_rate, self.out_rate, 1, dtype="float32", quality=RESAMPLE_QUALITY
            )

    def push(self, chunk: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
        x = self._samples(chunk)
        if self._soxr is None:
            return x
        return self._soxr.resample_chunk(x)

    def flush(self) -> np.ndarray:
        """The resampler's delayed tail; the stream then starts afresh."""
        odd = self._odd
        tail = (
            np.zeros(0, np.float32)
            if self._soxr is None
            else self._soxr.resample_chunk(np.zeros(0, np.float32), last=True)
        )
        self.reset()
        if odd:
            raise ValueError("pcm16 audio ended in the middle of a sample (odd byte count)")
        return tail

    def _samples(self, chunk: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
        if isinstance(chunk, np.ndarray):
            if chunk.dtype != np.float32 or chunk.ndim != 1:
                raise ValueError(
                    f"float audio must be 1-D float32, got {chunk.dtype} {chunk.shape}"
                )
            if self._odd:
                raise ValueError("float32 chunk after a pcm16 chunk with an odd byte count")
            return np.ascontiguousarray(chunk)
        data = self._odd + bytes(chunk)
        cut = len(data) - len(data) % 2
        self._odd = data[cut:]
        pcm = np.frombuffer(data[:cut], dtype="<i2")
        return pcm.astype(np.float32) / 32768.0


# ---------------------------------------------------------------------------------------
# Silero VAD


@functools.cache
def _silero_session() -> ort.InferenceSession:
    # One session for every stream: the recurrent state lives in each SileroVAD and is
    # passed in per call, and onnxruntime's run() is safe to call from several threads.
    # Located through the distribution's file list rather than importlib.resources, which
    # would import the silero_vad package and with it torch.
    path = metadata.distribution("silero-vad").locate_file("silero_vad/data/silero_vad.onnx")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(
        path.read_bytes(), sess_options=opts, providers=["CPUExecutionProvider"]
    )


def silero_problem() -> str | None:
    """Why the server VAD's model cannot be loaded on this host (None: it can), for a
    replica to report at its start rather than at its first realtime session."""
    try:
        _silero_session()
    except Exception as e:  # noqa: BLE001 - any reason is reported as it is
        return f"{type(e).__name__}: {e}"
    return None


class SileroVAD:
    """Silero VAD's streaming interface at 16 kHz: one speech probability per 512 samples.

    Each call feeds the model the previous window's last 64 samples followed by the new
    window, with the recurrent state the previous call returned (zeros after `reset`).
    """

    def __init__(self) -> None:
        self._session = _silero_session()
        # The model's signature, (audio [1, n], state [2, 1, 128], sample rate []) ->
        # (probability [1, 1], next state [2, 1, 128]); names are told apart by rank.
        inputs = {len(i.shape): i.name for i in self._session.get_inputs()}
        outputs = {len(o.shape): o.name for o in self._session.get_outputs()}
        if sorted(inputs) != [0, 2, 3] or sorted(outputs) != [2, 3]:
            raise RuntimeError(f"unexpected Silero VAD signature {inputs} -> {outputs}")
        self._audio_in, self._state_in, self._sr_in = inputs[2], inputs[3], inputs[0]
        self._prob_out, self._state_out = outputs[2], outputs[3]
        self._sr = np.array(VAD_SAMPLE_RATE, dtype=np.int64)
        self._state = np.zeros(STATE_SHAPE, np.float32)
        self._input = np.zeros((1, CONTEXT + WINDOW), np.float32)  # context | window

    def reset(self) -> None:
        self._state = np.zeros(STATE_SHAPE, np.float32)
        self._input[:] = 0.0

    def prob(self, window: np.ndarray) -> float:
        if window.shape != (WINDOW,):
            raise ValueError(f"Silero VAD takes windows of {WINDOW} samples, got {window.shape}")
        self._input[0, :CONTEXT] = self._input[0, WINDOW:]
        self._input[0, CONTEXT:] = window
        prob, self._state = self._session.run(
            [self._prob_out, self._state_out],
            {self._audio_in: self._input, self._state_in: self._state, self._sr_in: self._sr},
        )
        return float(prob[0, 0])


# ---------------------------------------------------------------------------------------
# Server VAD (turn detection)


@dataclass(frozen=True, slots=True)
class VadEvent:
    """`ms` is the API's audio_start_ms (start) or audio_end_ms (stop); `at_ms` is how much
    audio had been fed when the event was decided (the end of the deciding window)."""

    kind: Literal["start", "stop"]
    ms: int
    at_ms: int


class ServerVAD:
    """The Realtime API's server_vad over Silero probabilities, one decision per 32 ms window.

    - Start: the first window with probability >= threshold; its `ms` is that window's start
      minus `prefix_padding_ms`, floored at 0 (the API's audio_start_ms includes the padding).
    - Stop: once in speech, a run of windows below `threshold - 0.15` (Silero's own exit
      hysteresis, floored at 0.01) lasting `silence_duration_ms` from the start of its first
      window. A window >= threshold ends the run; windows in between neither end nor count
      against it, as in Silero's VADIterator. Its `ms` is the start of the run's first
      window, i.e. the end of the last window that was not silent.
    - Times count samples from the first one ever fed; `reset` forgets speech, the model's
      state and any partial window but keeps the clock, since the API's ms are session-wide.

    `commit_span` tells which audio the last finished speech covers; the caller slices.
    """

    def __init__(
        self,
        threshold: float = 0.5,
        prefix_padding_ms: int = 300,
        silence_duration_ms: int = 500,
        sample_rate: int = VAD_SAMPLE_RATE,
    ) -> None:
        if sample_rate != VAD_SAMPLE_RATE:
            raise ValueError(f"server VAD runs at {VAD_SAMPLE_RATE} Hz, got {sample_rate}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be within [0, 1], got {threshold}")
        if prefix_padding_ms < 0 or silence_duration_ms < 0:
            raise ValueError("prefix_padding_ms and silence_duration_ms must be >= 0")
        self.threshold = threshold
        self.neg_threshold = max(threshold - NEG_THRESHOLD_GAP, NEG_THRESHOLD_MIN)
        self.prefix_padding_ms = prefix_padding_ms
        self.silence_duration_ms = silence_duration_ms
        self.sample_rate = sample_rate
        self._model = SileroVAD()
        self._pending = np.zeros(WINDOW, np.float32)  # the partial window, fixed capacity
        self._num_pending = 0
        self._fed = 0  # samples fed since construction, the clock
        self.reset()

    def reset(self) -> None:
        self._model.reset()
        self._num_pending = 0  # dropped, but still counted in the clock: they were fed
        self._in_speech = False
        self._silence_start: int | None = None  # sample where the current quiet run began
        self._start_ms: int | None = None
        self._stop_ms: int | None = None

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def position_ms(self) -> int:
        """Audio fed so far, in ms."""
        return self._ms(self._fed)

    @property
    def speech_start_ms(self) -> int | None:
        """Start (padding included) of the current speech, or of the last one if none."""
        return self._start_ms

    def commit_span(self, tail_ms: int = 0) -> tuple[int, int] | None:
        """(start_ms, end_ms) of the last finished speech, its end extended by `tail_ms`
        but never past the audio fed; None while speaking or before any speech ended."""
        if self._in_speech or self._start_ms is None or self._stop_ms is None:
            return None
        return self._start_ms, min(self._stop_ms + max(tail_ms, 0), self.position_ms)

    def feed(self, pcm: np.ndarray) -> list[VadEvent]:
        if pcm.ndim != 1 or pcm.dtype != np.float32:
            raise ValueError(f"server VAD takes 1-D float32 audio, got {pcm.dtype} {pcm.shape}")
        events: list[VadEvent] = []
        pos = 0
        while pos < pcm.size:
            take = min(WINDOW - self._num_pending, pcm.size - pos)
            self._pending[self._num_pending : self._num_pending + take] = pcm[pos : pos + take]
            self._num_pending += take
            self._fed += take
            pos += take
            if self._num_pending == WINDOW:
                self._num_pending = 0
                event = self._window(self._model.prob(self._pending), self._fed - WINDOW)
                if event is not None:
                    events.append(event)
        return events

    def _window(self, prob: float, start: int) -> VadEvent | None:
        end = start + WINDOW
        if prob >= self.threshold:
            self._silence_start = None
            if not self._in_speech:
                self._in_speech = True
                self._start_ms = max(0, self._ms(start) - self.prefix_padding_ms)
                self._stop_ms = None
                return VadEvent("start", self._start_ms, self._ms(end))
            return None
        if not self._in_speech or prob >= self.neg_threshold:
            return None
        if self._silence_start is None:
            self._silence_start = start
        if (end - self._silence_start) * 1000 < self.silence_duration_ms * self.sample_rate:
            return None
        self._in_speech = False
        self._stop_ms = self._ms(self._silence_start)
        self._silence_start = None
        return VadEvent("stop", self._stop_ms, self._ms(end))

    def _ms(self, samples: int) -> int:
        return samples * 1000 // self.sample_rate
