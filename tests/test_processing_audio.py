"""Audio: decoding, resampling, log-mel parity with WhisperFeatureExtractor, token counts."""

from __future__ import annotations

import io
import math

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import spectrogram, window_function

from pipeline.processing.audio import (
    WINDOW_SAMPLES,
    audio_num_tokens,
    chunk_token_counts,
    clip_num_tokens,
    decode_audio,
    decode_av_audio,
    log_mel,
    log_mels,
    mel_filters,
    process_audio,
    process_audios,
    resample_mono,
)
from pipeline.processing.errors import (
    CorruptMediaError,
    EmptyMediaError,
    MediaTooLargeError,
    UnsupportedMediaError,
)

FE = WhisperFeatureExtractor(feature_size=80)  # 16 kHz, n_fft 400, hop 160, 30 s


def _signal(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    x = 0.3 * np.sin(2 * np.pi * 440 * t) * np.linspace(0.05, 1, n) + 0.01 * rng.standard_normal(n)
    return x.astype(np.float32)


def _reference(x: np.ndarray) -> torch.Tensor:
    """The reference flow (`audio_feature_extract`): split at 30 s, each piece through the
    Whisper extractor padded to 30 s, trimmed by its attention mask, concatenated. At
    dynamic_range_db 8 the reference's dynamic floor is Whisper's own max - 8."""
    outs = []
    for i in range(0, len(x), WINDOW_SAMPLES):
        r = FE(
            x[i : i + WINDOW_SAMPLES],
            sampling_rate=16000,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        outs.append(r["input_features"][0, :, : int(r["attention_mask"].sum())])
    return torch.cat(outs, dim=1)


def test_mel_filters_match_whisper():
    diff = np.abs(mel_filters() - FE.mel_filters)
    assert diff.max() < 1e-12, f"max {diff.max()}"


@pytest.mark.parametrize("seconds", [0.1, 1.0, 2.37, 29.99, 30.0, 41.5])
def test_log_mel_matches_reference(seconds):
    x = _signal(int(seconds * 16000) + 3)
    got, ref = log_mel(x), _reference(x)
    assert got.shape == ref.shape == (80, math.ceil(len(x) / 160))
    diff = (got - ref).abs()
    assert diff.max() < 1e-5, f"max {diff.max()} mean {diff.mean()}"


def _window_alone(x: np.ndarray) -> torch.Tensor:
    """One window's features computed alone: a 1-D STFT of the window padded with n_fft
    zeros, then the same ops (the code before windows shared a batched STFT)."""
    n = x.shape[0]
    wave = torch.nn.functional.pad(torch.from_numpy(x), (0, min(400, WINDOW_SAMPLES - n)))
    stft = torch.stft(wave, 400, 160, window=torch.hann_window(400), return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    log_spec = torch.clamp(torch.from_numpy(mel_filters()).float().T @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0)[:, : math.ceil(n / 160)].contiguous()


def test_batched_windows_equal_each_window_alone():
    """A video's 1 s segments (and a short last one), clips over 30 s (two full windows of
    one batch) and others: every clip's features are those of its windows computed alone,
    bit for bit, and process_audios is process_audio per clip."""
    clips = [_signal(16000, seed=i) for i in range(30)] + [_signal(7003, seed=30)]
    clips += [_signal(int(s * 16000) + 3, seed=40 + i) for i, s in enumerate((0.1, 29.99, 65.55))]
    clips[3] = clips[3] * 1e-4  # a quiet second: its own floor, not its batch mates'
    for x, got in zip(clips, log_mels(clips)):
        ref = torch.cat([_window_alone(x[k : k + WINDOW_SAMPLES])
                         for k in range(0, x.size, WINDOW_SAMPLES)], dim=1)
        assert torch.equal(got, ref), x.size
    for a, b in zip(process_audios(clips[:5]), map(process_audio, clips[:5])):
        assert torch.equal(a.features, b.features) and a.content_hash == b.content_hash


def test_dynamic_floor_numpy_restatement():
    """A plain numpy re-statement of `MiniCPMAAudioProcessor._np_extract_fbank_features`."""
    x = _signal(16000 * 3)
    x[:16000] *= 1e-4  # a quiet first second: the floor must clip it
    padded = np.concatenate([x, np.zeros(WINDOW_SAMPLES - len(x), np.float32)])
    spec = spectrogram(
        padded,
        window_function(400, "hann"),
        frame_length=400,
        hop_length=160,
        power=2.0,
        mel_filters=FE.mel_filters,
        log_mel="log10",
    )[:, :-1]
    spec = np.maximum(spec, spec.max() - 8.0)
    ref = ((spec + 4.0) / 4.0)[:, : math.ceil(len(x) / 160)]
    got = log_mel(x).numpy()
    diff = np.abs(got - ref)
    assert diff.max() < 1e-4, f"max {diff.max()} mean {diff.mean()}"
    assert np.isclose(got.min(), got.max() - 2.0, atol=1e-5)  # floor = max - 8 -> /4 = 2


@pytest.mark.parametrize("seconds", [0.1, 0.5, 1.0, 1.013, 7.3, 30.0, 31.0, 65.55])
def test_token_count_formula_vs_feature_lengths(seconds):
    n = round(seconds * 16000)
    clip = process_audio(_signal(n))
    frames = clip.num_frames
    assert frames == math.ceil(n / 160)
    # what the encoder produces: per 3000-frame window, conv stride 2 then pool 5
    tokens = 0
    for start in range(0, frames, 3000):
        f = min(3000, frames - start)
        tokens += ((f - 1) // 2 + 1 - 5) // 5 + 1
    assert tokens == audio_num_tokens(n) == clip_num_tokens(clip)
    if seconds == 1.0:
        assert tokens == 10
    if seconds == 65.55:
        assert tokens == 655


def test_chunk_counts():
    assert chunk_token_counts(10) == [10]
    assert chunk_token_counts(73) == [10] * 7 + [3]
    assert sum(chunk_token_counts(655)) == 655


def test_short_clip_padded_to_one_token():
    clip = process_audio(np.ones(200, np.float32) * 0.1)
    assert clip.num_frames == 10 and clip_num_tokens(clip) == 1
    with pytest.raises(EmptyMediaError):
        process_audio(np.zeros(0, np.float32))


def _sf_bytes(x: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize(
    "fmt,subtype", [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"), ("MP3", None)]
)
def test_decode_formats(fmt, subtype):
    sr = 22050
    t = np.arange(sr) / sr
    x = (0.4 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    y = decode_audio(_sf_bytes(np.stack([x, x], 1), sr, fmt, subtype), max_seconds=10)
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) - 16000) <= 1200, len(y)  # lossy codecs add priming / padding
    if fmt in ("WAV", "FLAC"):
        ref = 0.4 * np.sin(2 * np.pi * 300 * np.arange(len(y)) / 16000)
        err = np.abs(y[200:-200] - ref[200:-200])
        assert err.max() < 2e-3, f"resampled sine: max {err.max()} mean {err.mean()}"


def test_decode_with_pyav_fallback():
    """An AAC-in-M4A clip: libsndfile cannot read it, PyAV does."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("aac", rate=44100, layout="mono")
        x = (0.3 * np.sin(2 * np.pi * 500 * np.arange(44100) / 44100)).astype(np.float32)
        for i in range(0, len(x), 1024):
            f = av.AudioFrame.from_ndarray(x[None, i : i + 1024], format="flt", layout="mono")
            f.sample_rate = 44100
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    y = decode_audio(buf.getvalue(), max_seconds=10)
    assert abs(len(y) - 16000) < 1600 and 0.15 < np.abs(y).max() < 0.5


def test_decode_errors():
    wav = _sf_bytes(np.zeros(16000 * 3, np.float32), 16000, "WAV")
    with pytest.raises(MediaTooLargeError, match=r"3.0 s long, over the limit of 2 s"):
        decode_audio(wav, max_seconds=2)
    with pytest.raises(UnsupportedMediaError, match="not a supported format"):
        decode_audio(b"definitely not audio" * 10, max_seconds=10)
    with pytest.raises(CorruptMediaError):
        decode_audio(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk" * 4, max_seconds=10)
    with pytest.raises(EmptyMediaError):
        decode_audio(_sf_bytes(np.zeros(0, np.float32), 16000, "WAV"), max_seconds=10)
    with pytest.raises(EmptyMediaError):
        decode_audio(b"", max_seconds=10)


# ---------------------------------------------------------------------------------------
# Resampling: the reference loads audio with librosa.load(path, sr=16000, mono=True)

LIBROSA_CASES = {
    "44.1k stereo float wav": (44100, 2, "WAV", "FLOAT"),
    "44.1k stereo s16 wav": (44100, 2, "WAV", "PCM_16"),
    "48k mono s16 wav": (48000, 1, "WAV", "PCM_16"),
    "48k mono flac": (48000, 1, "FLAC", "PCM_24"),
    "22.05k stereo flac": (22050, 2, "FLAC", "PCM_16"),
}


def _clip(rate: int, channels: int, seconds: float = 2.37, seed: int = 0) -> np.ndarray:
    """(n, channels) float32: a chirp per channel plus noise, so every band is exercised."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    chans = [
        0.3 * np.sin(2 * np.pi * (200 * (c + 1) + 3000 * t) * t)
        + 0.05 * rng.standard_normal(t.size)
        for c in range(channels)
    ]
    return np.stack(chans, 1).astype(np.float32)


@pytest.mark.parametrize("name", list(LIBROSA_CASES))
def test_decode_matches_librosa_load(name, tmp_path):
    """soundfile path (whole signal) and PyAV path (streamed a second at a time) against
    librosa.load(path, sr=16000, mono=True), the reference's loader."""
    librosa = pytest.importorskip("librosa")
    rate, channels, fmt, subtype = LIBROSA_CASES[name]
    data = _sf_bytes(_clip(rate, channels), rate, fmt, subtype)
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    ref, ref_sr = librosa.load(path, sr=16000, mono=True)
    assert ref_sr == 16000
    got = decode_audio(data, max_seconds=10)
    with av.open(io.BytesIO(data)) as c:
        streamed = decode_av_audio(c, max_seconds=10)
    for what, y in (("soundfile", got), ("pyav stream", streamed)):
        assert y.dtype == np.float32 and y.shape == ref.shape, (what, y.shape, ref.shape)
        d = np.abs(y - ref)
        assert d.max() <= 1e-6, f"{what}: max {d.max():.3e}, mean {d.mean():.3e}"


def test_pyav_stream_equals_the_whole_signal_resampled():
    """The PyAV path hands decoded frames to the downmix and the resampler a second at a
    time: bit for bit what the whole decoded signal, downmixed and resampled in one call,
    gives (4.3 s of 44.1 kHz stereo AAC: ~190 frames, so 5 blocks, the last one partial)."""
    x = np.ascontiguousarray(_clip(44100, 2, seconds=4.3).T, dtype=np.float32)  # (2, n)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        aac = out.add_stream("aac", rate=44100, layout="stereo")
        for i in range(0, x.shape[1], 1024):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(x[:, i : i + 1024]), format="fltp", layout="stereo"
            )
            frame.sample_rate = 44100
            for p in aac.encode(frame):
                out.mux(p)
        for p in aac.encode(None):
            out.mux(p)
    data = buf.getvalue()
    with av.open(io.BytesIO(data)) as c:
        decoded = [f.to_ndarray() for f in c.decode(c.streams.audio[0])]  # fltp: (2, n) each
    whole = np.concatenate(decoded, axis=1).mean(axis=0)
    with av.open(io.BytesIO(data)) as c:
        streamed = decode_av_audio(c, max_seconds=10)
    assert len(decoded) > 150
    assert np.array_equal(streamed, resample_mono(whole, 44100))


def test_librosa_length_fix_pads_the_tail():
    """soxr alone returns round-ish lengths; librosa pads to ceil(n * 16000 / sr)."""
    librosa = pytest.importorskip("librosa")
    x = _clip(48000, 1, seconds=1.01)[:48007, 0]  # 48007 * 1/3 = 16002.33 -> 16003
    ref = librosa.resample(x, orig_sr=48000, target_sr=16000)
    data = _sf_bytes(x, 48000, "WAV", "FLOAT")
    y = decode_audio(data, max_seconds=10)
    assert len(ref) == len(y) == 16003 and np.abs(y - ref).max() <= 1e-6
