"""Sampling: processors vs plain restatements, greedy = argmax, seeded reproducibility,
and the repetition penalty's history against the reference's streaming decode loop."""

from __future__ import annotations

import math

import pytest
import torch
from _sampling_ref import (  # tests/ is on sys.path
    Sampler,
    apply_repetition_penalty,
    sample_row,
    top_k_mask,
    top_p_mask,
)
from _tiny_lm import random_lm, tiny_llm_config

from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.thinker.llm_engine.graphs import Staging
from pipeline.thinker.llm_engine.sampling import (
    SamplingTensors,
    make_generator,
    pack_rows,
    penalize,
    penalty_history,
    sample_batch,
    sampling_fields,
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


def _reference_filter(
    logits: torch.Tensor,
    banned: list[int],
    penalty: float,
    seen: list[int],
    temperature: float,
    top_k: int,
    top_p: float,
) -> torch.Tensor:
    """One step of ChunkPrefillChunkGenerate.chunk_generate restated (MiniCPM-o 4.5
    utils.py): float32 logits, forbidden ids to -inf, the repetition penalty per distinct
    seen id, temperature, then (sampling) top-k by torch.topk + scatter and its own top-p:
    sort descending, `cumsum(softmax) > top_p` shifted right by one, the first kept."""
    x = logits.to(dtype=torch.float32, copy=True)[None]
    if banned:
        x[:, banned] = float("-inf")
    if penalty != 1.0:
        for t in torch.unique(torch.tensor(seen, dtype=torch.long)):
            x[0, t] = x[0, t] / penalty if x[0, t] > 0 else x[0, t] * penalty
    if temperature != 1.0:
        x = x / temperature
    if top_k > 0:
        vals, idx = torch.topk(x, min(top_k, x.size(-1)))
        x = torch.full_like(x, float("-inf")).scatter_(1, idx, vals)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        remove = torch.cumsum(sorted_x.softmax(-1), dim=-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        x[remove.scatter(1, order, remove)] = float("-inf")
    return x[0]


def _kept(x: torch.Tensor) -> list[int]:
    return [i for i in range(x.numel()) if math.isfinite(x[i])]


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9, 0.999])
def test_top_p_restated(p):
    out = top_p_mask(LOGITS, p)
    probs = LOGITS.softmax(-1).tolist()
    order = sorted(range(8), key=lambda i: -probs[i])
    keep, mass = [], 0.0
    for i in order:  # keep tokens while the mass before them is not over p
        if keep and mass > p:
            break
        keep.append(i)
        mass += probs[i]
    assert _kept(out) == sorted(keep)
    assert _kept(_reference_filter(LOGITS, [], 1.0, [], 1.0, 0, p)) == sorted(keep)
    try:
        from transformers import TopPLogitsWarper
    except ImportError:
        return
    # Away from ties the reference's rule and HF's warper cut at the same token.
    ref = TopPLogitsWarper(p)(None, LOGITS.clone()[None])[0]
    assert torch.equal(torch.isfinite(ref), torch.isfinite(out))


@pytest.mark.parametrize(
    ("logits", "p", "kept"),
    [
        (torch.zeros(8), 0.5, 5),  # mass before the 5th token is exactly 1/2: it stays
        (torch.zeros(8), 0.5 + 1e-9, 5),  # p in float32 is 1/2, as the reference compares
        (torch.zeros(8), 0.25, 3),
        (torch.tensor([0.0] * 4 + [float("-inf")] * 4), 0.75, 4),  # banned-like -inf tail
        (torch.tensor([1.0, 1.0, 0.0, 0.0]), 1.0, 4),
    ],
)
def test_top_p_keeps_the_token_at_an_exact_tie(logits, p, kept):
    out = top_p_mask(logits, p)
    ref = _reference_filter(logits, [], 1.0, [], 1.0, 0, p)
    assert _kept(out) == _kept(ref) and len(_kept(out)) == kept
    try:
        from transformers import TopPLogitsWarper
    except ImportError:
        return
    if kept == 5:  # HF's ascending `cumsum <= 1 - p` drops the tied token: a different rule
        hf = TopPLogitsWarper(p)(None, logits.clone()[None])[0]
        assert int(torch.isfinite(hf).sum()) == 4


@pytest.mark.parametrize("seed", range(6))
def test_sample_row_is_the_reference_step(seed):
    """Bans, penalty, temperature, top-k, top-p in the reference's order: the filtered
    logits equal the restatement's, so the same generator draws the same token."""
    g = torch.Generator().manual_seed(seed)
    vocab = 300
    logits = (torch.randn(vocab, generator=g) * 2).bfloat16()
    seen = torch.randint(0, vocab, (40,), generator=g).tolist()
    top = torch.argsort(logits.float(), descending=True).tolist()
    banned = top[:3] + torch.randint(0, vocab, (30,), generator=g).tolist()
    sp = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3, banned_ids=tuple(banned)
    )
    ref = _reference_filter(logits, banned, 1.3, seen, 0.7, 20, 0.8)
    assert not set(_kept(ref)) & set(banned) and len(_kept(ref)) > 1
    for draw in range(20):
        want = torch.multinomial(ref.softmax(-1), 1, generator=make_generator(draw, "cpu"))
        got = sample_row(logits, sp, torch.tensor(seen), make_generator(draw, "cpu"))
        assert got == int(want), draw
    greedy = SamplingParams(repetition_penalty=1.3, banned_ids=tuple(banned))
    want = int(_reference_filter(logits, banned, 1.3, seen, 1.0, 0, 1.0).argmax())
    assert sample_row(logits, greedy, torch.tensor(seen), None) == want != top[0]


def test_bans_come_before_top_k_and_top_p():
    """The banned best token does not use up a top-k place nor top-p mass: the filters
    see the logits with it already at -inf (banning afterwards would keep fewer)."""
    x = torch.tensor([9.0, 3.0, 2.9, 2.8, -5.0])
    g = make_generator(0, "cpu")
    drawn = {
        sample_row(x, SamplingParams(temperature=1.0, top_k=2, banned_ids=(0,)), x[:0], g)
        for _ in range(200)
    }
    assert drawn == {1, 2}
    drawn = {
        sample_row(x, SamplingParams(temperature=1.0, top_p=0.6, banned_ids=(0,)), x[:0], g)
        for _ in range(200)
    }
    assert drawn == {1, 2}  # 0.37 + 0.34 of the renormalized mass crosses 0.6


def test_banned_ids_are_never_sampled():
    g = make_generator(3, "cpu")
    banned = (3, 7, 0)  # the three largest of LOGITS
    for params in (
        SamplingParams(temperature=5.0, banned_ids=banned),
        SamplingParams(temperature=5.0, top_k=3, top_p=0.9, banned_ids=banned),
        SamplingParams(banned_ids=banned),  # greedy
    ):
        toks = [sample_row(LOGITS, params, torch.tensor([]), g) for _ in range(100)]
        assert not set(toks) & set(banned)
    # In a batch: the plain greedy rows' shared argmax leaves the banned row alone.
    logits = LOGITS.expand(3, -1).clone()
    ps = [SamplingParams(), SamplingParams(banned_ids=banned), SamplingParams()]
    assert Sampler()(logits, ps, [[]] * 3, [None] * 3) == [3, 5, 3]


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


def _reference_stream_greedy(
    logits_at, steps: int, penalty: float, window: int | None, banned: tuple[int, ...] = ()
):
    """MiniCPMO.streaming_generate + ChunkPrefillChunkGenerate.chunk_generate, restated on
    greedy decoding: chunks of 11 then 10 tokens; the forbidden ids go to -inf first (the
    reference's "= model.generate@suppress_tokens": transformers' processor here); inside a
    chunk the penalty sees `generated_ids[:, -128:]` (ids of the earlier chunks) + the
    chunk's own ids, and is applied by transformers' processor. `logits_at(out)` gives the
    (V,) logits after the ids `out` were generated. Returns the ids and the banned and
    penalized logits of every step."""
    from transformers import RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(penalty)
    suppress = SuppressTokensLogitsProcessor(list(banned)) if banned else None
    generated = torch.empty((1, 0), dtype=torch.long)
    out: list[int] = []
    scores: list[torch.Tensor] = []
    first = True
    while len(out) < steps:
        chunk: list[int] = []
        for _ in range(min(10 + first, steps - len(out))):
            before = generated if window is None else generated[:, -window:]
            seen = torch.cat([before, torch.tensor([chunk], dtype=torch.long)], dim=1)
            x = logits_at(out).float()[None].clone()
            if suppress is not None:
                x = suppress(seen, x)
            s = proc(seen, x)[0]
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
    staged = Staging(sampling_fields(1, vocab), torch.device("cpu"))  # the batched sampler's inputs
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

TINY = tiny_llm_config(vocab_size=64, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny_lm() -> Qwen3LM:
    return random_lm(TINY, std=0.3)


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
            EngineConfig(num_blocks=128, block_size=4),
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


def test_engine_bans_before_the_penalty_every_step(tiny_lm):
    """Greedy with a banned set that the unbanned run would emit: the engine's ids are the
    reference loop's (bans, then the windowed penalty), and no banned id appears."""
    pytest.importorskip("transformers")
    prompt = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    steps, penalty = 120, 2.0
    at = _dense_next_logits(tiny_lm, prompt)
    free, _ = _reference_stream_greedy(at, steps, penalty, 16)
    banned = tuple(sorted(set(free[:12])))
    want, _ = _reference_stream_greedy(at, steps, penalty, 16, banned)
    eng = LLMEngine(tiny_lm, EngineConfig(num_blocks=128, block_size=4))
    sp = SamplingParams(
        max_tokens=steps,
        stop_ids=(),
        repetition_penalty=penalty,
        repetition_window=16,
        banned_ids=banned,
    )
    got = eng.generate({"r": prompt}, sp)["r"]
    assert got == want, f"first diff at {_first_diff(got, want)}"
    assert not set(got) & set(banned) and got != free
