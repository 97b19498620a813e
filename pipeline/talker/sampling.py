"""Talker code sampling, batched over streams, in the reference's order.

Per row (one stream), `MiniCPMTTS.generate` / `TTSStreamingGenerator` do:
  1. logits / temperature
  2. repetition penalty over the stream's last 16 codes: `logit * p**freq` if the logit is
     negative, else `logit / p**freq`
  3. TopP(top_p, min_keep=3)  (ascending sort, drop cumulative prob <= 1 - top_p)
  4. TopK(top_k, min_keep=3)  (k = max(top_k, 3); drop logits below the k-th)
  5. full_span only: EOS set to -inf while fewer than `min_new` codes were sampled
     (the reference masks EOS *after* the warpers)
  6. softmax, draw one code
At a stream's very first draw (no code yet) only steps 1, 5 and 6 run.

Drawing: `argmax(probs / E)` with E ~ Exp(1) per vocabulary entry (the exponential race),
which has the same distribution as `torch.multinomial(probs, 1)`. The noise rows are drawn
outside this module from each stream's own `torch.Generator`, so codes are reproducible per
request seed and do not depend on which other streams share the batch, and the sampler
itself is a fixed sequence of tensor ops that a CUDA graph can capture.

Shapes: B rows (streams), V = num_audio_tokens, W = repetition window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import TalkerConfig


@dataclass(frozen=True)
class TalkerSamplingParams:
    """`TTSSamplingParams` of the reference. temperature <= 0 means greedy (argmax)."""

    temperature: float = 0.8
    top_p: float = 0.85
    top_k: int = 25
    repetition_penalty: float = 1.05
    repetition_window: int = 16
    min_keep: int = 3  # min_tokens_to_keep of both warpers in `gen_logits`

    def __post_init__(self) -> None:
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repetition_window < 1 or self.min_keep < 1:
            raise ValueError("repetition_window and min_keep must be >= 1")

    @classmethod
    def from_config(cls, cfg: TalkerConfig) -> TalkerSamplingParams:
        return cls(cfg.temperature, cfg.top_p, cfg.top_k, cfg.repetition_penalty,
                   cfg.repetition_window)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class SamplerState:
    """Per-slot sampler state, kept on the device so a CUDA graph can update it.

    history: (S, W) long  last W codes of the stream, right-aligned (newest last)
    count:   (S,) long    valid entries in history (0 = nothing sampled yet: first draw)
    steps:   (S,) long    draws so far (EOS included), for the full_span EOS mask
    min_new: (S,) long    EOS is masked while steps < min_new (0 in streaming mode)
    noise:   (S, V) float Exp(1) noise of the next draw, filled per stream before a step
    """

    history: torch.Tensor
    count: torch.Tensor
    steps: torch.Tensor
    min_new: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def empty(cls, slots: int, window: int, vocab: int, device: torch.device) -> SamplerState:
        return cls(
            history=torch.zeros(slots, window, dtype=torch.long, device=device),
            count=torch.zeros(slots, dtype=torch.long, device=device),
            steps=torch.zeros(slots, dtype=torch.long, device=device),
            min_new=torch.zeros(slots, dtype=torch.long, device=device),
            noise=torch.ones(slots, vocab, dtype=torch.float32, device=device),
        )

    def rows(self, start: int, stop: int) -> SamplerState:
        """Views of rows [start, stop): in-place updates land in this state."""
        return SamplerState(
            history=self.history[start:stop],
            count=self.count[start:stop],
            steps=self.steps[start:stop],
            min_new=self.min_new[start:stop],
            noise=self.noise[start:stop],
        )

    def reset_row(self, slot: int, min_new: int) -> None:
        self.history[slot].zero_()
        self.count[slot] = 0
        self.steps[slot] = 0
        self.min_new[slot] = min_new


# ---------------------------------------------------------------------------------------
# The steps, as plain functions over (B, V) float32 logits


def apply_repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, count: torch.Tensor, penalty: float
) -> torch.Tensor:
    """`CustomRepetitionPenaltyLogitsProcessorRepeat` over the valid part of `history`.

    history (B, W) right-aligned, count (B,): entries j >= W - count are real codes.
    """
    window = history.shape[1]
    valid = torch.arange(window, device=history.device)[None, :] >= (window - count)[:, None]
    # freq (B, V) long, like the reference's `one_hot(...).sum(1)`; invalid entries add 0.
    freq = torch.zeros(logits.shape, dtype=torch.long, device=logits.device)
    freq.scatter_add_(1, history, valid.long())
    alpha = torch.pow(penalty, freq)
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def top_p_filter(logits: torch.Tensor, top_p: float, min_keep: int) -> torch.Tensor:
    """transformers `TopPLogitsWarper(top_p, min_tokens_to_keep=min_keep)`."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cum_probs <= (1 - top_p)
    sorted_remove[..., -min_keep:] = False  # the min_keep most likely always stay
    remove = sorted_remove.scatter(1, sorted_idx, sorted_remove)
    return logits.masked_fill(remove, float("-inf"))


def top_k_filter(logits: torch.Tensor, top_k: int, min_keep: int) -> torch.Tensor:
    """transformers `TopKLogitsWarper(top_k, min_tokens_to_keep=min_keep)` (ties stay)."""
    k = min(max(top_k, min_keep), logits.shape[-1])
    kth = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def process_logits(
    logits: torch.Tensor, state: SamplerState, params: TalkerSamplingParams,
    temperature: torch.Tensor, eos_column: torch.Tensor,
) -> torch.Tensor:
    """Steps 1-5 of the module docstring. Returns new (B, V) float32 logits.

    temperature: (1, 1) float32 (ignored when greedy); eos_column: (1, V) bool, True at EOS.
    """
    if not params.greedy:
        logits = logits / temperature
    warped = logits
    if params.repetition_penalty != 1.0:
        warped = apply_repetition_penalty(
            warped, state.history, state.count, params.repetition_penalty
        )
    warped = top_p_filter(warped, params.top_p, params.min_keep)
    warped = top_k_filter(warped, params.top_k, params.min_keep)
    # A stream's first draw (no code yet) is temperature-only, as in the reference.
    first_draw = (state.count == 0)[:, None]
    logits = torch.where(first_draw, logits, warped)
    eos_masked = (state.steps < state.min_new)[:, None] & eos_column
    return logits.masked_fill(eos_masked, float("-inf"))


def draw(logits: torch.Tensor, noise: torch.Tensor, greedy: bool) -> torch.Tensor:
    """One code per row: exponential race over softmax(logits), or argmax when greedy."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    # Exp(1) noise can be exactly 0 on some backends; the clamp keeps 0/0 out.
    return (probs / noise.clamp_min(1e-30)).argmax(dim=-1)


class CodeSampler:
    """The sampler with its constant tensors built once per device (not per step)."""

    def __init__(self, params: TalkerSamplingParams, vocab: int, eos_code: int,
                 device: torch.device) -> None:
        self.params, self.vocab, self.eos_code = params, vocab, eos_code
        self.temperature = torch.full((1, 1), params.temperature, dtype=torch.float32,
                                      device=device)
        self.eos_column = torch.zeros(1, vocab, dtype=torch.bool, device=device)
        self.eos_column[0, eos_code] = True

    def __call__(self, logits: torch.Tensor, state: SamplerState, active: torch.Tensor
                 ) -> torch.Tensor:
        """Draw one code per row and advance the state of `active` rows in place.

        logits (B, V) float32; state: rows matching logits; active (B,) bool.
        Returns codes (B,) long. EOS is never written into the history.
        """
        processed = process_logits(logits, state, self.params, self.temperature, self.eos_column)
        codes = draw(processed, state.noise, self.params.greedy)
        keep = active & (codes != self.eos_code)
        shifted = torch.cat([state.history[:, 1:], codes[:, None]], dim=1)
        state.history.copy_(torch.where(keep[:, None], shifted, state.history))
        window = state.history.shape[1]
        state.count.copy_(torch.where(keep, (state.count + 1).clamp_max(window), state.count))
        state.steps.add_(active.long())
        return codes
