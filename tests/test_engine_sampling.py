"""Sampling: processors vs plain restatements, greedy = argmax, seeded reproducibility,
and the repetition penalty's history against the reference's streaming decode loop."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import LLMConfig
from pipeline.engine.engine import EngineConfig, LLMEngine
from pipeline.engine.graphs import Staging
from pipeline.engine.sampling import (
    Sampler,
    SamplingTensors,
    apply_repetition_penalty,
    make_generator,
    pack_rows,
    penalize,
    penalty_history,
    sample_batch,
    sample_row,
    sampling_fields,
    top_k_mask,
    top_p_mask,
)
from pipeline.handoff import SamplingParams
from pipeline.thinker.llm import Qwen3LM

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 2.5])


def test_repetition_penalty_hf_semantics():
    out = apply_repetition_penalty(LOGITS, torch.tensor([0, 1, 1, 6]), 2.0)
    want = LOGITS.tolist()
    for i in (0, 1, 6):
        want[i] = want[i] / 2.0 if want[i] > 0 else want[i] * 2.0
    assert out.tolist() == want
    assert LOGITS[0] == 2.0  # input untouched
    try:
        from transformers import RepetitionPenaltyLogitsProcessor
    except ImportError:
        return
    ids = torch.tensor([[3, 4, 4, 0]])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, LOGITS.clone()[None])[0]
    assert torch.equal(apply_repetition_penalty(LOGITS, ids[0], 1.3), ref)


def test_top_k_restated():
    out = top_k_mask(LOGITS, 3)
    keep = sorted(range(8), key=lambda i: -LOGITS[i])[:3]
    assert [i for i in range(8) if math.isfinite(out[i])] == sorted(keep)
    assert torch.equal(top_k_mask(LOGITS, 0), LOGITS)


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9, 0.999])
def test_top_p_restated(p):
    out = top_p_mask(LOGITS, p)
    probs = LOGITS.softmax(-1).tolist()
    order = sorted(range(8), key=lambda i: -probs[i])
    keep, mass = [], 0.0
    for i in order:  # smallest prefix whose mass reaches p
        keep.append(i)
        mass += probs[i]
        if mass >= p:
            break
    assert [i for i in range(8) if math.isfinite(out[i])] == sorted(keep)
    try:
        from transformers import TopPLogitsWarper
    except ImportError:
        return
    ref = TopPLogitsWarper(p)(None, LOGITS.clone()[None])[0]
    assert torch.equal(torch.isfinite(ref), torch.isfinite(out))


def test_greedy_is_exact_argmax_in_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
    ]
    hist = [[1, 2]] * 5
    out = Sampler()(logits, params, hist, [make_generator(p.seed, "cpu") for p in params])
    for i in (0, 2, 4):
        assert out[i] == int(logits[i].argmax())
    assert out[3] == int(apply_repetition_penalty(logits[3], torch.tensor([1, 2]), 1.5).argmax())


def test_seeded_sampling_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 500)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    draws = []
    for batch_rows in ([0], [1, 0, 2]):  # the same request alone and batched with others
        g = make_generator(1234, "cpu")
        other = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=9)]
        toks = []
        for _ in range(20):
            ps = [sp if r == 0 else other[r - 1] for r in batch_rows]
            gens = [g if r == 0 else make_generator(p.seed, "cpu") for r, p in zip(batch_rows, ps)]
            res = Sampler()(logits[batch_rows], ps, [[]] * len(ps), gens)
            toks.append(res[batch_rows.index(0)])
        draws.append(toks)
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1  # it really samples


def test_sampled_tokens_respect_filters():
    g = make_generator(0, "cpu")
    allowed = {3, 7}  # top-2 of LOGITS
    for _ in range(50):
        tok = sample_row(LOGITS, SamplingParams(temperature=2.0, top_k=2), torch.tensor([]), g)
        assert tok in allowed
    for _ in range(50):  # p tiny: only the top token survives
        assert (
            sample_row(LOGITS, SamplingParams(temperature=1.0, top_p=0.01), torch.tensor([]), g)
            == 3
        )


# ---------------------------------------------------------------------------------------
# Repetition penalty history: the reference's streaming decode, restated


def _reference_stream_greedy(logits_at, steps: int, penalty: float, window: int | None):
    """MiniCPMO.streaming_generate + ChunkPrefillChunkGenerate.chunk_generate, restated on
    greedy decoding: chunks of 11 then 10 tokens; inside a chunk the penalty sees
    `generated_ids[:, -128:]` (ids of the earlier chunks) + the chunk's own ids, and is
    applied by transformers' processor. `logits_at(out)` gives the (V,) logits after the
    ids `out` were generated. Returns the ids and the penalized logits of every step."""
    from transformers import RepetitionPenaltyLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(penalty)
    generated = torch.empty((1, 0), dtype=torch.long)
    out: list[int] = []
    scores: list[torch.Tensor] = []
    first = True
    while len(out) < steps:
        chunk: list[int] = []
        for _ in range(min(10 + first, steps - len(out))):
            before = generated if window is None else generated[:, -window:]
            seen = torch.cat([before, torch.tensor([chunk], dtype=torch.long)], dim=1)
            s = proc(seen, logits_at(out).float()[None].clone())[0]
            scores.append(s)
            chunk.append(int(s.argmax()))
            out.append(chunk[-1])
        generated = torch.cat([generated, torch.tensor([chunk], dtype=torch.long)], dim=1)
        first = False
    return out, scores


def _random_logits(vocab: int, seed: int):
    table = torch.randn(400, vocab, generator=torch.Generator().manual_seed(seed))
    return lambda out: table[len(out)]


@pytest.mark.parametrize("window", [128, 7, None])
def test_penalty_history_matches_reference_stream_loop(window):
    pytest.importorskip("transformers")
    vocab, steps, penalty = 160, 300, 3.0
    logits_at = _random_logits(vocab, 0)
    ref_ids, ref_scores = _reference_stream_greedy(logits_at, steps, penalty, window)
    params = SamplingParams(repetition_penalty=penalty, repetition_window=window)
    staged = Staging(sampling_fields(1), torch.device("cpu"))  # the batched sampler's inputs
    for n in range(steps):
        out = ref_ids[:n]
        hist = torch.tensor(penalty_history(out, window), dtype=torch.long)
        got = apply_repetition_penalty(logits_at(out), hist, penalty)
        assert torch.equal(got, ref_scores[n]), f"step {n}"
        assert Sampler()(logits_at(out)[None], [params], [out], [None]) == [ref_ids[n]]
        pack_rows(staged.host, [params], [out], vocab)
        staged.upload()
        t = SamplingTensors.view(staged.dev, torch.ones(1, vocab), 1)
        batched = penalize(logits_at(out)[None], t.history, t.penalty)[0]
        assert torch.equal(batched, ref_scores[n]), f"batched, step {n}"
        assert sample_batch(logits_at(out)[None], t, sampled=False).tolist() == [ref_ids[n]]
    if window is not None:  # the window is live in this run: without it the ids differ
        assert ref_ids != _reference_stream_greedy(logits_at, steps, penalty, None)[0]
    if window == 7:
        # The rule is chunk-aligned, not a plain sliding window: at the last token of a
        # chunk the history reaches back window + 9 ids.
        assert penalty_history(ref_ids[:30], 7) == ref_ids[21 - 7 : 30]
        assert len(penalty_history(ref_ids[:21], 7)) == 7


def test_penalty_history_chunks_and_window():
    ids = list(range(1000, 1300))
    assert penalty_history(ids[:0], 128) == []
    assert penalty_history(ids[:11], 128) == ids[:11]  # first chunk is 11 long
    assert penalty_history(ids[:130], 128) == ids[:130]
    assert penalty_history(ids[:131], 128) == ids[3:131]  # chunk [131, 141) starts
    assert penalty_history(ids[:140], 128) == ids[3:140]
    assert penalty_history(ids[:141], 128) == ids[13:141]
    assert penalty_history(ids[:300], None) == ids[:300]
    with pytest.raises(ValueError, match="repetition_window"):
        SamplingParams(repetition_window=0)


def test_penalty_applies_once_per_distinct_id():
    once = apply_repetition_penalty(LOGITS, torch.tensor([3, 1]), 1.5)
    many = apply_repetition_penalty(LOGITS, torch.tensor([3, 3, 3, 1, 1]), 1.5)
    assert torch.equal(once, many)
    assert once[3] == LOGITS[3] / 1.5 and once[1] == LOGITS[1] * 1.5
    # the batched rule: a mark per distinct id, padding (id V) and penalty-1 rows inert
    pad = LOGITS.numel()
    hist = torch.tensor([[3, 3, 3, 1, 1, pad], [3, 1, pad, pad, pad, pad], [3, 1, 2, 5, 0, 7]])
    got = penalize(LOGITS.expand(3, -1), hist, torch.tensor([1.5, 1.5, 1.0]))
    assert torch.equal(got[0], once) and torch.equal(got[1], once)
    assert torch.equal(got[2], LOGITS)


# ---------------------------------------------------------------------------------------
# The engine penalizes generated ids only (never the prompt), through the window

TINY = LLMConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def tiny_lm() -> Qwen3LM:
    torch.manual_seed(0)
    m = Qwen3LM(TINY).eval()
    with torch.no_grad():
        for p in m.parameters():  # larger weights: logits far apart, greedy is stable
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return m


def _dense_next_logits(model: Qwen3LM, prompt: list[int]):
    """Logits after prompt + out from a plain no-cache forward over the whole sequence."""

    @torch.no_grad()
    def at(out: list[int]) -> torch.Tensor:
        ids = torch.tensor(prompt + out)
        hidden = model(model.embed(ids), torch.arange(len(ids)))
        return model.compute_logits(hidden[-1:])[0]

    return at


def test_engine_penalizes_generated_ids_only(tiny_lm):
    pytest.importorskip("transformers")
    prompt = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    steps, penalty = 150, 4.0
    at = _dense_next_logits(tiny_lm, prompt)
    results = {}
    for window in (16, None):
        eng = LLMEngine(
            tiny_lm,
            EngineConfig(num_blocks=128, block_size=4, attention_backend="torch"),
        )
        sp = SamplingParams(
            max_tokens=steps, stop_ids=(), repetition_penalty=penalty, repetition_window=window
        )
        got = eng.generate({"r": prompt}, sp)["r"]
        want, _ = _reference_stream_greedy(at, steps, penalty, window)
        assert got == want, f"window {window}: first diff at {_first_diff(got, want)}"
        results[window] = got
    # Both rules are live in this run: the window truncates, and prompt ids would matter.
    assert results[16] != results[None]
    with_prompt = _greedy_penalizing_prompt_too(at, prompt, steps, penalty)
    assert with_prompt != results[None]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _greedy_penalizing_prompt_too(at, prompt, steps, penalty):
    out: list[int] = []
    for _ in range(steps):
        logits = apply_repetition_penalty(at(out), torch.tensor(prompt + out), penalty)
        out.append(int(logits.argmax()))
    return out
