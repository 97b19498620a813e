"""Timing helper shared by the GPU scripts: CUDA events around many back-to-back calls."""

from __future__ import annotations

from typing import Callable

import torch


def cuda_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Mean device time of `fn` in ms over `iters` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
