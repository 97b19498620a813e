"""Qwen3 decoder of the Thinker (transformers `Qwen3ForCausalLM`, key for key).

Stages of `Qwen3LM.forward` over one flat varlen token batch of T tokens:
  input_embeds (T, H) -> 36 x [RMSNorm -> attention (QK-norm, 1-D RoPE, GQA, paged KV)
  -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> final RMSNorm -> (T, H)
`compute_logits` applies `lm_head` to the rows the caller picks (usually one per sequence).

State-dict keys equal the checkpoint's after stripping `llm.`: `model.embed_tokens`,
`model.layers.N.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm}`, `model.norm`, `lm_head`.

The model knows nothing about sequences or blocks. Attention asks the scoped forward
context (`pipeline.engine.attention.current_forward_batch()`) for the step's metadata and
KV cache. Outside a context (parity tests, one-off scoring) the whole flat batch is treated
as one causal sequence with no cache.

Two optional transforms for serving, applied from outside after the weights are loaded
and the model sits on its final device/dtype:
- `fuse_projections()`: one (q|k|v) and one (gate|up) matmul per layer. The original
  Linear weights become views into the fused tensors, so state_dict keys and
  `load_state_dict` keep working (a later `.to()` would break the sharing).
- `compile_ops()`: torch.compile the small elementwise helpers (RMSNorm, QK-norm + RoPE,
  SiLU-mul) shared by all layers; they stay capturable in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import LLMConfig
from pipeline.engine.attention import current_forward_batch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalize in fp32, cast back, then scale (HF order)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q (T, Hq, D) and k (T, Hkv, D), then RoPE with cos/sin (T, 1, D)."""
    q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # HF casts the table to the activation dtype
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@dataclass
class Ops:
    """The elementwise helpers every layer calls; one instance per model, so
    `Qwen3LM.compile_ops()` swaps in compiled versions for all layers at once."""

    rms_norm: Callable = rms_norm
    qk_norm_rope: Callable = qk_norm_rope
    silu_mul: Callable = silu_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops or Ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """1-D RoPE, rotate-half ("neox") layout, cos/sin table cached in fp32.

    Lookup by index keeps it CUDA-graph friendly (no per-step trig)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        # Not part of the checkpoint: persistent=False keeps load_state_dict(strict=True) exact.
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for positions (T,): each (T, 1, D) in fp32."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: LLMConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.ops = ops
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        # QK-norm: per-head RMSNorm over head_dim, applied before RoPE (as in HF Qwen3).
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, ops)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, ops)
        self.qkv_weight: torch.Tensor | None = None  # set by Qwen3LM.fuse_projections()

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention's inputs: q (T, Hq, D), k and v (T, Hkv, D), QK-normed and rotated."""
        T = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(T, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.ops.qk_norm_rope(
            q, k, self.q_norm.weight, self.k_norm.weight, self.eps, cos, sin
        )
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = current_forward_batch()
        if batch is None:
            return _dense_causal(q, k, v, self.scale)
        return batch.attend(self.layer_idx, q, k, v)  # writes k/v into the paged cache


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """No-cache fallback: the flat batch is one causal sequence. (T, H, D) in and out."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(0, 1)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: LLMConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by Qwen3LM.fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.ops.silu_mul(gate, up))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx, ops)
        self.mlp = Qwen3MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.post_attention(x, self.self_attn.attend(*self.pre_attention(x, cos, sin)))

    # The layer on either side of its attention (what a piecewise CUDA graph captures).
    def pre_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x: the layer's input (the residual); o: attention's output (T, Hq, D)."""
        x = x + self.self_attn.o_proj(o.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """`model.*` of the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: LLMConfig, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, ops) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class Qwen3LM(nn.Module):
    """Qwen3ForCausalLM over flat token batches.

    forward(input_embeds (T, H), positions (T,)) -> final-norm hidden (T, H)
    compute_logits(hidden (N, H)) -> (N, vocab)
    embed(ids (T,)) -> (T, H)
    """

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = Ops()
        self.model = Qwen3Model(cfg, self.ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    @property
    def num_layers(self) -> int:
        return self.cfg.num_hidden_layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = input_embeds  # (T, H)
        cos, sin = self.rotary(positions)  # (T, 1, D) each, shared by all layers
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # -- serving transforms ------------------------------------------------------------
    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Concatenate q|k|v and gate|up weights per layer; the Linear weights become views
        of the fused tensors (no extra memory; state_dict and load_state_dict unchanged)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_weight is not None:
                continue
            attn.qkv_weight = _fuse_into_views([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up_weight = _fuse_into_views([mlp.gate_proj, mlp.up_proj])

    def compile_ops(self, **compile_kwargs) -> None:
        """torch.compile the shared elementwise helpers (fewer, fused kernels per layer).
        Shapes vary with the number of tokens, so compile with dynamic shapes by default."""
        kw = {"dynamic": True, **compile_kwargs}
        self.ops.rms_norm = torch.compile(rms_norm, **kw)
        self.ops.qk_norm_rope = torch.compile(qk_norm_rope, **kw)
        self.ops.silu_mul = torch.compile(silu_mul, **kw)


def _fuse_into_views(linears: list[nn.Linear]) -> torch.Tensor:
    fused = torch.cat([lin.weight.data for lin in linears], dim=0)
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row : row + n], requires_grad=lin.weight.requires_grad)
        row += n
    return fused
