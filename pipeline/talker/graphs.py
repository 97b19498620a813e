"""Buckets of the Talker decode's CUDA graphs, one graph per (rows, read_len, steps), captured
at start on the project's GraphRunner (pipeline/graphs.py).

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

from collections.abc import Sequence


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
