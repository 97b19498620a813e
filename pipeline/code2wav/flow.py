"""Code2Wav flow model: speech codes (25 Hz) -> 80-bin mel (50 Hz), CosyVoice2-style.

`Flow` (the checkpoint's `CausalMaskedDiffWithXvec`, keys as in `assets/token2wav/flow.pt`):
  1. input_embedding   : codes (B,T) -> (B,T,512)
  2. encoder           : UpsampleConformerEncoderV2 (B,T,512) -> (B,2T,512)
       embed (Linear+LN, x sqrt(d), Espnet rel-pos) -> PreLookaheadLayer (3 codes of lookahead)
       -> 6 rel-pos conformer layers -> Upsample1D (nearest x2 + causal conv k=5)
       -> up_embed -> 4 conformer layers -> after_norm
  3. encoder_proj      : (B,2T,512) -> mu (B,2T,80)
  4. spk_embed_affine  : normalize(x-vector (B,192)) -> (B,80)
  5. decoder           : CausalCFM, 10 cosine-scheduled Euler steps of the DiT with CFG
                         v = (1+r) v_cond - r v_uncond, noise from a fixed `rand_noise` buffer.

Streaming only (the offline decode of a whole utterance is the tests' reference,
tests/_code2wav_plain.py): `setup_cache` builds a voice's `FlowCache` (`_chunk`, one chunk with caches),
then every stream's chunks run in the slot pool (`forward_slots`, slots.py); see stream.py for
the per-turn protocol (spec section 3.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.code2wav.dit import DiT, DiTPool, DiTSlots
from pipeline.config import Code2WavConfig, DiTConfig, FlowEncoderConfig

NOISE_FRAMES = 30000  # 600 s of 50 Hz mel: the reference's rand_noise length
HISTORY_FRAMES = 100  # mel frames of cache kept beyond the prompt (reference constant)


# ---------------------------------------------------------------------------------------
# Streaming cache


@dataclass
class FlowCache:
    """Per-batch flow streaming state. B streams; the estimator rows are CFG-doubled
    ([cond_0..cond_{B-1}, uncond_0..uncond_{B-1}], the reference's row order).

    token_att : (n_blocks, B, H, Lt, 2dk)  token-rate conformer K||V, oldest-first
    mel_att   : (n_up,     B, H, Lm, 2dk)  mel-rate conformer K||V, oldest-first (Lm = 2 Lt)
    lookahead_cnn : (B, C, 2)               PreLookaheadLayer conv2 context
    up_cnn    : (B, C, 2*stride)            Upsample1D conv context
    est_cnn   : (S, depth, 2B, 2D, 2)       DiT causal-conv tails per Euler step
    est_att   : (S, depth, 2B, H, L, 2dh)   DiT K||V per Euler step, newest-first

    The reference packs token_att duplicated along time next to mel_att ("[c,c]"); we keep the
    two apart (no duplication). Streams advance it in the slot pool (slots.py), which keeps
    the reference's trimming ([MU7]: prompt + the newest HISTORY_FRAMES frames)."""

    token_att: torch.Tensor
    mel_att: torch.Tensor
    lookahead_cnn: torch.Tensor
    up_cnn: torch.Tensor
    est_cnn: torch.Tensor
    est_att: torch.Tensor

    @property
    def batch(self) -> int:
        return self.lookahead_cnn.shape[0]

    @property
    def est_len(self) -> int:
        """Frames in the DiT cache = the noise offset of the next chunk."""
        return self.est_att.shape[4]

    @property
    def mel_len(self) -> int:
        return self.mel_att.shape[3]

    def clone(self) -> FlowCache:
        return FlowCache(**{f.name: getattr(self, f.name).clone() for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every tensor's shape: caches with equal shapes stack into one batch (`cat`)."""
        return tuple(tuple(t.shape) for t in self.tensors())

    @staticmethod
    def cat(caches: list[FlowCache]) -> FlowCache:
        """The streams of equal-shape caches as one batch, in their order: the conformer
        caches stacked on their batch dim, the estimator's CFG-doubled rows as
        [every cond row, then every uncond row] (what `CausalCFM` splits)."""
        if len(caches) == 1:
            return caches[0]
        out = {}
        for f in fields(FlowCache):
            parts = [getattr(c, f.name) for c in caches]
            dim = _BATCH_DIM[f.name]
            if f.name.startswith("est_"):
                halves = [p.chunk(2, dim) for p in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            out[f.name] = torch.cat(parts, dim)
        return FlowCache(**out)

    def split(self, prompt_frames: int | None = None) -> list[FlowCache]:
        """`cat`'s inverse: one cache per stream, each in memory of its own (a stream's
        cache never aliases its batch-mates'); a batch of one is its own. With
        `prompt_frames`, each stream also under [MU7] Token2wav's bound after a chunk: a
        cache longer than the prompt + HISTORY_FRAMES mel frames keeps the prompt's part and
        HISTORY_FRAMES of history. The DiT cache is newest-first and the package keeps
        `[:prompt] ++ [-HISTORY_FRAMES:]` of it all the same (so: the newest `prompt` frames
        and the oldest ones); the conformer caches are oldest-first (prompt + the newest
        history), the token-rate layers at half rate. A stream's tensors are copied once,
        from the batch's straight into their kept frames."""
        b = self.batch
        p = prompt_frames
        est = p is not None and self.est_len > p + HISTORY_FRAMES
        conformer = p is not None and self.mel_len > p + HISTORY_FRAMES
        if b == 1 and not est and not conformer:
            return [self]

        def kept(name: str, t: torch.Tensor) -> tuple[int, list[tuple[int, int]]]:
            """The time dim of `name` and its kept (start, length) spans; none: all."""
            if name == "est_att" and est:
                return 4, [(0, p), (t.shape[4] - HISTORY_FRAMES, HISTORY_FRAMES)]
            if name == "token_att" and conformer:
                half_p, half_h = p // 2, HISTORY_FRAMES // 2
                return 3, [(0, half_p), (t.shape[3] - half_h, half_h)]
            if name == "mel_att" and conformer:
                return 3, [(0, p), (t.shape[3] - HISTORY_FRAMES, HISTORY_FRAMES)]
            return 0, []

        def stream(i: int) -> FlowCache:
            out = {}
            for f in fields(self):
                t, dim = getattr(self, f.name), _BATCH_DIM[f.name]
                rows = [i, b + i] if f.name.startswith("est_") else [i]  # cond, uncond
                tdim, spans = kept(f.name, t)
                shape = list(t.shape)
                shape[dim] = len(rows)
                if spans:
                    shape[tdim] = sum(n for _, n in spans)
                x = t.new_empty(shape)
                for r, row in enumerate(rows):
                    dst, src = x.narrow(dim, r, 1), t.narrow(dim, row, 1)
                    if not spans:
                        dst.copy_(src)
                        continue
                    at = 0
                    for start, n in spans:
                        dst.narrow(tdim, at, n).copy_(src.narrow(tdim, start, n))
                        at += n
                out[f.name] = x
            return FlowCache(**out)

        return [stream(i) for i in range(b)]


# FlowCache's batch dim per tensor (the est_ tensors' rows are CFG-doubled)
_BATCH_DIM = {"token_att": 1, "mel_att": 1, "lookahead_cnn": 0, "up_cnn": 0, "est_cnn": 2,
              "est_att": 2}


# ---------------------------------------------------------------------------------------
# Slot pool (slots.py): every stream's caches in fixed-capacity buffers, batches of padded rows


@dataclass
class ConformerSlots:
    """A batch's view of one rate's conformer caches (oldest-first, left-aligned, lengths
    kept by the host). Keys are [cache capacity C || chunk T]; K = C + T.

    mask : (B, 1, 1, K)  the valid cached frames and the valid chunk frames
    rel  : (B, 1, T, K)  index of each (query, key) pair's relative position in the window of
                         `_pos(K)` (the positions the reference gets from its rel-shift)
    keep : (B, 1, C, 1)  the new cache: index into [cache || chunk] of each kept frame, in order
                         (trimming included); the rest of the row is never attended"""

    mask: torch.Tensor
    rel: torch.Tensor
    keep: torch.Tensor


@dataclass
class FlowSlots:
    """Everything the host computes for one batched chunk (slots.py `plan`).

    slots     : (B,) pool row of each batch row (padding rows use a spare row)
    emb_keep  : (B, Tin, 1) 1 for embedded codes, 0 for the zero lookahead of final chunks
    la_tail   : (B, 1, 2) the lookahead conv's next context (its last two valid outputs)
    up_tail   : (B, 1, 2*stride) the upsample conv's next context
    token, mel: the two rates' conformer caches
    noise     : (B, Tm) the CFM noise frame of each mel frame (the row's DiT cache length on)
    dit       : the DiT caches"""

    slots: torch.Tensor
    emb_keep: torch.Tensor
    la_tail: torch.Tensor
    up_tail: torch.Tensor
    token: ConformerSlots
    mel: ConformerSlots
    noise: torch.Tensor
    dit: DiTSlots


@dataclass
class FlowPool:
    """Fixed-capacity caches of all slots. token (n_blocks, slots, H, Ct, 2dk), mel (n_up,
    slots, H, Cm, 2dk), lookahead (slots, C, 2), up (slots, C, 2*stride), dit (DiTPool)."""

    token: torch.Tensor
    mel: torch.Tensor
    lookahead: torch.Tensor
    up: torch.Tensor
    dit: DiTPool


# ---------------------------------------------------------------------------------------
# Encoder


def _rel_positions(size: int, d_model: int) -> torch.Tensor:
    """Espnet relative PE, (1, 2*size-1, d): positions size-1 .. -(size-1)."""
    pos = torch.arange(0, size, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model)
    )
    pos_pe = torch.zeros(size, d_model)
    neg_pe = torch.zeros(size, d_model)
    pos_pe[:, 0::2] = torch.sin(pos * div)
    pos_pe[:, 1::2] = torch.cos(pos * div)
    neg_pe[:, 0::2] = torch.sin(-1 * pos * div)
    neg_pe[:, 1::2] = torch.cos(-1 * pos * div)
    return torch.cat([torch.flip(pos_pe, [0]), neg_pe[1:]], dim=0).unsqueeze(0)


def _rel_shift(x: torch.Tensor) -> torch.Tensor:
    """(B,H,T1,2T2-1) scores against positions T2-1..-(T2-1) -> (B,H,T1,T2) against keys, for
    queries that are the last T1 of the T2 keys (Transformer-XL shift trick)."""
    b, h, t1, n = x.shape
    x = F.pad(x, (1, 0)).view(b, h, n + 1, t1)[:, :, 1:].reshape(b, h, t1, n)
    return x[..., : n // 2 + 1]


class RelPosSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.h, self.d_k = n_head, d_model // n_head
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_head, self.d_k))

    def forward(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        cache: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (B,T,C); pos_emb: (1, 2Tk-1, C); cache: (B,H,L,2dk) oldest-first; mask: (B,1,Tk)
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)  # (B,T,H,dk)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)  # (B,H,T,dk)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        if cache is not None:
            k_cache, v_cache = torch.split(cache, self.d_k, dim=-1)
            k = torch.cat([k_cache, k], dim=2)
            v = torch.cat([v_cache, v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)
        p = self.linear_pos(pos_emb).view(pos_emb.shape[0], -1, self.h, self.d_k).transpose(1, 2)
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))  # (B,H,T,Tk)
        bd = torch.matmul(
            (q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)
        )  # (B,H,T,2Tk-1)
        if ac.shape != bd.shape:
            bd = _rel_shift(bd)
        scores = (ac + bd) / math.sqrt(self.d_k)
        if mask is not None:
            pad = mask.unsqueeze(1).eq(0)  # (B,1,1,Tk)
            attn = torch.softmax(scores.masked_fill(pad, -float("inf")), dim=-1).masked_fill(
                pad, 0.0
            )
        else:
            attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out), new_cache

    def forward_slots(
        self, x: torch.Tensor, pos_emb: torch.Tensor, pool: torch.Tensor, slots, ix
    ) -> torch.Tensor:
        """Padded rows; pool (slots, H, C, 2dk) of this layer, read and then rewritten with
        the trimmed new cache; pos_emb = `_pos(C + T)`."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        k_cache, v_cache = torch.split(pool[slots], self.d_k, dim=-1)
        k = torch.cat([k_cache, k], dim=2)
        v = torch.cat([v_cache, v], dim=2)
        kv = torch.cat([k, v], dim=-1)
        pool[slots] = kv.gather(2, ix.keep.expand(-1, self.h, -1, 2 * self.d_k)).to(pool.dtype)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        bd = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        bd = bd.gather(3, ix.rel.expand(-1, self.h, -1, -1))
        scores = (ac + bd) / math.sqrt(self.d_k)
        pad = ~ix.mask
        attn = torch.softmax(scores.masked_fill(pad, -float("inf")), dim=-1).masked_fill(pad, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(d_model, hidden)
        self.w_2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-LN rel-pos MHSA + swish FFN (no conv module, no macaron); LN eps 1e-12."""

    def __init__(self, cfg: FlowEncoderConfig):
        super().__init__()
        self.self_attn = RelPosSelfAttention(cfg.output_size, cfg.attention_heads)
        self.feed_forward = FeedForward(cfg.output_size, cfg.linear_units)
        self.norm_ff = nn.LayerNorm(cfg.output_size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(cfg.output_size, eps=1e-12)

    def forward(self, x, pos_emb, cache=None, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        h, new_cache = self.self_attn(self.norm_mha(x), pos_emb, cache, mask)
        x = x + h
        return x + self.feed_forward(self.norm_ff(x)), new_cache

    def forward_slots(self, x, pos_emb, pool, slots, ix) -> torch.Tensor:
        x = x + self.self_attn.forward_slots(self.norm_mha(x), pos_emb, pool, slots, ix)
        return x + self.feed_forward(self.norm_ff(x))


class LinearEmbed(nn.Module):
    """`embed` / `up_embed`: Linear + LayerNorm(1e-5), then x sqrt(d) (the rel-PE input scale)."""

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class PreLookaheadLayer(nn.Module):
    """conv1 (k = lookahead+1) looks ahead, leaky_relu, causal conv2 (k=3), residual."""

    def __init__(self, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def forward_chunk(
        self, x: torch.Tensor, cache: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x (B, T+lookahead, C) -> (B, T, C); cache (B, C, 2): previous chunk's last conv1 outputs
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)))
        if cache is None:
            cache = h.new_zeros(h.shape[0], h.shape[1], 2)
        new_cache = h[..., -2:]
        h = self.conv2(torch.cat([cache, h], dim=2)).transpose(1, 2)
        return h + x[:, : -self.lookahead], new_cache

    def forward_slots(
        self, x: torch.Tensor, cache: torch.Tensor, tail: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T+lookahead, C) with zeros past each row's codes; tail (B, 1, 2) the
        positions of the next context among conv1's outputs."""
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)))
        new_cache = h.gather(2, tail.expand(-1, h.shape[1], -1))
        h = self.conv2(torch.cat([cache, h], dim=2)).transpose(1, 2)
        return h + x[:, : -self.lookahead], new_cache


class Upsample1D(nn.Module):
    """Nearest x stride, then Conv1d(k = 2*stride+1) with 2*stride frames of left context."""

    def __init__(self, channels: int, stride: int, scale_factor: float):
        super().__init__()
        self.stride = stride
        self.scale_factor = float(scale_factor)
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x (B,C,T) -> (B,C,stride*T); cache (B,C,2*stride) of upsampled frames (zeros offline)
        h = F.interpolate(x, scale_factor=self.scale_factor, mode="nearest")
        if cache is None:
            cache = h.new_zeros(h.shape[0], h.shape[1], self.stride * 2)
        h = torch.cat([cache, h], dim=2)
        return self.conv(h), h[..., -self.stride * 2 :]

    def forward_slots(self, x: torch.Tensor, cache: torch.Tensor, tail: torch.Tensor):
        """x (B,C,T) valid prefix per row; tail (B, 1, 2*stride) the next context's positions
        in [cache || upsampled]."""
        h = torch.cat([cache, F.interpolate(x, scale_factor=self.scale_factor, mode="nearest")], 2)
        return self.conv(h), h.gather(2, tail.expand(-1, h.shape[1], -1))


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: FlowEncoderConfig, input_size: int):
        super().__init__()
        self.cfg = cfg
        d = cfg.output_size
        self.embed = LinearEmbed(input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList([ConformerLayer(cfg) for _ in range(cfg.num_blocks)])
        self.up_layer = Upsample1D(d, cfg.up_stride, cfg.up_scale_factor)
        self.up_embed = LinearEmbed(input_size, d)
        self.up_encoders = nn.ModuleList([ConformerLayer(cfg) for _ in range(cfg.num_up_blocks)])
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        self.register_buffer("pe", _rel_positions(5000, d), persistent=False)

    def _pos(self, size: int, like: torch.Tensor) -> torch.Tensor:
        """(1, 2*size-1, d) window centred on relative position 0."""
        if 2 * size - 1 > self.pe.shape[1]:
            self.pe = _rel_positions(size, self.cfg.output_size).to(self.pe.device)
        mid = self.pe.shape[1] // 2
        return self.pe[:, mid - size + 1 : mid + size].to(like.dtype)

    def forward_chunk(
        self, xs: torch.Tensor, last_chunk: bool, cache: FlowCache | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Streaming: xs (B, T+lookahead, C) embedded codes (lookahead zero-padded when
        `last_chunk`) -> (B, stride*T, C) and the new encoder caches. Attends to cache ++ chunk
        with no mask (each chunk sees its own lookahead but nothing later)."""
        offset = 0 if cache is None else cache.token_att.shape[3]
        xs = self.embed(xs)
        if last_chunk:
            xs = F.pad(xs, (0, 0, 0, self.pre_lookahead_layer.lookahead))
        xs, la_cache = self.pre_lookahead_layer.forward_chunk(
            xs, None if cache is None else cache.lookahead_cnn
        )
        pos = self._pos(offset + xs.shape[1], xs)
        token_att = []
        for i, layer in enumerate(self.encoders):
            xs, c = layer(xs, pos, None if cache is None else cache.token_att[i])
            token_att.append(c)
        xs, up_cache = self.up_layer(xs.transpose(1, 2), None if cache is None else cache.up_cnn)
        xs = self.up_embed(xs.transpose(1, 2))
        pos = self._pos(offset * self.up_layer.stride + xs.shape[1], xs)
        mel_att = []
        for i, layer in enumerate(self.up_encoders):
            xs, c = layer(xs, pos, None if cache is None else cache.mel_att[i])
            mel_att.append(c)
        new = {
            "token_att": torch.stack(token_att),
            "mel_att": torch.stack(mel_att),
            "lookahead_cnn": la_cache,
            "up_cnn": up_cache,
        }
        return self.after_norm(xs), new

    def forward_slots(self, xs: torch.Tensor, pool: FlowPool, ix: FlowSlots) -> torch.Tensor:
        """Padded rows: xs (B, T+lookahead, C) embedded codes -> (B, stride*T, C); the caches
        are read from and written back to `pool`."""
        xs = self.embed(xs)
        xs = xs * ix.emb_keep.to(xs.dtype)  # 0 / 1: exact in any dtype
        xs, la = self.pre_lookahead_layer.forward_slots(xs, pool.lookahead[ix.slots], ix.la_tail)
        pool.lookahead[ix.slots] = la.to(pool.lookahead.dtype)  # fp32 under fp16 autocast
        pos = self._pos(pool.token.shape[3] + xs.shape[1], xs)
        for i, layer in enumerate(self.encoders):
            xs = layer.forward_slots(xs, pos, pool.token[i], ix.slots, ix.token)
        xs, up = self.up_layer.forward_slots(xs.transpose(1, 2), pool.up[ix.slots], ix.up_tail)
        pool.up[ix.slots] = up.to(pool.up.dtype)
        xs = self.up_embed(xs.transpose(1, 2))
        pos = self._pos(pool.mel.shape[3] + xs.shape[1], xs)
        for i, layer in enumerate(self.up_encoders):
            xs = layer.forward_slots(xs, pos, pool.mel[i], ix.slots, ix.mel)
        return self.after_norm(xs)


# ---------------------------------------------------------------------------------------
# Conditional flow matching


class CausalCFM(nn.Module):
    """Fixed-step Euler ODE solver over the DiT with classifier-free guidance."""

    def __init__(
        self, dit: DiTConfig, inference_cfg_rate: float, n_timesteps: int, noise_seed: int = 0
    ):
        super().__init__()
        self.estimator = DiT(dit)
        self.inference_cfg_rate = float(inference_cfg_rate)
        self.n_timesteps = int(n_timesteps)
        gen = torch.Generator().manual_seed(noise_seed)
        # Non-persistent, like the reference: the checkpoint has no noise; parity tests copy it.
        self.register_buffer(
            "rand_noise",
            torch.randn(1, dit.out_channels, NOISE_FRAMES, generator=gen),
            persistent=False,
        )
        self._schedules: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def schedule(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(t, dt), each (S,): the reference's cosine t_span and its running-sum Euler steps,
        computed with the same float ops (t += dt; dt = t_span[k+1] - t). Cached per device."""
        key = (str(device), dtype, self.n_timesteps)
        if key not in self._schedules:
            span = torch.linspace(0, 1, self.n_timesteps + 1, device=device, dtype=dtype)
            span = 1 - torch.cos(span * 0.5 * torch.pi)
            t, dt = span[0].unsqueeze(0), span[1] - span[0]
            ts, dts = [], []
            for step in range(1, self.n_timesteps + 1):
                ts.append(t.reshape(()))
                dts.append(dt.reshape(()))
                t = t + dt
                if step < self.n_timesteps:
                    dt = span[step + 1] - t
            self._schedules[key] = (torch.stack(ts), torch.stack(dts))
        return self._schedules[key]

    def time_table(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(t_emb (S, D), dt (S,)): everything step-dependent, computable before a graph capture.
        The schedule and the sinusoid are computed in mu's `dtype`, as the reference's
        `linspace(dtype=mu.dtype)`: fp32, or fp16 in the fp16 mode (the bf16 mode converts
        the estimator only, so mu stays fp32: t * 1000 in bf16 would be too coarse); the MLP
        then runs in the weights' dtype."""
        t, dt = self.schedule(device, dtype)
        return self.estimator.time_embedding(t), dt

    def _guide(self, v: torch.Tensor, b: int) -> torch.Tensor:
        r = self.inference_cfg_rate
        v_c, v_u = torch.split(v, [b, b], dim=0)
        return (1.0 + r) * v_c - r * v_u

    def forward_chunk(
        self,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        cnn_cache: torch.Tensor | None,
        att_cache: torch.Tensor | None,
        time_table: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streaming. mu/cond (B,80,T), spks (B,80), caches (S, depth, 2B, ...) or None.
        Noise offset = current DiT cache length (shared by the batch: callers batch equal shapes).
        Returns mel (B,80,T), est_cnn (S,depth,2B,2D,2), est_att (S,depth,2B,H,T+L,2dh)."""
        b, _, t = mu.shape
        offset = 0 if att_cache is None else att_cache.shape[4]
        x = self.rand_noise[:, :, offset : offset + t].to(mu.dtype).expand(b, -1, -1)
        t_emb, dt = time_table if time_table is not None else self.time_table(mu.device, mu.dtype)
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spk_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        # the steps' new DiT caches go straight into one buffer, sized at the first step:
        # no list of them stacked into a second copy at the end
        cnn_out, att_out = [], None
        for i in range(self.n_timesteps):
            v, cnn, att = self.estimator.forward_chunk(
                torch.cat([x, x]),
                mu_in,
                t_emb[i].expand(2 * b, -1),
                spk_in,
                cond_in,
                None if cnn_cache is None else cnn_cache[i],
                None if att_cache is None else att_cache[i],
                None if att_out is None else att_out[i],
            )
            if att_out is None:
                att_out = att.new_empty((self.n_timesteps, *att.shape))
                att_out[0] = att
                del att
            x = x + dt[i] * self._guide(v, b)
            cnn_out.append(cnn)
        return x, torch.stack(cnn_out), att_out

    def forward_slots(self, mu, spks, cond, pool: DiTPool, ix: FlowSlots, time_table):
        """`forward_chunk` for padded rows with the DiT caches in `pool`; each row's noise
        starts at its own DiT cache length (`ix.noise`)."""
        b = mu.shape[0]
        x = self.rand_noise[0][:, ix.noise].to(mu.dtype).transpose(0, 1)  # (B, 80, T)
        t_emb, dt = time_table
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spk_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        dit = ix.dit.at(pool)  # the pools' flat indices, once for the 10 steps
        for i in range(self.n_timesteps):
            v = self.estimator.forward_slots(
                torch.cat([x, x]), mu_in, t_emb[i].expand(2 * b, -1), spk_in, cond_in, pool, i,
                dit,
            )
            x = x + dt[i] * self._guide(v, b)
        return x


# ---------------------------------------------------------------------------------------
# Flow model


class Flow(nn.Module):
    """CausalMaskedDiffWithXvec: codes + speaker prompt -> mel."""

    def __init__(self, cfg: Code2WavConfig, noise_seed: int = 0):
        super().__init__()
        if cfg.encoder.output_size != cfg.input_size:
            raise ValueError("flow encoder output_size must equal input_size (up_embed reuses it)")
        self.cfg = cfg
        self.pre_lookahead_len = cfg.encoder.pre_lookahead_len
        self.up_rate = cfg.encoder.up_stride
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder, cfg.input_size)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalCFM(cfg.dit, cfg.inference_cfg_rate, cfg.n_timesteps, noise_seed)

    def speaker(self, spk: torch.Tensor) -> torch.Tensor:
        """x-vector (B,192) -> (B,80)."""
        # normalized in spk's dtype (fp32 from the engine), projected in the layer's (fp16
        # autocast's cast of a half flow, on CPU too)
        layer = self.spk_embed_affine_layer
        return layer(F.normalize(spk, dim=1).to(layer.weight.dtype))

    def _chunk(self, tokens, spk, cache, last_chunk, cond_mel, time_table=None):
        spk = self.speaker(spk)
        h, enc = self.encoder.forward_chunk(self.input_embedding(tokens), last_chunk, cache)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()  # (B,80,T)
        cond = torch.zeros_like(mu) if cond_mel is None else cond_mel.transpose(1, 2).contiguous()
        mel, est_cnn, est_att = self.decoder.forward_chunk(
            mu,
            spk,
            cond,
            None if cache is None else cache.est_cnn,
            None if cache is None else cache.est_att,
            time_table,
        )
        return mel, FlowCache(est_cnn=est_cnn, est_att=est_att, **enc)

    @torch.inference_mode()
    def setup_cache(
        self, tokens: torch.Tensor, prompt_mel: torch.Tensor, spk: torch.Tensor
    ) -> FlowCache:
        """Initial streaming state for a voice. tokens (B, P+lookahead) = prompt codes plus the
        lookahead codes (3 x silence 4218), prompt_mel (B, 2P, 80), spk (B,192)."""
        if (tokens.shape[1] - self.pre_lookahead_len) * self.up_rate != prompt_mel.shape[1]:
            raise ValueError(
                f"prompt tokens {tuple(tokens.shape)} do not match "
                f"prompt mel {tuple(prompt_mel.shape)}"
            )
        _, cache = self._chunk(tokens, spk, None, False, prompt_mel)
        return cache

    @torch.inference_mode()
    def forward_slots(
        self,
        tokens: torch.Tensor,
        spk: torch.Tensor,
        pool: FlowPool,
        ix: FlowSlots,
        time_table,
    ) -> torch.Tensor:
        """One chunk for a batch of padded rows whose caches live in `pool` (slots.py):
        tokens (B, T + lookahead), spk (B, 192) -> mel (B, 80, stride*T), valid prefixes."""
        h = self.encoder.forward_slots(self.input_embedding(tokens), pool, ix)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()
        return self.decoder.forward_slots(
            mu, self.speaker(spk), torch.zeros_like(mu), pool.dit, ix, time_table
        )
