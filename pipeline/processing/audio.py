"""Audio decoding and MiniCPM-o log-mel features for the Whisper encoder.

Stages:
1. decode bytes -> float32 samples: soundfile (WAV/FLAC/OGG/MP3/...), PyAV for other
   containers (M4A/AAC, Opus in WebM, MP4 audio tracks...)
2. mono and 16 kHz exactly as the reference's `librosa.load(path, sr=16000, mono=True)`
   (librosa 0.10 / 0.11 `to_mono`, `resample`): the mean over channels in float32, then
   `soxr.resample(y, sr, 16000, quality="soxr_hq")` and `util.fix_length` to
   int(ceil(n * (16000 / sr))) samples (zero-padded at the end; `scale` off). PyAV-decoded
   streams go through `soxr.ResampleStream` frame by frame, whose output equals the
   whole-signal call sample for sample, so memory stays at the 16 kHz output
3. log-mel, per 30 s window (the reference splits longer clips at 480000 samples and runs the
   feature extractor on each piece): Whisper STFT (n_fft 400, hop 160, periodic Hann,
   centered, reflect pad), |X|^2, last STFT frame dropped, 80 slaney mel filters,
   log10(max(x, 1e-10)), *dynamic floor* max(x, max_over_window - 8), then (x + 4) / 4.
   The window is trimmed to ceil(n / 160) frames (the reference pads to 30 s with zeros and
   trims by the attention mask; padding with n_fft zeros gives the same frames, see
   `_window_log_mels`). Windows are concatenated: features (80, ceil(n / 160)). Windows of
   equal length, of one clip or of many (`log_mels`, `process_audios`), share one batched
   STFT.

Token counts: 100 frames/s -> conv stride 2 -> 50/s -> avg-pool 5 -> 10 LLM tokens/s,
`audio_num_tokens(n) = ((ceil(n/160) - 1) // 2 + 1 - 5) // 5 + 1`. Because each window is
3000 frames (even, a multiple of 10), running the encoder per `WINDOW_FRAMES` window and
concatenating gives exactly that count for any length.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math

import av
import numpy as np
import soundfile as sf
import soxr
import torch

from pipeline.handoff import AudioInput
from pipeline.processing.errors import (
    CorruptMediaError,
    EmptyMediaError,
    MediaTooLargeError,
    UnsupportedMediaError,
)

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 80
DYNAMIC_RANGE_DB = 8.0  # log10 units, as the reference names it
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # reference splits clips longer than 30 s here
WINDOW_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 3000 mel frames = one encoder pass
MIN_SAMPLES = 1600  # clips shorter than 0.1 s are zero-padded to this (>= 1 token)
SF_COUNT_MAX = 2**63 - 1  # libsndfile's frame count for "length unknown" (e.g. streamed FLAC)
RESAMPLE_QUALITY = "soxr_hq"  # librosa's default res_type since 0.10

# Leading bytes of containers we recognize: such bytes failing to decode are corrupt,
# anything else is an unsupported format.
_AUDIO_MAGIC = (
    b"RIFF",
    b"fLaC",
    b"OggS",
    b"ID3",
    b"\xff\xfb",
    b"\xff\xf3",
    b"\xff\xf2",
    b"FORM",
    b"\x1aE\xdf\xa3",
    b"caff",
)


# ---------------------------------------------------------------------------------------
# Decoding


def _looks_like_media(data: bytes) -> bool:
    return data.startswith(_AUDIO_MAGIC) or data[4:8] == b"ftyp"


def _decode_soundfile(data: bytes, max_seconds: float) -> tuple[np.ndarray, int] | None:
    """(frames, channels) float32 and the rate, or None when libsndfile cannot open it."""
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError):
        return None  # not a libsndfile format: let PyAV try
    with f:
        if f.frames >= SF_COUNT_MAX:
            # No length in the header: soundfile's read() would size its buffer from this
            # count. PyAV decodes such files with a decode-time length guard instead.
            return None
        # Check the header's length before decoding anything.
        if f.frames > 0 and f.frames / f.samplerate > max_seconds:
            raise MediaTooLargeError(
                f"audio is {f.frames / f.samplerate:.1f} s long, over the limit of "
                f"{max_seconds:g} s"
            )
        try:
            return f.read(dtype="float32", always_2d=True), f.samplerate
        except (sf.LibsndfileError, RuntimeError) as e:
            raise CorruptMediaError(f"{f.format} audio could not be decoded: {e}") from e


def decode_av_audio(container: av.container.InputContainer, max_seconds: float) -> np.ndarray:
    """Decode the first audio stream of an open PyAV container -> mono float32 at 16 kHz.

    Downmix by channel mean first (librosa's mono), then resample mono -> 16 kHz. Decoded
    frames (1024 samples of AAC, ~23 ms) go to the mean and the resampler a second at a
    time: the same samples as frame by frame (the mean is per sample and the resampler's
    output does not depend on how its input is cut), without ~50 us of per-call overhead
    for each frame.
    """
    stream = container.streams.audio[0]
    resampler: _Resampler | None = None
    out: list[np.ndarray] = []
    block: list[np.ndarray] = []
    n_block = n_out = 0
    limit = int(max_seconds * SAMPLE_RATE) + SAMPLE_RATE  # decode-time guard, checked below

    def push() -> None:
        nonlocal n_out, n_block
        assert resampler is not None
        x = block[0] if len(block) == 1 else np.concatenate(block, axis=1)
        y = resampler.push(x.mean(axis=0))
        out.append(y)
        n_out += len(y)
        block.clear()
        n_block = 0
        if n_out > limit:
            raise MediaTooLargeError(f"audio is longer than the limit of {max_seconds:g} s")

    for frame in container.decode(stream):
        x = _to_float(frame.to_ndarray(), frame.format.name, frame.layout.nb_channels)
        if resampler is None:
            resampler = _Resampler(frame.sample_rate)
        block.append(x)  # (channels, n)
        n_block += x.shape[1]
        if n_block >= resampler.rate:
            push()
    if resampler is None:
        return np.zeros(0, np.float32)
    if block:
        push()
    out.append(resampler.flush())
    return _fix_length(np.concatenate(out), resampler.output_length)


def _to_float(x: np.ndarray, fmt: str, channels: int) -> np.ndarray:
    """PyAV frame array -> (channels, n) float32 in [-1, 1]."""
    planar = fmt.endswith("p")
    if not planar:
        x = x.reshape(-1, channels).T
    if fmt.startswith("s16"):
        x = x.astype(np.float32) / 32768.0
    elif fmt.startswith("s32"):
        x = x.astype(np.float32) / 2147483648.0
    elif fmt.startswith("u8"):
        x = (x.astype(np.float32) - 128.0) / 128.0
    else:  # flt, dbl
        x = x.astype(np.float32)
    return x


class _Resampler:
    """Streaming mono resampler to 16 kHz (identity at 16 kHz): pieces in, pieces out, the
    concatenation equal to `soxr.resample` of the whole signal; the caller fixes the
    length to `output_length` as librosa does."""

    def __init__(self, rate: int):
        self.rate = rate
        self.num_in = 0
        self._soxr = None
        if rate != SAMPLE_RATE:
            self._soxr = soxr.ResampleStream(
                rate, SAMPLE_RATE, 1, dtype="float32", quality=RESAMPLE_QUALITY
            )

    @property
    def output_length(self) -> int:
        return _librosa_length(self.num_in, self.rate)

    def push(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.num_in += x.size
        if self._soxr is None or x.size == 0:
            return x
        return self._soxr.resample_chunk(x)

    def flush(self) -> np.ndarray:
        if self._soxr is None:
            return np.zeros(0, np.float32)
        return self._soxr.resample_chunk(np.zeros(0, np.float32), last=True)


def _librosa_length(n: int, rate: int) -> int:
    """librosa.resample's output length, with its float ratio (not exact integer ceil)."""
    return n if rate == SAMPLE_RATE else int(np.ceil(n * (float(SAMPLE_RATE) / rate)))


def _fix_length(y: np.ndarray, n: int) -> np.ndarray:
    """librosa.util.fix_length: trim to n, or zero-pad at the end."""
    if y.size >= n:
        return y[:n]
    return np.concatenate([y, np.zeros(n - y.size, y.dtype)])


def resample_mono(x: np.ndarray, rate: int) -> np.ndarray:
    """(n,) float32 at `rate` -> float32 at 16 kHz, librosa.resample(x, orig_sr=rate,
    target_sr=16000) with its default res_type "soxr_hq"."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if rate == SAMPLE_RATE:
        return x
    y = soxr.resample(x, rate, SAMPLE_RATE, quality=RESAMPLE_QUALITY)
    return _fix_length(y, _librosa_length(x.size, rate))


def decode_audio(data: bytes, *, max_seconds: float) -> np.ndarray:
    """Audio file bytes -> (n,) mono float32 samples at 16 kHz.

    Raises EmptyMediaError (no samples), MediaTooLargeError (longer than max_seconds),
    CorruptMediaError (a known container that fails to decode), UnsupportedMediaError.
    """
    if not data:
        raise EmptyMediaError("audio part is empty (0 bytes)")
    decoded = _decode_soundfile(data, max_seconds)
    if decoded is not None:
        x, rate = decoded
        if x.shape[0] == 0:  # before resampling: nothing to hand to the resampler
            raise EmptyMediaError("audio decodes to 0 samples")
        # librosa reads (channels, n) and averages over axis 0: the same float32 sums.
        samples = resample_mono(x.T.mean(axis=0), rate)
    else:
        samples = _decode_with_av(data, max_seconds)
    if samples.size == 0:
        raise EmptyMediaError("audio decodes to 0 samples")
    if samples.size > max_seconds * SAMPLE_RATE:
        raise MediaTooLargeError(
            f"audio is {samples.size / SAMPLE_RATE:.1f} s long, over the limit of {max_seconds:g} s"
        )
    if not np.isfinite(samples).all():
        raise CorruptMediaError("audio contains NaN or infinite samples")
    return samples


def _decode_with_av(data: bytes, max_seconds: float) -> np.ndarray:
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as e:
        if _looks_like_media(data):
            raise CorruptMediaError(f"audio container could not be opened: {e}") from e
        raise UnsupportedMediaError(
            "audio bytes are not a supported format (WAV, FLAC, OGG, MP3, or a container "
            "FFmpeg decodes, e.g. M4A/WebM)"
        ) from e
    with container:
        if not container.streams.audio:
            raise UnsupportedMediaError(f"container {container.format.name} has no audio stream")
        try:
            return decode_av_audio(container, max_seconds)
        except av.FFmpegError as e:
            raise CorruptMediaError(f"audio stream could not be decoded: {e}") from e


# ---------------------------------------------------------------------------------------
# Log-mel features


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(
        f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, f / f_sp
    )


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), m * f_sp)


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sr: int = SAMPLE_RATE) -> np.ndarray:
    """(n_fft // 2 + 1, n_mels) float64 triangular filters, slaney scale and slaney area
    normalization, 0 Hz .. sr / 2 (WhisperFeatureExtractor's bank)."""
    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_pts = np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2), n_mels + 2)
    hz_pts = _mel_to_hz(mel_pts)  # (n_mels + 2,)
    diff = np.diff(hz_pts)
    slopes = hz_pts[None, :] - fft_freqs[:, None]  # (bins, n_mels + 2)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = np.maximum(0.0, np.minimum(down, up))  # (bins, n_mels)
    return fb * (2.0 / (hz_pts[2:] - hz_pts[:-2]))[None, :]


@functools.lru_cache(maxsize=1)
def _stft_constants() -> tuple[torch.Tensor, torch.Tensor]:
    """The periodic Hann window and the (201, 80) float32 filter bank, built once."""
    return torch.hann_window(N_FFT), torch.from_numpy(mel_filters()).to(torch.float32)


# Samples per batched STFT: bounds its complex output (~8 x 3001 x 201 x 8 B, 39 MB).
STFT_BATCH_SAMPLES = 8 * WINDOW_SAMPLES


def _window_log_mels(xs: list[np.ndarray]) -> list[torch.Tensor]:
    """Windows of one length n <= 30 s -> (80, ceil(n / 160)) features each. One STFT over
    all of them (each row of a batched STFT is the row's own, bit for bit: tested), then
    the rest per window, the ops and shapes of one window alone.

    The reference zero-pads the window to 480000 samples before the centered STFT. Frames
    0..ceil(n/160)-1 only reach n + 200 samples to the right, and the floor's max only sees
    frames that touch the signal (all-zero frames sit at the -10 clamp), so padding with
    n_fft zeros (or up to 480000, whichever is shorter) yields the same numbers.
    """
    n = xs[0].shape[0]
    wave = np.zeros((len(xs), n + min(N_FFT, WINDOW_SAMPLES - n)), np.float32)
    for row, x in zip(wave, xs):
        row[:n] = x
    window, fb = _stft_constants()
    stft = torch.stft(torch.from_numpy(wave), N_FFT, HOP_LENGTH, window=window, return_complex=True)
    out = []
    for spec in stft:  # (201, frames + 1)
        power = (spec[..., :-1].abs() ** 2).contiguous()  # last frame dropped
        log_spec = torch.clamp(fb.T @ power, min=1e-10).log10()  # (80, frames)
        log_spec = torch.maximum(log_spec, log_spec.max() - DYNAMIC_RANGE_DB)
        log_spec = (log_spec + 4.0) / 4.0
        out.append(log_spec[:, : math.ceil(n / HOP_LENGTH)].contiguous())
    return out


def log_mels(clips: list[np.ndarray]) -> list[torch.Tensor]:
    """`log_mel` of each clip. Windows of equal length (a video's 1 s segments, the full
    30 s windows of long clips) share batched STFTs: one op for many instead of one each."""
    windows: list[tuple[int, np.ndarray]] = []  # (clip index, window)
    for i, x in enumerate(clips):
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"expected a non-empty 1-D waveform, got shape {x.shape}")
        windows += [(i, x[k : k + WINDOW_SAMPLES]) for k in range(0, x.size, WINDOW_SAMPLES)]
    by_length: dict[int, list[int]] = {}
    for j, (_, w) in enumerate(windows):
        by_length.setdefault(w.size, []).append(j)
    mels: list[torch.Tensor | None] = [None] * len(windows)
    for n, idx in by_length.items():
        rows = max(1, STFT_BATCH_SAMPLES // n)
        for b in range(0, len(idx), rows):
            part = idx[b : b + rows]
            for j, mel in zip(part, _window_log_mels([windows[j][1] for j in part])):
                mels[j] = mel
    per_clip: list[list[torch.Tensor]] = [[] for _ in clips]
    for (i, _), mel in zip(windows, mels):
        per_clip[i].append(mel)
    return [torch.cat(ms, dim=1) for ms in per_clip]


def log_mel(samples: np.ndarray) -> torch.Tensor:
    """(n,) float32 16 kHz samples -> (80, ceil(n / 160)) float32 features, any length."""
    return log_mels([samples])[0]


# ---------------------------------------------------------------------------------------
# Token counts and AudioInput


def audio_num_tokens(num_samples: int, pool_step: int = 5) -> int:
    """LLM tokens of a clip of num_samples 16 kHz samples (spec 1.5)."""
    frames = math.ceil(num_samples / HOP_LENGTH)
    after_cnn = (frames - 1) // 2 + 1
    return (after_cnn - pool_step) // pool_step + 1


def clip_num_tokens(clip: AudioInput, pool_step: int = 5) -> int:
    """LLM tokens of a processed clip, from its mel frame count (= audio_num_tokens(n))."""
    after_cnn = (clip.num_frames - 1) // 2 + 1
    return (after_cnn - pool_step) // pool_step + 1


def chunk_token_counts(
    num_tokens: int, chunk_seconds: float = 1.0, pool_step: int = 5
) -> list[int]:
    """Split a clip's tokens into per-chunk groups (reference `get_audio_placeholder` with
    chunk_input=True): each chunk holds the tokens of `chunk_seconds` (10 for 1 s), the last
    one the rest."""
    frames = int(chunk_seconds * 100)
    per_chunk = ((frames - 1) // 2 + 1 - pool_step) // pool_step + 1
    counts = []
    done = 0
    while done < num_tokens:
        counts.append(min(per_chunk, num_tokens - done))
        done += counts[-1]
    return counts


def audio_content_hash(samples: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(samples, dtype=np.float32).tobytes()).hexdigest()


def process_audio(samples: np.ndarray) -> AudioInput:
    """16 kHz mono samples -> AudioInput; clips shorter than 0.1 s are zero-padded to 0.1 s
    (the reference's video path does the same) so every clip yields >= 1 token."""
    return process_audios([samples])[0]


def process_audios(clips: list[np.ndarray]) -> list[AudioInput]:
    """`process_audio` of each clip, their log-mels computed together (`log_mels`)."""
    padded = []
    for samples in clips:
        if samples.size == 0:
            raise EmptyMediaError("audio clip has 0 samples")
        if samples.size < MIN_SAMPLES:
            samples = np.concatenate([samples, np.zeros(MIN_SAMPLES - samples.size, np.float32)])
        padded.append(samples.astype(np.float32, copy=False))
    return [AudioInput(m, audio_content_hash(x)) for m, x in zip(log_mels(padded), padded)]
