"""StageEngine: the one contract of the three stage engines (Thinker, Talker, Code2Wav).

A stage engine serves many streams at once, each named by a request id, and is driven by
one thread (deployments/stages/loop.py) that only ever calls these six methods:

    open(rid, spec)   the stream's state: ThinkerRequest (the whole prompt, its sampling),
                      TalkerSpec (mode, seed, limits), VoicePrompt | None (Code2Wav's voice)
    feed(rid, msg)    a typed input: SpokenChunk (Talker), CodeChunk (Code2Wav); the Thinker
                      takes its whole input at open and refuses feeds
    abort(rid)        frees everything the stream holds, now; nothing more comes for it;
                      an unknown or already finished rid is a no-op
    step()            one batched engine step -> its outputs, each naming its stream
    has_work()        whether a step would do anything (streams that only wait for input
                      do not count, so an idle driver can block instead of spinning)
    stats()           numbers, among them `open_streams` (streams the engine holds)

Not thread-safe: every call comes from the driving thread.

`Holds` is the clock of the Thinker's and the Talker's holds for a turn's first audio
(`ThinkerRequest.hold_after_spoken`, `TalkerSpec.hold`; ended by their `resume(rid)`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

from pipeline.handoff import HOLD_LIMIT_S


@runtime_checkable
class StageOutput(Protocol):
    """What `step()` yields: ThinkerDelta, CodeChunk or PcmChunk (pipeline/handoff.py)."""

    request_id: str
    finished: bool  # the stream's last output


@runtime_checkable
class StageEngine(Protocol):
    def open(self, rid: str, spec: Any) -> None: ...

    def feed(self, rid: str, msg: Any) -> None: ...

    def abort(self, rid: str) -> None: ...

    def step(self) -> list[StageOutput]: ...

    def has_work(self) -> bool: ...

    def stats(self) -> dict[str, float]: ...


class Holds:
    """A stage's holds for first audio: a held stream keeps its hold's start (`start()`, a
    monotonic time; 0.0 = not held), and `check(since)` ends a hold that ran out, counting
    it. `started` and `timed_out` are the stage's counts for its stats."""

    def __init__(self, limit_s: float = HOLD_LIMIT_S):
        self.limit_s = limit_s
        self.started = self.timed_out = 0

    def start(self) -> float:
        self.started += 1
        return time.monotonic()

    def check(self, since: float) -> float:
        """`since`, or 0.0 once that hold has lasted `limit_s`."""
        if since and time.monotonic() - since >= self.limit_s:
            self.timed_out += 1
            return 0.0
        return since
