"""The Qwen3 layer's QK-norm + RoPE and its paged K/V cache write as one Triton kernel.

Why: a small decode step of the Thinker is launch-bound, and per layer the compiled QK-norm
+ RoPE and `write_kv`'s two `index_copy_` are about three short kernels. `qk_norm_rope_kv`
does their work in one launch: for every token row it reads q, k and v where the q|k|v GEMM
left them, applies the per-head RMSNorm and rotate-half RoPE to q and k, writes q out for
attention and stores k and v into the layer's paged cache at the step's `kv_rows`. Attention
then only reads the cache.

Numerics: the same ops as `llm.qk_norm_rope` (the HF order) rounded where they round. In
bf16 each of `normed.to(bf16)`, `weight * normed`, `q * cos`, `rotate_half(q) * sin` and
their sum is rounded to the nearest bf16 (ties to even), by the bits: Triton's interpreter
truncates a bf16 cast where the GPU rounds, and the explicit rounding also keeps the
compiler from contracting a product and a sum into one FMA across a rounding. The cos / sin
rows are rounded to bf16 first, as HF casts the fp32 table to the activation dtype. What
may differ from the eager ops is the norm's sum of squares (summed in another order) and
its rsqrt; V is copied bit for bit. In fp32 nothing is rounded besides fp32's own (on the
GPU a product and a sum may contract to an FMA there: one fp32 rounding fewer).

On CPU it runs only in Triton's interpreter, in the tests (pipeline/triton_kernels.py).
"""

from __future__ import annotations

import torch

from pipeline.triton_kernels import INTERPRET, available, runs_here, triton

if triton is not None:
    import triton.language as tl

    from pipeline.triton_kernels import round_bf16

__all__ = ["DTYPES", "available", "qk_norm_rope_kv", "runs_here"]

# Head rows ((token, head) pairs) a program normalizes: of q, or of k with their v. On the
# GPU a few, so that a decode step's handful of tokens spreads over many SMs; the
# interpreter runs programs one by one, so it takes fewer, larger ones (a head row's result
# does not depend on the rows beside it).
ROWS = 256 if INTERPRET else 4
DTYPES = (torch.bfloat16, torch.float32)


if triton is not None:

    # The token count (and the (2, T) rows' stride) vary step by step: not specialized on
    # (a count of 1, or a multiple of 16), so a new count never compiles a kernel mid-serving.
    @triton.jit(do_not_specialize=["t", "s_rows"])
    def _qk_rope_kv_kernel(
        q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, rows_ptr, out_ptr, kv_ptr,
        t, eps,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, scos_t, ssin_t, s_rows, so_t,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        # A program takes R head rows: the (token, head) pairs of q, in token-major order,
        # or those of k (each with its v).
        pid = tl.program_id(0)
        q_programs = tl.cdiv(t * HQ, R)
        if pid < q_programs:
            r = pid * R + tl.arange(0, R)
            tok, head = r // HQ, r % HQ
            keep = r < t * HQ
            src, w_ptr = q_ptr + tok * sq_t + head * sq_h, qw_ptr
        else:
            r = (pid - q_programs) * R + tl.arange(0, R)
            tok, head = r // HKV, r % HKV
            keep = r < t * HKV
            src, w_ptr = k_ptr + tok * sk_t + head * sk_h, kw_ptr
        tok = tl.where(keep, tok, 0)  # rows past the end read token 0's inputs, store nothing
        # rotate_half(x) = (-x2, x1): element d takes element rot[d], negated in the first half
        d = tl.arange(0, D)
        rot = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)[None, :]
        m = keep[:, None]
        x = tl.load(src[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        x_rot = tl.load(src[:, None] + rot[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d).to(tl.float32)[None, :]
        w_rot = tl.load(w_ptr + rot).to(tl.float32)[None, :]
        cos = tl.load(cos_ptr + tok[:, None] * scos_t + d[None, :], mask=m, other=0.0)
        sin = tl.load(sin_ptr + tok[:, None] * ssin_t + d[None, :], mask=m, other=0.0)
        cos, sin = cos.to(tl.float32), sin.to(tl.float32)
        if ROUND:  # HF casts the fp32 table to the activation dtype
            cos, sin = round_bf16(cos), round_bf16(sin)
        # RMSNorm (fp32), cast back, times the weight; the rotated copy is the same values
        r_norm = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        n, n_rot = x * r_norm, x_rot * r_norm
        if ROUND:
            n, n_rot = round_bf16(n), round_bf16(n_rot)
        n, n_rot = w * n, w_rot * n_rot
        if ROUND:
            n, n_rot = round_bf16(n), round_bf16(n_rot)
        # RoPE: x * cos + rotate_half(x) * sin, each product and the sum rounded
        a, b = n * cos, (sign * n_rot) * sin
        if ROUND:
            a, b = round_bf16(a), round_bf16(b)
        y = a + b
        if ROUND:
            y = round_bf16(y)
        if pid < q_programs:
            dst = out_ptr + tok * so_t + head * D
            tl.store(dst[:, None] + d[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
        else:
            # the cache as rows of (HKV, D): k at rows[0, t], v at rows[1, t] (int64 offsets)
            k_row = tl.load(rows_ptr + tok, mask=keep, other=0)
            v_row = tl.load(rows_ptr + s_rows + tok, mask=keep, other=0)
            dst = kv_ptr + k_row * (HKV * D) + head * D
            tl.store(dst[:, None] + d[None, :], y.to(kv_ptr.dtype.element_ty), mask=m)
            v = tl.load(v_ptr + (tok * sv_t + head * sv_h)[:, None] + d[None, :], mask=m)
            tl.store(kv_ptr + (v_row * (HKV * D) + head * D)[:, None] + d[None, :], v, mask=m)


def qk_norm_rope_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """`qk_norm_rope` of q (T, Hq, D) and k (T, Hkv, D), then `write_kv` of the rotated k and
    v (T, Hkv, D) into one layer's paged cache kv (num_blocks, 2, block, Hkv, D) at rows
    (2, T) (`kv_rows`), in one launch; returns the rotated q as a new (T, Hq, D) tensor.

    q, k, v may be strided views (the q|k|v GEMM's output split), with the head dim
    contiguous; cos, sin: (T, 1, D) (`RotaryEmbedding`'s, fp32 unless the model was cast).
    Graph capturable: no host reads, one output of a shape fixed by the inputs'."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if q.dtype not in DTYPES or not (k.dtype == v.dtype == kv.dtype == q.dtype):
        raise ValueError(f"qk_norm_rope_kv: q, k, v and the cache in one of {DTYPES}")
    if d < 2 or d & (d - 1) or kv.shape[-2:] != (hkv, d) or not kv.is_contiguous():
        raise ValueError("qk_norm_rope_kv: a power-of-two head dim and a contiguous cache")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin, rows)):
        raise ValueError("qk_norm_rope_kv: q, k, v, cos, sin and rows need a contiguous last dim")
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    grid = (triton.cdiv(t * hq, ROWS) + triton.cdiv(t * hkv, ROWS),)
    _qk_rope_kv_kernel[grid](
        q, k, v, q_w, k_w, cos, sin, rows, out, kv,
        t, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), rows.stride(0), out.stride(0),
        HQ=hq, HKV=hkv, D=d, R=ROWS, ROUND=q.dtype == torch.bfloat16,
    )
    return out
