"""One way to capture a CUDA graph: `GraphRunner`, static buffers per shape key.

Contract:
  * the caller reduces a step to `fn(*inputs) -> outputs` over tensors whose shapes are fixed
    by a hashable `key` (a batch-size bucket, a window...), with no host syncs inside;
  * a key's first use captures it: the inputs are copied into the key's static buffers, `fn`
    runs twice on a side stream (lazy inits, cuBLAS workspaces, compiled kernels), then once
    under capture. A step with side effects (caches written in place) passes `example`
    inputs that make those harmless (padding rows writing to a spare slot);
  * every later use copies the inputs into the static buffers and replays. The outputs are
    the graph's static tensors: read (or clone) them before the next replay of that key;
  * a step on static buffers it owns (a decode over the engine's own tensors) passes no inputs;
    `add(key, fn)` captures a key up front;
  * at most `max_graphs` keys are kept (least recently used evicted), all in one memory pool;
  * `fallback()` counts steps the caller ran eagerly instead (shapes it does not capture);
  * a graph captured while the current stream has a raised priority is captured on a side
    stream of that priority: torch instantiates graphs with per-node priorities, copied from
    the capturing stream, so a replay ignores the priority of the stream it is launched on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...] | torch.Tensor


class GraphRunner:
    def __init__(self, max_graphs: int = 32, warmup_iters: int = 2):
        self.max_graphs, self.warmup_iters = max_graphs, warmup_iters
        self.graphs: OrderedDict[Hashable, Captured] = OrderedDict()
        self.pool = None
        self.replays = self.captures = self.fallbacks = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def fallback(self) -> None:
        self.fallbacks += 1

    def counts(self, name: str) -> dict[str, int]:
        """Replays, captures and fallbacks, keyed `{name}_graph_*`, for an engine's stats."""
        return {f"{name}_graph_replays": self.replays, f"{name}_graph_captures": self.captures,
                f"{name}_graph_fallbacks": self.fallbacks}

    def add(self, key: Hashable, fn, example: Sequence[torch.Tensor] = ()) -> None:
        """Capture `key` now (start-up capture of known shapes) instead of at its first run."""
        self.graphs[key] = self.capture(fn, example)
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)

    def run(
        self,
        key: Hashable,
        inputs: Sequence[torch.Tensor],
        fn: Callable[..., tuple[torch.Tensor, ...] | torch.Tensor],
        example: Sequence[torch.Tensor] | None = None,
    ):
        cap = self.graphs.get(key)
        if cap is None:
            cap = self.capture(fn, inputs if example is None else example)
            self.graphs[key] = cap
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        for dst, src in zip(cap.inputs, inputs):
            dst.copy_(src, non_blocking=True)
        cap.graph.replay()
        self.replays += 1
        return cap.outputs

    def capture(self, fn, example: Sequence[torch.Tensor]) -> Captured:
        static = tuple(x.clone() for x in example)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*static)
        self.captures += 1
        return Captured(graph, static, outputs)
