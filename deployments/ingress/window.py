"""The active stream window: at most K turns run in the GPU stages; the rest wait FIFO.

A slot is taken when a turn is admitted and given back on its last audio piece (or its
last text delta for a text-only turn), on error, or on cancel. A prepared but idle stream
(voice decoded, no turn in flight) never holds a slot: the ingress prepares media and the
voice before `acquire`. K = 0 means no limit. Why a window at all: a bounded number of
streams keeps each stream's chunks arriving faster than real time; vLLM-Omni's history
(serving-reference 1.6) shows K must be at least the target concurrency, or first packets
serialize.

The queue is bounded too: at most QUEUE_PER_SLOT x K turns wait. A turn past that is
refused at once (`QueueFull`, a 503 with a Retry-After) instead of waiting for a slot that
would come only after many turns' worth of work; it never held anything, so the refusal
frees nothing and is no failure of an admitted turn. Each admitted turn's wait is on its
Slot (`wait_s`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

# Waiting turns per window slot. A turn that finds this many waiting ahead of it would start
# only after each slot ran QUEUE_PER_SLOT more turns: past that, waiting is longer than a
# client's retry, and the ingress's memory for the queued requests' media stays bounded.
QUEUE_PER_SLOT = 4
# Retry-After of a refusal before any turn has ended (no hold time measured yet), seconds.
DEFAULT_RETRY_AFTER_S = 1
HOLD_EWMA = 0.2  # weight of the newest turn in the mean slot hold time


class QueueFull(Exception):
    """The window's queue holds `limit` waiting turns: this turn is refused, not queued."""

    def __init__(self, waiting: int, limit: int, size: int, retry_after_s: int):
        super().__init__(
            f"{waiting} turns are waiting for the {size} stream slots (at most {limit} may "
            f"wait); retry in {retry_after_s} s")
        self.waiting, self.limit, self.size = waiting, limit, size
        self.retry_after_s = retry_after_s


@dataclass
class Slot:
    """One admitted turn; `release()` is idempotent so every exit path may call it.
    `wait_s`: how long the turn waited in the queue (0 when a slot was free)."""

    window: ActiveStreamWindow
    request_id: str
    wait_s: float = 0.0
    admitted_at: float = field(default_factory=time.monotonic)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.window._release(self)


class ActiveStreamWindow:
    """FIFO admission of at most `size` concurrent turns (0 = unlimited), with at most
    `queue_limit` waiting (default QUEUE_PER_SLOT x size; unbounded with size 0).

    Runs on one asyncio loop (the ingress replica's); not thread-safe.
    """

    def __init__(self, size: int, queue_limit: int | None = None):
        if size < 0:
            raise ValueError(f"the window size must be >= 0, got {size}")
        if queue_limit is not None and queue_limit < 0:
            raise ValueError(f"the queue limit must be >= 0, got {queue_limit}")
        self.size = size
        self.queue_limit = QUEUE_PER_SLOT * size if queue_limit is None else queue_limit
        self._active: set[str] = set()
        self._waiters: deque[tuple[str, asyncio.Future]] = deque()
        self.peak_active = 0
        self.peak_waiting = 0
        self.admitted = 0
        self.refused = 0  # turns refused with the queue full
        self.waited = 0  # admitted turns that had to wait
        self.wait_s_total = 0.0
        self.max_wait_s = 0.0
        self.hold_s = 0.0  # mean time a turn holds its slot (EWMA; 0 until one ended)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _has_room(self) -> bool:
        return self.size == 0 or len(self._active) < self.size

    def full(self) -> bool:
        """Whether a turn arriving now would be refused (every slot taken, queue full)."""
        return (self.size > 0 and not self._has_room()
                and len(self._waiters) >= self.queue_limit)

    def retry_after_s(self) -> int:
        """Whole seconds until the queue has likely moved on by one slot's turn: the mean
        hold time of a slot times the waiting turns per slot."""
        if self.size == 0 or self.hold_s <= 0:
            return DEFAULT_RETRY_AFTER_S
        return max(1, math.ceil(self.hold_s * max(1, self.waiting) / self.size))

    def check(self) -> None:
        """Raise QueueFull if a turn arriving now would be refused."""
        if self.full():
            raise QueueFull(self.waiting, self.queue_limit, self.size, self.retry_after_s())

    async def acquire(self, request_id: str) -> Slot:
        """Wait for a slot in arrival order; QueueFull at once when the queue is full.
        Cancelling the wait leaves the queue clean."""
        if self._has_room() and not self._waiters:
            return self._admit(request_id)
        if self.full():
            self.refused += 1
            self.check()
        t0 = time.monotonic()
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
        wait = time.monotonic() - t0
        self.waited += 1
        self.wait_s_total += wait
        self.max_wait_s = max(self.max_wait_s, wait)
        return Slot(self, request_id, wait)

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
        held = time.monotonic() - slot.admitted_at
        self.hold_s = held if self.hold_s <= 0 else (
            (1 - HOLD_EWMA) * self.hold_s + HOLD_EWMA * held)
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

    def stats(self) -> dict[str, int | float]:
        return {"size": self.size, "active": self.active, "waiting": self.waiting,
                "queue_limit": self.queue_limit, "peak_active": self.peak_active,
                "peak_waiting": self.peak_waiting, "admitted": self.admitted,
                "refused": self.refused, "waited": self.waited,
                "wait_s_total": round(self.wait_s_total, 6),
                "max_wait_s": round(self.max_wait_s, 6)}

    def reset_peaks(self) -> None:
        self.peak_active = self.active
        self.peak_waiting = self.waiting
