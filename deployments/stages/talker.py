"""Talker deployment: a TalkerEngine behind the shared StageServer.

Per turn: the ingress holds `session(rid, seed)` open (a stream: Opened, then heartbeats,
and a TextWanted should a held turn's first unit end before its first chunk); the Thinker
calls `feed(rid, ids, hidden, final)` as spoken text arrives (handed to the engine as a
SpokenChunk); every 25-code chunk (+3 lookahead) the engine releases goes straight to
Code2Wav through `code2wav.push`, in order. The session ends after its last chunk was
taken; cancelling it, or `abort(rid)`, frees the slot. A step failure or a failed push ends
the session with a StageFailure, which the ingress turns into the turn's error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np

from deployments.config import AppConfig
from deployments.stages.forward import Forwarder, Tombstones
from deployments.stages.server import StageServer
from deployments.wire import via
from pipeline.handoff import CodeChunk, SpokenChunk, StageFailure, TalkerSpec, TextWanted


class TalkerServer(StageServer):
    stage = "talker"
    next_stage, next_title, hands_on = "code2wav", "Code2Wav", "the codes"

    def __init__(
        self,
        app: AppConfig | dict,
        code2wav: Any = None,
        *,
        engine_cls: Any = None,
        source: Any = None,
    ):
        super().__init__(app, engine_cls=engine_cls, source=source)
        self.code2wav = code2wav
        self.mode = "full_span" if self.cfg.talker_mode == "full_span" else "streaming"
        self.feeds = 0  # feed calls received (full_span: one per turn)
        # Streams that released their last chunk. A fixed-length stream (max_codes) ends
        # while the Thinker may still be saying text: its later feeds are dropped, where a
        # feed for a stream this replica never had (it restarted) is refused.
        self._spoken = Tombstones()

    def _default_engine(self, device: str, settings: dict[str, Any]) -> tuple[Any, dict]:
        from pipeline.talker.engine import TalkerEngine

        return TalkerEngine, settings

    async def session(
        self, rid: str, seed: int | None = None, max_codes: int | None = None,
        hold: bool = False,
    ) -> AsyncIterator[Any]:
        """One turn's stream: Opened once the engine holds a slot for `rid`, Heartbeats while
        it speaks, a StageFailure if it cannot go on; it ends after the last code chunk was
        handed to Code2Wav. Cancelling it (the turn is over) frees the slot. `hold`: held
        after its first chunk until `resume(rid)` (TalkerSpec.hold)."""
        spec = TalkerSpec(self.mode, seed, max_codes, hold)
        async with aclosing(self._serve(rid, spec, forward=True)) as items:
            async for item in items:
                yield item

    def _refused(self, e: Exception) -> StageFailure | None:
        message = f"could not open the stream: {e}"
        if isinstance(e, RuntimeError):  # no free slot
            return StageFailure("talker", message, 503, "stage_busy")
        if isinstance(e, ValueError):  # a bad seed, mode or length
            return StageFailure("talker", message, 400, "invalid_request")
        return None

    def _emit(self, rid: str, outputs: list[CodeChunk | TextWanted],
              fwd: Forwarder | None) -> tuple[list, bool]:
        """Code chunks go to Code2Wav; a TextWanted goes to this stream's reader (the
        ingress, which resumes the Thinker)."""
        chunks = [c for c in outputs if isinstance(c, CodeChunk)]
        for chunk in chunks:
            fwd.push(chunk)
        done = bool(chunks) and chunks[-1].finished
        if done:
            self._spoken.add(rid)
        return [o for o in outputs if isinstance(o, TextWanted)], done

    async def _send(self, rid: str, chunks: list[CodeChunk], final: bool) -> bool:
        # Lookahead codes are not sent: Code2Wav buffers the stream's codes itself, and
        # they open the next chunk anyway.
        codes = np.array([c for ch in chunks for c in ch.codes], dtype=np.int64)
        spans = [(ch.started_at, ch.released_at) for ch in chunks if ch.released_at]
        code2wav = via(self.code2wav, self.grpc, codes.nbytes)
        return await code2wav.push.remote(rid, codes, final, spans)

    async def feed(self, rid: str, ids: list[int], hidden: np.ndarray | None, final: bool) -> bool:
        """Spoken ids (n,) + hidden (n, llm_dim) from the Thinker; False if rid is gone
        (aborted, or not opened on this replica within `timeouts.open_s`: the ingress starts
        the Thinker with this session's open, so a span may come before it). A stream that
        has spoken its fixed length takes the rest of the text and drops it."""
        if not self.loop.is_open(rid) and (rid in self._spoken or not await self._opens(rid)):
            return rid in self._spoken
        import torch

        self.feeds += 1
        h = None
        if hidden is not None:
            a = np.asarray(hidden, dtype=np.float32)
            # Ray hands numpy arguments over zero-copy from its store, read-only; a tensor
            # must own writable memory (a chunk's hidden states: tens of KiB).
            h = torch.from_numpy(a if a.flags.writeable else a.copy())
        chunk = SpokenChunk(list(ids), h, final)
        await self.loop.call(lambda e: e.feed(rid, chunk))
        return True

    def _leaks(self, engine: dict[str, Any]) -> list[str]:
        if engine.get("unaccounted_slots"):
            return [f"{engine['unaccounted_slots']} Talker slots held by no stream"]
        return []

    def _extra_stats(self) -> dict[str, Any]:
        return {"sessions": len(self._serving), "feeds": self.feeds}
