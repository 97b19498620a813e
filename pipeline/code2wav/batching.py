"""Coalescing of Code2Wav chunks across streams (CPU only, no torch).

Each engine step offers at most one ready chunk per stream (its next one, so a stream's chunks
can never be reordered). Chunks batch together only when their shape keys are equal (same
chunk length, cache lengths, last flag), so a batch needs no padding and stays exact.

Waiting rule (`code2wav_batch_wait_ms`): a *lone* chunk (no other ready chunk with its key)
is held back while (a) it has waited less than `wait_ms` and (b) some other stream with the
same next key is known to be close (a few codes short of a full window). Groups of two or more
run at once; streams with no ready chunk never occupy a batch slot. wait_ms = 0 disables waiting.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReadyChunk:
    stream_id: str
    key: Hashable  # chunks batch only with equal keys


@dataclass
class ChunkBatcher:
    wait_ms: float = 0.0
    max_batch: int = 4
    clock: Callable[[], float] = time.monotonic
    _first_seen: dict[str, float] = field(
        default_factory=dict
    )  # stream -> when its chunk got ready
    waits: int = 0  # steps in which some chunk was held back

    def plan(self, ready: list[ReadyChunk], near: Counter | None = None) -> list[list[ReadyChunk]]:
        """Batches to run now. `ready`: one entry per stream with a ready chunk, in stream order.
        `near`: per key, how many other streams are close to a ready chunk with that key."""
        now = self.clock()
        ready_ids = {r.stream_id for r in ready}
        for sid in list(self._first_seen):
            if sid not in ready_ids:
                del self._first_seen[sid]
        for r in ready:
            self._first_seen.setdefault(r.stream_id, now)
        groups: dict[Hashable, list[ReadyChunk]] = {}
        for r in ready:
            groups.setdefault(r.key, []).append(r)
        near = near or Counter()
        batches, held = [], False
        for key, group in groups.items():
            lone = len(group) == 1
            waited_ms = (now - self._first_seen[group[0].stream_id]) * 1000.0
            if self.wait_ms > 0 and lone and near.get(key, 0) > 0 and waited_ms < self.wait_ms:
                held = True
                continue
            for i in range(0, len(group), self.max_batch):
                batches.append(group[i : i + self.max_batch])
        for batch in batches:
            for r in batch:
                self._first_seen.pop(r.stream_id, None)
        self.waits += int(held)
        return batches

    def deadline(self) -> float | None:
        """Clock time by which a held chunk must run (None if nothing is held)."""
        if not self._first_seen:
            return None
        return min(self._first_seen.values()) + self.wait_ms / 1000.0
