"""CUDA graphs of the HiFT vocoder (`HiFTGraphRunner`), on the project's one graph mechanism
(pipeline/graphs.py). The flow's graphs are the slot-pool step's (engine.py).

`HiFTGraphRunner` is a drop-in for `hift(mel, cache_source, generators)`: key = (batch, mel
frames, cached source samples), captured lazily for the batch sizes in `batch_sizes`. The source
noise is drawn eagerly from the streams' generators (`HiFTGenerator.draw_noise`: the same draws
as an eager call) and copied into the graph's inputs with the mel and the cached source, so a
replay computes what the eager call would. The graph ends at the complex spectrum
(`forward_spectrum`): torch.istft checks the window overlap with a host sync, so it runs eagerly
on the replay's output. Anything else (CPU, other batch sizes, no cache) runs eagerly and counts
as a fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.graphs import GraphRunner


class HiFTGraphRunner(GraphRunner):
    def __init__(self, hift, batch_sizes: Sequence[int], max_graphs: int = 32):
        super().__init__(max_graphs)
        self.hift, self.batch_sizes = hift, tuple(batch_sizes)

    @torch.inference_mode()
    def __call__(self, mel, cache_source=None, generators=None):
        if not (mel.is_cuda and cache_source is not None and mel.shape[0] in self.batch_sizes):
            self.fallback()
            return self.hift(mel, cache_source, generators)
        rand_ini, gauss = self.hift.draw_noise(mel, generators)
        key = (mel.shape[0], mel.shape[2], cache_source.shape[2], str(mel.device))
        spec, source = self.run(
            key, (mel, cache_source, rand_ini, gauss),
            lambda m, c, r, g: self.hift.forward_spectrum(m, c, noise=(r, g)))
        return self.hift.istft(spec), source.clone()
