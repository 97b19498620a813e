"""CUDA graphs for pure-decode steps of the LLM, on the project's GraphRunner (pipeline/graphs.py).

Contract (one graph per bucketed batch size, captured at start, largest first):
- `GraphBuffers`: static input/output tensors sized for the largest bucket. A replay
  copies the real rows in, pads the rest (token 0 at position 0 writing to the KV
  cache's scratch slot, attending over the scratch block), replays, and reads
  rows [:bs] back.
- Attention metadata is not captured: before each replay the backend re-plans the
  bucket's FlashInfer decode wrapper, whose indptr/indices/last-page buffers are static.
- Only the FlashInfer backend is capturable (the torch backend syncs to read lengths).
- Prefill and mixed steps, steps with multimodal rows, and batches above the largest
  bucket run eagerly. `enforce_eager` in the engine config turns graphs off entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine.attention import AttnMetadata, FlashInferAttention, ForwardBatch, forward_batch
from pipeline.engine.kv_cache import KVCache
from pipeline.graphs import GraphRunner


def default_graph_sizes(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to max_bs (max_bs itself always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
    return tuple(sorted(set(sizes)))


@dataclass
class GraphBuffers:
    input_ids: torch.Tensor  # (max_bs,) int64
    positions: torch.Tensor  # (max_bs,) int64
    slot_mapping: torch.Tensor  # (max_bs,) int64
    hidden: torch.Tensor  # (max_bs, H) final-norm hidden of each row
    logits: torch.Tensor  # (max_bs, V)

    @classmethod
    def allocate(
        cls, max_bs: int, hidden_size: int, vocab: int, dtype: torch.dtype, device: torch.device
    ) -> GraphBuffers:
        def z(*shape: int, dt: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        return cls(
            z(max_bs),
            z(max_bs),
            z(max_bs),
            z(max_bs, hidden_size, dt=dtype),
            z(max_bs, vocab, dt=dtype),
        )

    def copy_inputs(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pad_slot: int
    ) -> None:
        n = ids.numel()
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(pad_slot)


class DecodeGraphs:
    """Captures and replays the model's decode forward (embed -> layers -> norm -> lm_head)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: FlashInferAttention,
        sizes: tuple[int, ...],
        scale: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not isinstance(backend, FlashInferAttention):
            raise TypeError("CUDA graphs need the flashinfer attention backend")
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.sizes = tuple(sorted(sizes))
        self.scale = scale
        self.device = device
        cfg = model.cfg
        self.buf = GraphBuffers.allocate(
            self.sizes[-1], cfg.hidden_size, cfg.vocab_size, dtype, device
        )
        # The step runs on buffers it owns (no graph inputs), so the runner's warm-up on its
        # side stream only writes the scratch KV slot.
        self.runner = GraphRunner(max_graphs=len(self.sizes), warmup_iters=1)

    @property
    def num_replays(self) -> int:
        """Observability: how many steps ran as graphs."""
        return self.runner.replays

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def bucket(self, bs: int) -> int | None:
        for s in self.sizes:
            if s >= bs:
                return s
        return None

    def padded_meta(
        self, bs_real: int, bucket: int, kv_lens: list[int], block_tables: list[list[int]]
    ) -> AttnMetadata:
        """Decode metadata for `bucket` rows; pad rows attend over the scratch block."""
        scratch = self.kv_cache.scratch_block
        lens = list(kv_lens) + [1] * (bucket - bs_real)
        tables = [list(t) for t in block_tables] + [[scratch]] * (bucket - bs_real)
        width = max(len(t) for t in tables)
        bt = torch.zeros(bucket, width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return AttnMetadata(
            qo_indptr=torch.arange(bucket + 1, dtype=torch.int32),
            kv_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=bt,  # only read on the host by FlashInfer's plan
            block_tables_cpu=bt,
            slot_mapping=self.buf.slot_mapping[:bucket],
            is_decode=True,
            block_size=self.kv_cache.block_size,
        )

    def _forward(self, bs: int, meta: AttnMetadata) -> None:
        fb = ForwardBatch(self.backend, meta, self.kv_cache.layers, self.scale)
        with forward_batch(fb):
            h = self.model(self.model.embed(self.buf.input_ids[:bs]), self.buf.positions[:bs])
        self.buf.hidden[:bs].copy_(h)
        self.buf.logits[:bs].copy_(self.model.compute_logits(h))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its pool memory)."""
        for bs in sorted(self.sizes, reverse=True):
            meta = self.padded_meta(0, bs, [], [])
            self.buf.copy_inputs(
                self.buf.input_ids[:0],
                self.buf.positions[:0],
                self.buf.slot_mapping[:0],
                self.kv_cache.scratch_slot,
            )
            self.backend.use_graph_wrapper(bs)
            try:
                self.backend.prepare(meta)
                self.runner.add(bs, lambda bs=bs, meta=meta: self._forward(bs, meta))
            finally:
                self.backend.use_graph_wrapper(None)
        torch.cuda.synchronize()

    def replay(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_lens: list[int],
        block_tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one decode step of len(ids) sequences. Returns (hidden, logits) rows [:bs]
        (views into the static buffers: consume or clone before the next replay)."""
        bs = ids.numel()
        bucket = self.bucket(bs)
        assert bucket is not None, f"batch {bs} exceeds the largest captured graph {self.max_bs}"
        self.buf.copy_inputs(ids, positions, slots, self.kv_cache.scratch_slot)
        meta = self.padded_meta(bs, bucket, kv_lens, block_tables)
        self.backend.use_graph_wrapper(bucket)
        try:
            self.backend.prepare(meta)
        finally:
            self.backend.use_graph_wrapper(None)
        self.runner.run(bucket, (), fn=None)  # every bucket was captured at start
        return self.buf.hidden[:bs], self.buf.logits[:bs]
