"""Code2Wav's fp32 matmuls on one GPU: cuBLAS against a small-tile Triton kernel, against
cuBLAS split over K, and the DiT's attention kernels.

Why: cuBLAS's fp32 (SIMT) kernels tile the output in 64-128-row blocks, so the DiT's 112-row
matmuls at one chunk fill few of the H200's 132 SMs. The kernel below tiles them small (16 x 32
up) to fill the GPU, each output one fp32 dot product over K then the bias (another order of
sums than cuBLAS's). Measured (docs/performance.md): it is 1-4x slower than cuBLAS at every
shape, so Code2Wav keeps cuBLAS; kept here as the record of that measurement.

The shapes and counts are those of one shipped Code2Wav step (slot pool, compiled DiT parts,
the vocoder's convs as matmuls) at B=1 and B=8 chunks, recorded with a dispatch mode on CPU
at full size. Each matmul is timed as 20 calls inside a CUDA graph (as in the engine: no launch
cost), the median of 10 replays; the error of each against a float64 product, relative to the
output's largest value. Prints per shape cuBLAS, the kernel at `tile_config`'s tiles and at the
best of `CONFIGS`, and the step's sum over its matmuls (count x time).

Split over K (`--split-k`): the same cuBLAS kernels on S slices of K as one batched product,
then the S partial outputs summed (another order of sums; S times the output tiles, so S times
the SMs busy on a 112-row product), and q|k|v as one 1536-wide product. `--attention`: the
DiT's fp32 attention at one chunk (2B rows, 8 heads of 64, a window of keys, a key mask) with
SDPA's memory-efficient kernel as shipped against its math path (two batched matmuls and a
softmax), and the slot path as it runs: each row's window gathered from the slot pool then
SDPA, against `pool_attention`'s kernel reading the pool in place.

    python bench/gpu_gemm_fp32.py [--no-triton] [--split-k] [--attention] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipeline.code2wav.dit import split_k

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by output size; see `tile_config`.
CONFIGS = [(16, 32, 32, 4), (16, 64, 32, 4), (32, 32, 32, 4), (32, 64, 32, 4),
           (64, 32, 32, 4), (64, 64, 32, 4), (32, 64, 16, 4), (64, 64, 16, 4),
           (32, 128, 32, 4), (64, 128, 32, 8), (128, 64, 32, 8), (128, 128, 32, 8)]
def tile_config(m: int, n: int) -> tuple[int, int, int, int]:
    """The largest tiles that still give the GPU's SMs a block each (fewer loads per FMA),
    down to 16 x 32."""
    for bm, bn in ((64, 64), (32, 64), (32, 32), (16, 32)):
        if triton.cdiv(m, bm) * triton.cdiv(n, bn) >= 128:
            return bm, bn, 32, 4
    return 16, 32, 32, 4


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                   sxm, sxk, swn, swk, sym, syn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def small_tile_mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T + b (N,), fp32 on CUDA, through the Triton kernel."""
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, warps = config or tile_config(m, n)
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _linear_kernel[grid](x, w, b if b is not None else w, y, m, n, k,
                         x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                         y.stride(0), y.stride(1), HAS_BIAS=b is not None,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


# (count in one step, M, K, N): the matmuls of a step's DiT (10 CFM steps x 16 blocks) and
# vocoder, the few-call ones left out.
STEPS = {
    1: [(640, 112, 512, 512), (320, 112, 1536, 512), (160, 2, 512, 4608), (160, 112, 512, 2048),
        (160, 112, 2048, 512), (12, 1152, 1792, 256), (12, 5760, 896, 128), (12, 17283, 704, 64),
        (12, 272, 1792, 256), (12, 1360, 896, 128), (12, 4081, 704, 64), (10, 112, 512, 80),
        (6, 1152, 768, 256), (6, 1152, 2816, 256), (6, 5760, 384, 128), (6, 5760, 1408, 128),
        (6, 17283, 448, 64), (6, 272, 2816, 256), (6, 1360, 1408, 128), (6, 4081, 448, 64)],
    8: [(640, 896, 512, 512), (320, 896, 1536, 512), (160, 16, 512, 4608), (160, 896, 512, 2048),
        (160, 896, 2048, 512), (12, 9216, 1792, 256), (12, 46080, 896, 128),
        (12, 138264, 704, 64), (12, 2176, 1792, 256), (12, 10880, 896, 128),
        (12, 32648, 704, 64), (10, 896, 512, 80), (6, 9216, 768, 256), (6, 9216, 2816, 256),
        (6, 46080, 384, 128), (6, 46080, 1408, 128), (6, 138264, 448, 64),
        (6, 2176, 2816, 256), (6, 10880, 1408, 128), (6, 32648, 448, 64)],
}
CALLS = 20


def graph_us(fn, *args) -> float:
    """Median device time of one call, from CUDA-graph replays of CALLS calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn(*args)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def operands(m: int, k: int, n: int, g: torch.Generator):
    """x (M, K), w (N, K), bias (N,) on CUDA, their float64 product, cuBLAS's time (us)."""
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    bias = torch.randn(n, device="cuda", generator=g)
    ref = torch.addmm(bias.double(), x.double(), w.double().t())
    return x, w, bias, ref, graph_us(F.linear, x, w, bias)


def split_k_rows(shapes) -> None:
    """Per shape: cuBLAS as is, split over K in 2, 4, 8, 16 (where K divides), the error
    of each against float64."""
    g = torch.Generator(device="cuda").manual_seed(1)
    print("split over K: count M K N | cuBLAS us | S=2 | S=4 | S=8 | S=16 | best (S) | "
          "rel err cuBLAS / best")
    tot = {"cublas": 0.0, "best": 0.0}
    for count, m, k, n in shapes:
        x, w, bias, ref, cub = operands(m, k, n, g)
        times = {}
        for s in (2, 4, 8, 16):
            if k % s == 0:
                times[s] = graph_us(split_k, x, w, bias, s)
        best_s = min(times, key=times.get)
        cells = " | ".join(f"{times[s]:7.2f}" if s in times else "      -" for s in (2, 4, 8, 16))
        e_cub = rel_err(F.linear(x, w, bias), ref)
        e_s = rel_err(split_k(x, w, bias, best_s), ref)
        tot["cublas"] += count * cub
        tot["best"] += count * min(cub, times[best_s])
        print(f"  {count:4d} {m:6d} {k:5d} {n:5d} | {cub:8.2f} | {cells} | "
              f"{times[best_s]:7.2f} ({best_s}) | {e_cub:.1e} / {e_s:.1e}")
    print(f"  sum ms: cuBLAS {tot['cublas'] / 1000:.2f}, best split {tot['best'] / 1000:.2f}")


def qkv_rows(rows: int) -> None:
    """q, k, v as three 512-wide products against one 1536-wide product (same dot products)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(rows, 512, device="cuda", generator=g)
    ws = [torch.randn(512, 512, device="cuda", generator=g) / 512 ** 0.5 for _ in range(3)]
    bs = [torch.randn(512, device="cuda", generator=g) for _ in range(3)]
    w, b = torch.cat(ws), torch.cat(bs)
    three = graph_us(lambda x: [F.linear(x, wi, bi) for wi, bi in zip(ws, bs)], x)
    one = graph_us(F.linear, x, w, b)
    split = min(graph_us(split_k, x, w, b, s) for s in (2, 4, 8))
    same = torch.equal(torch.cat([F.linear(x, wi, bi) for wi, bi in zip(ws, bs)], -1),
                       F.linear(x, w, b))
    print(f"q|k|v at {rows} rows: three products {three:.2f} us, one {one:.2f} us "
          f"(bitwise equal: {same}), one split over K {split:.2f} us")


def attention_rows(batch: int, window: int, t: int = 56) -> None:
    """The DiT's attention at `batch` chunks: memory-efficient SDPA against the math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(3)
    b = 2 * batch
    q = torch.randn(b, 8, t, 64, device="cuda", generator=g)
    kv = torch.randn(b, 8, window, 64, device="cuda", generator=g)
    vv = torch.randn(b, 8, window, 64, device="cuda", generator=g)
    mask = torch.zeros(b, 1, 1, window, dtype=torch.bool, device="cuda")
    mask[..., : window - 40] = True  # a window with free positions, as in the pool

    def run(backend):
        def f(q, k, v, m):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return f

    ref = F.scaled_dot_product_attention(q.double(), kv.double(), vv.double(), attn_mask=mask)
    cells = []
    for name, backend in (("mem-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("math", SDPBackend.MATH)):
        f = run(backend)
        us = graph_us(f, q, kv, vv, mask)
        cells.append(f"{name} {us:.2f} us (err {rel_err(f(q, kv, vv, mask), ref):.1e})")
    print(f"attention, {batch} chunk(s), window {window}: " + ", ".join(cells))
    pool_rows(batch, window, t)


def pool_rows(batch: int, window: int, t: int = 56, slots_n: int = 8) -> None:
    """The slot path's attention at `batch` chunks: gathers + SDPA (as `attend_slots` without
    the kernel) against `pool_attention` reading K / V in place from the pool."""
    from pipeline.code2wav.pool_attention import pool_attention
    g = torch.Generator(device="cuda").manual_seed(4)
    b, cap = 2 * batch, window + 64
    k_pool = torch.randn(2, slots_n, cap, 8, 64, device="cuda", generator=g)
    v_pool = torch.randn(2, slots_n, cap, 8, 64, device="cuda", generator=g)
    slots = torch.randperm(slots_n, device="cuda", generator=g)[:batch]
    cfg = torch.arange(2, device="cuda").repeat_interleave(batch)[:, None]
    rows = slots.repeat(2)[:, None]
    q = torch.randn(b, t, 8, 64, device="cuda", generator=g).transpose(1, 2)
    mask = torch.zeros(b, 1, 1, window, dtype=torch.bool, device="cuda")
    mask[..., : window - 40] = True

    def gathered(q, k_pool, v_pool, mask):
        keys = k_pool[:, slots, :window].reshape(b, window, 8, 64).transpose(1, 2)
        vals = v_pool[:, slots, :window].reshape(b, window, 8, 64).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, -1)

    def kernel(q, k_pool, v_pool, mask):
        return pool_attention(q, k_pool, v_pool, cfg, rows, mask, window)

    ref = gathered(q.double(), k_pool.double(), v_pool.double(), mask)
    a, k = gathered(q, k_pool, v_pool, mask), kernel(q, k_pool, v_pool, mask)
    print(f"  slot path: gathers + SDPA {graph_us(gathered, q, k_pool, v_pool, mask):.2f} us "
          f"(err {rel_err(a, ref):.1e}), pool kernel {graph_us(kernel, q, k_pool, v_pool, mask):.2f}"
          f" us (err {rel_err(k, ref):.1e}; max abs against SDPA {(k - a).abs().max():.1e})")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton kernel")
    ap.add_argument("--split-k", action="store_true", help="cuBLAS split over K, q|k|v joined")
    ap.add_argument("--attention", action="store_true", help="the DiT's attention kernels")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {}
    if args.split_k:
        for b in (1, 2, 4, 8):
            dit = [(c, m * b, k, n) for c, m, k, n in STEPS[1] if m in (2, 112)]
            print(f"B={b}, the DiT's matmuls")
            split_k_rows(dit)
            qkv_rows(112 * b)
    if args.attention:
        for b in (1, 2, 4, 8):
            for window in (192, 256):
                attention_rows(b, window)
    for b, shapes in STEPS.items() if not args.no_triton else ():
        rows, tot = [], {"cublas": 0.0, "tiles": 0.0, "best": 0.0}
        print(f"B={b}: count M K N | cuBLAS us | tile_config us | best us (config) | "
              f"rel err cuBLAS / kernel")
        for count, m, k, n in shapes:
            x, w, bias, ref, cub = operands(m, k, n, g)
            cfg = tile_config(m, n)
            mine = graph_us(small_tile_mm, x, w, bias, cfg)
            best = (mine, cfg)
            for c in CONFIGS:
                t = graph_us(small_tile_mm, x, w, bias, c)
                best = min(best, (t, c))
            e_cub = rel_err(F.linear(x, w, bias), ref)
            e_mine = rel_err(small_tile_mm(x, w, bias, cfg), ref)
            tot["cublas"] += count * cub
            tot["tiles"] += count * mine
            tot["best"] += count * min(best[0], cub)
            rows.append({"count": count, "m": m, "k": k, "n": n, "cublas_us": round(cub, 2),
                         "tiles_us": round(mine, 2), "tiles": cfg, "best_us": round(best[0], 2),
                         "best": best[1], "err_cublas": e_cub, "err_kernel": e_mine})
            print(f"  {count:4d} {m:6d} {k:5d} {n:5d} | {cub:8.2f} | {mine:8.2f} {cfg} | "
                  f"{best[0]:8.2f} {best[1]} | {e_cub:.1e} / {e_mine:.1e}")
        print(f"  step sum ms: cuBLAS {tot['cublas'] / 1000:.2f}, kernel everywhere "
              f"{tot['tiles'] / 1000:.2f}, best of all {tot['best'] / 1000:.2f}")
        result[b] = {"rows": rows, "sum_ms": {k: round(v / 1000, 3) for k, v in tot.items()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
