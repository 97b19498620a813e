"""Paged KV cache: the device tensor (`KVCache`) and its CPU-side accounting (`BlockManager`).

Layout: one tensor (num_layers, num_blocks + 1, 2, block_size, num_kv_heads, head_dim);
layer i is FlashInfer's "NHD" paged layout (num_pages, 2, page, Hkv, D) with [:, 0] = K,
[:, 1] = V. The extra last block is a scratch page that the BlockManager never hands out:
padded rows of a CUDA-graph batch write their K/V there, so padding can never clobber a
live sequence.

Token t of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`; its slot id is `block * block_size + offset`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

import torch

from pipeline.config import LLMConfig


def bytes_per_block(cfg: LLMConfig, block_size: int, dtype: torch.dtype) -> int:
    """K + V of one block over all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def num_blocks_for_budget(
    cfg: LLMConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    n = budget_bytes // bytes_per_block(cfg, block_size, dtype)
    if n < 1:
        raise ValueError(
            f"KV budget {budget_bytes} B is smaller than one block "
            f"({bytes_per_block(cfg, block_size, dtype)} B at block_size={block_size})"
        )
    return int(n)


class KVCache:
    """The device tensor. `layers[i]` is a view (num_blocks + 1, 2, block, Hkv, D)."""

    def __init__(
        self,
        cfg: LLMConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks  # never allocated; the sink for padded rows
        self.kv = torch.zeros(
            cfg.num_hidden_layers,
            num_blocks + 1,
            2,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )
        self.layers = list(self.kv.unbind(0))

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class BlockManager:
    """Free-list allocator of KV blocks. Pure CPU bookkeeping, no tensors.

    Block tables are plain lists owned by the caller (the Sequence); the manager only
    hands out and takes back block ids and counts what is free."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, block_table: Seq[int], num_tokens: int) -> int:
        """Blocks to add so `block_table` covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place to cover `num_tokens` tokens (a prefill chunk or an
        appended decode slot). Raises if there are not enough free blocks: the scheduler
        checks `can_allocate` first."""
        need = self.extra_blocks(block_table, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, free {len(self._free)}")
        for _ in range(need):
            block_table.append(self._free.popleft())

    def append_slot(self, block_table: list[int], num_tokens: int) -> int:
        """Make room for token index `num_tokens - 1` and return its slot id."""
        self.allocate(block_table, num_tokens)
        t = num_tokens - 1
        return block_table[t // self.block_size] * self.block_size + t % self.block_size

    def free(self, block_table: list[int]) -> None:
        """Return every block of `block_table` and empty it."""
        self._free.extend(block_table)
        block_table.clear()
