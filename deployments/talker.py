"""Talker deployment: a TalkerEngine behind an EngineLoop.

Per turn: the ingress holds `session(rid, seed)` open (a stream: Opened, then heartbeats);
the Thinker calls `feed(rid, ids, hidden, final)` as spoken text arrives; every 25-code
chunk (+3 lookahead) the engine releases goes straight to Code2Wav through `code2wav.push`,
in order. The session ends after its last chunk; cancelling it, or `abort(rid)`, frees the
slot. A step failure or a failed push ends the session with a StageFailure, which the
ingress turns into the turn's error.
"""

from __future__ import annotations

import dataclasses
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
    stats_dict,
)

log = logging.getLogger(__name__)


def make_talker_engine(source: Any, config: Any, device: str) -> Any:
    """TalkerEngine from a ModelSource: the `tts.` part of the checkpoint, strictly loaded."""
    import torch

    from pipeline.checkpoint import load_into, load_part, talker_schema
    from pipeline.talker.engine import TalkerEngine
    from pipeline.talker.model import TalkerModel
    from pipeline.utils import resolve_dtype

    cfg = source.config.talker
    dtype = resolve_dtype("auto", device)  # bf16 on CUDA, fp32 on CPU
    if torch.device(device).type != "cuda" and getattr(config, "talker_compile", False):
        # Inductor on CPU needs a C++ compiler and minutes of start-up; the knob is for GPUs
        config = dataclasses.replace(config, talker_compile=False)
    model = TalkerModel(cfg)
    load_into(model, load_part(source.tensors, "tts.", talker_schema(cfg), "cpu", torch.float32),
              "talker")
    return TalkerEngine(model.to(device=device, dtype=dtype), config)


class _RealTalker:
    """The real engine behind the `engine_cls.from_source(source, config, device)` protocol."""

    from_source = staticmethod(make_talker_engine)


class TalkerServer:
    def __init__(self, app: AppConfig | dict, code2wav: Any = None, *, engine_cls: Any = None,
                 source: Any = None):
        from pipeline.checkpoint import ModelSource

        cfg = AppConfig.model_validate(app)
        source = source or ModelSource.open(cfg.model)
        if engine_cls is None:
            from pipeline.talker.engine import TalkerEngineConfig

            engine_cls, config_cls = _RealTalker, TalkerEngineConfig
        else:
            config_cls = getattr(engine_cls, "config_cls", None)
        with stage_init(cfg, "talker") as device:
            self.engine = build_engine(engine_cls, source, cfg.talker.engine, device, config_cls)
        self.metrics = StageMetrics("talker")
        if hasattr(self.engine, "stats"):
            self.metrics.engine_stats = lambda: stats_dict(self.engine.stats())
        self.loop = EngineLoop(self.engine, name="talker", route=lambda c: (c.stream_id, c),
                               on_step=self.metrics.on_step, on_streams=self.metrics.streams,
                               on_failure=self._close_all, scope=engine_scope(cfg, "talker"))
        self.code2wav = code2wav
        self.mode = "full_span" if cfg.talker_mode == "full_span" else "streaming"
        self.timeouts = cfg.timeouts
        self._sessions: set[str] = set()
        self._aborted = Tombstones()
        self.feeds = 0  # feed calls received (full_span: one per turn)

    def _close_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:
            engine.close(rid)

    async def session(self, rid: str, seed: int | None = None,
                      max_codes: int | None = None) -> AsyncIterator[Any]:
        """One turn's stream: Opened once the engine holds a slot for `rid`, Heartbeats while
        it speaks, a StageFailure if it cannot go on; it ends after the last code chunk was
        handed to Code2Wav. Cancelling it (the turn is over) frees the slot."""
        if rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        q = self.loop.open(rid)
        self._sessions.add(rid)
        kw = {} if max_codes is None else {"max_codes": max_codes}
        fwd: Forwarder | None = None
        t = self.timeouts
        try:
            try:
                await self.loop.call(lambda e: e.open(rid, self.mode, seed, **kw))
            except RuntimeError as e:  # no free slot
                yield StageFailure("talker", f"could not open the stream: {e}", 503, "stage_busy")
                return
            except ValueError as e:  # a bad seed, mode or length
                yield StageFailure("talker", f"could not open the stream: {e}", 400,
                                   "invalid_request")
                return
            if rid in self._aborted:  # aborted while the engine was opening it
                return
            yield Opened("talker")

            def failed(e: BaseException) -> None:
                q.put_nowait(StageFailure("code2wav", f"could not take the codes: "
                                          f"{error_line(e)}", 503, "stage_unavailable"))

            fwd = Forwarder(self._sender(rid), name=f"talker->code2wav {rid}",
                            timeout_s=t.hop_s, on_error=failed)
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
            self.loop.post(lambda e: e.close(rid))

    def _sender(self, rid: str) -> Any:
        async def send(chunks: list[Any], final: bool) -> None:
            # Lookahead codes are not sent: Code2Wav buffers the stream's codes itself, and
            # they open the next chunk anyway.
            codes = np.array([c for ch in chunks for c in ch.codes], dtype=np.int64)
            spans = [(ch.started_at, ch.released_at) for ch in chunks
                     if getattr(ch, "released_at", 0.0)]
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
        if h is None:
            h = torch.zeros(0, self.engine.cfg.llm_dim)
        await self.loop.call(lambda e: e.feed_text(rid, ids, h, final))
        return True

    async def abort(self, rid: str) -> None:
        self._aborted.add(rid)
        q = self.loop.queue(rid)
        if q is not None:  # ends the session at its next item
            q.put_nowait(StageFailure("talker", "aborted", 499, "cancelled"))
        await self.loop.call(lambda e: e.close(rid))

    async def stats(self) -> dict[str, Any]:
        engine = await self.loop.call(lambda e: stats_dict(e.stats()) if hasattr(e, "stats") else {})
        streams = engine.get("open_streams", 0)
        leaks = []
        if engine.get("unaccounted_slots"):
            leaks.append(f"{engine['unaccounted_slots']} Talker slots held by no stream")
        return stage_stats(self.loop, self.timeouts.wedge_s, engine, streams, leaks,
                           sessions=len(self._sessions), feeds=self.feeds)

    def check_health(self) -> None:
        check_loop_health(self.loop, self.timeouts.wedge_s)
