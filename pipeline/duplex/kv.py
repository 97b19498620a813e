"""Duplex sessions' Thinker KV: pages of a paged KV pool (`llm_engine`'s layout, per layer
(blocks, 2, block_size, Hkv, D)), so that the units of many sessions run through one
attention call a layer (`forward_sessions`: FlashInfer on CUDA, torch elsewhere), and in a
server the sessions' K/V are the Thinker engine's own blocks: one budget for chat turns and
duplex sessions, a session's blocks back in the pool at its close.

`KVPages` is the pool: the KV tensor, the block manager handing out its blocks, and an
attention backend of its own (its planning never touches the engine's in-flight step).
`SessionKV` is one session's block table and length; the sliding window drops a span and
re-rotates the keys that follow it, gathering and scattering rows through the table.

Decode steps (one token for each session of a step) on an engine's pool go through the
engine's own step (`step`, given by the pool's owner: a server's engine loop runs them in
the step it was about to run, so the sessions' rows share one forward, and one read of the
weights, with the chat turns' decodes; `llm_engine.runner.GuestRows`): on CUDA the engine's
decode graphs, the rows padded to a captured batch size (padding moves the GEMMs' sums
only: their order, not their terms). A pool without one runs them eagerly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from pipeline.thinker.llm import Qwen3LM
from pipeline.thinker.llm_engine.attention import (
    AttnMetadata,
    ForwardBatch,
    TorchAttention,
    forward_batch,
    make_backend,
)
from pipeline.thinker.llm_engine.kv_cache import BlockManager, KVCache
from pipeline.thinker.llm_engine.runner import GuestRows

BLOCK_SIZE = 16  # a standalone pool's page (the engine's pool keeps its own)
FIRST_BLOCKS = 64  # a standalone pool's first size; it doubles when full


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_cos_sin(head_dim: int, positions: torch.Tensor, theta: float, dtype: torch.dtype):
    """cos, sin (len, 1, D) for `positions`, computed as the reference's sliding window
    computes them (fp32 angles from the positions, then cast)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    angles = torch.einsum("i,j->ij", positions.to(torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    return cos[:, None, :], sin[:, None, :]


class KVPages:
    """A paged KV pool the sessions of one Thinker model take their blocks from.

    `of_engine`: the Thinker engine's pool (a server: sessions and chat turns share its
    budget; a session that finds no free block fails its unit with a clear error), its
    decode steps through the engine's step when given one. `standalone`: a pool of its own
    that doubles when full (tests, scripts)."""

    def __init__(self, llm: Qwen3LM, layers: list[torch.Tensor], blocks: BlockManager,
                 growable: bool, kv_cache: KVCache | None = None,
                 step: Callable[[GuestRows], object] | None = None):
        cfg = llm.cfg
        self.llm = llm
        self.layers = layers
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.growable = growable
        self.kv_cache = kv_cache  # an engine's
        # runs a decode step's rows in the engine's step (`decode`); None: eager forwards
        self.step = step
        w = llm.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        self.scale = cfg.head_dim**-0.5
        self.backend = self._make_backend()

    def _make_backend(self):
        cfg = self.llm.cfg
        if self.dtype not in (torch.bfloat16, torch.float16):
            return TorchAttention()  # FlashInfer's kernels are half precision only
        return make_backend(self.device, num_qo_heads=cfg.num_attention_heads,
                            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                            block_size=self.block_size, max_num_pages=self.layers[0].shape[0],
                            dtype=self.dtype)

    @classmethod
    def of_engine(cls, engine, step: Callable[[GuestRows], object] | None = None) -> KVPages:
        """The pool of an `llm_engine.LLMEngine` (its KV tensor and block manager). `step`
        runs a decode step's rows in the engine's step: `engine.step` where nothing else
        steps the engine, a server's `EngineLoop.guest_step` (which routes the step's
        outputs to the engine's own requests) where something does."""
        return cls(engine.model, engine.kv_cache.layers, engine.block_manager, growable=False,
                   kv_cache=engine.kv_cache, step=step)

    @classmethod
    def standalone(cls, llm: Qwen3LM, num_blocks: int = FIRST_BLOCKS,
                   block_size: int = BLOCK_SIZE) -> KVPages:
        cfg = llm.cfg
        w = llm.lm_head.weight
        layers = [torch.zeros(num_blocks, 2, block_size, cfg.num_key_value_heads, cfg.head_dim,
                              device=w.device, dtype=w.dtype)
                  for _ in range(cfg.num_hidden_layers)]
        return cls(llm, layers, BlockManager(num_blocks, block_size, enable_caching=False),
                   growable=True)

    def allocate(self, table: list[int], tokens: int) -> None:
        """Grow `table` to cover `tokens` tokens (a standalone pool grows; an engine's pool
        that has too few free blocks raises ValueError)."""
        need = self.blocks.extra_blocks(table, tokens)
        if need > self.blocks.num_free:
            if not self.growable:
                raise ValueError(
                    f"the Thinker's KV cache is full: the session needs {need} more blocks of "
                    f"{self.block_size} tokens, {self.blocks.num_free} are free")
            self._grow(need - self.blocks.num_free)
        self.blocks.allocate(table, tokens)

    def _grow(self, at_least: int) -> None:
        old = self.blocks.num_blocks
        new = max(2 * old, old + at_least)
        self.layers = [torch.cat([x, x.new_zeros((new - old, *x.shape[1:]))]) for x in self.layers]
        self.blocks.add_blocks(new - old)
        self.backend = self._make_backend()

    def free(self, table: list[int]) -> None:
        self.blocks.free(table)

    def forward(self, items: Sequence[tuple[SessionKV, torch.Tensor]]) -> list[torch.Tensor]:
        """Append each session's rows (T_i, H) to its KV in one forward (one attention call a
        layer for all of them); returns each one's final-norm hidden rows. Each session
        appears once; `ensure` first."""
        bs = self.block_size
        qo, kv_lens, slots, positions, tables = [0], [], [], [], []
        for kv, rows in items:
            t = rows.shape[0]
            start = kv.length
            qo.append(qo[-1] + t)
            kv_lens.append(start + t)
            p = torch.arange(start, start + t)
            table = torch.tensor(kv.table, dtype=torch.long)
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table)
        bt = torch.zeros(len(items), max(len(t) for t in tables), dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        meta = AttnMetadata(
            qo_indptr=torch.tensor(qo, dtype=torch.int32),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
            block_tables=bt.to(self.device),
            block_tables_cpu=bt,
            slot_mapping=torch.cat(slots).to(self.device),
            is_decode=all(rows.shape[0] == 1 for _, rows in items),
            block_size=bs,
        )
        embeds = torch.cat([rows.to(self.dtype) for _, rows in items], dim=0)
        self.backend.prepare(meta)
        with forward_batch(ForwardBatch(self.backend, meta, self.layers, self.scale)):
            hidden = self.llm(embeds, torch.cat(positions).to(self.device))
        out = []
        for (kv, rows), lo in zip(items, qo):
            kv.length += rows.shape[0]
            out.append(hidden[lo : lo + rows.shape[0]])
        return out


    @torch.inference_mode()
    def decode(self, kvs: Sequence[SessionKV], tokens: Sequence[int]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token appended to each session (room ensured): final-norm hidden rows (n, H),
        and (n, V) logits where the engine's decode graph computed them (None: eager, the
        caller computes the logits it wants)."""
        if any(kv.pages is not self for kv in kvs):
            raise ValueError("the sessions of a decode step must share its KV pool")
        if self.step is None:
            embeds = self.llm.embed(torch.tensor(list(tokens), dtype=torch.long,
                                                 device=self.device))
            rows = self.forward([(kv, embeds[i : i + 1]) for i, kv in enumerate(kvs)])
            return torch.cat(rows), None
        guests = GuestRows(list(tokens), [kv.length for kv in kvs], [kv.table for kv in kvs])
        self.step(guests)
        for kv in kvs:
            kv.length += 1
        return guests.hidden, guests.logits


_STANDALONE: weakref.WeakKeyDictionary[Qwen3LM, KVPages] = weakref.WeakKeyDictionary()


def standalone_pages(llm: Qwen3LM) -> KVPages:
    """The standalone pool of `llm` (made on first use): what sessions made without a
    server's pool share, so that they batch together."""
    pages = _STANDALONE.get(llm)
    if pages is None:
        pages = _STANDALONE[llm] = KVPages.standalone(llm)
    return pages


class SessionKV:
    """One session's block table in a `KVPages` pool and its length, at most `max_tokens`
    (a server's bound on what one session holds of the shared pool; default: the model's
    context)."""

    def __init__(self, pages: KVPages, max_tokens: int | None = None):
        cfg = pages.llm.cfg
        self.pages = pages
        self.head_dim = cfg.head_dim
        self.theta = float(cfg.rope_theta)
        self.model_len = cfg.max_position_embeddings
        self.max_len = self.model_len if max_tokens is None else min(max_tokens, self.model_len)
        self.device, self.dtype = pages.device, pages.dtype
        self.table: list[int] = []
        self.length = 0

    def ensure(self, total: int) -> None:
        """Room for `total` tokens (ValueError past the model's context, or when the pool
        has no free block for them)."""
        if total > self.max_len == self.model_len:
            raise ValueError(
                f"the session's context would reach {total} tokens, over the model's "
                f"{self.max_len}; use sliding_window_mode 'basic'"
            )
        if total > self.max_len:
            raise ValueError(
                f"the session's context would reach {total} tokens, over a session's limit "
                f"of {self.max_len} (its sliding window's high mark and one unit): the "
                f"system prompt and voice must leave room for the window's units"
            )
        self.pages.allocate(self.table, total)

    def release(self) -> None:
        """Every block back to the pool."""
        self.pages.free(self.table)
        self.length = 0

    def trim(self) -> None:
        """Blocks past the length back to the pool (after the window slid)."""
        keep = self.pages.blocks.blocks_for(self.length)
        if len(self.table) > keep:
            extra = self.table[keep:]
            del self.table[keep:]
            self.pages.free(extra)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """Append `embeds` (T, H) at the next positions; returns their final-norm hidden
        rows (T, H)."""
        self.ensure(self.length + embeds.shape[0])
        return self.pages.forward([(self, embeds)])[0]

    # -- rows through the table ---------------------------------------------------------
    def _where(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.pages.block_size
        p = torch.arange(lo, hi)
        blk = torch.tensor(self.table, dtype=torch.long)[p // bs]
        return blk.to(self.device), (p % bs).to(self.device)

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + n, device=self.device)
        return rope_cos_sin(self.head_dim, positions, self.theta, self.dtype)

    def _gather(self, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K, V (hi - lo, Hkv, D) of tokens [lo, hi) (copies)."""
        blk, off = self._where(lo, hi)
        return [(x[blk, 0, off], x[blk, 1, off]) for x in self.pages.layers]

    def _scatter(self, lo: int, rows: list[tuple[torch.Tensor, torch.Tensor]],
                 old: int) -> None:
        """Write per-layer K, V rows at [lo, lo + n), the keys re-rotated from positions
        [old, old + n) to theirs (as they are when old == lo)."""
        n = rows[0][0].shape[0]
        blk, off = self._where(lo, lo + n)
        if old != lo:  # the angles once for every layer
            cos_o, sin_o = self._rope(old, n)
            cos_n, sin_n = self._rope(lo, n)
        for x, (k, v) in zip(self.pages.layers, rows, strict=True):
            if old != lo:
                base = cos_o * k - sin_o * _rotate_half(k)
                k = cos_n * base + sin_n * _rotate_half(base)
            x[blk, 0, off] = k
            x[blk, 1, off] = v

    def snapshot(self) -> list[torch.Tensor]:
        """Per layer (2, length, Hkv, D): the session's K/V in position order (tests)."""
        return [torch.stack(kv) for kv in self._gather(0, self.length)]

    @torch.inference_mode()
    def drop(self, start: int, length: int) -> None:
        """Remove tokens [start, start + length) and move the rest down, their keys
        re-rotated from their old positions to the new ones (the reference's
        `drop_tokens_from_cache` + `realign_rotary_suffix`)."""
        end, total = start + length, self.length
        if total - end > 0:
            self._scatter(start, self._gather(end, total), old=end)
        self.length = total - length
        self.trim()

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        self.length = length
        self.trim()

    @torch.inference_mode()
    def rebuild(self, prefix_end: int, embeds: torch.Tensor | None, keep: int) -> None:
        """Keep tokens [0, prefix_end) and the last `keep`; recompute `embeds` after the
        prefix (their K/V attend to the prefix only), then move the kept tail right after
        them, its keys re-rotated (the reference's `_rebuild_cache_with_previous`)."""
        total = self.length
        old_start = total - keep
        tail = self._gather(old_start, total) if keep > 0 else []
        self.length = prefix_end
        if embeds is not None and embeds.shape[0] > 0:
            self.forward(embeds)
        if keep > 0:
            new_start = self.length
            self.ensure(new_start + keep)
            self._scatter(new_start, tail, old=old_start)
            self.length = new_start + keep
        self.trim()
