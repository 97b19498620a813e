"""A session's outbound side: the server events waiting for the socket, in bytes, and the one
task that writes them.

Both the session loop and the response task queue events here and never wait on the socket
themselves; the writer hands them to the socket in order. The queue is bounded in bytes:

- past `COALESCE_BYTES` waiting, a new audio delta merges into the audio delta still waiting
  at the queue's tail (one delta, its transcript delta with it): fewer, larger frames for a
  reader that fell behind, the same audio and transcript;
- past `MAX_BYTES` waiting, or one write that does not complete in `WRITE_TIMEOUT_S`, the
  reader is too slow: everything waiting is dropped and the outbox stops (`stopped` holds the
  reason); the session then ends and the socket is closed with `SLOW_READER_CLOSE`.

The session loop waits (`flush`) until what it queued has been written before it reads the
next client event, so a client that does not read is not read either: its own writes meet
the transport's backpressure instead of growing the server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.realtime import protocol as p

log = logging.getLogger(__name__)

# The largest server event is a session or response object carrying a client's text (one
# client event is at most `realtime.max_event_bytes`, 4 MiB by default): a few of those fit.
MAX_BYTES = 16 << 20
COALESCE_BYTES = 1 << 20
WRITE_TIMEOUT_S = 30.0
SLOW_READER_CLOSE = 1008  # RFC 6455 policy violation: the client does not read its events


@dataclass
class _Audio:
    """An audio delta and its transcript delta, still open for more audio while queued."""

    response_id: str
    item_id: str
    pcm: bytearray
    transcript: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        # base64 of the pcm plus the two events' fields
        return len(self.pcm) * 4 // 3 + sum(len(t) for t in self.transcript) + 512


class Outbox:
    """`write(text)` sends one text frame; `to_wire(event)` is the text of an event, or None
    for an event this client does not get (a GA-only event for a beta session)."""

    def __init__(self, write: Callable[[str], Awaitable[None]],
                 to_wire: Callable[[dict[str, Any]], str | None]):
        self._write = write
        self._to_wire = to_wire
        self._queue: deque[str | _Audio] = deque()
        self.bytes = 0  # waiting, not yet handed to the socket
        self.peak = 0
        self.coalesced = 0  # audio deltas merged into an earlier one
        self._queued = 0  # entries queued since the start
        self._written = 0  # entries handed to the socket (or dropped)
        self._progress = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self.stopped: str | None = None  # why nothing more goes out
        self.slow = False  # stopped because the client does not read
        self.stopped_event = asyncio.Event()

    # -- queueing --------------------------------------------------------------------------

    def put(self, event: dict[str, Any]) -> None:
        if self.stopped is not None:
            return
        text = self._to_wire(event)
        if text is not None:
            self._push(text, len(text))

    def put_audio(self, response_id: str, item_id: str, pcm: bytes, transcript: str) -> None:
        """One audio delta (pcm16 at 24 kHz) and the transcript that goes out with it."""
        if self.stopped is not None:
            return
        tail = self._queue[-1] if self._queue else None
        if (self.bytes > COALESCE_BYTES and isinstance(tail, _Audio)
                and tail.item_id == item_id):
            before = tail.size
            tail.pcm += pcm
            tail.transcript.append(transcript)
            self.coalesced += 1
            self._grew(tail.size - before)
            return
        entry = _Audio(response_id, item_id, bytearray(pcm), [transcript])
        self._push(entry, entry.size)

    def _push(self, entry: str | _Audio, size: int) -> None:
        self._queue.append(entry)
        self._queued += 1
        self._grew(size)
        if self.stopped is None and (self._writer is None or self._writer.done()):
            self._writer = asyncio.get_running_loop().create_task(self._drain())

    def _grew(self, size: int) -> None:
        self.bytes += size
        self.peak = max(self.peak, self.bytes)
        if self.bytes > MAX_BYTES:
            self.stop(f"slow reader: over {MAX_BYTES} bytes of server events unread", slow=True)

    # -- writing ---------------------------------------------------------------------------

    def _frames(self, entry: str | _Audio) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        data = base64.b64encode(entry.pcm).decode()
        rid, iid = entry.response_id, entry.item_id
        events = (p.response_output_audio_delta(rid, iid, 0, 0, data),
                  p.response_output_audio_transcript_delta(rid, iid, 0, 0,
                                                           "".join(entry.transcript)))
        return [t for t in map(self._to_wire, events) if t is not None]

    async def _drain(self) -> None:
        try:
            while self._queue and self.stopped is None:
                entry = self._queue.popleft()
                size = len(entry) if isinstance(entry, str) else entry.size
                try:
                    for text in self._frames(entry):
                        if not await self._write_within(text, WRITE_TIMEOUT_S):
                            self.stop(f"slow reader: a server event waited over "
                                      f"{WRITE_TIMEOUT_S:g} s to be written", slow=True)
                            break
                except Exception as e:  # the socket is gone: the session's receive says so
                    self.stop(f"the socket failed: {type(e).__name__}")
                    log.debug("realtime outbox: write failed", exc_info=True)
                finally:
                    self.bytes = max(0, self.bytes - size)
                    self._written += 1
                    self._progress.set()
        finally:
            self._progress.set()

    async def _write_within(self, text: str, timeout: float) -> bool:
        write = await within(self._write(text), timeout)
        if write is None:
            return False
        write.result()  # raises the socket's error
        return True

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been written (or the outbox stopped);
        False if `timeout` passed first."""
        target = self._queued

        async def wait() -> None:
            while self._written < target and self.stopped is None:
                self._progress.clear()
                await self._progress.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def stop(self, reason: str, *, slow: bool = False) -> None:
        """Drop what waits and send nothing more."""
        if self.stopped is None:
            self.stopped, self.slow = reason, slow
            self.stopped_event.set()
            if slow:
                log.info("realtime outbox stopped: %s", reason)
        self._queue.clear()
        self.bytes = 0
        self._written = self._queued
        self._progress.set()

    async def close(self) -> None:
        """Stop, and end the writer (a write still waiting on the socket is cancelled)."""
        writer = self._writer
        if self.stopped is None:
            self.stop("closed")
        if writer is not None and not writer.done():
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer

    def stats(self) -> dict[str, int]:
        return {"bytes": self.bytes, "frames": len(self._queue), "peak_bytes": self.peak,
                "coalesced": self.coalesced}


async def within(aw: Awaitable[Any], timeout: float) -> asyncio.Future | None:
    """Run `aw` for at most `timeout` seconds: its finished future, or None if it did not
    finish in time. Then it is cancelled and not waited for: a socket write blocked on a
    reader that does not read may not end on cancellation until the connection does (so
    `asyncio.wait_for`, which waits for the cancellation, could wait forever)."""
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    except asyncio.CancelledError:
        _abandon(fut)
        raise
    if fut in done:
        return fut
    _abandon(fut)
    return None


def _abandon(fut: asyncio.Future) -> None:
    fut.cancel()
    _abandoned.add(fut)  # referenced until it ends
    fut.add_done_callback(_abandoned.discard)


_abandoned: set[asyncio.Future] = set()


def dumps(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))
