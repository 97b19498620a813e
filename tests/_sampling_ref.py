"""The host sampler, one row at a time (a few host syncs a row): the reference the batched
`sample_batch` (pipeline/thinker/llm_engine/sampling.py) is tested against, bit for bit."""

from __future__ import annotations

import torch

from pipeline.handoff import SamplingParams
from pipeline.thinker.llm_engine.sampling import _banned, penalty_history, top_p_threshold


def apply_bans(logits: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    """logits (V,) with every id of `ids` at -inf (a new tensor when there is one)."""
    if not ids:
        return logits
    index = torch.from_numpy(_banned(ids, logits.shape[-1])[0]).to(logits.device)
    return logits.index_fill(-1, index, float("-inf"))


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
    # A tensor divisor divides exactly on every device, as the batched `penalize` does;
    # CUDA would multiply by the reciprocal of a Python scalar (1 ulp apart at times).
    pen = torch.full((), penalty, dtype=out.dtype, device=out.device)
    out[ids] = torch.where(picked > 0, picked / pen, picked * pen)
    return out


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest (ties at the threshold kept, as HF does); others -> -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    thresh = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < thresh, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus, the reference's rule: keep the top tokens until the mass before a token is
    over p (a token whose mass before equals p stays; the first token always does)."""
    p = top_p_threshold(p)
    if p >= 1.0:
        return logits
    # Ties in index order and an exact float64 mass: the same cut as `sample_batch`.
    sorted_logits, order = torch.sort(logits, descending=True, stable=True)
    probs = sorted_logits.softmax(-1).double()
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before > p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    history: torch.Tensor,
    generator: torch.Generator | None,
) -> int:
    """One token from one row of logits (V,). `history`: the ids to penalize (N,), the
    request's `penalty_history`."""
    logits = apply_bans(logits.float(), params.banned_ids)
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits))
    temperature = torch.full((), params.temperature, dtype=logits.dtype, device=logits.device)
    logits = logits / temperature  # a tensor divisor, as for the penalty
    logits = top_k_mask(logits, params.top_k)
    logits = top_p_mask(logits, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Batch sampler. Rows that are all plain greedy (no bans, no penalty) share one argmax;
    the rest go row by row (per-request bans, penalty, temperature, top-k/p and generator).
    `outputs[i]` are the ids row i's request generated so far (no prompt ids)."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        outputs: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        out: list[int | None] = [None] * len(params)
        plain = [
            i
            for i, p in enumerate(params)
            if p.greedy and p.repetition_penalty == 1.0 and not p.banned_ids
        ]
        if plain:
            idx = torch.tensor(plain, device=logits.device)
            for i, tok in zip(plain, torch.argmax(logits[idx], dim=-1).tolist()):
                out[i] = tok
        for i, p in enumerate(params):
            if out[i] is None:
                hist = torch.tensor(
                    penalty_history(outputs[i], p.repetition_window),
                    dtype=torch.long,
                    device=logits.device,
                )
                out[i] = sample_row(logits[i], p, hist, generators[i])
        return out  # type: ignore[return-value]
