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


class _GraphLRU:
    """Captured graphs by shape key, least recently used evicted past `max_graphs`, one memory
    pool. `_replay(key, inputs, run)` copies `inputs` into the key's static copies and replays
    `run(*static)`; a key's first use warms `run` up twice on a side stream (lazy inits, cuBLAS
    workspaces, cuFFT plans), then captures it."""

    def __init__(self, batch_sizes: tuple[int, ...], max_graphs: int):
        self.batch_sizes = tuple(batch_sizes)
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.pool = None
        self.replays = self.captures = self.fallbacks = 0

    def _replay(self, key: tuple, inputs: tuple[torch.Tensor, ...], run) -> tuple:
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(inputs, run)
            self.graphs[key] = cap
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        for dst, src in zip(cap.inputs, inputs):
            dst.copy_(src)
        cap.graph.replay()
        self.replays += 1
        return cap.outputs

    def _capture(self, inputs: tuple[torch.Tensor, ...], run) -> _Captured:
        static = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = run(*static)
        self.captures += 1
        return _Captured(graph, static, outputs)


class CFMGraphRunner(_GraphLRU):
    def __init__(self, cfm: CausalCFM, batch_sizes: tuple[int, ...] = (1, 2), max_graphs: int = 16):
        super().__init__(batch_sizes, max_graphs)
        self.cfm = cfm
        self._table: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

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
        table = self.time_table(mu.device, mu.dtype)
        outputs = self._replay(key, (mu, spks, cond, cnn_cache, att_cache),
                               lambda *x: self.cfm.forward_chunk(*x, time_table=table))
        return tuple(o.clone() for o in outputs)


class HiFTGraphRunner(_GraphLRU):
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
        super().__init__(batch_sizes, max_graphs)
        self.hift = hift

    @torch.inference_mode()
    def __call__(self, mel, cache_source=None, generators=None):
        if not (mel.is_cuda and cache_source is not None and mel.shape[0] in self.batch_sizes):
            self.fallbacks += 1
            return self.hift(mel, cache_source, generators)
        rand_ini, gauss = self.hift.draw_noise(mel, generators)
        key = (mel.shape[0], mel.shape[2], cache_source.shape[2], str(mel.device))
        spec, source = self._replay(
            key, (mel, cache_source, rand_ini, gauss),
            lambda m, c, r, g: self.hift.forward_spectrum(m, c, noise=(r, g)))
        return self.hift.istft(spec), source.clone()
