"""The DiT's slot-path attention as one Triton kernel that reads K / V from the slot pool.

Why: at one or two chunks PyTorch's fp32 memory-efficient kernel leaves most SMs idle (it
tiles 64 query rows per (row, head): a chunk is 16 thread blocks), and the slot path's
attention needs two gathers that copy each row's window of K / V out of the pool first. This
kernel tiles 16 query rows, so a chunk is 64 blocks, and loads K / V straight from the pool
at each row's (CFG half, slot): no gathered copies. It computes the same softmax(q k^T
scale + mask) v in fp32 (products in IEEE fp32, no TF32; an online softmax over blocks of
keys), so its outputs differ from the gathers + SDPA's only in the order of float sums.

`write_kv` writes a block's new keys and values into the pool in one launch where two
`index_put_` took two: only copies. The DiT takes both on CUDA (`DiT.prepare_slot_path`).

On CPU it runs only in Triton's interpreter, in the tests (pipeline/triton_kernels.py).
"""

from __future__ import annotations

import torch

from pipeline.triton_kernels import INTERPRET, available, runs_here, triton

if triton is not None:
    import triton.language as tl

__all__ = ["MAX_ROWS", "available", "pool_attention", "runs_here", "write_kv"]

# Query rows a thread block (the interpreter runs programs one by one, so it takes fewer,
# larger ones: a row's sums do not depend on the rows beside it), and keys an iteration.
BLOCK_M = 64 if INTERPRET else 16
BLOCK_N = 64
# Estimator rows (2 a chunk) up to which the kernel runs: beyond 4 chunks the gathers + SDPA,
# with its larger tiles, are faster (docs/performance.md).
MAX_ROWS = 8


if triton is not None:

    @triton.jit
    def _pool_attention_kernel(
        q_ptr, k_ptr, v_ptr, cfg_ptr, slot_ptr, mask_ptr, out_ptr,
        t, w, scale,
        sq_b, sq_h, sq_t,
        sk_c, sk_s, sk_p, sk_h,
        sv_c, sv_s, sv_p, sv_h,
        sm_b, so_b, so_t,
        DH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ):
        row, head, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        half, slot = tl.load(cfg_ptr + row), tl.load(slot_ptr + row)
        offs_m = mb * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, DH)
        rows_in = offs_m < t
        q = tl.load(q_ptr + row * sq_b + head * sq_h + offs_m[:, None] * sq_t + offs_d[None, :],
                    mask=rows_in[:, None], other=0.0)
        k_base = k_ptr + half * sk_c + slot * sk_s + head * sk_h
        v_base = v_ptr + half * sv_c + slot * sv_s + head * sv_h
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DH], tl.float32)
        for start in range(0, w, BN):
            offs_n = start + tl.arange(0, BN)
            keep = tl.load(mask_ptr + row * sm_b + offs_n, mask=offs_n < w, other=0) != 0
            # masked keys load as zeros: a pool position nobody attends may hold anything
            k = tl.load(k_base + offs_n[:, None] * sk_p + offs_d[None, :], mask=keep[:, None],
                        other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key kept yet: exp(-inf) = 0
            alpha = tl.exp(m_i - m_sub)
            p = tl.exp(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * sv_p + offs_d[None, :], mask=keep[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + row * so_b + offs_m[:, None] * so_t + head * DH + offs_d[None, :],
                 out, mask=rows_in[:, None])


def pool_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   cfg: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                   window: int) -> torch.Tensor:
    """Each row r of q (R, H, T, dh) attends the keys / values at positions [0, window) of
    k_pool / v_pool[cfg[r], slots[r]] ((2, S, C, H, dh) each) that mask[r] ((R, 1, 1, >=
    window) bool) keeps, at scale 1/sqrt(dh): SDPA's result, as (R, T, H * dh)."""
    r, h, t, dh = q.shape
    if q.stride(3) != 1 or k_pool.stride(4) != 1 or v_pool.stride(4) != 1:
        raise ValueError("pool_attention: the head dim must be contiguous")
    if dh < 16 or dh & (dh - 1) or mask.dtype != torch.bool:
        raise ValueError("pool_attention: needs a power-of-two head dim >= 16 and a bool mask")
    mask = mask.reshape(r, mask.shape[-1])
    if mask.stride(1) != 1:
        mask = mask.contiguous()
    out = torch.empty(r, t, h * dh, dtype=q.dtype, device=q.device)
    grid = (r, h, triton.cdiv(t, BLOCK_M))
    _pool_attention_kernel[grid](
        q, k_pool, v_pool, cfg.reshape(-1), slots.reshape(-1), mask.view(torch.uint8), out,
        t, window, dh ** -0.5,
        q.stride(0), q.stride(1), q.stride(2),
        *k_pool.stride()[:4], *v_pool.stride()[:4],
        mask.stride(0), out.stride(0), out.stride(1),
        DH=dh, BM=BLOCK_M, BN=BLOCK_N,
    )
    return out


if triton is not None:

    # The rows (2 B T) change with the batch: not specialized on, so a new batch size
    # compiles nothing.
    @triton.jit(do_not_specialize=["n"])
    def _kv_write_kernel(
        k_ptr, v_ptr, at_ptr, kp_ptr, vp_ptr,
        n, sk_r, sv_r,
        HD: tl.constexpr, BD: tl.constexpr, R: tl.constexpr,
    ):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        d = tl.arange(0, BD)
        keep = (rows < n)[:, None] & (d < HD)[None, :]
        at = tl.load(at_ptr + rows, mask=rows < n, other=0).to(tl.int64)[:, None] * HD
        k = tl.load(k_ptr + rows[:, None] * sk_r + d[None, :], mask=keep)
        tl.store(kp_ptr + at + d[None, :], k, mask=keep)
        v = tl.load(v_ptr + rows[:, None] * sv_r + d[None, :], mask=keep)
        tl.store(vp_ptr + at + d[None, :], v, mask=keep)


# Frame rows a program writes (the interpreter runs programs one by one: one for all).
KV_ROWS = 4


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             at: torch.Tensor) -> None:
    """The new frames' keys and values into the pool, in one launch: what
    `k_pool.view(-1, H, dh).index_put_((at,), k.flatten(0, 1))` and the same for v do in two.
    k, v (B, T, H, dh), each frame's (H, dh) contiguous (v may be a view of the q|k|v
    product); k_pool, v_pool (2, S, C, H, dh) contiguous; at (B T,) each frame's row in the
    pool seen as (2 S C, H, dh)."""
    b, t, h, dh = k.shape
    for x in (k, v):
        rows_of_frames = x.stride(3) == 1 and x.stride(2) == dh and x.stride(0) == t * x.stride(1)
        if x.shape != k.shape or not rows_of_frames:
            raise ValueError("write_kv: k and v (B, T, H, dh), each frame's (H, dh) contiguous")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()) or k_pool.shape[-2:] != (h, dh):
        raise ValueError("write_kv: contiguous pools of (H, dh) rows")
    if not (k.dtype == v.dtype == k_pool.dtype == v_pool.dtype):
        raise ValueError("write_kv: k, v and the pools of one dtype")
    n, hd = b * t, h * dh
    rows = n if INTERPRET else KV_ROWS
    _kv_write_kernel[(triton.cdiv(n, rows),)](
        k, v, at, k_pool, v_pool, n, k.stride(1), v.stride(1),
        HD=hd, BD=triton.next_power_of_2(hd), R=triton.next_power_of_2(rows),
    )
