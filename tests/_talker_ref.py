"""The plain Talker forward: transformers' Llama restated over a TalkerKVCache, module by
module on the model's own Linears (q_proj, ..., up_proj), each projection its own GEMM and
RoPE from float32 tables cast per step. The reference that fused.py's forward is checked
against (bitwise on CPU; within the precision contract where Inductor or other GEMM kernels
sum in another order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.talker.model import AttentionBatch, TalkerKVCache, TalkerModel, rope_tables


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, H, D); cos/sin (B, L, D) float32, cast to x's dtype like transformers."""
    cos = cos[:, :, None, :].to(x.dtype)
    sin = sin[:, :, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def kv_views(cache: TalkerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v as (layers, slots, max_len + 1, kv_heads, head_dim) views of the cache."""
    return cache.kv[:, 0].transpose(2, 3), cache.kv[:, 1].transpose(2, 3)


def attention(attn, x, cos, sin, k_rows, v_rows, batch: AttentionBatch) -> torch.Tensor:
    """Llama self-attention: x (B, L, E); k_rows/v_rows (B, T, Hkv, D), this layer's cache
    rows of the B sequences. The new keys/values are written before attending."""
    b, length, _ = x.shape
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = apply_rope(attn.q_proj(x).view(b, length, h, d), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b, length, hkv, d), cos, sin)
    v = attn.v_proj(x).view(b, length, hkv, d)
    k_rows[batch.row_ids, batch.write_pos] = k
    v_rows[batch.row_ids, batch.write_pos] = v
    if batch.mask is None:
        keys, values, causal = k, v, True
    else:
        keys, values, causal = k_rows[:, : batch.read_len], v_rows[:, : batch.read_len], False
    q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if hkv != h:
        keys = keys.repeat_interleave(h // hkv, dim=1)
        values = values.repeat_interleave(h // hkv, dim=1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, is_causal=causal)
    return attn.o_proj(out.transpose(1, 2).reshape(b, length, h * d))


def backbone(
    talker: TalkerModel, x: torch.Tensor, positions: torch.Tensor, cache: TalkerKVCache,
    batch: AttentionBatch,
) -> torch.Tensor:
    """x (B, L, E), positions (B, L) RoPE positions. Returns final-norm hidden (B, L, E)."""
    cos, sin = rope_tables(talker.cfg.head_dim, talker.cfg.rope_theta, cache.max_len + 1,
                           x.device)
    cos, sin = cos[positions], sin[positions]
    k, v = kv_views(cache)
    for i, layer in enumerate(talker.model.layers):
        h = layer.input_layernorm(x)
        x = x + attention(layer.self_attn, h, cos, sin, k[i, batch.rows], v[i, batch.rows], batch)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return talker.model.norm(x)


class PlainTalker:
    """`prefill` / `decode` with fused.FusedTalker's signatures, computed plainly."""

    compiled = rope_kernel = False

    def __init__(self, talker: TalkerModel) -> None:
        self.model = talker

    def prefill(self, cache: TalkerKVCache, slot: int, embeds: torch.Tensor) -> torch.Tensor:
        length = embeds.shape[0]
        positions = cache.position_ids[:length][None, :]  # (1, L)
        batch = AttentionBatch(slice(slot, slot + 1), cache.row_ids[:1], positions, length, None)
        hidden = backbone(self.model, embeds[None], positions, cache, batch)
        return self.model.head(hidden[0, -1])

    def decode(
        self, cache: TalkerKVCache, codes: torch.Tensor, positions: torch.Tensor,
        active: torch.Tensor, read_len: int,
    ) -> torch.Tensor:
        r = codes.shape[0]
        x = self.model.embed_codes(codes)[:, None, :]  # (R, 1, E)
        pos = torch.where(active, positions, 0)
        write_pos = torch.where(active, positions, cache.scratch_pos)
        keys = cache.position_ids[:read_len]
        mask = (keys[None, :] <= pos[:, None])[:, None, None, :]  # (R, 1, 1, read_len)
        batch = AttentionBatch(slice(0, r), cache.row_ids[:r], write_pos[:, None], read_len, mask)
        hidden = backbone(self.model, x, pos[:, None], cache, batch)
        return self.model.head(hidden[:, 0])
