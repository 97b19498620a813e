"""CUDA graphs of the vocoders, on the project's one graph mechanism (pipeline/graphs.py):
the CosyVoice2 HiFT (`HiFTGraphRunner`) and the causal CosyVoice3 vocoder
(`CausalVocoderGraphs`). The flow's graphs are the slot-pool step's (engine.py).

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
from dataclasses import replace

import torch

from pipeline.code2wav.causal_hift import CausalVocoderState, draw_noise, plan_chunk, vocode_chunk
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


class CausalVocoderGraphs(GraphRunner):
    """CUDA graphs of the causal vocoder's chunk (`causal_hift.vocode_chunk`), a drop-in for
    it. Which windows a chunk runs depends only on the states' `key()`, the chunk's frames and
    `last`, so key = (batch, state key, frames, last): the graph replays the same windows on
    new tensors. The noise is drawn eagerly (`draw_noise`, the same draws) and fed in; the
    counters are host ints advanced by `plan_chunk`. Anything else runs eagerly.

    A stream's last chunk has any length up to a full window, so last chunks come in many
    keys, each seen once a turn: with `capture_last` off (the engine's default once it has
    captured the common ones at warm-up) a last chunk whose key is not captured runs eagerly
    (slower than a replay, but far faster than a capture, which every stream of the step
    would wait for)."""

    def __init__(self, vocoder, batch_sizes: Sequence[int], max_graphs: int = 32):
        super().__init__(max_graphs)
        self.vocoder, self.batch_sizes = vocoder, tuple(batch_sizes)
        self.capture_last = True

    def _eligible(self, mel: torch.Tensor, states) -> bool:
        return mel.is_cuda and len(states) in self.batch_sizes

    @torch.inference_mode()
    def __call__(self, states, mel, last, generators=None):
        b, frames, s0 = len(states), mel.shape[2], states[0]
        key = (b, s0.key(), frames, last)
        if not self._eligible(mel, states) or (last and not self.capture_last
                                               and key not in self):
            self.fallback()
            return vocode_chunk(self.vocoder, states, mel, last, generators=generators)
        noise = draw_noise(self.vocoder, states, frames, last, generators)
        batch = CausalVocoderState.cat(states) if b > 1 else s0

        def step(m, src, phase, fresh, nz):
            rows = [replace(s0, mel=m[i : i + 1], source=src[i : i + 1], phase=phase[i : i + 1])
                    for i in range(b)]
            out, new = vocode_chunk(self.vocoder, rows, fresh, last, noise=nz)
            return (out, *(torch.cat([getattr(s, n) for s in new]) for n in
                           ("mel", "source", "phase")))

        out, m, src, phase = self.run(key, (batch.mel, batch.source, batch.phase, mel, noise),
                                      step)
        _, (received, sourced, emitted) = plan_chunk(self.vocoder, s0, frames, last)
        new = [
            replace(s, mel=m[i : i + 1].clone(), source=src[i : i + 1].clone(),
                    phase=phase[i : i + 1].clone(), received=s.received + received - s0.received,
                    sourced=s.sourced + sourced - s0.sourced,
                    emitted=s.emitted + emitted - s0.emitted, finalized=last)
            for i, s in enumerate(states)
        ]
        return out.clone(), new
