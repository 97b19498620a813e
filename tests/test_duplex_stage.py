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

from deployments.stages.duplex import DuplexSessions
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


@pytest.fixture(scope="module")
def ckpt():
    from tests._duplex_ckpt import duplex_test_checkpoint

    return duplex_test_checkpoint()


def test_stage_session_equals_a_session_over_fresh_weights(ckpt):
    record = json.loads((GOLDEN / f"{NAME}.json").read_text())
    source = ModelSource.open(str(ckpt))
    engine = ThinkerEngine.from_source(source, ThinkerEngineConfig(), "cpu")
    sessions = DuplexSessions(source, engine.device)
    options = {"decode_mode": record["decode_mode"], **record["duplex_kwargs"], "seed": 5}
    init = SimpleNamespace(options=options, audio_out=True, system_prompt=record["prefix"],
                           ref_audio=None, prompt_wav=None, max_slice_nums=1)
    sessions.open(engine, "s", init)
    with pytest.raises(ValueError, match="already open"):
        sessions.open(engine, "s", init)

    cfg = DuplexConfig(decode_mode=record["decode_mode"], **record["duplex_kwargs"])
    alone = DuplexSession(DuplexThinker.from_checkpoint(ckpt, cfg, seed=5),
                          DuplexSpeech.from_checkpoint(ckpt, cfg, seed=5))
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
    assert sessions.stats() == {"sessions": 1, "units": UNITS, "batches": UNITS}
    assert sessions.close("s") and not sessions.close("s")
    with pytest.raises(KeyError):
        sessions.unit("s", inputs[0][0], None, None)
    assert len(sessions) == 0


def test_stage_session_refuses_a_bad_option(ckpt):
    source = ModelSource.open(str(ckpt))
    engine = SimpleNamespace(model=None, tokenizer=None)
    sessions = DuplexSessions(source, "cpu")
    init = SimpleNamespace(options={"sliding_window_mode": "sideways"}, audio_out=False,
                           system_prompt=None, ref_audio=None, prompt_wav=None, max_slice_nums=1)
    with pytest.raises((ValueError, TypeError)):
        sessions.open(engine, "x", init)
    assert len(sessions) == 0


def test_concurrent_units_of_several_sessions_run_as_one_batch(ckpt):
    """The served path (ThinkerServer.duplex_unit): units of three sessions that arrive
    together run as one batch on the engine loop, and each equals its session alone."""
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
                init = SimpleNamespace(
                    options={"decode_mode": s.decode_mode, **s.duplex_kwargs, "seed": s.seed},
                    audio_out=False, system_prompt=di.PREFIX, ref_audio=None, prompt_wav=None,
                    max_slice_nums=1)
                await server.duplex_open(name, init)
            out = []
            for k in rounds:
                out.append(await asyncio.gather(*(
                    server.duplex_unit(name, *inputs[i][k], None) for i, name in enumerate(names))))
            with pytest.raises(KeyError):
                await server.duplex_unit("nobody", inputs[0][0][0], None, None)
            stats = server._duplex_sessions().stats()
            for name in names:
                assert await server.duplex_close(name)
            return out, stats

        got, stats = asyncio.run(main())
    finally:
        server.loop.stop()
    # one batch per round (the unknown session's unit is refused before any batch)
    assert stats == {"sessions": 3, "units": 3 * len(rounds), "batches": len(rounds)}

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
            assert g["token_ids"] == want.token_ids and g["pcm"] is None, where
            kinds.add("listen" if want.is_listen else "speak")
    assert kinds == {"listen", "speak"}
