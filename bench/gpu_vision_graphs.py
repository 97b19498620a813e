"""The vision pass as CUDA graphs against the shipped eager pass (H200, bf16, full size).

    python -m bench.gpu_vision_graphs [--iters 10] [--out F.json]

For batches of B uint8 slices of one patch grid (a 448x448 slice: 32 x 32; a 16:9 video
frame of about that area: 20 x 36), each timed the way the Thinker runs it
(`ThinkerModel._encode_batch` = normalize, SigLIP with regional compile, resampler; and
`VisionGraphs.encode`): the host's time until the call returns and the wall time until its
rows are on the device (median ms of `--iters` calls after warm-up; the graph's first call,
its capture, reported apart), and whether the graph's rows equal eager's bitwise.
Random weights at the released geometry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.gpu_vision import build_shipped
from pipeline.processing.image import normalize_pixels
from pipeline.thinker.model import VisionGraphs

GRIDS = [(32, 32), (20, 36)]
BATCHES = [1, 2, 4, 8, 16]
PATCH = 14


def timed(fn, iters: int) -> tuple[float, float]:
    """(host ms, wall ms), medians over `iters` calls."""
    host, wall = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return sorted(host)[iters // 2], sorted(wall)[iters // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    vpm, res = build_shipped(dev)
    graphs = VisionGraphs(vpm, res, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, ok = [], True
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("grid      B | eager host / wall ms | graph host / wall ms | capture ms | equal")
    with torch.inference_mode():
        for grid in GRIDS:
            n = grid[0] * grid[1]
            for b in BATCHES:
                pix = torch.randint(0, 256, (b, 3, PATCH, PATCH * n), generator=g, device=dev,
                                    dtype=torch.uint8)
                tgt = torch.tensor([grid] * b, dtype=torch.int32)
                mask = torch.ones(b, 1, n, dtype=torch.bool)

                def eager(pix=pix, tgt=tgt, mask=mask):
                    return res(vpm(normalize_pixels(pix).to(dtype), tgt, mask), tgt)

                for _ in range(3):  # compile (symbolic shapes: once per kind), caches
                    eager()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graphs.encode(pix, grid)
                torch.cuda.synchronize()
                capture = (time.perf_counter() - t0) * 1e3
                e_host, e_wall = timed(eager, args.iters)
                g_host, g_wall = timed(lambda pix=pix, grid=grid: graphs.encode(pix, grid),
                                       args.iters)
                equal = torch.equal(graphs.encode(pix, grid), eager())
                ok &= equal
                rows.append({"grid": grid, "b": b, "eager_host_ms": e_host, "eager_wall_ms": e_wall,
                             "graph_host_ms": g_host, "graph_wall_ms": g_wall,
                             "capture_ms": capture, "equal": equal})
                print(f"{grid!s:9} {b:2d} | {e_host:8.2f} / {e_wall:7.2f} | {g_host:8.2f} / "
                      f"{g_wall:7.2f} | {capture:9.1f} | {equal}")
    print(f"graphs kept {len(graphs.runner.graphs)}, captures {graphs.runner.captures}, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("OK" if ok else "FAILED: a graph's rows differ from eager's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
