"""CUDA graphs of whole LLM steps, on the project's GraphRunner (pipeline/graphs.py).

`LLMGraphRunner` is the one contract the model runner sees: `can_run(plan, ...)` says whether
a step has a captured graph, `decode` / `forward` replay it. Two kinds of graph lie behind it,
all captured at start (largest first, smaller ones reuse its pool memory):

- `DecodeGraphs`: pure-decode steps without multimodal rows, one graph per bucketed batch
  size and sampler variant, computing `embed -> layers -> norm -> lm_head -> sample_batch`
  over static buffers. The step's inputs (ids, positions, KV slots, FlashInfer's page table,
  every row's sampling parameters and penalty history) live in one `Staging` uploaded with
  one non-blocking copy; the noise rows are drawn on the device before the replay. Variants:
  `sampled=False` (penalty + argmax: every row greedy) and `sampled=True` (the full sampler).
- `PrefillGraphs`: every other step (prompts, chunks of them, prefills beside decodes,
  multimodal rows) of at most `GRAPH_TOKENS` tokens, one graph per (bucket of sequences,
  bucket of tokens), attention included (FlashInfer's prefill in its CUDA-graph mode). The
  embeddings are the input, the final-norm hidden rows the output; sampling runs eagerly.

Padded rows up to a bucket hold token 0 / a zero embedding at position 0, write their K/V
into the KV cache's scratch slot and attend over its scratch block. Attention metadata is
not captured: before each replay the key's FlashInfer wrapper is planned from the staged page
table (pinned host arrays, device indices), so planning never waits for the GPU. Only the
FlashInfer backend is capturable (the torch backend syncs to read lengths). Steps no graph
takes run eagerly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.thinker.llm_engine.attention import (
    AttnMetadata,
    FlashInferAttention,
    ForwardBatch,
    forward_batch,
    write_new_kv,
)
from pipeline.thinker.llm_engine.kv_cache import KVCache
from pipeline.thinker.llm_engine.scheduler import StepPlan
from pipeline.thinker.llm_engine.sampling import (
    SamplingTensors,
    pack_rows,
    sample_batch,
    sampling_fields,
)
from pipeline.graphs import GraphRunner

Fields = dict[str, tuple[torch.dtype, tuple[int, ...]]]

# Tokens of the largest whole-step graph: longer steps (a long prompt's first chunk) are
# GPU-bound and run eagerly.
GRAPH_TOKENS = 512


def default_graph_sizes(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to max_bs (max_bs itself always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
    return tuple(sorted(set(sizes)))


class Staging:
    """Named tensors that the host writes and the device reads: one host buffer (pinned on
    CUDA) and one device buffer of the same layout.

    A step writes its inputs through `host` (numpy views: cheap element writes), then
    `upload()` copies the whole buffer with one non-blocking copy; the device reads `dev`
    (torch views, fixed addresses: graph inputs). `host_t` are torch views of the host
    buffer, for APIs that copy from pinned memory themselves. `mark_consumed()` records
    the point after which the device no longer reads the host buffer, and
    `wait_consumed()` waits for it before the host writes the next step's inputs (it has
    long passed unless steps are launched ahead of the GPU)."""

    def __init__(self, fields: Fields, device: torch.device) -> None:
        spans, end = {}, 0
        for name, (dtype, shape) in fields.items():
            lo = -(-end // 8) * 8  # every view 8-byte aligned
            end = lo + dtype.itemsize * math.prod(shape)
            spans[name] = (lo, end)
        cuda = device.type == "cuda"
        self._host = torch.zeros(end, dtype=torch.uint8, pin_memory=cuda)
        self._dev = torch.zeros(end, dtype=torch.uint8, device=device)
        self.host_t, self.dev, self.host = {}, {}, {}
        for name, (dtype, shape) in fields.items():
            lo, hi = spans[name]
            self.host_t[name] = self._host[lo:hi].view(dtype).view(shape)
            self.dev[name] = self._dev[lo:hi].view(dtype).view(shape)
            self.host[name] = self.host_t[name].numpy()
        self._consumed = torch.cuda.Event() if cuda else None

    def upload(self) -> None:
        self._dev.copy_(self._host, non_blocking=True)

    def mark_consumed(self) -> None:
        if self._consumed is not None:
            self._consumed.record()

    def wait_consumed(self) -> None:
        if self._consumed is not None:
            self._consumed.synchronize()


def decode_fields(rows: int, max_pages: int) -> Fields:
    """A decode step's inputs besides sampling: one token per row, FlashInfer's page table,
    and the rows whose token is still pending on the host (filled from the device)."""
    long, i32 = torch.int64, torch.int32
    return {
        "input_ids": (long, (rows,)),
        "positions": (long, (rows,)),
        "slot_mapping": (long, (rows,)),
        "pending_rows": (long, (rows,)),
        "pending_src": (long, (rows,)),
        "kv_indptr": (i32, (rows + 1,)),
        "kv_last_page_len": (i32, (rows,)),
        "kv_indices": (i32, (max_pages,)),
    }


def page_table(
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    scratch_block: int,
    indptr: np.ndarray,
    indices: np.ndarray,
    last_page_len: np.ndarray,
) -> int:
    """FlashInfer's CSR page table (`AttnMetadata.paged_csr`) written into the given arrays,
    for len(indptr) - 1 rows: the real ones, then padded rows holding one token in the
    scratch block. Returns the number of indices written."""
    pad = len(indptr) - 1 - len(kv_lens)
    pages = [(n + block_size - 1) // block_size for n in kv_lens]
    indptr[0] = 0
    np.cumsum(pages + [1] * pad, out=indptr[1:])
    used = int(indptr[-1])
    indices[:used] = np.fromiter(
        itertools.chain(
            itertools.chain.from_iterable(t[:p] for t, p in zip(block_tables, pages)),
            [scratch_block] * pad,
        ),
        dtype=np.int32,
        count=used,
    )
    last_page_len[:] = [n - (p - 1) * block_size for n, p in zip(kv_lens, pages)] + [1] * pad
    return used


class DecodeGraphs:
    """Captures and replays the model's decode step with sampling inside the graph."""

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
        self.vocab = cfg.vocab_size
        rows = self.sizes[-1]
        self.staging = Staging(
            {**decode_fields(rows, backend.max_num_pages), **sampling_fields(rows, self.vocab)},
            device,
        )
        self.noise = torch.ones(rows, cfg.vocab_size, dtype=torch.float32, device=device)
        self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(rows, cfg.vocab_size, dtype=dtype, device=device)
        self.next_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self._num_indices = 0
        # The step runs on buffers it owns (no graph inputs), so the runner's warm-up on its
        # side stream only writes the scratch KV slot.
        self.runner = GraphRunner(max_graphs=2 * len(self.sizes), warmup_iters=1)

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

    def sampling_tensors(self, rows: int) -> SamplingTensors:
        return SamplingTensors.view(self.staging.dev, self.noise, rows)

    # -- one step: stage (host) -> upload -> [device fills] -> replay ---------------------
    def stage(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        kv_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> int:
        """Write a decode step's token inputs and page table for its bucket; returns the
        bucket. The caller writes the sampling rows [0, bucket) (`pack_rows`) and then
        calls `staging.upload()`. Waits first until the previous step's inputs were read."""
        n = len(ids)
        bucket = self.bucket(n)
        assert bucket is not None, f"batch {n} exceeds the largest captured graph {self.max_bs}"
        self.staging.wait_consumed()
        h = self.staging.host
        h["input_ids"][:n] = ids
        h["positions"][:n] = positions
        h["slot_mapping"][:n] = slots
        h["input_ids"][n:bucket] = 0
        h["positions"][n:bucket] = 0
        h["slot_mapping"][n:bucket] = self.kv_cache.scratch_slot
        self._num_indices = page_table(
            kv_lens,
            block_tables,
            self.kv_cache.block_size,
            self.kv_cache.scratch_block,
            h["kv_indptr"][: bucket + 1],
            h["kv_indices"],
            h["kv_last_page_len"][:bucket],
        )
        return bucket

    def fill_pending(self, count: int, prev_ids: torch.Tensor) -> None:
        """After the upload: rows `pending_rows[:count]` take their token (and their penalty
        history's newest id) from `prev_ids[pending_src[:count]]`, the ids the previous step
        sampled, still on the device."""
        d = self.staging.dev
        rows = d["pending_rows"][:count]
        vals = prev_ids.index_select(0, d["pending_src"][:count])
        d["input_ids"].index_copy_(0, rows, vals)
        d["history"][:, -1].index_copy_(0, rows, vals)

    def replay(self, bucket: int, sampled: bool) -> None:
        """Plan attention for the staged page table and replay the bucket's graph. Outputs:
        `hidden`, `logits`, `next_ids` rows [:bucket]. The plan reads pinned host arrays
        and device indices (the backend's `prepare` would copy pageable host tensors with
        a blocking copy, which waits for the GPU to drain)."""
        b, h = self.backend, self.staging.host_t
        b.graph_decode_wrapper(bucket).plan(
            h["kv_indptr"][: bucket + 1],
            self.staging.dev["kv_indices"][: self._num_indices],
            h["kv_last_page_len"][:bucket],
            b.num_qo_heads,
            b.num_kv_heads,
            b.head_dim,
            b.block_size,
            q_data_type=b.dtype,
            kv_data_type=b.dtype,
            non_blocking=True,
        )
        self.staging.mark_consumed()
        self.runner.run((bucket, sampled), (), fn=None)  # every graph was captured at start

    # -- capture -------------------------------------------------------------------------
    def _forward(self, bs: int, meta: AttnMetadata, sampled: bool) -> None:
        d = self.staging.dev
        fb = ForwardBatch(self.backend, meta, self.kv_cache.layers, self.scale)
        with forward_batch(fb):
            h = self.model(self.model.embed(d["input_ids"][:bs]), d["positions"][:bs])
        self.hidden[:bs].copy_(h)
        logits = self.model.compute_logits(h)
        self.logits[:bs].copy_(logits)
        self.next_ids[:bs].copy_(sample_batch(logits, self.sampling_tensors(bs), sampled))

    def _padding_meta(self, bs: int) -> AttnMetadata:
        """Decode metadata of `bs` padded rows, for planning at capture."""
        bt = torch.full((bs, 1), self.kv_cache.scratch_block, dtype=torch.int32)
        return AttnMetadata(
            qo_indptr=torch.arange(bs + 1, dtype=torch.int32),
            kv_lens=torch.ones(bs, dtype=torch.int32),
            block_tables=bt,  # only read on the host by FlashInfer's plan
            block_tables_cpu=bt,
            slot_mapping=self.staging.dev["slot_mapping"][:bs],
            is_decode=True,
            block_size=self.kv_cache.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture both variants of every bucket, largest first (smaller ones reuse its
        pool memory)."""
        h = self.staging.host  # every row padding
        h["input_ids"][:] = 0
        h["positions"][:] = 0
        h["slot_mapping"][:] = self.kv_cache.scratch_slot
        pack_rows(h, [None] * self.max_bs, [()] * self.max_bs, self.vocab)
        self.staging.upload()
        for bs in sorted(self.sizes, reverse=True):
            meta = self._padding_meta(bs)
            self.backend.use_graph_wrapper(bs)
            try:
                self.backend.prepare(meta)
                for sampled in (False, True):
                    self.runner.add(
                        (bs, sampled), lambda bs=bs, m=meta, s=sampled: self._forward(bs, m, s)
                    )
            finally:
                self.backend.use_graph_wrapper(None)
        torch.cuda.synchronize()


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """16, 32, 64, ... up to max_tokens (max_tokens itself always included)."""
    sizes, n = [], 16
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return (*sizes, max_tokens)


def prefill_fields(max_seqs: int, max_tokens: int, max_pages: int) -> Fields:
    """A prefill graph step's inputs besides its embeddings: positions and KV slots per row,
    FlashInfer's query offsets and page table per sequence."""
    long, i32 = torch.int64, torch.int32
    return {
        "positions": (long, (max_tokens,)),
        "slot_mapping": (long, (max_tokens,)),
        "qo_indptr": (i32, (max_seqs + 1,)),
        "kv_indptr": (i32, (max_seqs + 1,)),
        "kv_last_page_len": (i32, (max_seqs,)),
        "kv_indices": (i32, (max_pages,)),
    }


class _PlannedPrefill:
    """A prefill graph's attention (the AttentionBackend interface): the new K/V written at
    the staged slots, then the key's FlashInfer prefill wrapper, planned before each
    replay, into a static output. FlashInfer writes only the planned rows, so the rows
    past them keep earlier, finite values (never uninitialized memory)."""

    name = "flashinfer-prefill-graph"

    def __init__(self, wrapper, out: torch.Tensor) -> None:
        self.wrapper, self.out = wrapper, out

    def prepare(self, meta: AttnMetadata) -> None:
        pass

    def forward(self, kv, q, k, v, meta, scale, rows=None):
        assert rows is not None, "a prefill graph writes K/V at the rows its ForwardBatch computed"
        write_new_kv(kv, meta, rows, k, v)
        return self.wrapper.run(q.contiguous(), kv, out=self.out[: q.shape[0]])


class PrefillGraphs:
    """Whole-step CUDA graphs for the steps decode graphs do not take (prompts, chunks of
    them, new turns over a cached history, prefills beside decodes, multimodal rows), per
    (bucket of sequences, bucket of tokens), attention included.

    Why: an eager short prefill is host-bound (every layer's attention call, K/V write and
    op launches), a graph's wall time is its kernels'. FlashInfer's prefill in its
    CUDA-graph mode takes a fixed number of sequences and at most the rows of its first
    plan, and a plan before each replay rewrites its buffers.

    Contract:
    - a step of b sequences and T tokens runs in the key (B, n): B the smallest batch bucket
      >= b, n the smallest token bucket >= T + B - b; the embeddings (multimodal rows
      spliced in) are an input, the final-norm hidden rows [:T] the output (`hidden`, read
      before the next step);
    - padding: B - b sequences of one row each (rows T, T + 1, ...), attending over the KV
      cache's scratch block, as decode graphs pad; rows up to n after them are planned for
      no sequence. Every padded row has a zero embedding at position 0 and writes its K/V
      into the scratch slot. Every op but attention works row by row, so padding never
      reaches a real row. A GEMM over n rows may pick another kernel than over T, and
      FlashInfer's graph mode schedules attention its own way (its FA2 kernels always split
      the keys): reordered sums, bounded by the tests against the plain forward;
    - the host stages positions, slots and the page table in one pinned buffer (`Staging`),
      uploads it with one copy, and plans the key's wrapper from it without a sync.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: FlashInferAttention,
        max_tokens: int,
        batch_sizes: tuple[int, ...],
        scale: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not isinstance(backend, FlashInferAttention):
            raise TypeError("prefill graphs need the flashinfer attention backend")
        cfg = model.cfg
        self.model, self.kv_cache, self.backend, self.scale = model, kv_cache, backend, scale
        self.batch_sizes = tuple(sorted(b for b in batch_sizes if b <= max_tokens))
        self.buckets = token_buckets(max_tokens)
        kw = {"dtype": dtype, "device": device}
        fields = prefill_fields(self.batch_sizes[-1], max_tokens, backend.max_num_pages)
        self.staging = Staging(fields, device)
        self.x = torch.zeros(max_tokens, cfg.hidden_size, **kw)
        self.hidden = torch.zeros(max_tokens, cfg.hidden_size, **kw)
        self.out = torch.zeros(max_tokens, cfg.num_attention_heads, cfg.head_dim, **kw)
        self.keys = [(b, n) for b in self.batch_sizes for n in self.buckets if b <= n]
        self.runner = GraphRunner(max_graphs=len(self.keys), warmup_iters=1)
        self.steps = 0  # observability: steps run as prefill graphs

    def key(self, seqs: int, tokens: int) -> tuple[int, int] | None:
        """The graph a step of `seqs` sequences and `tokens` tokens replays; None: none."""
        b = next((b for b in self.batch_sizes if b >= seqs), None)
        if b is None:
            return None
        n = next((n for n in self.buckets if n >= tokens + b - seqs), None)
        return None if n is None else (b, n)

    def _stage(
        self,
        key: tuple[int, int],
        qo_indptr: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        kv_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> int:
        """Write the key's inputs for the real sequences and rows, then the padding, into
        the host buffer; returns the number of page indices."""
        (b, n), seqs, t = key, len(kv_lens), len(positions)
        h, kv = self.staging.host, self.kv_cache
        h["positions"][:t] = positions
        h["positions"][t:n] = 0
        h["slot_mapping"][:t] = slots
        h["slot_mapping"][t:n] = kv.scratch_slot
        h["qo_indptr"][: seqs + 1] = qo_indptr
        h["qo_indptr"][seqs + 1 : b + 1] = range(t + 1, t + 1 + b - seqs)  # one row each
        return page_table(
            kv_lens,
            block_tables,
            kv.block_size,
            kv.scratch_block,
            h["kv_indptr"][: b + 1],
            h["kv_indices"],
            h["kv_last_page_len"][:b],
        )

    def _plan(self, key: tuple[int, int], used: int) -> None:
        """Plan the key's wrapper from the staged host arrays (pinned: no blocking copy) and
        the uploaded page indices."""
        (b, _), host, bk = key, self.staging.host_t, self.backend
        bk.graph_prefill_wrapper(*key).plan(
            host["qo_indptr"][: b + 1],
            host["kv_indptr"][: b + 1],
            self.staging.dev["kv_indices"][:used],
            host["kv_last_page_len"][:b],
            bk.num_qo_heads,
            bk.num_kv_heads,
            bk.head_dim,
            bk.block_size,
            causal=True,
            q_data_type=bk.dtype,
            kv_data_type=bk.dtype,
            non_blocking=True,
        )

    def _forward(self, key: tuple[int, int]) -> None:
        """The model over rows [:n] of the buffers (captured as the key's graph)."""
        (b, n), d, kv = key, self.staging.dev, self.kv_cache
        meta = AttnMetadata(  # only the slots are read inside: the wrapper was planned
            qo_indptr=torch.zeros(b + 1, dtype=torch.int32),
            kv_lens=torch.ones(b, dtype=torch.int32),
            block_tables=d["kv_indices"][None, :1],
            block_tables_cpu=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=d["slot_mapping"][:n],
            is_decode=False,
            block_size=kv.block_size,
        )
        attention = _PlannedPrefill(self.backend.graph_prefill_wrapper(*key), self.out)
        with forward_batch(ForwardBatch(attention, meta, kv.layers, self.scale)):
            h = self.model(self.x[:n], d["positions"][:n])
        self.hidden[:n].copy_(h)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every key, largest first (smaller ones reuse its pool memory), each planned first
        for all its n rows (its first sequence takes those the other B - 1 leave), padding in
        the scratch block: the most rows it takes."""
        kv = self.kv_cache
        for b, n in sorted(self.keys, reverse=True):
            first = n - (b - 1)
            pages = [kv.scratch_block] * -(-first // kv.block_size)
            used = self._stage(
                (b, n), [0, first], [0] * first, [kv.scratch_slot] * first, [first], [pages]
            )
            self.staging.upload()
            self._plan((b, n), used)
            self.runner.add((b, n), lambda key=(b, n): self._forward(key))
        torch.cuda.synchronize()

    def forward(
        self,
        key: tuple[int, int],
        embeds: torch.Tensor,
        qo_indptr: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        kv_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """A step of len(kv_lens) sequences (rows qo_indptr[i]:qo_indptr[i + 1] of
        `embeds`, their KV covering kv_lens[i] tokens after the step through
        block_tables[i]) in the graph of `key` (`self.key`) -> final-norm hidden (T, H), a
        view of `hidden`."""
        t, n = embeds.shape[0], key[1]
        self.staging.wait_consumed()  # the previous step's plan has read the host buffer
        used = self._stage(key, qo_indptr, positions, slots, kv_lens, block_tables)
        self.staging.upload()
        self.x[:t].copy_(embeds)
        self.x[t:n].zero_()
        self._plan(key, used)
        self.staging.mark_consumed()
        self.steps += 1
        self.runner.run(key, (), fn=None)  # every key was captured at start
        return self.hidden[:t]


class LLMGraphRunner:
    """The LLM's CUDA graphs behind one contract: `can_run(plan, media)` says whether a step
    replays a graph; a decode step (`is_decode`) replays its `decode` graph (sampling
    inside), any other the whole-step graph of its size through `forward` (embeddings in,
    final-norm hidden rows out). Either part may be absent (tests build one alone); `build`
    captures both for the engine."""

    def __init__(self, decode: DecodeGraphs | None = None, prefill: PrefillGraphs | None = None):
        self.decode, self.prefill = decode, prefill

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: FlashInferAttention,
        max_seqs: int,
        dtype: torch.dtype,
        device: torch.device,
        guest_rows: int = 0,
    ) -> LLMGraphRunner:
        """Decode graphs up to `max_seqs` + `guest_rows` rows (runner.GuestRows beside a
        full batch), whole-step graphs up to `max_seqs` sequences."""
        scale = model.cfg.head_dim**-0.5
        sizes = default_graph_sizes(max_seqs)
        decode = DecodeGraphs(model, kv_cache, backend, default_graph_sizes(max_seqs + guest_rows),
                              scale, dtype, device)
        decode.capture()
        prefill = PrefillGraphs(
            model, kv_cache, backend, GRAPH_TOKENS, sizes, scale, dtype, device
        )
        prefill.capture()
        return cls(decode, prefill)

    def is_decode(self, plan: StepPlan, media: bool, guests: int = 0) -> bool:
        """The step is one for the decode graphs (`media`: it has multimodal rows; `guests`:
        decode rows beside the plan's, runner.GuestRows)."""
        rows = len(plan.seqs) + guests
        return (
            self.decode is not None
            and rows > 0
            and (plan.is_empty or plan.is_decode_only)
            and not media
            and self.decode.bucket(rows) is not None
        )

    def can_run(self, plan: StepPlan, media: bool) -> bool:
        """The step has a graph: a decode graph, or a whole-step graph of its size."""
        if self.is_decode(plan, media):
            return True
        tokens = sum(s.num_new for s in plan.seqs)
        return self.prefill is not None and self.prefill.key(len(plan.seqs), tokens) is not None

    def forward(
        self,
        plan: StepPlan,
        embeds: torch.Tensor,
        qo_indptr: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        kv_lens: Sequence[int],
    ) -> torch.Tensor:
        """A step `can_run` took but not `is_decode`, in its whole-step graph: the step's
        flattened rows (`PrefillGraphs.forward`) -> final-norm hidden (T, H)."""
        key = self.prefill.key(len(plan.seqs), embeds.shape[0])
        tables = [s.seq.block_table for s in plan.seqs]
        return self.prefill.forward(key, embeds, qo_indptr, positions, slots, kv_lens, tables)

    @property
    def decode_replays(self) -> int:
        return self.decode.num_replays if self.decode is not None else 0

    @property
    def prefill_steps(self) -> int:
        return self.prefill.steps if self.prefill is not None else 0
