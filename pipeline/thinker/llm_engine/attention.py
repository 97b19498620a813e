"""Paged attention backends and the scoped forward context the model reads them through.

One step of the engine = one flat batch of T query tokens from B sequences. The runner
builds an `AttnMetadata` (CPU, then moved), asks the backend to `prepare` it (FlashInfer
plans here, once per step for all layers), and runs the model inside
`with forward_batch(ForwardBatch(...)):`. Every attention layer then calls
`current_forward_batch().attend(layer, q, k, v)`, which writes this step's K/V into the
paged cache and attends over the cached prefix + the new tokens. A layer that wrote its K/V
itself at the batch's `rows` (the Thinker's fused QK-norm + RoPE + K/V kernel) passes
k = v = None: every backend attends over the cache alone, never over k / v.

Backends (same interface, `AttentionBackend`):
- `TorchAttention`: gathers the paged KV with plain indexing and runs SDPA. Works on CPU
  and CUDA; the reference for tests. Not CUDA-graph capturable.
- `FlashInferAttention`: BatchPrefillWithPagedKVCacheWrapper for steps with any prefill
  rows, BatchDecodeWithPagedKVCacheWrapper for pure decode steps, plus one
  CUDA-graph decode wrapper per captured batch size and one CUDA-graph prefill wrapper per
  bucket of sequences and tokens (see graphs.py). flashinfer is imported lazily.

KV layout: per layer (num_blocks, 2, block_size, num_kv_heads, head_dim), FlashInfer's
"NHD" paged layout, with [:, 0] = K and [:, 1] = V.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Step metadata


@dataclass
class AttnMetadata:
    """Attention layout of one step. Tensors live on the compute device unless noted.

    Sequence b owns query rows qo_indptr[b]:qo_indptr[b+1] of the flat batch; its KV
    after this step covers kv_lens[b] tokens, the last qo_len of which are the new rows
    (bottom-right aligned causal mask)."""

    qo_indptr: torch.Tensor  # (B+1,) int32, CPU: row offsets of each sequence
    kv_lens: torch.Tensor  # (B,) int32, CPU: cached + new tokens per sequence
    block_tables: torch.Tensor  # (B, max_blocks) int32 on device, padded with 0
    block_tables_cpu: torch.Tensor  # the same table on CPU (FlashInfer plans from host data)
    slot_mapping: torch.Tensor  # (T,) int64 on device: block * block_size + offset per row
    is_decode: bool  # every sequence has exactly one query row
    block_size: int

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.numel())

    def paged_csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's CSR page table: (kv_indptr (B+1,), kv_indices (nnz,), last_page_len (B,)),
        all int32 on CPU."""
        pages = (self.kv_lens + self.block_size - 1) // self.block_size  # (B,)
        kv_indptr = torch.zeros(self.batch_size + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        bt = self.block_tables_cpu
        cols = torch.arange(bt.shape[1])
        kv_indices = bt[cols.unsqueeze(0) < pages.unsqueeze(1)].to(torch.int32)  # row-major
        last = self.kv_lens - (pages - 1) * self.block_size
        return kv_indptr, kv_indices, last.to(torch.int32)


def kv_rows(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """(2, T): the rows of each slot's K and V in a layer's cache viewed as rows of
    (Hkv, D), i.e. (num_blocks * 2 * block, Hkv, D). The same for every layer, so a step
    computes them once."""
    k = (slots // block_size) * (2 * block_size) + slots % block_size
    return torch.stack((k, k + block_size))


def write_kv(kv: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Copy new K/V into one layer's paged cache at `kv_rows` (graph capturable).

    kv: (num_blocks, 2, block, Hkv, D); rows: (2, T); k, v: (T, Hkv, D)."""
    flat = kv.view(-1, *kv.shape[3:])
    flat.index_copy_(0, rows[0], k.to(kv.dtype))
    flat.index_copy_(0, rows[1], v.to(kv.dtype))


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttnMetadata) -> None:
        """Plan once per step, before the model runs."""

    def forward(
        self,
        kv: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: AttnMetadata,
        scale: float,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v at meta.slot_mapping (`rows`: its `kv_rows`, computed here when None;
        k = v = None: already written there), then attend. q: (T, Hq, D) -> (T, Hq, D)."""


# ---------------------------------------------------------------------------------------
# Scoped forward context


@dataclass
class ForwardBatch:
    """What attention layers need during one model forward. Built inside the forward (a
    captured graph recomputes `rows` from its staged slots on every replay)."""

    backend: AttentionBackend
    meta: AttnMetadata
    kv_layers: list[torch.Tensor]  # per layer (num_blocks, 2, block, Hkv, D)
    scale: float

    def __post_init__(self) -> None:
        self.rows = kv_rows(self.meta.slot_mapping, self.meta.block_size)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of `layer_idx` over its cache, after writing k/v at `rows` (None: the
        layer wrote them already)."""
        kv = self.kv_layers[layer_idx]
        return self.backend.forward(kv, q, k, v, self.meta, self.scale, self.rows)


class _ForwardContext:
    def __init__(self) -> None:
        self.batch: ForwardBatch | None = None

    @contextmanager
    def forward_batch(self, batch: ForwardBatch) -> Iterator[ForwardBatch]:
        assert self.batch is None, "nested forward_batch is not allowed"
        self.batch = batch
        try:
            yield batch
        finally:
            self.batch = None  # never leave a step's metadata behind


_CTX = _ForwardContext()


def forward_batch(batch: ForwardBatch):
    """`with forward_batch(fb): model(...)` - the only way attention sees a KV cache."""
    return _CTX.forward_batch(batch)


def current_forward_batch() -> ForwardBatch | None:
    return _CTX.batch


def _rows(meta: AttnMetadata, rows: torch.Tensor | None) -> torch.Tensor:
    return kv_rows(meta.slot_mapping, meta.block_size) if rows is None else rows


def write_new_kv(kv, meta, rows, k, v) -> None:
    """The backends' K/V write: k/v at the step's rows, unless the layer wrote them (None)."""
    if k is not None:
        write_kv(kv, _rows(meta, rows), k, v)


# ---------------------------------------------------------------------------------------
# Torch backend


class TorchAttention:
    """Reference paged attention with plain torch ops (CPU or CUDA)."""

    name = "torch"

    def prepare(self, meta: AttnMetadata) -> None:
        pass

    def forward(self, kv, q, k, v, meta, scale, rows=None):
        write_new_kv(kv, meta, rows, k, v)
        if meta.is_decode:
            return self._decode(kv, q, meta, scale)
        return self._prefill(kv, q, meta, scale)

    @staticmethod
    def _gather(kv: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(nb,) block ids -> K, V of shape (nb * block, Hkv, D)."""
        pages = kv[block_table]  # (nb, 2, block, Hkv, D)
        k = pages[:, 0].flatten(0, 1)
        v = pages[:, 1].flatten(0, 1)
        return k, v

    def _decode(self, kv, q, meta, scale):
        # One query per sequence: pad every sequence to the longest block table, mask the tail.
        B = meta.batch_size
        pages = kv[meta.block_tables.long()]  # (B, nb, 2, block, Hkv, D)
        k = pages[:, :, 0].flatten(1, 2)  # (B, L, Hkv, D)
        v = pages[:, :, 1].flatten(1, 2)
        L = k.shape[1]
        kv_lens = meta.kv_lens.to(q.device)
        mask = torch.arange(L, device=q.device).unsqueeze(0) < kv_lens.unsqueeze(1)  # (B, L)
        o = F.scaled_dot_product_attention(
            q.view(B, 1, q.shape[1], q.shape[2]).transpose(1, 2).float(),  # (B, Hq, 1, D)
            k.transpose(1, 2).float(),
            v.transpose(1, 2).float(),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(1, 2).reshape(q.shape).to(q.dtype)

    def _prefill(self, kv, q, meta, scale):
        out = torch.empty_like(q)
        indptr = meta.qo_indptr.tolist()
        kv_lens = meta.kv_lens.tolist()
        for b in range(meta.batch_size):
            lo, hi, n_kv = indptr[b], indptr[b + 1], kv_lens[b]
            n_q = hi - lo
            n_blocks = (n_kv + meta.block_size - 1) // meta.block_size
            k, v = self._gather(kv, meta.block_tables[b, :n_blocks].long())
            k, v = k[:n_kv], v[:n_kv]
            # Bottom-right causal: query i sits at absolute position n_kv - n_q + i.
            qpos = torch.arange(n_kv - n_q, n_kv, device=q.device)
            mask = torch.arange(n_kv, device=q.device).unsqueeze(0) <= qpos.unsqueeze(1)
            o = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1).float(),
                k.transpose(0, 1).float(),
                v.transpose(0, 1).float(),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[lo:hi] = o.transpose(0, 1).to(q.dtype)
        return out


# ---------------------------------------------------------------------------------------
# FlashInfer backend


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "FlashInfer's attention needs the flashinfer-python package (0.7.2.post1 is known "
            f"to work; see docs/gpu.md) ({e})"
        ) from e
    return flashinfer


def flashinfer_available() -> bool:
    try:
        import_flashinfer()
        return True
    except ImportError:
        return False


class FlashInferAttention:
    """FlashInfer paged attention. `prepare` plans the right wrapper once per step;
    `forward` writes K/V with index_copy_ and runs the planned wrapper for each layer.

    For CUDA graphs, `graph_decode_wrapper(bs)` returns a per-batch-size decode wrapper
    whose metadata buffers are static; `use_graph_wrapper(bs)` routes the next decode
    plans/runs to it; `graph_prefill_wrapper(seqs, tokens)` is the same for prefill steps,
    planned and run by graphs.PrefillGraphs itself (see graphs.py)."""

    name = "flashinfer"

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        workspace_bytes: int = 128 * 1024 * 1024,
    ) -> None:
        fi = import_flashinfer()
        self._fi = fi
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.max_num_pages = max_num_pages
        self.dtype, self.device = dtype, device
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._graph_wrappers: dict[int, object] = {}
        self._prefill_graph_wrappers: dict[tuple[int, int], object] = {}
        self._graph_bs: int | None = None  # when set, decode steps use that graph wrapper
        self._active = None

    # -- CUDA-graph hooks ------------------------------------------------------------
    def graph_decode_wrapper(self, bs: int):
        if bs not in self._graph_wrappers:
            self._graph_wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(
                    self.max_num_pages, dtype=torch.int32, device=self.device
                ),
                paged_kv_last_page_len_buffer=torch.zeros(
                    bs, dtype=torch.int32, device=self.device
                ),
            )
        return self._graph_wrappers[bs]

    def use_graph_wrapper(self, bs: int | None) -> None:
        self._graph_bs = bs

    def graph_prefill_wrapper(self, seqs: int, tokens: int):
        """A prefill wrapper in FlashInfer's CUDA-graph mode for `seqs` sequences of at most
        `tokens` query rows in all (graphs.PrefillGraphs: one per key). Its first plan fixes
        the most rows it takes, and so its grid and tiles; later plans rewrite its buffers."""
        key = (seqs, tokens)
        if key not in self._prefill_graph_wrappers:
            i32 = {"dtype": torch.int32, "device": self.device}
            self._prefill_graph_wrappers[key] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(seqs + 1, **i32),
                paged_kv_indptr_buf=torch.zeros(seqs + 1, **i32),
                paged_kv_indices_buf=torch.zeros(self.max_num_pages, **i32),
                paged_kv_last_page_len_buf=torch.zeros(seqs, **i32),
            )
        return self._prefill_graph_wrappers[key]

    # -- step --------------------------------------------------------------------------
    def prepare(self, meta: AttnMetadata) -> None:
        kv_indptr, kv_indices, last_page_len = meta.paged_csr()
        common = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        if meta.is_decode:
            wrapper = (
                self.decode if self._graph_bs is None else self.graph_decode_wrapper(self._graph_bs)
            )
            wrapper.plan(
                kv_indptr,
                kv_indices.to(self.device),
                last_page_len,
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                **common,
            )
        else:
            wrapper = self.prefill
            wrapper.plan(
                meta.qo_indptr,
                kv_indptr,
                kv_indices.to(self.device),
                last_page_len,
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                causal=True,
                **common,
            )
        self._active = wrapper

    def forward(self, kv, q, k, v, meta, scale, rows=None):
        write_new_kv(kv, meta, rows, k, v)
        # sm_scale defaults to 1/sqrt(head_dim), which is Qwen3's scale.
        return self._active.run(q.contiguous(), kv)


def make_backend(
    device: torch.device,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_num_pages: int,
    dtype: torch.dtype,
) -> AttentionBackend:
    """FlashInfer's paged attention on CUDA when it imports, else torch's. CUDA without
    FlashInfer still serves, on the torch backend, but says so: that backend captures no
    CUDA graph, so every step runs eagerly, several times slower."""
    if device.type != "cuda":
        return TorchAttention()
    try:
        import_flashinfer()
    except ImportError as e:
        log.warning("no FlashInfer on CUDA: the LLM's attention runs on the torch backend, "
                    "several times slower (no CUDA graphs): %s", e)
        return TorchAttention()
    return FlashInferAttention(
        num_qo_heads, num_kv_heads, head_dim, block_size, max_num_pages, dtype, device
    )
