"""Units of many duplex sessions batched in one step (pipeline/duplex/batch.py) equal each
session run alone (DuplexSession.unit, the path the goldens hold to the reference).

Sessions on the duplex test checkpoint (tests/_duplex_ckpt.py) with the scripted inputs of
tests/_duplex_inputs.py, each in its own state when the batch starts: listening, speaking
mid-turn (seeded sampling, with speech), past several "context" window slides, an omni
session with frames in a turn (with speech too: two sessions' Talker chunks in one batch);
greedy and seeded sampling, forced decisions. Every session has a twin built the same way
that runs alone.

Precision contract: the batch shares the matmuls over the sessions' rows; attention is each
session's own. The ids, decisions, text and speech codes must be equal; every layer's K/V and
the PCM within 1e-5 (fp32 matmuls over more rows sum in another order: the K/V of the
batched twins differ from the alone ones by about 2e-6 here, never enough to flip a token
or a code)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pipeline.checkpoint import ModelSource
from pipeline.duplex import batch
from pipeline.duplex.batch import UnitRequest, run_units
from pipeline.duplex.config import DuplexConfig
from pipeline.duplex.decoder import decode_batch
from pipeline.duplex.session import DuplexSession
from pipeline.duplex.speech import DuplexSpeech, SpeechModels
from pipeline.duplex.thinker import DuplexThinker, reference_special_tokens
from pipeline.thinker.model import ThinkerModel
from pipeline.tokenizer import TextTokenizer
from tests import _duplex_inputs as di

ATOL = 1e-5


@pytest.fixture(scope="module")
def shared():
    from tests._duplex_ckpt import duplex_test_checkpoint

    source = ModelSource.open(str(duplex_test_checkpoint()))
    model = ThinkerModel.load(source, device="cpu", dtype=torch.float32)
    tok = TextTokenizer.from_dir(source.tokenizer_dir)
    return model, tok, reference_special_tokens(source.tokenizer_dir), source


@pytest.fixture(scope="module")
def speech_models(shared):
    return SpeechModels.from_source(shared[3], "cpu")


def make(shared, name: str, speech_models=None, **kw) -> tuple[DuplexSession, list]:
    """A session of a golden script over the shared Thinker model, prepared; its inputs."""
    model, tok, special, _ = shared
    script = di.session(name)
    cfg = DuplexConfig(decode_mode=script.decode_mode, **{**script.duplex_kwargs, **kw})
    th = DuplexThinker(model, tok, cfg, seed=script.seed, special_tokens=special)
    speech = None
    if speech_models is not None:
        speech = DuplexSpeech(speech_models, seed=script.seed, temperature=cfg.tts_temperature,
                              repetition_penalty=cfg.tts_repetition_penalty)
    s = DuplexSession(th, speech)
    s.prepare(di.PREFIX, di.SUFFIX, None, None)
    return s, di.session_inputs(script)


def assert_same(got, want, where: str) -> None:
    assert not isinstance(got, BaseException), f"{where}: {got!r}"
    assert (got.is_listen, got.end_of_turn, got.text) == (
        want.is_listen, want.end_of_turn, want.text), where
    assert got.token_ids == want.token_ids and got.codes == want.codes, where
    assert got.prefill == want.prefill, where
    if want.pcm is None:
        assert got.pcm is None, where
    else:
        assert got.pcm.shape == want.pcm.shape and want.pcm.size > 0, where
        # the Token2Wav engine's padded rows: the PCM within 1 LSB of its int16 round trip
        np.testing.assert_allclose(got.pcm, want.pcm, rtol=0, atol=1 / 32768, err_msg=where)


def assert_same_state(a: DuplexSession, b: DuplexSession, where: str) -> None:
    ta, tb = a.thinker, b.thinker
    assert (ta.context_length, ta.slides, ta.current_turn_ended, ta.decoder.draws) == (
        tb.context_length, tb.slides, tb.current_turn_ended, tb.decoder.draws), where
    # the same draws from the same seed: the generators stand at the same state
    assert torch.equal(ta.generator.get_state(), tb.generator.get_state()), where
    n = ta.context_length
    for ka, kb in zip(ta.kv.snapshot(), tb.kv.snapshot(), strict=True):
        torch.testing.assert_close(ka[:, :n], kb[:, :n], rtol=ATOL, atol=ATOL, msg=where)


def test_units_of_four_sessions_batched_equal_each_session_alone(shared, speech_models,
                                                                 monkeypatch):
    # (script, units run alone first, speech, overrides, force per batched unit)
    specs = [
        ("audio_greedy", 1, False, {}, ["speak", None, None, None, "listen"]),  # listening
        ("audio_sampling", 3, True, {"max_new_speak_tokens_per_chunk": 6}, [None] * 5),
        ("text_context_greedy", 7, False, {}, [None] * 5),  # past context window slides
        ("omni_greedy", 5, True, {}, [None, None, None, "listen", None]),  # frames, mid-turn
    ]
    alone, batched, inputs, starts = [], [], [], []
    for name, start, speaks, kw, _ in specs:
        (a, ins), (b, _) = (make(shared, name, speech_models if speaks else None, **kw)
                            for _ in range(2))
        for audio, frames in ins[:start]:  # the same history for both twins
            a.unit(audio, frames)
            b.unit(audio, frames)
        alone.append(a), batched.append(b), inputs.append(ins), starts.append(start)

    # the sessions enter the batch in different states, with contexts of different lengths
    ths = [s.thinker for s in batched]
    assert ths[0].current_turn_ended and ths[0].units[-1].is_listen and not ths[0].slides
    assert ths[2].slides >= 1 and ths[2].cfg.sliding_window_mode == "context"
    assert not ths[3].current_turn_ended  # in the middle of a turn
    assert len({t.context_length for t in ths}) == 4

    draws = []  # the sessions of each decode_batch call: one call a step for all of them

    def counted(decoders, *args):
        draws.append(len(decoders))
        return decode_batch(decoders, *args)

    monkeypatch.setattr(batch, "decode_batch", counted)
    seen = set()
    for k in range(len(specs[0][4])):
        reqs, want = [], []
        for i, (name, _, _, _, forces) in enumerate(specs):
            audio, frames = inputs[i][starts[i] + k]
            reqs.append(UnitRequest(batched[i], audio, frames, forces[k]))
            want.append(alone[i].unit(audio, frames, forces[k]))
        got = run_units(reqs)
        kinds = set()
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            where = f"{specs[i][0]} unit {starts[i] + k}"
            assert_same(g, w, where)
            assert_same_state(alone[i], batched[i], where)
            kinds.add("listen" if w.is_listen else "end" if w.end_of_turn else "speak")
            if w.codes:
                seen.add("codes")
        if {"listen", "speak"} <= kinds:
            seen.add("listen and speak in one batch")  # sessions leave the loop at different steps
        if sum(bool(w.codes) for w in want) >= 2:
            seen.add("two sessions' Talker draws in one batch")  # speech.speak_batch
        seen |= kinds
    assert {"listen", "speak", "end", "codes", "listen and speak in one batch",
            "two sessions' Talker draws in one batch"} <= seen, seen
    assert ths[2].slides > 1 and ths[0].slides == 0  # a slide inside the batch too
    assert max(draws) >= 3  # greedy and sampling sessions' draws in one call


def test_one_session_through_the_batch_is_the_session_alone(shared):
    """A batch of one runs the exact ops of DuplexSession.unit: identical tensors."""
    (a, ins), (b, _) = (make(shared, "audio_sampling") for _ in range(2))
    for k, (audio, frames) in enumerate(ins[:6]):
        want = a.unit(audio, frames)
        got = run_units([UnitRequest(b, audio, frames)])[0]
        assert_same(got, want, f"unit {k}")
        assert a.thinker.context_length == b.thinker.context_length
        for ka, kb in zip(a.thinker.kv.snapshot(), b.thinker.kv.snapshot(), strict=True):
            assert torch.equal(ka, kb), f"unit {k}"
    assert torch.equal(a.thinker.generator.get_state(), b.thinker.generator.get_state())


def test_a_bad_unit_fails_alone_and_the_others_go_on(shared):
    (a, ins), (b, _) = (make(shared, "audio_greedy") for _ in range(2))
    (c, _), (d, _) = (make(shared, "text_context_greedy") for _ in range(2))
    e, _ = make(shared, "omni_greedy")
    audio, _ = ins[3]
    got = run_units([
        UnitRequest(b, audio),
        UnitRequest(d, np.zeros((2, 8), np.float32)),  # not 1-D
        UnitRequest(e, audio, None, "sideways"),  # not a force
    ])
    assert_same(got[0], a.unit(audio), "the good unit")
    assert isinstance(got[1], ValueError) and "1-D" in str(got[1])
    assert isinstance(got[2], ValueError) and "force" in str(got[2])
    # the refused units left their sessions as they were
    assert d.thinker.context_length == c.thinker.context_length
    assert e.thinker.units == [] and e.units == 0
    with pytest.raises(ValueError, match="one unit in a batch"):
        run_units([UnitRequest(b, audio), UnitRequest(b, audio)])


def test_a_failed_draw_fails_the_sessions_drawing_and_the_others_go_on(shared, monkeypatch):
    (a, ins), (b, _), (c, _) = (make(shared, "audio_greedy") for _ in range(3))

    def broken(*args):
        raise RuntimeError("no draw")

    monkeypatch.setattr(batch, "decode_batch", broken)
    audio, _ = ins[0]
    got = run_units([UnitRequest(a, audio), UnitRequest(b, audio, None, "listen")])
    assert isinstance(got[0], RuntimeError)
    assert_same(got[1], c.unit(audio, None, "listen"), "a forced listen draws nothing")


def test_units_joining_at_any_step_equal_each_session_alone(shared, speech_models):
    """UnitScheduler: units added while others decode or speak join at its next step (a new
    unit is prefilled and decided while another's speech batch is in flight), a session's
    next unit waits until its last is done, and every unit equals its session's alone."""
    specs = [("audio_sampling", 3, True, {"max_new_speak_tokens_per_chunk": 6}, "speak"),
             ("omni_greedy", 5, True, {}, None), ("audio_greedy", 1, False, {}, None),
             ("text_context_greedy", 7, False, {}, None)]
    rounds = 3
    alone, twins, units = [], [], []  # units: (session index, round, request)
    for i, (name, start, speaks, kw, force) in enumerate(specs):
        (a, ins), (b, _) = (make(shared, name, speech_models if speaks else None, **kw)
                            for _ in range(2))
        for audio, frames in ins[:start]:
            a.unit(audio, frames)
            b.unit(audio, frames)
        alone.append(a), twins.append(b)
        units += [(i, k, UnitRequest(b, *ins[start + k], force)) for k in range(rounds)]
    want = {(i, k): alone[i].unit(req.audio, req.frames, req.force) for i, k, req in units}

    sched = batch.UnitScheduler()
    sched.clock = itertools.count().__next__  # every step takes 1: the lanes take turns
    got, log, step = {}, [], [0]

    def tell(what, i, k):
        def fn(r):
            log.append((step[0], what, i, k))
            if what == "done":
                got[i, k] = r
        return fn

    # one unit added a step, round by round: each joins the lanes mid-way
    todo = sorted(units, key=lambda u: (u[1], u[0]))
    while todo or sched.has_work():
        if todo:
            i, k, req = todo.pop(0)
            log.append((step[0], "added", i, k))
            sched.add(req, tell("decided", i, k), tell("done", i, k))
        if sched.has_work():
            sched.step()
        step[0] += 1
    for (i, k), w in want.items():
        assert_same(got[i, k], w, f"{specs[i][0]} round {k}")
    for i in range(len(specs)):
        assert_same_state(alone[i], twins[i], specs[i][0])
    at = {(what, i, k): s for s, what, i, k in log}
    for i, k, _ in units:  # a session's units one after another
        assert at["decided", i, k] <= at["done", i, k]
        if k:
            assert at["done", i, k - 1] <= at["decided", i, k]
    # some unit decided while another's speech (a speak unit's) was in flight
    speech = [(at["decided", i, k], at["done", i, k]) for (i, k), w in want.items() if w.codes]
    assert speech and any(s < at["decided", j, m] < e for s, e in speech for j, m, _ in units)


def test_a_unit_is_prefilled_while_its_sessions_last_unit_speaks(shared, speech_models):
    """A session's next unit, added while its last unit's speech is in flight, is prefilled
    then (its context grows before that speech is done) and draws only after it: both units
    equal the session's alone, and the generator stands where it stands alone."""
    a, ins = make(shared, "audio_sampling", speech_models)
    b, _ = make(shared, "audio_sampling", speech_models)
    for audio, frames in ins[:3]:
        a.unit(audio, frames)
        b.unit(audio, frames)
    want = [a.unit(*ins[3], "speak"), a.unit(*ins[4], "speak")]
    sched = batch.UnitScheduler()
    got, events = {}, []

    def tell(what, k):
        def fn(r):
            events.append((what, k, b.thinker.context_length))
            if what == "done":
                got[k] = r
        return fn

    sched.add(UnitRequest(b, *ins[3], "speak"), tell("decided", 0), tell("done", 0))
    while not events:  # unit 0's Thinker part; its speech is next
        sched.step()
    decided_at = b.thinker.context_length
    sched.add(UnitRequest(b, *ins[4], "speak"), tell("decided", 1), tell("done", 1))
    held = False
    while sched.has_work():
        sched.step()
        held = held or bool(sched._held)
    assert held, "unit 1 waited, prefilled, for unit 0's speech"
    kinds = [(what, k) for what, k, _ in events]
    assert kinds == [("decided", 0), ("done", 0), ("decided", 1), ("done", 1)]
    # unit 1's prefill went into the context before unit 0 was done
    assert events[1][2] > decided_at
    for k in range(2):
        assert_same(got[k], want[k], f"unit {k}")
    assert_same_state(a, b, "after both units")


def test_fail_all_ends_every_unit_in_flight_once(shared, speech_models):
    """UnitScheduler.fail_all (a step failed outside the units' own handling): every unit
    in flight gets the error once, as its decision too where none went out yet, and its
    session takes a next unit."""
    a, ins_a = make(shared, "audio_sampling", speech_models)
    b, ins_b = make(shared, "audio_greedy")
    sched = batch.UnitScheduler()
    told: dict[str, list] = {"a": [], "b": [], "b2": []}

    def add(key, req):
        sched.add(req, lambda r, k=key: told[k].append(("decided", r)),
                  lambda r, k=key: told[k].append(("done", r)))

    add("a", UnitRequest(a, *ins_a[3], "speak"))
    add("b", UnitRequest(b, *ins_b[0], "speak"))
    add("b2", UnitRequest(b, *ins_b[1], "listen"))  # waits for b's first
    while not any(k == "decided" for k, _ in told["a"]):  # a's speech is next
        sched.step()
    assert sched.has_work()
    in_flight = [k for k, got in told.items() if not any(x == "done" for x, _ in got)]
    assert "a" in in_flight and "b2" in in_flight  # a mid-speech, b2 waiting or decoding
    boom = RuntimeError("boom")
    sched.fail_all(boom)
    assert not sched.has_work()
    assert [k for k, _ in told["a"]] == ["decided", "done"] and told["a"][1][1] is boom
    for key, got in told.items():
        kinds = [k for k, _ in got]
        assert kinds.count("done") == 1 and kinds.count("decided") == 1, (key, got)
        assert (got[-1] == ("done", boom)) == (key in in_flight), (key, got)
    # b's session is free again: its next unit runs
    out = run_units([UnitRequest(b, *ins_b[2], "listen")])[0]
    assert not isinstance(out, BaseException) and out.is_listen


def test_new_units_every_step_do_not_starve_the_units_decoding(monkeypatch):
    """UnitScheduler's Thinker lane: a new unit's prefill goes ahead of the units decoding,
    but not twice in a row, so units arriving as fast as the steps run still leave the
    decoding ones every other step (the lanes' work stood in for by counters)."""
    from types import SimpleNamespace

    order = []

    def prefill(self, admitted):
        order.append("P")
        self._new = [r for r in self._new if r not in admitted]
        for r in admitted:
            r.left = 3
        self._thinking += admitted

    def decode(self):
        order.append("D")
        for r in self._thinking:
            r.left -= 1
        self._thinking = [r for r in self._thinking if r.left > 0]

    monkeypatch.setattr(batch.UnitScheduler, "_prefill", prefill)
    monkeypatch.setattr(batch.UnitScheduler, "_decode_step", decode)
    sched = batch.UnitScheduler()
    for _ in range(8):  # a unit of a new session before every step
        sched.add(UnitRequest(SimpleNamespace(thinker=None), None))
        sched.step()
    assert "".join(order) == "PD" * 4
    while sched.has_work():
        sched.step()
    assert "".join(order[8:]) == "PDDD"  # the last unit: its prefill and its three steps


def test_the_lanes_share_the_gpus_time_while_both_have_work(monkeypatch):
    """UnitScheduler: while both lanes have work, the one that has spent less time steps
    next; a lane alone builds no credit (the lanes' work stood in for by counters, a
    Thinker step taking 4 of the clock's ticks, a speech step 1)."""
    from types import SimpleNamespace

    now, order = [0], []

    def decode(self):
        order.append("T")
        now[0] += 4
        if order.count("T") == 6:
            self._thinking = []

    def speech(self):
        order.append("s")
        now[0] += 1
        if order.count("s") == 14:
            self._speech = None

    monkeypatch.setattr(batch.UnitScheduler, "_decode_step", decode)
    monkeypatch.setattr(batch.UnitScheduler, "_speech_step", speech)
    sched = batch.UnitScheduler()
    sched.clock = lambda: now[0]
    sched._thinking = [SimpleNamespace()]
    for _ in range(3):  # the Thinker alone: no credit for the speech lane to repay
        sched.step()
    sched._speech = iter(())  # a speech batch in flight
    while sched.has_work():
        sched.step()
    # T alone x3; then both: a Thinker step of 4 ticks, then 4 speech steps of 1, ...; the
    # speech alone at the end
    assert "".join(order) == "TTT" + "Tssss" * 3 + "ss"


def test_the_thinker_lane_steps_while_token2wav_is_on_the_gpu(monkeypatch):
    """UnitScheduler: while the speech lane's Token2Wav step is in flight (its generator
    yields the step's Landing), the Thinker lane steps (its kernels run beside it); with
    nothing else to step, `step()` waits for the landing a short while (not at all when its
    caller has steps of its own) and returns, and once it has landed the speech lane
    resumes at once (a stand-in landing and lanes)."""
    from types import SimpleNamespace

    order, waits = [], []

    class Landing:
        def ready(self):
            return len(waits) >= 2

        def wait(self, timeout=None):
            order.append("w")
            waits.append(timeout)
            return self.ready()

    landing = Landing()

    def speech():  # as speech._token2wav_steps: launch, then the landing until it is done
        order.append("s")
        while not landing.ready():
            yield landing
        order.append("r")
        yield None
        return []

    def decode(self):
        order.append("T")
        if order.count("T") == 2:
            self._thinking = []

    monkeypatch.setattr(batch.UnitScheduler, "_decode_step", decode)
    sched = batch.UnitScheduler()
    ticks = iter(range(1000))
    sched.clock = lambda: next(ticks)  # every step one tick: the lanes alternate
    sched._thinking = [SimpleNamespace()]
    sched._speech = speech()
    for _ in range(3):
        sched.step()
    sched.step(others=True)  # the caller has steps of its own: no wait
    while sched.has_work():
        sched.step()
    # a Thinker step, the launch, a Thinker step beside it, then only the landing left: a
    # look that finds it running (the caller busy), a wait that sees it land and the speech
    # lane's next step at once
    assert "".join(order) == "TsTwwr"
    assert waits == [0.0, batch.SPEECH_POLL_S]


def test_a_speak_units_text_is_told_as_it_is_drawn(shared):
    """UnitScheduler's `on_text`: a speaking unit's spoken ids as they are drawn, before its
    decision, each a prefix of the next, the last the unit's own; `text_pieces` turns them
    into pieces that join into the unit's text (whole characters only)."""
    from deployments.stages.duplex import text_pieces

    s, ins = make(shared, "audio_greedy")
    tok = shared[1]
    told, pieces, order = [], [], []
    text = text_pieces(tok, pieces.append)
    sched = batch.UnitScheduler()
    sched.add(UnitRequest(s, *ins[0], "speak"), lambda u: order.append(("decided", u)),
              lambda r: order.append(("done", r)),
              lambda ids: (told.append(ids), text(ids), order.append(("text", len(ids)))))
    while sched.has_work():
        sched.step()
    unit = order[-2][1]
    assert [k for k, _ in order[-2:]] == ["decided", "done"] and not unit.is_listen
    assert len(told) >= 2 and all(k == "text" for k, _ in order[:-2])
    for a, b in itertools.pairwise(told):
        assert b[:len(a)] == a and len(b) > len(a)
    assert told[-1] == [i for i, _ in unit.spoken]
    assert "".join(pieces) == unit.text and len(pieces) >= 2

    # a character split over two ids waits for its second
    ids = tok.encode("héllo 你好 wörld")
    pieces.clear()
    text = text_pieces(tok, pieces.append)
    for k in range(1, len(ids) + 1):
        text(ids[:k])
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
