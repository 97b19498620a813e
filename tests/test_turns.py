"""Turns that go wrong, in-process (no Ray): the four servers over fake engines, wired with
LocalHandles (tests/fakes.py). A stage that dies mid-stream, stops answering, wedges
its engine loop or refuses to open ends each affected turn with exactly one error, frees
the window slot and every stage's state; cancellations at random points leave nothing
behind. After every scenario the app's invariants (`Ingress.stats()`: idle, no leaks)
hold.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from test_api import light_source, user

from deployments.stages.loop import EngineLoop
from deployments.wire import AudioChunk, Done, Error, Opened, TextDelta
from fakes import FakeThinkerEngine, LocalHandle, build_local_app
from pipeline.handoff import TextWanted


@pytest.fixture(scope="module")
def source():
    return light_source()


@pytest.fixture(scope="module")
def app_cfg():
    return {"capacity": 2, "limits": {"max_tokens": 64}}


SPEECH = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32}
TEXT = {"messages": user("hi"), "max_tokens": 8}
FAST = {"heartbeat_s": 0.05, "stall_s": 0.5, "wedge_s": 0.3, "open_s": 1.0, "hop_s": 1.0,
        "abort_s": 1.0}


async def collect(ingress, body) -> list:
    return [ev async for ev in ingress.chat(body)]


async def settled(local, timeout: float = 3.0) -> dict:
    """Ingress.stats() once idle with no leaks (or the last reading)."""
    deadline = time.perf_counter() + timeout
    while True:
        st = await local.ingress.stats()
        if (st["idle"] and not st["leaks"]) or time.perf_counter() > deadline:
            return st
        await asyncio.sleep(0.02)


def assert_clean(st: dict) -> None:
    assert st["idle"] and not st["leaks"], st
    th, tk, cw = (st["stages"][n] for n in ("thinker", "talker", "code2wav"))
    assert th["open"] == 0 and th["engine"]["num_running"] == 0, th
    assert tk["open"] == 0 and tk["engine"]["open_streams"] == 0, tk
    assert cw["open"] == 0 and cw["engine"]["open_streams"] == 0, cw
    assert st["window"]["active"] == 0 and st["window"]["waiting"] == 0


def one_terminal(evs: list) -> Done | Error:
    terminals = [e for e in evs if isinstance(e, (Done, Error))]
    assert len(terminals) == 1 and evs[-1] is terminals[0], evs
    return terminals[0]


class DyingStream:
    """Wraps a LocalHandle: the `method` stream raises like a dead replica's (Ray raises
    ActorDiedError on the caller's side) after `after` items; later calls work again
    (Serve restarted the replica)."""

    def __init__(self, inner: LocalHandle, method: str, after: int):
        self.inner, self.method, self.after = inner, method, after
        self.died = asyncio.Event()

    def options(self, **kw):
        if "stream" not in kw:  # the transport (stage_transport): the same in-process
            return self
        outer = self

        class _Opts:
            def __getattr__(self, name):
                target = getattr(outer.inner.options(**kw), name)
                if name != outer.method or outer.died.is_set():
                    return target

                class _M:
                    def remote(self, *a, **k):
                        return outer._wrap(target.remote(*a, **k))
                return _M()
        return _Opts()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _wrap(self, stream):
        outer = self

        class _S:
            def __init__(self):
                self.n = 0

            def cancel(self):
                stream.cancel()

            def __aiter__(self):
                return self

            async def __anext__(self):
                if self.n >= outer.after:
                    outer.died.set()
                    stream.cancel()  # the replica is gone: its state with it
                    raise RuntimeError("ActorDiedError: The actor died unexpectedly")
                self.n += 1
                return await stream.__anext__()
        return _S()


@pytest.mark.parametrize("stage,method", [("thinker", "generate"), ("talker", "session"),
                                          ("code2wav", "stream")])
def test_a_stage_that_dies_mid_stream_ends_the_turn_at_once(app_cfg, source, stage, method):
    async def main():
        local = build_local_app({**app_cfg, "timeouts": FAST,
                                 "thinker": {"engine": {"step_delay_s": 0.01}}}, source)
        handle = getattr(local.ingress.stages, stage)
        dying = DyingStream(handle, method, after=2)
        setattr(local.ingress.stages, stage, dying)
        t = time.perf_counter()
        evs = await collect(local.ingress, SPEECH)
        took = time.perf_counter() - t
        after = [await collect(local.ingress, SPEECH), await collect(local.ingress, TEXT)]
        return evs, took, after, await settled(local)

    evs, took, after, st = asyncio.run(main())
    err = one_terminal(evs)
    assert isinstance(err, Error) and err.status == 503 and err.reason == "stage_unavailable", err
    assert stage in err.message and took < 2.0, (err, took)
    assert all(isinstance(one_terminal(a), Done) for a in after), after
    assert_clean(st)


def test_a_wedged_engine_fails_health_and_ends_its_turns(app_cfg, source):
    """A Code2Wav step that never returns: the stream's heartbeat says so (503), the turn
    ends within about wedge_s, and check_health (what Serve calls) raises."""
    cfg = {**app_cfg, "timeouts": FAST, "code2wav": {"engine": {"step_delay_s": 3.0}}}

    async def main():
        local = build_local_app(cfg, source)
        t = time.perf_counter()
        evs = await collect(local.ingress, SPEECH)
        took = time.perf_counter() - t
        try:
            local.code2wav.check_health()
            health = None
        except RuntimeError as e:
            health = str(e)
        return evs, took, health

    evs, took, health = asyncio.run(main())
    err = one_terminal(evs)
    assert isinstance(err, Error) and err.status == 503 and "stuck" in err.message, err
    assert took < 2.0, took
    assert health and "code2wav engine is stuck" in health


def test_a_stage_that_stops_answering_ends_the_turn_after_stall_s(app_cfg, source):
    """A stream that sends nothing at all (not even heartbeats: its replica's event loop is
    blocked) ends the turn after timeouts.stall_s."""
    async def main():
        local = build_local_app({**app_cfg, "timeouts": FAST}, source)
        real = local.ingress.stages.code2wav

        class Silent:
            def options(self, **kw):
                if "stream" not in kw:  # the transport (stage_transport)
                    return self
                opts = real.options(**kw)

                class _O:
                    def __getattr__(self, name):
                        if name != "stream":
                            return getattr(opts, name)

                        class _M:
                            def remote(self, *a, **k):
                                s = opts.stream.remote(*a, **k)

                                class _S:
                                    first = True

                                    def cancel(self):
                                        s.cancel()

                                    def __aiter__(self):
                                        return self

                                    async def __anext__(self):
                                        if self.first:
                                            self.first = False
                                            return await s.__anext__()  # Opened
                                        await asyncio.sleep(3600)  # then silence
                                return _S()
                        return _M()
                return _O()

            def __getattr__(self, name):
                return getattr(real, name)

        local.ingress.stages.code2wav = Silent()
        t = time.perf_counter()
        evs = await collect(local.ingress, SPEECH)
        took = time.perf_counter() - t
        local.ingress.stages.code2wav = real
        return evs, took, await settled(local)

    evs, took, st = asyncio.run(main())
    err = one_terminal(evs)
    assert isinstance(err, Error) and "stopped answering" in err.message, err
    assert FAST["stall_s"] <= took < FAST["stall_s"] + 1.0, took
    assert_clean(st)


def test_opening_is_all_or_nothing(app_cfg, source):
    """The Talker refuses to open (no free slot): the Code2Wav stream that did open is
    released, the window slot too, and the refusal is one 503 error."""
    cfg = {**app_cfg, "talker": {"engine": {}}}

    async def main():
        local = build_local_app(cfg, source)
        engine = local.talker.engine
        real_open = engine.open

        def refuse(*a, **k):
            raise RuntimeError("no free Talker slot (8 in use)")

        engine.open = refuse
        evs = await collect(local.ingress, SPEECH)
        engine.open = real_open
        ok = await collect(local.ingress, SPEECH)
        return evs, ok, await settled(local)

    evs, ok, st = asyncio.run(main())
    err = one_terminal(evs)
    assert isinstance(err, Error) and err.status == 503 and "no free Talker slot" in err.message
    assert isinstance(one_terminal(ok), Done)
    assert_clean(st)


def test_text_turns_do_not_wait_for_speech_slots(app_cfg, source):
    """A full window of slow speech turns: a text-only turn still runs at once."""
    cfg = {**app_cfg, "capacity": 1, "code2wav": {"engine": {"step_delay_s": 0.2}}}

    async def main():
        local = build_local_app(cfg, source)
        speech = [asyncio.ensure_future(collect(local.ingress, SPEECH)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert local.ingress.groups[0].window.waiting == 1
        t = time.perf_counter()
        text = await collect(local.ingress, TEXT)
        took = time.perf_counter() - t
        done = await asyncio.gather(*speech)
        return text, took, done, await settled(local)

    text, took, done, st = asyncio.run(main())
    assert isinstance(one_terminal(text), Done) and took < 0.5, took
    assert all(isinstance(one_terminal(d), Done) for d in done)
    assert_clean(st)


def test_engine_refusal_is_a_400_and_leaves_nothing(app_cfg, source):
    """A request the Thinker engine refuses (here: prompt + max_tokens over the context) is
    one 400 error, not a failed step that poisons other turns."""
    async def main():
        local = build_local_app(app_cfg, source)
        engine = local.thinker.engine
        real_open = engine.open

        def refuse(rid, req):
            raise ValueError("prompt (9 tokens) + max_tokens (40000) exceeds the context")

        engine.open = refuse
        evs = await collect(local.ingress, SPEECH)
        engine.open = real_open
        return evs, await collect(local.ingress, SPEECH), await settled(local)

    evs, ok, st = asyncio.run(main())
    err = one_terminal(evs)
    assert isinstance(err, Error) and err.status == 400 and "exceeds the context" in err.message
    assert isinstance(one_terminal(ok), Done)
    assert_clean(st)


def test_cancellations_at_random_points_leave_nothing(app_cfg, source):
    """40 turns of every kind, each dropped by its consumer at a random event (or a random
    time before its first one); then a clean turn and the invariants."""
    bodies = [SPEECH, TEXT, {**SPEECH, "modalities": ["audio"]},
              {**SPEECH, "audio": {"format": "mp3"}}]
    cfg = {**app_cfg, "capacity": 3,
           "thinker": {"engine": {"step_delay_s": 0.002}},
           "code2wav": {"engine": {"step_delay_s": 0.002}}}
    rng = random.Random(7)

    async def one(local, body, stop_after: int, delay: float):
        agen = local.ingress.chat(body)

        async def consume():
            n = 0
            async for _ in agen:
                n += 1
                if n >= stop_after:
                    break
        task = asyncio.ensure_future(consume())
        if delay:
            await asyncio.sleep(delay)
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await agen.aclose()

    async def main():
        local = build_local_app(cfg, source)
        await asyncio.gather(*[
            one(local, rng.choice(bodies), rng.randint(1, 12),
                rng.choice([0, 0, rng.uniform(0.0, 0.05)])) for _ in range(40)])
        st = await settled(local)
        ok = await collect(local.ingress, SPEECH)
        return st, ok

    st, ok = asyncio.run(main())
    assert_clean(st)
    assert isinstance(one_terminal(ok), Done) and any(isinstance(e, AudioChunk) for e in ok)


def test_bad_seeds_then_a_good_speech_turn(app_cfg, source):
    """8 requests with an out-of-range seed are 400s that open nothing; a good speech turn
    after them gets a Talker slot."""
    async def main():
        local = build_local_app({**app_cfg, "talker": {"engine": {}}}, source)
        bad = [await collect(local.ingress, {**SPEECH, "seed": 2**64}) for _ in range(8)]
        return bad, await collect(local.ingress, SPEECH), await settled(local)

    bad, ok, st = asyncio.run(main())
    assert all(len(b) == 1 and b[0].status == 400 and "seed" in b[0].message for b in bad)
    assert isinstance(one_terminal(ok), Done)
    assert_clean(st)


def test_engine_loop_health_reports_a_stuck_step():
    async def main():
        engine = FakeThinkerEngine(step_delay_s=0.4)
        loop = EngineLoop(engine, name="t", route=lambda d: (d.request_id, d))
        from pipeline.handoff import SamplingParams, ThinkerRequest

        assert loop.health(0.1) is None
        loop.open("r")
        await loop.call(lambda e: e.open(
            "r", ThinkerRequest("r", [1], sampling=SamplingParams(max_tokens=1))))
        await asyncio.sleep(0.25)
        stuck = loop.health(0.1)
        await asyncio.sleep(0.3)
        after = loop.health(0.1)
        loop.stop()
        return stuck, after

    stuck, after = asyncio.run(main())
    assert stuck and "stuck" in stuck and "step" in stuck
    assert after is None


def test_a_busy_stream_is_not_taken_for_a_silent_one(app_cfg, source):
    """A Talker that hands chunks to Code2Wav back to back for longer than stall_s (never
    idle for a heartbeat period) still tells the ingress it is alive."""
    cfg = {**app_cfg, "timeouts": {**FAST, "heartbeat_s": 0.5, "stall_s": 1.0},
           "talker": {"engine": {"step_delay_s": 0.15, "codes_per_id": 12}}}

    async def main():
        local = build_local_app(cfg, source)
        t = time.perf_counter()
        evs = await collect(local.ingress, SPEECH)
        return evs, time.perf_counter() - t, await settled(local)

    evs, took, st = asyncio.run(main())
    assert isinstance(one_terminal(evs), Done), evs[-1]
    assert took > 1.0, took  # the Talker really was busy for longer than stall_s
    assert_clean(st)


def test_a_blocked_ingress_loop_is_not_taken_for_silent_stages(app_cfg, source):
    """The ingress's own event loop stalls for longer than stall_s (a long CPU task in it)
    while the stages keep producing: what they sent meanwhile is read, the turn goes on."""
    cfg = {**app_cfg, "timeouts": FAST, "thinker": {"engine": {"step_delay_s": 0.02}}}

    async def main():
        local = build_local_app(cfg, source)
        evs = []
        async for ev in local.ingress.chat(SPEECH):
            evs.append(ev)
            if len(evs) == 2:
                time.sleep(FAST["stall_s"] + 0.3)  # blocks this loop, stages run on
        return evs, await settled(local)

    evs, st = asyncio.run(main())
    assert isinstance(one_terminal(evs), Done), evs[-1]
    assert_clean(st)


def test_turn_events_still_stream_text_and_audio(app_cfg, source):
    """The fault machinery is invisible on a good turn: text, audio, one Done, and the
    stages' heartbeats never reach the client."""
    async def main():
        local = build_local_app({**app_cfg, "timeouts": FAST,
                                 "code2wav": {"engine": {"step_delay_s": 0.12}}}, source)
        return await collect(local.ingress, SPEECH), await settled(local)

    evs, st = asyncio.run(main())
    assert isinstance(one_terminal(evs), Done)
    assert {type(e) for e in evs} == {TextDelta, AudioChunk, Done}
    assert_clean(st)


@pytest.mark.parametrize("hop", ["feed", "push"])
def test_a_refused_hop_ends_the_turn_within_a_second(app_cfg, source, hop):
    """The next stage answers a hop with False (it has no such stream: closed, or a new
    replica): the turn ends with one stage error within 1 s instead of waiting for speech
    that will never come."""
    async def main():
        local = build_local_app({**app_cfg, "timeouts": FAST}, source)
        server = local.talker if hop == "feed" else local.code2wav

        async def refuse(*a, **k):
            return False
        setattr(server, hop, refuse)
        t = time.perf_counter()
        evs = await collect(local.ingress, SPEECH)
        took = time.perf_counter() - t
        return evs, took, await settled(local)

    evs, took, st = asyncio.run(main())
    err = one_terminal(evs)
    assert isinstance(err, Error) and err.status == 503 and err.reason == "stage_unavailable", err
    assert "no stream" in err.message and took < 1.0, (err, took)
    assert_clean(st)


def test_the_thinker_starts_with_the_speech_opens(app_cfg, source):
    """The Thinker gets the request while the Talker is still opening (its prefill overlaps
    the opens), and its text reaches the client only once both opened."""
    async def main():
        local = build_local_app(app_cfg, source)
        marks = {}
        thinker, talker = local.thinker.engine, local.talker.engine
        thinker_open, talker_open = thinker.open, talker.open

        def open_thinker(*a, **k):
            marks["thinker"] = time.perf_counter()
            return thinker_open(*a, **k)

        def open_talker(*a, **k):
            time.sleep(0.3)  # the Talker's worker thread is busy
            marks["talker"] = time.perf_counter()
            return talker_open(*a, **k)

        thinker.open, talker.open = open_thinker, open_talker
        evs, seen = [], []
        async for ev in local.ingress.chat(SPEECH):
            evs.append(ev)
            seen.append((time.perf_counter(), ev))
        return evs, seen, marks, await settled(local)

    evs, seen, marks, st = asyncio.run(main())
    assert isinstance(one_terminal(evs), Done) and any(isinstance(e, AudioChunk) for e in evs)
    assert marks["thinker"] < marks["talker"] - 0.2, marks  # opened during the Talker's open
    first_text = next(t for t, ev in seen if isinstance(ev, TextDelta))
    assert first_text >= marks["talker"], (first_text, marks)
    assert_clean(st)


def test_a_span_that_comes_before_its_session_waits_for_it(app_cfg, source):
    """The Talker takes a spoken span that overtook its session's open once the session
    opens; a span for an aborted stream is refused at once, and one for a stream that never
    opens after `timeouts.open_s`, leaving no waiter behind."""
    cfg = {**app_cfg, "timeouts": {**FAST, "open_s": 0.3}}
    hidden = np.zeros((2, 16), np.float32)

    async def main():
        local = build_local_app(cfg, source)
        talker = local.talker
        early = asyncio.ensure_future(talker.feed("r1", [5, 6], hidden, False))
        await asyncio.sleep(0.05)
        waited = not early.done()
        session = LocalHandle(talker).options(stream=True).session.remote("r1", None, None)
        opened = await session.__anext__()
        took_early = await early
        s = talker.engine.streams["r1"]
        fed = s["pending"] + len(s["codes"]) // talker.engine.codes_per_id  # ids taken
        session.cancel()
        await talker.abort("r2")
        t = time.perf_counter()
        aborted = await talker.feed("r2", [5], hidden[:1], False)
        t_aborted = time.perf_counter() - t
        t = time.perf_counter()
        never = await talker.feed("r3", [5], hidden[:1], False)
        t_never = time.perf_counter() - t
        return (waited, opened, took_early, fed, aborted, t_aborted, never, t_never,
                dict(talker._open_waiters), await settled(local))

    waited, opened, took_early, fed, aborted, t_aborted, never, t_never, waiters, st = (
        asyncio.run(main()))
    assert waited and isinstance(opened, Opened) and took_early is True and fed == 2
    assert aborted is False and t_aborted < 0.05, t_aborted
    assert never is False and 0.3 <= t_never < 0.6, t_never
    assert not waiters
    assert_clean(st)


@pytest.mark.parametrize("mode", ["streaming", "full_span"])
def test_a_speech_turn_holds_for_its_first_audio_then_resumes(app_cfg, source, mode):
    """Streaming: the Thinker's request holds after the Talker's first text chunk and the
    Talker's stream after its first chunk, and the first audio piece the ingress gets
    resumes both (the stages would otherwise hold it up to HOLD_LIMIT_S); full_span (the
    Talker waits for the whole span anyway): no holds, no resumes."""
    hold = mode == "streaming"

    async def main():
        local = build_local_app({**app_cfg, "talker_mode": mode}, source)
        specs, resumed = {}, []
        for name in ("thinker", "talker"):
            engine = getattr(local, name).engine
            real_open = engine.open

            def open_(rid, spec, name=name, real_open=real_open):
                specs[name] = spec
                return real_open(rid, spec)

            engine.open = open_
            engine.resume = lambda rid, name=name: resumed.append((name, time.perf_counter()))
        seen = []
        async for ev in local.ingress.chat(SPEECH):
            seen.append((time.perf_counter(), ev))
        await settled(local)
        return specs, resumed, seen

    specs, resumed, seen = asyncio.run(main())
    assert isinstance(one_terminal([ev for _, ev in seen]), Done)
    first_audio = next(t for t, ev in seen if isinstance(ev, AudioChunk))
    chunk = source.config.talker.streaming_text_chunk
    assert specs["thinker"].hold_after_spoken == (chunk if hold else 0)
    assert specs["talker"].hold is hold
    if hold:
        assert sorted(n for n, _ in resumed) == ["talker", "thinker"]
        assert all(t >= first_audio - 0.05 for _, t in resumed), (resumed, first_audio)
    else:
        assert resumed == []


def test_a_talker_that_wants_held_text_resumes_the_thinker_at_once(app_cfg, source):
    """The Talker's TextWanted (its first unit ended before its first chunk, so the first
    audio needs the text its Thinker holds) makes the ingress resume the Thinker when it
    arrives, not at the first audio. What is timed is the ingress's own order: its resume
    sent, then the first audio received. (The resume's arrival at the Thinker against the
    audio's at the ingress would be a race of two paths here: this fake Talker makes its
    first chunk right after it asks, where a real one waits for the text.)"""
    async def main():
        local = build_local_app(app_cfg, source)
        resumed, sent = [], []
        local.thinker.engine.resume = lambda rid: resumed.append(time.perf_counter())
        turns, real_tell = local.ingress.turns, local.ingress.turns._tell

        def tell(rid, stages, method):
            sent.append((time.perf_counter(), method, len(stages)))
            real_tell(rid, stages, method)

        turns._tell = tell
        talker = local.talker.engine
        real_step, said = talker.step, set()

        def step():
            out = real_step()
            for rid in talker.streams:
                if rid not in said:
                    said.add(rid)
                    out.append(TextWanted(rid))
            return out

        talker.step = step
        seen = []
        async for ev in local.ingress.chat(SPEECH):
            seen.append((time.perf_counter(), ev))
        await settled(local)
        return resumed, sent, seen

    resumed, sent, seen = asyncio.run(main())
    assert isinstance(one_terminal([ev for _, ev in seen]), Done)
    first_audio = next(t for t, ev in seen if isinstance(ev, AudioChunk))
    # the Thinker alone on TextWanted, before the first audio; both stages at the first audio
    resumes = [(t, n) for t, method, n in sent if method == "resume"]
    assert [n for _, n in resumes] == [1, 2] and resumes[0][0] < first_audio, (resumes, first_audio)
    assert len(resumed) == 2  # each landed at the Thinker


def test_the_thinker_sends_the_talker_whole_text_chunks(app_cfg, source):
    """Streaming speech: the Thinker's spoken rows reach the Talker in its text chunks (a
    unit starts only with a whole one, or the last rows once the text is finished), one
    feed call each instead of one a token; nothing lost, the last call final."""
    cfg = source.config
    chunk = 3  # the fake Thinker says 10 words: several chunks and a short last one
    small = SimpleNamespace(**{**vars(source), "config": replace(
        cfg, talker=replace(cfg.talker, streaming_text_chunk=chunk))})

    async def main():
        # a token every 20 ms: each row reaches the forwarder on its own
        local = build_local_app(
            {**app_cfg, "thinker": {"engine": {"step_delay_s": 0.02}}}, small)
        feeds, real_feed = [], local.talker.feed

        async def feed(rid, ids, hidden, final):
            feeds.append((len(ids), final))
            return await real_feed(rid, ids, hidden, final)

        local.talker.feed = feed
        evs = await collect(local.ingress, SPEECH)
        return evs, feeds, await settled(local)

    evs, feeds, st = asyncio.run(main())
    done = one_terminal(evs)
    assert isinstance(done, Done)
    rows = [n for n, _ in feeds]
    assert [f for _, f in feeds] == [False] * (len(feeds) - 1) + [True], feeds
    assert all(n >= chunk for n in rows[:-1]) and rows[-1] <= chunk, feeds
    assert len(feeds) <= sum(rows) // chunk + 1 and sum(rows) > chunk, feeds
    assert sum(rows) == done.usage.completion_tokens  # the fake speaks every token
    assert_clean(st)


def test_a_failed_turns_slot_comes_back_once_its_stages_freed_theirs(app_cfg, source):
    """Capacity is the window and every stage's slot count: a turn that ends early (here the
    client goes away) keeps its window slot until its stages' aborts landed, so the turn the
    window admits next never finds a stage slot still held by it."""
    async def main():
        local = build_local_app({**app_cfg, "capacity": 1}, source)
        real_abort, landed = local.talker.abort, asyncio.Event()

        async def slow_abort(rid):
            await asyncio.sleep(0.3)
            await real_abort(rid)
            landed.set()

        local.talker.abort = slow_abort
        agen = local.ingress.chat(SPEECH)
        async for ev in agen:
            if isinstance(ev, TextDelta):
                break
        await agen.aclose()  # what Serve does when the HTTP client goes away
        await asyncio.sleep(0.1)
        held = local.ingress.groups[0].window.stats()["active"]
        await asyncio.wait_for(landed.wait(), 3)
        await asyncio.sleep(0.05)
        freed = local.ingress.groups[0].window.stats()["active"]
        second = one_terminal(await collect(local.ingress, SPEECH))
        return held, freed, second, await settled(local)

    held, freed, second, st = asyncio.run(main())
    assert (held, freed) == (1, 0)
    assert isinstance(second, Done) and second.audio_seconds > 0
    assert_clean(st)
