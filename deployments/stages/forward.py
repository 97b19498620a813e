"""In-order forwarding of one stream's chunks to the next stage, and the tombstones that let
an abort overtake its stream's open."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.wire import error_line

log = logging.getLogger(__name__)


def one_each(item: Any) -> int:
    """A `Forwarder` chunk's default size: every chunk counts one."""
    return 1


class Forwarder:
    """Sends one stream's chunks to the next stage in order, one call in flight at a time.

    Chunks that arrive while a call is in flight are coalesced into the next call, so a
    slow hop batches instead of queueing. `hold` keeps everything until `finish()` (the
    Talker's full_span mode); `at_least` waits until the pending chunks' `size`s add up to
    it, or `finish()` (the Thinker sends the Talker whole text chunks: a unit starts only
    with one, so a row sent alone would only wait there, and cost both processes a call and
    the GPU the Talker's small launches between the Thinker's steps). `send(items, final)` is
    the hop, e.g. `talker.feed`; each call is bounded by `timeout_s`. A failed call drops the
    stream and reports to `on_error`, so the stream's owner ends the turn instead of waiting
    for chunks that will never come.
    """

    def __init__(
        self,
        send: Callable[[list[Any], bool], Awaitable[Any]],
        *,
        name: str,
        hold: bool = False,
        at_least: int = 1,
        size: Callable[[Any], int] = one_each,
        timeout_s: float | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        self._send = send
        self._name = name
        self._hold = hold
        self._at_least, self._size = at_least, size
        self._pending = 0  # the `size`s of the chunks not sent yet
        self._timeout_s = timeout_s
        self._on_error = on_error
        self._items: list[Any] = []
        self._final = False
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())
        self.calls = 0

    def push(self, item: Any) -> None:
        self._items.append(item)
        self._pending += self._size(item)
        if not self._hold and self._pending >= self._at_least:
            self._wake.set()

    def finish(self) -> None:
        self._final = True
        self._wake.set()

    def cancel(self) -> None:
        self._task.cancel()

    @property
    def done(self) -> bool:
        return self._task.done()

    async def wait(self, timeout: float) -> bool:
        """Whether the last call returned (or the stream was dropped) within `timeout`."""
        done, _ = await asyncio.wait([self._task], timeout=timeout)
        return bool(done)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            items, self._items, self._pending = self._items, [], 0
            final = self._final
            if items or final:
                try:
                    await asyncio.wait_for(self._send(items, final), self._timeout_s)
                    self.calls += 1
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the next stage died, refused or hung
                    if isinstance(e, asyncio.TimeoutError):
                        e = TimeoutError(f"no answer within {self._timeout_s:g} s")
                    log.warning(
                        "%s: forwarding failed (%s); stream dropped", self._name, error_line(e)
                    )
                    if self._on_error is not None:
                        self._on_error(e)
                    return
            if final:
                return


class Tombstones:
    """Recently aborted request ids (bounded): an abort that overtakes its stream's open
    (both are concurrent calls) must still win, or the stream would never be closed."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids
