"""Talker sampler vs a plain restatement of the reference procedure (gen_logits +
CustomRepetitionPenaltyLogitsProcessorRepeat + the generate loop), on fixed logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from pipeline.talker.sampling import (
    CodeSampler,
    SamplerState,
    TalkerSamplingParams,
    draw,
    process_logits,
    top_k_filter,
    top_p_filter,
)

V = 40
EOS = V - 1


def ref_penalty(history: torch.Tensor, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """CustomRepetitionPenaltyLogitsProcessorRepeat(penalty, V, 16), restated."""
    if history.size(1) > 16:
        history = history[:, -16:]
    freq = F.one_hot(history, scores.size(1)).sum(1)
    alpha = torch.pow(penalty, freq)
    return torch.where(scores < 0, scores * alpha, scores / alpha)


def ref_process(
    row: torch.Tensor, history: list[int], t: int, min_new: int, p: TalkerSamplingParams
) -> torch.Tensor:
    """One stream's step of `MiniCPMTTS.generate` up to the softmax (t = draws so far)."""
    logits = row[None].clone()
    logits /= torch.tensor([p.temperature], dtype=torch.float).view(-1, 1)
    if history:  # the reference's `audio_bos` (first draw) skips processors and warpers
        ids = torch.tensor([history])
        logits = ref_penalty(ids, logits, p.repetition_penalty)
        logits = TopPLogitsWarper(p.top_p, min_tokens_to_keep=3)(ids, logits)
        logits = TopKLogitsWarper(p.top_k, min_tokens_to_keep=3)(ids, logits)
    if t < min_new:
        logits[:, EOS] = -torch.inf
    return logits[0]


def state_for(histories: list[list[int]], steps: list[int], min_new: list[int]) -> SamplerState:
    state = SamplerState.empty(len(histories), 16, V, torch.device("cpu"))
    for i, h in enumerate(histories):
        tail = h[-16:]
        if tail:
            state.history[i, 16 - len(tail) :] = torch.tensor(tail)
        state.count[i] = len(tail)
        state.steps[i] = steps[i]
        state.min_new[i] = min_new[i]
    return state


def fixed_logits(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 2.5
    logits[0, :5] = torch.tensor([9.0, -3.0, 0.5, 9.0, -0.0])  # a tie and a signed zero
    return logits


@pytest.mark.parametrize(
    "params",
    [
        TalkerSamplingParams(),  # released: temp 0.8, top_p 0.85, top_k 25, rep 1.05
        TalkerSamplingParams(temperature=1.3, top_p=0.3, top_k=4, repetition_penalty=1.5),
        TalkerSamplingParams(temperature=0.5, top_p=0.0, top_k=1, repetition_penalty=0.8),
        TalkerSamplingParams(temperature=0.9, top_p=1.0, top_k=2, repetition_penalty=2.0),
    ],
    ids=["released", "strong", "min-keep-both", "topk2"],
)
def test_process_logits_matches_reference_order(params):
    histories = [
        [],  # first draw: temperature only (+ EOS mask)
        [1, 3, 3, 7],
        [2] * 20 + [5, 6, 0, 0, 1],  # longer than the 16-code window
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0],
        [],  # first draw in streaming mode (no EOS mask)
    ]
    steps = [0, 4, 30, 17, 0]
    min_new = [50, 50, 20, 0, 0]
    logits = fixed_logits(0, len(histories))
    sampler = CodeSampler(params, V, EOS, torch.device("cpu"))
    state = state_for(histories, steps, min_new)
    got = process_logits(logits, state, params, sampler.temperature, sampler.eos_column)
    for i, h in enumerate(histories):
        expected = ref_process(logits[i], h, steps[i], min_new[i], params)
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(got[i]), kept), f"row {i}: kept sets differ"
        diff = (got[i][kept] - expected[kept]).abs()
        assert diff.max().item() == 0.0, (
            f"row {i}: max diff {diff.max():.3e} mean {diff.mean():.3e}"
        )


def test_min_keep_edge_cases():
    dominant = torch.full((1, V), -5.0)
    dominant[0, 7] = 30.0  # top-p alone would keep 1 token
    dominant[0, 3], dominant[0, 11] = 1.0, 0.5
    kept = torch.isfinite(top_p_filter(dominant, 0.85, 3))
    assert kept.sum() == 3 and kept[0, [7, 3, 11]].all()
    assert torch.isfinite(top_p_filter(dominant, 0.0, 3)).sum() == 3  # top_p 0 still keeps 3
    assert torch.isfinite(top_k_filter(dominant, 1, 3)).sum() == 3  # k = max(1, 3)
    ties = torch.zeros(1, V)
    ties[0, :5] = 2.0
    assert torch.isfinite(top_k_filter(ties, 3, 3)).sum() == 5  # ties at the k-th stay


def test_draw_is_a_faithful_multinomial_and_greedy_is_argmax():
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]])
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    n = 20000
    noise = torch.empty(n, 5).exponential_(generator=g)
    codes = draw(logits.expand(n, 5), noise, greedy=False)
    freq = torch.bincount(codes, minlength=5).float() / n
    assert (freq - probs[0]).abs().max() < 0.015, f"frequencies {freq.tolist()}"
    assert freq[4] == 0
    assert draw(logits, torch.ones(1, 5), greedy=True).item() == 0


def test_sampler_updates_history_and_skips_eos():
    params = TalkerSamplingParams(temperature=0.0)  # greedy: draws are the argmax
    sampler = CodeSampler(params, V, EOS, torch.device("cpu"))
    state = SamplerState.empty(2, 16, V, torch.device("cpu"))
    active = torch.tensor([True, False])
    drawn = []
    for code in [4, 9, EOS, 4] + list(range(20, 35)):
        logits = torch.zeros(2, V)
        logits[:, code] = 50.0
        drawn.append(sampler(logits, state, active)[0].item())
    assert drawn[:4] == [4, 9, EOS, 4]
    kept = [4, 9, 4] + list(range(20, 35))  # EOS never enters the penalty window
    assert state.history[0].tolist() == kept[-16:]
    assert state.count.tolist() == [16, 0] and state.steps.tolist() == [19, 0]
    assert state.history[1].abs().sum() == 0  # inactive row untouched


def test_sampler_matches_reference_draws_with_same_noise():
    """End to end per step: same logits + same noise -> same code as the restated loop."""
    params = TalkerSamplingParams()
    sampler = CodeSampler(params, V, EOS, torch.device("cpu"))
    state = SamplerState.empty(1, 16, V, torch.device("cpu"))
    state.min_new[0] = 5
    gen = torch.Generator().manual_seed(3)
    ref_gen = torch.Generator().manual_seed(3)
    logits_gen = torch.Generator().manual_seed(4)
    history: list[int] = []
    for t in range(60):
        logits = torch.randn(1, V, generator=logits_gen) * 2
        state.noise[0].exponential_(generator=gen)
        code = sampler(logits, state, torch.ones(1, dtype=torch.bool))[0].item()
        probs = torch.softmax(ref_process(logits[0], history, t, 5, params), dim=-1)
        ref_noise = torch.empty(V).exponential_(generator=ref_gen)
        assert code == (probs / ref_noise).argmax().item(), f"draw {t}"
        if code != EOS:
            history.append(code)
