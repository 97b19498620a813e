"""StageEngine: the one contract of the three stage engines (Thinker, Talker, Code2Wav).

A stage engine serves many streams at once, each named by a request id, and is driven by
one thread (deployments/loop.py) that only ever calls these six methods:

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
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


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
