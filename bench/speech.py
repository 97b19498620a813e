"""Synthetic speech-like audio that Silero VAD scores as speech, for tests without recordings.

`speech_like` is a source-filter vowel stream: glottal pulses (period-to-period jitter and
shimmer, a 100-160 Hz pitch contour set per syllable) through four formant resonators whose
targets move between vowels from syllable to syllable, under a syllable envelope (120-250 ms
syllables, ~5 per second) with fricative-like noise bursts at most syllable onsets. What
made Silero fire, found by trying variants: pulses rather than a smooth glottal wave,
formants that keep moving (one steady vowel scores near 0), consonant bursts, and a vowel
(not a burst) at the very onset, which makes the first window score as speech.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import scipy.signal as ss

# Formant targets F1-F4 (Hz) of a few vowels (a, i, u, e, o, ae, schwa-ish) and bandwidths.
_VOWELS = np.array(
    [
        (730, 1090, 2440, 3400),
        (270, 2290, 3010, 3700),
        (300, 870, 2240, 3300),
        (530, 1840, 2480, 3500),
        (570, 840, 2410, 3300),
        (660, 1720, 2410, 3400),
        (440, 1020, 2240, 3300),
    ],
    dtype=np.float64,
)
_BANDWIDTHS = (60.0, 90.0, 120.0, 180.0)
SILENCE_STD = 1e-4  # the "silent" segments' noise floor (about -80 dBFS)


def _formants(src: np.ndarray, tracks: list[np.ndarray], sr: int) -> np.ndarray:
    """Cascade of two-pole resonators, their centre frequencies updated every 5 ms."""
    block = max(sr // 200, 1)
    y = np.empty_like(src)
    zi = [np.zeros(2) for _ in _BANDWIDTHS]
    for b in range(0, src.size, block):
        seg = src[b : b + block]
        for k, bw in enumerate(_BANDWIDTHS):
            r = np.exp(-np.pi * bw / sr)
            c = 2 * r * np.cos(2 * np.pi * tracks[k][b] / sr)
            seg, zi[k] = ss.lfilter([1 - c + r * r], [1, -c, r * r], seg, zi=zi[k])
        y[b : b + block] = seg
    return y


def speech_like(seconds: float, sr: int, seed: int) -> np.ndarray:
    """`seconds` of speech-like float32 audio at `sr` (peak 0.5), deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    n = round(seconds * sr)
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(bounds[-1] + int(rng.uniform(0.12, 0.25) * sr))
    edges = np.array(bounds)

    # glottal source: one pulse per period, jittered and shimmered, shaped as a flow derivative
    f0 = np.interp(np.arange(n), edges, 105 + rng.uniform(0, 60, edges.size))
    pulses = np.zeros(n)
    pos = 0.0
    while pos < n:
        i = int(pos)
        pulses[i] = 1 + 0.1 * rng.standard_normal()
        pos += sr / f0[i] * (1 + 0.02 * rng.standard_normal())
    width = max(int(0.004 * sr), 2)
    flow = np.sin(np.pi * np.arange(width) / width) ** 2
    src = np.convolve(pulses, -np.diff(flow, prepend=0.0), "same")
    src += 0.02 * rng.standard_normal(n)

    # vowel targets at syllable centres, formants gliding between them
    centres = (edges[:-1] + edges[1:]) // 2
    targets = _VOWELS[rng.integers(0, len(_VOWELS), centres.size)]
    tracks = [np.interp(np.arange(n), centres, targets[:, k]) for k in range(4)]
    voiced = _formants(src, tracks, sr)

    # syllable envelope: 30 ms attack, 50 ms release to a 0.2 floor between syllables
    env = np.zeros(n)
    for a, b in zip(edges[:-1], np.minimum(edges[1:], n)):
        length = b - a
        if length <= 0:
            continue
        attack, release = min(int(0.03 * sr), length // 3), min(int(0.05 * sr), length // 3)
        e = np.ones(length)
        e[:attack] = np.linspace(0.2 if a > 0 else 0.0, 1.0, attack)
        e[length - release :] = np.linspace(1.0, 0.2, release)
        env[a:b] = e * rng.uniform(0.6, 1.0)
    tail = min(int(0.04 * sr), n)
    env[n - tail :] *= np.linspace(1.0, 0.0, tail)
    y = voiced / (np.abs(voiced).max() + 1e-9) * env

    # consonant-like noise bursts at most syllable onsets after the first
    noise = rng.standard_normal(n)
    for a in edges[1:-1]:
        if rng.random() >= 0.6:
            continue
        b = min(a + int(rng.uniform(0.03, 0.08) * sr), n)
        if b - a < 8:
            continue
        fc = rng.uniform(2500, 6000)
        lo, hi = fc * 0.7 / (sr / 2), min(fc * 1.3 / (sr / 2), 0.95)
        if lo >= hi:
            continue
        bb, aa = ss.butter(2, [lo, hi], "band")
        y[a:b] += ss.lfilter(bb, aa, noise[a:b]) * np.hanning(b - a) * 0.25
    return (y / (np.abs(y).max() + 1e-9) * 0.5).astype(np.float32)


def bursts(pattern: list[tuple[float, bool]], sr: int, seed: int) -> np.ndarray:
    """Concatenated segments: (seconds, True) speech-like, (seconds, False) near silence."""
    rng = np.random.default_rng(seed)
    parts = []
    for i, (seconds, speech) in enumerate(pattern):
        if speech:
            parts.append(speech_like(seconds, sr, seed * 1000 + i))
        else:
            n = round(seconds * sr)
            parts.append((SILENCE_STD * rng.standard_normal(n)).astype(np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def write_wav(path: str | Path, pcm: np.ndarray, sr: int) -> None:
    """Mono pcm16 WAV of float audio in [-1, 1] (clipped)."""
    ints = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(ints.tobytes())
