"""One duplex session's Thinker KV cache: every layer's K/V in one block of the paged
layout (`llm_engine.attention`: (1, 2, capacity, Hkv, D)), so the LLM runs on it through
the usual forward context, and the sliding window can drop a span and re-rotate what
follows it in place."""

from __future__ import annotations

import torch

from pipeline.thinker.llm import Qwen3LM
from pipeline.thinker.llm_engine.attention import (
    AttnMetadata,
    ForwardBatch,
    TorchAttention,
    forward_batch,
)

GROW = 512  # capacity is grown in steps of this many tokens


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_cos_sin(head_dim: int, positions: torch.Tensor, theta: float, dtype: torch.dtype):
    """cos, sin (len, 1, D) for `positions`, computed as the reference's sliding window
    computes them (fp32 angles from the positions, then cast)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    angles = torch.einsum("i,j->ij", positions.to(torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    return cos[:, None, :], sin[:, None, :]


class SessionKV:
    def __init__(self, llm: Qwen3LM):
        cfg = llm.cfg
        self.llm = llm
        self.layers = cfg.num_hidden_layers
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.theta = float(cfg.rope_theta)
        self.max_len = cfg.max_position_embeddings
        w = llm.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        self.kv: list[torch.Tensor] = []
        self.capacity = 0
        self.length = 0
        self.backend = TorchAttention()
        self.scale = cfg.head_dim**-0.5

    def ensure(self, total: int) -> None:
        """Room for `total` tokens (ValueError past the model's context)."""
        if total > self.max_len:
            raise ValueError(
                f"the session's context would reach {total} tokens, over the model's "
                f"{self.max_len}; use sliding_window_mode 'basic'"
            )
        if total <= self.capacity:
            return
        cap = min(self.max_len, ((total + GROW - 1) // GROW) * GROW)
        new = [torch.zeros(1, 2, cap, self.kv_heads, self.head_dim, device=self.device,
                           dtype=self.dtype) for _ in range(self.layers)]
        for old, fresh in zip(self.kv, new):
            fresh[:, :, : self.length] = old[:, :, : self.length]
        self.kv, self.capacity = new, cap

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """Append `embeds` (T, H) at the next positions; returns their final-norm hidden
        rows (T, H)."""
        t = embeds.shape[0]
        start = self.length
        self.ensure(start + t)
        positions = torch.arange(start, start + t, device=self.device)
        meta = self.metadata(t)
        with forward_batch(ForwardBatch(self.backend, meta, self.kv, self.scale)):
            hidden = self.llm(embeds.to(self.dtype), positions)
        self.length = start + t
        return hidden

    def metadata(self, t: int) -> AttnMetadata:
        """The attention layout of appending `t` rows at `length` (capacity ensured): the
        session's one block, its rows at their positions. A batch of sessions
        (pipeline.duplex.batch) attends each session through this same layout."""
        start = self.length
        return AttnMetadata(
            qo_indptr=torch.tensor([0, t], dtype=torch.int32),
            kv_lens=torch.tensor([start + t], dtype=torch.int32),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            block_tables_cpu=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.arange(start, start + t, device=self.device),
            is_decode=t == 1,
            block_size=self.capacity,
        )

    @torch.inference_mode()
    def drop(self, start: int, length: int) -> None:
        """Remove tokens [start, start + length) and move the rest down, their keys
        re-rotated from their old positions to the new ones (the reference's
        `drop_tokens_from_cache` + `realign_rotary_suffix`)."""
        end, total = start + length, self.length
        rest = total - end
        if rest > 0:
            old = torch.arange(end, total, device=self.device)
            new = torch.arange(start, start + rest, device=self.device)
            cos_o, sin_o = rope_cos_sin(self.head_dim, old, self.theta, self.dtype)
            cos_n, sin_n = rope_cos_sin(self.head_dim, new, self.theta, self.dtype)
            for kv in self.kv:
                k = kv[0, 0, end:total].clone()
                v = kv[0, 1, end:total].clone()
                base = cos_o * k - sin_o * _rotate_half(k)
                kv[0, 0, start : start + rest] = cos_n * base + sin_n * _rotate_half(base)
                kv[0, 1, start : start + rest] = v
        self.length = total - length

    @torch.inference_mode()
    def rebuild(self, prefix_end: int, embeds: torch.Tensor | None, keep: int) -> None:
        """Keep tokens [0, prefix_end) and the last `keep`; recompute `embeds` after the
        prefix (their K/V attend to the prefix only), then move the kept tail right after
        them, its keys re-rotated (the reference's `_rebuild_cache_with_previous`)."""
        total = self.length
        old_start = total - keep
        tail = [(kv[0, 0, old_start:total].clone(), kv[0, 1, old_start:total].clone())
                for kv in self.kv] if keep > 0 else []
        self.length = prefix_end
        if embeds is not None and embeds.shape[0] > 0:
            self.forward(embeds)
        if keep <= 0:
            return
        new_start = self.length
        self.ensure(new_start + keep)
        if old_start != new_start:
            old = torch.arange(old_start, old_start + keep, device=self.device)
            new = torch.arange(new_start, new_start + keep, device=self.device)
            cos_o, sin_o = rope_cos_sin(self.head_dim, old, self.theta, self.dtype)
            cos_n, sin_n = rope_cos_sin(self.head_dim, new, self.theta, self.dtype)
        for kv, (k, v) in zip(self.kv, tail):
            if old_start != new_start:
                base = cos_o * k - sin_o * _rotate_half(k)
                k = cos_n * base + sin_n * _rotate_half(base)
            kv[0, 0, new_start : new_start + keep] = k
            kv[0, 1, new_start : new_start + keep] = v
        self.length = new_start + keep
