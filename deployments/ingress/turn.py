"""One chat turn across the three stages, as the ingress runs it.

    1. speech: wait for a slot in the active stream window (FIFO); text-only turns need no
       Talker or Code2Wav state and skip the window. A full queue refuses the turn at once
       (503 `queue_full`, nothing opened); an admitted turn's wait is its Done's `queue_s`
    2. start Thinker.generate (text back here; spoken span Thinker -> Talker -> Code2Wav
       directly), and right after it
    3. speech: open Talker.session and Code2Wav.stream (with the voice). Both opens must
       answer Opened within `timeouts.open_s`, or the turn ends and whatever opened is
       released; the Thinker's text waits for them
    4. merge the streams into events as they come; free the slot on the last audio piece
       (text-only: on the last text); with `hold_rows`, the first audio piece resumes the
       Thinker and the Talker, which held the turn's later work so the first audio came
       sooner (streaming talker_mode)
    5. end with exactly one terminal event: Done, or Error (bad input the engine refused,
       a stage failure, a stage that died or stopped answering, the request timeout)

Every stage that holds the turn's state does so inside a stream this runner keeps open, so
a replica that dies fails its stream at once and the turn ends within milliseconds; a
stream silent for `timeouts.stall_s` (stages send heartbeats every `timeouts.heartbeat_s`)
ends the turn as a stage that stopped answering. A cancelled turn (client gone) yields
nothing more. On every exit the streams are cancelled (which frees their state in the
stages) and, unless the turn finished, aborts are sent too: they are idempotent and win
over an open still in flight (tombstones).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from deployments.config import TimeoutSettings
from deployments.ingress.window import ActiveStreamWindow, QueueFull
from deployments.metrics import AppMetrics
from deployments.wire import (
    SAMPLE_RATE,
    AudioChunk,
    Done,
    Error,
    Event,
    Heartbeat,
    NamedVoice,
    Opened,
    TextDelta,
    Usage,
    error_line,
    via,
)
from pipeline.handoff import StageFailure, TextWanted

log = logging.getLogger(__name__)

_END = object()
# Stream name -> the stage that serves it.
_STAGE = {"text": "thinker", "talker": "talker", "audio": "code2wav"}


@dataclass
class Stages:
    """Handles (DeploymentHandle, or tests/fakes.py LocalHandle in-process). `grpc`:
    a turn's own calls go over Serve's gRPC data plane (AppConfig.stage_transport)."""

    thinker: Any
    talker: Any
    code2wav: Any
    grpc: bool = False

    def via(self, stage: str, nbytes: int = 0) -> Any:
        """The handle of `stage` for a turn's call carrying `nbytes` of arrays."""
        return via(getattr(self, stage), self.grpc, nbytes)

    async def answer(self, timeout: float) -> None:
        """All three stages answer a stats call within `timeout` (raises otherwise)."""
        await asyncio.wait_for(asyncio.gather(
            self.thinker.stats.remote(), self.talker.stats.remote(),
            self.code2wav.stats.remote()), timeout=timeout)


@dataclass
class Group:
    """One stage group as the ingress sees it: its handles and its window. A group whose
    stage just died (a turn ended with `stage_unavailable`) gets no new turns until all
    three of its stages answer again (`TurnRunner` probes them). An autoscaled group
    (`scalable`, past min_groups) sleeps with no replicas until every awake group's window
    is full, and goes back to sleep after `group_idle_s` without a turn."""

    name: str
    stages: Stages
    window: ActiveStreamWindow
    turns: int = 0  # turns started here
    in_flight: int = 0
    down: bool = False
    downs: int = 0  # times a dead stage took it out of rotation
    scalable: bool = False
    asleep: bool = False
    waking: bool = False
    wakes: int = 0
    last_busy: float = 0.0  # monotonic: when its last turn ended (or it woke)

    def free_slots(self) -> float:
        w = self.window
        return float("inf") if w.size == 0 else w.size - w.active - w.waiting

    @property
    def routable(self) -> bool:
        return not (self.down or self.asleep)

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "window": self.window.stats(), "turns": self.turns,
                "in_flight": self.in_flight, "down": self.down, "downs": self.downs,
                "asleep": self.asleep, "waking": self.waking, "wakes": self.wakes}


@dataclass
class PreparedTurn:
    request_id: str
    thinker_request: Any  # pipeline.handoff.ThinkerRequest
    speech: bool
    voice: Any = None  # None (default voice) | 16 kHz waveform | stage.NamedVoice
    seed: int | None = None
    text: bool = True  # False for modalities ["audio"]: text deltas are not sent
    speech_codes: int | None = None  # fixed-length benchmark mode: exactly this many codes
    return_timings: bool = False  # per-stage spans on the Done event (docs/bench.md)
    arrival: float = 0.0  # wall clock: request arrived at the ingress
    prepared: float = 0.0  # wall clock: media decoded, prompt built


class _TurnError(Exception):
    """Ends the turn with `event` (one terminal Error)."""

    def __init__(self, event: Error):
        super().__init__(event.message)
        self.event = event


class TurnRunner:
    def __init__(self, groups: list[Group], metrics: AppMetrics | None,
                 timeout_s: float, timeouts: TimeoutSettings | None = None, *,
                 idle_s: float = 120.0, wake_timeout_s: float = 900.0, hold_rows: int = 0):
        if not groups:
            raise ValueError("a TurnRunner needs at least one group")
        self.groups = groups
        self.idle_s = idle_s
        self.wake_timeout_s = wake_timeout_s
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.timeouts = timeouts or TimeoutSettings()
        # > 0: a speech turn's Thinker holds after this many spoken rows (the Talker's first
        # text chunk) and its Talker after its first chunk, until the first audio is out
        # (streaming talker_mode; the same outputs)
        self.hold_rows = hold_rows
        self._background: set[asyncio.Task] = set()
        self.in_flight: dict[str, bool] = {}  # request id -> speech

    def choose(self, speech: bool) -> Group:
        """The group with the most free window slots (a text-only turn: the fewest turns in
        flight), among those not down or asleep; ties go to the lowest index. With every
        group down, any awake one: its turn waits in the opens for Serve's new replicas.
        A speech turn that finds every awake window full wakes a sleeping group for the
        turns after it (a wake takes a replica start; this turn queues where it is)."""
        self.sleep_idle()
        best = self.likely_group(speech)
        if speech and best.free_slots() <= 0:
            self._wake_one()
        return best

    def likely_group(self, speech: bool) -> Group:
        """The group `choose` picks, without waking a group or putting one to sleep."""
        awake = [g for g in self.groups if not g.asleep]
        up = [g for g in awake if not g.down] or awake
        if speech:
            return max(up, key=lambda g: (g.free_slots(), -g.in_flight))
        return min(up, key=lambda g: g.in_flight)

    def sleep_idle(self) -> None:
        """Put autoscaled groups idle for `idle_s` to sleep (checked whenever the ingress
        routes a turn or reads stats, so nothing calls them and Serve stops them)."""
        now = time.monotonic()
        for g in self.groups:
            if (g.scalable and not g.asleep and not g.waking and g.in_flight == 0
                    and now - g.last_busy >= self.idle_s):
                g.asleep = True
                log.info("group %s: idle for %.0f s, no new turns (Serve stops its replicas)",
                         g.name, now - g.last_busy)

    def _wake_one(self) -> None:
        if any(g.waking for g in self.groups):
            return  # one replica start at a time
        sleeping = [g for g in self.groups if g.asleep]
        if not sleeping:
            return
        group = sleeping[0]
        group.waking = True
        group.wakes += 1
        log.info("group %s: every awake group's window is full, waking it", group.name)

        async def wake() -> None:
            try:
                while True:
                    try:
                        # Calls that queue at the handles of a deployment with no replica
                        # are what Serve's autoscaler starts one for.
                        await group.stages.answer(self.wake_timeout_s)
                        break
                    except Exception as e:  # noqa: BLE001 - a replica that failed to start
                        log.warning("group %s did not wake: %s", group.name, error_line(e))
                        await asyncio.sleep(1.0)
                group.asleep = False
                group.last_busy = time.monotonic()
                log.info("group %s is awake", group.name)
            finally:
                group.waking = False

        self.in_background(wake())

    def _mark_down(self, group: Group) -> None:
        if group.down or len(self.groups) == 1:
            return
        group.down = True
        group.downs += 1
        log.warning("group %s: a stage died; new turns go to the other groups until it "
                    "answers again", group.name)

        async def probe() -> None:
            while True:
                try:
                    await group.stages.answer(self.timeouts.heartbeat_s)
                    break
                except Exception:  # noqa: BLE001 - still restarting
                    await asyncio.sleep(0.25)
            group.down = False
            log.info("group %s answers again", group.name)

        self.in_background(probe())

    async def run(self, turn: PreparedTurn) -> AsyncIterator[Event]:
        # Routing reads the windows' counts, so nothing may await between choosing a group
        # and the turn's entry into its window (in `_run`): a burst of turns routed in one
        # tick would otherwise all see the same empty-looking window.
        group = self.choose(turn.speech)
        group.turns += 1
        group.in_flight += 1
        try:
            # aclosing: a cancelled turn (client gone) runs the inner cleanup now, not at GC
            async with contextlib.aclosing(self._run(turn, group)) as events:
                async for ev in events:
                    if isinstance(ev, Error) and ev.reason == "stage_unavailable":
                        self._mark_down(group)
                    yield ev
        finally:
            group.in_flight -= 1
            group.last_busy = time.monotonic()

    async def _run(self, turn: PreparedTurn, group: Group) -> AsyncIterator[Event]:
        stages, window = group.stages, group.window
        rid = turn.request_id
        now = time.perf_counter()
        # Latencies count from the request's arrival (preprocessing included), like a client's.
        t0 = now - max(0.0, time.time() - turn.arrival) if turn.arrival else now
        deadline = t0 + self.timeout_s
        slot = None
        streams: dict[str, Any] = {}
        pumps: list[asyncio.Task] = []
        merged: asyncio.Queue = asyncio.Queue()
        seen: dict[str, float] = {}  # stream -> when it last sent anything
        outcome, reason = "cancelled", "cancelled"
        self.in_flight[rid] = turn.speech
        try:
            early: list[tuple[str, Any]] = []  # the Thinker's items while the opens ran
            if turn.speech:
                self._window_metrics()
                try:
                    slot = await self._bounded(window.acquire(rid), deadline)
                except QueueFull as e:  # nothing was opened: a refusal, not a failure
                    raise _TurnError(Error(503, f"server busy: {e}", "queue_full")) from None
                self._window_metrics()
                self._queue_wait(slot.wait_s)
            # The Thinker's call first: its prefill is what the first token waits for, and
            # each call the ingress submits before it delays its start. The
            # speech opens follow at once and their round trips overlap the prefill (the
            # Talker waits for its session should the span come first).
            request = turn.thinker_request
            if turn.speech and self.hold_rows:
                request = replace(request, hold_after_spoken=self.hold_rows)
            thinker = stages.via("thinker", request.media_bytes)
            self._start("text", thinker.options(stream=True).generate.remote(request), streams,
                        pumps, merged, seen)
            if turn.speech:
                self._start_speech(turn, stages, streams, pumps, merged, seen)
                early = await self._opened(merged, seen, deadline)

            marks: dict[str, float] = {}
            pieces: list[tuple[float, float]] = []
            talker: list[tuple[float, float]] = []
            usage, finish = Usage(), "stop"
            ttft = first_audio = last_audio = None
            audio_s, index = 0.0, 0
            needed = {"text", "audio"} if turn.speech else {"text"}
            while needed:
                src, item = early.pop(0) if early else await self._next(merged, seen, deadline)
                if item is _END:
                    needed.discard(src)
                    seen.pop(src, None)
                    continue
                if isinstance(item, (Heartbeat, Opened)):
                    continue
                if src == "talker":  # the session says it failed, ends, or wants text
                    if isinstance(item, TextWanted) and self.hold_rows:
                        self._tell(rid, [stages.via("thinker")], "resume")
                    continue
                if src == "text":
                    usage = Usage(item.prompt_tokens or usage.prompt_tokens,
                                  item.completion_tokens or usage.completion_tokens)
                    if item.text:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        if turn.text:
                            yield TextDelta(item.text, prompt_tokens=usage.prompt_tokens,
                                            completion_tokens=usage.completion_tokens)
                    marks.update(getattr(item, "timings", None) or {})
                    if item.finished:
                        finish = item.finish_reason or "stop"
                else:
                    if getattr(item, "t_end", 0.0):
                        pieces.append((item.t_start, item.t_end))
                    talker.extend(getattr(item, "talker_spans", None) or [])
                    if len(item.pcm):
                        now = time.perf_counter()
                        if first_audio is None:
                            first_audio = now - t0
                            if self.hold_rows:
                                resume = [stages.via("thinker"), stages.via("talker")]
                                self._tell(rid, resume, "resume")
                        last_audio = now - t0
                        audio_s += len(item.pcm) / SAMPLE_RATE
                        yield AudioChunk(item.pcm, index)
                        index += 1
                    if item.is_last and slot is not None:
                        slot.release()
            if slot is not None:
                slot.release()
            self._window_metrics()
            outcome, reason = "ok", "ok"
            metrics = {"ttft_s": ttft or 0.0}
            if slot is not None:
                metrics["queue_s"] = slot.wait_s  # waited for a window slot
            if first_audio is not None:
                metrics.update(first_audio_s=first_audio, rtf=last_audio / max(audio_s, 1e-9))
            self._record(ttft, first_audio, metrics.get("rtf"), audio_s)
            timings = stage_spans(turn, marks, talker, pieces) if turn.return_timings else None
            yield Done(usage, finish, audio_s, metrics, timings)
        except _TurnError as e:
            refused = e.event.status < 500 or e.event.reason == "queue_full"
            outcome, reason = ("rejected" if refused else "error"), e.event.reason
            yield e.event
        except asyncio.TimeoutError:
            outcome, reason = "timeout", "timeout"
            yield Error(504, f"turn exceeded the {self.timeout_s:g} s request timeout", "timeout")
        finally:
            self.in_flight.pop(rid, None)
            for p in pumps:
                p.cancel()
            for s in streams.values():
                _cancel(s)
            if outcome != "ok" and (streams or slot is not None):
                # The slot comes back once the stages freed the turn's own slots, so the
                # turn it admits next never finds them still held.
                self._abort(rid, stages, turn.speech, then=slot and slot.release)
            elif slot is not None:
                slot.release()
            if self.metrics is not None:
                self.metrics.outcome(outcome, reason)
            self._window_metrics()

    # -- opening -------------------------------------------------------------------------

    def _start_speech(self, turn: PreparedTurn, stages: Stages, streams: dict[str, Any],
                      pumps: list[asyncio.Task], merged: asyncio.Queue,
                      seen: dict[str, float]) -> None:
        rid = turn.request_id
        self._start("talker", stages.via("talker").options(stream=True).session.remote(
            rid, turn.seed, turn.speech_codes, bool(self.hold_rows)), streams, pumps, merged,
            seen)
        voice = turn.voice.samples if isinstance(turn.voice, NamedVoice) else turn.voice
        code2wav = stages.via("code2wav", 0 if voice is None else voice.nbytes)
        self._start("audio", code2wav.options(stream=True).stream.remote(rid, turn.voice),
                    streams, pumps, merged, seen)

    async def _opened(self, merged: asyncio.Queue, seen: dict[str, float],
                      deadline: float) -> list[tuple[str, Any]]:
        """Both speech streams answer Opened, or the turn ends (the caller's cleanup cancels
        whichever opened, which frees it: opening is all-or-nothing). What the Thinker says
        meanwhile is kept, in order, and returned: no text goes out before the turn can
        speak, and a Thinker failure ends the turn here as any stage's does."""
        waiting = {"talker", "audio"}
        early: list[tuple[str, Any]] = []
        open_by = min(deadline, time.perf_counter() + self.timeouts.open_s)
        while waiting:
            try:
                src, item = await self._bounded(merged.get(), open_by)
            except asyncio.TimeoutError:
                if time.perf_counter() >= deadline:
                    raise
                late = " and ".join(sorted(_STAGE[s] for s in waiting))
                raise _TurnError(Error(503, f"{late} did not open the speech stream within "
                                            f"{self.timeouts.open_s:g} s", "stage_unavailable"))
            if src in seen and item is not _END:
                seen[src] = time.perf_counter()
            if src == "text" and not isinstance(item, (StageFailure, BaseException)):
                early.append((src, item))
            elif isinstance(item, (Opened, Heartbeat)):
                if isinstance(item, Opened):
                    waiting.discard(src)
            elif item is _END:
                raise _TurnError(Error(500, f"{_STAGE[src]} closed the stream before opening "
                                            "it", "stage_error"))
            else:
                self._fail(src, item)
        return early

    def _start(self, src: str, gen: Any, streams: dict[str, Any], pumps: list[asyncio.Task],
               merged: asyncio.Queue, seen: dict[str, float]) -> None:
        streams[src] = gen
        # A stream's first item may take up to `open_s`: its replica may be starting (Serve
        # restarting a dead one); after that, silence is bounded by `stall_s`.
        seen[src] = time.perf_counter() + max(0.0, self.timeouts.open_s - self.timeouts.stall_s)
        pumps.append(asyncio.get_running_loop().create_task(self._pump(src, gen, merged)))

    # -- the merged stream ---------------------------------------------------------------

    async def _next(self, merged: asyncio.Queue, seen: dict[str, float],
                    deadline: float) -> tuple[str, Any]:
        """The next (stream, item), failing the turn on a stage failure, a dead stage, or a
        stream silent for longer than `timeouts.stall_s`."""
        stall, grace = self.timeouts.stall_s, 2 * self.timeouts.heartbeat_s
        graced = False
        while True:
            if merged.empty():
                now = time.perf_counter()
                if now >= deadline:
                    raise asyncio.TimeoutError
                silent = [(now - last, src) for src, last in seen.items() if now - last >= stall]
                if silent and not graced:
                    # This event loop may itself have been busy (a client write, a long
                    # encode): what the stages sent meanwhile waits in the pumps. Give them a
                    # heartbeat's time before calling a stage silent.
                    graced = True
                    await asyncio.sleep(grace)
                    continue
                if silent:
                    quiet, src = max(silent)
                    raise _TurnError(Error(503, f"{_STAGE[src]} stopped answering (nothing for "
                                                f"{quiet:.0f} s)", "stage_unavailable"))
                graced = False
                wake = min((last + stall for last in seen.values()), default=deadline)
                try:
                    src, item = await asyncio.wait_for(merged.get(), min(deadline, wake) - now)
                except asyncio.TimeoutError:
                    continue
            else:
                src, item = merged.get_nowait()
            if src in seen:
                seen[src] = time.perf_counter()
            if isinstance(item, (StageFailure, BaseException)):
                self._fail(src, item)
            return src, item

    @staticmethod
    def _fail(src: str, item: Any) -> None:
        if isinstance(item, StageFailure):
            raise _TurnError(Error(item.status, f"{item.stage}: {item.message}", item.reason))
        # The stage call itself failed: the replica died, or the call could not be served.
        raise _TurnError(Error(503, f"{_STAGE[src]} stage failed: {error_line(item)}",
                               "stage_unavailable"))

    async def _bounded(self, aw: Any, deadline: float) -> Any:
        # In this task, not a new one (asyncio.wait_for's on Python 3.11): a window entry
        # then happens in the same step as the routing decision before it.
        async with asyncio.timeout(max(0.0, deadline - time.perf_counter())):
            return await aw

    async def _pump(self, src: str, gen: Any, out: asyncio.Queue) -> None:
        try:
            async for item in gen:
                out.put_nowait((src, item))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stage call itself failed (replica died...)
            out.put_nowait((src, e))
        out.put_nowait((src, _END))

    def _abort(self, rid: str, group: Stages, speech: bool, then: Any = None) -> None:
        names = ("thinker", "talker", "code2wav") if speech else ("thinker",)
        self._tell(rid, [group.via(name) for name in names], "abort", then)

    def _tell(self, rid: str, stages: list[Any], method: str, then: Any = None) -> None:
        """Call `method(rid)` on each stage, fire-and-forget: the caller may already be
        cancelled, so this runs on its own; `then()` once every call returned or timed out."""

        async def tell() -> None:
            calls = [asyncio.wait_for(getattr(s, method).remote(rid), self.timeouts.abort_s)
                     for s in stages]
            try:
                for r in await asyncio.gather(*calls, return_exceptions=True):
                    if isinstance(r, BaseException):
                        log.info("%s of %s did not land: %s", method, rid, error_line(r))
            finally:
                if then is not None:
                    then()
                    self._window_metrics()

        self.in_background(tell())

    def in_background(self, coro: Any) -> None:
        """Run `coro` on its own, kept alive until it ends. A fresh context: Serve links
        handle calls made in a request's context to that request and cancels them with it,
        and the request that started this may be being cancelled right now."""
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _record(self, ttft, first_audio, rtf, audio_s) -> None:
        if self.metrics is None:
            return
        if ttft is not None:
            self.metrics.ttft.observe(ttft)
        if first_audio is not None:
            self.metrics.first_audio.observe(first_audio)
            self.metrics.rtf.observe(rtf)
            self.metrics.audio_seconds.inc(audio_s)

    def check_admission(self, speech: bool) -> None:
        """Raise the window's QueueFull if a turn routed now would be refused: lets a route
        answer 503 before a stream's headers go out (the turn's own `acquire` decides)."""
        if speech:
            self.likely_group(speech).window.check()

    def _queue_wait(self, wait_s: float) -> None:
        if self.metrics is not None:
            self.metrics.queue_wait.observe(wait_s)

    def _window_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.window(sum(g.window.active for g in self.groups),
                                sum(g.window.waiting for g in self.groups))


def _cancel(gen: Any) -> None:
    cancel = getattr(gen, "cancel", None)
    if cancel is not None:
        try:
            cancel()
        except Exception:
            log.debug("cancel of a stage stream failed", exc_info=True)


def stage_spans(turn: PreparedTurn, marks: dict[str, float], talker: list[tuple[float, float]],
                pieces: list[tuple[float, float]]) -> dict[str, Any]:
    """Per-stage spans of one turn in seconds since it arrived (docs/bench.md section 2.3).
    `queue` runs until the Thinker admits the request (window, stage opens, admission);
    a `talker` span runs from the previous chunk's release (the first prefill for chunk 0)
    to this chunk's release; a `code2wav` span is the engine step that made the chunk."""
    t0 = turn.arrival
    spans: list[dict[str, Any]] = []

    def span(stage: str, start: float | None, end: float | None, **extra: Any) -> None:
        if start and end and end >= start:
            spans.append({"stage": stage, "start": round(start - t0, 6),
                          "end": round(end - t0, 6), **extra})

    req = turn.thinker_request
    span("preprocess", t0, turn.prepared)
    span("queue", turn.prepared, marks.get("admitted"))
    if req.images:
        span("vision_encoder", marks.get("admitted"), marks.get("vision_end"))
    if req.audios:
        span("audio_encoder", marks.get("vision_end"), marks.get("audio_end"))
    span("prefill", marks.get("audio_end"), marks.get("first_token"))
    span("decode", marks.get("first_token"), marks.get("last_token"))
    for i, (start, end) in enumerate(talker):
        span("talker", start, end, chunk=i)
    for i, (start, end) in enumerate(pieces):
        span("code2wav", start, end, chunk=i)
    durations: dict[str, float] = {}
    for s in spans:
        durations[s["stage"]] = round(durations.get(s["stage"], 0.0) + s["end"] - s["start"], 6)
    return {"clock": "seconds since the request arrived", "spans": spans, "durations": durations}
