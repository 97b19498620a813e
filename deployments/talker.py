"""Talker deployment: a TalkerEngine behind an EngineLoop.

Per turn: the ingress holds `session(rid, seed)` open (a stream: Opened, then heartbeats);
the Thinker calls `feed(rid, ids, hidden, final)` as spoken text arrives (handed to the
engine as a SpokenChunk); every 25-code chunk (+3 lookahead) the engine releases goes
straight to Code2Wav through `code2wav.push`, in order. The session ends after its last chunk; cancelling it, or `abort(rid)`, frees the
slot. A step failure or a failed push ends the session with a StageFailure, which the
ingress turns into the turn's error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from deployments.config import AppConfig
from deployments.loop import EngineLoop, StageFailure
from deployments.metrics import StageMetrics
from deployments.stage import (
    Forwarder,
    Heartbeat,
    Opened,
    Tombstones,
    build_engine,
    check_loop_health,
    engine_scope,
    error_line,
    next_item,
    stage_init,
    stage_stats,
)
from pipeline.handoff import SpokenChunk, TalkerSpec

log = logging.getLogger(__name__)


class TalkerServer:
    def __init__(
        self,
        app: AppConfig | dict,
        code2wav: Any = None,
        *,
        engine_cls: Any = None,
        source: Any = None,
    ):
        from pipeline.checkpoint import ModelSource

        cfg = AppConfig.model_validate(app)
        source = source or ModelSource.open(cfg.model)
        if engine_cls is None:
            from pipeline.talker.engine import TalkerEngine

            engine_cls = TalkerEngine
        with stage_init(cfg, "talker") as device:
            self.engine = build_engine(engine_cls, source, cfg.talker.engine, device)
        self.metrics = StageMetrics("talker")
        self.metrics.engine_stats = self.engine.stats
        self.loop = EngineLoop(
            self.engine,
            name="talker",
            on_step=self.metrics.on_step,
            on_streams=self.metrics.streams,
            on_failure=self._abort_all,
            scope=engine_scope(cfg, "talker"),
        )
        self.code2wav = code2wav
        self.mode = "full_span" if cfg.talker_mode == "full_span" else "streaming"
        self.timeouts = cfg.timeouts
        self._sessions: set[str] = set()
        self._aborted = Tombstones()
        self.feeds = 0  # feed calls received (full_span: one per turn)

    def _abort_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:
            engine.abort(rid)

    async def session(
        self, rid: str, seed: int | None = None, max_codes: int | None = None
    ) -> AsyncIterator[Any]:
        """One turn's stream: Opened once the engine holds a slot for `rid`, Heartbeats while
        it speaks, a StageFailure if it cannot go on; it ends after the last code chunk was
        handed to Code2Wav. Cancelling it (the turn is over) frees the slot."""
        if rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        q = self.loop.open(rid)
        self._sessions.add(rid)
        spec = TalkerSpec(self.mode, seed, max_codes)
        fwd: Forwarder | None = None
        t = self.timeouts
        try:
            try:
                await self.loop.call(lambda e: e.open(rid, spec))
            except RuntimeError as e:  # no free slot
                yield StageFailure("talker", f"could not open the stream: {e}", 503, "stage_busy")
                return
            except ValueError as e:  # a bad seed, mode or length
                yield StageFailure(
                    "talker", f"could not open the stream: {e}", 400, "invalid_request"
                )
                return
            if rid in self._aborted:  # aborted while the engine was opening it
                return
            yield Opened("talker")

            def failed(e: BaseException) -> None:
                q.put_nowait(
                    StageFailure(
                        "code2wav",
                        f"could not take the codes: {error_line(e)}",
                        503,
                        "stage_unavailable",
                    )
                )

            fwd = Forwarder(
                self._sender(rid),
                name=f"talker->code2wav {rid}",
                timeout_s=t.hop_s,
                on_error=failed,
            )
            said = time.monotonic()  # the chunks go to Code2Wav, not to this stream's reader
            while True:
                item = await next_item(q, self.loop, "talker", t.heartbeat_s, t.wedge_s)
                if isinstance(item, (Heartbeat, StageFailure)):
                    yield item
                    said = time.monotonic()
                    if isinstance(item, StageFailure):
                        return
                    continue
                fwd.push(item)
                if item.finished:
                    fwd.finish()
                    break
                if time.monotonic() - said >= t.heartbeat_s:  # busy speaking: still alive
                    yield Heartbeat("talker")
                    said = time.monotonic()
            # The last chunk is on its way; a push that fails now is still this turn's failure
            # (the forwarder reports it into `q` before it ends).
            while not await fwd.wait(t.heartbeat_s):
                yield Heartbeat("talker")
            while not q.empty():
                if isinstance(item := q.get_nowait(), StageFailure):
                    yield item
                    return
        finally:
            if fwd is not None:
                fwd.cancel()
            self._sessions.discard(rid)
            self.loop.close(rid)
            self.loop.post(lambda e: e.abort(rid))

    def _sender(self, rid: str) -> Any:
        async def send(chunks: list[Any], final: bool) -> None:
            # Lookahead codes are not sent: Code2Wav buffers the stream's codes itself, and
            # they open the next chunk anyway.
            codes = np.array([c for ch in chunks for c in ch.codes], dtype=np.int64)
            spans = [(ch.started_at, ch.released_at) for ch in chunks if ch.released_at]
            if not await self.code2wav.push.remote(rid, codes, final, spans):
                raise RuntimeError(f"Code2Wav has no stream {rid!r} (closed or restarted)")

        return send

    async def feed(self, rid: str, ids: list[int], hidden: np.ndarray | None, final: bool) -> bool:
        """Spoken ids (n,) + hidden (n, llm_dim) from the Thinker; False if rid is gone."""
        if not self.loop.is_open(rid):
            return False
        import torch

        self.feeds += 1
        h = torch.from_numpy(np.asarray(hidden, dtype=np.float32)) if hidden is not None else None
        chunk = SpokenChunk(list(ids), h, final)
        await self.loop.call(lambda e: e.feed(rid, chunk))
        return True

    async def abort(self, rid: str) -> None:
        self._aborted.add(rid)
        q = self.loop.queue(rid)
        if q is not None:  # ends the session at its next item
            q.put_nowait(StageFailure("talker", "aborted", 499, "cancelled"))
        await self.loop.call(lambda e: e.abort(rid))

    async def stats(self) -> dict[str, Any]:
        engine = await self.loop.call(lambda e: e.stats())
        streams = int(engine["open_streams"])
        leaks = []
        if engine.get("unaccounted_slots"):
            leaks.append(f"{engine['unaccounted_slots']} Talker slots held by no stream")
        return stage_stats(
            self.loop,
            self.timeouts.wedge_s,
            engine,
            streams,
            leaks,
            sessions=len(self._sessions),
            feeds=self.feeds,
        )

    def check_health(self) -> None:
        check_loop_health(self.loop, self.timeouts.wedge_s)
