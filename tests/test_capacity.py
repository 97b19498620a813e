"""Capacity (no Ray): the turns each stage's memory holds, measured on the built engine and
checked against the window at start; the window's bounded queue (a 503 `queue_full` past it,
each admitted turn's wait reported); 32 concurrent speech turns on the tiny default through
the in-process app (the ingress, the three stage servers and their real engines) all
complete with the window at 8 (they queue) and at 32.
"""

from __future__ import annotations

import asyncio

import pytest
from test_api import light_source, user
from test_turns import collect
from test_turns import settled as _settled

from deployments.config import CapacityError, check_holds
from deployments.ingress.window import QUEUE_PER_SLOT, ActiveStreamWindow, QueueFull
from deployments.wire import AudioChunk, Done, Error
from fakes import FakeCode2WavEngine, FakeThinkerEngine, build_local_app

SPEECH = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 4,
          "omniray": {"fixed_speech_codes": 8}}


async def idle(local) -> dict:
    return await _settled(local, timeout=10.0)


# -- the window's queue ------------------------------------------------------------------


def test_the_queue_is_bounded_and_each_wait_is_measured():
    async def main():
        w = ActiveStreamWindow(2)
        assert w.queue_limit == QUEUE_PER_SLOT * 2
        held = [await w.acquire(f"a{i}") for i in range(2)]
        assert not w.full() and all(s.wait_s == 0.0 for s in held)
        waiters = [asyncio.ensure_future(w.acquire(f"w{i}")) for i in range(w.queue_limit)]
        await asyncio.sleep(0)
        assert w.waiting == w.queue_limit and w.full()
        with pytest.raises(QueueFull) as refused:
            await w.acquire("late")
        e = refused.value
        assert (e.waiting, e.limit, e.size) == (8, 8, 2) and e.retry_after_s >= 1
        assert "8 turns are waiting" in str(e) and w.refused == 1
        assert w.waiting == w.queue_limit  # the refused turn left nothing behind
        # a cancelled waiter makes room for one more
        waiters[-1].cancel()
        await asyncio.sleep(0)
        assert not w.full()
        waiters[-1] = asyncio.ensure_future(w.acquire("again"))
        await asyncio.sleep(0.05)
        order = []
        for s in held:
            s.release()
        while waiters:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                waiters.remove(t)
                slot = t.result()
                order.append(slot)
                assert slot.wait_s >= 0.05
                slot.release()
        assert len(order) == 8 and w.active == 0 and w.waiting == 0
        st = w.stats()
        assert st["waited"] == 8 and st["refused"] == 1 and st["max_wait_s"] >= 0.05
        # the hold time it has seen now sets Retry-After (at least a second)
        assert w.hold_s > 0 and w.retry_after_s() >= 1

    asyncio.run(main())


def test_an_unlimited_window_never_refuses():
    async def main():
        w = ActiveStreamWindow(0)
        slots = [await w.acquire(str(i)) for i in range(100)]
        assert w.active == 100 and not w.full()
        for s in slots:
            s.release()

    asyncio.run(main())


def test_a_turn_past_the_queue_is_a_503_and_admitted_ones_all_finish():
    """Capacity 1: one turn runs, QUEUE_PER_SLOT wait, the next is refused at once with a
    503 `queue_full` (counted as rejected, nothing opened in any stage); every admitted turn
    finishes and reports its queue wait."""
    cfg = {"capacity": 1, "limits": {"max_tokens": 64},
           "thinker": {"engine": {"step_delay_s": 0.01}}}

    async def main():
        local = build_local_app(cfg, light_source())
        turns = local.ingress.turns
        body = {**SPEECH, "max_tokens": 6}
        tasks = [asyncio.ensure_future(collect(local.ingress, body))
                 for _ in range(1 + QUEUE_PER_SLOT)]
        while local.ingress.groups[0].window.waiting < QUEUE_PER_SLOT:
            await asyncio.sleep(0.005)
        with pytest.raises(QueueFull):  # what a route can ask before its headers go out
            turns.check_admission(speech=True)
        turns.check_admission(speech=False)  # text turns never wait for the window
        late = await collect(local.ingress, body)
        results = await asyncio.gather(*tasks)
        return local, late, results, await idle(local)

    local, late, results, st = asyncio.run(main())
    assert len(late) == 1 and isinstance(late[0], Error), late
    assert late[0].status == 503 and late[0].reason == "queue_full", late[0]
    assert "retry in" in late[0].message
    dones = [evs[-1] for evs in results]
    assert all(isinstance(d, Done) for d in dones), dones
    waits = sorted(d.metrics["queue_s"] for d in dones)
    assert waits[0] == 0.0 and waits[-1] > 0, waits
    assert st["idle"] and not st["leaks"], st
    assert st["window"]["refused"] == 1 and st["window"]["waited"] == QUEUE_PER_SLOT
    # the refused turn never reached a stage
    assert local.thinker.engine.aborted == 0


def test_the_route_answers_a_full_queue_before_preparing_with_retry_after(monkeypatch):
    """The chat route asks the window first: a full queue is a 503 `queue_full` with a
    Retry-After header, and the request's media is never prepared."""
    from starlette.testclient import TestClient

    local = build_local_app({"capacity": 1}, light_source())
    prepared = []
    monkeypatch.setattr(local.ingress, "prepare", lambda req: prepared.append(req))

    def full(speech: bool) -> None:
        if speech:
            raise QueueFull(4, 4, 1, retry_after_s=7)

    monkeypatch.setattr(local.ingress.turns, "check_admission", full)
    with TestClient(local.ingress.__serve_build_asgi_app__()) as c:
        r = c.post("/v1/chat/completions", json={**SPEECH, "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "7", (r.status_code, r.headers)
    err = r.json()["error"]
    assert err["code"] == "queue_full" and "retry in 7 s" in err["message"], err
    assert prepared == []


# -- what each stage holds, checked at start ---------------------------------------------


def test_a_stage_holding_fewer_turns_than_the_window_is_refused():
    holds = {"streams": 3, "stream_bytes": 3 * 2**20, "budget_bytes": 9 * 2**20,
             "holder": "slot pool"}
    check_holds("code2wav", holds, 3)  # enough
    with pytest.raises(CapacityError) as e:
        check_holds("code2wav", holds, 4)
    msg = str(e.value)
    assert msg.startswith("code2wav holds 3 turns but capacity is 4")
    assert "slot pool has 0.009 GiB at 3.0 MiB a turn" in msg
    assert "code2wav.memory_fraction" in msg and "lower capacity" in msg


class SmallPool(FakeCode2WavEngine):
    """A fake Code2Wav whose memory holds two streams, whatever its settings."""

    def capacity(self):
        return {"streams": 2, "stream_bytes": 2**20, "budget_bytes": 2 * 2**20,
                "holder": "fake pool"}


def test_a_stage_whose_memory_holds_fewer_turns_does_not_start():
    from deployments.stages.code2wav import Code2WavServer

    source = light_source()
    with pytest.raises(CapacityError, match="code2wav holds 2 turns but capacity is 3"):
        Code2WavServer({"capacity": 3}, engine_cls=SmallPool, source=source)
    server = Code2WavServer({"capacity": 2}, engine_cls=SmallPool, source=source)
    try:
        st = asyncio.run(server.stats())
        assert st["holds"]["streams"] == 2 and st["capacity"] == 2, st
    finally:
        server.loop.stop()


def test_the_thinker_holds_what_its_kv_cache_holds(tiny_source):
    """The real tiny Thinker: the turns its KV cache holds at `default_max_tokens` each, never
    more than max_num_seqs; a cache too small for the window refuses to start."""
    from deployments.stages.thinker import ThinkerServer
    from pipeline.thinker.llm_engine.kv_cache import bytes_per_block

    llm_cfg = tiny_source.config.thinker.llm
    block = bytes_per_block(llm_cfg, 16, __import__("torch").float32)
    cfg = {"device": "cpu", "capacity": 4, "limits": {"default_max_tokens": 64},
           "thinker": {"cpu_kv_cache_gib": 40 * block / 2**30}}  # 40 blocks: 10 turns
    server = ThinkerServer(cfg, source=tiny_source)
    try:
        holds = asyncio.run(server.stats())["holds"]
    finally:
        server.loop.stop()
    assert holds == {"streams": 4, "stream_bytes": 4 * block, "budget_bytes": 40 * block,
                     "holder": "KV cache of 640 tokens, 64 a turn"}, holds
    small = {**cfg, "thinker": {"cpu_kv_cache_gib": 12 * block / 2**30}}  # 3 turns
    with pytest.raises(CapacityError, match="thinker holds 3 turns but capacity is 4"):
        ThinkerServer(small, source=tiny_source)


# -- 32 concurrent turns on the tiny default ---------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("capacity", [8, 32])
def test_32_concurrent_speech_turns_all_complete(tiny_source, capacity):
    """32 speech turns at once through the in-process app on the tiny default's real
    engines: every one ends with Done and audio; with the window at 8 the others queue
    (never more than 8 in the stages), at 32 none waits; each stage reports that it holds
    at least the window, and nothing is left held."""
    cfg = {"device": "cpu", "capacity": capacity,
           "limits": {"max_tokens": 64, "default_max_tokens": 16}}

    async def main():
        local = build_local_app(cfg, tiny_source, thinker_engine_cls=None,
                                talker_engine_cls=None, code2wav_engine_cls=None)
        try:
            bodies = [{**SPEECH, "seed": i} for i in range(32)]
            results = await asyncio.wait_for(asyncio.gather(
                *(collect(local.ingress, b) for b in bodies)), 240)
            return results, await idle(local)
        finally:
            for server in (local.thinker, local.talker, local.code2wav):
                server.loop.stop()

    results, st = asyncio.run(main())
    failed = [evs[-1] for evs in results if not isinstance(evs[-1], Done)]
    assert not failed, failed
    assert all(any(isinstance(e, AudioChunk) for e in evs) for evs in results)
    assert st["idle"] and not st["leaks"], st
    window = st["window"]
    assert window["admitted"] == 32 and window["refused"] == 0, window
    assert window["peak_active"] <= capacity, window
    if capacity == 8:
        assert window["waited"] >= 32 - 8 and window["peak_waiting"] >= 32 - 8 - 1, window
    else:
        assert window["waited"] == 0, window
    for name in ("thinker", "talker", "code2wav"):
        holds = st["stages"][name]["holds"]
        assert holds["streams"] >= capacity and holds["stream_bytes"] > 0, (name, holds)


# -- the engines at 32 streams -----------------------------------------------------------


def test_code2wav_warms_every_last_chunk_batch_up_to_32_streams(tiny_checkpoint):
    """The warm-up's last chunks at max_streams 32: a batch of more streams than there are
    last-chunk lengths repeats lengths, and each of its throwaway streams still opens (the
    warm-up once named streams by length: two of one batch collided past 26 streams). Only
    the streams' bookkeeping runs here (decoding is stubbed); every slot comes back."""
    from pipeline.code2wav.assets import load_code2wav
    from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
    from pipeline.code2wav.graphs import CausalVocoderGraphs
    from pipeline.code2wav.voice import VoiceCache
    from pipeline.handoff import CodeChunk

    flow, hift, cfg = load_code2wav(tiny_checkpoint, "cpu", __import__("torch").float32)
    engine = Code2WavEngine(flow, hift, cfg, Code2WavEngineConfig(max_streams=32))
    voice = VoiceCache(tiny_checkpoint / "assets" / "token2wav").default()
    assert engine.capacity()["streams"] == 32
    assert engine.capacity()["budget_bytes"] == engine.pool.nbytes()
    engine.hift_graphs = CausalVocoderGraphs(hift, engine.graph_sizes, engine.max_graphs)
    widest = []
    engine.drain = lambda: widest.append(len(engine.streams)) or {}
    engine._warm_last_chunks(voice)
    lengths = cfg.chunk_size + 1  # a last chunk's codes: pre_lookahead .. a full window
    assert max(widest) == 32 > lengths
    assert len(engine.pool.free) == 32 and not engine.streams
    # the graphs kept per runner cover every batch size's warm-up windows
    assert engine.max_graphs >= 6 * len(engine.graph_sizes)
    # the runners' counts are running totals: a step's stats carry them as they are
    del engine.drain
    for sid in ("a", "b"):
        engine.open(sid, voice)
        engine.feed(sid, CodeChunk(sid, (1,) * cfg.chunk_size, False))
    for _ in range(2):
        engine.step()
        engine.feed("a", CodeChunk("a", (1,) * cfg.chunk_size, False))
    runner = engine.hift_graphs  # on CPU every vocoder call is a fallback
    assert runner.fallbacks >= 2
    assert engine.stats()["hift_graph_fallbacks"] == runner.fallbacks


def test_the_talker_holds_its_kv_slots(tiny_source):
    """The Talker's capacity: one KV slot of every position a stream may reach, each."""
    import torch

    from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig
    from pipeline.talker.model import TalkerKVCache

    engine = TalkerEngine.from_source(tiny_source, TalkerEngineConfig(max_streams=32))
    held = engine.capacity()
    per_slot = TalkerKVCache.bytes_per_slot(engine.cfg, engine.max_len, torch.float32)
    assert held["streams"] == 32 and held["stream_bytes"] == per_slot
    assert held["budget_bytes"] == 32 * per_slot
    assert engine.batch_sizes[-1] == 32  # a step's rows reach every slot


H100_BYTES = 85_031_714_816  # what CUDA reports for an H100 80GB HBM3 (79.2 GiB)
# docs/operations.md "Capacity 32 on one H100": the split that ran there (fp16, 5 steps) and
# the exact one it gives, not yet started on an H100
CAPACITY_32_ON_H100 = {
    "exact, 5 s voices": {
        "capacity": 32, "limits": {"max_ref_audio_seconds": 5},
        "thinker": {"memory_fraction": 0.45, "kv_cache_gib": 10},
        "talker": {"memory_fraction": 0.125},
        "code2wav": {"memory_fraction": 0.345, "engine": {"slot_prompt_frames": 250}}},
    "fp16, 5 steps": {
        "capacity": 32,
        "thinker": {"memory_fraction": 0.48, "kv_cache_gib": 10},
        "talker": {"memory_fraction": 0.125},
        "code2wav": {"memory_fraction": 0.3,
                     "engine": {"token2wav_precision": "fp16", "n_timesteps": 5}}},
}
# The Thinker's peak while it loads the full-size weights (H100, random-full): 32.5 GiB
# allocated when it asked for 2.3 GiB more, before its KV cache; a cap below it does not start.
THINKER_LOAD_PEAK_GIB = 34.9


@pytest.mark.parametrize("name", list(CAPACITY_32_ON_H100))
def test_the_documented_capacity_32_splits_pass_the_start_up_check(name):
    """Each split validates (the engine sections too), fits an H100 by the start-up check,
    its Talker cap holds 32 KV slots of the full-size Talker beside its weights and its
    Thinker cap the Thinker's measured load peak."""
    import torch

    from deployments.app import engine_configs
    from deployments.config import GIB, AppConfig, check_memory_budget
    from pipeline.config import talker_config_from_hf
    from pipeline.presets import full_hf_config
    from pipeline.talker.model import TalkerKVCache

    cfg = AppConfig.model_validate(CAPACITY_32_ON_H100[name])
    built = engine_configs(cfg)
    assert built["talker"].max_streams == built["code2wav"].max_streams == 32
    assert built["thinker"].llm.max_num_seqs == 32
    plan = check_memory_budget(cfg, H100_BYTES)
    assert plan["need"] <= plan["total"]
    talker = talker_config_from_hf(full_hf_config())
    kv = 32 * TalkerKVCache.bytes_per_slot(talker, talker.max_position_embeddings,
                                          torch.bfloat16)
    assert plan["talker"] * GIB > kv, (plan["talker"], kv / GIB)
    assert plan["thinker"] > THINKER_LOAD_PEAK_GIB, plan["thinker"]
