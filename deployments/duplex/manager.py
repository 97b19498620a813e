"""Duplex sessions per ingress replica: at most `max_sessions` run, and never more than the
backend holds (`backend.holds()`: what the Thinkers' KV pools have room for), up to
`max_queue` wait in FIFO order (told their position and an ETA as it changes), the rest are
refused."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.config import DuplexSettings

# The ETA of a queued session before any session on this replica has ended: the length
# of a typical voice call, a guess the first finished sessions replace.
FIRST_GUESS_SESSION_S = 120.0

# (position 1-based, estimated wait in seconds, queue length) -> the wire's queued event
Notify = Callable[[int, float, int], Awaitable[None]]


class Refused(Exception):
    """A session the replica does not run: an error event with `code`, then close."""

    def __init__(self, code: str, message: str, close_code: int = 1013):
        super().__init__(message)
        self.code, self.message, self.close_code = code, message, close_code


@dataclass
class _Waiter:
    session_id: str
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    granted: bool = False


class DuplexManager:
    def __init__(self, settings: DuplexSettings, backend: Any):
        self.settings = settings
        self.backend = backend
        self.active: dict[str, float] = {}        # session id -> monotonic start
        self.opened: set[str] = set()             # ids open on the backend
        self._queue: deque[_Waiter] = deque()
        self._durations: deque[float] = deque(maxlen=64)
        self.refused = 0
        self.limit = settings.max_sessions  # sessions that may run: max_sessions, or fewer

    async def _limit(self) -> int:
        """`max_sessions`, or what the backend holds if that is fewer."""
        holds = getattr(self.backend, "holds", None)
        held = await holds() if holds is not None and self.settings.max_sessions else None
        self.limit = self.settings.max_sessions if held is None else min(
            self.settings.max_sessions, held)
        return self.limit

    # -- admission ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def slot(self, session_id: str, notify: Notify) -> AsyncIterator[None]:
        """Hold one of the replica's slots for the body; queue for it first when all are
        taken (`notify` on joining and on every move). Raises Refused past the queue."""
        await self._acquire(session_id, notify)
        try:
            yield
        finally:
            self._release(session_id)

    async def _acquire(self, session_id: str, notify: Notify) -> None:
        s = self.settings
        if s.max_sessions == 0:
            self.refused += 1
            raise Refused("duplex_unavailable", "full duplex is off on this server "
                          "(duplex.max_sessions is 0)", 1008)
        limit = await self._limit()
        if limit == 0:
            self.refused += 1
            raise Refused("duplex_unavailable", "the Thinker's KV cache holds no duplex "
                          "session beside the chat turns (raise thinker.kv_cache_gib)", 1008)
        if len(self.active) < limit and not self._queue:
            self.active[session_id] = time.monotonic()
            return
        if len(self._queue) >= s.max_queue:
            self.refused += 1
            raise Refused("server_busy", f"all {limit} duplex sessions of this "
                          f"replica are taken and {len(self._queue)} are waiting; try again "
                          f"later")
        w = _Waiter(session_id)
        self._queue.append(w)
        deadline = time.monotonic() + s.queue_timeout_s
        try:
            while not w.granted:
                w.changed.clear()
                pos = self._queue.index(w) + 1
                await notify(pos, self.eta(pos), len(self._queue))
                left = deadline - time.monotonic()
                if w.granted:
                    break
                if left <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(w.changed.wait(), left)
        except BaseException as e:
            if w.granted:  # a slot came, but the socket went (or timed out) at that moment
                self._release(session_id)
            else:
                self._queue.remove(w)
                self._moved()
            if isinstance(e, asyncio.TimeoutError):
                self.refused += 1
                raise Refused("queue_timeout", f"no duplex slot came free within "
                              f"{s.queue_timeout_s:g} s; try again later") from None
            raise

    def _release(self, session_id: str) -> None:
        start = self.active.pop(session_id, None)
        if start is None:
            return
        self._durations.append(time.monotonic() - start)
        while self._queue and len(self.active) < self.limit:
            w = self._queue.popleft()
            w.granted = True
            self.active[w.session_id] = time.monotonic()
            w.changed.set()
        self._moved()

    def _moved(self) -> None:
        for w in self._queue:
            w.changed.set()

    def eta(self, position: int) -> float:
        """Seconds until the session at `position` in the queue gets a slot: the running
        sessions' expected remaining time (their mean length so far, less their age),
        a full session length for every round of slots ahead of it."""
        mean = (sum(self._durations) / len(self._durations) if self._durations
                else FIRST_GUESS_SESSION_S)
        now = time.monotonic()
        left = sorted(max(mean - (now - t), 1.0) for t in self.active.values()) or [1.0]
        rounds, i = divmod(position - 1, len(left))
        return round(left[i] + rounds * mean, 1)

    # -- backend sessions --------------------------------------------------------------

    async def open(self, session_id: str, init: Any) -> None:
        await self.backend.open(session_id, init)
        self.opened.add(session_id)

    async def close(self, session_id: str) -> None:
        if session_id in self.opened:
            self.opened.discard(session_id)
            await self.backend.close(session_id)

    # -- stats -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Sessions running and waiting, and `leaks`: accounting that does not add up."""
        leaks = []
        if not self.opened <= set(self.active):
            leaks.append(f"duplex: backend sessions {sorted(self.opened - set(self.active))} "
                         f"hold no slot")
        if len(self.active) > self.limit:
            leaks.append(f"duplex: {len(self.active)} sessions over their limit {self.limit}")
        backend = self.backend.stats() if hasattr(self.backend, "stats") else {}
        if "sessions" in backend and backend["sessions"] != len(self.opened):
            leaks.append(f"duplex: backend holds {backend['sessions']} sessions, "
                         f"{len(self.opened)} open")
        return {"active": len(self.active), "queued": len(self._queue), "refused": self.refused,
                "limit": self.limit,
                "backend": backend, "idle": not self.active and not self._queue,
                "leaks": leaks}
