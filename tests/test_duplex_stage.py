"""Duplex sessions resident in the Thinker stage (deployments/stages/duplex.py), over the
turn-based engine's own model (its fused projections): the same units, decisions, codes and
PCM as a session over freshly loaded weights (the one test_duplex_thinker.py holds to the
reference's goldens)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from deployments.config import DuplexSettings
from deployments.stages.duplex import DECISION, DuplexSessions
from pipeline.checkpoint import ModelSource
from pipeline.duplex.config import DuplexConfig
from pipeline.duplex.session import DuplexSession
from pipeline.duplex.speech import DuplexSpeech
from pipeline.duplex.thinker import DuplexThinker
from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from tests import _duplex_inputs as di

GOLDEN = Path(__file__).parent / "duplex_golden"
NAME = "audio_greedy"
UNITS = 8  # listen units, a turn of speak units and its end
STEPS = DuplexSettings().n_timesteps  # the served Token2Wav's Euler steps


@pytest.fixture(scope="module")
def ckpt():
    from tests._duplex_ckpt import duplex_test_checkpoint

    return duplex_test_checkpoint()


def test_stage_session_equals_a_session_over_fresh_weights(ckpt):
    record = json.loads((GOLDEN / f"{NAME}.json").read_text())
    source = ModelSource.open(str(ckpt))
    engine = ThinkerEngine.from_source(source, ThinkerEngineConfig(), "cpu")
    sessions = DuplexSessions(source, engine.device, STEPS)
    options = {"decode_mode": record["decode_mode"], **record["duplex_kwargs"], "seed": 5}
    init = SimpleNamespace(options=options, audio_out=True, system_prompt=record["prefix"],
                           ref_audio=None, prompt_wav=None, max_slice_nums=1)
    sessions.open(engine, "s", init)
    with pytest.raises(ValueError, match="already open"):
        sessions.open(engine, "s", init)

    cfg = DuplexConfig(decode_mode=record["decode_mode"], **record["duplex_kwargs"])
    speech = DuplexSpeech.from_checkpoint(ckpt, cfg, seed=5, n_timesteps=STEPS)  # as served
    alone = DuplexSession(DuplexThinker.from_checkpoint(ckpt, cfg, seed=5), speech)
    alone.prepare(record["prefix"], None, None, None)

    inputs = di.session_inputs(di.session(NAME))[:UNITS]
    spoke = 0
    for unit, (audio, frames) in zip(record["units"][:UNITS], inputs, strict=True):
        got = sessions.unit("s", audio, frames, None)
        want = alone.unit(audio, frames)
        where = f"unit {unit['index']}"
        assert (got["is_listen"], got["end_of_turn"]) == (want.is_listen, want.end_of_turn), where
        assert got["token_ids"] == want.token_ids and got["codes"] == want.codes, where
        rows = sum(x[1] if isinstance(x, tuple) else 1 for x in want.prefill)
        assert got["prefill_tokens"] == rows > 1, where  # <unit> + the unit's audio rows
        if want.pcm is None:
            assert got["pcm"] is None, where
        else:
            spoke += 1
            np.testing.assert_allclose(got["pcm"], want.pcm, rtol=0, atol=1e-5, err_msg=where)
    assert spoke >= 2, "the scripted units include speak units"
    # the session's K/V are blocks of the engine's own pool, back in it at close
    pool = engine.llm.block_manager
    held = sessions.stats()["kv_blocks"]
    assert held > 0 and pool.num_used == held
    stats = sessions.stats()
    assert stats == {"sessions": 1, "units": UNITS, "prefills": UNITS, "kv_blocks": held,
                     "talker_rows": stats["talker_rows"],
                     "token2wav_streams": stats["token2wav_streams"]}
    assert stats["token2wav_streams"] <= 1  # its turn's stream, while the turn goes on
    assert sessions.close("s") and not sessions.close("s")
    assert pool.num_used == 0 and sessions.stats()["kv_blocks"] == 0
    assert sessions.stats()["talker_rows"] == sessions.stats()["token2wav_streams"] == 0
    with pytest.raises(KeyError):
        sessions.unit("s", inputs[0][0], None, None)
    assert len(sessions) == 0


def test_stage_session_refuses_a_bad_option(ckpt):
    source = ModelSource.open(str(ckpt))
    engine = SimpleNamespace(model=None, tokenizer=None)
    sessions = DuplexSessions(source, "cpu", STEPS)
    init = SimpleNamespace(options={"sliding_window_mode": "sideways"}, audio_out=False,
                           system_prompt=None, ref_audio=None, prompt_wav=None, max_slice_nums=1)
    with pytest.raises((ValueError, TypeError)):
        sessions.open(engine, "x", init)
    assert len(sessions) == 0


def _text_init(script) -> SimpleNamespace:
    """A session.init for a scripted session: its options and seed, text out only."""
    return SimpleNamespace(
        options={"decode_mode": script.decode_mode, **script.duplex_kwargs, "seed": script.seed},
        audio_out=False, system_prompt=di.PREFIX, ref_audio=None, prompt_wav=None,
        max_slice_nums=1)


async def _unit(server, sid, audio, frames, force) -> dict:
    """ThinkerServer.duplex_unit's stream read to its decision; a speak unit's text pieces
    must join into a prefix of its text (all of it but an unfinished last character)."""
    pieces = []
    async for item in server.duplex_unit(sid, audio, frames, force):
        if "text" in item:
            pieces.append(item["text"])
        else:
            decision = item["decision"]
    assert decision["text"].startswith("".join(pieces)), (pieces, decision["text"])
    assert bool(pieces) == bool(decision["text"].strip("\ufffd"))  # streamed if it has text
    return decision


def test_concurrent_units_of_several_sessions_join_in_one_step(ckpt):
    """The served path (ThinkerServer.duplex_unit): units of three sessions that arrive
    together are prefilled in one step on the engine loop, and each equals its session
    alone."""
    import asyncio

    from deployments.stages.thinker import ThinkerServer

    source = ModelSource.open(str(ckpt))
    names = ["audio_greedy", "audio_sampling", "omni_greedy"]
    scripts = [di.session(n) for n in names]
    inputs = [di.session_inputs(s) for s in scripts]
    rounds = range(6)  # quiet then loud units: listen, speak and a turn's start

    server = ThinkerServer({"device": "cpu"}, source=source)
    try:
        async def main():
            for name, s in zip(names, scripts, strict=True):
                await server.duplex_open(name, _text_init(s))
            out = []
            for k in rounds:
                out.append(await asyncio.gather(*(
                    _unit(server, name, *inputs[i][k], None) for i, name in enumerate(names))))
            with pytest.raises(KeyError):
                await _unit(server, "nobody", inputs[0][0][0], None, None)
            stats = server._duplex_sessions().stats()
            for name in names:
                assert await server.duplex_close(name)
            return out, stats

        got, stats = asyncio.run(main())
    finally:
        server.loop.stop()
    # one prefill a round: the units that arrive together join in one step (the unknown
    # session's unit is refused before any step)
    assert stats["kv_blocks"] > 0
    assert stats == {"sessions": 3, "units": 3 * len(rounds), "prefills": len(rounds),
                     "kv_blocks": stats["kv_blocks"], "talker_rows": 0,
                     "token2wav_streams": 0}  # text only

    kinds = set()
    for i, (name, s) in enumerate(zip(names, scripts, strict=True)):
        cfg = DuplexConfig(decode_mode=s.decode_mode, **s.duplex_kwargs)
        alone = DuplexSession(DuplexThinker.from_checkpoint(ckpt, cfg, seed=s.seed))
        alone.prepare(di.PREFIX)
        for j, k in enumerate(rounds):
            want, g = alone.unit(*inputs[i][k]), got[j][i]
            where = f"{name} unit {k}"
            assert (g["is_listen"], g["end_of_turn"], g["text"]) == (
                want.is_listen, want.end_of_turn, want.text), where
            assert g["token_ids"] == want.token_ids and set(g) == set(DECISION), where
            kinds.add("listen" if want.is_listen else "speak")
    assert kinds == {"listen", "speak"}


def test_served_frames_are_sliced_off_the_loop_and_a_bad_one_fails_its_unit(ckpt):
    """The served path slices a unit's frames in a worker thread (the unit reaches the
    scheduler with a future of them, at once): the thread that steps the GPU resizes no
    image; the unit equals its session's unit from the raw frames. A bad frame fails its
    unit alone with a ValueError and the session goes on."""
    import asyncio
    import threading

    import pipeline.duplex.thinker as thinker_mod
    from deployments.stages.thinker import ThinkerServer

    source = ModelSource.open(str(ckpt))
    script = di.session("omni_greedy")
    inputs = di.session_inputs(script)
    sliced_on: list[str] = []
    prepare = thinker_mod.prepare_frames

    def recording(*args):
        sliced_on.append(threading.current_thread().name)
        return prepare(*args)

    server = ThinkerServer({"device": "cpu"}, source=source)
    thinker_mod.prepare_frames = recording
    try:
        async def main():
            await server.duplex_open("s", _text_init(script))
            out = [await _unit(server, "s", *inputs[0], None)]
            with pytest.raises(ValueError, match="uint8"):
                await _unit(server, "s", inputs[1][0], [np.zeros((4, 4, 3), np.float32)],
                            None)
            out.append(await _unit(server, "s", *inputs[1], None))
            await server.duplex_close("s")
            return out

        got = asyncio.run(main())
    finally:
        thinker_mod.prepare_frames = prepare
        server.loop.stop()
    assert inputs[0][1] and sliced_on and all(n.startswith("duplex-frames") for n in sliced_on)
    cfg = DuplexConfig(decode_mode=script.decode_mode, **script.duplex_kwargs)
    alone = DuplexSession(DuplexThinker.from_checkpoint(ckpt, cfg, seed=script.seed))
    alone.prepare(di.PREFIX)
    for k, g in enumerate(got):
        want = alone.unit(*inputs[k])
        assert (g["is_listen"], g["text"], g["token_ids"]) == (
            want.is_listen, want.text, want.token_ids), f"unit {k}"


class _FakeUnits:
    """DuplexSessions' unit side (add / steps / fail_all) with fake units: a unit is
    decided at its first step and done at a step of its own (`speech_steps` later, or when
    `gate` is set); `audio="boom"` breaks the steps themselves."""

    def __init__(self, speech_steps: int = 1):
        import threading

        self.speech_steps = speech_steps
        self.gate = threading.Event()
        self.gate.set()
        self.units: list[list] = []  # [sid, audio, on_decided, on_done, steps run]
        self.jobs = 0  # times the steps started
        self.joined: list[list[str]] = []  # the units new at each step

    def add(self, sid, audio, frames, force, on_decided=None, on_done=None, on_text=None):
        if sid == "nobody":
            for fn in (on_decided, on_done):
                fn(KeyError(sid))
            return
        self.units.append([sid, audio, on_decided, on_done, 0, force])

    def steps(self, others):
        self.jobs += 1
        assert others() in (True, False)  # the engine's has_work: its own steps between
        while self.units:
            new = [f"{u[0]}:{u[1]}" for u in self.units if u[4] == 0]
            self.joined.append(new)
            for u in list(self.units):
                sid, audio, on_decided, on_done, n, force = u
                if audio == "boom":
                    raise RuntimeError("the step failed")
                u[4] += 1
                if n == 0:
                    on_decided(ValueError("bad force") if force == "x"
                               else {k: _result(sid, audio)[k] for k in DECISION})
                    if force == "x":
                        on_done(ValueError("bad force"))
                        self.units.remove(u)
                elif n >= self.speech_steps and self.gate.is_set():
                    on_done(_result(sid, audio))
                    self.units.remove(u)
            yield

    def fail_all(self, e):
        for u in self.units:
            (u[2] if u[4] == 0 else (lambda r: None))(e)
            u[3](e)
        self.units.clear()


def _result(sid, audio) -> dict:
    """A unit's whole result as DuplexSessions' on_done gets it (fakes)."""
    return {**dict.fromkeys(DECISION), "text": f"{sid}:{audio}", "codes": [1], "pcm": None}


def _batcher(units: _FakeUnits):
    from deployments.stages.duplex import UnitBatcher
    from deployments.stages.loop import EngineLoop

    class Idle:
        def has_work(self):
            return False

        def step(self):
            return []

    loop = EngineLoop(None, name="fake")
    loop.start(Idle)
    return UnitBatcher(loop, lambda: units), loop


def test_unit_batcher_joins_units_at_the_next_step():
    """UnitBatcher over the engine loop: a lone unit starts the steps at once; units that
    arrive while they run join at a next step (no new job); after the steps end, a new unit
    starts them again; a unit's failure is its own; steps that fail outside the units fail
    the units in flight, and the next unit runs."""
    import asyncio

    units = _FakeUnits(speech_steps=3)
    b, loop = _batcher(units)

    async def main():
        first = await asyncio.wait_for(b.submit("a", 0, None, None), 2)
        assert first["text"] == "a:0" and set(first) == set(DECISION)
        later = [asyncio.create_task(b.submit(sid, n, None, f))
                 for sid, n, f in (("b", 0, None), ("c", 0, "x"))]
        got = [(await asyncio.wait_for(t, 2)) if k == 0 else None for k, t in enumerate(later)]
        assert got[0]["text"] == "b:0"
        with pytest.raises(ValueError, match="bad force"):
            await later[1]
        assert (await asyncio.wait_for(b.speech("a"), 2))["codes"] == [1]
        assert (await asyncio.wait_for(b.speech("b"), 2))["text"] == "b:0"
        with pytest.raises(KeyError):
            await b.submit("nobody", 0, None, None)
        jobs = units.jobs
        assert (await b.submit("d", 0, None, None))["text"] == "d:0"  # the steps start again
        await b.speech("d")
        assert units.jobs == jobs + 1
        bad = asyncio.gather(b.submit("e", "boom", None, None), return_exceptions=True)
        assert isinstance((await asyncio.wait_for(bad, 2))[0], RuntimeError)
        assert (await asyncio.wait_for(b.submit("e", 2, None, None), 2))["text"] == "e:2"

    try:
        asyncio.run(main())
    finally:
        loop.stop()
    assert ["a:0"] == units.joined[0]  # it never waited for more units
    assert any(set(j) == {"b:0", "c:0"} for j in units.joined)  # joined a running job


def test_unit_batcher_returns_the_decision_before_the_speech():
    """`submit` returns at the unit's decision, `speech` once its speech is done, with the
    codes and PCM; a session that never ran a unit has no speech; `forget` drops a closed
    session's; `idle` waits for the session's unit in flight only."""
    import asyncio

    units = _FakeUnits()
    units.gate.clear()  # the speech waits
    b, loop = _batcher(units)

    async def main():
        with pytest.raises(KeyError):
            await b.speech("a")
        decision = await asyncio.wait_for(b.submit("a", 0, None, None), 2)
        speech = asyncio.create_task(b.speech("a"))
        idle = asyncio.create_task(b.idle("a"))
        await asyncio.wait_for(b.idle("b"), 1)  # no unit of b in flight
        await asyncio.sleep(0.05)
        early = speech.done() or idle.done()
        units.gate.set()
        whole = await asyncio.wait_for(speech, 2)
        await asyncio.wait_for(idle, 2)
        b.forget("a")
        with pytest.raises(KeyError):
            await b.speech("a")
        return decision, early, whole

    try:
        decision, early, whole = asyncio.run(main())
    finally:
        loop.stop()
    assert decision["text"] == "a:0" and "codes" not in decision
    assert not early and whole["codes"] == [1] and whole["text"] == "a:0"


def test_chat_steps_between_the_units_steps_and_a_close_waits_for_its_unit(ckpt):
    """The served path runs the units' steps as a side job of the engine loop: a chat turn's
    steps come between them, the units' decode steps are the chat turn's steps themselves
    (the sessions' rows in the engine's forward: `guest_step`), and a close that comes
    while the session's unit runs waits for its end."""
    import asyncio

    from deployments.stages.thinker import ThinkerServer
    from pipeline.handoff import SamplingParams, ThinkerRequest

    source = ModelSource.open(str(ckpt))
    script = di.session(NAME)
    inputs = di.session_inputs(script)
    server = ThinkerServer({"device": "cpu"}, source=source)
    order: list[str] = []
    step, side_step = server.engine.step, server.loop._side_step
    server.engine.step = lambda guests=None: order.append("E" if guests is None else "G") \
        or step(guests)
    server.loop._side_step = lambda: order.append("S") or side_step()
    try:
        async def main():
            await server.duplex_open("s", _text_init(script))
            for k in range(4):  # to the first speak unit: several decode steps
                await _unit(server, "s", *inputs[k], "speak" if k == 3 else None)
            q = server.loop.open("chat")
            await server.loop.call(lambda e: e.open("chat", ThinkerRequest(
                "chat", [1, 2, 3], sampling=SamplingParams(max_tokens=400, ignore_eos=True))))
            order.clear()
            unit = asyncio.create_task(_unit(server, "s", *inputs[4], "speak"))
            while server.loop.side_steps == 0 or "S" not in order:
                await asyncio.sleep(0.001)
            closed = await server.duplex_close("s")  # mid-unit: waits for its end
            result = await unit
            await server.loop.call(lambda e: e.abort("chat"))
            server.loop.close("chat")
            text = []
            while not q.empty():
                item = q.get_nowait()
                text.append(getattr(item, "text", ""))
            return text, closed, result

        text, closed, result = asyncio.run(main())
    finally:
        server.loop.stop()
    assert closed and isinstance(result, dict) and not result["is_listen"]
    side = [i for i, x in enumerate(order) if x == "S"]
    assert len(side) > 2, order
    between = order[side[0] : side[-1]]
    # an engine step between side steps; the unit's decode steps ran in them
    assert between.count("E") + between.count("G") >= len(side) - 1, order
    assert order.count("G") >= 10, order
    assert text, "the chat turn streamed beside the unit"


def test_a_full_kv_pool_fails_the_unit_that_needs_more_and_close_frees(ckpt):
    """Sessions take their K/V blocks from the engine's pool: a unit that finds none free
    fails alone with a clear error (the session's state up to its last unit stays), another
    session's units go on, and closing gives every block back."""
    from pipeline.thinker.llm_engine.engine import EngineConfig

    source = ModelSource.open(str(ckpt))
    # room for the two system prompts and a few units, not for many units of both
    engine = ThinkerEngine.from_source(
        source, ThinkerEngineConfig(llm=EngineConfig(num_blocks=14, block_size=16)), "cpu")
    pool = engine.llm.block_manager
    sessions = DuplexSessions(source, engine.device, STEPS)
    for sid in ("a", "b"):
        sessions.open(engine, sid, SimpleNamespace(
            options={"decode_mode": "greedy", "seed": 1}, audio_out=False,
            system_prompt=di.PREFIX, ref_audio=None, prompt_wav=None, max_slice_nums=1))
    inputs = di.session_inputs(di.session("audio_greedy"))
    failed = None
    for k, (audio, _) in enumerate(inputs):
        out = sessions.units_batch([("a", audio, None, "speak")])[0]
        if isinstance(out, BaseException):
            failed = (k, out)
            break
    assert failed is not None, "the pool never filled"
    k, err = failed
    assert isinstance(err, ValueError) and "KV cache is full" in str(err), err
    assert pool.num_free < 2  # the pool was spent, not a context limit
    assert sessions.close("a")  # a's blocks back: b goes on
    out = sessions.units_batch([("b", inputs[0][0], None, "listen")])[0]
    assert not isinstance(out, BaseException) and out["is_listen"], out
    assert sessions.close("b")
    assert pool.num_used == 0 and sessions.stats()["kv_blocks"] == 0


def test_served_sessions_slide_and_stay_within_their_bound(ckpt):
    """A served session runs the reference's basic window (the wires offer no other mode):
    its context stays under the window's high mark plus one unit (`session_tokens_max`), the
    bound its K/V may take of the pool; a session whose system prompt alone passes the bound
    is refused at its start, saying so."""
    from deployments.stages.duplex import sessions_held
    from pipeline.duplex.config import session_tokens_max, unit_tokens_max

    source = ModelSource.open(str(ckpt))
    engine = ThinkerEngine.from_source(source, ThinkerEngineConfig(), "cpu")
    q = engine.model.cfg.query_num
    sessions = DuplexSessions(source, engine.device, STEPS)
    window = {"basic_window_high_tokens": 80, "basic_window_low_tokens": 60}

    def init(prompt, **extra):
        return SimpleNamespace(options={"decode_mode": "greedy", "seed": 1, **window, **extra},
                               audio_out=False, system_prompt=prompt, ref_audio=None,
                               prompt_wav=None, max_slice_nums=1)

    sessions.open(engine, "a", init(None))
    thinker = sessions._sessions["a"][0].thinker
    cfg = thinker.cfg
    assert cfg.sliding_window_mode == "basic"
    bound = 80 + unit_tokens_max(cfg, q)
    assert thinker.max_tokens == session_tokens_max(cfg, q) == bound == thinker.kv.max_len
    inputs = di.session_inputs(di.session("audio_greedy"))
    longest = 0
    for k, (audio, _) in enumerate(inputs[:12]):
        out = sessions.units_batch([("a", audio, None, "speak" if k % 3 else "listen")])[0]
        assert not isinstance(out, BaseException), out
        longest = max(longest, thinker.kv.length)
    assert thinker.slides > 0 and longest <= bound
    assert sessions.close("a")

    with pytest.raises(ValueError, match="over a session's limit of"):
        sessions.open(engine, "long", init(" ".join(["a long system prompt"] * 30)))
    assert len(sessions) == 0 and engine.llm.block_manager.num_used == 0

    # the pool's sessions beside the chat window, at the default session's bound
    llm = engine.llm
    blocks, block = llm.block_manager.num_blocks, llm.config.block_size
    held = sessions_held(llm, 8, 512, q)
    per = -(-held["session_tokens"] // block)
    assert held["session_tokens"] == 4000 + unit_tokens_max(DuplexConfig(), q)
    assert held["sessions"] == (blocks - 8 * -(-512 // block)) // per
    assert sessions_held(llm, blocks, block, q)["sessions"] == 0  # chat takes it all


def test_sessions_in_memory_is_what_the_cap_holds_beside_the_rest():
    from deployments.stages.duplex import sessions_in_memory

    gib = 2**30
    # the H100 case of docs/operations.md: a 57 GiB cap, 37.2 GiB turn peak + 1.5 of speech
    # weights, 0.85 GiB a session at 10 steps: 21, not the 24 that ran out of memory there
    assert sessions_in_memory(57 * gib, int(38.7 * gib), int(0.85 * gib)) == 21
    assert sessions_in_memory(10 * gib, 12 * gib, gib) == 0  # nothing left: none
    assert sessions_in_memory(10 * gib, 0, 0) == 10 * gib  # a zero size counts as one byte


def test_memory_holds_is_a_gpu_bound(ckpt):
    """On a CPU there is no cap to hold sessions to: the KV pool's count stands."""
    sessions = DuplexSessions(ModelSource.open(str(ckpt)), "cpu", STEPS)
    assert sessions.memory_holds(80 * 2**30) is None
    assert sessions._speech_models is None  # nothing loaded for it


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA")
def test_memory_holds_measures_a_sessions_peak_cuda(ckpt):
    """On CUDA the first ask loads the speech models and runs the warm-up speak batch: a
    session's peak is measured (> 0), the sessions follow from the cap, and the warm-up's
    sessions are gone (no Talker row held)."""
    import torch

    sessions = DuplexSessions(ModelSource.open(str(ckpt)), "cuda", STEPS)
    total = torch.cuda.get_device_properties(0).total_memory
    m = sessions.memory_holds(total)
    assert m is not None and m["per_session_bytes"] > 0 and m["speech_weight_bytes"] > 0
    assert m["sessions"] == (total - m["held_bytes"]) // m["per_session_bytes"] > 0
    assert sessions._speech_models.pool.rows_in_use == 0
    again = sessions.memory_holds(total // 2)  # measured once, counted per cap
    assert again["per_session_bytes"] == m["per_session_bytes"]
    assert again["sessions"] < m["sessions"]
