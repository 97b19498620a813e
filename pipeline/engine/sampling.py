"""Per-request sampling over a batch of logits rows.

Order of operations for each row (HF `generate` order for these processors):
  repetition penalty (over prompt + output ids) -> temperature -> top-k -> top-p -> draw.
Greedy rows (temperature 0) take the argmax of the penalized logits; with penalty 1 that
is exactly argmax of the raw logits. Draws use the request's own torch.Generator when it
asked for a seed, so a seeded request reproduces regardless of what it is batched with.
"""

from __future__ import annotations

import torch

from pipeline.handoff import SamplingParams


def apply_repetition_penalty(
    logits: torch.Tensor, ids: torch.Tensor, penalty: float
) -> torch.Tensor:
    """HF semantics: for every id seen, positive logits are divided by the penalty and
    negative ones multiplied. logits: (V,), ids: (N,) int64. Returns a new tensor."""
    if penalty == 1.0 or ids.numel() == 0:
        return logits
    out = logits.clone()
    ids = ids.unique()
    picked = out[ids]
    out[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest (ties at the threshold kept, as HF does); others -> -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    thresh = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < thresh, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of top tokens whose probability sum reaches p
    (the token that crosses p is kept; at least one token always survives)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    # Drop a token when the mass strictly before it already reaches p.
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    history: torch.Tensor,
    generator: torch.Generator | None,
) -> int:
    """One token from one row of logits (V,). `history` = prompt + output ids (N,)."""
    logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    logits = top_k_mask(logits, params.top_k)
    logits = top_p_mask(logits, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Batch sampler. Rows that are all plain greedy share one argmax; the rest go row by
    row (per-request penalty, temperature, top-k/p and generator)."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        histories: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        out: list[int | None] = [None] * len(params)
        plain = [i for i, p in enumerate(params) if p.greedy and p.repetition_penalty == 1.0]
        if plain:
            idx = torch.tensor(plain, device=logits.device)
            for i, tok in zip(plain, torch.argmax(logits[idx], dim=-1).tolist()):
                out[i] = tok
        for i, p in enumerate(params):
            if out[i] is None:
                hist = torch.tensor(histories[i], dtype=torch.long, device=logits.device)
                out[i] = sample_row(logits[i], p, hist, generators[i])
        return out  # type: ignore[return-value]
