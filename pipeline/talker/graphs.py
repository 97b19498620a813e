"""CUDA graphs of the Talker decode step, one per (rows, read_len) bucket.

Contract with the engine:
  - `step_fn(rows, read_len)` runs one decode step over cache rows [0, rows) reading keys
    [0, read_len), entirely on static buffers (inputs, sampler state, outputs, KV cache);
    it must not sync with the host, and it must leave state untouched for idle rows
    (the engine captures while every row is idle, so warm-up runs change nothing).
  - The engine picks the bucket with `bucket_up` for both the graph and the eager path,
    so turning graphs on or off never changes the shapes a step runs at (hence the codes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def bucket_up(value: int, sizes: Sequence[int]) -> int:
    """Smallest size >= value; `sizes` is sorted ascending."""
    for size in sizes:
        if size >= value:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {sizes[-1]}")


def power_of_two_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... below hi, then hi itself."""
    sizes = []
    size = lo
    while size < hi:
        sizes.append(size)
        size *= 2
    sizes.append(hi)
    return tuple(sizes)


class DecodeGraphs:
    """Captured decode steps sharing one memory pool."""

    def __init__(
        self,
        step_fn: Callable[[int, int], None],
        batch_sizes: Sequence[int],
        kv_lengths: Sequence[int],
    ) -> None:
        self.step_fn = step_fn
        self.keys = [(r, l) for r in batch_sizes for l in kv_lengths]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def capture(self, warmup_iters: int = 2) -> None:
        # Largest first, so smaller graphs reuse the pool blocks of larger ones.
        keys = sorted(self.keys, reverse=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (allocator, cuBLAS, SDPA) off the capture
            for rows, read_len in keys:
                for _ in range(warmup_iters):
                    self.step_fn(rows, read_len)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for rows, read_len in keys:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step_fn(rows, read_len)
            self.graphs[(rows, read_len)] = graph
        torch.cuda.synchronize()

    def replay(self, rows: int, read_len: int) -> None:
        self.graphs[(rows, read_len)].replay()
        self.replays += 1
