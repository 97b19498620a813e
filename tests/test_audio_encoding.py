"""deployments.ingress.audio_encoding: streamed/one-shot output audio in the OpenAI formats (CPU).

- every format: 5 uneven pieces streamed, the concatenation decoded (PyAV; soundfile/wave for
  wav): rate, mono, duration vs the codec's priming/padding, correlation with the input
  (sample-exact int16 for wav/pcm16/flac);
- wav: each piece is a complete WAV of exactly that piece;
- the first audio bytes come back from the first encode(), before finish();
- encode_whole == streaming for the lossless formats; mp3's whole file is gapless;
- bad input (NaN/inf, shapes, dtypes), unknown formats, empty pieces, finish()/close().
"""

from __future__ import annotations

import io
import subprocess
import sys
import wave

import av
import numpy as np
import pytest
import soundfile as sf

from deployments.ingress.audio_encoding import (
    AUDIO_FORMATS,
    MIME_TYPES,
    StreamEncoder,
    canonical_format,
    encode_whole,
)
from deployments.ingress.media import float_to_int16

SR = 24000
PIECES = [24000, 23000, 25000, 12000, 7]
N = sum(PIECES)
CANONICAL = ["wav", "pcm16", "mp3", "opus", "aac", "flac"]
CODED = ["mp3", "opus", "aac", "flac"]
LOSSLESS = ["wav", "pcm16", "flac"]


def tone(n: int = N) -> np.ndarray:
    """440 Hz sine with a slow, non-periodic envelope (so alignment is unambiguous)."""
    t = np.arange(n) / SR
    env = 0.35 + 0.25 * np.sin(2 * np.pi * 0.7 * t) * np.sin(2 * np.pi * 0.23 * t + 0.5)
    return (env * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


X = tone()


def split(x: np.ndarray, lengths=PIECES) -> list[np.ndarray]:
    out, pos = [], 0
    for n in lengths:
        out.append(x[pos:pos + n])
        pos += n
    return out


def stream(fmt: str, pieces: list[np.ndarray]) -> list[bytes]:
    enc = StreamEncoder(fmt)
    outs = [enc.encode(p) for p in pieces]
    outs.append(enc.finish())
    return outs


def av_decode(data: bytes) -> tuple[int, int, np.ndarray]:
    """-> (sample rate, channels, float32 samples of channel 0)."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.audio[0]
        frames = [f.to_ndarray() for f in c.decode(s)]
        rate, channels = s.codec_context.sample_rate, s.codec_context.layout.nb_channels
    y = np.concatenate(frames, axis=1)[0] if frames else np.zeros(0)
    if y.dtype == np.int16:
        y = y.astype(np.float32) / 32767.0
    return rate, channels, y.astype(np.float32)


def av_decode_int16(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.audio[0]
        frames = [f.to_ndarray() for f in c.decode(s)]
    y = np.concatenate(frames, axis=1)
    assert y.dtype == np.int16 and y.shape[0] == 1
    return y[0]


def to_24k(y: np.ndarray, rate: int) -> np.ndarray:
    if rate == SR:
        return y
    r = av.AudioResampler(format="flt", layout="mono", rate=SR)
    f = av.AudioFrame.from_ndarray(y[None, :].astype(np.float32), format="flt", layout="mono")
    f.sample_rate = rate
    out = r.resample(f) + r.resample(None)
    return np.concatenate([o.to_ndarray()[0] for o in out])


def aligned_corr(x: np.ndarray, y: np.ndarray, max_lag: int = 4000) -> tuple[int, float]:
    """Best lag (y delayed by `lag` vs x) and the normalised correlation there."""
    n = len(x) + len(y)
    size = 1 << (n - 1).bit_length()
    xc = np.fft.irfft(np.fft.rfft(y, size) * np.conj(np.fft.rfft(x, size)), size)
    lags = np.concatenate([np.arange(0, max_lag + 1), np.arange(-max_lag, 0)])
    lag = int(lags[np.argmax(xc[lags])])
    if lag >= 0:
        a, b = x, y[lag:]
    else:
        a, b = x[-lag:], y
    m = min(len(a), len(b))
    a, b = a[:m].astype(np.float64), b[:m].astype(np.float64)
    return lag, float(a @ b / np.sqrt((a @ a) * (b @ b)))


# -- names -----------------------------------------------------------------------------------

def test_names():
    assert set(AUDIO_FORMATS) == {"wav", "pcm16", "pcm", "mp3", "opus", "aac", "flac"}
    assert canonical_format("pcm") == "pcm16"
    for f in CANONICAL:
        assert canonical_format(f) == f
    assert set(MIME_TYPES) == set(CANONICAL)
    assert MIME_TYPES["mp3"] == "audio/mpeg" and MIME_TYPES["opus"] == "audio/ogg"
    assert StreamEncoder("pcm").format == "pcm16"


@pytest.mark.parametrize("bad", ["ogg", "MP3", "", None, 3])
def test_unknown_format(bad):
    with pytest.raises(ValueError) as e:
        canonical_format(bad)
    for f in AUDIO_FORMATS:
        assert f in str(e.value)
    with pytest.raises(ValueError, match="mp3"):
        StreamEncoder(bad)
    with pytest.raises(ValueError, match="flac"):
        encode_whole(X[:100], bad)


def test_no_torch_or_ray():
    code = ("import sys, deployments.ingress.audio_encoding; "
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- streaming round trips -------------------------------------------------------------------

def test_wav_pieces_are_complete_files():
    pieces = split(X)
    outs = stream("wav", pieces)
    assert outs[-1] == b""
    for piece, data in zip(pieces, outs):
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SR)
            got = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        np.testing.assert_array_equal(got, float_to_int16(piece))
        y, rate = sf.read(io.BytesIO(data), dtype="int16")
        assert rate == SR
        np.testing.assert_array_equal(y, float_to_int16(piece))


def test_pcm16_stream_is_exact():
    outs = stream("pcm16", split(X))
    assert outs[-1] == b""
    got = np.frombuffer(b"".join(outs), "<i2")
    np.testing.assert_array_equal(got, float_to_int16(X))


def test_flac_stream_is_exact():
    data = b"".join(stream("flac", split(X)))
    rate, channels, _ = av_decode(data)
    assert (rate, channels) == (SR, 1)
    np.testing.assert_array_equal(av_decode_int16(data), float_to_int16(X))


# extra decoded samples (codec priming + last-frame padding) allowed per lossy format, and
# where the aligned signal should start: mp3 ~1105 (LAME delay), aac 1024 (ADTS priming),
# opus 0 (pre-skip and end trim are in the Ogg stream: exact length at 48 kHz).
LOSSY = {"mp3": (0, 2 * 1152 + 1105, range(1000, 1200)),
         "aac": (0, 3 * 1024, range(1000, 1100)),
         "opus": (0, 0, range(-5, 6))}


@pytest.mark.parametrize("fmt", list(LOSSY))
def test_lossy_stream_round_trip(fmt):
    data = b"".join(stream(fmt, split(X)))
    rate, channels, y = av_decode(data)
    assert channels == 1
    assert rate == (48000 if fmt == "opus" else SR)
    lo, hi, lags = LOSSY[fmt]
    extra = len(y) * SR // rate - N
    assert lo <= extra <= hi, (len(y), rate)
    lag, corr = aligned_corr(X, to_24k(y, rate))
    assert corr > 0.95, corr
    assert lag in lags, lag


@pytest.mark.parametrize("fmt", CODED)
def test_first_bytes_before_finish(fmt):
    """The first encode() of a 1 s piece already returns decodable audio (most of it)."""
    enc = StreamEncoder(fmt)
    first = enc.encode(X[:SR])
    assert first
    rate, _, y = av_decode(first)
    assert len(y) * SR // rate >= 0.8 * SR
    second = enc.encode(X[SR:2 * SR])
    assert second
    enc.close()


@pytest.mark.parametrize("fmt", CANONICAL)
def test_empty_pieces_do_not_break_the_stream(fmt):
    pieces = split(X)
    plain = stream(fmt, pieces)
    empty = np.zeros(0, np.float32)
    enc = StreamEncoder(fmt)
    outs = [enc.encode(empty)]
    for p in pieces:
        outs += [enc.encode(p), enc.encode(empty)]
    outs.append(enc.finish())
    assert outs[0] == b"" and all(o == b"" for o in outs[2:-1:2])
    if fmt in CODED:  # (Ogg picks a random stream serial: compare what decodes)
        np.testing.assert_array_equal(av_decode(b"".join(outs))[2], av_decode(b"".join(plain))[2])
    else:
        assert outs[1::2] == plain


# -- one-shot ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", LOSSLESS)
def test_whole_equals_stream_lossless(fmt):
    whole = encode_whole(X, fmt)
    outs = stream(fmt, split(X))
    if fmt == "wav":
        y, rate = sf.read(io.BytesIO(whole), dtype="int16")
        assert rate == SR
        streamed = np.concatenate([sf.read(io.BytesIO(o), dtype="int16")[0] for o in outs[:-1]])
    elif fmt == "pcm16":
        y = np.frombuffer(whole, "<i2")
        streamed = np.frombuffer(b"".join(outs), "<i2")
    else:
        y = av_decode_int16(whole)
        streamed = av_decode_int16(b"".join(outs))
        # the one-shot file has STREAMINFO's sample count, so libsndfile reads it too
        y_sf, rate = sf.read(io.BytesIO(whole), dtype="int16")
        assert rate == SR
        np.testing.assert_array_equal(y_sf, y)
    np.testing.assert_array_equal(y, float_to_int16(X))
    np.testing.assert_array_equal(streamed, y)


@pytest.mark.parametrize("fmt", list(LOSSY))
def test_whole_lossy(fmt):
    rate, channels, y = av_decode(encode_whole(X, fmt))
    assert channels == 1
    lo, hi, _ = LOSSY[fmt]
    extra = len(y) * SR // rate - N
    if fmt == "mp3":  # Xing/LAME header: FFmpeg trims the delay and padding
        assert extra == 0
    else:
        assert lo <= extra <= hi
    _, corr = aligned_corr(X, to_24k(y, rate))
    assert corr > 0.95, corr


def test_whole_empty():
    empty = np.zeros(0, np.float32)
    with wave.open(io.BytesIO(encode_whole(empty, "wav"))) as w:
        assert w.getnframes() == 0 and w.getframerate() == SR
    assert encode_whole(empty, "pcm16") == b""
    rate, _, y = av_decode(encode_whole(empty, "flac"))
    assert rate == SR and len(y) == 0


# -- input checks and lifecycle --------------------------------------------------------------

@pytest.mark.parametrize("fmt", CANONICAL)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises(fmt, bad):
    x = X[:1000].copy()
    x[500] = bad
    with pytest.raises(ValueError, match="NaN"):
        StreamEncoder(fmt).encode(x)
    with pytest.raises(ValueError, match="NaN"):
        encode_whole(x, fmt)


def test_shapes_dtypes_and_clipping():
    enc = StreamEncoder("pcm16")
    col = X[:100].reshape(-1, 1)
    assert enc.encode(col) == float_to_int16(X[:100]).tobytes()
    assert enc.encode(X[:100].reshape(1, -1).astype(np.float64)) == \
        float_to_int16(X[:100].astype(np.float64)).tobytes()
    with pytest.raises(ValueError, match="1-D"):
        enc.encode(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="float"):
        enc.encode(np.zeros(100, np.int16))
    loud = np.array([2.0, -3.0, 0.5], np.float32)
    got = np.frombuffer(enc.encode(loud), "<i2")
    np.testing.assert_array_equal(got, [32767, -32767, 16384])
    # the codecs see clipped input too
    data = encode_whole(np.full(4800, 5.0, np.float32), "flac")
    assert (av_decode_int16(data) == 32767).all()


@pytest.mark.parametrize("fmt", CANONICAL)
def test_lifecycle(fmt):
    enc = StreamEncoder(fmt)
    enc.encode(X[:5000])
    enc.finish()
    assert enc.finish() == b""
    with pytest.raises(RuntimeError):
        enc.encode(X[:10])
    # cancel: close() without finish(), then nothing more
    enc = StreamEncoder(fmt)
    enc.encode(X[:5000])
    enc.close()
    enc.close()
    assert enc.finish() == b""
    with pytest.raises(RuntimeError):
        enc.encode(X[:10])


def test_unsupported_rate():
    with pytest.raises(ValueError, match="24000"):
        StreamEncoder("opus", sample_rate=44100)
    assert StreamEncoder("flac", sample_rate=44100).finish()[:4] == b"fLaC"
