"""The StageEngine contract (pipeline/stage_engine.py), one suite run against the three real
engines on the embedded default checkpoint (CPU): open -> feed -> step until the stream's
final output, abort frees everything at once, idle engines have no work, stats are numbers,
and interleaved streams each finish with what they would produce alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from pipeline.thinker.llm_engine.engine import EngineConfig
from pipeline.handoff import CodeChunk, SamplingParams, SpokenChunk, TalkerSpec, ThinkerRequest
from pipeline.stage_engine import StageEngine, StageOutput
from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig
from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig

MAX_STEPS = 500


@dataclass
class Stage:
    """One engine and how to drive a stream through it."""

    engine: Any
    spec: Callable[[str], Any]  # rid -> what open() takes
    inputs: Callable[[str], list[Any]]  # rid -> what feed() takes, in order
    payload: Callable[[list[Any]], Any]  # a stream's outputs -> what it produced
    holds_nothing: Callable[[dict[str, float]], bool]  # stats -> no stream state left


def _thinker(source) -> Stage:
    cfg = ThinkerEngineConfig(llm=EngineConfig(kv_cache_bytes=8 * 2**20))
    eng = ThinkerEngine.from_source(source, cfg, device="cpu")
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)

    def spec(rid: str) -> ThinkerRequest:
        seed = sum(map(ord, rid))
        return ThinkerRequest(
            rid, [100 + (seed * 7 + i) % 500 for i in range(12)], sampling=sampling
        )

    return Stage(
        eng,
        spec,
        lambda rid: [],  # the whole prompt comes with open()
        lambda outs: [t for o in outs for t in o.token_ids],
        lambda st: st["open_streams"] == 0 and st["num_free_blocks"] == st["num_total_blocks"],
    )


def _talker(source) -> Stage:
    eng = TalkerEngine.from_source(source, TalkerEngineConfig(max_streams=2), "cpu")
    dim = eng.cfg.llm_dim

    def inputs(rid: str) -> list[SpokenChunk]:
        g = torch.Generator().manual_seed(sum(map(ord, rid)))
        ids = torch.randint(0, 151000, (14,), generator=g).tolist()
        hidden = torch.randn(14, dim, generator=g)
        return [SpokenChunk(ids[:6], hidden[:6]), SpokenChunk(ids[6:], hidden[6:], True)]

    return Stage(
        eng,
        lambda rid: TalkerSpec(seed=sum(map(ord, rid)), max_codes=40),
        inputs,
        lambda outs: [c for o in outs for c in o.codes],
        lambda st: (
            st["open_streams"] == 0
            and st["free_slots"] == eng.config.max_streams
            and st["unaccounted_slots"] == 0
        ),
    )


def _code2wav(source) -> Stage:
    eng = Code2WavEngine.from_source(source, Code2WavEngineConfig(), "cpu")

    def inputs(rid: str) -> list[CodeChunk]:
        g = torch.Generator().manual_seed(sum(map(ord, rid)))
        codes = tuple(torch.randint(0, 6561, (40,), generator=g).tolist())
        return [CodeChunk(rid, codes[:25], False), CodeChunk(rid, codes[25:], True)]

    return Stage(
        eng,
        lambda rid: None,  # the checkpoint's default voice
        inputs,
        lambda outs: np.concatenate([o.pcm for o in outs]),
        lambda st: st["open_streams"] == 0,
    )


@pytest.fixture(scope="module", params=["thinker", "talker", "code2wav"])
def stage(request, tiny_source) -> Stage:
    return {"thinker": _thinker, "talker": _talker, "code2wav": _code2wav}[request.param](
        tiny_source
    )


def _step_until_final(eng: StageEngine, rids: set[str]) -> dict[str, list[Any]]:
    """Step until every stream in `rids` had its final output; outputs by stream."""
    out: dict[str, list[Any]] = {rid: [] for rid in rids}
    done: set[str] = set()
    for _ in range(MAX_STEPS):
        for o in eng.step():
            assert isinstance(o, StageOutput)
            assert o.request_id in out and o.request_id not in done, o.request_id
            out[o.request_id].append(o)
            if o.finished:
                done.add(o.request_id)
        if done == rids:
            return out
    raise AssertionError(f"streams {rids - done} never finished")


def _settle(eng: StageEngine, gone: set[str]) -> None:
    """Step while there is work (a few steps at most); nothing comes for `gone` streams."""
    for _ in range(5):
        if not eng.has_work():
            return
        assert not [o for o in eng.step() if o.request_id in gone]
    assert not eng.has_work()


def _close(st: Stage, rid: str) -> None:
    """The caller's end of a stream: abort once it is done with it."""
    st.engine.abort(rid)
    assert st.holds_nothing(st.engine.stats()), st.engine.stats()


def _alone(st: Stage, rid: str) -> Any:
    st.engine.open(rid, st.spec(rid))
    for msg in st.inputs(rid):
        st.engine.feed(rid, msg)
    outs = _step_until_final(st.engine, {rid})[rid]
    _close(st, rid)
    return st.payload(outs)


def test_is_a_stage_engine_and_idle(stage):
    eng = stage.engine
    assert isinstance(eng, StageEngine)
    assert not eng.has_work() and eng.step() == []
    stats = eng.stats()
    assert stats and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in stats.values()
    ), stats
    assert stage.holds_nothing(stats)


def test_open_feed_step_until_final(stage):
    eng = stage.engine
    eng.open("s", stage.spec("s"))
    with pytest.raises(ValueError):
        eng.open("s", stage.spec("s"))  # one stream per id
    for msg in stage.inputs("s"):
        eng.feed("s", msg)
    outs = _step_until_final(eng, {"s"})["s"]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(stage.payload(outs)) > 0
    _settle(eng, set())
    _close(stage, "s")


def test_abort_mid_stream_frees_everything(stage):
    eng = stage.engine
    eng.open("m", stage.spec("m"))
    first, *_ = stage.inputs("m") or [None]
    if first is not None:
        eng.feed("m", first)
    for _ in range(2):
        assert all(not o.finished for o in eng.step())
    assert not stage.holds_nothing(eng.stats())
    eng.abort("m")
    assert stage.holds_nothing(eng.stats()), eng.stats()
    _settle(eng, {"m"})
    eng.abort("m")  # a second abort, and one of an id never opened: harmless
    eng.abort("never-opened")
    assert stage.holds_nothing(eng.stats()) and not eng.has_work()
    _alone(stage, "m")  # the id can be used again


def test_a_stream_waiting_for_input_is_no_work(stage):
    """The driver steps back to back while has_work() holds (deployments/loop.py): a stream
    that has what it was fed so far done must not count as work, or the driver spins."""
    eng = stage.engine
    feeds = stage.inputs("w")
    if not feeds:
        pytest.skip("the Thinker takes its whole input at open")
    eng.open("w", stage.spec("w"))
    eng.feed("w", feeds[0])
    outs = []
    for _ in range(MAX_STEPS):
        if not eng.has_work():
            break
        outs += eng.step()
    assert not eng.has_work() and not any(o.finished for o in outs)
    for msg in feeds[1:]:
        eng.feed("w", msg)
    assert eng.has_work()
    outs += _step_until_final(eng, {"w"})["w"]
    assert outs[-1].finished
    _close(stage, "w")


def test_two_interleaved_streams_each_finish_as_alone(stage):
    eng = stage.engine
    want = {rid: _alone(stage, rid) for rid in ("a", "b")}
    feeds = {rid: stage.inputs(rid) for rid in ("a", "b")}
    got: dict[str, list[Any]] = {"a": [], "b": []}

    def feed_and_step(rid: str) -> None:
        if feeds[rid]:
            eng.feed(rid, feeds[rid].pop(0))
        for o in eng.step():
            got[o.request_id].append(o)

    eng.open("a", stage.spec("a"))
    feed_and_step("a")
    eng.open("b", stage.spec("b"))  # while a runs
    for rid in ("b", "a", "b"):
        feed_and_step(rid)
    assert not feeds["a"] and not feeds["b"]
    rest = _step_until_final(eng, {rid for rid in got if not any(o.finished for o in got[rid])})
    for rid in ("a", "b"):
        outs = got[rid] + rest.get(rid, [])
        assert outs[-1].finished and not any(o.finished for o in outs[:-1]), rid
        eng.abort(rid)
        if isinstance(want[rid], np.ndarray):
            np.testing.assert_allclose(stage.payload(outs), want[rid], rtol=0, atol=1e-5)
        else:
            assert stage.payload(outs) == want[rid], rid
    assert stage.holds_nothing(eng.stats()) and not eng.has_work()


def test_gc_watch_counts_collections_and_their_pauses():
    import gc

    from deployments.stages.gc_watch import GcWatch

    watch = GcWatch(warn_ms=1e9)
    gc.callbacks.append(watch)
    try:
        before = watch.gens[2]["count"]
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
    finally:
        gc.callbacks.remove(watch)
    st = watch.stats()
    assert watch.gens[2]["count"] == before + 1 and st["gen0"]["count"] >= 1
    assert st["gen2"]["max_ms"] > 0 and st["gen2"]["total_ms"] >= st["gen2"]["max_ms"]


def test_a_started_stage_freezes_its_startup_objects():
    """In a process of its own, as a replica is: after the freeze a full collection scans
    only what came after (gc.get_objects lists the collected generations alone). In-process
    (here, outside Serve) nothing is frozen."""
    import subprocess
    import sys

    from deployments.stages.gc_watch import freeze_startup_objects

    assert freeze_startup_objects() is False  # not a Serve replica: the test process stays
    code = (
        "import gc\n"
        "from test_api import light_source\n"
        "from deployments.stages.gc_watch import freeze_startup_objects\n"
        "from deployments.stages.talker import TalkerServer\n"
        "from fakes import FakeTalkerEngine\n"
        "server = TalkerServer({}, None, engine_cls=FakeTalkerEngine, source=light_source())\n"
        "assert freeze_startup_objects(force=True)\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()),"
        " any(o is server for o in gc.get_objects()))\n"
    )
    import os
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{here.parent}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.split()
    frozen, left, server_left = int(out[0]), int(out[1]), out[2]
    assert frozen > 10_000 and left < frozen / 10 and server_left == "False", out
