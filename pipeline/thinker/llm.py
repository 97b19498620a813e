"""Qwen3 decoder of the Thinker (transformers `Qwen3ForCausalLM`, key for key).

Stages of `Qwen3LM.forward` over one flat varlen token batch of T tokens:
  input_embeds (T, H) -> 36 x [RMSNorm -> attention (QK-norm, 1-D RoPE, GQA, paged KV)
  -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> final RMSNorm -> (T, H)
`compute_logits` applies `lm_head` to the rows the caller picks (usually one per sequence).

State-dict keys equal the checkpoint's after stripping `llm.`: `model.embed_tokens`,
`model.layers.N.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm}`, `model.norm`, `lm_head`.

The model knows nothing about sequences or blocks. Attention asks the scoped forward
context (`pipeline.thinker.llm_engine.attention.current_forward_batch()`) for the step's metadata and
KV cache. Outside a context (parity tests, one-off scoring) the whole flat batch is treated
as one causal sequence with no cache.

Two optional transforms for serving, applied from outside after the weights are loaded
and the model sits on its final device/dtype:
- `fuse_projections()`: one (q|k|v) and one (gate|up) matmul per layer. The original
  Linear weights become views into the fused tensors, so state_dict keys and
  `load_state_dict` keep working (a later `.to()` would break the sharing).
- `compile_ops()`: torch.compile the layer's two halves around attention (`layer_pre`:
  residual add, RMSNorm, q|k|v, QK-norm + RoPE; `layer_post`: o_proj, residual add, RMSNorm,
  SwiGLU MLP) and the final norm, one compiled function each shared by all layers, so the
  elementwise work between the matmuls fuses into a few kernels; they stay capturable in
  CUDA graphs.
- `fuse_qk_rope_kv()` (opt-in, CUDA): the layer stops after the q|k|v GEMM (`layer_qkv`)
  and one Triton kernel (`qk_rope_kv.py`) applies QK-norm + RoPE and writes K/V into the
  paged cache, in place of the compiled QK-norm + RoPE and `write_kv`'s two copies;
  attention then only reads the cache. The norm's sum of squares may sum in another order.

The residual stream crosses a layer boundary as (x, delta): a layer returns its MLP output
`delta` unadded and the next layer's `layer_pre` (or the final norm) adds it, so the add and
the norm that follows it are one fused kernel when compiled. Eager, every op is the one the
HF layer runs, in its order (the same bf16 roundings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import LLMConfig
from pipeline.thinker.llm_engine.attention import current_forward_batch
from pipeline.thinker import qk_rope_kv
from pipeline.utils import fuse_into_views


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


def _linear_split(
    h: torch.Tensor, weights: tuple[torch.Tensor, ...], sizes: list[int]
) -> tuple[torch.Tensor, ...]:
    """Projections of h by `weights`: one weight (the fused q|k|v or gate|up) split into
    `sizes`, or one matmul per weight."""
    if len(weights) == 1:
        return F.linear(h, weights[0]).split(sizes, dim=-1)
    return tuple(F.linear(h, w) for w in weights)


def layer_qkv(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_w: torch.Tensor,
    qkv_ws: tuple[torch.Tensor, ...],
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer up to its q|k|v projections. x (T, H): the residual stream; delta: the
    previous layer's MLP output, added here (None in the first layer). Returns (x + delta,
    q (T, Hq, D), k and v (T, Hkv, D)), views of the projections' output."""
    if delta is not None:
        x = x + delta
    h = rms_norm(x, norm_w, eps)
    t, d = x.shape[0], head_dim
    q, k, v = _linear_split(h, qkv_ws, [heads * d, kv_heads * d, kv_heads * d])
    return x, q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)


def layer_pre(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_w: torch.Tensor,
    qkv_ws: tuple[torch.Tensor, ...],
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer up to attention: `layer_qkv`, then q and k QK-normed and rotated."""
    x, q, k, v = layer_qkv(x, delta, norm_w, qkv_ws, eps, heads, kv_heads, q_norm_w.shape[0])
    q, k = qk_norm_rope(q, k, q_norm_w, k_norm_w, eps, cos, sin)
    return x, q, k, v


def layer_post(
    x: torch.Tensor,
    o: torch.Tensor,
    o_w: torch.Tensor,
    norm_w: torch.Tensor,
    gate_up_ws: tuple[torch.Tensor, ...],
    down_w: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer after attention. o (T, Hq, D): attention's output. Returns
    (x + o_proj(o), the MLP's output for the next layer to add)."""
    x = x + F.linear(o.flatten(1), o_w)
    h = rms_norm(x, norm_w, eps)
    inter = down_w.shape[1]
    gate, up = _linear_split(h, gate_up_ws, [inter, inter])
    return x, F.linear(silu_mul(gate, up), down_w)


def final_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The last layer's MLP output added, then the final RMSNorm."""
    return rms_norm(x if delta is None else x + delta, weight, eps)


@dataclass
class Ops:
    """The functions every layer calls; one instance per model, so `Qwen3LM.compile_ops()`
    swaps in compiled versions for all layers at once."""

    layer_pre: Callable = layer_pre
    layer_qkv: Callable = layer_qkv
    layer_post: Callable = layer_post
    final_norm: Callable = final_norm
    # Set by `Qwen3LM.fuse_qk_rope_kv()`: layers run `layer_qkv` instead of `layer_pre`, and
    # this (`qk_rope_kv.qk_norm_rope_kv`) QK-norms, rotates and writes K/V before attention.
    qk_rope_kv: Callable | None = None


def _compiled(fn: Callable, dynamic_args: tuple[int, ...], **compile_kwargs) -> Callable:
    """`fn` compiled once for every layer: the token dim (0) of the tensor arguments at
    `dynamic_args` is symbolic from the first call (prefills and decode batches of any size
    share a graph; one token, as Dynamo specializes size 1, gets its own). The weights'
    shapes stay static."""
    compiled = torch.compile(
        fn, fullgraph=True, options={"emulate_precision_casts": True}, **compile_kwargs
    )

    def call(*args):
        for i in dynamic_args:
            if args[i] is not None:
                torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return compiled(*args)

    return call


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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
    def __init__(self, cfg: LLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        # QK-norm: per-head RMSNorm over head_dim, applied before RoPE (as in HF Qwen3).
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None  # set by Qwen3LM.fuse_projections()

    def qkv_weights(self) -> tuple[torch.Tensor, ...]:
        if self.qkv_weight is not None:
            return (self.qkv_weight,)
        return (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)

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
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by Qwen3LM.fuse_projections()

    def gate_up_weights(self) -> tuple[torch.Tensor, ...]:
        if self.gate_up_weight is not None:
            return (self.gate_up_weight,)
        return (self.gate_proj.weight, self.up_proj.weight)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, layer_idx: int, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual, previous MLP output) -> (residual, this layer's MLP output)."""
        x, q, k, v = self.pre_attention(x, delta, cos, sin)
        return self.post_attention(x, self.attention(q, k, v, cos, sin))

    # The layer on either side of its attention (each half compiled by `compile_ops`).
    def pre_attention(
        self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x + delta, q, k, v); q and k QK-normed and rotated unless the fused kernel is on
        (`Ops.qk_rope_kv`: then `attention` does that)."""
        a = self.self_attn
        if self.ops.qk_rope_kv is not None:
            return self.ops.layer_qkv(
                x,
                delta,
                self.input_layernorm.weight,
                a.qkv_weights(),
                self.input_layernorm.eps,
                a.num_heads,
                a.num_kv_heads,
                a.head_dim,
            )
        return self.ops.layer_pre(
            x,
            delta,
            cos,
            sin,
            self.input_layernorm.weight,
            a.qkv_weights(),
            a.q_norm.weight,
            a.k_norm.weight,
            self.input_layernorm.eps,
            a.num_heads,
            a.num_kv_heads,
        )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Attention over `pre_attention`'s q, k, v -> (T, Hq, D). With the fused kernel
        (`Ops.qk_rope_kv`) they come straight from the q|k|v GEMM: one launch normalizes and
        rotates q and k and stores k and v into this layer's paged cache at the step's rows,
        and the backend attends over the cache without writing it again."""
        a = self.self_attn
        fused = self.ops.qk_rope_kv
        if fused is None:
            return a.attend(q, k, v)
        batch = current_forward_batch()
        if batch is None:  # no cache to write into: the plain ops
            q, k = qk_norm_rope(q, k, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, cos, sin)
            return a.attend(q, k, v)
        kv, rows = batch.kv_layers[a.layer_idx], batch.rows
        q = fused(q, k, v, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, cos, sin, kv, rows)
        return batch.attend(a.layer_idx, q, None, None)  # k/v None: already in the cache

    def post_attention(
        self, x: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual after pre_attention; o: attention's output (T, Hq, D)."""
        return self.ops.layer_post(
            x,
            o,
            self.self_attn.o_proj.weight,
            self.post_attention_layernorm.weight,
            self.mlp.gate_up_weights(),
            self.mlp.down_proj.weight,
            self.post_attention_layernorm.eps,
        )


class Qwen3Model(nn.Module):
    """`model.*` of the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: LLMConfig, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, ops) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


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

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, delta = input_embeds, None  # (T, H)
        cos, sin = self.rotary(positions)  # (T, 1, D) each, shared by all layers
        for layer in self.model.layers:
            x, delta = layer(x, delta, cos, sin)
        return self.final_norm(x, delta)

    def final_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        norm = self.model.norm
        return self.ops.final_norm(x, delta, norm.weight, norm.eps)

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
            attn.qkv_weight = fuse_into_views([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up_weight = fuse_into_views([mlp.gate_proj, mlp.up_proj])

    def compile_ops(self, **compile_kwargs) -> None:
        """torch.compile each layer's halves around attention and the final norm, shared by
        all layers (fewer, fused kernels). The matmuls stay the eager ones (cuBLAS); the
        elementwise work and the norms' reductions fuse, keeping eager's bf16 roundings
        (emulate_precision_casts) but summing in Inductor's order."""
        self.ops.layer_pre = _compiled(layer_pre, (0, 1, 2, 3), **compile_kwargs)
        # compiled at its first call: only layers under fuse_qk_rope_kv call it
        self.ops.layer_qkv = _compiled(layer_qkv, (0, 1), **compile_kwargs)
        self.ops.layer_post = _compiled(layer_post, (0, 1), **compile_kwargs)
        self.ops.final_norm = _compiled(final_norm, (0, 1), **compile_kwargs)

    def fuse_qk_rope_kv(self, on: bool = True) -> bool:
        """Each layer's QK-norm + RoPE and its K/V cache write as one Triton kernel
        (`qk_rope_kv.qk_norm_rope_kv`) where it runs: bf16 or fp32 weights on a device the
        kernel supports (CUDA). Independent of `compile_ops` (either order). Returns whether
        it is on."""
        weight = self.model.embed_tokens.weight
        on = on and weight.dtype in qk_rope_kv.DTYPES and qk_rope_kv.available(weight.device)
        self.ops.qk_rope_kv = qk_rope_kv.qk_norm_rope_kv if on else None
        return on
