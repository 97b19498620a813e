"""Whisper audio encoder (`apm.*`) + projection (`audio_projection_layer.*`) + pooling.

Stages of `AudioEncoder.forward` for mel features (B, n_mels, T) with true lengths T_i:
1. Windows: a clip longer than 2 * max_source_positions mel frames (3000 = 30 s) is cut
   into 30 s windows that are encoded as independent clips and concatenated at the end.
   This is the reference's rule (processing splits audio > 30 s into 30 s pieces before
   featurizing; the encoder only has 1500 learned positions). For bit-exact features,
   featurize each 30 s waveform window separately, as the reference does; cutting a mel
   computed over the whole clip differs at the window edges (STFT padding, log floor).
2. conv1 (k3, p1) + GELU, conv2 (k3, s2, p1) + GELU: 100 -> 50 frames/s. Frames past a
   clip's length are zeroed before each conv so a batched clip sees exactly the zero
   padding it would see alone.
3. + embed_positions[:T'], T' = (T - 1) // 2 + 1.
4. Whisper pre-LN layers with a block-causal mask: 1 s chunks (50 frames); a frame sees
   every frame up to the end of its own chunk; padded keys are masked.
5. layer_norm (the output used is hidden_states[-1], i.e. after it).
6. AudioProjection: Linear(d -> llm) + ReLU + Linear(llm -> llm), per frame.
7. AvgPool1d(pool_step, pool_step) over time (projection BEFORE pooling), keep
   (T' - pool_step) // pool_step + 1 tokens: 10 tokens per second.

Deviation from the reference batch path (documented on purpose): the reference masks
padded keys by comparing post-conv positions with *mel* lengths (so it masks almost
nothing) and lets a shorter clip's last conv2 frame see its neighbour's padding. Here a
clip gives the same tokens batched or alone, which is what the reference gives for the
usual one-clip call.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import AudioConfig, ThinkerConfig
from pipeline.sdpa import any_shape
from pipeline.thinker.vision import load_stripped

MEL_FRAMES_PER_SECOND = 100  # hop 160 at 16 kHz
HOP_LENGTH = 160
ENCODER_FRAMES_PER_SECOND = 50  # after conv2's stride 2


# ---------------------------------------------------------------------------------------
# Lengths


def encoder_frames(n_mel: int) -> int:
    """Frames after conv2 (stride 2, padding 1, kernel 3)."""
    return (n_mel - 1) // 2 + 1


def pooled_tokens(n_mel: int, pool_step: int = 5) -> int:
    """LLM tokens for one window of n_mel <= 3000 mel frames."""
    return (encoder_frames(n_mel) - pool_step) // pool_step + 1


def num_audio_tokens(n_mel: int, pool_step: int = 5, window: int = 3000) -> int:
    """LLM tokens for a clip of n_mel mel frames, split into `window`-frame pieces.

    Equals the processor's placeholder count ((ceil(n/160) - 1)//2 + 1 - 5)//5 + 1 with
    n_mel = ceil(samples / 160): each full 3000-frame window gives exactly 1500 / 5 = 300."""
    if n_mel <= 0:
        return 0
    full, rest = divmod(n_mel, window)
    return full * pooled_tokens(window, pool_step) + (pooled_tokens(rest, pool_step) if rest else 0)


def num_audio_tokens_for_samples(n_samples: int, pool_step: int = 5) -> int:
    """Same count from a 16 kHz waveform length (the processor's get_audio_placeholder)."""
    return num_audio_tokens(math.ceil(n_samples / HOP_LENGTH), pool_step)


def block_causal_mask(
    lengths: Sequence[int], seq_len: int, chunk: int, device=None
) -> torch.Tensor:
    """(B, 1, seq_len, seq_len) bool, True = may attend.

    Query i of clip b sees key j iff j < min(end of i's chunk, length_b); chunk <= 0 means
    full attention over the clip. Padded query rows still see the real keys of their
    chunk range, so no row is fully masked (no NaN)."""
    pos = torch.arange(seq_len)
    if chunk > 0:
        chunk_end = (pos // chunk + 1) * chunk  # (L,) exclusive end of each query's chunk
        allowed = pos[None, :] < chunk_end[:, None]  # (L, L)
    else:
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool)
    lens = torch.tensor(list(lengths))
    key_ok = pos[None, :] < lens[:, None]  # (B, L)
    return (allowed[None] & key_ok[:, None, :]).unsqueeze(1).to(device)


# ---------------------------------------------------------------------------------------
# Modules


class WhisperAttention(nn.Module):
    """Whisper encoder self-attention; k_proj has no bias."""

    def __init__(self, cfg: AudioConfig, backend: str = "sdpa"):
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.head_dim = cfg.head_dim
        self.backend = backend
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # x (B, T, d); mask (B, 1, T, T) bool, True = attend
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        if self.backend == "eager":
            scores = (q * self.head_dim**-0.5) @ k.transpose(2, 3)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            o = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, d))


class WhisperEncoderLayer(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, cfg: AudioConfig, backend: str = "sdpa"):
        super().__init__()
        assert cfg.activation_function == "gelu", f"unsupported act {cfg.activation_function}"
        d = cfg.d_model
        self.self_attn = WhisperAttention(cfg, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Mel (B, n_mels, T) + lengths -> (B, T', d) after the final layer_norm."""

    def __init__(self, cfg: AudioConfig, chunk_frames: int = 50, backend: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.chunk_frames = chunk_frames
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(
            WhisperEncoderLayer(cfg, backend) for _ in range(cfg.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    @property
    def max_mel_frames(self) -> int:
        return 2 * self.cfg.max_source_positions

    def set_attn_backend(self, backend: str) -> None:
        if backend not in ("eager", "sdpa"):
            raise ValueError(f"audio attention backend must be eager or sdpa, got {backend!r}")
        for layer in self.layers:
            layer.self_attn.backend = backend

    def forward(self, features: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        t = features.shape[2]
        lengths = [int(n) for n in lengths]
        if max(lengths) > self.max_mel_frames:
            raise ValueError(
                f"clip of {max(lengths)} mel frames > {self.max_mel_frames}; split it first"
            )
        return self.run(features, *self.masks(lengths, t, features.device))

    def masks(
        self, lengths: Sequence[int], t: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mel_valid (B, t), mask (B, 1, T', T')) of clips of `lengths` mel frames padded
        to t: each clip's valid mel frames, and the block-causal + padding mask shared by
        all layers."""
        mel_valid = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(
            device, non_blocking=True
        )
        enc_lens = [encoder_frames(m) for m in lengths]
        return mel_valid, block_causal_mask(enc_lens, encoder_frames(t), self.chunk_frames, device)

    def run(self, features: torch.Tensor, mel_valid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The encoder over features (B, n_mels, t) with `masks`' tensors (no host work on
        lengths: a CUDA graph replays it)."""
        features = features.to(self.conv1.weight.dtype)

        # 1) convs; zero each clip's tail so batching does not leak into its last frame
        x = features * mel_valid[:, None, :]
        x = F.gelu(self.conv1(x)) * mel_valid[:, None, :]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (B, T', d)

        # 2) learned positions
        x = x + self.embed_positions.weight[: x.shape[1]]

        # 3) the layers, under the block-causal + padding mask; every clip length is a new shape
        with any_shape():
            for layer in self.layers:
                x = layer(x, mask)
        return self.layer_norm(x)


class AudioProjection(nn.Module):
    """`audio_projection_layer`: Linear(d_in -> llm) + ReLU + Linear(llm -> llm)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


class AudioEncoder(nn.Module):
    """Whisper encoder + projection + average pooling -> LLM-width audio tokens.

    Children are named as the checkpoint prefixes (`apm`, `audio_projection_layer`), so
    this module's state_dict keys are exactly the checkpoint's."""

    def __init__(
        self, cfg: AudioConfig, llm_hidden: int, pool_step: int = 5, chunk_seconds: float = 1.0
    ):
        super().__init__()
        # the reference sizes the projection input from the FFN width, not d_model
        in_dim = cfg.encoder_ffn_dim // 4
        if in_dim != cfg.d_model:
            raise ValueError(
                f"projection input encoder_ffn_dim//4={in_dim} != d_model={cfg.d_model}"
            )
        chunk_frames = int(chunk_seconds * ENCODER_FRAMES_PER_SECOND)
        self.pool_step = pool_step
        self.apm = WhisperEncoder(cfg, chunk_frames)
        self.audio_projection_layer = AudioProjection(in_dim, llm_hidden)

    @classmethod
    def from_config(cls, cfg: ThinkerConfig) -> "AudioEncoder":
        return cls(cfg.audio, cfg.llm.hidden_size, cfg.audio_pool_step, cfg.audio_chunk_length)

    def num_tokens(self, n_mel: int) -> int:
        return num_audio_tokens(n_mel, self.pool_step, self.apm.max_mel_frames)

    def tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Encoder frames (N, T', d) -> projected per frame, then average-pooled over time
        (N, T' // pool_step, llm); a window of n mel frames keeps pooled_tokens(n) of them."""
        h = self.audio_projection_layer(h)  # (N, T', llm)
        return F.avg_pool1d(h.transpose(1, 2), self.pool_step, self.pool_step).transpose(1, 2)

    def forward(
        self, features: torch.Tensor, lengths: Sequence[int] | torch.Tensor
    ) -> list[torch.Tensor]:
        """features (B, n_mels, T) zero-padded, lengths (B,) mel frames per clip ->
        list of B tensors (num_tokens(length_i), llm_hidden)."""
        lengths = [int(n) for n in torch.as_tensor(lengths).reshape(-1).tolist()]
        window = self.apm.max_mel_frames

        # 1) cut clips into <= 30 s windows: (row, start, length) per window
        pieces: list[tuple[int, int, int]] = []
        owner: list[int] = []
        for i, n in enumerate(lengths):
            for start in range(0, max(n, 1), window):
                pieces.append((i, start, min(window, n - start)))
                owner.append(i)
        if len(pieces) == len(lengths):
            batch = features[:, :, : max(lengths)]
        else:
            t = max(p[2] for p in pieces)
            batch = features.new_zeros(len(pieces), features.shape[1], t)
            for j, (i, start, n) in enumerate(pieces):
                batch[j, :, :n] = features[i, :, start : start + n]
        piece_lens = [p[2] for p in pieces]

        # 2) encode, project per frame, then pool over time
        pooled = self.tokens(self.apm(batch, piece_lens))

        # 3) keep each window's real tokens and stitch windows back into clips
        out: list[list[torch.Tensor]] = [[] for _ in lengths]
        for j, n in enumerate(piece_lens):
            out[owner[j]].append(pooled[j, : pooled_tokens(n, self.pool_step)])
        return [torch.cat(parts, dim=0) for parts in out]


def build_audio_encoder(
    cfg: ThinkerConfig, state_dict: Mapping[str, torch.Tensor] | None = None, prefix: str = ""
) -> AudioEncoder:
    """Build from config; if `state_dict` is given, strict-load `apm.*` and
    `audio_projection_layer.*` (found under `prefix`, "" for a whole checkpoint)."""
    enc = AudioEncoder.from_config(cfg)
    if state_dict is not None:
        keep = (prefix + "apm.", prefix + "audio_projection_layer.")
        load_stripped(enc, {k: v for k, v in state_dict.items() if k.startswith(keep)}, prefix)
    return enc
