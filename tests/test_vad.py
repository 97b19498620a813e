"""Realtime input audio: streaming resampler, Silero VAD, server VAD turn detection.

References: one-shot `soxr.resample` for the resampler; the silero-vad package's own
`OnnxWrapper` (probabilities) and `VADIterator` (start / end rules) for the detector, both
torch code that only the tests import. Speech is synthetic (bench/speech.py).
"""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest
import soxr

from bench.speech import bursts, speech_like, write_wav
from pipeline.processing.vad import WINDOW, ServerVAD, SileroVAD, StreamResampler, VadEvent

SR = 16000
WINDOW_MS = WINDOW * 1000 // SR  # 32
# Silero's recurrent state keeps its probability above the exit threshold for a few windows
# after speech ends, so a stop lands up to this much after the true end of speech.
STOP_LAG_MS = 5 * WINDOW_MS
# speech 1.2 s, silence 0.8 s, speech 1.0 s, silence 1.0 s. The first speech is the stream's
# very first audio, where Silero starts from a zero state and, for some voices, needs a few
# windows to warm up; SEED is a voice it scores as speech from its first window (later
# onsets fire within a window for every seed tried).
PATTERN = [(1.2, True), (0.8, False), (1.0, True), (1.0, False)]
SEED = 1


def _onnx_path() -> str:
    return str(metadata.distribution("silero-vad").locate_file("silero_vad/data/silero_vad.onnx"))


def _events(vad: ServerVAD, x: np.ndarray, chunk: int) -> list[VadEvent]:
    out: list[VadEvent] = []
    for i in range(0, x.size, chunk):
        out += vad.feed(x[i : i + chunk])
    return out


def _random_chunks(n: int, rng: np.random.Generator, hi: int) -> list[int]:
    sizes, total = [], 0
    while total < n:
        sizes.append(int(rng.integers(1, hi)))
        total += sizes[-1]
    return sizes


# ---------------------------------------------------------------------------------------
# StreamResampler


@pytest.mark.parametrize("hi", [2, 37, 480, 2400, 24000])
def test_resampler_chunked_equals_one_shot(hi: int) -> None:
    rng = np.random.default_rng(hi)
    x = (0.3 * rng.standard_normal(24000 * 2)).astype(np.float32)
    want = soxr.resample(x, 24000, 16000, "HQ")
    rs = StreamResampler(24000)
    got, pos = [], 0
    for size in _random_chunks(x.size, rng, hi):
        got.append(rs.push(x[pos : pos + size]))
        pos += size
    got.append(rs.flush())
    out = np.concatenate(got)
    assert out.dtype == np.float32
    assert out.size == want.size == x.size * 2 // 3
    np.testing.assert_array_equal(out, want)


def test_resampler_pcm16_bytes_split_anywhere() -> None:
    rng = np.random.default_rng(1)
    ints = rng.integers(-32768, 32768, 24000, dtype=np.int64).astype("<i2")
    data = ints.tobytes()
    want = soxr.resample(ints.astype(np.float32) / 32768.0, 24000, 16000, "HQ")
    rs = StreamResampler(24000)
    got, pos = [], 0
    for size in _random_chunks(len(data), rng, 999):  # odd sizes split samples in half
        got.append(rs.push(data[pos : pos + size]))
        pos += size
    got.append(rs.flush())
    np.testing.assert_array_equal(np.concatenate(got), want)


def test_resampler_identity_and_errors() -> None:
    ints = np.array([0, 1, -1, 32767, -32768], dtype="<i2")
    rs = StreamResampler(16000)
    out = rs.push(ints.tobytes())
    np.testing.assert_array_equal(out, ints.astype(np.float32) / 32768.0)
    assert rs.flush().size == 0

    rs.push(b"\x01\x02\x03")  # one and a half samples
    with pytest.raises(ValueError, match="middle of a sample"):
        rs.flush()
    assert rs.push(b"\x00\x40").tolist() == [0.5]  # flush started the stream afresh
    with pytest.raises(ValueError, match="float32"):
        rs.push(np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="positive"):
        StreamResampler(0)


# ---------------------------------------------------------------------------------------
# SileroVAD


def test_silero_matches_package_wrapper() -> None:
    torch = pytest.importorskip("torch")
    utils_vad = pytest.importorskip("silero_vad.utils_vad")
    ref = utils_vad.OnnxWrapper(_onnx_path(), force_onnx_cpu=True)
    x = bursts([(0.4, False), (1.5, True), (0.5, False), (0.6, True)], SR, seed=3)
    vad = SileroVAD()
    for rnd in range(2):  # and again after reset: the state and context start from zeros
        ref.reset_states()
        vad.reset()
        ours, theirs = [], []
        for i in range(0, x.size - WINDOW + 1, WINDOW):
            w = x[i : i + WINDOW]
            ours.append(vad.prob(w))
            theirs.append(float(ref(torch.from_numpy(w.copy()), SR).item()))
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert max(ours) > 0.9 and min(ours) < 0.05  # the clip holds both speech and silence
    with pytest.raises(ValueError, match="512"):
        vad.prob(np.zeros(WINDOW - 1, np.float32))


def test_speech_like_scores_as_speech() -> None:
    vad = SileroVAD()
    for seed in range(3):
        x = speech_like(2.0, SR, seed)
        probs = [vad.prob(x[i : i + WINDOW]) for i in range(0, x.size - WINDOW + 1, WINDOW)]
        vad.reset()
        assert np.mean(np.array(probs) >= 0.5) > 0.8, (seed, np.round(probs, 2))


# ---------------------------------------------------------------------------------------
# ServerVAD


def _iterator_events(x: np.ndarray, threshold: float, silence_ms: int, pad_ms: int):
    """Silero's VADIterator over the same audio: its start is a window's start minus the
    padding and its end the start of the first quiet window. It counts silence from the end
    of that first quiet window, ours from its start, hence one window less here."""
    torch = pytest.importorskip("torch")
    utils_vad = pytest.importorskip("silero_vad.utils_vad")
    it = utils_vad.VADIterator(
        utils_vad.OnnxWrapper(_onnx_path(), force_onnx_cpu=True),
        threshold=threshold,
        sampling_rate=SR,
        min_silence_duration_ms=silence_ms - WINDOW_MS,
        speech_pad_ms=0,
    )
    out = []
    for i in range(0, x.size - WINDOW + 1, WINDOW):
        ev = it(torch.from_numpy(x[i : i + WINDOW].copy()))
        if ev and "start" in ev:
            out.append(("start", max(0, ev["start"] * 1000 // SR - pad_ms)))
        elif ev:
            out.append(("stop", ev["end"] * 1000 // SR))
    return out


@pytest.mark.parametrize(("threshold", "pad_ms", "silence_ms"), [(0.5, 300, 500), (0.7, 100, 300)])
def test_server_vad_turns(threshold: float, pad_ms: int, silence_ms: int) -> None:
    x = bursts(PATTERN, SR, seed=SEED)
    vad = ServerVAD(threshold, prefix_padding_ms=pad_ms, silence_duration_ms=silence_ms)
    events = _events(vad, x, 1600)
    assert [e.kind for e in events] == ["start", "stop", "start", "stop"]

    # the rules: exactly Silero's own iterator on the same probabilities
    assert [(e.kind, e.ms) for e in events] == _iterator_events(x, threshold, silence_ms, pad_ms)

    # the acoustics: speech at 0-1200 and 2000-3000 ms; a start is the first speech window
    # (the one holding the onset or the next) minus the padding, floored at 0
    for e, onset in zip(events[0::2], (0, 2000)):
        assert abs(e.ms - max(0, onset - pad_ms)) <= WINDOW_MS
        assert e.at_ms <= onset + 2 * WINDOW_MS
    for e, end in zip(events[1::2], (1200, 3000)):
        assert end - WINDOW_MS <= e.ms <= end + STOP_LAG_MS
        assert e.at_ms >= e.ms + silence_ms  # decided only after the whole silence
    assert not vad.in_speech
    assert vad.commit_span() == (events[2].ms, events[3].ms)
    assert vad.commit_span(tail_ms=100) == (events[2].ms, events[3].ms + 100)
    assert vad.commit_span(tail_ms=10**6) == (events[2].ms, vad.position_ms)
    assert vad.position_ms == 4000


def test_server_vad_silence_only() -> None:
    vad = ServerVAD()
    assert _events(vad, bursts([(3.0, False)], SR, seed=5), 480) == []
    assert not vad.in_speech and vad.commit_span() is None and vad.speech_start_ms is None


def test_short_pause_does_not_stop() -> None:
    x = bursts([(1.0, True), (0.3, False), (1.0, True), (1.0, False)], SR, seed=2)
    vad = ServerVAD(silence_duration_ms=500)
    events = _events(vad, x, 800)
    assert [e.kind for e in events] == ["start", "stop"]
    assert 2300 - WINDOW_MS <= events[1].ms <= 2300 + STOP_LAG_MS


def test_chunking_invariance() -> None:
    x = bursts(PATTERN, SR, seed=SEED)
    ten_ms = _events(ServerVAD(), x, 160)
    assert len(ten_ms) == 4
    assert _events(ServerVAD(), x, 1600) == ten_ms
    rng = np.random.default_rng(0)
    vad, got, pos = ServerVAD(), [], 0
    for size in _random_chunks(x.size, rng, 3000):
        got += vad.feed(x[pos : pos + size])
        pos += size
    assert got == ten_ms


def test_reset_keeps_clock_and_bad_input() -> None:
    x = bursts([(0.5, False), (1.0, True)], SR, seed=4)
    vad = ServerVAD()
    events = vad.feed(x)
    assert [e.kind for e in events] == ["start"] and vad.in_speech
    vad.feed(np.zeros(100, np.float32))  # a partial window, dropped by reset
    vad.reset()
    assert not vad.in_speech and vad.position_ms == (x.size + 100) * 1000 // SR
    again = vad.feed(x)  # the same audio again, timed after what came before
    assert [e.kind for e in again] == ["start"]
    assert again[0].ms > events[0].ms + 1400

    with pytest.raises(ValueError, match="float32"):
        vad.feed(np.zeros(512, np.int16))
    with pytest.raises(ValueError, match="threshold"):
        ServerVAD(threshold=1.5)
    with pytest.raises(ValueError, match="16000"):
        ServerVAD(sample_rate=24000)
    with pytest.raises(ValueError, match=">= 0"):
        ServerVAD(silence_duration_ms=-1)


def test_pcm16_24k_stream_end_to_end(tmp_path) -> None:
    """What a realtime session does: 24 kHz pcm16 chunks -> 16 kHz -> turn events."""
    x24 = bursts(PATTERN, 24000, seed=SEED)
    path = tmp_path / "mic.wav"
    write_wav(path, x24, 24000)
    import soundfile as sf

    back, sr = sf.read(path, dtype="int16")
    assert sr == 24000 and back.size == x24.size
    data = back.astype("<i2").tobytes()
    rs, vad, events = StreamResampler(24000), ServerVAD(), []
    for i in range(0, len(data), 2400):  # 50 ms chunks
        events += vad.feed(rs.push(data[i : i + 2400]))
    events += vad.feed(rs.flush())
    assert [e.kind for e in events] == ["start", "stop", "start", "stop"]
    assert abs(events[2].ms - 1700) <= WINDOW_MS
    assert 3000 - WINDOW_MS <= events[3].ms <= 3000 + STOP_LAG_MS
