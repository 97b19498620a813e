"""The session's input side: the uncommitted input audio on the session clock and, under
server VAD, where speech starts and stops. It knows nothing of responses: the session
decides what a start (barge-in) or a stop (commit, respond) does, so the same listener can
keep listening while a response plays.

The session clock counts milliseconds of input audio since the session's first sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.realtime import protocol as p

# Audio kept before the speech VAD may start in (prefix padding), and some slack for it.
KEEP_BEFORE_MS = 1000


class InputBuffer:
    """Uncommitted input audio: pcm16 at the session's rate, with the session clock of its
    first byte."""

    def __init__(self, rate: int):
        self.rate = rate
        self.data = bytearray()
        self.start_ms = 0.0  # session clock of data[0]

    def _sample(self, ms: float) -> int:
        return round((ms - self.start_ms) * self.rate / 1000)

    @property
    def ms(self) -> float:
        return len(self.data) / 2 * 1000 / self.rate

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.ms

    def append(self, pcm: bytes) -> None:
        self.data += pcm

    def take(self, start_ms: float | None = None, end_ms: float | None = None) -> bytes:
        """The audio between two session times (default: all of it); the buffer is cleared."""
        a = 0 if start_ms is None else max(0, self._sample(start_ms))
        b = len(self.data) // 2 if end_ms is None else max(a, self._sample(end_ms))
        out = bytes(self.data[2 * a : 2 * b])
        self.clear()
        return out

    def keep_last(self, ms: float) -> None:
        drop = len(self.data) // 2 - int(ms * self.rate / 1000)
        if drop > 0:
            del self.data[: 2 * drop]
            self.start_ms += drop * 1000 / self.rate

    def clear(self) -> None:
        self.start_ms = self.end_ms
        self.data.clear()


@dataclass(frozen=True)
class SpeechStarted:
    ms: int  # audio_start_ms: prefix padding included
    item_id: str  # the item the speech will be committed as


@dataclass(frozen=True)
class SpeechStopped:
    ms: int  # audio_end_ms
    item_id: str
    audio: bytes  # the speech, pcm16 at the session's rate: what is committed


Heard = SpeechStarted | SpeechStopped


class Listener:
    def __init__(self, rate: int, turn_detection: p.TurnDetection | None, max_buffer_s: float):
        self.max_buffer_s = max_buffer_s
        self.buffer = InputBuffer(rate)
        self.turn_detection = turn_detection
        self.vad = None
        self.speech_item: str | None = None  # the item the current speech commits to
        self._listen()

    def _listen(self) -> None:
        """A fresh VAD (and resampler to its 16 kHz), its clock starting now."""
        self.speech_item = None
        td = self.turn_detection
        if td is None:
            self.vad = self.resampler = None
            return
        from pipeline.processing.vad import ServerVAD, StreamResampler

        self.vad = ServerVAD(td.threshold, td.prefix_padding_ms, td.silence_duration_ms)
        self.resampler = StreamResampler(self.buffer.rate)
        self.vad_offset_ms = self.buffer.end_ms  # session clock of the VAD's first sample

    def reconfigure(self, rate: int, turn_detection: p.TurnDetection | None) -> None:
        if rate != self.buffer.rate and self.buffer.data:
            raise p.ProtocolError(
                "invalid_value",
                "the input audio format cannot change while the buffer holds audio; "
                "commit or clear it first",
                "session.audio.input.format",
            )
        self.buffer.rate = rate
        self.turn_detection = turn_detection
        self._listen()

    def append(self, pcm: bytes) -> list[Heard]:
        """Buffer pcm16 audio; under server VAD, what it heard in it."""
        heard: list[Heard] = []
        if self.buffer.ms + len(pcm) / 2 * 1000 / self.buffer.rate > self.max_buffer_s * 1000:
            if self.speech_item is None:
                raise p.ProtocolError(
                    "input_audio_buffer_full",
                    f"the input audio buffer holds at most {self.max_buffer_s:g} s; "
                    "commit or clear it",
                )
            # Speech longer than the buffer: commit it as a turn now, and listen afresh.
            heard.append(self._stopped(self.buffer.end_ms))
            self._listen()
        self.buffer.append(pcm)
        if self.vad is None:
            return heard
        for ev in self.vad.feed(self.resampler.push(pcm)):
            at = ev.ms + self.vad_offset_ms
            if ev.kind == "start":
                self.speech_item = p.new_id("item")
                heard.append(SpeechStarted(int(at), self.speech_item))
            elif self.speech_item is not None:
                heard.append(self._stopped(at))
        if self.speech_item is None:  # not in speech: keep only what a start may reach back to
            self.buffer.keep_last(self.turn_detection.prefix_padding_ms + KEEP_BEFORE_MS)
        return heard

    def _stopped(self, end_ms: float) -> SpeechStopped:
        item_id, self.speech_item = self.speech_item, None
        start_ms = (self.vad.speech_start_ms or 0) + self.vad_offset_ms
        audio = self.buffer.take(start_ms, end_ms)  # the silence after it is dropped
        return SpeechStopped(int(end_ms), item_id, audio)

    def commit(self) -> tuple[str, bytes]:
        """(item id, audio) of everything buffered (the client's commit); listen afresh."""
        if not self.buffer.data:
            raise p.ProtocolError(
                "input_audio_buffer_commit_empty", "the input audio buffer is empty"
            )
        item_id = self.speech_item or p.new_id("item")
        audio = self.buffer.take()
        self._listen()
        return item_id, audio

    def clear(self) -> None:
        self.buffer.clear()
        self._listen()
