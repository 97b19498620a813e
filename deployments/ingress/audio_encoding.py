"""Output audio (mono float32 in [-1, 1], 24 kHz) -> the OpenAI `audio.format`s, streamed.

    enc = StreamEncoder("opus")
    for pcm in pieces:
        send(enc.encode(pcm))    # may be b"" while the codec or muxer buffers
    send(enc.finish())           # flushes the codec, writes the trailer
The bytes of all calls, concatenated in order, are one valid file of the format, except
`wav`, which keeps the app's historical behaviour: every encode() returns one complete WAV of
that piece (clients such as vLLM's benchmark decode each piece on its own) and finish()
returns b"". `encode_whole()` is the one-shot form for non-streamed responses.

Formats (FFmpeg through PyAV for the compressed ones; each reads `frame_size` from the opened
codec, buffers leftover samples between encode() calls and hands only the last, short frame
to the encoder in finish(), where FFmpeg pads it with silence):

  wav    16-bit PCM mono WAV (deployments.ingress.media.wav_bytes_int16 / float_to_int16).
  pcm16  raw little-endian int16 mono, same quantisation (alias: pcm).
  mp3    libmp3lame, 64 kb/s CBR, raw MPEG audio frames (no ID3 tag). 24 kHz is MPEG-2
         Layer III: 576 samples a frame. Streamed, there is no Xing/LAME header (it is only
         written when the muxer can seek back), so decoders play the encoder delay
         (~1105 samples) and the last frame's padding as silence; encode_whole() writes the
         header, which lets gapless decoders (FFmpeg) trim them.
  opus   libopus in Ogg, 32 kb/s VBR, 20 ms frames (480 samples). libopus accepts 24 kHz
         input natively (its rates: 48/24/16/12/8 kHz), so nothing is resampled; decoders
         output 48 kHz (Opus always decodes at 48 kHz unless asked otherwise). Pre-skip and
         the end trim are in the Ogg headers/granules, so the decoded length is exact.
         Ogg pages are cut every OGG_PAGE_DURATION_US (100 ms) instead of FFmpeg's 1 s and
         the muxer holds back the newest page, so each encode() returns the audio up to
         ~0.1-0.2 s before the end of what it was given; the rest comes with the next call.
  aac    FFmpeg's native `aac` (AAC-LC), 64 kb/s, ADTS stream, 1024 samples a frame. ADTS
         cannot carry the encoder delay, so decoded audio starts with 1024 samples of
         priming silence and ends with the last frame's padding.
  flac   FFmpeg `flac` (s16, compression level 5), native FLAC stream, 2304-sample blocks at
         24 kHz, no PADDING block. Lossless: decodes to exactly float_to_int16's samples.
         Streamed, STREAMINFO goes out before the audio, so its total-sample count and MD5
         are 0 ("unknown", which the FLAC spec allows; FFmpeg/PyAV decode it), but libsndfile
         (python-soundfile 0.14 / libsndfile 1.2.2) cannot read such a file: sf.read fails.
         encode_whole() fills them in, so its output reads everywhere.

Every streaming format returns its first audio bytes from the first encode() of a 1 s
piece: flac all its full blocks, mp3/aac all but the encoder's lookahead/bit reservoir
(~0.1-0.15 s), opus all but the last ~0.1 s (the Ogg page in progress); the held-back tail
comes out with the next encode() or finish().

Every format encodes far faster than real time on one core (docs/performance.md).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import av
import numpy as np

from deployments.ingress.media import float_to_int16, wav_bytes_int16

DEFAULT_SAMPLE_RATE = 24000

AUDIO_FORMATS: tuple[str, ...] = ("wav", "pcm16", "pcm", "mp3", "opus", "aac", "flac")
_ALIASES = {"pcm": "pcm16"}

MIME_TYPES: dict[str, str] = {
    "wav": "audio/wav",
    "pcm16": "audio/pcm",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
}

# Ogg page length. FFmpeg's default (1 s) plus the page the muxer holds back would delay
# opus audio by up to ~2 s; 100 ms costs ~30 bytes of page header per 100 ms (~2.4 kb/s).
OGG_PAGE_DURATION_US = 100_000


@dataclass(frozen=True)
class _AvSpec:
    container: str
    codec: str
    sample_fmt: str  # what we hand the encoder: float for the lossy codecs, s16 for flac
    bit_rate: int | None
    container_options: dict[str, str] = field(default_factory=dict)
    codec_options: dict[str, str] = field(default_factory=dict)


_AV_SPECS: dict[str, _AvSpec] = {
    # id3v2_version=0: no ID3 tag, the stream is bare MPEG frames.
    "mp3": _AvSpec("mp3", "libmp3lame", "fltp", 64000, {"id3v2_version": "0"}),
    "opus": _AvSpec("ogg", "libopus", "flt", 32000,
                    {"page_duration": str(OGG_PAGE_DURATION_US)}),
    "aac": _AvSpec("adts", "aac", "fltp", 64000),
    # metadata_header_padding=0: no 8 KiB PADDING block (room for retagging in place,
    # useless for a stream).
    "flac": _AvSpec("flac", "flac", "s16", None, {"metadata_header_padding": "0"}),
}


def canonical_format(fmt: str) -> str:
    """The canonical name of an accepted format ("pcm" -> "pcm16"); ValueError otherwise."""
    if isinstance(fmt, str) and fmt in AUDIO_FORMATS:
        return _ALIASES.get(fmt, fmt)
    raise ValueError(f"unsupported audio format {fmt!r}; expected one of: "
                     + ", ".join(AUDIO_FORMATS))


def _check_pcm(pcm: Any) -> np.ndarray:
    """1-D float samples (an (n, 1) or (1, n) array is flattened), finite, clipped to
    [-1, 1]. float32 and float64 keep their dtype (so wav/pcm16 quantise exactly as
    float_to_int16 does today); other float types become float32."""
    a = np.asarray(pcm)
    if a.ndim == 2 and 1 in a.shape:
        a = a.reshape(-1)
    if a.ndim != 1:
        raise ValueError(f"audio must be a 1-D (mono) array, got shape {a.shape}")
    if a.dtype.kind != "f":
        raise ValueError(f"audio must be float samples in [-1, 1], got dtype {a.dtype}")
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    if a.size and not np.isfinite(a).all():
        raise ValueError("audio contains NaN or infinite samples")
    return np.clip(a, -1.0, 1.0)


class _AppendSink:
    """Append-only file for the muxer: write() appends, drain() hands out what is there.
    No seek/tell, so PyAV tells FFmpeg the output is not seekable and muxers do not try to
    go back (they skip or log the header rewrite instead)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def drain(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class _AvEncoder:
    def __init__(self, spec: _AvSpec, sample_rate: int, bit_rate: int | None,
                 seekable: bool) -> None:
        rates = av.codec.Codec(spec.codec, "w").audio_rates
        if rates and sample_rate not in rates:
            raise ValueError(f"{spec.codec} cannot encode {sample_rate} Hz; it accepts "
                             + ", ".join(str(r) for r in sorted(rates)))
        self._spec = spec
        self._sink: Any = io.BytesIO() if seekable else _AppendSink()
        self._container = av.open(
            self._sink, mode="w", format=spec.container,
            # Hand each packet to the sink as soon as it is muxed (not when the 32 KiB
            # AVIO buffer fills).
            container_options={"flush_packets": "1", **spec.container_options})
        try:
            self._stream = self._container.add_stream(
                spec.codec, rate=sample_rate, layout="mono", format=spec.sample_fmt,
                options=dict(spec.codec_options))
            ctx = self._stream.codec_context
            rate = bit_rate if bit_rate is not None else spec.bit_rate
            if rate:
                ctx.bit_rate = rate
            ctx.time_base = Fraction(1, sample_rate)
            self._stream.time_base = Fraction(1, sample_rate)
            ctx.open()
        except Exception:
            self._container.close()
            raise
        self._rate = sample_rate
        self._frame_size = ctx.frame_size or 0  # 0: the codec takes any length
        self._int16 = spec.sample_fmt == "s16"
        self._pending = np.zeros(0, np.int16 if self._int16 else np.float32)
        self._pts = 0

    def _frame(self, samples: np.ndarray) -> av.AudioFrame:
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples)[None, :],
                                           format=self._spec.sample_fmt, layout="mono")
        frame.sample_rate = self._rate
        frame.time_base = Fraction(1, self._rate)
        frame.pts = self._pts
        self._pts += len(samples)
        return frame

    def _send(self, frame: av.AudioFrame | None) -> None:
        self._container.mux(self._stream.encode(frame))

    def _take(self) -> bytes:
        return self._sink.drain() if isinstance(self._sink, _AppendSink) else b""

    def encode(self, pcm: np.ndarray) -> bytes:
        """`pcm`: checked, clipped float samples."""
        if not len(pcm):
            return b""
        # flac gets exactly float_to_int16's samples; the lossy codecs take float32.
        pcm = float_to_int16(pcm) if self._int16 else pcm.astype(np.float32, copy=False)
        fs = self._frame_size
        if not fs:
            self._send(self._frame(pcm))
            return self._take()
        if len(self._pending):
            pcm = np.concatenate([self._pending, pcm])
        full = len(pcm) // fs * fs
        for start in range(0, full, fs):
            self._send(self._frame(pcm[start:start + fs]))
        self._pending = pcm[full:].copy()
        return self._take()

    def finish(self) -> bytes:
        if len(self._pending):
            self._send(self._frame(self._pending))  # the one short frame; FFmpeg pads it
            self._pending = self._pending[:0]
        self._send(None)  # drain the encoder
        self._container.start_encoding()  # no-op unless nothing was muxed: write a header
        self._container.close()  # trailer
        if isinstance(self._sink, _AppendSink):
            return self._sink.drain()
        return self._sink.getvalue()

    def close(self) -> None:
        try:
            self._container.close()
        except Exception:  # noqa: BLE001 - best effort on cancel
            pass


class StreamEncoder:
    """One response's audio: encode() each piece as it is produced, finish() once at the end.
    The bytes returned by all calls, concatenated in order, are one valid file of the format
    (`wav`: each encode() returns a complete WAV of its piece and finish() returns b"").

    encode() returns b"" for an empty piece, or while the codec/muxer is still buffering.
    finish() may be called once; later calls return b"". close() frees the codec without
    flushing (on cancel); encode() after finish() or close() raises RuntimeError.
    `bit_rate` (b/s) overrides the default of the lossy formats; it is ignored by the others.
    """

    def __init__(self, fmt: str, sample_rate: int = DEFAULT_SAMPLE_RATE, *,
                 bit_rate: int | None = None, _seekable: bool = False) -> None:
        self.format = canonical_format(fmt)
        self.mime_type = MIME_TYPES[self.format]
        if not isinstance(sample_rate, int) or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive int, got {sample_rate!r}")
        self.sample_rate = sample_rate
        self.samples = 0  # samples accepted so far
        self._av = (_AvEncoder(_AV_SPECS[self.format], sample_rate, bit_rate, _seekable)
                    if self.format in _AV_SPECS else None)
        self._done = False

    def encode(self, pcm: np.ndarray) -> bytes:
        if self._done:
            raise RuntimeError("StreamEncoder.encode() after finish() or close()")
        pcm = _check_pcm(pcm)
        self.samples += len(pcm)
        if not len(pcm):
            return b""
        if self.format == "wav":
            return wav_bytes_int16(float_to_int16(pcm), self.sample_rate)
        if self.format == "pcm16":
            return float_to_int16(pcm).tobytes()
        return self._av.encode(pcm)

    def finish(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        if self._av is None:
            return b""
        try:
            return self._av.finish()
        finally:
            self._av = None

    def close(self) -> None:
        self._done = True
        if self._av is not None:
            self._av.close()
            self._av = None


def encode_whole(pcm: np.ndarray, fmt: str, sample_rate: int = DEFAULT_SAMPLE_RATE, *,
                 bit_rate: int | None = None) -> bytes:
    """All of a response's audio as one file (non-streamed responses). Unlike streaming,
    the muxer may seek back here, so mp3 gets its Xing/LAME (gapless) header and flac its
    STREAMINFO sample count and MD5. Empty audio: a header-only WAV or FLAC (valid, 0
    samples); b"" for pcm16 and aac; for mp3 a lone Xing frame and for opus the Ogg headers
    only, which FFmpeg declines to open (no audio to probe)."""
    fmt = canonical_format(fmt)
    pcm = _check_pcm(pcm)
    if fmt == "wav":
        return wav_bytes_int16(float_to_int16(pcm), sample_rate)
    if fmt == "pcm16":
        return float_to_int16(pcm).tobytes()
    enc = StreamEncoder(fmt, sample_rate, bit_rate=bit_rate, _seekable=True)
    try:
        enc.encode(pcm)  # returns b"": a seekable sink is read only at finish()
        return enc.finish()
    finally:
        enc.close()
