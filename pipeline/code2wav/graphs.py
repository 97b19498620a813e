"""CUDA graphs for Code2Wav: the whole 10-step CFM of a streaming chunk (`CFMGraphRunner`) and
the HiFT vocoder (`HiFTGraphRunner`, at the end).

Contract (`CFMGraphRunner`, a drop-in for `CausalCFM.forward_chunk`):
  * key = (batch, chunk frames, DiT cache frames, dtype); captured lazily on first use for the
    batch sizes in `batch_sizes` (default 1 and 2), at most `max_graphs` kept (LRU);
  * static inputs: mu, spks, cond (B,80,T / B,80), est cnn/att caches; static outputs: mel and
    the new caches, cloned on return (stream states must not alias graph memory);
  * the step table (timestep embeddings t_emb (S,D) and Euler dt (S,)) is computed once before
    capture: it only depends on the weights and the schedule, so nothing inside the graph
    syncs with the host or builds tables; the noise slice offset is part of the key;
  * anything else (CPU, first chunk without cache, other batch sizes) runs eagerly and
    increments `fallbacks`. All graphs share one memory pool.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from pipeline.code2wav.flow import CausalCFM


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # CFM: mu, spks, cond, cnn, att; HiFT: mel, source, noise
    outputs: tuple[torch.Tensor, ...]  # CFM: mel, cnn, att; HiFT: spectrum, source


class CFMGraphRunner:
    def __init__(self, cfm: CausalCFM, batch_sizes: tuple[int, ...] = (1, 2), max_graphs: int = 16):
        self.cfm = cfm
        self.batch_sizes = tuple(batch_sizes)
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.pool = None
        self._table: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.replays = 0
        self.captures = 0
        self.fallbacks = 0

    def time_table(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), dtype)
        if key not in self._table:
            with torch.inference_mode():
                t_emb, dt = self.cfm.time_table(device, dtype)
            self._table[key] = (t_emb.clone(), dt.clone())
        return self._table[key]

    def _eligible(self, mu, cnn_cache, att_cache) -> bool:
        return (
            mu.is_cuda
            and cnn_cache is not None
            and att_cache is not None
            and mu.shape[0] in self.batch_sizes
        )

    @torch.inference_mode()
    def __call__(self, mu, spks, cond, cnn_cache, att_cache, time_table=None):
        if not self._eligible(mu, cnn_cache, att_cache):
            self.fallbacks += 1
            return self.cfm.forward_chunk(mu, spks, cond, cnn_cache, att_cache, time_table)
        key = (mu.shape[0], mu.shape[2], att_cache.shape[4], mu.dtype, str(mu.device))
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(mu, spks, cond, cnn_cache, att_cache)
            self.graphs[key] = cap
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        for dst, src in zip(cap.inputs, (mu, spks, cond, cnn_cache, att_cache)):
            dst.copy_(src)
        cap.graph.replay()
        self.replays += 1
        return tuple(o.clone() for o in cap.outputs)

    def _capture(self, mu, spks, cond, cnn_cache, att_cache) -> _Captured:
        table = self.time_table(mu.device, mu.dtype)
        inputs = tuple(x.clone() for x in (mu, spks, cond, cnn_cache, att_cache))
        # Warm up on a side stream (lazy inits, cuBLAS workspaces) before capturing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.cfm.forward_chunk(*inputs, time_table=table)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.cfm.forward_chunk(*inputs, time_table=table)
        self.captures += 1
        return _Captured(graph, inputs, outputs)


class HiFTGraphRunner:
    """CUDA graphs of the HiFT vocoder, a drop-in for `hift(mel, cache_source, generators)`.

    key = (batch, mel frames, cached source samples); captured lazily for the batch sizes in
    `batch_sizes`, at most `max_graphs` kept (LRU), one shared memory pool. The source noise is
    drawn eagerly from the streams' generators (`HiFTGenerator.draw_noise`: the same draws as
    an eager call) and copied into the graph's inputs with the mel and the cached source, so a
    replay computes what the eager call would. The graph ends at the complex spectrum
    (`forward_spectrum`): torch.istft checks the window overlap with a host sync, so it runs
    eagerly on the replay's output. Anything else (CPU, other batch sizes, no cache) runs
    eagerly and increments `fallbacks`.
    """

    def __init__(self, hift, batch_sizes: tuple[int, ...] = (1, 2), max_graphs: int = 16):
        self.hift = hift
        self.batch_sizes = tuple(batch_sizes)
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.pool = None
        self.replays = self.captures = self.fallbacks = 0

    @torch.inference_mode()
    def __call__(self, mel, cache_source=None, generators=None):
        if not (mel.is_cuda and cache_source is not None and mel.shape[0] in self.batch_sizes):
            self.fallbacks += 1
            return self.hift(mel, cache_source, generators)
        rand_ini, gauss = self.hift.draw_noise(mel, generators)
        key = (mel.shape[0], mel.shape[2], cache_source.shape[2], str(mel.device))
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(mel, cache_source, rand_ini, gauss)
            self.graphs[key] = cap
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        for dst, src in zip(cap.inputs, (mel, cache_source, rand_ini, gauss)):
            dst.copy_(src)
        cap.graph.replay()
        self.replays += 1
        spec, source = cap.outputs
        return self.hift.istft(spec), source.clone()

    def _capture(self, mel, cache_source, rand_ini, gauss) -> _Captured:
        inputs = tuple(x.clone() for x in (mel, cache_source, rand_ini, gauss))

        def run():
            return self.hift.forward_spectrum(inputs[0], inputs[1], noise=(inputs[2], inputs[3]))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # cuFFT plans, cuDNN choices, allocator: off the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = run()
        self.captures += 1
        return _Captured(graph, inputs, outputs)
