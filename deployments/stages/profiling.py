"""Profiles of a stage's engine steps inside the running app, for what only the app shows
(a first turn's extra cost, a stage slowed by the others sharing its GPU).

`StepProfiler(steps)` profiles the next `steps` engine steps the stage's worker thread runs,
each on its own torch.profiler window (host ops, and CUDA kernels on a GPU): per step its
wall ms, the device ms and count of its kernels, and the kernels and host ops that took the
most. A profiled step waits for its kernels before its window closes (so they are its own):
with launching ahead, its wall time then includes the work it would have left in flight.
Armed through `EngineLoop.profile`, returned by a stage's `profile()` handle method, written
by `python -m bench.gpu_e2e --profile-first-turn STAGE:N`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass
from typing import Any

import torch

TOP = 6  # kernels and host ops listed per step


@dataclass
class StepProfile:
    wall_ms: float
    device_ms: float  # the step's kernels, summed
    kernels: int
    top_kernels: list[tuple[str, float, int]]  # (name, ms, calls), most time first
    top_host_ops: list[tuple[str, float, int]]  # (name, self ms, calls), most time first


class StepProfiler:
    def __init__(self, steps: int):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.left = steps
        self.records: list[StepProfile] = []
        self.done: Future[list[dict[str, Any]]] = Future()

    def warm_up(self) -> None:
        """One empty window: the profiler's own set-up (CUPTI's on a GPU, paid the first time
        in a process) is then not paid inside the first profiled step."""
        with _profile():
            pass

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        t0 = time.perf_counter()
        with _profile() as prof:
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.records.append(summarize(prof, 1e3 * (time.perf_counter() - t0)))
        self.left -= 1
        if self.left == 0:
            self.finish()

    def finish(self) -> None:
        """Hand over the steps profiled so far (once: the worker thread's last step and a
        caller's timeout may both get here)."""
        with contextlib.suppress(InvalidStateError):
            self.done.set_result([asdict(r) for r in self.records])


def _profile() -> Any:
    from torch.profiler import ProfilerActivity, profile

    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    return profile(activities=[ProfilerActivity.CPU, *cuda])


def summarize(prof: Any, wall_ms: float) -> StepProfile:
    from torch.autograd import DeviceType

    kernels, host = [], []
    for e in prof.key_averages():
        if e.device_type != DeviceType.CPU:
            kernels.append((e.key, e.self_device_time_total / 1e3, e.count))
        elif e.self_cpu_time_total > 0:
            host.append((e.key, e.self_cpu_time_total / 1e3, e.count))
    kernels.sort(key=lambda k: -k[1])
    host.sort(key=lambda h: -h[1])
    return StepProfile(
        wall_ms=round(wall_ms, 3),
        device_ms=round(sum(k[1] for k in kernels), 3),
        kernels=sum(k[2] for k in kernels),
        top_kernels=[(n, round(ms, 3), c) for n, ms, c in kernels[:TOP]],
        top_host_ops=[(n, round(ms, 3), c) for n, ms, c in host[:TOP]],
    )


def format_profile(stage: str, steps: list[dict[str, Any]]) -> str:
    """The steps as text: one block per step, kernels then host ops."""
    lines = [f"{stage}: {len(steps)} engine steps profiled, in order"]
    for i, s in enumerate(steps):
        lines.append(f"step {i}: wall {s['wall_ms']:.1f} ms, {s['kernels']} kernels, "
                     f"device {s['device_ms']:.1f} ms")
        lines += [f"  kernel {ms:8.2f} ms x{c:<5d} {name[:110]}" for name, ms, c in s["top_kernels"]]
        lines += [f"  host   {ms:8.2f} ms x{c:<5d} {name[:110]}" for name, ms, c in s["top_host_ops"]]
    return "\n".join(lines) + "\n"
