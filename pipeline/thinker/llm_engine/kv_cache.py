"""Paged KV cache: the device tensor (`KVCache`) and its CPU-side accounting (`BlockManager`).

Layout: one tensor (num_layers, num_blocks + 1, 2, block_size, num_kv_heads, head_dim);
layer i is FlashInfer's "NHD" paged layout (num_pages, 2, page, Hkv, D) with [:, 0] = K,
[:, 1] = V. The extra last block is a scratch page that the BlockManager never hands out:
padded rows of a CUDA-graph batch write their K/V there, so padding can never clobber a
live sequence.

Token t of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`; its slot id is `block * block_size + offset`.

Prefix caching (nano-vllm / vLLM style): a full block whose K/V are computed is
registered under a hash chained over its parent's hash, its token ids and the content
keys of the media rows spliced into it (`hash_block`). A new sequence takes the longest
run of registered blocks matching its own chain instead of recomputing them (their ref
count goes up); a block whose ref count drops to zero keeps its hash and K/V, and is
evicted (least recently released first) only when no free block without one is left.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
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


BlockHash = bytes
ROOT_HASH: BlockHash = b""  # parent of a sequence's first block


def hash_block(
    parent: BlockHash, token_ids: Seq[int], media: Seq[tuple[str, int, int, int]] = ()
) -> BlockHash:
    """Chained content hash of one full block.

    media: one (content key, first row within that key's rows, first offset within the
    block, number of rows) per multimodal run inside the block: equal token ids with other
    media rows spliced in give other K/V, so they must give another hash. A cryptographic
    hash, because a collision would silently hand one prompt another prompt's K/V."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key, row, offset, n in media:
        k = key.encode()
        h.update(struct.pack("<4q", len(k), row, offset, n))
        h.update(k)
    return h.digest()


class BlockManager:
    """Allocator of KV blocks with ref counts and a prefix cache. Pure CPU bookkeeping.

    Block tables are plain lists owned by the caller (the Sequence); the manager hands out
    and takes back block ids. Every block is in exactly one state:
      in use     ref_count > 0 (shared by every table holding it when it has a hash);
      cached     ref_count == 0 with a hash: K/V kept for a later prefix hit, evictable;
      free       ref_count == 0, no hash.
    `num_free` counts free + cached: both can be handed out. Allocation takes free blocks
    first and evicts cached ones, least recently released first, only when none is left."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest release first
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (in use or evictable)."""
        return len(self._by_hash)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> BlockHash | None:
        return self._hash[block]

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, block_table: Seq[int], num_tokens: int) -> int:
        """Blocks to add so `block_table` covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def add_blocks(self, n: int) -> None:
        """`n` more free blocks, ids after the current ones (a pool whose tensor grew)."""
        self._free.extend(range(self.num_blocks, self.num_blocks + n))
        self._ref += [0] * n
        self._hash += [None] * n
        self.num_blocks += n

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place with fresh blocks to cover `num_tokens` tokens (a
        prefill chunk or an appended decode slot). Raises if there are not enough: the
        scheduler checks `can_allocate` first."""
        need = self.extra_blocks(block_table, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, free {self.num_free}")
        for _ in range(need):
            block_table.append(self._take())

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:  # evict the least recently released cached block
            b, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash[b]]
            self._hash[b] = None
            self.num_evictions += 1
        assert self._ref[b] == 0, f"block {b} handed out while referenced"
        self._ref[b] = 1
        return b

    def append_slot(self, block_table: list[int], num_tokens: int) -> int:
        """Make room for token index `num_tokens - 1` and return its slot id."""
        self.allocate(block_table, num_tokens)
        t = num_tokens - 1
        return block_table[t // self.block_size] * self.block_size + t % self.block_size

    def free(self, block_table: list[int]) -> None:
        """Release every block of `block_table` and empty it. Last block first, so that
        a prefix's tail is evicted before its head (a child is useless without its parent)."""
        for b in reversed(block_table):
            assert self._ref[b] > 0, f"block {b} freed more often than taken"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._cached[b] = None  # most recently released: evicted last
        block_table.clear()

    # -- prefix cache ------------------------------------------------------------------
    def match_prefix(self, hashes: Seq[BlockHash]) -> list[int]:
        """Blocks holding the longest registered run of `hashes` (no refs taken)."""
        if not self.enable_caching:
            return []
        blocks = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def hit_cost(self, blocks: Seq[int]) -> int:
        """Blocks that taking `blocks` removes from `num_free` (the evictable ones)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def take_cached(self, block_table: list[int], blocks: Seq[int]) -> None:
        """Append matched blocks to an empty-so-far prefix of `block_table`, one ref each."""
        for b in blocks:
            assert self._hash[b] is not None, f"block {b} is not a cached block"
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
            block_table.append(b)

    def register(self, block: int, h: BlockHash) -> bool:
        """Publish a full block whose K/V are now computed under hash `h`. If another block
        already holds `h` (two equal prefixes computed at the same time), this one stays
        private and is freed normally; returns whether it was registered."""
        if not self.enable_caching or h in self._by_hash:
            return False
        assert self._ref[block] > 0 and self._hash[block] is None
        self._hash[block] = h
        self._by_hash[h] = block
        return True
