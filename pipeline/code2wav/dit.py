"""DiT estimator of the Code2Wav flow-matching decoder (Step-Audio2 / CosyVoice2 "DiT-v5").

Predicts the CFM velocity v(x_t, t | mu, spk, cond) for 80-bin mel frames.

Stages (per call, B = 2 x streams because of CFG):
  1. input   : concat[x (B,80,T), mu (B,80,T), spk (B,80)->(B,80,T), cond (B,80,T)] -> (B,320,T)
               -> in_proj -> (B,T,D)
  2. time    : t_emb (B,D) from `time_embedding(t)` (t*1000 -> 256-d [cos, sin] -> MLP); callers
               precompute it once per Euler step (graph-safe, no per-step allocation of tables)
  3. blocks  : depth x DiTBlock, adaLN-Zero with 9 modulations, order attn -> conv -> mlp
               (norm1 / norm3 / norm2), attention bidirectional with QK-LayerNorm and no position
               encoding; the conv branch is CausalConv1d -> LN -> Mish -> CausalConv1d
  4. final   : adaLN(shift, scale) -> LN -> Linear(D -> 80) -> (B,80,T)

Streaming (`forward_chunk`, which builds a voice's template; every later chunk runs
`forward_slots` with the caches in the slot pool, slots.py): each block attends to
[chunk || cache] (the cache is stored newest-first: new keys are concatenated *before* the old
ones), no mask; the causal convs carry their last 2 input frames. Caches:
  cnn_cache (depth, B, 2D, 2)   = per block [conv1 input tail (D) || conv2 input tail (D)]
  att_cache (depth, B, H, L, 2*dh) = per block K || V along the last dim

`compile_dit_blocks(dit)` applies regional torch.compile from outside (one compiled block
forward shared by all blocks); see its docstring for the dynamic-shape policy.
`dit.prepare_slot_path()` shapes the slot path's matmuls for small batches (`linear_split_k`)
and picks its Triton kernels where the device runs them (pool_attention.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.code2wav import pool_attention
from pipeline.config import DiTConfig
from pipeline.utils import fuse_into_views

# The slot path's matmuls have 112 rows a chunk (2 CFG rows x 56 frames). cuBLAS's fp32 (SIMT)
# kernels tile such an output in a handful of blocks, so most SMs idle. Products over K = 1536
# / 2048 (the conv branch's windows, fc2) run as SPLIT_K products over slices of K, summed, up
# to two chunks' rows (beyond, the partial sums' traffic costs more than the split saves).
SPLIT_K = 8
SPLIT_MIN_K = 1536
SPLIT_MAX_ROWS = 224


def linear_split_k(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int
) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T + bias as `splits` products over slices of K in one batched
    call, then summed: every output the same dot product with its sum in another order. Views
    of x and weight, no copies. Plain `F.linear` when `splits` is 1, does not divide K, K is
    below SPLIT_MIN_K or the rows are more than SPLIT_MAX_ROWS (under torch.compile the row
    test is a guard: one graph for each side of it)."""
    k = x.shape[-1]
    if splits == 1 or k % splits or k < SPLIT_MIN_K or x.numel() > SPLIT_MAX_ROWS * k:
        return F.linear(x, weight, bias)
    return split_k(x, weight, bias, splits)


def split_k(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int
) -> torch.Tensor:
    """`linear_split_k`'s product at any shape (`splits` must divide K): no size rules."""
    k, n = x.shape[-1], weight.shape[0]
    xs = x.reshape(-1, splits, k // splits).transpose(0, 1)  # (S, M, K/S)
    ws = weight.view(n, splits, k // splits).permute(1, 2, 0)  # (S, K/S, N)
    y = torch.bmm(xs, ws).sum(0)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def _mark_dynamic_dims(x, c, cnn=None, att=None, mask=None) -> None:
    """The dims that vary between calls of a block, for a compiled block (compile_dit_blocks);
    no-ops in eager: rows B, chunk frames T, cache frames L, each its own symbol."""
    for t, dims in ((x, (0, 1)), (c, (0,)), (cnn, (0,)), (att, (0, 2)), (mask, (0, 3))):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, dims)


@dataclass
class DiTSlots:
    """Where a batch's DiT caches live in the slot pool (slots.py builds it, one per chunk).

    The pool holds, per Euler step and block, K and V as (2, slots, capacity, H, dh): CFG
    half, slot, frame position. Attention has no positions, so frames may sit anywhere; the
    host decides where each new frame goes (`write`) and which positions a row attends
    (`mask`). Rows are [cond_0..cond_{B-1}, uncond_0..uncond_{B-1}], the reference's order.

    cfg, rows : (2B, 1)  CFG half and slot of each estimator row
    write     : (2B, T)  position each new frame is written to (kept frames to free positions,
                         dropped and padded ones to a per-batch scratch range)
    mask      : (2B, 1, 1, W)  positions each row attends (its cached frames and its new ones)
    window    : W, positions [0, W) hold everything the batch attends (static per graph)
    conv_tail : (2B, 1, 2)  index into [cached tail || frames] of the last two valid frames
    kv_at     : (2B T,)  `at(pool)`: each new frame's row in a block's K / V pool seen as
                         (2 slots C, H, dh), i.e. (cfg, rows, write) as one index
    cnn_at    : (2B,)    `at(pool)`: each row's conv tails in the cnn pool as (2 slots, 2D, 2)"""

    cfg: torch.Tensor
    rows: torch.Tensor
    write: torch.Tensor
    mask: torch.Tensor
    window: int
    conv_tail: torch.Tensor
    kv_at: torch.Tensor | None = None
    cnn_at: torch.Tensor | None = None

    def at(self, pool: DiTPool) -> DiTSlots:
        """These slots with the flat pool indices filled in (once per chunk, for every Euler
        step and block): one index per pool read or write instead of three, which the
        indexing kernels would first broadcast to the frames' shape (two copies each)."""
        if self.kv_at is not None:
            return self
        slots, capacity = pool.k.shape[-4:-2]  # (..., 2, slots, C, H, dh)
        row = self.cfg * slots + self.rows  # (2B, 1)
        return replace(self, kv_at=(row * capacity + self.write).reshape(-1),
                       cnn_at=row.reshape(-1))


@dataclass
class DiTPool:
    """Per-step, per-block cache storage of all slots: k, v (S, depth, 2, slots, C, H, dh) and
    the causal-conv tails cnn (S, depth, 2, slots, 2D, 2)."""

    k: torch.Tensor
    v: torch.Tensor
    cnn: torch.Tensor


class TimestepEmbedder(nn.Module):
    """t (N,) in [0,1] -> (N, D): sinusoid of t*1000 laid out [cos, sin], then the MLP."""

    def __init__(self, hidden_size: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(
            nn.Linear(freq_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(0, half) / half).to(t)
        args = (t * 1000)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class CausalConv1d(nn.Conv1d):
    """Conv1d with (k-1) frames of left context: zeros offline, the cached tail when streaming."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__(channels, channels, kernel_size)
        self.context = kernel_size - 1

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (B, C, T); cache: (B, C, k-1)
        if cache is None:
            cache = x.new_zeros(x.shape[0], x.shape[1], self.context)
        x = torch.cat([cache, x], dim=2)
        return super().forward(x), x[..., -self.context :]


class ConvBranch(nn.Module):
    """CausalConv1d -> LayerNorm -> Mish -> CausalConv1d over (B, T, D).

    The checkpoint stores it as `block.{1,3,6}` (the reference's Sequential had transposes at the
    other indices), hence the ModuleDict with those names."""

    def __init__(self, channels: int, kernel_size: int = 3):
        super().__init__()
        self.channels = channels
        self.block = nn.ModuleDict(
            {
                "1": CausalConv1d(channels, kernel_size),
                "3": nn.LayerNorm(channels),
                "6": CausalConv1d(channels, kernel_size),
            }
        )

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (B, T, D); cache: (B, 2D, 2) = [conv1 tail || conv2 tail]
        c1, c2 = (
            (None, None) if cache is None else cache.split((self.channels, self.channels), dim=1)
        )
        h, new1 = self.block["1"](x.transpose(1, 2), c1)
        h = F.mish(self.block["3"](h.transpose(1, 2)))
        h, new2 = self.block["6"](h.transpose(1, 2), c2)
        return h.transpose(1, 2), torch.cat([new1, new2], dim=1)

    def forward_slots(
        self, x: torch.Tensor, cache: torch.Tensor, tail: torch.Tensor, splits: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded rows: x (B, T, D) whose valid frames are a prefix of each row; cache
        (B, 2D, 2); tail (B, 1, 2) the last two valid frames' index into [cache || frames].
        The convs are causal, so padded frames change no valid one. `splits`: see
        `linear_split_k`."""
        c1, c2 = cache.split((self.channels, self.channels), dim=1)

        def conv(layer, h, c):
            # As one matmul over the unfolded windows: fp32 cuDNN convs of this size are
            # ~10x slower than the GEMM; only the order of the sums changes.
            h = torch.cat([c, h], dim=2)
            win = h.unfold(2, layer.kernel_size[0], 1)  # (B, C, T, k)
            b, ch, t, k = win.shape
            out = linear_split_k(win.permute(0, 2, 1, 3).reshape(b * t, ch * k),
                                 layer.weight.reshape(layer.out_channels, ch * k), layer.bias,
                                 splits)
            return out.view(b, t, -1).transpose(1, 2), h.gather(2, tail.expand(-1, ch, -1))

        h, new1 = conv(self.block["1"], x.transpose(1, 2), c1)
        h = F.mish(self.block["3"](h.transpose(1, 2)))
        h, new2 = conv(self.block["6"], h.transpose(1, 2), c2)
        return h.transpose(1, 2), torch.cat([new1, new2], dim=1)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, dim)
        self.qkv_weight: torch.Tensor | None = None  # joined q|k|v (join_qkv), slot path only
        self.qkv_bias: torch.Tensor | None = None
        self.pool_kernel = False  # attend_slots through pool_attention (DiT.prepare_slot_path)
        self.kv_kernel = False  # attend_slots writes K / V by write_kv (DiT.prepare_slot_path)

    def join_qkv(self) -> None:
        """q|k|v weights and biases as views of one joined tensor each, for `qkv`: one 1536-wide
        product instead of three (the same dot products, which cuBLAS may sum in another order).
        Join after any dtype change or load that replaces the parameters."""
        linears = [self.to_q, self.to_k, self.to_v]
        self.qkv_weight = fuse_into_views(linears, "weight")
        self.qkv_bias = fuse_into_views(linears, "bias")

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, dh)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (B, T, D); cache: (B, H, L, 2dh) newest-first; mask: (B, 1, 1|T, T+L) bool or None
        b, t, _ = x.shape
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if cache is not None:
            k_cache, v_cache = cache.chunk(2, dim=3)
            k = torch.cat([k, k_cache], dim=2)  # new frames first: the reference's cache order
            v = torch.cat([v, v_cache], dim=2)
        new_cache = torch.cat([k, v], dim=3)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, dh)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1)), new_cache

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> q (B, H, T, dh) normed; k (B, T, H, dh) normed; v (B, T, H, dh)."""
        b, t, _ = x.shape
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).chunk(3, dim=-1)
        else:
            q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q = self.q_norm(self._heads(q))
        k = self.k_norm(k.reshape(b, t, self.num_heads, self.head_dim))
        return q, k, v.reshape(b, t, self.num_heads, self.head_dim)

    def attend_slots(self, q, k, v, k_pool: torch.Tensor, v_pool: torch.Tensor, ix: DiTSlots):
        """k_pool / v_pool (2, slots, C, H, dh) of this step and block. Writes the new frames'
        K/V into the pool first, then attends over the pool window: the same keys as
        [new || cache], in another order (attention without positions ignores it).
        Returns (B, T, H*dh), before the output projection."""
        b, _, t, dh = q.shape
        # the pool's dtype: under fp16 autocast k (after its LayerNorm) is fp32, as [MU7]
        # rounds it into its fp16 cache
        k, v = k.to(k_pool.dtype), v.to(v_pool.dtype)
        if self.kv_kernel:  # both in one launch
            pool_attention.write_kv(k, v, k_pool, v_pool, ix.kv_at)
        else:
            k_pool.view(-1, self.num_heads, dh).index_put_((ix.kv_at,), k.flatten(0, 1))
            v_pool.view(-1, self.num_heads, dh).index_put_((ix.kv_at,), v.flatten(0, 1))
        if self.pool_kernel and b <= pool_attention.MAX_ROWS:  # read in place, no gathered copies
            return pool_attention.pool_attention(q, k_pool, v_pool, ix.cfg, ix.rows, ix.mask,
                                                 ix.window)
        slots, w = ix.rows[: b // 2, 0], ix.window
        keys = k_pool[:, slots, :w].reshape(b, w, self.num_heads, dh).transpose(1, 2)
        vals = v_pool[:, slots, :w].reshape(b, w, self.num_heads, dh).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=ix.mask)
        return out.transpose(1, 2).reshape(b, t, -1)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.hidden_size
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(d, cfg.num_heads, cfg.head_dim)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(d, int(d * cfg.mlp_ratio))
        self.norm3 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.conv = ConvBranch(d, 3)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 9 * d))
        self.split_k = 1  # the slot path's large-K products (DiT.prepare_slot_path)

    def forward(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        cnn_cache: torch.Tensor | None = None,
        att_cache: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: (B, T, D); c: (B, 1, D)
        (
            shift_msa,
            scale_msa,
            gate_msa,
            shift_mlp,
            scale_mlp,
            gate_mlp,
            shift_conv,
            scale_conv,
            gate_conv,
        ) = self.adaLN_modulation(c).chunk(9, dim=-1)
        h, new_att = self.attn(_modulate(self.norm1(x), shift_msa, scale_msa), att_cache, mask)
        x = x + gate_msa * h
        h, new_cnn = self.conv(_modulate(self.norm3(x), shift_conv, scale_conv), cnn_cache)
        x = x + gate_conv * h
        x = x + gate_mlp * self.mlp(_modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x, new_cnn, new_att

    # The slot-pool path in three parts, so that the two without pool reads or writes can be
    # compiled (compile_slot_blocks) and the pool stays in eager ops, updated in place.
    def slot_pre(self, x: torch.Tensor, c: torch.Tensor):
        """The 9 modulations and the attention's q, k, v. c (B, 1, D): the step's time
        embedding per row."""
        mod = self.adaLN_modulation(c).chunk(9, dim=-1)
        return (*self.attn.qkv(_modulate(self.norm1(x), mod[0], mod[1])), *mod)

    def slot_post(self, x, attn_out, mod, cnn_pool, tail, cnn_at):
        """Everything after attention; returns x and the conv branch's new tails. The rows'
        conv tails are gathered here from `cnn_pool` (2 slots, 2D, 2) at `cnn_at`: compiled,
        the gather becomes a load of the kernel that builds the first conv's windows instead
        of a launch of its own."""
        cnn_cache = cnn_pool.index_select(0, cnn_at)
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_conv, scale_conv, gate_conv = mod
        x = x + gate_msa * self.attn.proj(attn_out)
        h, new_cnn = self.conv.forward_slots(
            _modulate(self.norm3(x), shift_conv, scale_conv), cnn_cache, tail, self.split_k
        )
        x = x + gate_conv * h
        mlp = self.mlp
        h = F.gelu(mlp.fc1(_modulate(self.norm2(x), shift_mlp, scale_mlp)), approximate="tanh")
        return x + gate_mlp * linear_split_k(h, mlp.fc2.weight, mlp.fc2.bias, self.split_k), new_cnn

    def forward_slots(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        cnn_pool: torch.Tensor,
        ix: DiTSlots,
    ) -> torch.Tensor:
        """`forward` on padded rows with the caches in the slot pool (read and written in
        place). cnn_pool (2, slots, 2D, 2) of this step and block."""
        cnn_pool = cnn_pool.flatten(0, 1)  # (2 slots, 2D, 2)
        q, k, v, *mod = self._slot_pre(x, c)
        out = self.attn.attend_slots(q, k, v, k_pool, v_pool, ix)
        x, new_cnn = self._slot_post(x, out, mod, cnn_pool, ix.conv_tail, ix.cnn_at)
        cnn_pool.index_put_((ix.cnn_at,), new_cnn.to(cnn_pool.dtype))
        return x

    def _slot_pre(self, x, c):  # replaced by a compiled one in compile_slot_blocks
        return self.slot_pre(x, c)

    def _slot_post(self, x, attn_out, mod, cnn_pool, tail, cnn_at):
        return self.slot_post(x, attn_out, mod, cnn_pool, tail, cnn_at)


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.out_channels = cfg.out_channels
        self.t_embedder = TimestepEmbedder(cfg.hidden_size)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)

    def prepare_slot_path(self) -> None:
        """The slot path's matmuls shaped for small batches: q|k|v joined, and in fp32 the
        large-K products split over K (SPLIT_K; bf16 partial sums would round each part, so
        a bf16 estimator keeps them whole); and where the device runs pool_attention.py's
        kernels (CUDA), the new keys and values written by `write_kv` (one launch instead
        of two `index_put_`, the same copies) and, for an fp32 estimator (a bf16 one has
        fast flash SDPA), the attention read in place from the pool. Call it after any
        dtype change or load that replaces the parameters. `forward_chunk` (the voice
        templates) is unchanged."""
        weight = self.in_proj.weight
        fp32 = weight.dtype == torch.float32
        kernels = pool_attention.available(weight.device)
        for block in self.blocks:
            block.attn.join_qkv()
            block.split_k = SPLIT_K if fp32 else 1
            block.attn.kv_kernel = kernels
            block.attn.pool_kernel = kernels and fp32

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """t (N,) -> (N, D). Constant per Euler step, so the CFM computes it once per schedule."""
        return self.t_embedder(t)

    def _inputs(self, x, mu, spks, cond) -> torch.Tensor:
        # (B,80,T) x3 + (B,80) -> (B, T, 320), in the weights' dtype: a bf16 estimator
        # (token2wav_precision bf16) takes the fp32 flow's inputs and returns v in fp32.
        spk = spks[:, :, None].expand(-1, -1, x.shape[-1])
        return torch.cat([x, mu, spk, cond], dim=1).transpose(1, 2).to(self.in_proj.weight.dtype)

    def forward_chunk(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t_emb: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        cnn_cache: torch.Tensor | None = None,
        att_cache: torch.Tensor | None = None,
        att_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streaming: returns v (B,80,T), new cnn_cache (depth,B,2D,2), new att_cache
        (depth,B,H,T+L,2dh) with this chunk's keys first, written into `att_out` when given
        (the caller's buffer for every Euler step: no stacked copy of the steps after)."""
        c = t_emb[:, None]
        h = self.in_proj(self._inputs(x, mu, spks, cond))
        new_cnn, new_att = [], []
        for i, block in enumerate(self.blocks):
            cnn = None if cnn_cache is None else cnn_cache[i]
            att = None if att_cache is None else att_cache[i]
            _mark_dynamic_dims(h, c, cnn, att)
            h, cc, ac = block(h, c, cnn, att)
            new_cnn.append(cc)
            new_att.append(ac)
        return (self.final_layer(h, c).transpose(1, 2).to(x.dtype), torch.stack(new_cnn),
                torch.stack(new_att, out=att_out))

    def forward_slots(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t_emb: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        pool: DiTPool,
        step: int,
        ix: DiTSlots,
    ) -> torch.Tensor:
        """`forward_chunk` for padded rows whose caches live in `pool` (Euler step `step`);
        returns v (2B, 80, T). Valid frames are a prefix of each row."""
        c = t_emb[:, None]
        h = self.in_proj(self._inputs(x, mu, spks, cond))
        ix = ix.at(pool)
        for i, block in enumerate(self.blocks):
            h = block.forward_slots(h, c, pool.k[step, i], pool.v[step, i], pool.cnn[step, i], ix)
        return self.final_layer(h, c).transpose(1, 2).to(x.dtype)


# ---------------------------------------------------------------------------------------
# Regional compile


def compile_slot_blocks(dit: DiT, *, backend: str = "inductor") -> DiT:
    """Regional torch.compile of the slot-pool path: each block's `slot_pre` and `slot_post`
    (everything but the pool's writes, its gathers and SDPA) compiled once for all blocks.
    Inductor fuses the adaLN modulate, gates, residuals, LayerNorms, Mish and GELU between the
    matmuls, which stay aten (cuBLAS) in the weights' dtype: only the summation order inside
    fused norms changes. Only the rows are dynamic (every other shape is fixed by the padded
    chunk), so one graph serves every batch size (`slot_post` has two: with its large-K
    products split and whole, `linear_split_k`'s row guard). Nothing in it syncs with the host: the engine's graph runner compiles in its warm-up calls, then
    captures."""
    pre = torch.compile(DiTBlock.slot_pre, backend=backend)
    post = torch.compile(DiTBlock.slot_post, backend=backend)

    def rows_dynamic(*tensors):  # rows vary, nothing else
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)

    def compiled_pre(block, x, c):
        rows_dynamic(x, c)
        return pre(block, x, c)

    def compiled_post(block, x, attn_out, mod, cnn_pool, tail, cnn_at):
        # the pool (2 slots, 2D, 2) is fixed; the rows' index varies
        rows_dynamic(x, attn_out, *mod, tail, cnn_at)
        return post(block, x, attn_out, mod, cnn_pool, tail, cnn_at)

    for block in dit.blocks:
        block._slot_pre = functools.partial(compiled_pre, block)
        block._slot_post = functools.partial(compiled_post, block)
    return dit


def compile_dit_blocks(dit: DiT, *, dynamic: bool | None = None, backend: str = "inductor") -> DiT:
    """Regional torch.compile: compile each DiTBlock's forward in place (the engine's
    voice templates, `setup_cache`, run through it on CUDA).

    All blocks share one code object and Dynamo treats their parameters as inputs, so one
    compiled graph serves all `depth` blocks and compile time is that of one block. Inductor
    fuses the elementwise work between the matmuls; the matmuls stay aten (cuBLAS) calls in
    the weights' dtype and attention stays SDPA, so only the summation order inside the fused
    LayerNorms differs from eager. The FinalLayer stays eager (a few kernels a call).

    Shapes: rows B, chunk frames T and cache frames L vary. The DiT marks exactly those dims
    dynamic at every block call (`_mark_dynamic_dims`), so the first trace is already
    symbolic in them and new sizes do not recompile. Not `dynamic=True`: it gives dims of
    equal size one symbol ("duck sizing"), so coincidences at the first call pin a graph
    (rows 2 == the conv tail's 2 frames, L == T); nor None without marks: each dim's first
    change would recompile, and past Dynamo's limit of 8 graphs per code object (shared by
    all blocks) new shapes run eagerly. What remains is one graph per kind of input (no
    cache / a cache / a mask), counted in tests/test_code2wav_compile.py."""
    for block in dit.blocks:
        block.compile(dynamic=dynamic, backend=backend)
    return dit
