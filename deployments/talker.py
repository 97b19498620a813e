"""Talker deployment: a TalkerEngine behind an EngineLoop.

Per turn: `open(rid)` reserves a stream; the Thinker calls `feed(rid, ids, hidden, final)`
as spoken text arrives; every 25-code chunk (+3 lookahead) the engine releases goes
straight to Code2Wav through `code2wav.push`, in order. The stream closes after its last
chunk, or on `abort(rid)`. A step failure reaches the client through `code2wav.fail`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from deployments.config import AppConfig
from deployments.loop import EngineLoop, StageFailure
from deployments.metrics import StageMetrics
from deployments.stage import (
    Forwarder,
    Tombstones,
    build_engine,
    device_memory,
    stage_init,
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
                               on_step=self.metrics.on_step, on_failure=self._close_all)
        self.code2wav = code2wav
        self.mode = "full_span" if cfg.talker_mode == "full_span" else "streaming"
        self._pumps: dict[str, asyncio.Task] = {}
        self._aborted = Tombstones()
        self.feeds = 0  # feed calls received (full_span: one per turn)

    def _close_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:
            engine.close(rid)

    async def open(self, rid: str, seed: int | None = None, max_codes: int | None = None) -> None:
        if rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        q = self.loop.open(rid)
        kw = {} if max_codes is None else {"max_codes": max_codes}
        try:
            await self.loop.call(lambda e: e.open(rid, self.mode, seed, **kw))
        except BaseException:
            self.loop.close(rid)
            raise
        if rid in self._aborted:  # aborted while the engine was opening it
            self.loop.close(rid)
            await self.loop.call(lambda e: e.close(rid))
            raise RuntimeError(f"request {rid} was aborted")
        self._pumps[rid] = asyncio.get_running_loop().create_task(self._pump(rid, q))

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

    async def _pump(self, rid: str, q: asyncio.Queue) -> None:
        """Engine chunks of one stream -> Code2Wav, in order, until the last one."""
        async def send(chunks: list[Any], final: bool) -> None:
            # Lookahead codes are not sent: Code2Wav buffers the stream's codes itself, and
            # they open the next chunk anyway.
            codes = np.array([c for ch in chunks for c in ch.codes], dtype=np.int64)
            spans = [(ch.started_at, ch.released_at) for ch in chunks
                     if getattr(ch, "released_at", 0.0)]
            await self.code2wav.push.remote(rid, codes, final, spans)

        fwd = Forwarder(send, name=f"talker->code2wav {rid}")
        try:
            while True:
                item = await q.get()
                if isinstance(item, StageFailure):
                    fwd.cancel()
                    await self.code2wav.fail.remote(rid, item.stage, item.message)
                    return
                fwd.push(item)
                if item.finished:
                    fwd.finish()
                    return
        except asyncio.CancelledError:
            fwd.cancel()
            raise
        finally:
            self.loop.close(rid)
            self.loop.post(lambda e: e.close(rid))
            self._pumps.pop(rid, None)

    async def abort(self, rid: str) -> None:
        self._aborted.add(rid)
        task = self._pumps.pop(rid, None)
        if task is not None:
            task.cancel()
        if self.loop.is_open(rid):
            self.loop.close(rid)
        await self.loop.call(lambda e: e.close(rid))

    async def stats(self) -> dict[str, Any]:
        engine = await self.loop.call(lambda e: stats_dict(e.stats()) if hasattr(e, "stats") else {})
        return {"open": len(self.loop.open_keys), "pumps": len(self._pumps), "feeds": self.feeds,
                "steps": self.loop.steps, "failures": self.loop.failures, "engine": engine,
                **device_memory()}
