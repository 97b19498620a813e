"""The duplex Thinker's next-id choice for many sessions at once (`decode_batch`,
pipeline/duplex/decoder.py) equals each session's own `DuplexDecoder.decode`.

`decode_batch` draws the next ids of a batch step: the stacked rows go through the masks,
penalties and filters together, softmax and cumsum run row by row, and each row draws from
its own generator. Its contract is exactness: the same ids, the same draws from each
generator (so the generator stands at the same state), the same repetition history, step
after step; and a fixed number of host reads a step, whatever the row count.

Random logits over a vocabulary whose rows are not 16-byte multiples in bf16 (the packed
rows' alignment differs from a tensor of their own), with steps of coarse values (ties at
the top-k and top-p cuts) and boosted `<|chunk_eos|>` and listen ids. The CUDA cases run
where a GPU is present: CUDA picks its softmax and cumsum kernels by row count and
alignment, which the CPU does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.duplex.decoder import (
    DecodeParams,
    DuplexDecoder,
    _aligned,
    decode_batch,
    multinomial,
    rowwise,
)

VOCAB = 1003
MODEL_VOCAB = 151748  # MiniCPM-o 4.5's: CUDA's large-row softmax and sort kernels
CHUNK_EOS, TURN_EOS, LISTEN = 5, 7, 9
FORBIDDEN = [1, 2, CHUNK_EOS]

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
]


def params(mode="sampling", **kw) -> DecodeParams:
    """DuplexConfig's defaults, a short repetition window (its trim runs too)."""
    base = dict(mode=mode, temperature=0.7, top_k=20, top_p=0.8, listen_top_k=None,
                listen_prob_scale=1.0, repetition_penalty=1.05, repetition_window=8)
    return DecodeParams(**{**base, **kw})


# (seed, its params, forbidden ids); seed None: the previous row's generator
SESSIONS = [
    (0, params(), FORBIDDEN),
    (1, params(), FORBIDDEN),  # the same settings: one group with row 0
    (2, params("greedy"), FORBIDDEN),
    (3, params(temperature=1.3, top_k=0, top_p=0.95), FORBIDDEN),
    (4, params(top_k=50, top_p=0.0, repetition_penalty=0.9), FORBIDDEN),
    (5, params(listen_top_k=3, listen_prob_scale=1.5), FORBIDDEN),
    (6, params("greedy", listen_top_k=2, repetition_penalty=1.0), FORBIDDEN),
    (7, params(top_k=1), [3, CHUNK_EOS]),  # its own forbidden ids
    (None, params(temperature=0.9), FORBIDDEN),  # shares row 7's generator
]


def decoders(device: str) -> list[DuplexDecoder]:
    out, generator = [], None
    for seed, _, forbidden in SESSIONS:
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        out.append(DuplexDecoder(chunk_eos=CHUNK_EOS, turn_eos=TURN_EOS, listen_id=LISTEN,
                                 forbidden=forbidden, generator=generator))
    return out


def step_logits(step: int, n: int, g: torch.Generator, device: str, dtype: torch.dtype,
                vocab: int = VOCAB) -> list[torch.Tensor]:
    """The step's (1, V) logits per row: random, coarse every third step (ties), with
    chunk_eos or the listen id boosted in some rows, and recent ids high (the penalty)."""
    x = torch.randn(n, vocab, generator=g) * 3
    if step % 3 == 0:
        x = (x * 2).round() / 2
    x[step % n, CHUNK_EOS] += 12 if step % 4 == 0 else 0
    if step % 5 == 0:  # listen on top of its row: a listen_top_k row answers listen
        x[(step + 1) % n, LISTEN] = x[(step + 1) % n].max() + 1
    x[:, 10 + step % 7] += 4
    rows = x.to(device=device, dtype=dtype)
    return [rows[i : i + 1] for i in range(n)]  # views of one tensor, as a batch's logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_equals_each_decoder_alone(device, dtype):
    alone, batched = decoders(device), decoders(device)
    ps = [p for _, p, _ in SESSIONS]
    g = torch.Generator().manual_seed(11)
    vocab = MODEL_VOCAB if device == "cuda" else VOCAB
    seen = set()
    for step in range(120):
        logits = step_logits(step, len(ps), g, device, dtype, vocab)
        want = [d.decode(row, p) for d, row, p in zip(alone, logits, ps)]
        got = decode_batch(batched, logits, ps)
        assert got == want, f"step {step}"
        for a, b in zip(alone, batched):
            assert (a.generated, a.draws) == (b.generated, b.draws), f"step {step}"
        for i, (token, p) in enumerate(zip(want, ps)):
            if token == CHUNK_EOS:
                seen.add("chunk_eos")
            elif token == LISTEN and p.listen_top_k is not None:
                seen.add("listen_top_k")
            else:
                seen.add(p.mode)
    for a, b in zip(alone, batched):
        assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert seen == {"chunk_eos", "listen_top_k", "greedy", "sampling"}, seen
    assert all(len(d.generated) <= 2 * 8 for d in batched)  # the window trims


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multinomial_draws_what_torch_multinomial_draws(device, dtype):
    """The draw without multinomial's checks: the same index from the same generator state
    and the generator left where multinomial leaves it, for (V,) and (1, V) rows, flat and
    peaked distributions, at both vocabularies."""
    g = torch.Generator().manual_seed(5)
    for vocab in (VOCAB, MODEL_VOCAB):
        ours = torch.Generator(device=device).manual_seed(vocab)
        theirs = torch.Generator(device=device).manual_seed(vocab)
        for i in range(40):
            scale = (0.1, 1.0, 8.0)[i % 3]
            logits = (torch.randn(vocab, generator=g) * scale).to(device, dtype)
            probs = F.softmax(logits if i % 2 else logits[None], dim=-1)
            want = torch.multinomial(probs, 1, generator=theirs)
            got = multinomial(probs, ours)
            assert got.shape == want.shape and torch.equal(got, want), (vocab, i)
        assert torch.equal(ours.get_state(), theirs.get_state())


def test_rows_of_one_decoder_draw_in_row_order():
    """Two rows of one decoder: the second sees the first's draws and history."""
    alone, batched = decoders("cpu")[0], decoders("cpu")[0]
    p = params()
    g = torch.Generator().manual_seed(3)
    for step in range(20):
        logits = step_logits(step + 1, 3, g, "cpu", torch.float32)
        want = [alone.decode(row, p) for row in logits]
        assert decode_batch([batched] * 3, logits, [p] * 3) == want, f"step {step}"
    assert batched.generated == alone.generated and batched.draws == alone.draws
    assert torch.equal(alone.generator.get_state(), batched.generator.get_state())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ops_on_stacked_rows_equal_the_single_row_calls(device, dtype):
    """What decode_batch runs over stacked rows gives each row what the (1, V) call gives:
    top-k values, sort (with ties) and argmax; the per-row softmax and cumsum on the
    aligned rows equal the same calls on a tensor of their own, also run side by side on
    streams of their own (`rowwise`). CUDA's cumsum over a
    vocabulary row is not deterministic in float32 (the same call on the same tensor
    differs in its last bits from run to run, H100): there the reference's own top-p cut
    moves as much, and the aligned row's sums are held to that spread."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, MODEL_VOCAB, generator=g) * 4).round() / 4
    x = x.to(device=device, dtype=dtype)
    rows = _aligned(x)
    values, indices = torch.sort(rows, descending=True)
    # the rows' softmax on side streams (CUDA), side by side
    side_by_side = rowwise(lambda row: F.softmax(row, -1),
                           [rows[i : i + 1] for i in range(len(x))])
    for i in range(len(x)):
        one = x[i : i + 1].clone()
        assert torch.equal(torch.topk(rows, 20)[0][i : i + 1], torch.topk(one, 20)[0])
        v, idx = torch.sort(one, descending=True)
        assert torch.equal(values[i : i + 1], v) and torch.equal(indices[i : i + 1], idx)
        assert torch.equal(torch.argmax(rows, -1)[i], torch.argmax(one))
        assert rows[i : i + 1].is_contiguous()
        assert rows[i : i + 1].data_ptr() % 16 == 0  # where a tensor of its own starts
        probs = F.softmax(rows[i : i + 1], -1)
        assert torch.equal(probs, F.softmax(one, -1))
        assert torch.equal(side_by_side[i : i + 1], probs)
        got, want = torch.cumsum(probs, -1), torch.cumsum(F.softmax(one, -1), -1)
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            # a float32 sum of 151k terms, summed in another order: ~1e-7 to 1e-6 apart;
            # bfloat16 rounds the float sums to its own ulp near 1 (2**-7)
            atol = 1e-5 if dtype == torch.float32 else 2.0**-7
            assert torch.allclose(got, want, rtol=0, atol=atol)


class _HostReads:
    """Counts the Python-side reads of tensor values (`item`, `tolist`, `bool(t)`,
    `int(t)`, `float(t)`): each is a host sync on CUDA."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, fn):
        def counted(t, *a, **kw):
            self.n += 1
            return fn(t, *a, **kw)
        return counted

    def reads(self, fn) -> int:
        before = self.n
        fn()
        return self.n - before


@pytest.mark.parametrize("listen_top_k", [None, 3])
def test_decode_batch_reads_the_host_a_fixed_number_of_times(monkeypatch, listen_top_k):
    counter = _HostReads(monkeypatch)
    g = torch.Generator().manual_seed(2)
    for n in (1, 4, 16):
        ps = [params("greedy" if i % 3 == 0 else "sampling", listen_top_k=listen_top_k,
                     temperature=0.7 + 0.1 * (i % 2)) for i in range(n)]
        made = [[DuplexDecoder(chunk_eos=CHUNK_EOS, turn_eos=TURN_EOS, listen_id=LISTEN,
                               forbidden=FORBIDDEN,
                               generator=torch.Generator().manual_seed(i)) for i in range(n)]
                for _ in range(2)]
        for step in range(4):  # with a repetition history after the first
            x = torch.randn(n, VOCAB, generator=g)
            x[:, CHUNK_EOS] = -30  # every row goes on past the first draw
            x[:, LISTEN] = -30  # and none answers listen at listen_top_k
            if step == 3:  # but here every other row ends, and every third answers listen
                x[::2, CHUNK_EOS] = 30
                x[1::3, LISTEN] = 30
            logits = list(x.split(1))
            batched = counter.reads(lambda: decode_batch(made[0], logits, ps))
            alone = counter.reads(
                lambda: [d.decode(row, p) for d, row, p in zip(made[1], logits, ps)])
            assert batched == 1, (n, step)
            if step < 3:
                assert alone == n * (3 if listen_top_k is None else 4), (n, step)
        for a, b in zip(*made):  # the rows that ended put their generators back
            assert a.generated == b.generated and a.draws == b.draws
            assert torch.equal(a.generator.get_state(), b.generator.get_state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_decode_batch_syncs_as_often_for_sixteen_rows_as_for_two_on_cuda():
    """CUDA's own count (set_sync_debug_mode), which sees the syncs inside ops too (a copy
    from pageable memory, a boolean mask's nonzero)."""
    import warnings

    counts = []
    g = torch.Generator().manual_seed(4)
    for n in (2, 16):
        ps = [params("greedy" if i % 3 == 0 else "sampling") for i in range(n)]
        made = [DuplexDecoder(chunk_eos=CHUNK_EOS, turn_eos=TURN_EOS, listen_id=LISTEN,
                              forbidden=FORBIDDEN,
                              generator=torch.Generator(device="cuda").manual_seed(i))
                for i in range(n)]
        for step in range(2):  # the first moves the forbidden ids and warms the pinned pool
            x = torch.randn(n, MODEL_VOCAB, generator=g)
            x[:, CHUNK_EOS] = -30
            logits = list(x.to("cuda", torch.bfloat16).split(1))
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    decode_batch(made, logits, ps)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts[0] == counts[1] > 0, counts
