"""Thinker deployment: a ThinkerEngine behind an EngineLoop.

`generate(req)` streams text back to its caller (the ingress). When the request asks for
speech, the spoken span (token ids + final-norm hidden states, numpy) goes straight to the
Talker through `talker.feed`, in order, so the ingress never carries hidden states.
In `full_span` mode the span is sent once, when the Thinker finishes. A feed that fails
(the Talker died, refused the span or did not answer in `timeouts.hop_s`) ends the stream
with a StageFailure: the turn cannot speak any more.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from deployments.config import GIB, AppConfig
from deployments.loop import EngineLoop, StageFailure
from deployments.metrics import StageMetrics
from deployments.stage import (
    Forwarder,
    Heartbeat,
    TextOut,
    build_engine,
    check_loop_health,
    engine_scope,
    error_line,
    next_item,
    stage_init,
    stage_stats,
)


class ThinkerServer:
    def __init__(
        self,
        app: AppConfig | dict,
        talker: Any = None,
        *,
        engine_cls: Any = None,
        source: Any = None,
    ):
        from pipeline.checkpoint import ModelSource

        cfg = AppConfig.model_validate(app)
        source = source or ModelSource.open(cfg.model)
        with stage_init(cfg, "thinker") as device:
            settings = dict(cfg.thinker.engine)
            if engine_cls is None:
                from pipeline.thinker.engine import ThinkerEngine

                engine_cls = ThinkerEngine
                kv = cfg.thinker.kv_cache_gib if device == "cuda" else cfg.thinker.cpu_kv_cache_gib
                if kv is not None:  # one config for GPU and CPU: the budget follows the device
                    settings["llm"] = {"kv_cache_bytes": int(kv * GIB), **settings.get("llm", {})}
            self.engine = build_engine(engine_cls, source, settings, device)
        self.metrics = StageMetrics("thinker")
        self.metrics.engine_stats = self.engine.stats
        self.loop = EngineLoop(
            self.engine,
            name="thinker",
            on_step=self.metrics.on_step,
            on_streams=self.metrics.streams,
            on_failure=self._abort_all,
            scope=engine_scope(cfg, "thinker"),
        )
        self.talker = talker
        self.full_span = cfg.talker_mode == "full_span"
        self.timeouts = cfg.timeouts
        self._forwarders: dict[str, Forwarder] = {}

    def _abort_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:  # worker thread: a failed step poisons every request
            engine.abort(rid)

    async def generate(self, req: Any) -> AsyncIterator[TextOut | Heartbeat | StageFailure]:
        rid = req.request_id
        q = self.loop.open(rid)
        fwd = self._forwarder(rid) if req.return_hidden and self.talker is not None else None
        finished = False
        t = self.timeouts
        try:
            try:
                await self.loop.call(lambda e: e.open(rid, req))
            except ValueError as e:  # the engine refused this request (e.g. over the context)
                yield StageFailure("thinker", str(e), 400, "invalid_request")
                return
            while not finished:
                first = await next_item(q, self.loop, "thinker", t.heartbeat_s, t.wedge_s)
                if isinstance(first, Heartbeat):
                    yield first
                    continue
                items = [first]
                while not q.empty():  # coalesce what piled up during one hop
                    items.append(q.get_nowait())
                out = TextOut("")
                for d in items:
                    if isinstance(d, StageFailure):
                        yield d
                        return
                    if fwd is not None and d.spoken_ids:
                        fwd.push((list(d.spoken_ids), _numpy(d.spoken_hidden)))
                    out.text += d.text
                    out.prompt_tokens = d.num_prompt_tokens or out.prompt_tokens
                    out.completion_tokens = d.num_output_tokens or out.completion_tokens
                    if d.timings:
                        out.timings = {**(out.timings or {}), **d.timings}
                    if d.finished:
                        out.finished, out.finish_reason, finished = True, d.finish_reason, True
                if fwd is not None and finished:
                    fwd.finish()
                yield out
        finally:
            self.loop.close(rid)
            if not finished:
                self.loop.post(lambda e: e.abort(rid))
                if fwd is not None:
                    fwd.cancel()
            self._forwarders.pop(rid, None)

    def _forwarder(self, rid: str) -> Forwarder:
        async def send(chunks: list[tuple[list[int], np.ndarray]], final: bool) -> None:
            ids = [i for c, _ in chunks for i in c]
            hidden = np.concatenate([h for _, h in chunks]) if chunks else None
            if not await self.talker.feed.remote(rid, ids, hidden, final):
                raise RuntimeError(f"Talker has no stream {rid!r} (closed or restarted)")

        def failed(e: BaseException) -> None:
            self.loop.deliver(
                rid,
                StageFailure(
                    "talker",
                    f"could not take the spoken text: {error_line(e)}",
                    503,
                    "stage_unavailable",
                ),
            )

        fwd = Forwarder(
            send,
            name=f"thinker->talker {rid}",
            hold=self.full_span,
            timeout_s=self.timeouts.hop_s,
            on_error=failed,
        )
        self._forwarders[rid] = fwd
        return fwd

    async def abort(self, rid: str) -> None:
        fwd = self._forwarders.pop(rid, None)
        if fwd is not None:
            fwd.cancel()
        if self.loop.is_open(rid):
            self.loop.close(rid)
            await self.loop.call(lambda e: e.abort(rid))

    async def stats(self) -> dict[str, Any]:
        engine = await self.loop.call(lambda e: e.stats())
        open_ = len(self.loop.open_keys)
        held = int(engine["open_streams"])
        leaks = []
        if len(self._forwarders) > open_:
            leaks.append(f"{len(self._forwarders)} forwarders for {open_} open calls")
        total = engine.get("num_total_blocks")
        if not held and total is not None and engine.get("num_free_blocks") != total:
            leaks.append(f"{total - engine['num_free_blocks']} KV blocks in use with no request")
        return stage_stats(
            self.loop, self.timeouts.wedge_s, engine, held, leaks, forwarders=len(self._forwarders)
        )

    def check_health(self) -> None:
        check_loop_health(self.loop, self.timeouts.wedge_s)


def _numpy(h: Any) -> np.ndarray:
    """Hidden states cross Ray as float32 numpy (read zero-copy from the object store)."""
    if isinstance(h, np.ndarray):
        return h.astype(np.float32, copy=False)
    return h.detach().float().cpu().numpy()
