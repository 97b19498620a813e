"""The scripted duplex sessions of the golden files: deterministic per-unit inputs.

Both the golden script (tests/duplex_golden/make_golden.py, on the reference) and the parity
tests (on omniray) build their inputs here. A unit is 1 s of 16 kHz float32 PCM (what the
official client sends each second), "loud" (seeded noise plus a tone, where the duplex test
checkpoint speaks) or "quiet" (seeded noise at -60 dB, where it listens, and where a quiet
unit in the middle of a turn ends the turn); an omni session adds one small seeded RGB frame
per unit."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 16000
UNIT_SAMPLES = SAMPLE_RATE  # the official client's 1 s units

# Listen (quiet, no turn), speak for a few units (loud), end the turn (quiet), listen, speak
# again, end again, listen: listen and speak units, two turn ends, and (with the sessions'
# small window) a window slide in the second half.
PATTERN = "qqqLLLLqqqLLLqqq"

PREFIX = "<|im_start|>system\nYou are a helpful assistant. Listen and answer in speech.\n"
SUFFIX = "<|im_end|>"


@dataclass(frozen=True)
class SessionScript:
    name: str
    decode_mode: str  # "greedy" | "sampling"
    seed: int  # torch.manual_seed before prepare (the reference's global RNG)
    pattern: str = PATTERN
    frames: bool = False  # omni: one frame per unit
    frame_size: tuple[int, int] = (56, 42)  # (width, height)
    duplex_kwargs: dict = field(default_factory=dict)
    generate_audio: bool = True  # False: the Thinker alone (no Talker, no Token2Wav)
    # Token2wav's Euler steps (`MiniCPMODuplex(n_timesteps=...)`; 10 is its default, 5 what
    # the demo's duplex example passes and its server runs)
    n_timesteps: int = 10


# The reference's own kwargs: basic sliding window with thresholds a 16-unit session crosses.
WINDOW = {"sliding_window_mode": "basic", "basic_window_high_tokens": 300,
          "basic_window_low_tokens": 220}

SESSIONS = (
    SessionScript("audio_greedy", "greedy", seed=1234, duplex_kwargs=dict(WINDOW)),
    SessionScript("audio_sampling", "sampling", seed=4321, duplex_kwargs=dict(WINDOW)),
    # audio_greedy's session with Token2wav at 5 Euler steps: the same ids and codes, its PCM
    SessionScript("audio_greedy_5steps", "greedy", seed=1234, duplex_kwargs=dict(WINDOW),
                  n_timesteps=5),
    SessionScript("omni_greedy", "greedy", seed=777, frames=True,
                  duplex_kwargs={"sliding_window_mode": "basic", "basic_window_high_tokens": 700,
                                 "basic_window_low_tokens": 550}),
    # The context-preserving window: past 6 units the oldest is dropped and its text moves
    # into the "previous: " block of the system prompt (at most 40 tokens, cut on the left).
    SessionScript("text_context_greedy", "greedy", seed=99, generate_audio=False,
                  duplex_kwargs={"sliding_window_mode": "context", "context_max_units": 6,
                                 "context_previous_max_tokens": 40}),
)


def session(name: str) -> SessionScript:
    for s in SESSIONS:
        if s.name == name:
            return s
    raise KeyError(name)


def unit_audio(kind: str, index: int, seed: int = 0) -> np.ndarray:
    """1 s of 16 kHz float32 PCM for unit `index`: kind "L" loud or "q" quiet."""
    rng = np.random.default_rng([seed, index, 16000])
    noise = rng.standard_normal(UNIT_SAMPLES).astype(np.float32)
    if kind == "q":
        return (0.001 * noise).astype(np.float32)
    if kind != "L":
        raise ValueError(f"unit kind {kind!r}: 'L' (loud) or 'q' (quiet)")
    t = np.arange(UNIT_SAMPLES, dtype=np.float64) / SAMPLE_RATE
    f0 = 180.0 + 40.0 * (index % 5)
    tone = 0.25 * np.sin(2 * np.pi * f0 * t) + 0.1 * np.sin(2 * np.pi * 2.5 * f0 * t)
    return (tone + 0.05 * noise).astype(np.float32)


def unit_frame(index: int, size: tuple[int, int] = (56, 42), seed: int = 0):
    """A small seeded RGB frame (PIL.Image) for unit `index`: smooth gradients plus noise."""
    from PIL import Image

    w, h = size
    rng = np.random.default_rng([seed, index, 3])
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)),
                     np.full_like(xx, (index * 37) % 256)], axis=-1).astype(np.int16)
    img = np.clip(base + rng.integers(-40, 41, size=base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(img, "RGB")


def session_inputs(script: SessionScript) -> list[tuple[np.ndarray, list | None]]:
    """[(audio, frames or None)] per unit of the session."""
    out = []
    for i, kind in enumerate(script.pattern):
        audio = unit_audio(kind, i, seed=script.seed)
        frames = [unit_frame(i, script.frame_size, seed=script.seed)] if script.frames else None
        out.append((audio, frames))
    return out


def ref_audio(ckpt_dir) -> np.ndarray | None:
    """The checkpoint's HT_ref_audio.wav as 16 kHz float32 (the voice embedded by prepare)."""
    from pathlib import Path

    import soundfile

    path = Path(ckpt_dir) / "assets" / "HT_ref_audio.wav"
    if not path.is_file():
        return None
    wav, sr = soundfile.read(str(path), dtype="float32")
    if wav.ndim > 1:
        wav = wav.mean(axis=1)
    if sr != SAMPLE_RATE:
        raise ValueError(f"{path}: {sr} Hz, expected {SAMPLE_RATE}")
    return np.ascontiguousarray(wav, dtype=np.float32)
