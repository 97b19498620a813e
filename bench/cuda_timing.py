"""Shared by the GPU scripts: one call's kernels under torch.profiler."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch


def kernel_profile(fn: Callable[[], object], top: int = 10
                   ) -> tuple[int, float, list[tuple[str, float, int]], list[tuple[float, str, float]]]:
    """One call of `fn` under the profiler: (kernel count, kernel ms, the `top` kernels as
    (name, us, calls), every kernel as (start us, name, us) in launch order)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: Counter = Counter()
    calls: Counter = Counter()
    seq = []
    for e in prof.events():
        if e.device_type.name == "CUDA":
            times[e.name] += e.device_time_total
            calls[e.name] += 1
            seq.append((e.time_range.start, e.name, e.device_time_total))
    rows = [(name[:90], us, calls[name]) for name, us in times.most_common(top)]
    return sum(calls.values()), sum(times.values()) / 1e3, rows, sorted(seq)
