"""Executes a `StepPlan` on the model.

Steps of `ModelRunner.run(plan)`:
  1. Flatten the plan: token ids, positions and KV slot ids of every scheduled token,
     plus per-sequence query offsets, KV lengths and block tables (`AttnMetadata`).
  2. Pure decode steps with a captured graph size replay a CUDA graph (graphs.py).
     Everything else runs eagerly:
  3. Embed the ids, then overwrite the rows at multimodal positions with the sequence's
     `mm_embeds` (only the rows inside this step's chunk).
  4. Plan attention once, run the model inside the scoped forward context.
  5. Logits for the last row of every sequence that reached its last token; sample.
  6. Hidden rows for `return_hidden` sequences: the final-norm hidden state of every
     output token fed as input (one row per decode step), each returned once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.engine.attention import AttentionBackend, AttnMetadata, ForwardBatch, forward_batch
from pipeline.engine.graphs import DecodeGraphs
from pipeline.engine.kv_cache import KVCache
from pipeline.engine.sampling import Sampler
from pipeline.engine.scheduler import ScheduledSeq, StepPlan


@dataclass
class RunnerOutput:
    sampled: list[int]  # one id per plan entry with sample=True, in plan order
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> (n, H), CPU


@dataclass
class _FlatBatch:
    ids: list[int]
    positions: list[int]
    slots: list[int]
    qo_indptr: list[int]
    kv_lens: list[int]
    sample_rows: list[int]  # row index of the last token of each sampling sequence


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.graphs = graphs
        self.block_size = kv_cache.block_size
        self.scale = model.cfg.head_dim**-0.5
        self.sampler = Sampler()

    # -- 1) flatten --------------------------------------------------------------------
    def _flatten(self, plan: StepPlan) -> _FlatBatch:
        fb = _FlatBatch([], [], [], [0], [], [])
        bs = self.block_size
        for s in plan.seqs:
            seq = s.seq
            lo, hi = s.start, s.start + s.num_new
            fb.ids += seq.token_ids(lo, hi)
            fb.positions += range(lo, hi)
            fb.slots += [seq.block_table[p // bs] * bs + p % bs for p in range(lo, hi)]
            fb.qo_indptr.append(fb.qo_indptr[-1] + s.num_new)
            fb.kv_lens.append(hi)
            if s.sample:
                fb.sample_rows.append(fb.qo_indptr[-1] - 1)
        return fb

    def _meta(self, plan: StepPlan, fb: _FlatBatch) -> AttnMetadata:
        width = max(len(s.seq.block_table) for s in plan.seqs)
        bt = torch.zeros(len(plan.seqs), width, dtype=torch.int32)
        for i, s in enumerate(plan.seqs):
            bt[i, : len(s.seq.block_table)] = torch.tensor(s.seq.block_table, dtype=torch.int32)
        return AttnMetadata(
            qo_indptr=torch.tensor(fb.qo_indptr, dtype=torch.int32),
            kv_lens=torch.tensor(fb.kv_lens, dtype=torch.int32),
            block_tables=bt.to(self.device),
            block_tables_cpu=bt,
            slot_mapping=torch.tensor(fb.slots, dtype=torch.long).to(self.device),
            is_decode=plan.is_decode_only,
            block_size=self.block_size,
        )

    @staticmethod
    def _mm_rows(s: ScheduledSeq) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows within this chunk, embeds) of the multimodal slots inside the chunk."""
        seq = s.seq
        if seq.mm_positions is None or seq.mm_positions.numel() == 0:
            return None
        pos = seq.mm_positions
        inside = (pos >= s.start) & (pos < s.start + s.num_new)
        if not bool(inside.any()):
            return None
        return pos[inside] - s.start, seq.mm_embeds[inside]

    # -- run ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan) -> RunnerOutput:
        fb = self._flatten(plan)
        ids = torch.tensor(fb.ids, dtype=torch.long)
        positions = torch.tensor(fb.positions, dtype=torch.long)
        mm = [self._mm_rows(s) for s in plan.seqs]

        use_graph = (
            self.graphs is not None
            and plan.is_decode_only
            and all(m is None for m in mm)
            and self.graphs.bucket(len(plan.seqs)) is not None
        )
        if use_graph:
            # 2) CUDA graph: every row is a sampling row.
            hidden, logits = self.graphs.replay(
                ids.to(self.device),
                positions.to(self.device),
                torch.tensor(fb.slots, dtype=torch.long).to(self.device),
                fb.kv_lens,
                [s.seq.block_table for s in plan.seqs],
            )
            if not all(s.sample for s in plan.seqs):  # a 1-token recompute chunk samples nothing
                logits = logits[[i for i, s in enumerate(plan.seqs) if s.sample]]
        else:
            # 3) embeddings with multimodal rows spliced in
            embeds = self.model.embed(ids.to(self.device))  # (T, H)
            for s, m, lo in zip(plan.seqs, mm, fb.qo_indptr):
                if m is not None:
                    rows, vals = m
                    embeds[lo + rows.to(self.device)] = vals.to(self.device, embeds.dtype)
            # 4) attention plan + model
            meta = self._meta(plan, fb)
            self.backend.prepare(meta)
            with forward_batch(ForwardBatch(self.backend, meta, self.kv_cache.layers, self.scale)):
                hidden = self.model(embeds, positions.to(self.device))  # (T, H)
            logits = None

        # 5) sampling
        sampling = [s for s in plan.seqs if s.sample]
        sampled: list[int] = []
        if sampling:
            if logits is None:
                rows = torch.tensor(fb.sample_rows, device=self.device)
                logits = self.model.compute_logits(hidden[rows])  # (N, V)
            sampled = self.sampler(
                logits,
                [s.seq.sampling for s in sampling],
                [s.seq.all_ids for s in sampling],
                [s.seq.generator for s in sampling],
            )

        # 6) hidden rows of output tokens fed as input, each emitted once
        out = RunnerOutput(sampled)
        for s, lo in zip(plan.seqs, fb.qo_indptr):
            seq = s.seq
            if not seq.return_hidden:
                continue
            first = max(s.start, seq.num_prompt, seq.num_hidden_emitted)
            last = s.start + s.num_new
            if first < last:
                out.hidden[seq.request_id] = hidden[lo + first - s.start : lo + last - s.start].to(
                    "cpu"
                )
                seq.num_hidden_emitted = last
        return out
