"""A duplex session's audio input: ~1 s of 16 kHz audio a unit -> 10 LLM rows, streamed.

Two stages, each carrying the session's state from unit to unit, as the reference
(`MiniCPMODuplex.streaming_prefill` -> `StreamingMelProcessorExact` ->
`get_audio_embedding_streaming`) does:

1. `StreamingMel`: the session's audio so far (at most ~30 s, then 10 s slide off the
   front) is featurized whole at every unit, and only the frames whose STFT window lies
   inside the buffer are emitted: the unit's 100 core frames plus `cnn_redundancy` frames
   either side (none before the first unit). The log floor follows the buffer's length:
   a fixed -10 (log10) under 5 s of audio, the clip's max - 8 from then on, as the
   reference switches its feature extractor.
2. `StreamingAudioEncoder`: conv1/conv2 over the emitted frames, the redundant conv2
   frames cut (ceil(frames / 2) each side), learned positions continuing from the
   session's encoder cache, and Whisper layers whose queries attend to every cached
   frame and to the unit's own (no mask); the cache restarts when it would pass the
   encoder's positions. Projection and 5-frame average pooling as in the offline path.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.processing.audio import HOP_LENGTH, N_FFT, SAMPLE_RATE, _stft_constants
from pipeline.thinker.audio import AudioEncoder

# The reference's buffer rule (`init_streaming_processor`): slide 10 s once 30 s are held.
SLIDE_TRIGGER_SECONDS = 30.0
SLIDE_STRIDE_SECONDS = 10.0
SLIDE_MIN_KEEP_SECONDS = 1.0
# Under this much buffered audio the log floor is fixed, from it on relative to the max.
DYNAMIC_FLOOR_FROM_SECONDS = 5
FIXED_LOG_FLOOR = -10.0
DYNAMIC_RANGE = 8.0


def buffer_log_mel(buffer: np.ndarray) -> torch.Tensor:
    """(n,) float32 -> (80, n // 160): the reference feature extractor on an unpadded
    buffer (centered STFT with reflect padding, the last frame dropped, log10 floor by the
    buffer's length, then (x + 4) / 4)."""
    window, fb = _stft_constants()
    wave = torch.from_numpy(np.ascontiguousarray(buffer, dtype=np.float32))[None]  # (1, n)
    stft = torch.stft(wave, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2  # (1, 201, T)
    log_spec = torch.clamp(fb.T @ power, min=1e-10).log10()  # (1, 80, T)
    if len(buffer) < DYNAMIC_FLOOR_FROM_SECONDS * SAMPLE_RATE:
        log_spec = torch.maximum(log_spec, torch.tensor(FIXED_LOG_FLOOR))
    else:
        peak = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0]
        log_spec = torch.maximum(log_spec, peak - DYNAMIC_RANGE)
    return ((log_spec + 4.0) / 4.0)[0]


class StreamingMel:
    """The session's mel features, one unit at a time (see the module docstring)."""

    def __init__(self, chunk_ms: int, first_chunk_ms: int, cnn_redundancy_ms: int,
                 sample_rate: int = SAMPLE_RATE):
        self.chunk_samples = int(round(chunk_ms * sample_rate / 1000))
        self.chunk_frames = self.chunk_samples // HOP_LENGTH
        raw_first = int(round(first_chunk_ms * sample_rate / 1000))
        # the first chunk is cut at a hop boundary (1035 ms -> 1030 ms)
        self.first_chunk_samples = max(HOP_LENGTH, (raw_first // HOP_LENGTH) * HOP_LENGTH)
        self.redundancy_frames = max(0, int(cnn_redundancy_ms * sample_rate / 1000) // HOP_LENGTH)
        self.sample_rate = sample_rate
        self.buffer = np.zeros(0, np.float32)
        self.last_emitted = 0  # global frame index of the next core frame
        self.base = 0  # global frame index of buffer[0]'s frame
        self.first = True

    def chunk_size(self) -> int:
        return self.first_chunk_samples if self.first else self.chunk_samples

    @property
    def first_chunk_consumed(self) -> int:
        return self.first_chunk_samples

    def _slide(self) -> None:
        sr, n = self.sample_rate, len(self.buffer)
        if n < int(SLIDE_TRIGGER_SECONDS * sr):
            return
        drop = int(SLIDE_STRIDE_SECONDS * sr)
        guard = min(int(SLIDE_MIN_KEEP_SECONDS * sr), n - drop)
        drop = min(drop, max(0, n - guard))
        drop = (drop // HOP_LENGTH) * HOP_LENGTH
        if drop > 0:
            self.buffer = self.buffer[drop:]
            self.base += drop // HOP_LENGTH

    def push(self, chunk: np.ndarray) -> torch.Tensor:
        """Append a chunk; returns the frames to encode (80, n), n = 0 when none is ready."""
        chunk = np.asarray(chunk, dtype=np.float32)
        if len(self.buffer) == 0:
            self.buffer = chunk.copy()
        else:
            self.buffer = np.concatenate([self.buffer, chunk])
        self._slide()
        if len(self.buffer) < N_FFT:
            raise ValueError(f"audio buffer of {len(self.buffer)} samples is shorter than n_fft")
        mel = buffer_log_mel(self.buffer)
        t_full = mel.shape[-1]
        n = len(self.buffer)
        stable = 0 if n < N_FFT // 2 else max(0, (n - N_FFT // 2) // HOP_LENGTH + 1)
        stable_global = self.base + min(t_full, stable)
        core_start = self.last_emitted
        core_end = core_start + self.chunk_frames
        self.first = False
        if stable_global < core_end + self.redundancy_frames:
            return mel[:, :0]
        start = max(0, max(0, core_start - self.redundancy_frames) - self.base)
        end = core_end + self.redundancy_frames - self.base
        start = max(0, min(start, t_full))
        end = max(start, min(end, t_full))
        self.last_emitted = core_end
        return mel[:, start:end]


class StreamingAudioEncoder:
    """The Whisper encoder + projection + pooling over one session's units, with the
    session's encoder K/V carried between units (see the module docstring)."""

    def __init__(self, audio: AudioEncoder):
        self.audio = audio
        self.apm = audio.apm
        self.k: list[torch.Tensor] | None = None  # per layer (heads, past, head_dim)
        self.v: list[torch.Tensor] | None = None

    @property
    def past(self) -> int:
        return 0 if self.k is None else self.k[0].shape[1]

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor, prefix_frames: int, suffix_frames: int) -> torch.Tensor:
        """mel (80, n) with `prefix_frames` / `suffix_frames` redundant mel frames at the
        edges -> (tokens, llm_hidden)."""
        apm = self.apm
        w = apm.conv1.weight
        n_mel = mel.shape[-1]
        max_seq = (n_mel - 1) // 2 + 1
        positions = apm.embed_positions.weight.shape[0]
        if self.k is not None and self.past + max_seq >= positions:
            self.k = self.v = None  # the reference restarts its encoder cache here
        x = mel.to(device=w.device, dtype=w.dtype)[None]  # (1, 80, n)
        x = F.gelu(apm.conv1(x))
        x = F.gelu(apm.conv2(x))  # (1, d, max_seq)
        cut_front = (prefix_frames + 1) // 2 if prefix_frames > 0 else 0
        cut_back = (suffix_frames + 1) // 2 if suffix_frames > 0 else 0
        if cut_front > 0:
            x = x[:, :, cut_front:]
        if 0 < cut_back < x.shape[2]:
            x = x[:, :, :-cut_back]
        x = x.transpose(1, 2)  # (1, t, d)
        past, t = self.past, x.shape[1]
        if past + t > positions:
            raise ValueError(f"audio unit of {t} encoder frames does not fit {positions} positions")
        x = x + apm.embed_positions.weight[past : past + t]
        new_k, new_v = [], []
        for i, layer in enumerate(apm.layers):
            a = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            heads, hd = a.num_heads, a.head_dim
            q = a.q_proj(h).view(1, t, heads, hd).transpose(1, 2)
            k = a.k_proj(h).view(1, t, heads, hd).transpose(1, 2)[0]
            v = a.v_proj(h).view(1, t, heads, hd).transpose(1, 2)[0]
            if self.k is not None:
                k = torch.cat([self.k[i], k], dim=1)
                v = torch.cat([self.v[i], v], dim=1)
            new_k.append(k)
            new_v.append(v)
            o = F.scaled_dot_product_attention(q, k[None], v[None])  # every key: no mask
            x = x + a.out_proj(o.transpose(1, 2).reshape(1, t, heads * hd))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        self.k, self.v = new_k, new_v
        h = apm.layer_norm(x)
        pooled = self.audio.tokens(h)[0]  # (t // 5, llm)
        after_cnn = (n_mel - 1) // 2 + 1
        keep = (after_cnn - self.audio.pool_step) // self.audio.pool_step + 1
        return pooled[:keep]
