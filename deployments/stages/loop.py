"""EngineLoop: one worker thread drives an engine's `step()` beside Serve's event loop.

Why a thread: a step is blocking PyTorch work; running it on the replica's asyncio loop
would stall every other call. Why one loop per engine: requests that arrive while a step
runs are added before the next one, so concurrent calls batch together (continuous
batching) without any waiting policy here.

Contract with the engine: the StageEngine protocol (pipeline/stage_engine.py). The loop
itself calls only `has_work()` and `step()`; everything else (open, feed, abort, stats) is
sent as a command (`call` / `post`), so every engine call happens on the worker thread and
engines need no locks. Outputs are routed by `route(output) -> (key, item)` (default: the
output's `request_id`, the output itself) to the asyncio queue registered for that key;
items for unknown keys (aborted requests) are dropped. If `step()` raises, every open queue
receives a `StageFailure` and `on_failure` (e.g. abort everything) runs on the worker
thread, so the next request starts clean.

Side jobs (`call_steps`): work that is not the engine's own but shares its thread and GPU,
in steps, e.g. the duplex units' scheduler (deployments/stages/duplex.py). `fn(engine)` makes a
generator on the worker thread; the loop advances it one `next()` an iteration, then runs
the engine's step when the engine has work (one side step, one engine step), back to back
when it has none, with the commands still run between steps. So a long side job delays each
engine step by one of its steps, never by all of them. A side step may run that
iteration's engine step itself, with rows of its own in the engine's forward
(`guest_step`: the duplex units' decode rows beside the chat turns' decodes, one weight
read for both); the iteration then runs no other. Its return value (or what it
raised) settles its caller; a failed side step fails that job only, not the engine's
streams. Side jobs run one at a time, in the order they came (the duplex units have one
in flight at most); a job whose caller went away still runs to its end, as a command does,
its result dropped.

`health(wedge_s)` tells a live loop from a wedged one: the worker thread died, or one step,
side step or command has run longer than `wedge_s`. Stages report it through Serve's
`check_health` and in their streams' heartbeats, so a stuck engine ends its turns instead of
hanging them.

`start(build)` builds the engine on the worker thread itself and then serves: its warm-up
runs on the thread that serves, so what CUDA keeps per thread (cuBLAS and cuDNN handles,
their workspaces) exists before the first request instead of being made in its step.

`profile(steps)` profiles the next `steps` steps where they run (stages/profiling.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pipeline.handoff import StageFailure
from pipeline.stage_engine import StageEngine, StageOutput

log = logging.getLogger(__name__)

# Wake-up period of an idle worker: to notice `stop()`, and a hold that ran out
# (pipeline.stage_engine.Holds: held work is no work until then, and no command comes).
IDLE_POLL_S = 0.05


@dataclass
class StepRecord:
    """What one step did, for metrics."""

    seconds: float
    outputs: int
    queued_commands: int


def _settle(
    fut: Future | None, *, result: Any = None, exception: BaseException | None = None
) -> bool:
    """Complete a caller's future unless it was cancelled; True if someone got it."""
    if fut is None or not fut.set_running_or_notify_cancel():
        return False
    if exception is not None:
        fut.set_exception(exception)
    else:
        fut.set_result(result)
    return True


class EngineLoop:
    def __init__(
        self,
        engine: StageEngine | None,
        *,
        name: str,
        route: Callable[[StageOutput], tuple[str, Any]] = lambda out: (out.request_id, out),
        on_step: Callable[[StepRecord], None] | None = None,
        on_failure: Callable[[StageEngine, BaseException], None] | None = None,
        on_streams: Callable[[int], None] | None = None,
    ):
        self.engine = engine
        self.name = name
        self._route = route
        self._on_step = on_step
        self._on_failure = on_failure
        self._on_streams = on_streams  # told the number of open keys when it changes
        self._commands: queue.Queue[tuple[Callable, Future | None]] = queue.Queue()
        # side jobs (`call_steps`), the running one first; touched by the worker thread only
        self._jobs: deque[tuple[Generator, Future]] = deque()
        self._queues: dict[str, asyncio.Queue] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.side_steps = 0
        self.guest_steps = 0  # engine steps a side step ran with its rows (`guest_step`)
        self._stepped = False  # this iteration's engine step has run
        self.failures = 0
        self.step_started_at = 0.0
        # monotonic start of the running step / side step / command; 0 = waiting
        self._busy_since = 0.0
        self._busy_what = ""
        self._profiler: Any = None  # a StepProfiler while steps are to be profiled

    # -- event-loop side -----------------------------------------------------------------

    def start(self, build: Callable[[], StageEngine]) -> StageEngine:
        """Build the engine with `build()` on a new worker thread and serve
        it from that thread; return it once built (blocking). Raises what `build` raised,
        leaving no thread. Until the first `open` / `call` no output can exist, so the
        thread needs no event loop before then."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: the engine loop is already running")
        built: Future = Future()
        self._spawn(build, built)
        return built.result()

    def _ensure_started(self) -> None:
        if self._aloop is None:
            self._aloop = asyncio.get_running_loop()
        if self._thread is None:
            self._spawn()

    def _spawn(self, *build_args: Any) -> None:
        self._thread = threading.Thread(
            target=self._run, args=build_args, name=f"{self.name}-engine", daemon=True
        )
        self._thread.start()

    def open(self, key: str) -> asyncio.Queue:
        """Register the queue that receives `key`'s outputs (call before adding work)."""
        self._ensure_started()
        if key in self._queues:
            raise ValueError(f"{self.name}: request id {key!r} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[key] = q
        self._streams_changed()
        return q

    def close(self, key: str) -> None:
        if self._queues.pop(key, None) is not None:
            self._streams_changed()

    def _streams_changed(self) -> None:
        if self._on_streams is not None:
            try:
                self._on_streams(len(self._queues))
            except Exception:  # metrics must never break a stream
                log.debug("on_streams failed", exc_info=True)

    def is_open(self, key: str) -> bool:
        return key in self._queues

    @property
    def open_keys(self) -> list[str]:
        return list(self._queues)

    async def call(self, fn: Callable[[StageEngine], Any]) -> Any:
        """Run `fn(engine)` on the worker thread between steps; return its result."""
        self._ensure_started()
        fut: Future = Future()
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    async def call_steps(self, fn: Callable[[StageEngine], Generator[Any, None, Any]]) -> Any:
        """Run the generator `fn(engine)` makes (on the worker thread, in order with the
        commands) one `next()` a loop iteration beside the engine's steps; return its return
        value, or raise what it raised (module docstring)."""
        self._ensure_started()
        fut: Future = Future()
        self._commands.put((lambda e: self._add_job(fn, fut), None))
        return await asyncio.wrap_future(fut)

    def profile(self, steps: int) -> Any:
        """Profile the next `steps` steps (a StepProfiler: its `done` future gets them); one
        armed before gets what it has."""
        from deployments.stages.profiling import StepProfiler

        new = StepProfiler(steps)
        self.post(lambda e: new.warm_up())  # on the worker thread, before its next step
        old, self._profiler = self._profiler, new
        if old is not None:
            old.finish()
        return new

    def unprofile(self, profiler: Any) -> None:
        """Stop profiling with `profiler` (it gets the steps it has)."""
        if self._profiler is profiler:
            self._profiler = None
        profiler.finish()

    def post(self, fn: Callable[[StageEngine], Any]) -> None:
        """Fire-and-forget `fn(engine)` (errors are logged)."""
        self._commands.put((fn, None))

    @property
    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def health(self, wedge_s: float) -> str | None:
        """None while the loop serves; otherwise why it does not (thread dead, or one step or
        command running for longer than `wedge_s`)."""
        if not self.alive:
            return f"{self.name} engine thread died"
        since = self._busy_since
        if since and time.monotonic() - since > wedge_s:
            return (
                f"{self.name} engine is stuck: one {self._busy_what} has run for "
                f"{time.monotonic() - since:.0f} s (limit {wedge_s:g} s)"
            )
        return None

    def stop(self) -> None:
        self._stopping = True
        self._commands.put((lambda e: None, None))
        if self._thread is not None:
            self._thread.join(timeout=5)

    def queue(self, key: str) -> asyncio.Queue | None:
        return self._queues.get(key)

    def deliver(self, key: str, item: Any) -> None:
        """Put `item` on `key`'s queue (event-loop side; dropped if the key is closed)."""
        q = self._queues.get(key)
        if q is not None:
            q.put_nowait(item)

    def _deliver_all(self, item: Any) -> None:
        for q in list(self._queues.values()):
            q.put_nowait(item)

    # -- worker thread ------------------------------------------------------------------

    def _run_commands(self, block: bool, timeout: float) -> int:
        """Run queued commands (waiting up to `timeout` for the first if `block`).

        A command always runs, even if its caller stopped waiting (a cancelled `call`):
        an add is then undone by the abort its caller posts next, in order."""
        n = 0
        try:
            fn, fut = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return 0
        while True:
            n += 1
            self._mark_busy("command")
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                if not _settle(fut, exception=e):
                    log.warning("%s: command failed: %r", self.name, e)
            else:
                _settle(fut, result=result)
            finally:
                self._busy_since = 0.0
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return n

    def _add_job(self, fn: Callable[[StageEngine], Generator], fut: Future) -> None:
        try:
            steps = fn(self.engine)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            if not _settle(fut, exception=e):
                log.warning("%s: side job failed: %r", self.name, e)
            return
        self._jobs.append((steps, fut))

    def _side_step(self) -> None:
        """One `next()` of the oldest side job; its end (its return or what it raised)
        settles its caller and lets the next job start."""
        steps, fut = self._jobs[0]
        self._mark_busy("side step")
        try:
            next(steps)
        except StopIteration as done:
            self._jobs.popleft()
            _settle(fut, result=done.value)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller, not the streams
            self._jobs.popleft()
            if not _settle(fut, exception=e):
                log.warning("%s: side job failed: %r", self.name, e)
        finally:
            self._busy_since = 0.0
        self.side_steps += 1

    def _run(self, build: Callable[[], StageEngine] | None = None,
             built: Future | None = None) -> None:
        if build is not None:  # start(): the engine is made here first
            try:
                self.engine = build()
            except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
                built.set_exception(e)
                return
            built.set_result(self.engine)
        self._serve()

    def _serve(self) -> None:
        while not self._stopping:
            if self._aloop is not None and self._aloop.is_closed():
                return  # the event loop it serves is gone (its process is shutting down)
            try:
                self._iterate()
            except Exception as e:  # noqa: BLE001 - a stage fault must not kill the loop
                if self._aloop is not None and self._aloop.is_closed():
                    return
                self._fail(e)

    def guest_step(self, guests: Any) -> None:
        """From a side step: the engine's step with `guests` in its forward
        (pipeline.thinker.llm_engine.runner.GuestRows; an engine with nothing to do runs
        them alone), its outputs routed as any step's. The iteration runs no other. A step
        that raises fails the engine's streams as any failed step does, and then the side
        step that asked for it."""
        what, since = self._busy_what, self._busy_since
        self._stepped = True
        try:
            self._step(0, guests)
        except Exception as e:
            self._fail(e)
            raise
        finally:
            self._busy_what, self._busy_since = what, since
        self.guest_steps += 1

    def _iterate(self) -> None:
        """Commands, then one side step if a side job is live, then one step if there is
        work and the side step ran none (`guest_step`).

        Steps follow each other with no wait while `has_work()` holds, whether or not they
        emit anything: a Talker step that draws a code mid-chunk emits nothing and is still
        the stream's progress, so any pause after it would be paid on every code. Streams
        that only wait for input are not work (the StageEngine contract), so a waiting
        engine with no side job blocks on its commands instead of spinning."""
        if not self.engine.has_work() and not self._jobs:
            self._run_commands(block=True, timeout=IDLE_POLL_S)
            return
        n_cmds = self._run_commands(block=False, timeout=0)
        self._stepped = False
        if self._jobs:
            self._side_step()
        if not self._stepped and self.engine.has_work():
            self._step(n_cmds)

    def _step(self, n_cmds: int, guests: Any = None) -> None:
        """One engine step (with `guests`: `guest_step`); its outputs to their queues."""
        self.step_started_at = time.time()  # wall clock, read by route() for timings
        t0 = time.perf_counter()
        self._mark_busy("step")
        prof = self._profiler
        run = self.engine.step if guests is None else lambda: self.engine.step(guests)
        try:
            if prof is None:
                outputs = run()
            else:
                with prof.step():
                    outputs = run()
                if prof.left <= 0 and self._profiler is prof:
                    self._profiler = None
        finally:
            self._busy_since = 0.0
        dt = time.perf_counter() - t0
        self.steps += 1
        for out in outputs:
            key, item = self._route(out)
            self._aloop.call_soon_threadsafe(self.deliver, key, item)
        if self._on_step is not None:
            self._on_step(StepRecord(dt, len(outputs), n_cmds))

    def _mark_busy(self, what: str) -> None:
        self._busy_what = what
        self._busy_since = time.monotonic()

    def _fail(self, e: BaseException) -> None:
        """Every open request gets a StageFailure; `on_failure` cleans the engine."""
        self.failures += 1
        log.exception("%s: engine step failed", self.name)
        failure = StageFailure(self.name, f"{type(e).__name__}: {e}")
        self._aloop.call_soon_threadsafe(self._deliver_all, failure)
        if self._on_failure is not None:
            try:
                self._on_failure(self.engine, e)
            except Exception:
                log.exception("%s: recovery after a failed step failed", self.name)
