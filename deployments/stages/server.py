"""StageServer: the plumbing the three stage deployments share, around one engine.

Each stage serves one stream per turn (Thinker.generate, Talker.session, Code2Wav.stream).
This class holds what every stage does the same way: the engine built inside `stage_init`,
the EngineLoop that drives it, opening a stream (its loop queue, then the engine's `open`,
a refusal becoming the stream's StageFailure), the loop that turns engine outputs into what
the stream yields (with heartbeats while quiet and the loop's stage failures), forwarding to
the next stage through a Forwarder (a failed or refused hop ends the stream), an idempotent
abort (with tombstones where an abort may overtake the open), `stats()` with the invariants
and `check_health`.

A stage subclass says only what is its own: `stage` (its name and settings section), the
real engine class (`_default_engine`), which refusals of an open are the client's fault
(`_refused`), what a batch of engine outputs yields and hands on (`_emit`), the hop itself
(`_send`), its own per-stream records (`_forget`) and its extra stats and leak checks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from deployments.config import AppConfig, check_holds, dataclass_from_dict
from deployments.metrics import StageMetrics
from deployments.stages.forward import Forwarder, Tombstones, one_each
from deployments.stages.gc_watch import freeze_startup_objects, gc_watch
from deployments.stages.gpu import device_memory, stage_init, started
from deployments.stages.loop import EngineLoop
from deployments.wire import Heartbeat, Opened, error_line
from pipeline.handoff import StageFailure

log = logging.getLogger(__name__)


class StageServer:
    stage: ClassVar[str]  # "thinker", "talker" or "code2wav": its name and settings section
    announces_open: ClassVar[bool] = True  # the stream's first item is Opened
    tombstones: ClassVar[bool] = True  # an abort may land before the stream opens
    # The stage its outputs go on to, the name its messages use, and what it hands on.
    next_stage: ClassVar[str | None] = None
    next_title: ClassVar[str] = ""
    hands_on: ClassVar[str] = ""

    def __init__(self, app: AppConfig | dict, *, engine_cls: Any = None, source: Any = None):
        from pipeline.checkpoint import ModelSource

        self.cfg = cfg = AppConfig.model_validate(app)
        gc_watch()  # from the start, so a stall in any step can be told from a GC pause
        source = source or ModelSource.open(cfg.model)

        def build() -> Any:
            with stage_init(cfg, self.stage) as device:
                settings = cfg.engine_settings(self.stage)
                cls, kw = engine_cls, settings
                if cls is None:
                    cls, kw = self._default_engine(device, settings)
                engine = build_engine(cls, source, kw, device)
            # What its memory really holds, measured on the built engine: fewer turns than
            # the window admits would fail the turns past them, so the stage does not start.
            self.holds = self._holds(engine)
            if self.holds is not None:
                log.info("%s: holds %s (capacity %d)", self.stage, self.holds, cfg.capacity)
                check_holds(self.stage, self.holds, cfg.capacity)
            return engine

        self.metrics = StageMetrics(self.stage)
        self.loop = EngineLoop(
            None,
            name=self.stage,
            route=self._route,
            on_step=self.metrics.on_step,
            on_streams=self.metrics.streams,
            on_failure=self._abort_all,
        )
        # built (and warmed up) on the thread that will serve it
        self.holds: dict[str, Any] | None = None
        self.engine = self.loop.start(build)
        self.metrics.engine_stats = self.engine.stats
        if self.holds is not None:
            self.metrics.holds(self.holds)
        self.timeouts = cfg.timeouts
        self.grpc = cfg.stage_transport == "grpc"  # the hops to the next stage (`via`)
        self.hold_forward = False  # the Forwarder keeps everything until the stream's end
        # ... or sends once the pending chunks' sizes add up to this (Forwarder `at_least`)
        self.forward_at_least, self.forward_size = 1, one_each
        self.model_config = source.config
        self.source = source
        self._serving: set[str] = set()  # streams inside their generator
        self._forwarders: dict[str, Forwarder] = {}
        self._aborted = Tombstones() if self.tombstones else None
        self._open_waiters: dict[str, asyncio.Event] = {}  # hops that came before the open
        freeze_startup_objects()  # last: the engine (and its warm-up) is built

    # -- what a stage says about itself --------------------------------------------------

    def _default_engine(self, device: str, settings: dict[str, Any]) -> tuple[Any, dict]:
        """The real engine class and its settings, when no engine class is injected."""
        raise NotImplementedError

    def _route(self, out: Any) -> tuple[str, Any]:
        """EngineLoop's route (worker thread): an engine output -> (stream, queued item)."""
        return out.request_id, out

    def _engine_spec(self, engine: Any, spec: Any) -> Any:
        """What the engine's `open` takes for the stream's `spec` (worker thread)."""
        return spec

    def _refused(self, e: Exception) -> StageFailure | None:
        """The stream's StageFailure for an `open` the engine refused; None: not a refusal."""
        return None

    def _emit(self, rid: str, outputs: list[Any], fwd: Forwarder | None) -> tuple[list, bool]:
        """A batch of the stream's engine outputs -> (items to yield, whether it was the last),
        handing what the next stage takes to `fwd`."""
        raise NotImplementedError

    async def _send(self, rid: str, items: list[Any], final: bool) -> bool:
        """One hop to the next stage; False if it has no such stream."""
        raise NotImplementedError

    def _forget(self, rid: str) -> None:
        """Drop the stage's own records of `rid` (its stream ended or was aborted)."""

    def _holds(self, engine: Any) -> dict[str, Any] | None:
        """The turns the built engine's memory holds (`engine.capacity()`: streams,
        stream_bytes, budget_bytes, holder); None for an engine that does not say."""
        capacity = getattr(engine, "capacity", None)
        return dict(capacity()) if callable(capacity) else None

    def _leaks(self, engine: dict[str, Any]) -> list[str]:
        return []

    def _extra_stats(self) -> dict[str, Any]:
        return {}

    # -- one stream -----------------------------------------------------------------------

    def _abort_all(self, engine: Any, _: BaseException) -> None:
        for rid in self.loop.open_keys:  # worker thread: a failed step poisons every stream
            engine.abort(rid)

    async def _open(self, rid: str, spec: Any) -> StageFailure | None:
        """Open the engine's stream; the StageFailure to yield if the engine refused it."""
        try:
            await self.loop.call(lambda e: e.open(rid, self._engine_spec(e, spec)))
        except Exception as e:
            failure = self._refused(e)
            if failure is None:
                raise
            return failure
        return None

    async def _serve(self, rid: str, spec: Any, *, forward: bool) -> AsyncIterator[Any]:
        """The stream of `rid`: [Opened,] what its engine outputs yield, Heartbeats while
        nothing is said for `heartbeat_s`, and a StageFailure (the last item) if it cannot
        go on. Cancelling it, or its end, frees everything it holds."""
        if self._aborted is not None and rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        q = self.loop.open(rid)
        self._serving.add(rid)
        fwd: Forwarder | None = None
        done = False
        t = self.timeouts
        try:
            failure = await self._open(rid, spec)
            self._wake_open_waiters(rid)  # hops that came first: the stream takes them now
            if failure is not None:
                yield failure
                return
            if self._aborted is not None and rid in self._aborted:  # aborted while opening
                return
            if self.announces_open:
                yield Opened(self.stage)
            if forward:
                fwd = self._forwarder(rid)
            said = time.monotonic()
            while not done:
                first = await next_item(q, self.loop, self.stage, t.heartbeat_s, t.wedge_s)
                if isinstance(first, Heartbeat):
                    yield first
                    said = time.monotonic()
                    continue
                items = [first]
                while not q.empty():  # coalesce what piled up during one yield
                    items.append(q.get_nowait())
                cut = next((i for i, x in enumerate(items) if isinstance(x, StageFailure)), None)
                outputs = items if cut is None else items[:cut]
                shown: list[Any] = []
                if outputs:
                    shown, done = self._emit(rid, outputs, fwd)
                    if done and fwd is not None:
                        fwd.finish()
                for item in shown:
                    yield item
                    said = time.monotonic()
                if cut is not None:
                    yield items[cut]
                    return
                # Outputs that only go on to the next stage: tell the reader it is alive.
                if not done and time.monotonic() - said >= t.heartbeat_s:
                    yield Heartbeat(self.stage)
                    said = time.monotonic()
            if fwd is not None:
                # The last hop is on its way: the stream stays open until it returned, so a
                # hop that fails now (the next stage died or has no such stream) is still
                # this stream's failure (the forwarder reports it into `q` before it ends).
                while not await fwd.wait(t.heartbeat_s):
                    yield Heartbeat(self.stage)
                while not q.empty():
                    if isinstance(item := q.get_nowait(), StageFailure):
                        yield item
                        return
        finally:
            self._wake_open_waiters(rid)
            if fwd is not None:
                fwd.cancel()
            self._forwarders.pop(rid, None)
            self._serving.discard(rid)
            self._forget(rid)
            self.loop.close(rid)
            self.loop.post(lambda e: e.abort(rid))

    def _forwarder(self, rid: str) -> Forwarder:
        async def send(items: list[Any], final: bool) -> None:
            if not await self._send(rid, items, final):
                raise RuntimeError(f"{self.next_title} has no stream {rid!r} (closed or restarted)")

        def failed(e: BaseException) -> None:
            message = f"could not take {self.hands_on}: {error_line(e)}"
            failure = StageFailure(self.next_stage, message, 503, "stage_unavailable")
            self.loop.deliver(rid, failure)

        fwd = Forwarder(
            send,
            name=f"{self.stage}->{self.next_stage} {rid}",
            hold=self.hold_forward,
            at_least=self.forward_at_least,
            size=self.forward_size,
            timeout_s=self.timeouts.hop_s,
            on_error=failed,
        )
        self._forwarders[rid] = fwd
        return fwd

    def _takes_hops(self, rid: str) -> bool:
        """Whether `rid`'s stream takes hops from the previous stage now."""
        return self.loop.is_open(rid)

    async def _opens(self, rid: str) -> bool:
        """Whether `rid`'s stream takes hops, waiting up to `timeouts.open_s` for its open:
        the ingress starts the Thinker with the speech opens, so a hop may come first. False
        at once for an aborted stream; an abort or a refused open ends the wait."""
        if self._takes_hops(rid):
            return True
        if self._aborted is not None and rid in self._aborted:
            return False
        ev = self._open_waiters.setdefault(rid, asyncio.Event())
        try:
            async with asyncio.timeout(self.timeouts.open_s):
                await ev.wait()
        except TimeoutError:
            pass
        finally:
            if self._open_waiters.get(rid) is ev and not ev.is_set():
                del self._open_waiters[rid]
        return self._takes_hops(rid)

    def _wake_open_waiters(self, rid: str) -> None:
        ev = self._open_waiters.pop(rid, None)
        if ev is not None:
            ev.set()

    # -- the handle's common methods ------------------------------------------------------

    async def abort(self, rid: str) -> None:
        """End `rid`'s stream (at its next item) and free what the engine holds for it; an
        abort that lands before the stream opens still wins where the stage has tombstones.
        Idempotent."""
        if self._aborted is not None:
            self._aborted.add(rid)
        self._wake_open_waiters(rid)  # a hop waiting for this stream's open: it will not come
        fwd = self._forwarders.pop(rid, None)
        if fwd is not None:
            fwd.cancel()
        q = self.loop.queue(rid)
        if q is not None:
            q.put_nowait(StageFailure(self.stage, "aborted", 499, "cancelled"))
        self._forget(rid)
        self.loop.close(rid)
        await self.loop.call(lambda e: e.abort(rid))

    async def resume(self, rid: str) -> None:
        """End `rid`'s hold for its first audio (engines that hold: the Thinker's and the
        Talker's); fire-and-forget, a stream that is gone is ignored."""
        self.loop.post(lambda e: e.resume(rid) if hasattr(e, "resume") else None)

    async def profile(self, steps: int = 8, timeout_s: float = 300.0) -> dict[str, Any]:
        """Profile the engine's next `steps` steps where they run (deployments/profiling.py):
        returns once they ran, or after `timeout_s` with those that did:
        {"stage": name, "steps": [per-step summary, ...]}."""
        prof = self.loop.profile(steps)
        done = asyncio.wrap_future(prof.done)
        await asyncio.wait({done}, timeout=timeout_s)
        if not done.done():
            self.loop.unprofile(prof)
        return {"stage": self.loop.name, "steps": prof.done.result()}

    async def stats(self) -> dict[str, Any]:
        """Its open streams, capacity, `holds` (the turns its memory holds, measured once
        built: streams, stream_bytes, budget_bytes, holder) and engine stats, and the
        invariants: `idle` (no stream
        open and the engine holds nothing), `leaks` (accounting that does not add up),
        `health` (None, or why the loop is unhealthy); `gpu_sharing` is what the stage found
        at start on its GPU: sharing, memory, start times (None on CPU)."""
        engine = await self.loop.call(lambda e: e.stats())
        loop, open_, held = self.loop, len(self.loop.open_keys), int(engine["open_streams"])
        leaks = self._leaks(engine)
        extra = self._extra_stats()
        if self.next_stage is not None:
            if len(self._forwarders) > open_:
                leaks.insert(0, f"{len(self._forwarders)} forwarders for {open_} open calls")
            extra = {"forwarders": len(self._forwarders), **extra}
        if held > open_:
            leaks.insert(0, f"engine holds {held} streams but {open_} are open")
        return {"open": open_, "capacity": self.cfg.capacity, "holds": self.holds,
                **extra, "steps": loop.steps,
                "failures": loop.failures, "engine": engine, "idle": open_ == 0 and held == 0,
                "leaks": leaks, "health": loop.health(self.timeouts.wedge_s),
                "pid": os.getpid(), "gpu_sharing": started(loop.name),
                "gc": gc_watch().stats(), **device_memory()}

    def check_health(self) -> None:
        """Serve's `check_health`: raise while the engine loop is dead or wedged (Serve then
        replaces the replica, which ends its turns at once)."""
        problem = self.loop.health(self.timeouts.wedge_s)
        if problem:
            raise RuntimeError(problem)


async def next_item(
    q: asyncio.Queue, loop: Any, stage: str, heartbeat_s: float, wedge_s: float
) -> Any:
    """The next item of a stream's queue, or a Heartbeat (StageFailure if the engine loop is
    wedged) when nothing comes within `heartbeat_s`."""
    if not q.empty():  # the common case while streaming: no timer, no task
        return q.get_nowait()
    try:
        return await asyncio.wait_for(q.get(), heartbeat_s)
    except asyncio.TimeoutError:
        problem = loop.health(wedge_s)
        if problem:
            return StageFailure(stage, problem, 503, "stage_unavailable")
        return Heartbeat(stage)


def build_engine(
    engine_cls: Any, source: Any, engine_kwargs: dict[str, Any], device: str, config_cls: Any = None
) -> Any:
    """`engine_cls.from_source(source, config, device)`, the config validated from the
    stage's `engine:` settings (unknown keys fail here, at startup, with the key named) as
    `config_cls` (default: the engine class's own). With none (fakes: `config_cls = None`),
    the settings dict is passed as is."""
    config_cls = config_cls or engine_cls.config_cls
    config = (
        dict(engine_kwargs)
        if config_cls is None
        else dataclass_from_dict(config_cls, engine_kwargs, engine_cls.__name__)
    )
    return engine_cls.from_source(source, config, device)
