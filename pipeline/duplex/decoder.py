"""The duplex Thinker's next-token choice: the reference `StreamDecoder.decode`, op for op.

Order (the reference's): a first draw from the raw distribution (argmax when greedy) that
only decides whether the chunk ends here (`<|chunk_eos|>`); then the forbidden ids (the
tokenizer's bad ids, `<|tts_pad|>`, `<|chunk_eos|>`) masked, the repetition penalty over
the last `window` decoded ids, the turn-end length penalty, the listen scale and
`listen_top_k`, then greedy or temperature / top-k / top-p sampling. Draws come from the
session's generator, in the reference's order, so a seed replays the same tokens.

`DuplexDecoder.decode` is that path for one session; `decode_batch` draws the next ids of
many sessions at once (pipeline.duplex.batch), with the same values, draws and ids as each
session's `decode`, and one host read in all instead of three or four a session.

A (1, V) softmax over the vocabulary runs on CUDA as one thread block over the whole row (a
single SM for ~50 us at 151k entries), and a row of a packed (B, V) tensor may sum in another
order than the row alone (its alignment picks the threads' elements). So `decode_batch` keeps
the reference's (1, V) calls, each on a row laid out as a tensor of its own, and spreads them
over side streams (`rowwise`): the same kernels on the same rows, run side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# `StreamDecoder.decode`'s own default: streaming_generate never passes another.
TURN_EOS_LENGTH_PENALTY = 1.1
# `decode_batch` lays its rows out where tensors of their own would start (the CUDA caching
# allocator's 512-byte blocks): CUDA's softmax splits a row among its threads by the row's
# alignment, so a row of a packed (B, V) tensor may sum its exps in another order.
ROW_ALIGN_BYTES = 512
# Side streams a device's row-wise calls spread over (`rowwise`): a row's softmax fills one
# SM, so this many run at once.
ROW_STREAMS = 8


@dataclass(frozen=True)
class DecodeParams:
    """A session's decoding options: its DuplexConfig's, under the decoder's names."""

    mode: str  # "greedy" | "sampling"
    temperature: float
    top_k: int
    top_p: float
    listen_top_k: int | None
    listen_prob_scale: float
    repetition_penalty: float
    repetition_window: int


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`torch.multinomial(probs, 1, generator=generator)`: the same index, drawn with the same
    draws from the generator, without multinomial's checks of `probs` (reductions and device
    asserts: most of a draw's kernels and host time). One sample is the exponential race
    argmax(probs / q), q ~ Exp(1) of probs' shape, in multinomial as here."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / q, dim=-1, keepdim=True)


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
        self.forbidden_ids = tuple(sorted(set(forbidden)))
        self.forbidden = torch.tensor(self.forbidden_ids, dtype=torch.long)
        self.generator = generator
        self.generated: list[int] = []  # every id decode returned past the chunk_eos check
        self.draws = 0  # samples drawn from the generator so far

    def _multinomial(self, probs: torch.Tensor) -> torch.Tensor:
        self.draws += 1
        return multinomial(probs, self.generator)

    def _forbidden_on(self, device: torch.device) -> torch.Tensor:
        if self.forbidden.device != device:  # moved once: a copy a step would wait
            self.forbidden = self.forbidden.to(device)
        return self.forbidden

    def _record(self, token: int, window: int) -> None:
        self.generated.append(token)
        if len(self.generated) > 2 * window:  # only the last window is read
            del self.generated[:-window]

    @torch.inference_mode()
    def decode(self, logits: torch.Tensor, p: DecodeParams) -> int:
        """logits (1, V) -> the next id."""
        logits = logits.clone()
        if p.mode == "greedy":
            first = int(torch.argmax(logits[0]).item())
        else:
            first = int(self._multinomial(F.softmax(logits[0], dim=-1)).item())
        if first == self.chunk_eos:
            return first

        logits[:, self._forbidden_on(logits.device)] = float("-inf")
        if p.repetition_penalty != 1.0 and self.generated:
            recent = torch.tensor(sorted(set(self.generated[-p.repetition_window:])),
                                  dtype=torch.long, device=logits.device)
            recent = recent[recent < logits.size(-1)]
            if p.repetition_penalty > 1.0:
                logits[0, recent] /= p.repetition_penalty
            else:
                logits[0, recent] *= 1.0 / p.repetition_penalty
        if TURN_EOS_LENGTH_PENALTY != 1.0:
            if logits[0, self.turn_eos] > 0:
                logits[0, self.turn_eos] = logits[0, self.turn_eos] / TURN_EOS_LENGTH_PENALTY
            else:
                logits[0, self.turn_eos] = logits[0, self.turn_eos] * TURN_EOS_LENGTH_PENALTY
        if p.listen_prob_scale != 1.0:
            logits[0, self.listen_id] *= p.listen_prob_scale
        if p.listen_top_k is not None:
            rank = int((logits[0] > logits[0, self.listen_id]).sum().item())
            if rank < p.listen_top_k:
                return self.listen_id  # not recorded in `generated`, as in the reference

        if p.mode == "greedy":
            token = int(torch.argmax(logits, dim=-1).item())
        else:
            logits = top_k_top_p_filtering(logits / p.temperature, p.top_k, p.top_p)
            token = int(self._multinomial(F.softmax(logits, dim=-1)).squeeze(1).item())
        self._record(token, p.repetition_window)
        return token


@torch.inference_mode()
def decode_batch(decoders: list[DuplexDecoder], logits: list[torch.Tensor],
                 params: list[DecodeParams]) -> list[int]:
    """`decoders[i].decode(logits[i], params[i])` for every row: the same ids, the same draws
    from each decoder's generator, the same `generated` after. The host reads the device
    once, whatever the row count: every row's whole path is computed before the read, and
    a row that stops early (chunk_eos, a listen by `listen_top_k`) puts its generator back
    where the reference leaves it (`_decode_rows`), so the launches of a step's draws go
    out while the GPU still runs the step.

    Ops whose value in a row does not depend on the other rows (elementwise, masks, argmax,
    top-k, sort) run over the stacked rows, one call per group of rows with equal settings;
    softmax and cumsum run per row, as (1, V) calls (CUDA sums one row and several rows in
    different orders) side by side (`rowwise`), and each row draws its noise from its own
    generator (one divide and one argmax for all the rows' draws). Rows that share a
    generator (or a decoder) draw in rounds, in row order, as they would one after another
    (a read a round).
    """
    if not len(decoders) == len(logits) == len(params):
        raise ValueError("one logits row and one DecodeParams per decoder")
    out = [0] * len(decoders)
    for rows in _rounds(decoders):
        ids = _decode_rows([decoders[i] for i in rows], [logits[i] for i in rows],
                           [params[i] for i in rows])
        for i, token in zip(rows, ids):
            out[i] = token
    return out


def _rounds(decoders: list[DuplexDecoder]) -> list[list[int]]:
    """The row indices in rounds holding each generator once, each round in row order."""
    rounds: list[list[int]] = []
    uses: dict[int, int] = {}
    for i, d in enumerate(decoders):
        k = uses.get(id(d.generator), 0)  # None, the global generator, is one generator too
        uses[id(d.generator)] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(i)
    return rounds


def _decode_rows(decoders: list[DuplexDecoder], logits: list[torch.Tensor],
                 params: list[DecodeParams]) -> list[int]:
    """`decode_batch` over rows with distinct generators, with one host read: every row's
    first draw, its `listen_top_k` rank and its filtered draw are computed before any is
    read, and a row that ends at its first draw (chunk_eos) or answers listen puts its
    generator back where its first draw left it (the reference draws nothing more then),
    so the draws each generator makes are the reference's."""
    rows = _stacked(logits)  # decode's clone
    device = rows.device

    # 1. the first draw of every row: a row that draws chunk_eos is done
    firsts: list[torch.Tensor | None] = [None] * len(decoders)
    greedy = [j for j, p in enumerate(params) if p.mode == "greedy"]
    if greedy:
        for j, first in zip(greedy, torch.argmax(rows[_on(greedy, device)], dim=-1).split(1)):
            firsts[j] = first
    sampling = [j for j, p in enumerate(params) if p.mode != "greedy"]
    if sampling:
        probs = rowwise(_softmax, [rows[j : j + 1] for j in sampling])
        for j, first in zip(sampling, _race([decoders[j] for j in sampling], probs)):
            firsts[j] = first
    # where each sampling row's generator stands after its first draw
    states = {j: _generator(decoders[j], device).get_state() for j in sampling}

    # 2. the masks and penalties, in decode's order (on every row: rows are independent)
    x = rows
    _mask_forbidden(x, decoders)
    _penalize_repeats(x, decoders, params)
    if TURN_EOS_LENGTH_PENALTY != 1.0:
        index = (torch.arange(len(decoders), device=device),
                 _on([d.turn_eos for d in decoders], device))
        v = x[index]
        x[index] = torch.where(v > 0, v / TURN_EOS_LENGTH_PENALTY, v * TURN_EOS_LENGTH_PENALTY)
    scaled = [(p.listen_prob_scale, j, d.listen_id)
              for j, (d, p) in enumerate(zip(decoders, params)) if p.listen_prob_scale != 1.0]
    for scale, (r, c) in _by_value(scaled).items():
        x[_on(r, device), _on(c, device)] *= scale

    # 3. listen_top_k: each ranked row's listen rank
    ranked = [j for j, p in enumerate(params) if p.listen_top_k is not None]
    ranks = None
    if ranked:
        r, c = _on(ranked, device), _on([decoders[j].listen_id for j in ranked], device)
        ranks = (x[r] > x[r, c].unsqueeze(-1)).sum(-1)

    # 4. greedy argmax or the filtered draw of every row
    picked: dict[int, torch.Tensor] = {}
    if greedy:
        picked.update(zip(greedy, torch.argmax(x[_on(greedy, device)], dim=-1).split(1)))
    groups: dict[tuple[float, int, float], list[int]] = {}
    for j in sampling:
        p = params[j]
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(j)
    for (temperature, top_k, top_p), group in groups.items():
        y = aligned_empty(len(group), x)
        torch.div(x[_on(group, device)], temperature, out=y)
        _filter_rows(y, top_k, top_p)
        probs = rowwise(_softmax, [y[k : k + 1] for k in range(len(group))])
        picked.update(zip(group, _race([decoders[j] for j in group], probs)))

    # the one read: the first draws, the ranks, the picks
    n = len(decoders)
    parts = firsts + [picked[j] for j in range(n)] + ([ranks] if ranks is not None else [])
    read = torch.cat([t.reshape(-1) for t in parts]).tolist()
    rank = dict(zip(ranked, read[2 * n :]))
    out = []
    for j, (d, p) in enumerate(zip(decoders, params)):
        first, token = read[j], read[n + j]
        if first == d.chunk_eos:
            out.append(first)
        elif j in rank and rank[j] < p.listen_top_k:
            out.append(d.listen_id)  # not recorded, as in decode
        else:
            d._record(token, p.repetition_window)
            out.append(token)
            continue
        if j in states:  # no second draw in the reference: the generator goes back
            _generator(d, device).set_state(states[j])
            d.draws -= 1
    return out


def _generator(d: DuplexDecoder, device: torch.device) -> torch.Generator:
    """The generator `d` draws from (None: the device's default one)."""
    if d.generator is not None:
        return d.generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator


def _mask_forbidden(x: torch.Tensor, decoders: list[DuplexDecoder]) -> None:
    if len({d.forbidden_ids for d in decoders}) == 1:
        x[:, decoders[0]._forbidden_on(x.device)] = float("-inf")
        return
    for j, d in enumerate(decoders):
        x[j, d._forbidden_on(x.device)] = float("-inf")


def _penalize_repeats(x: torch.Tensor, decoders: list[DuplexDecoder],
                      params: list[DecodeParams]) -> None:
    """Each row's penalty over its last window's ids, one indexed divide per penalty: a
    Python scalar as in decode (CUDA divides by a scalar through its reciprocal, by a
    tensor exactly)."""
    vocab = x.shape[-1]
    items = []
    for j, (d, p) in enumerate(zip(decoders, params)):
        if p.repetition_penalty != 1.0 and d.generated:
            recent = sorted(set(d.generated[-p.repetition_window:]))
            items += [(p.repetition_penalty, j, t) for t in recent if t < vocab]
    for penalty, (r, c) in _by_value(items).items():
        index = (_on(r, x.device), _on(c, x.device))
        if penalty > 1.0:
            x[index] /= penalty
        else:
            x[index] *= 1.0 / penalty


def _filter_rows(y: torch.Tensor, top_k: int, top_p: float) -> None:
    """`top_k_top_p_filtering` of every row of y (B, V) in place: its batched twin, so that
    the rows of a group with equal settings take one top-k and one sort, not one a row.
    The same ops in the same order, each row left as the (1, V) call leaves it: softmax
    and cumsum run per row on aligned rows (ROW_ALIGN_BYTES), and the cut entries go to
    -inf through masks, where the one-row filter indexes its row 0."""
    if top_k > 0:
        top_k = min(top_k, y.size(-1))
        y.masked_fill_(y < torch.topk(y, top_k)[0][..., -1, None], float("-inf"))
    if top_p > 0.0:
        sorted_logits, sorted_indices = torch.sort(y, descending=True)
        sorted_logits = _aligned(sorted_logits)
        # per row: CUDA scans one row with a device-wide cub scan, rows with another kernel
        cumulative = rowwise(lambda row: torch.cumsum(_softmax(row), dim=-1),
                             [sorted_logits[k : k + 1] for k in range(len(y))])
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # keep the token that crosses top_p
        remove[..., 0] = 0
        y.masked_fill_(torch.zeros_like(remove).scatter_(-1, sorted_indices, remove),
                       float("-inf"))


def _softmax(row: torch.Tensor) -> torch.Tensor:
    return F.softmax(row, dim=-1)


def _race(decoders: list[DuplexDecoder], probs: torch.Tensor) -> list[torch.Tensor]:
    """Each row's `multinomial` draw (row k of probs from decoders[k]'s generator, in row
    order): the rows' exponential noise drawn one by one, each into a row laid out as a
    tensor of its own, then one divide and one argmax for all. Returns each row's (1,) id."""
    q = aligned_empty(len(decoders), probs)
    for k, d in enumerate(decoders):
        d.draws += 1
        q[k].exponential_(generator=d.generator)
    return list(torch.argmax(probs / q, dim=-1).split(1))


_side_streams: dict[torch.device, list[torch.cuda.Stream]] = {}


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat([fn(row) for row in rows])`. On CUDA the calls run on ROW_STREAMS side
    streams, joined before it returns: each call is the same kernels on the same row as
    alone (so the same values), and calls that fill one SM each run side by side."""
    if len(rows) < 2 or rows[0].device.type != "cuda":
        return torch.cat([fn(row) for row in rows])
    device = rows[0].device
    main = torch.cuda.current_stream(device)
    if device not in _side_streams:
        _side_streams[device] = [torch.cuda.Stream(device) for _ in range(ROW_STREAMS)]
    streams = _side_streams[device][: len(rows)]
    for side in streams:
        side.wait_stream(main)
    outs = []
    for k, row in enumerate(rows):
        with torch.cuda.stream(streams[k % len(streams)]):
            out = fn(row)
        out.record_stream(main)  # made on a side stream, read on main
        outs.append(out)
    for side in streams:
        main.wait_stream(side)
    return torch.cat(outs)


def aligned_empty(n: int, like: torch.Tensor) -> torch.Tensor:
    """(n, V) like `like`, each row starting ROW_ALIGN_BYTES-aligned (a view of wider rows)."""
    per = ROW_ALIGN_BYTES // like.element_size()
    vocab = like.shape[-1]
    width = -(-vocab // per) * per
    return torch.empty(n, width, dtype=like.dtype, device=like.device)[:, :vocab]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    out = aligned_empty(t.shape[0], t)
    out.copy_(t)
    return out


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """`_aligned(torch.cat(rows))` of (1, V) rows; consecutive rows of one tensor (a decode
    graph's logits) go to the aligned rows in one copy."""
    first = rows[0]
    step = first.stride(0)
    if all(r.dtype == first.dtype and r.stride() == first.stride()
           and r.data_ptr() == first.data_ptr() + k * step * first.element_size()
           for k, r in enumerate(rows)):
        out = aligned_empty(len(rows), first)
        out.copy_(first.as_strided((len(rows), first.shape[-1]), first.stride()))
        return out
    return _aligned(torch.cat(rows))


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an index tensor on `device`. On CUDA through pinned memory: a copy from
    pageable memory waits for the stream, a host sync."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _by_value(items) -> dict[float, tuple[list[int], list[int]]]:
    """(value, row, column) triples -> per value its rows and columns."""
    out: dict[float, tuple[list[int], list[int]]] = {}
    for value, r, c in items:
        rows, cols = out.setdefault(value, ([], []))
        rows.append(r)
        cols.append(c)
    return out
