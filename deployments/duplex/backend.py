"""What a duplex wire needs from the model side: open a session, run one 1 s unit, close.

The wires (official.py, openai_shape.py) and the session manager only talk to a
`DuplexBackend`, so they run unchanged over the in-process backend here, over a future
stage-resident one, and over the scripted fake the tests use (tests/fakes.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

Force = Literal["listen", "speak"]
FORCES: tuple[str, ...] = ("listen", "speak")


@dataclass(frozen=True)
class DuplexInit:
    """One session's start: what `MiniCPMODuplex.prepare` takes, and the reference's own
    sampling kwargs a client may set (names of pipeline.duplex.config.DuplexConfig)."""

    mode: Literal["audio", "video"] = "audio"
    system_prompt: str | None = None
    ref_audio: np.ndarray | None = None      # 16 kHz float32: the voice in the prompt
    prompt_wav: np.ndarray | None = None     # 16 kHz float32: the Token2Wav voice
    max_slice_nums: int = 1
    audio_out: bool = True                   # false: text only (no Talker / Token2Wav)
    options: dict[str, Any] = field(default_factory=dict)  # DuplexConfig fields


# A unit's outcome as the wires use it: pipeline.duplex.session.UnitResult's fields, with
# its prefill schema (ids, ("audio", n) and ("img", n) rows) counted as `prefill_tokens`.
@dataclass
class UnitResult:
    is_listen: bool
    end_of_turn: bool
    text: str
    token_ids: list[int]
    codes: list[int]
    pcm: np.ndarray | None                   # float32 24 kHz, None or empty when silent
    prefill_tokens: int = 0


def prefill_positions(schema: Any) -> int:
    """Positions a unit's prefill schema appended: one per id, n per ("audio"|"img", n)."""
    return sum(item[1] if isinstance(item, tuple) else 1 for item in schema)


class DuplexBackend(Protocol):
    """Sessions by id. `unit` runs one unit of a session and is never called again for that
    session before it returns; `close` frees everything the session holds and is called
    exactly once per `open` that returned, also after a failed `unit`."""

    async def open(self, session_id: str, init: DuplexInit) -> None: ...

    async def unit(self, session_id: str, audio: np.ndarray, frames: list | None,
                   force: str | None) -> UnitResult: ...

    async def close(self, session_id: str) -> None: ...


class InProcessBackend:
    """Each session a `pipeline.duplex.session.DuplexSession` in this process, its units run
    one at a time on a worker thread (the model is shared; the event loop stays free).

    `factory(init) -> DuplexSession` builds a prepared-to-be session over loaded modules.
    TODO(integrator): build the default factory from the app's checkpoint and device once
    pipeline/duplex is merged (DuplexThinker / DuplexSpeech over omniray's modules)."""

    def __init__(self, factory: Any = None):
        self._factory = factory
        self._sessions: dict[str, Any] = {}
        self._lock = asyncio.Lock()  # one unit at a time over the shared modules

    def problem(self) -> str | None:
        """Why this backend cannot run sessions, or None."""
        if self._factory is None:
            return "full duplex is not available in this build (no duplex session factory)"
        return None

    def _build(self, init: DuplexInit) -> Any:
        if (why := self.problem()) is not None:
            raise RuntimeError(why)
        return self._factory(init)

    async def open(self, session_id: str, init: DuplexInit) -> None:
        async with self._lock:
            session = await asyncio.to_thread(self._build, init)
            await asyncio.to_thread(
                session.prepare, prefix=init.system_prompt, ref_audio=init.ref_audio,
                prompt_wav=init.prompt_wav)
        self._sessions[session_id] = (session, init.max_slice_nums)

    async def unit(self, session_id: str, audio: np.ndarray, frames: list | None,
                   force: str | None) -> UnitResult:
        session, slices = self._sessions[session_id]
        async with self._lock:
            r = await asyncio.to_thread(session.unit, audio, frames, force, slices)
        return UnitResult(r.is_listen, r.end_of_turn, r.text, list(r.token_ids),
                          list(r.codes), r.pcm, prefill_positions(getattr(r, "prefill", ())))

    async def close(self, session_id: str) -> None:
        entry = self._sessions.pop(session_id, None)
        close = getattr(entry[0], "close", None) if entry else None
        if close is not None:
            async with self._lock:
                await asyncio.to_thread(close)

    def stats(self) -> dict[str, int]:
        return {"sessions": len(self._sessions)}
