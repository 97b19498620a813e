"""The duplex Thinker's next-token choice: the reference `StreamDecoder.decode`, op for op.

Order (the reference's): a first draw from the raw distribution (argmax when greedy) that
only decides whether the chunk ends here (`<|chunk_eos|>`); then the forbidden ids (the
tokenizer's bad ids, `<|tts_pad|>`, `<|chunk_eos|>`) masked, the repetition penalty over
the last `window` decoded ids, the turn-end length penalty, the listen scale and
`listen_top_k`, then greedy or temperature / top-k / top-p sampling. Draws come from the
session's generator, in the reference's order, so a seed replays the same tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# `StreamDecoder.decode`'s own default: streaming_generate never passes another.
TURN_EOS_LENGTH_PENALTY = 1.1


def top_k_top_p_filtering(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(1, V) -> (1, V) with the filtered entries at -inf (the reference's filter)."""
    logits = logits.clone()
    if top_k > 0:
        top_k = min(top_k, logits.size(-1))
        logits[logits < torch.topk(logits, top_k)[0][..., -1, None]] = float("-inf")
    if top_p > 0.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # keep the token that crosses top_p
        remove[..., 0] = 0
        logits[0, sorted_indices[remove]] = float("-inf")
    return logits


class DuplexDecoder:
    def __init__(self, *, chunk_eos: int, turn_eos: int, listen_id: int,
                 forbidden: list[int], generator: torch.Generator | None):
        self.chunk_eos = chunk_eos
        self.turn_eos = turn_eos
        # The reference's decoder takes "listen" to be the tokenizer's eos (`<|im_end|>`),
        # not `<|listen|>`: listen_prob_scale and listen_top_k act on that id. Kept on
        # purpose; both are off by default.
        self.listen_id = listen_id
        self.forbidden = torch.tensor(sorted(set(forbidden)), dtype=torch.long)
        self.generator = generator
        self.generated: list[int] = []  # every id decode returned past the chunk_eos check
        self.draws = 0  # samples drawn from the generator so far

    def _multinomial(self, probs: torch.Tensor) -> torch.Tensor:
        self.draws += 1
        return torch.multinomial(probs, num_samples=1, generator=self.generator)

    @torch.inference_mode()
    def decode(self, logits: torch.Tensor, *, mode: str, temperature: float, top_k: int,
               top_p: float, listen_top_k: int | None, listen_prob_scale: float,
               repetition_penalty: float, repetition_window: int) -> int:
        """logits (1, V) -> the next id."""
        logits = logits.clone()
        if mode == "greedy":
            first = int(torch.argmax(logits[0]).item())
        else:
            first = int(self._multinomial(F.softmax(logits[0], dim=-1)).item())
        if first == self.chunk_eos:
            return first

        if self.forbidden.device != logits.device:  # moved once: a copy a step would wait
            self.forbidden = self.forbidden.to(logits.device)
        logits[:, self.forbidden] = float("-inf")
        if repetition_penalty != 1.0 and self.generated:
            recent = torch.tensor(sorted(set(self.generated[-repetition_window:])),
                                  dtype=torch.long, device=logits.device)
            recent = recent[recent < logits.size(-1)]
            if repetition_penalty > 1.0:
                logits[0, recent] /= repetition_penalty
            else:
                logits[0, recent] *= 1.0 / repetition_penalty
        if TURN_EOS_LENGTH_PENALTY != 1.0:
            if logits[0, self.turn_eos] > 0:
                logits[0, self.turn_eos] = logits[0, self.turn_eos] / TURN_EOS_LENGTH_PENALTY
            else:
                logits[0, self.turn_eos] = logits[0, self.turn_eos] * TURN_EOS_LENGTH_PENALTY
        if listen_prob_scale != 1.0:
            logits[0, self.listen_id] *= listen_prob_scale
        if listen_top_k is not None:
            rank = int((logits[0] > logits[0, self.listen_id]).sum().item())
            if rank < listen_top_k:
                return self.listen_id  # not recorded in `generated`, as in the reference

        if mode == "greedy":
            token = int(torch.argmax(logits, dim=-1).item())
        else:
            logits = top_k_top_p_filtering(logits / temperature, top_k, top_p)
            token = int(self._multinomial(F.softmax(logits, dim=-1)).squeeze(1).item())
        self.generated.append(token)
        if len(self.generated) > 2 * repetition_window:  # only the last window is read
            del self.generated[:-repetition_window]
        return token
