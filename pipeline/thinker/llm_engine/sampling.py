"""Per-request sampling over a batch of logits rows.

Order of operations for each row, the reference streaming decode's
(`ChunkPrefillChunkGenerate.chunk_generate`, MiniCPM-o 4.5 `utils.py`):
  banned ids -> repetition penalty -> temperature -> top-k -> top-p -> draw.
Greedy rows (temperature 0) take the argmax of the banned and penalized logits; with no
bans and penalty 1 that is exactly argmax of the raw logits. Draws use the request's own
torch.Generator when it asked for a seed, so a seeded request reproduces regardless of
what it is batched with.

Banned ids (`SamplingParams.banned_ids`): their logits become -inf first, on every step,
greedy rows included; the penalty then leaves them -inf (-inf * penalty). The reference
does this with `suppress_forbidden_tokens` while it speaks.

Top-p, the reference's own rule (not HF's `TopPLogitsWarper`): sort descending, cumulative
probability `c`, drop a token when the mass strictly before it is over p (`c > p` shifted
right by one; the first token always stays). Mass exactly equal to p keeps the token, where
HF's ascending `cumsum <= 1 - p` drops it. The reference compares its float32 sums with
p rounded to float32 (a Python float against a float32 tensor), so p is rounded likewise.

Repetition penalty, as the reference's streaming chat computes it
(`MiniCPMO.streaming_generate` driving `ChunkPrefillChunkGenerate.chunk_generate`, MiniCPM-o
4.5 `modeling_minicpmo.py` / `utils.py`):
  * only generated ids count, never the prompt: the reference passes this turn's generated
    ids as `all_input_ids` (the offline `chat()` too: HF `generate` on `inputs_embeds`
    starts `input_ids` empty);
  * it decodes in chunks of 10 tokens, the first chunk 11 long, and a token inside a chunk
    sees the last `PENALTY_WINDOW_SIZE` = 128 ids of the earlier chunks plus the ids of its
    own chunk so far (`penalty_history`; `SamplingParams.repetition_window`, None = no
    window, the offline rule);
  * each distinct id is penalized once (`torch.unique` there, HF's processor likewise):
    positive logits divided by the penalty, the others multiplied.

`sample_batch` computes that rule for the whole batch as one fixed sequence of tensor ops
with no host sync, so the decode CUDA graph can capture it. Its inputs are per-row tensors
(`SamplingTensors`) that `pack_rows` writes on the host and `draw_noise` fills on the device.
It computes the same function as the per-row host sampler (tests/_sampling_ref.py, the
reference path) bit for bit:
  - penalty and temperature divide by float32 tensors (true division; a Python scalar
    divisor would make CUDA multiply by its reciprocal instead);
  - the bans are -inf (a bitmask row);
  - top-k's threshold is the k-th largest value; top-p sorts stably and sums the mass in
    float64, where every prefix sum of float32 probabilities down to 2**-29 is exact, so
    the cut does not depend on the scan algorithm torch picks for a batch size;
  - the draw is the exponential race `argmax(probs / q)`, q ~ Exp(1), which is what
    `torch.multinomial(probs, 1)` computes: `draw_noise` takes q from the row's own
    generator exactly as multinomial would, so a seed draws the same token whatever else
    is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pipeline.handoff import SamplingParams

# The reference's streaming decode chunks: `generate_chunk_size` 10, and the first chunk
# one longer (`chunk_size=generate_chunk_size + 1 * is_first_generate_chunk`).
DECODE_CHUNK = 10
FIRST_DECODE_CHUNK = DECODE_CHUNK + 1

# An output id the host does not know yet: the token the step in flight is sampling. A step
# launched before the previous one finished feeds it from the device (runner.py).
PENDING_ID = -1

# Ids per row of the batched sampler's penalty history (its static width in the decode
# graphs). The last column is kept for a row's newest id while that is PENDING_ID on the
# host; a row with more distinct ids than the other columns hold is sampled again, eagerly,
# with a history built wide enough for that step (`widened_history`).
HISTORY_WIDTH = 256


def penalty_history(output_ids: Sequence[int], window: int | None) -> list[int]:
    """The generated ids the penalty sees when sampling output token len(output_ids):
    the ids before its decode chunk, the last `window` of them, then its chunk's own."""
    n = len(output_ids)
    if window is None or n < FIRST_DECODE_CHUNK:
        return list(output_ids)
    chunk_start = FIRST_DECODE_CHUNK + (n - FIRST_DECODE_CHUNK) // DECODE_CHUNK * DECODE_CHUNK
    return list(output_ids[max(0, chunk_start - window) :])


# Host copies of the banned sets, keyed by the identity of a request's `banned_ids` tuple
# (each request carries its own after unpickling): hashing ~1,800 ids every step would cost
# more than the lookup saves. The entry keeps the tuple alive, so its id is not reused.
_BANNED_CACHE_SIZE = 1024
_banned_cache: dict[int, tuple[tuple[int, ...], int, np.ndarray, np.ndarray]] = {}


def _banned(ids: tuple[int, ...], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(the ids as int64, the little-endian bitmask of `vocab` bits) of a banned set."""
    hit = _banned_cache.get(id(ids))
    if hit is not None and hit[0] is ids and hit[1] == vocab:
        return hit[2], hit[3]
    index = np.array(ids, dtype=np.int64)
    if index.size and (index.min() < 0 or index.max() >= vocab):
        raise ValueError(f"banned id {int(index.max())} is outside the vocabulary of {vocab}")
    mask = np.zeros(vocab, dtype=bool)
    mask[index] = True
    bits = np.packbits(mask, bitorder="little")
    if len(_banned_cache) >= _BANNED_CACHE_SIZE:
        _banned_cache.pop(next(iter(_banned_cache)))  # the oldest entry
    _banned_cache[id(ids)] = (ids, vocab, index, bits)
    return index, bits


def top_p_threshold(p: float) -> float:
    """p as the reference compares it: rounded to float32 (see the module docstring)."""
    return float(np.float32(p))


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def sampling_fields(
    rows: int, vocab: int, width: int = HISTORY_WIDTH
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The per-row inputs of `sample_batch` that the host writes (`pack_rows`)."""
    return {
        "greedy": (torch.bool, (rows,)),
        "temperature": (torch.float32, (rows,)),
        "top_k": (torch.int64, (rows,)),
        "top_p": (torch.float64, (rows,)),
        "penalty": (torch.float32, (rows,)),
        "history": (torch.int64, (rows, width)),
        # One bit per vocabulary id (little-endian bytes): any banned set fits, in V / 8
        # bytes a row (19 KB at the Thinker's 151,748), where an id list would need a cap.
        "banned": (torch.uint8, (rows, -(-vocab // 8))),
    }


@dataclass(frozen=True)
class SamplingTensors:
    """The inputs of `sample_batch`, B rows on the device."""

    greedy: torch.Tensor  # (B,) bool
    temperature: torch.Tensor  # (B,) float32 (1 on greedy rows)
    top_k: torch.Tensor  # (B,) int64: index of the k-th largest logit (V - 1: off)
    top_p: torch.Tensor  # (B,) float64 (1: off)
    penalty: torch.Tensor  # (B,) float32 (1: off)
    history: torch.Tensor  # (B, W) int64: ids to penalize, padded with V
    banned: torch.Tensor  # (B, ceil(V / 8)) uint8: bit v % 8 of byte v // 8 bans id v
    noise: torch.Tensor  # (B, V) float32: Exp(1) draws of the rows that sample

    @classmethod
    def view(
        cls, fields: dict[str, torch.Tensor], noise: torch.Tensor, rows: int
    ) -> SamplingTensors:
        """Rows [:rows] of `sampling_fields` tensors and of a noise buffer."""
        names = ("greedy", "temperature", "top_k", "top_p", "penalty", "history", "banned")
        return cls(**{k: fields[k][:rows] for k in names}, noise=noise[:rows])

    def with_history(self, history: torch.Tensor) -> SamplingTensors:
        return replace(self, history=history)


@dataclass
class PackedRows:
    sampled: bool  # some row draws (else the step only needs penalty + argmax)
    wide: dict[int, list[int]]  # rows whose distinct history does not fit: all their ids


def pack_rows(
    host: dict[str, np.ndarray],
    params: Sequence[SamplingParams | None],
    outputs: Sequence[Sequence[int]],
    vocab: int,
) -> PackedRows:
    """Write rows [0, len(params)) of the `sampling_fields` host arrays. None is a padded
    row: greedy, no penalty. `outputs[i]`: the ids row i's request generated so far; the
    last may be PENDING_ID, whose history column (the last) the device then fills."""
    hist = host["history"]
    width = hist.shape[1]
    host["banned"][: len(params)] = 0
    sampled, wide = False, {}
    for i, p in enumerate(params):
        hist[i] = vocab
        if p is not None and p.banned_ids:
            host["banned"][i] = _banned(p.banned_ids, vocab)[1]
        draws = p is not None and not p.greedy
        sampled |= draws
        host["greedy"][i] = not draws
        host["temperature"][i] = p.temperature if draws else 1.0
        host["top_k"][i] = p.top_k - 1 if draws and 0 < p.top_k < vocab else vocab - 1
        host["top_p"][i] = top_p_threshold(p.top_p) if draws else 1.0
        if p is None or p.repetition_penalty == 1.0:
            host["penalty"][i] = 1.0
            continue
        host["penalty"][i] = p.repetition_penalty
        ids = penalty_history(outputs[i], p.repetition_window)
        if ids and ids[-1] == PENDING_ID:
            ids.pop()
        if len(ids) >= width:
            ids = list(dict.fromkeys(ids))  # the penalty sees each distinct id once
            if len(ids) >= width:
                wide[i] = ids
                ids = ids[: width - 1]
        hist[i, : len(ids)] = ids
    return PackedRows(sampled, wide)


def widened_history(
    history: torch.Tensor, host_history: np.ndarray, wide: dict[int, list[int]], vocab: int
) -> torch.Tensor:
    """A history wide enough for `wide`'s rows; the other rows and the last column (the
    device-filled newest id) are taken from `history` (n, W) / its host copy."""
    n, width = history.shape
    out = torch.full((n, max(map(len, wide.values())) + 1), vocab, dtype=torch.long)
    out[:, : width - 1] = torch.from_numpy(host_history[:n, : width - 1])
    for i, ids in wide.items():
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    out = out.to(history.device)
    out[:, -1] = history[:, -1]
    return out


def draw_noise(
    noise: torch.Tensor,
    params: Sequence[SamplingParams | None],
    generators: Sequence[torch.Generator | None],
) -> None:
    """Exp(1) draws for the rows that sample, from each request's generator (the default
    one when it has none): the draws `torch.multinomial(probs, 1, generator=g)` makes."""
    for i, (p, g) in enumerate(zip(params, generators)):
        if p is not None and not p.greedy:
            noise[i].exponential_(generator=g)


def penalize(x: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The repetition penalty per row (HF semantics: positive logits divided, others
    multiplied, each distinct id once): x (B, V) float32, history (B, W) ids padded with
    V, penalty (B,). Each distinct id is marked once (column V is the padding's sink)."""
    vocab = x.shape[-1]
    seen = torch.zeros(x.shape[0], vocab + 1, dtype=torch.bool, device=x.device)
    seen.scatter_(1, history, True)
    pen = penalty[:, None]
    return torch.where(seen[:, :vocab], torch.where(x > 0, x / pen, x * pen), x)


def ban(x: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """The banned ids at -inf per row: x (B, V), banned (B, ceil(V / 8)) bitmask rows."""
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    bits = (banned[:, :, None] >> shifts) & 1  # (B, ceil(V / 8), 8): bit j of byte b = id 8b + j
    return x.masked_fill(bits.flatten(1)[:, : x.shape[-1]].bool(), float("-inf"))


def sample_batch(logits: torch.Tensor, t: SamplingTensors, sampled: bool = True) -> torch.Tensor:
    """One id per row of logits (B, V): the module's rule for every row at once, with no host
    sync. sampled=False runs bans + penalty + argmax only (every row greedy). Returns (B,)
    int64."""
    x = penalize(ban(logits.float(), t.banned), t.history, t.penalty)
    greedy_ids = x.argmax(-1)
    if not sampled:
        return greedy_ids
    x = x / t.temperature[:, None]
    # One sort serves both filters: top-k's threshold, then top-p's mass on the survivors.
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    kth = sorted_x.gather(1, t.top_k[:, None])
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = sorted_x.softmax(-1).double()
    top_p = t.top_p[:, None]
    drop_sorted = (probs.cumsum(-1) - probs > top_p) & (top_p < 1.0)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    probs = x.masked_fill(drop, float("-inf")).softmax(-1)
    drawn = (probs / t.noise).argmax(-1)
    return torch.where(t.greedy, greedy_ids, drawn)
