"""CUDA graphs of the Talker decode, one per (rows, read_len, steps) bucket.

Contract with the engine:
  - `step_fn(rows, read_len, steps)` runs `steps` decode steps back to back over cache rows
    [0, rows) reading keys [0, read_len), entirely on static buffers (inputs, sampler state,
    outputs, KV cache); it must not sync with the host, and it must leave state untouched
    for idle rows (the engine captures while every row is idle, so warm-up runs change
    nothing).
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
        step_fn: Callable[[int, int, int], None],
        batch_sizes: Sequence[int],
        kv_lengths: Sequence[int],
        steps: Sequence[int] = (1,),
    ) -> None:
        self.step_fn = step_fn
        self.keys = [(r, l, k) for r in batch_sizes for l in kv_lengths for k in steps]
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def capture(self, warmup_iters: int = 2) -> None:
        # Largest first, so smaller graphs reuse the pool blocks of larger ones.
        keys = sorted(self.keys, reverse=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (allocator, cuBLAS, SDPA) off the capture
            for key in keys:
                for _ in range(warmup_iters):
                    self.step_fn(*key)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for key in keys:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step_fn(*key)
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def replay(self, rows: int, read_len: int, steps: int = 1) -> None:
        self.graphs[(rows, read_len, steps)].replay()
        self.replays += 1
