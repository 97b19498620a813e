"""Perceiver resampler (`resampler.*`): SigLIP patch features -> 64 LLM tokens per slice.

Stages of `Resampler.forward` (D = LLM hidden, Q = query_num, L = patches):
1. kv = ln_kv(kv_proj(x))                     (B, L, kv_dim) -> (B, L, D)
2. q  = ln_q(query)                           (Q, D), shared by the batch
3. one cross-attention, nn.MultiheadAttention semantics (D // 128 heads):
   keys = kv + pos, values = kv, padded patches masked -> (B, Q, D)
4. ln_post, then `@ proj` (a right-multiplied (D, D) matrix, no bias).

`pos` is a fixed 2-D sin-cos table over the (h, w) patch grid. Layout (the reference's
meshgrid(w, h)): channels [0, D/2) encode the column index w, channels [D/2, D) the row
index h; each half is [sin(p * omega), cos(p * omega)] with omega_i = 10000^(-i / (D/4)).
Entry (i, j) does not depend on the table's size, so a slice's (h, w) table is any larger
table's top-left corner. The module keeps the reference's 70 x 70 table as a buffer; a
slice taller or wider than that gets its own h x w table for that call only (the reference
instead grows its cache to the largest slice ever seen, which a few extreme aspect ratios
turn into gigabytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import ThinkerConfig
from pipeline.sdpa import any_shape
from pipeline.thinker.vision import load_stripped


def sincos_pos_embed_2d(
    dim: int, h: int, w: int, device: torch.device | None = None
) -> torch.Tensor:
    """(h, w, dim) float32 table; pos[i, j] = [emb(j), emb(i)], emb(p) = [sin(p*om), cos(p*om)].

    Computed in float32 like the reference (numpy float32), so values agree to an ulp.
    `device` None = the current default device (what module construction uses)."""
    assert dim % 4 == 0, "sin-cos 2-D embedding needs dim divisible by 4"
    quarter = dim // 4
    omega = 1.0 / 10000 ** (
        torch.arange(quarter, dtype=torch.float32, device=device) / float(quarter)
    )  # (D/4,)

    def emb(pos: torch.Tensor) -> torch.Tensor:  # (h, w) -> (h, w, D/2)
        out = pos[..., None] * omega
        return torch.cat([out.sin(), out.cos()], dim=-1)

    rows = torch.arange(h, dtype=torch.float32, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, dtype=torch.float32, device=device)[None, :].expand(h, w)
    return torch.cat([emb(cols), emb(rows)], dim=-1)


class ResamplerAttention(nn.Module):
    """nn.MultiheadAttention's parameters and math (packed in_proj, out_proj), batch-first
    and query/key/value from different sources. Keys: in_proj_weight (3D, D),
    in_proj_bias (3D,), out_proj.{weight,bias}."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # query (B, Q, D); key, value (B, L, D); key_padding_mask (B, L) bool, True = ignore
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3)
        b, nq, d = query.shape
        nk = key.shape[1]
        q = F.linear(query, wq, bq).view(b, nq, self.num_heads, self.head_dim).transpose(1, 2)
        k = F.linear(key, wk, bk).view(b, nk, self.num_heads, self.head_dim).transpose(1, 2)
        v = F.linear(value, wv, bv).view(b, nk, self.num_heads, self.head_dim).transpose(1, 2)
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, L), True = attend
        with any_shape():  # B and L change with the batch
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, Q, hd)
        return self.out_proj(o.transpose(1, 2).reshape(b, nq, d))


class Resampler(nn.Module):
    def __init__(
        self, num_queries: int, embed_dim: int, kv_dim: int, max_size: tuple[int, int] = (70, 70)
    ):
        super().__init__()
        if embed_dim < 128:
            raise ValueError(
                f"resampler uses embed_dim // 128 heads; embed_dim={embed_dim} gives none"
            )
        self.embed_dim = embed_dim
        self.num_heads = embed_dim // 128
        self.query = nn.Parameter(torch.zeros(num_queries, embed_dim))
        # the reference drops kv_proj when the widths already match
        self.kv_proj = (
            nn.Linear(kv_dim, embed_dim, bias=False) if kv_dim != embed_dim else nn.Identity()
        )
        self.attn = ResamplerAttention(embed_dim, self.num_heads)
        self.ln_q = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_kv = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_post = nn.LayerNorm(embed_dim, eps=1e-6)
        self.proj = nn.Parameter(embed_dim**-0.5 * torch.randn(embed_dim, embed_dim))
        self.max_size = tuple(max_size)
        self.register_buffer(
            "pos_embed", sincos_pos_embed_2d(embed_dim, *self.max_size), persistent=False
        )

    @classmethod
    def from_config(cls, cfg: ThinkerConfig) -> Resampler:
        return cls(cfg.query_num, cfg.llm.hidden_size, cfg.vision.hidden_size)

    def pos_table(self, h: int, w: int) -> torch.Tensor:
        """(h, w, D) float32 positions of an h x w patch grid, on the buffer's device.

        Within max_size: a view of the buffer. Beyond it: a table of exactly h x w, built
        for this call and not kept, so memory follows the current slice and not the
        largest one ever seen. It is computed on the CPU in float32 like the reference's
        grown cache, and sin/cos are elementwise, so its values are bit-identical to the
        same corner of any larger table."""
        max_h, max_w = self.pos_embed.shape[:2]
        if h <= max_h and w <= max_w:
            return self.pos_embed[:h, :w]
        table = sincos_pos_embed_2d(self.embed_dim, h, w, device=torch.device("cpu"))
        return table.to(self.pos_embed.device)

    def pos_for(
        self, sizes: list[tuple[int, int]], seq_len: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """(B, seq_len, D) positions of each strip's patches, zero on the padded tail."""
        out = self.pos_embed.new_zeros(len(sizes), seq_len, self.embed_dim, dtype=dtype)
        tables: dict[tuple[int, int], torch.Tensor] = {}  # one build per size in the batch
        for i, (h, w) in enumerate(sizes):
            if (h, w) not in tables:
                tables[h, w] = self.pos_table(h, w)
            out[i, : h * w] = tables[h, w].reshape(h * w, -1)
        return out

    def forward(
        self, x: torch.Tensor, tgt_sizes: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """x (B, L, kv_dim) vision features, tgt_sizes (B, 2) -> (B, Q, D)."""
        return self.run(x, self.plan(tgt_sizes, x.shape[1], x.dtype))

    def plan(
        self, tgt_sizes: torch.Tensor | Sequence[Sequence[int]], seq_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The host's part of a batch, on the device: positions (B, L, D) and the key padding
        (B, L), True on padded patches."""
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(tgt_sizes).reshape(-1, 2).tolist()]
        lens = torch.tensor([h * w for h, w in sizes])
        key_padding = (torch.arange(seq_len)[None, :] >= lens[:, None]).to(
            self.pos_embed.device, non_blocking=True
        )
        return self.pos_for(sizes, seq_len, dtype), key_padding

    def run(self, x: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The device work of `forward` for a batch planned by `plan`: no host syncs."""
        pos, key_padding = plan
        b = x.shape[0]
        kv = self.ln_kv(self.kv_proj(x))  # (B, L, D)
        q = self.ln_q(self.query).unsqueeze(0).expand(b, -1, -1)  # (B, Q, D)
        out = self.attn(q, kv + pos, kv, key_padding)  # (B, Q, D)
        return self.ln_post(out) @ self.proj


def build_resampler(
    cfg: ThinkerConfig,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    prefix: str = "resampler.",
) -> Resampler:
    """Build from config; if `state_dict` is given, strict-load the keys under `prefix`."""
    r = Resampler.from_config(cfg)
    if state_dict is not None:
        load_stripped(r, state_dict, prefix)
    return r
