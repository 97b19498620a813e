"""Where the vision encoder's time goes, and what its parts cost alone (H200, bf16).

    python -m bench.gpu_vision_parts [--batch 32] [--iters 10]

1. The shipped path (sdpa + regional compile, SDPA without cuDNN attention) over B
   448x448 slices: ms a slice, then its top kernels (ms a slice, calls, share of the
   device time).
2. Its attention alone, (B, 16 heads, 1024, 72), 26 layers' worth: each SDPA kernel SDPA
   can pick here (flash, memory-efficient, cuDNN) and flash on q/k/v zero-padded to
   head dims 80 / 96 / 128 (the same scores: zero columns add nothing).
3. Its matmuls alone, 26 layers' worth: q, k, v as three products against one joined
   q|k|v product; fc1 / fc2 at the released 4304 against 4352 (a multiple of 128).
Random weights at the released geometry; each part in the same run as its baseline.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.cuda_timing import cuda_ms
from bench.gpu_talker import kernel_table
from bench.gpu_vision import build_shipped, run

LAYERS = 26
PATCHES = 1024


def kernel_lines(fn, slices: int) -> str:
    """One call of `fn` profiled (bench.gpu_talker.kernel_table): its top kernels a slice."""
    n, ms, top = kernel_table(fn)
    lines = [f"kernels: {n}, device {ms / slices:.3f} ms a slice"]
    for name, us, count in top:
        lines.append(f"  {us / 1e3 / slices:7.3f} ms  {count:5d}x  {100 * us / 1e3 / ms:5.1f}%  "
                     f"{name}")
    return "\n".join(lines)


def attention_parts(b: int, iters: int) -> None:
    dev = torch.device("cuda")
    h, d = 16, 72
    q, k, v = (torch.randn(b, h, PATCHES, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    scale = d**-0.5
    print(f"\n2. attention alone, ({b}, {h}, {PATCHES}, {d}) x {LAYERS} layers, ms a slice")
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
    for label, kern in (("flash", SDPBackend.FLASH_ATTENTION),
                        ("mem-efficient", SDPBackend.EFFICIENT_ATTENTION),
                        ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([kern]):
                out = F.scaled_dot_product_attention(q, k, v, scale=scale)
                ms = cuda_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), iters)
            err = (out.float() - ref).abs().max().item()
            print(f"  {label:<16} {ms * LAYERS / b:7.3f}   max |diff| vs fp32 {err:.2e}")
        except RuntimeError as e:
            print(f"  {label:<16} cannot run: {str(e).splitlines()[0][:90]}")
    for pad in (80, 96, 128):
        qp, kp, vp = (F.pad(t, (0, pad - d)) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(qp, kp, vp, scale=scale)[..., :d]
            ms = cuda_ms(lambda a=(qp, kp, vp): F.scaled_dot_product_attention(*a, scale=scale),
                         iters)
        err = (out.float() - ref).abs().max().item()
        print(f"  flash, pad {pad:<5} {ms * LAYERS / b:7.3f}   max |diff| vs fp32 {err:.2e}"
              " (the pad itself not counted)")


def matmul_parts(b: int, iters: int) -> None:
    dev = torch.device("cuda")
    bf = torch.bfloat16
    rows, dm = b * PATCHES, 1152
    x = torch.randn(rows, dm, device=dev, dtype=bf)
    print(f"\n3. matmuls alone, {rows} rows x {LAYERS} layers, ms a slice")

    def line(label: str, fn) -> None:
        print(f"  {label:<34} {cuda_ms(fn, iters) * LAYERS / b:7.3f}")

    wq, wk, wv = (torch.randn(dm, dm, device=dev, dtype=bf) * 0.02 for _ in range(3))
    bq, bk, bv = (torch.randn(dm, device=dev, dtype=bf) for _ in range(3))
    wqkv, bqkv = torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv])
    line("q, k, v: three (1152 -> 1152)", lambda: (F.linear(x, wq, bq), F.linear(x, wk, bk),
                                                   F.linear(x, wv, bv)))
    line("q|k|v joined (1152 -> 3456)", lambda: F.linear(x, wqkv, bqkv))
    line("out (1152 -> 1152)", lambda: F.linear(x, wq, bq))
    for ff in (4304, 4352):
        w1 = torch.randn(ff, dm, device=dev, dtype=bf) * 0.02
        w2 = torch.randn(dm, ff, device=dev, dtype=bf) * 0.02
        b1, b2 = torch.randn(ff, device=dev, dtype=bf), torch.randn(dm, device=dev, dtype=bf)
        hid = torch.randn(rows, ff, device=dev, dtype=bf)
        line(f"fc1 (1152 -> {ff})", lambda w=w1, b=b1: F.linear(x, w, b))
        line(f"fc2 ({ff} -> 1152)", lambda h=hid, w=w2, b=b2: F.linear(h, w, b))
    flop = 2 * PATCHES * dm * (4 * dm + 2 * 4304) * LAYERS
    print(f"  (the layer matmuls' {flop / 1e12:.3f} TFLOP a slice take "
          f"{1e3 * flop / 790e12:.3f} ms at 790 TFLOP/s)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    vpm, res = build_shipped(dev)
    b = args.batch
    x = torch.randn(b, 3, 14, 14 * PATCHES, device=dev, dtype=torch.bfloat16)
    t = torch.tensor([(32, 32)] * b, dtype=torch.int32)
    m = torch.ones(b, 1, PATCHES, dtype=torch.bool, device=dev)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, B={b}")
    with torch.no_grad():
        enc = cuda_ms(lambda: vpm(x, t, m), args.iters)
        both = cuda_ms(lambda: run(vpm, res, x, t, m), args.iters)
        print(f"\n1. shipped: encoder {enc / b:.3f} ms a slice, + resampler {both / b:.3f}")
        print(kernel_lines(lambda: run(vpm, res, x, t, m), b))
        attention_parts(b, args.iters)
        matmul_parts(b, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
