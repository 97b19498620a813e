"""The active stream window: at most K turns run in the GPU stages; the rest wait FIFO.

A slot is taken when a turn is admitted and given back on its last audio piece (or its
last text delta for a text-only turn), on error, or on cancel. A prepared but idle stream
(voice decoded, no turn in flight) never holds a slot: the ingress prepares media and the
voice before `acquire`. K = 0 means no limit. Why a window at all: a bounded number of
streams keeps each stream's chunks arriving faster than real time; vLLM-Omni's history
(serving-reference 1.6) shows K must be at least the target concurrency, or first packets
serialize.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


@dataclass
class Slot:
    """One admitted turn; `release()` is idempotent so every exit path may call it."""

    window: ActiveStreamWindow
    request_id: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.window._release(self)


class ActiveStreamWindow:
    """FIFO admission of at most `size` concurrent turns (0 = unlimited).

    Runs on one asyncio loop (the ingress replica's); not thread-safe.
    """

    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"the window size must be >= 0, got {size}")
        self.size = size
        self._active: set[str] = set()
        self._waiters: deque[tuple[str, asyncio.Future]] = deque()
        self.peak_active = 0
        self.peak_waiting = 0
        self.admitted = 0

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _has_room(self) -> bool:
        return self.size == 0 or len(self._active) < self.size

    async def acquire(self, request_id: str) -> Slot:
        """Wait for a slot in arrival order. Cancelling the wait leaves the queue clean."""
        if self._has_room() and not self._waiters:
            return self._admit(request_id)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((request_id, fut))
        self.peak_waiting = max(self.peak_waiting, len(self._waiters))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # admitted just as we were cancelled
                self._active.discard(request_id)
                self._wake()
            else:
                self._remove_waiter(fut)
            raise
        return Slot(self, request_id)

    def _admit(self, request_id: str) -> Slot:
        self._active.add(request_id)
        self.admitted += 1
        self.peak_active = max(self.peak_active, len(self._active))
        return Slot(self, request_id)

    def _remove_waiter(self, fut: asyncio.Future) -> None:
        for i, (_, f) in enumerate(self._waiters):
            if f is fut:
                del self._waiters[i]
                return

    def _release(self, slot: Slot) -> None:
        self._active.discard(slot.request_id)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._has_room():
            rid, fut = self._waiters.popleft()
            if fut.done():
                continue
            self._active.add(rid)
            self.admitted += 1
            self.peak_active = max(self.peak_active, len(self._active))
            fut.set_result(None)

    def stats(self) -> dict[str, int]:
        return {"size": self.size, "active": self.active, "waiting": self.waiting,
                "peak_active": self.peak_active, "peak_waiting": self.peak_waiting,
                "admitted": self.admitted}

    def reset_peaks(self) -> None:
        self.peak_active = self.active
        self.peak_waiting = self.waiting
