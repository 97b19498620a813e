"""What a duplex wire needs from the model side: open a session, run one 1 s unit, close.

The wires (official.py, openai_shape.py) and the session manager only talk to a
`DuplexBackend`: the app's is StageBackend (sessions resident in the Thinker stage), the
tests' a scripted fake (tests/fakes.py).
"""

from __future__ import annotations

from collections.abc import Callable
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


# A unit's outcome as the wires use it: pipeline.duplex.session.UnitResult's fields, its
# prefill schema counted (`prefill_tokens`, for usage) as the Thinker stage sends it.
@dataclass
class UnitResult:
    is_listen: bool
    end_of_turn: bool
    text: str
    token_ids: list[int]
    codes: list[int]
    pcm: np.ndarray | None                   # float32 24 kHz, None or empty when silent
    prefill_tokens: int = 0


class DuplexBackend(Protocol):
    """Sessions by id. `unit` runs one unit of a session and returns its decision (`codes`
    empty and `pcm` None), as soon as the model has decided and said its text, which it may
    also hand `on_text` piece by piece before (the pieces join into a prefix of the
    decision's text); `speech` then returns that unit's codes and PCM once its audio is
    made. Neither is called again for the session before the other returns (`speech` only
    after a speaking unit); `close` frees everything the session holds and is called exactly
    once per `open` that returned, also after a failed `unit` or `speech`."""

    async def open(self, session_id: str, init: DuplexInit) -> None: ...

    async def unit(self, session_id: str, audio: np.ndarray, frames: list | None,
                   force: str | None, on_text: Callable[[str], None] | None = None
                   ) -> UnitResult: ...

    async def speech(self, session_id: str) -> tuple[list[int], np.ndarray | None]: ...

    async def close(self, session_id: str) -> None: ...


class StageBackend:
    """Sessions resident in a stage group's Thinker stage (`duplex_open` / `duplex_unit` /
    `duplex_speech` / `duplex_close` on its handle: deployments/stages/duplex.py), so a
    session's state lives beside the engine's model; each new session goes to the group
    holding the fewest, of those with room.

    `groups`: the ingress's Groups (`stages.via(stage, nbytes)` and `asleep`); `share`: the
    ingress replicas, each of which runs its share of every group's sessions."""

    def __init__(self, groups: list[Any], share: int = 1):
        self.groups = groups
        self.share = share
        self._where: dict[str, Any] = {}   # session id -> its group
        self._room: dict[int, int] = {}    # id(group) -> its sessions, this replica's share

    def _awake(self) -> list[Any]:
        return [g for g in self.groups if not getattr(g, "asleep", False)] or self.groups

    async def holds(self) -> int | None:
        """The sessions this replica may run in the awake groups: each group's Thinker
        tells what its KV pool holds (asked once a group), divided among the replicas.
        None: a Thinker without a KV pool (no bound from here)."""
        total = 0
        for g in self._awake():
            if id(g) not in self._room:
                held = await g.stages.via("thinker").duplex_holds.remote()
                if held.get("sessions") is None:
                    return None
                self._room[id(g)] = held["sessions"] // self.share
            total += self._room[id(g)]
        return total

    def _pick(self) -> Any:
        awake = self._awake()
        held = {id(g): 0 for g in awake}
        for g in self._where.values():
            if id(g) in held:
                held[id(g)] += 1
        # a group not yet asked (`holds`) has room as far as this replica knows
        room = [g for g in awake if id(g) not in self._room or held[id(g)] < self._room[id(g)]]
        return min(room or awake, key=lambda g: held[id(g)])

    async def open(self, session_id: str, init: DuplexInit) -> None:
        group = self._pick()
        nbytes = sum(a.nbytes for a in (init.ref_audio, init.prompt_wav) if a is not None)
        await group.stages.via("thinker", nbytes).duplex_open.remote(session_id, init)
        self._where[session_id] = group

    async def unit(self, session_id: str, audio: np.ndarray, frames: list | None,
                   force: str | None, on_text: Callable[[str], None] | None = None
                   ) -> UnitResult:
        group = self._where[session_id]
        nbytes = audio.nbytes + sum(f.width * f.height * 3 for f in frames or ())
        stream = group.stages.via("thinker", nbytes).options(stream=True).duplex_unit.remote(
            session_id, audio, frames, force)
        async for item in stream:
            if "text" in item:
                if on_text is not None:
                    on_text(item["text"])
            else:
                return UnitResult(**item["decision"], codes=[], pcm=None)
        raise RuntimeError("the Thinker stage ended a duplex unit without its decision")

    async def speech(self, session_id: str) -> tuple[list[int], np.ndarray | None]:
        group = self._where[session_id]
        out = await group.stages.via("thinker").duplex_speech.remote(session_id)
        return out["codes"], out["pcm"]

    async def close(self, session_id: str) -> None:
        group = self._where.pop(session_id, None)
        if group is not None:
            await group.stages.via("thinker").duplex_close.remote(session_id)

    def stats(self) -> dict[str, int]:
        return {"sessions": len(self._where), "holds": sum(self._room.values())}
