"""A duplex session's audio input: ~1 s of 16 kHz audio a unit -> 10 LLM rows, streamed.

Two stages, each carrying the session's state from unit to unit, as the reference
(`MiniCPMODuplex.streaming_prefill` -> `StreamingMelProcessorExact` ->
`get_audio_embedding_streaming`) does:

1. `StreamingMel`: the session's audio so far (at most ~30 s, then 10 s slide off the
   front) is featurized whole at every unit, as the reference does, and only the frames
   whose STFT window lies inside the buffer are emitted: the unit's 100 core frames plus
   `cnn_redundancy` frames either side (none before the first unit). The log floor follows
   the buffer's length: a fixed -10 (log10) under 5 s of audio, the clip's max - 8 from
   then on, as the reference switches its feature extractor. The frames no new sample
   changes are kept from unit to unit, so a unit computes the STFT of its own ~100 frames,
   not of the whole buffer (~11 ms of one CPU thread a session at 30 s).
2. `StreamingAudioEncoder`: conv1/conv2 over the emitted frames, the redundant conv2
   frames cut (ceil(frames / 2) each side), learned positions continuing from the
   session's encoder cache, and Whisper layers whose queries attend to every cached
   frame and to the unit's own (no mask); the cache restarts when it would pass the
   encoder's positions. Projection and 5-frame average pooling as in the offline path.

The encoder stage runs many sessions' units in one pass (`encode_batch`, what a batch of
duplex units uses; `StreamingAudioEncoder.encode` is a batch of one): the matmuls over all
sessions' rows, the attention of each session over its own cache. A session's cache is one
buffer of the encoder's full length, allocated at its first unit: the size the cache
reaches anyway before it restarts (~30 s of units), written in place instead of grown.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.processing.audio import HOP_LENGTH, N_FFT, N_MELS, SAMPLE_RATE, _stft_constants
from pipeline.sdpa import any_shape
from pipeline.thinker.audio import AudioEncoder

# The reference's buffer rule (`init_streaming_processor`): slide 10 s once 30 s are held.
SLIDE_TRIGGER_SECONDS = 30.0
SLIDE_STRIDE_SECONDS = 10.0
SLIDE_MIN_KEEP_SECONDS = 1.0
# Under this much buffered audio the log floor is fixed, from it on relative to the max.
DYNAMIC_FLOOR_FROM_SECONDS = 5
FIXED_LOG_FLOOR = -10.0
DYNAMIC_RANGE = 8.0
# Frames whose window reaches before the buffer's first sample (reflect-padded):
# ceil(200 / 160).
FRONT_FRAMES = -(-(N_FFT // 2) // HOP_LENGTH)


def stable_frames(samples: int) -> int:
    """Frames of a buffer of `samples` that no later sample changes: frame t reads samples
    up to t * 160 + 200, so it is stable once they are all in the buffer."""
    return max(0, (samples - N_FFT // 2) // HOP_LENGTH + 1)


def log_mel_frames(buffer: np.ndarray, lo: int, hi: int) -> torch.Tensor:
    """Frames [lo, hi) of the reference feature extractor's log10 mel of an unpadded buffer
    (a centered STFT with reflect padding, whose last frame is dropped), before its floor:
    (80, hi - lo). A frame is its 400 samples' own FFT, the same bits whatever the frames
    around it; only the filter bank's matmul may sum a column in another order when it has
    other columns beside it (within 1 ulp of the log)."""
    if hi <= lo:
        return torch.zeros(N_MELS, 0)
    n, half = len(buffer), N_FFT // 2
    a, b = lo * HOP_LENGTH - half, (hi - 1) * HOP_LENGTH + half  # the frames' samples
    # reflect padding needs more than `half` samples beyond an edge it pads
    s0, s1 = max(0, min(a, n - half - 1)), min(n, max(b, half + 1))
    wave = torch.from_numpy(np.ascontiguousarray(buffer[s0:s1], dtype=np.float32))[None, None]
    front, back = max(0, -a), max(0, b - n)
    if front or back:
        wave = F.pad(wave, (front, back), mode="reflect")
    off = a - (s0 - front)
    wave = wave[0, :, off : off + b - a]  # (1, b - a)
    window, fb = _stft_constants()
    stft = torch.stft(wave, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
    power = stft.abs() ** 2  # (1, 201, hi - lo)
    return torch.clamp(fb.T @ power, min=1e-10).log10()[0]


def mel_floor(frames: torch.Tensor, samples: int, log_spec: torch.Tensor) -> torch.Tensor:
    """The reference's floor on `frames`, some of the frames `log_spec` (80, T) of a buffer
    of `samples`, then (x + 4) / 4: a fixed -10 under 5 s of audio, the buffer's max - 8
    from then on."""
    if samples < DYNAMIC_FLOOR_FROM_SECONDS * SAMPLE_RATE:
        frames = torch.maximum(frames, torch.tensor(FIXED_LOG_FLOOR))
    else:
        frames = torch.maximum(frames, log_spec.max() - DYNAMIC_RANGE)
    return (frames + 4.0) / 4.0


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
        # log10 mel of the buffer's first frames, those no later sample changes (`log_spec`)
        self._stable = torch.zeros(N_MELS, 0)

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
            # the frames kept move down whole (drop is a whole number of hops); the front
            # ones now pad by reflecting the new first samples
            kept = self._stable[:, drop // HOP_LENGTH :]
            front = min(FRONT_FRAMES, kept.shape[1])
            self._stable = torch.cat([log_mel_frames(self.buffer, 0, front), kept[:, front:]], 1)

    def log_spec(self) -> torch.Tensor:
        """The buffer's frames' log10 mel before the floor, (80, len(buffer) // 160): what
        the reference computes over the whole buffer at every unit, computed here for the
        frames new since the last unit (and those that reach past the buffer's end, whose
        padding the next samples replace) and kept for the frames that no new sample
        changes."""
        n = len(self.buffer)
        total = n // HOP_LENGTH
        done = self._stable.shape[1]
        fresh = log_mel_frames(self.buffer, done, total)
        stable = min(total, stable_frames(n))
        self._stable = torch.cat([self._stable, fresh[:, : stable - done]], 1)
        return torch.cat([self._stable, fresh[:, stable - done :]], 1)

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
        log_spec = self.log_spec()
        t_full = log_spec.shape[-1]
        n = len(self.buffer)
        stable_global = self.base + min(t_full, stable_frames(n))
        core_start = self.last_emitted
        core_end = core_start + self.chunk_frames
        self.first = False
        if stable_global < core_end + self.redundancy_frames:
            return log_spec[:, :0]
        start = max(0, max(0, core_start - self.redundancy_frames) - self.base)
        end = core_end + self.redundancy_frames - self.base
        start = max(0, min(start, t_full))
        end = max(start, min(end, t_full))
        self.last_emitted = core_end
        # the floor's max is over the whole buffer; the rest is elementwise
        return mel_floor(log_spec[:, start:end], n, log_spec)


class StreamingAudioEncoder:
    """The Whisper encoder + projection + pooling over one session's units, with the
    session's encoder K/V carried between units (see the module docstring). A batch of
    sessions runs in one pass through `encode_batch`; `encode` is a batch of one."""

    def __init__(self, audio: AudioEncoder):
        self.audio = audio
        self.apm = audio.apm
        # (layers, 2, heads, positions, head_dim): the K/V of the session's encoder frames,
        # the first `length` positions valid; allocated at the first unit, zeroed so that a
        # batch's masked-out positions never hold a NaN (0 weight times NaN is NaN)
        self.kv: torch.Tensor | None = None
        self.length = 0

    @property
    def past(self) -> int:
        return self.length

    @property
    def k(self) -> list[torch.Tensor] | None:
        """Per layer (heads, past, head_dim), or None before the first unit."""
        return None if self.kv is None or not self.length else list(self.kv[:, 0, :, : self.length])

    @property
    def v(self) -> list[torch.Tensor] | None:
        return None if self.kv is None or not self.length else list(self.kv[:, 1, :, : self.length])

    def encode(self, mel: torch.Tensor, prefix_frames: int, suffix_frames: int) -> torch.Tensor:
        """mel (80, n) with `prefix_frames` / `suffix_frames` redundant mel frames at the
        edges -> (tokens, llm_hidden)."""
        return encode_batch([self], [mel], [prefix_frames], [suffix_frames])[0]


@torch.inference_mode()
def encode_batch(encoders: list[StreamingAudioEncoder], mels: list[torch.Tensor],
                 prefix_frames: list[int], suffix_frames: list[int]) -> list[torch.Tensor]:
    """One unit of each session (its own encoder, each once, all over one AudioEncoder) in
    one pass: mel (80, n_i) with its redundant edge frames -> (tokens_i, llm_hidden) each,
    every encoder's K/V advanced as if it ran alone.

    The convs run per group of equal mel length; the positions, norms, projections and MLPs
    over every session's rows at once; the attention in one call over the sessions padded
    to the longest past + new frames, a key mask hiding each one's padding (no mask when
    every session has the same length: a batch of one is the plain unmasked attention).
    Across sessions only the matmuls' row count and the padding differ, which moves fp32
    values in their last bits."""
    b = len(encoders)
    if not (b == len(mels) == len(prefix_frames) == len(suffix_frames)):
        raise ValueError("encode_batch takes one mel and one prefix / suffix per encoder")
    if not b:
        return []
    if len({id(e) for e in encoders}) != b:
        raise ValueError("an encoder may have one unit in a batch")
    audio = encoders[0].audio
    if any(e.audio is not audio for e in encoders):
        raise ValueError("the encoders of a batch must share one AudioEncoder")
    apm = audio.apm
    w = apm.conv1.weight
    positions = apm.embed_positions.weight.shape[0]
    n_mels = [int(m.shape[-1]) for m in mels]

    # convs, one call per mel length; then each session's redundant conv2 frames are cut
    frames: list[torch.Tensor | None] = [None] * b
    for n in sorted(set(n_mels)):
        idx = [i for i in range(b) if n_mels[i] == n]
        x = torch.stack([mels[i] for i in idx]).to(device=w.device, dtype=w.dtype)
        x = F.gelu(apm.conv2(F.gelu(apm.conv1(x))))  # (g, d, max_seq)
        for j, i in enumerate(idx):
            front = (prefix_frames[i] + 1) // 2 if prefix_frames[i] > 0 else 0
            back = (suffix_frames[i] + 1) // 2 if suffix_frames[i] > 0 else 0
            y = x[j, :, front:]
            if 0 < back < y.shape[1]:
                y = y[:, :-back]
            frames[i] = y.transpose(0, 1)  # (t_i, d)
    ts = [f.shape[0] for f in frames]

    # each session's past: the reference restarts its encoder cache when the unit's frames
    # would pass the encoder's positions
    pasts = []
    for e, n in zip(encoders, n_mels):
        max_seq = (n - 1) // 2 + 1
        pasts.append(0 if e.length and e.length + max_seq >= positions else e.length)
    for p, t in zip(pasts, ts):
        if p + t > positions:
            raise ValueError(f"audio unit of {t} encoder frames does not fit {positions} positions")
    for e, p in zip(encoders, pasts):
        e.length = p
        if e.kv is None:
            layer = apm.layers[0].self_attn
            e.kv = torch.zeros(len(apm.layers), 2, layer.num_heads, positions, layer.head_dim,
                               device=w.device, dtype=w.dtype)

    x = torch.cat(frames) if b > 1 else frames[0]  # (N, d): every session's rows
    pos = torch.cat([torch.arange(p, p + t) for p, t in zip(pasts, ts)]).to(w.device)
    x = x + apm.embed_positions.weight[pos]
    ends = [p + t for p, t in zip(pasts, ts)]
    kv_len = max(ends)
    uniform = len(set(ts)) == 1
    # a key mask only where the sessions' lengths differ, True = attend
    mask = None
    if len(set(ends)) > 1:
        mask = (torch.arange(kv_len)[None, :] < torch.tensor(ends)[:, None])[:, None, None]
        mask = mask.to(w.device)
    if not uniform:  # queries padded to the longest unit: (row of x) -> (session, frame)
        rows_b = torch.cat([torch.full((t,), i) for i, t in enumerate(ts)]).to(w.device)
        rows_t = torch.cat([torch.arange(t) for t in ts]).to(w.device)
    bounds = [0]
    for t in ts:
        bounds.append(bounds[-1] + t)

    for li, layer in enumerate(apm.layers):
        a = layer.self_attn
        heads, hd = a.num_heads, a.head_dim
        h = layer.self_attn_layer_norm(x)
        q = a.q_proj(h).view(-1, heads, hd)
        kv = torch.stack((a.k_proj(h), a.v_proj(h))).view(2, -1, heads, hd)
        for i, e in enumerate(encoders):  # each session's new K/V after its own past
            lo, hi, p = bounds[i], bounds[i + 1], pasts[i]
            e.kv[li, :, :, p : p + ts[i]] = kv[:, lo:hi].transpose(1, 2)
        if b == 1:
            keys = encoders[0].kv[li, :, :, :kv_len][:, None]  # (2, 1, heads, L, hd)
        else:
            keys = torch.stack([e.kv[li, :, :, :kv_len] for e in encoders], dim=1)
        if uniform:
            qb = q.view(b, ts[0], heads, hd).transpose(1, 2)
        else:
            qb = q.new_zeros(b, max(ts), heads, hd)
            qb[rows_b, rows_t] = q
            qb = qb.transpose(1, 2)
        # the keys' length grows every unit: a new shape at every call (pipeline/sdpa.py)
        with any_shape():
            o = F.scaled_dot_product_attention(qb, keys[0], keys[1], attn_mask=mask)
        o = o.transpose(1, 2)  # (b, t, heads, hd)
        o = o.reshape(-1, heads * hd) if uniform else o[rows_b, rows_t].reshape(-1, heads * hd)
        x = x + a.out_proj(o)
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    for e, end in zip(encoders, ends):
        e.length = end

    h = apm.layer_norm(x)
    if uniform:
        pooled = list(audio.tokens(h.view(b, ts[0], -1)))
    else:
        pooled = [audio.tokens(h[bounds[i] : bounds[i + 1]][None])[0] for i in range(b)]
    out = []
    for n, p in zip(n_mels, pooled):
        after_cnn = (n - 1) // 2 + 1
        out.append(p[: (after_cnn - audio.pool_step) // audio.pool_step + 1])
    return out
