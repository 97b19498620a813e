"""The Talker forward's RoPE and K / V cache write as one Triton kernel a layer (CUDA).

Why: a decode step is launch-bound, and two of each layer's launches are its rotation
(Inductor's kernel) and its `scatter_` of k and v into the cache. This kernel rotates q and
k in place in the q|k|v projection and stores k and v at their cache positions in one launch.

Numerics: it computes the fused path's `_rotated_qkv` and `scatter_` with the same
roundings: in bf16, `x * cos` and `roll(x) * signed_sin` are each rounded to bf16 and then
their sum (the products of two bf16 values are exact in fp32, so each rounding is the one
torch's bf16 ops make); in fp32 each op rounds in fp32. The bf16 roundings are done by the
bits (to nearest, ties to even), because Triton's interpreter truncates its casts to bf16;
an explicit rounding between a product and the add also leaves the compiler no fused
multiply-add to form. In fp32 on a GPU the compiler may contract `x * cos + r` into one FMA
(one rounding fewer): bounded by the engine tests; the Talker serves in bf16.

On CPU it runs only in Triton's interpreter, in the tests (pipeline/triton_kernels.py).
"""

from __future__ import annotations

import torch

from pipeline.triton_kernels import available, runs_here, triton

if triton is not None:
    import triton.language as tl

    from pipeline.triton_kernels import round_bf16

__all__ = ["available", "rope_kv_", "runs_here"]


if triton is not None:
    # Triton compiles a variant per integer argument equal to 1 or divisible by 16, and per
    # pointer aligned to 16 bytes or not; the prompt length, the first slot and the
    # positions' row stride and offset take many values (a prefill's positions are a
    # slice of the cache's table), and a request must not wait for a compile at its
    # prefill: one variant for all of them.
    @triton.jit(do_not_specialize=["length", "row0", "sp_b", "sw_b", "pos_ptr", "wpos_ptr"])
    def _rope_kv_kernel(
        qkv_ptr, cs_ptr, pos_ptr, wpos_ptr, kv_ptr,
        length, row0,
        sx_b, sx_l, sx_h,
        sc_p, sc_c,
        sp_b, sw_b,
        skv_c, skv_s, skv_h, skv_t,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, NH: tl.constexpr,
        BF16: tl.constexpr,
    ):
        tok = tl.program_id(0)
        b, i = tok // length, tok % length
        pos = tl.load(pos_ptr + b * sp_b + i)
        wpos = tl.load(wpos_ptr + b * sw_b + i)
        heads = tl.arange(0, NH)
        d = tl.arange(0, D)
        base = qkv_ptr + b * sx_b + i * sx_l
        ptrs = base + heads[:, None] * sx_h + d[None, :]
        in_qkv = heads[:, None] < HEADS + 2 * KV_HEADS
        rotates = heads[:, None] < HEADS + KV_HEADS
        x = tl.load(ptrs, mask=in_qkv, other=0.0).to(tl.float32)
        # rotate-half as a roll by D / 2, its sign folded into the table's sin
        partner = base + heads[:, None] * sx_h + ((d[None, :] + D // 2) % D)
        xr = tl.load(partner, mask=rotates, other=0.0).to(tl.float32)
        cos = tl.load(cs_ptr + pos * sc_p + d).to(tl.float32)
        sin = tl.load(cs_ptr + pos * sc_p + sc_c + d).to(tl.float32)
        if BF16:
            y = round_bf16(round_bf16(x * cos[None, :]) + round_bf16(xr * sin[None, :]))
        else:
            y = x * cos[None, :] + xr * sin[None, :]
        y = tl.where(rotates, y, x)  # v passes through
        tl.store(ptrs, y.to(qkv_ptr.dtype.element_ty), mask=rotates)
        # k heads [HEADS, HEADS + KV_HEADS) -> kv[0], v heads after them -> kv[1]
        j = tl.maximum(heads - HEADS, 0)
        dst = (kv_ptr + (j // KV_HEADS)[:, None] * skv_c + (row0 + b) * skv_s
               + (j % KV_HEADS)[:, None] * skv_h + wpos * skv_t + d[None, :])
        tl.store(dst, y.to(kv_ptr.dtype.element_ty), mask=in_qkv & (heads[:, None] >= HEADS))


def rope_kv_(
    qkv: torch.Tensor,
    rope_cs: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor,
    kv: torch.Tensor,
    row0: int,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Rotate q and k of qkv (B, L, H + 2 Hkv, D) in place at `positions` (B, L) with the
    table rope_cs (P, 2, D) (cos, sin with rotate-half's sign folded in), and store k and v
    into one layer's cache kv (2, S, Hkv, T, D) at slots row0 + b, positions
    `write_pos` (B, L). Returns qkv."""
    b, length, nh, d = qkv.shape
    if nh != heads + 2 * kv_heads or d & (d - 1) or d < 2:
        raise ValueError("rope_kv_: qkv must be (B, L, H + 2 Hkv, D) with D a power of two")
    if qkv.stride(3) != 1 or kv.stride(4) != 1 or rope_cs.stride(2) != 1:
        raise ValueError("rope_kv_: the head dim must be contiguous")
    if positions.stride(1) != 1 or write_pos.stride(1) != 1:
        raise ValueError("rope_kv_: positions must be contiguous along L")
    if qkv.dtype not in (torch.bfloat16, torch.float32) or kv.dtype != qkv.dtype:
        raise ValueError("rope_kv_: bf16 or fp32 q|k|v and cache of one dtype")
    _rope_kv_kernel[(b * length,)](
        qkv, rope_cs, positions, write_pos, kv,
        length, row0,
        qkv.stride(0), qkv.stride(1), qkv.stride(2),
        rope_cs.stride(0), rope_cs.stride(1),
        positions.stride(0), write_pos.stride(0),
        *kv.stride()[:4],
        HEADS=heads, KV_HEADS=kv_heads, D=d, NH=triton.next_power_of_2(nh),
        BF16=qkv.dtype == torch.bfloat16,
    )
    return qkv
