"""The duplex encoders batched across sessions: every session's audio unit through the
streaming audio encoder in one pass (`audio_stream.encode_batch`) and every session's frames
through the vision encoder in one call (`thinker.plan_prefill_batch`) equal each session
alone.

Sessions in different states: one that started at the first unit, one that started later
(a shorter encoder past, and its first unit's shorter mel in the same pass as the others'),
one whose next unit passes the encoder's positions (the encoder cache restarts inside the
batch), and units of different lengths (padded queries and keys). The reset point is 29
units in (1500 positions, 50 frames a unit): cheap for the encoder alone, so the encoder
tests reach it by units; the session test primes that session's encoder with the same units
(running 29 whole units of both twins would cost more than this file's budget).

Precision contract (CPU fp32): the batch shares the convs, norms, projections and MLPs over
more rows and pads the attention, so values move in their last bits only; tokens, decisions
and schemas are equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.checkpoint import ModelSource
from pipeline.duplex.audio_stream import StreamingAudioEncoder, StreamingMel, encode_batch
from pipeline.duplex.config import DuplexConfig
from pipeline.duplex.thinker import DuplexThinker, plan_prefill_batch, reference_special_tokens
from pipeline.thinker.model import ThinkerModel
from pipeline.tokenizer import TextTokenizer
from tests import _duplex_inputs as di

TOL = dict(rtol=1e-5, atol=1e-6)
UNITS_TO_RESET = 29  # 29 * 50 frames + the next unit's 52 pass 1500 positions


@pytest.fixture(scope="module")
def shared():
    from tests._duplex_ckpt import duplex_test_checkpoint

    source = ModelSource.open(str(duplex_test_checkpoint()))
    model = ThinkerModel.load(source, device="cpu", dtype=torch.float32)
    tok = TextTokenizer.from_dir(source.tokenizer_dir)
    return model, tok, reference_special_tokens(source.tokenizer_dir)


def unit_mels(n: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """(mel, prefix frames) of a session's first n units, as the session cuts them."""
    mel = StreamingMel(1000, 1035, 20)
    out = []
    for i in range(n):
        audio = di.unit_audio("L" if i % 3 else "q", i, seed)
        if i == 0:  # the session left-pads its first unit to 1035 ms
            audio = np.concatenate([np.zeros(560, np.float32), audio])
        out.append((mel.push(audio[: mel.chunk_size()]), 0 if i == 0 else 2))
    return out


def twins(model, mels) -> tuple[StreamingAudioEncoder, StreamingAudioEncoder]:
    """Two encoders that ran the same units alone."""
    pair = StreamingAudioEncoder(model.audio), StreamingAudioEncoder(model.audio)
    for e in pair:
        for mel, prefix in mels:
            e.encode(mel, prefix, 2)
    return pair


def assert_same_past(a: StreamingAudioEncoder, b: StreamingAudioEncoder, where: str) -> None:
    assert a.past == b.past, where
    for ka, kb in zip(a.k + a.v, b.k + b.v, strict=True):
        torch.testing.assert_close(kb, ka, **TOL, msg=where)


def test_one_encoder_pass_over_sessions_with_different_pasts_equals_each_alone(shared):
    model = shared[0]
    early = unit_mels(8, seed=1)  # started at the first unit
    late = unit_mels(4, seed=2)  # started three units later
    long = unit_mels(UNITS_TO_RESET + 3, seed=3)  # its next unit restarts the encoder cache
    fresh = unit_mels(3, seed=4)  # its first unit comes with the others' later ones
    sessions = [  # (units before the batch, the batch's units)
        (early[:5], early[5:]),
        (late[:2], late[2:] + [late[1]]),
        (long[:UNITS_TO_RESET], long[UNITS_TO_RESET:]),
        ([], fresh),
    ]
    pairs = [twins(model, before) for before, _ in sessions]
    assert len({b.past for _, b in pairs}) == 4
    assert pairs[2][1].past == 50 * UNITS_TO_RESET

    for step in range(3):
        mels = [units[step] for _, units in sessions]
        want = [a.encode(mel, prefix, 2) for (a, _), (mel, prefix) in zip(pairs, mels)]
        got = encode_batch([b for _, b in pairs], [m for m, _ in mels], [p for _, p in mels],
                           [2] * len(mels))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            where = f"session {i} step {step}"
            assert g.shape == w.shape == (10, model.cfg.llm.hidden_size), where
            torch.testing.assert_close(g, w, **TOL, msg=where)
            assert_same_past(*pairs[i], where)
        if step == 0:
            assert pairs[2][1].past == 50  # the cache restarted inside the batch
            assert {m.shape[-1] for m, _ in mels} == {102, 104}  # two conv groups


def test_units_of_different_lengths_pad_their_queries(shared):
    """Units of other lengths than a session's 1 s (the pass takes any mel): the queries and
    keys are padded per session and its rows come back unpadded."""
    model = shared[0]
    mels = unit_mels(3, seed=5)
    short = mels[2][0][:, :64]  # 30 encoder frames after the cut
    pairs = [twins(model, mels[:1]), twins(model, mels[:2]), twins(model, [])]
    batch = [(mels[1][0], 2), (short, 2), (mels[0][0], 0)]
    want = [a.encode(m, p, 2) for (a, _), (m, p) in zip(pairs, batch)]
    got = encode_batch([b for _, b in pairs], [m for m, _ in batch], [p for _, p in batch],
                       [2, 2, 2])
    assert [g.shape[0] for g in got] == [10, 6, 10]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **TOL, msg=f"session {i}")
        assert_same_past(*pairs[i], f"session {i}")
    assert [b.past for _, b in pairs] == [100, 130, 50]


def test_encode_batch_refuses_what_it_cannot_run(shared):
    model = shared[0]
    e = StreamingAudioEncoder(model.audio)
    mel, _ = unit_mels(1, seed=6)[0]
    with pytest.raises(ValueError, match="one unit in a batch"):
        encode_batch([e, e], [mel, mel], [0, 0], [2, 2])
    with pytest.raises(ValueError, match="one mel"):
        encode_batch([e], [mel, mel], [0], [2])
    assert e.past == 0 and e.k is None


def make_thinker(shared, seed: int) -> DuplexThinker:
    model, tok, special = shared
    script = di.session("omni_greedy")
    cfg = DuplexConfig(decode_mode="greedy", **script.duplex_kwargs)
    th = DuplexThinker(model, tok, cfg, seed=seed, special_tokens=special)
    th.prepare(di.PREFIX, di.SUFFIX)
    return th


@torch.inference_mode()
def run_unit(th: DuplexThinker, plan) -> list[int]:
    """The rest of a planned unit, alone: its rows into the KV, then the decision and tokens."""
    hidden = th.kv.forward(plan.rows)
    th.finish_prefill(plan, th._logits(hidden[-1]) if plan.ok else None)
    return th.generate_unit().token_ids


def test_omni_units_of_sessions_planned_together_equal_each_alone(shared):
    """Omni sessions' frames (one of several slices) in one vision call and their audio in
    one encoder pass: the planned rows equal each session's alone and so do the tokens."""
    model = shared[0]
    seeds = (11, 12, 13)
    inputs = [di.session_inputs(di.SessionScript(f"s{s}", "greedy", s, frames=True))
              for s in seeds]
    big = [di.unit_frame(k, (672, 336), seed=3) for k in range(3)]  # several slices each
    pairs = [(make_thinker(shared, s), make_thinker(shared, s)) for s in seeds]
    history = (4, 1, 2)  # units before the batch: the second session started later
    for (a, b), ins, n in zip(pairs, inputs, history):
        for audio, frames in ins[:n]:
            for th in (a, b):
                th.prefill_unit(audio, frames)
                th.generate_unit()
    # the third session's encoder at the reset point (see the module docstring)
    for mel, prefix in unit_mels(UNITS_TO_RESET + 1, seed=7)[history[2] + 1:]:
        for th in pairs[2]:
            th.audio_encoder.encode(mel, prefix, 2)
    assert pairs[2][0].audio_encoder.past == 50 * UNITS_TO_RESET
    assert len({b.audio_encoder.past for _, b in pairs}) == 3

    seen_slices = set()
    for k in range(3):
        units = []
        for i, ins in enumerate(inputs):
            audio, frames = ins[history[i] + k]
            if i == 1:
                frames, slices = [big[k], frames[0]], [4, 1]
            else:
                slices = 1
            units.append((audio, frames, slices))
        want = [a.plan_prefill(*u) for (a, _), u in zip(pairs, units)]
        got = plan_prefill_batch([(b, *u) for (_, b), u in zip(pairs, units)])
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            where = f"session {i} unit {k}"
            assert not isinstance(g, BaseException), f"{where}: {g!r}"
            assert (g.ok, g.mode, g.schema) == (w.ok, w.mode, w.schema), where
            assert g.ok and g.mode == "OMNI", where
            torch.testing.assert_close(g.rows, w.rows, **TOL, msg=where)
            seen_slices.add(sum(1 for x in g.schema if x == model.cfg.tokens.slice))
            assert run_unit(pairs[i][1], g) == run_unit(pairs[i][0], w), where
            assert pairs[i][0].context_length == pairs[i][1].context_length, where
            assert_same_past(pairs[i][0].audio_encoder, pairs[i][1].audio_encoder, where)
        if k == 0:
            assert pairs[2][1].audio_encoder.past == 50  # restarted inside the batch
    assert max(seen_slices) > 0  # the big frames were sliced


def test_bad_input_fails_its_own_unit_before_touching_its_session(shared):
    (a, b), (c, d) = ((make_thinker(shared, s), make_thinker(shared, s)) for s in (21, 22))
    e = make_thinker(shared, 23)
    audio, frames = di.session_inputs(di.SessionScript("s", "greedy", 21, frames=True))[0]
    before = (e.context_length, e.audio_encoder.past, len(e.audio_buffer), e.unit_start)
    got = plan_prefill_batch([
        (b, audio, frames, 1),
        (d, audio, ["not an image"], 1),
        (e, np.full(16000, np.nan, np.float32), frames, 1),
        (c, None, None, 1),
    ])
    want = a.plan_prefill(audio, frames)
    torch.testing.assert_close(got[0].rows, want.rows, **TOL)
    assert isinstance(got[1], ValueError) and "frame" in str(got[1])
    assert isinstance(got[2], ValueError) and "NaN" in str(got[2])
    assert got[3] is None  # nothing to prefill
    assert (e.context_length, e.audio_encoder.past, len(e.audio_buffer), e.unit_start) == before
    assert d.audio_encoder.past == 0 and d.audio_chunk_idx == 0 and d.unit_start is None
