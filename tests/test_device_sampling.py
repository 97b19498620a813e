"""The batched device sampler (`sampling.sample_batch`) against the per-row host `Sampler`.

Claims tested here, on CPU unless marked:
  * the same ids as the host sampler, row for row and step after step, for greedy rows
    (bit-exact banned and penalized argmax) and for sampled rows (the same generator draws,
    the same probabilities), with ties in bf16 logits and live bans / top-k / top-p /
    penalty cuts; top-p at an exact tie keeps the token, as the reference does;
  * its draws follow the filtered distribution (chi-square, fixed seed: deterministic);
  * a seeded row's ids do not depend on its batch mates or its row;
  * the engine with device sampling == the engine with host sampling, token for token, over
    long runs with batching, chunked prefill and penalty histories wider than the graph's;
  * the engine launching ahead (PENDING_ID tokens fed from the device) == synchronous steps:
    ids, hidden rows, finish reasons, aborts and preemption with a step in flight;
  * CUDA: the decode graph with in-graph sampling == eager, greedy and seeded.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from _sampling_ref import (  # tests/ is on sys.path
    Sampler,
    apply_bans,
    apply_repetition_penalty,
    top_k_mask,
    top_p_mask,
)
from _tiny_lm import CUDA_LLM, has_flashinfer, random_lm, tiny_llm_config

import pipeline.thinker.llm_engine.graphs as graphs_module
from pipeline.config import LLMConfig
from pipeline.thinker.llm_engine.attention import AttnMetadata, FlashInferAttention, TorchAttention
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.thinker.llm_engine.graphs import (
    DecodeGraphs,
    LLMGraphRunner,
    Staging,
    decode_fields,
    page_table,
)
from pipeline.thinker.llm_engine.sampling import (
    HISTORY_WIDTH,
    PENDING_ID,
    SamplingTensors,
    ban,
    draw_noise,
    make_generator,
    pack_rows,
    penalize,
    sample_batch,
    sampling_fields,
    widened_history,
)
from pipeline.handoff import SamplingParams
from pipeline.thinker.llm import Qwen3LM

CPU = torch.device("cpu")


def batched(logits, params, outputs, generators) -> list[int]:
    """`sample_batch` over rows, through the same packing / noise steps the runner uses."""
    n, vocab = logits.shape
    st = Staging(sampling_fields(n, vocab), logits.device)
    noise = torch.ones(n, vocab, device=logits.device)
    packed = pack_rows(st.host, params, outputs, vocab)
    st.upload()
    t = SamplingTensors.view(st.dev, noise, n)
    draw_noise(noise, params, generators)
    if packed.wide:
        t = t.with_history(widened_history(t.history, st.host["history"], packed.wide, vocab))
    return sample_batch(logits, t, packed.sampled).tolist()


MIX = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=2.0, repetition_window=None),
    SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=1),
    SamplingParams(temperature=1.0, seed=2),
    SamplingParams(temperature=1.3, top_k=5, seed=3),
    SamplingParams(temperature=0.9, top_p=0.5, repetition_penalty=1.5, repetition_window=7),
    SamplingParams(temperature=1.0, top_p=0.95, top_k=0),  # unseeded: the default generator
    SamplingParams(banned_ids=tuple(range(3, 300, 5))),  # greedy with bans only
    SamplingParams(
        temperature=1.2,
        top_p=0.9,
        top_k=40,
        repetition_penalty=1.1,
        banned_ids=(0, 7, 8, *range(64, 300, 4)),  # byte edges of the bitmask rows
        seed=4,
    ),
]
BANNED_ROWS = [i for i, p in enumerate(MIX) if p.banned_ids]


def test_batched_equals_host_sampler_row_by_row():
    """Both samplers over the same generated histories for 80 steps: the same ids, and the
    generators end in the same state (the same draws were taken)."""
    vocab, steps = 500, 80
    g = torch.Generator().manual_seed(0)
    gens = {k: [make_generator(p.seed, "cpu") for p in MIX] for k in ("host", "batch")}
    outputs: list[list[int]] = [[] for _ in MIX]
    sampled_rows, ban_live = set(), set()
    for step in range(steps):
        # bf16 logits, as the model returns them: many exact ties across 500 entries
        logits = (torch.randn(len(MIX), vocab, generator=g) * 3).bfloat16()
        torch.manual_seed(1000 + step)
        want = Sampler()(logits, MIX, outputs, gens["host"])
        torch.manual_seed(1000 + step)
        got = batched(logits, MIX, outputs, gens["batch"])
        assert got == want, f"step {step}"
        for i, tok in enumerate(want):
            outputs[i].append(tok)
            if not MIX[i].greedy and tok != int(logits[i].argmax()):
                sampled_rows.add(i)
            if int(logits[i].argmax()) in MIX[i].banned_ids:
                ban_live.add(i)
    for i in BANNED_ROWS:
        assert not set(outputs[i]) & set(MIX[i].banned_ids), i
    assert ban_live == set(BANNED_ROWS)  # the ban moved the pick off the raw argmax
    for a, b in zip(gens["host"], gens["batch"]):
        if a is not None:
            assert torch.equal(a.get_state(), b.get_state())
    assert sampled_rows == {i for i, p in enumerate(MIX) if not p.greedy}  # it really draws
    assert len(set(outputs[2])) > 50  # penalized greedy moves off the argmax


def test_top_p_boundary_and_ties_agree():
    """Top-p cutting inside runs of tied values, and mass landing exactly on p (8 equal
    logits: every probability is exactly 1/8): both samplers cut at the same token, the
    reference's (the token whose mass before equals p stays)."""
    runs = [
        (torch.tensor([2.0] * 8 + [1.0] * 8 + [0.0] * 48), (0.25, 0.5, 0.5 + 1e-9, 0.73, 0.999)),
        (torch.zeros(8), (0.125, 0.25, 0.5, 0.625, 0.875)),
    ]
    rows = 32
    for base, ps in runs:
        for p in ps:
            for temp in (1.0, 0.5):
                params = [SamplingParams(temperature=temp, top_p=p, seed=s) for s in range(rows)]
                logits = base.expand(rows, base.numel()).clone()
                outs = [[]] * rows
                want = Sampler()(
                    logits, params, outs, [make_generator(s, "cpu") for s in range(rows)]
                )
                got = batched(logits, params, outs, [make_generator(s, "cpu") for s in range(rows)])
                assert got == want, (p, temp)
    # the exact case really sits on the boundary: p = 1/2 keeps 5 of the 8 (mass 1/2 before
    # the 5th), and so does the batched sampler
    kept = torch.isfinite(top_p_mask(torch.zeros(8), 0.5)).sum()
    assert kept == 5
    rows = 64
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=s) for s in range(rows)]
    zeros = torch.zeros(rows, 8)
    got = batched(zeros, params, [[]] * rows, [make_generator(s, "cpu") for s in range(rows)])
    assert set(got) == {0, 1, 2, 3, 4}


def test_bitmask_bans_equal_the_host_index_fill():
    """`ban` over bitmask rows == `apply_bans` per row, at byte edges and the last id of a
    vocabulary that is not a multiple of 8; rows without bans (and padded rows) untouched."""
    vocab = 203
    sets = [(0,), (7, 8, 15, 16), (202,), tuple(range(0, 203, 3)), ()]
    params = [SamplingParams(banned_ids=b) for b in sets] + [None]
    st = Staging(sampling_fields(len(params), vocab), CPU)
    pack_rows(st.host, params, [[]] * len(params), vocab)
    st.upload()
    x = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(2))
    got = ban(x, st.dev["banned"])
    for i, b in enumerate(sets):
        assert torch.equal(got[i], apply_bans(x[i], b)), b
    assert torch.equal(got[-1], x[-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pack_rows(st.host, [SamplingParams(banned_ids=(vocab,))], [[]], vocab)


# ---------------------------------------------------------------------------------------
# Distribution


def _target_probs(logits: torch.Tensor, p: SamplingParams, history: list[int]) -> torch.Tensor:
    """The host rule's probabilities in float64 (the exact distribution to draw from)."""
    x = apply_repetition_penalty(
        logits.float(), torch.tensor(history, dtype=torch.long), p.repetition_penalty
    )
    x = x / p.temperature
    x = top_p_mask(top_k_mask(x, p.top_k), p.top_p)
    return x.double().softmax(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=12),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.4),
    ],
)
def test_draws_follow_the_filtered_distribution(params):
    vocab, rows, rounds = 40, 2000, 20
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    history = [3, 7, 7, 11, 0]
    probs = _target_probs(logits, params, history)
    g = torch.Generator().manual_seed(1234)  # one stream for every row: deterministic
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(rounds):
        ids = batched(logits.expand(rows, vocab), [params] * rows, [history] * rows, [g] * rows)
        counts += torch.bincount(torch.tensor(ids), minlength=vocab).double()
    n = rows * rounds
    support = probs > 0
    assert counts[~support].sum() == 0  # nothing outside the filtered set
    expected = probs[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), chi2 / 2))
    assert p_value > 1e-3, f"chi2 {chi2:.1f} on {dof} dof, p {p_value:.2e}"
    assert dof >= 4  # the filters leave a real distribution to test


# ---------------------------------------------------------------------------------------
# Batch composition


def test_seeded_row_independent_of_batch_mates_and_position():
    vocab, steps = 300, 40
    g = torch.Generator().manual_seed(9)
    table = torch.randn(steps, vocab, generator=g)
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=77)
    runs = []
    for mates, where in ((0, 0), (3, 0), (5, 2), (7, 7)):
        rng = random.Random(mates)
        gen = make_generator(77, "cpu")
        out: list[int] = []
        for step in range(steps):
            n = mates + 1
            logits = torch.randn(n, vocab, generator=g)
            logits[where] = table[step]
            params = [MIX[rng.randrange(len(MIX))] for _ in range(n)]
            params[where] = sp
            gens = [make_generator(p.seed, "cpu") for p in params]
            gens[where] = gen
            outs = [[rng.randrange(vocab) for _ in range(rng.randrange(30))] for _ in range(n)]
            outs[where] = out
            out.append(batched(logits, params, outs, gens)[where])
        runs.append(out)
    assert all(r == runs[0] for r in runs)
    assert len(set(runs[0])) > 5


# ---------------------------------------------------------------------------------------
# Penalty rows wider than the graph's history


def test_wide_history_penalizes_every_distinct_id():
    vocab = 1000
    out = list(range(600)) + list(range(300))  # 600 distinct ids, window None: all count
    params = SamplingParams(repetition_penalty=1.7, repetition_window=None)
    st = Staging(sampling_fields(2, vocab), CPU)
    packed = pack_rows(st.host, [params, None], [out, []], vocab)
    assert list(packed.wide) == [0]
    st.upload()
    hist = widened_history(st.dev["history"][:2], st.host["history"], packed.wide, vocab)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    got = penalize(logits, hist, st.dev["penalty"][:2])
    assert torch.equal(got[0], apply_repetition_penalty(logits[0], torch.tensor(out), 1.7))
    assert torch.equal(got[1], logits[1])
    # A history that fits after de-duplication stays in the regular width.
    packed = pack_rows(st.host, [params], [list(range(100)) * 5], vocab)
    assert not packed.wide and HISTORY_WIDTH > 100


def test_pending_newest_id_is_left_for_the_device():
    st = Staging(sampling_fields(1, 50), CPU)
    params = SamplingParams(repetition_penalty=1.5)
    pack_rows(st.host, [params], [[5, 6, PENDING_ID]], 50)
    row = st.host["history"][0].tolist()
    assert row[:2] == [5, 6] and set(row[2:]) == {50}  # column W-1 padded: the device fills it


# ---------------------------------------------------------------------------------------
# The engine: device sampling == host sampling

CFG = tiny_llm_config()


@pytest.fixture(scope="module")
def model() -> Qwen3LM:
    return random_lm(CFG)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


REQUESTS = {
    "greedy": (_prompt(9, 1), SamplingParams(max_tokens=200, stop_ids=())),
    "pen": (_prompt(30, 2), SamplingParams(max_tokens=200, stop_ids=(), repetition_penalty=1.8)),
    # window None over 300 tokens: more distinct ids than the regular history holds
    "pen_all": (
        _prompt(17, 3),
        SamplingParams(max_tokens=300, stop_ids=(), repetition_penalty=3.0, repetition_window=None),
    ),
    "sampled": (
        _prompt(21, 4),
        SamplingParams(
            temperature=0.8,
            top_k=50,
            top_p=0.9,
            repetition_penalty=1.2,
            max_tokens=150,
            stop_ids=(),
            seed=11,
        ),
    ),
    "hot": (_prompt(5, 5), SamplingParams(temperature=1.5, max_tokens=120, stop_ids=(), seed=12)),
    # bans, greedy (every even id) and sampled (every third id)
    "ban_greedy": (
        _prompt(11, 6),
        SamplingParams(max_tokens=100, stop_ids=(), banned_ids=tuple(range(0, 1000, 2))),
    ),
    "ban_sampled": (
        _prompt(14, 7),
        SamplingParams(
            temperature=0.9,
            top_k=30,
            top_p=0.9,
            max_tokens=100,
            stop_ids=(),
            seed=13,
            banned_ids=tuple(range(0, 1000, 3)),
        ),
    ),
}
ARRIVAL = {
    "greedy": 0,
    "pen": 0,
    "pen_all": 1,
    "sampled": 3,
    "hot": 8,
    "ban_greedy": 2,
    "ban_sampled": 5,
}


def _engine(model, launch_ahead: bool = False, **kw) -> LLMEngine:
    """launch_ahead: launch step N+1 before finishing step N, as on CUDA."""
    base = {
        "num_blocks": 512,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,  # prompts chunk; decode and prefill rows share steps
    }
    eng = LLMEngine(model, EngineConfig(**{**base, **kw}))
    eng.launch_ahead = launch_ahead
    return eng


def _host_sampled(eng: LLMEngine) -> LLMEngine:
    """The engine with the reference host sampler (tests/_sampling_ref.py) in place of the
    batched one, row by row on the host; synchronous steps only (no pending ids)."""

    def sample(logits, sampling, last_ids, newest):
        assert not newest and not eng.launch_ahead
        ids = Sampler()(
            logits,
            [s.seq.sampling for s in sampling],
            [s.seq.output_ids for s in sampling],  # the penalty counts generated ids only
            [s.seq.generator for s in sampling],
        )
        return torch.tensor(ids, device=logits.device)

    eng.runner._sample_eager = sample
    return eng


def _staggered(eng: LLMEngine, requests=REQUESTS, arrival=ARRIVAL) -> dict[str, list[int]]:
    got = {rid: [] for rid in requests}
    step = 0
    while step <= max(arrival.values()) or eng.has_unfinished():
        for rid, (prompt, sp) in requests.items():
            if arrival[rid] == step:
                eng.add_request(rid, prompt, sp)
        for o in eng.step():
            got[o.request_id] += o.token_ids
        step += 1
    return got


def test_engine_device_sampling_equals_host_sampling(model):
    torch.manual_seed(0)
    host = _staggered(_host_sampled(_engine(model)))
    torch.manual_seed(0)
    dev = _staggered(_engine(model))
    for rid in REQUESTS:
        assert dev[rid] == host[rid], rid
    assert len(set(host["pen_all"])) >= HISTORY_WIDTH  # the wide-history path ran
    for rid in ("ban_greedy", "ban_sampled"):
        assert not set(host[rid]) & set(REQUESTS[rid][1].banned_ids), rid
    assert len(set(host["sampled"])) > 20 and host["greedy"] != host["pen"]


# ---------------------------------------------------------------------------------------
# Launching ahead: step N+1 planned and launched before step N's ids reach the host


def _every_output(eng: LLMEngine, requests, arrival, hidden=(), abort_at=None):
    """`_staggered`, keeping all of each request's outputs: its ids, its hidden rows (for
    the requests in `hidden`), its finish reason; `abort_at` = {rid: step} aborts then.
    Checks that the engine never holds a block nobody owns after a step."""
    got = {rid: ([], [], None) for rid in requests}
    step = 0
    while step <= max(arrival.values()) or eng.has_unfinished():
        for rid, (prompt, sp) in requests.items():
            if arrival[rid] == step:
                eng.add_request(rid, prompt, sp, return_hidden=rid in hidden)
        for rid, at in (abort_at or {}).items():
            if at == step:
                assert eng.abort(rid)
        for o in eng.step():
            ids, rows, _ = got[o.request_id]
            ids += o.token_ids
            if o.hidden is not None:
                rows.append(o.hidden)
            if o.finished:
                got[o.request_id] = (ids, rows, o.finish_reason)
        bm, held = eng.block_manager, eng.scheduler.running + list(eng.scheduler.waiting)
        assert bm.num_used == len({b for s in held for b in s.block_table})
        step += 1
    assert eng.block_manager.num_used == 0
    return {rid: (ids, torch.cat(rows) if rows else None, why) for rid, (ids, rows, why) in got.items()}


def _stopping_requests(model) -> dict:
    """REQUESTS but the unseeded one, plus greedy and seeded requests that stop on an id
    they draw mid-run (so a stopped row rides along in the step launched after it)."""
    reqs = {k: v for k, v in REQUESTS.items() if k != "hot"}  # every sampled one seeded
    for i, (name, sp) in enumerate(
        [("stop_greedy", SamplingParams(max_tokens=40, stop_ids=())),
         ("stop_seeded", SamplingParams(temperature=0.9, top_k=40, max_tokens=40, stop_ids=(),
                                        seed=21, repetition_penalty=1.3))]
    ):
        prompt = _prompt(12 + i, 60 + i)
        drawn = _engine(model).generate({"x": prompt}, sp)["x"]
        reqs[name] = (prompt, replace(sp, stop_ids=(drawn[7 + 5 * i],)))
    return reqs


def test_launch_ahead_equals_synchronous(model):
    """The same ids, hidden rows and finish reasons as the synchronous steps, over staggered
    arrivals with chunked prefills, penalties (one wider than the graph's history), bans,
    seeded sampling and stops mid-run; and no block leaks on the way."""
    reqs = _stopping_requests(model)
    arrival = {**{k: ARRIVAL[k] for k in reqs if k in ARRIVAL}, "stop_greedy": 4, "stop_seeded": 6}
    hidden = ("greedy", "stop_greedy", "stop_seeded")
    sync = _every_output(_engine(model), reqs, arrival, hidden)
    eng = _engine(model, launch_ahead=True)
    assert eng.launch_ahead and not _engine(model).launch_ahead  # CPU: off unless asked
    ahead = _every_output(eng, reqs, arrival, hidden)
    for rid in reqs:
        (ids, rows, why), (ref, ref_rows, ref_why) = ahead[rid], sync[rid]
        assert ids == ref and why == ref_why, rid
        if rid in hidden:
            assert rows.shape[0] == len(ids) - 1, rid  # a row per id fed back in
            # batches differ for a step after a finish: fp32 summation order only
            torch.testing.assert_close(rows, ref_rows, rtol=1e-5, atol=1e-5, msg=rid)
    for name in ("stop_greedy", "stop_seeded"):
        ids, _, why = sync[name]
        assert why == "stop" and len(ids) < 40 and ids[-1] in reqs[name][1].stop_ids, name
    # Ended by length only, the two batch the same rows in every step (a sequence whose
    # pending id is its last is not scheduled and holds no slot): bf16 would then agree too.
    length_only = {k: v for k, v in reqs.items() if not k.startswith("stop")}
    plans = []
    for ahead in (False, True):
        eng = _engine(model, launch_ahead=ahead)
        plans.append(_logged_plans(eng))
        _every_output(eng, length_only, arrival)
    assert plans[0] == plans[1] and len(plans[0]) > 300


def _logged_plans(eng: LLMEngine) -> list[list[tuple[str, int, int]]]:
    """A list that the engine's scheduler fills with every non-empty plan's shares."""
    log, schedule = [], eng.scheduler.schedule

    def logged():
        plan = schedule()
        if plan.seqs:
            log.append([(x.seq.request_id, x.start, x.num_new) for x in plan.seqs])
        return plan

    eng.scheduler.schedule = logged
    return log


def test_launch_ahead_aborts_and_preemption(model, monkeypatch):
    """Aborts of requests with a step in flight, and preemption of sequences whose newest
    id is still pending (a cache of 24 blocks): the others' ids equal the synchronous run's,
    the aborted ones' ids are a prefix of theirs, and every block is freed."""
    reqs = {k: (p, replace(sp, max_tokens=min(sp.max_tokens, 40)))
            for k, (p, sp) in _stopping_requests(model).items()}
    arrival = {k: i for i, k in enumerate(reqs)}
    aborts = {"pen": 12, "ban_greedy": 30}
    small = {"num_blocks": 24, "max_num_seqs": 4}
    sync = _every_output(_engine(model, **small), reqs, arrival, abort_at=aborts)
    eng = _engine(model, launch_ahead=True, **small)
    pending = []  # preempted with the newest id still pending, each time
    preempt = eng.scheduler._preempt
    monkeypatch.setattr(eng.scheduler, "_preempt", lambda seq: (
        pending.append(seq.output_ids[-1:] == [PENDING_ID]), preempt(seq)))
    ahead = _every_output(eng, reqs, arrival, abort_at=aborts)
    assert any(pending) and eng.stats().num_preemptions == len(pending)
    for rid in reqs:
        (ids, _, why), (ref, _, ref_why) = ahead[rid], sync[rid]
        if rid in aborts:
            assert why == "abort" and ids == ref[: len(ids)], rid
        else:
            assert ids == ref and why == ref_why, rid


def test_pending_token_must_come_from_the_previous_step(model):
    eng = _engine(model)
    eng.add_request("a", _prompt(5, 1), SamplingParams(max_tokens=4, stop_ids=()))
    eng.step()  # 'a' sampled its first token
    eng.add_request("b", _prompt(5, 2), SamplingParams(max_tokens=4, stop_ids=()))
    eng._seqs["b"].output_ids.append(PENDING_ID)  # but 'b' was not in that step
    with pytest.raises(RuntimeError, match="did not sample"):
        eng.runner.launch(eng.scheduler.schedule())


def test_staged_page_table_equals_paged_csr():
    """The decode graphs plan from a page table written on the host into pinned staging;
    it must be the CSR FlashInfer gets from `AttnMetadata.paged_csr` for the padded batch."""
    block, scratch, bucket = 4, 99, 8
    kv_lens = [1, 4, 5, 17, 30]
    rng = random.Random(0)
    tables = [rng.sample(range(60), -(-n // block) + rng.randrange(2)) for n in kv_lens]
    st = Staging(decode_fields(bucket, 128), CPU)
    h = st.host
    used = page_table(
        kv_lens, tables, block, scratch, h["kv_indptr"], h["kv_indices"], h["kv_last_page_len"]
    )
    padded = tables + [[scratch]] * (bucket - len(tables))
    width = max(map(len, padded))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in padded], dtype=torch.int32)
    lens = torch.tensor(kv_lens + [1] * (bucket - len(kv_lens)), dtype=torch.int32)
    meta = AttnMetadata(
        torch.arange(bucket + 1, dtype=torch.int32), lens, bt, bt, torch.zeros(0), True, block
    )
    indptr, indices, last = meta.paged_csr()
    assert h["kv_indptr"].tolist() == indptr.tolist()
    assert h["kv_indices"][:used].tolist() == indices.tolist()
    assert h["kv_last_page_len"].tolist() == last.tolist()


# ---------------------------------------------------------------------------------------
# The decode-graph step's host side, on CPU: every buffer, staging, page table, pending fill
# and in-graph sampler as on CUDA; only the capture (a direct call) and FlashInfer's kernel
# (the torch backend over the page table the step planned) are replaced.


class _DirectRunner:
    """GraphRunner's interface; `run` calls the step instead of replaying a capture."""

    def __init__(self, max_graphs: int, warmup_iters: int) -> None:
        self.fns, self.replays = {}, 0

    def add(self, key, fn, example=()) -> None:
        self.fns[key] = fn

    def run(self, key, inputs, fn=None) -> None:
        self.fns[key]()
        self.replays += 1


class _PlannedTorchAttention(FlashInferAttention):
    """Attends with the torch backend over the CSR page table last planned."""

    def __init__(self, cfg: LLMConfig, max_num_pages: int, block_size: int) -> None:
        self.num_qo_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.block_size, self.max_num_pages = cfg.head_dim, block_size, max_num_pages
        self.dtype, self.csr = torch.float32, None

    def graph_decode_wrapper(self, bs: int):
        owner = self

        class Wrapper:
            def plan(self, indptr, indices, last, *args, **kwargs) -> None:
                owner.csr = (indptr.clone(), indices.clone(), last.clone())

        return Wrapper()

    def use_graph_wrapper(self, bs: int | None) -> None:
        pass

    def prepare(self, meta: AttnMetadata) -> None:
        self.csr = meta.paged_csr()

    def forward(self, kv, q, k, v, meta, scale, rows=None):
        indptr, indices, last = self.csr
        pages = (indptr[1:] - indptr[:-1]).tolist()
        bt = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        for b, (lo, n) in enumerate(zip(indptr.tolist(), pages)):
            bt[b, :n] = indices[lo : lo + n]
        lens = (torch.tensor(pages) - 1) * self.block_size + last
        planned = AttnMetadata(
            torch.arange(len(pages) + 1), lens, bt, bt, meta.slot_mapping, True, self.block_size
        )
        return TorchAttention().forward(kv, q, k, v, planned, scale, rows)


def _cpu_graph_engine(model, monkeypatch, **kw) -> LLMEngine:
    monkeypatch.setattr(graphs_module, "GraphRunner", _DirectRunner)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    eng = _engine(model, **kw)
    backend = _PlannedTorchAttention(CFG, eng.kv_cache.num_blocks + 1, eng.kv_cache.block_size)
    g = DecodeGraphs(
        model, eng.kv_cache, backend, (1, 2, 4), CFG.head_dim**-0.5, torch.float32, CPU
    )
    g.capture()
    eng.runner.graphs = LLMGraphRunner(decode=g)
    return eng


def test_graph_step_host_side_on_cpu(model, monkeypatch):
    torch.manual_seed(0)
    ref = _staggered(_host_sampled(_engine(model)))
    torch.manual_seed(0)
    eng = _cpu_graph_engine(model, monkeypatch)
    got = _staggered(eng)
    assert eng.runner.graphs.decode_replays > 250
    for rid in REQUESTS:
        assert got[rid] == ref[rid], rid
    reqs = {k: v for k, v in REQUESTS.items() if k != "hot"}
    eng = _cpu_graph_engine(model, monkeypatch, launch_ahead=True)
    ahead = _staggered(eng, reqs, {k: ARRIVAL[k] for k in reqs})  # pending ids in graph steps
    for rid in reqs:
        assert ahead[rid] == ref[rid], ("launch ahead", rid)
    # hidden rows of decode steps come back through the graph's pinned copy
    rows = {}
    for eng in (_cpu_graph_engine(model, monkeypatch), _engine(model)):
        eng.add_request("h", _prompt(13, 9), REQUESTS["sampled"][1], return_hidden=True)
        hid = []
        while eng.has_unfinished():
            hid += [o.hidden for o in eng.step() if o.hidden is not None]
        rows[eng.uses_cuda_graphs] = torch.cat(hid)
    assert rows[True].shape[0] == REQUESTS["sampled"][1].max_tokens - 1
    assert torch.equal(rows[True], rows[False])


# ---------------------------------------------------------------------------------------
# CUDA: the decode graph with in-graph sampling


@pytest.mark.gpu
@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_graph_sampling_matches_eager_on_cuda():
    m = random_lm(CUDA_LLM).to("cuda", torch.bfloat16)
    reqs = {k: v for k, v in REQUESTS.items() if k != "hot"}
    arrival = {k: ARRIVAL[k] for k in reqs}
    outs = {}
    for graphs, host in ((False, True), (False, False), (True, False)):
        eng = LLMEngine(
            m,
            EngineConfig(num_blocks=256, block_size=16, cuda_graphs=graphs, max_num_seqs=4,
                         max_num_batched_tokens=64),
            "cuda",
            torch.bfloat16,
        )
        eng.launch_ahead = False
        if host:
            _host_sampled(eng)
        assert eng.uses_cuda_graphs == graphs
        replays = eng.runner.graphs.decode_replays if graphs else 0
        outs[(graphs, host)] = _staggered(eng, reqs, arrival)
        if graphs:
            assert eng.runner.graphs.decode_replays - replays > 200  # decode ran as graphs
    ref = outs[(False, True)]  # eager, host sampler
    for key, got in outs.items():
        for rid in reqs:
            assert got[rid] == ref[rid], (key, rid)


@pytest.mark.gpu
@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_launch_ahead_matches_synchronous_on_cuda():
    """The engine launching ahead against the synchronous engine, bf16, FlashInfer, decode
    graphs with pending ids fed inside them (penalties, bans, seeded sampling). The staggered
    arrivals end by length only, so both runs batch the same rows step for step (a sequence
    whose pending id is its last is not scheduled again), and the ids must be equal. Each run
    on its own engine: no prefix-cache hits."""
    m = random_lm(CUDA_LLM).to("cuda", torch.bfloat16)
    reqs = {k: (REQUESTS[k][0], replace(REQUESTS[k][1], max_tokens=120 + 9 * i))
            for i, k in enumerate(("pen", "pen_all", "sampled", "ban_sampled"))}
    arrival = {"pen": 0, "pen_all": 0, "sampled": 3, "ban_sampled": 5}

    def engine(ahead: bool) -> LLMEngine:
        cfg = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=4,
                           max_num_batched_tokens=64, enable_prefix_caching=False)
        eng = LLMEngine(m, cfg, "cuda", torch.bfloat16)
        eng.launch_ahead = ahead
        return eng

    sync = _staggered(engine(False), reqs, arrival)
    eng = engine(True)
    assert eng.launch_ahead and eng.uses_cuda_graphs
    ahead = _staggered(eng, reqs, arrival)
    for rid, (_, sp) in reqs.items():
        assert len(ahead[rid]) == sp.max_tokens and ahead[rid] == sync[rid], ("launch ahead", rid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_sampler_on_cuda_equals_host_and_alone():
    """At the Thinker's vocabulary size, on the GPU's kernels: every row of a batch draws
    what the host sampler draws, and what it draws alone (bucket 1)."""
    vocab, steps = 151936, 12
    g = torch.Generator(device="cuda").manual_seed(0)
    gens = {k: [make_generator(p.seed, "cuda") for p in MIX] for k in ("host", "batch")}
    alone = [make_generator(p.seed, "cuda") for p in MIX]
    outputs: list[list[int]] = [[] for _ in MIX]
    for step in range(steps):
        logits = (torch.randn(len(MIX), vocab, generator=g, device="cuda") * 3).bfloat16()
        torch.manual_seed(step)
        want = Sampler()(logits, MIX, outputs, gens["host"])
        torch.manual_seed(step)
        got = batched(logits, MIX, outputs, gens["batch"])
        assert got == want, f"step {step}"
        for i, p in enumerate(MIX):
            if p.seed is not None or p.greedy:
                one = batched(logits[i : i + 1], [p], [outputs[i]], [alone[i]])
                assert one == [want[i]], f"step {step}, row {i} alone"
        for i, tok in enumerate(want):
            outputs[i].append(tok)


# ---------------------------------------------------------------------------------------
# Compiled layers: each layer's halves around attention as Inductor graphs (compile_ops)


def _compiled_copy(model: Qwen3LM) -> Qwen3LM:
    m = copy.deepcopy(model)
    m.fuse_projections()
    m.compile_ops()
    return m


def _decode_hidden(eng: LLMEngine, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    eng.add_request("h", prompt, sp, return_hidden=True)
    rows = []
    while eng.has_unfinished():
        rows += [o.hidden for o in eng.step() if o.hidden is not None]
    return torch.cat(rows).float()


@torch.no_grad()
def test_compiled_layers_equal_the_plain_forward_on_cpu(model):
    """compile_ops (Inductor's CPU code, fp32) against the plain layers through the engine:
    the same tokens for every request of the staggered mix (prefill chunks beside decodes,
    penalties, bans, seeded draws), hidden rows of a 120-token run to fp32 rounding with no
    drift; and one graph per function and case, shared by every layer and step size."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import pipeline.thinker.llm as llm_module

    torch._dynamo.reset()  # count this test's graphs only
    compiled = _compiled_copy(model)
    reqs = {k: v for k, v in REQUESTS.items() if k != "hot"}
    arrival = {k: ARRIVAL[k] for k in reqs}
    ref = _staggered(_engine(model), reqs, arrival)
    got = _staggered(_engine(compiled), reqs, arrival)
    for rid in reqs:
        assert got[rid] == ref[rid], rid
    sp = SamplingParams(max_tokens=120, stop_ids=())
    plain_rows = _decode_hidden(_engine(model), _prompt(40, 9), sp)
    rows = _decode_hidden(_engine(compiled), _prompt(40, 9), sp)
    diff = (rows - plain_rows).abs().amax(dim=-1)
    assert diff.max() <= 1e-5 * plain_rows.abs().max(), diff.max()
    assert diff[-30:].mean() <= 2 * diff[:30].mean() + 1e-6, (diff[:30], diff[-30:])
    # layer_pre: the first layer (no MLP output to add) and the others, each at one token
    # and at many; layer_post and final_norm: one token and many.
    counts = {
        fn.__name__: len(_debug_get_cache_entry_list(fn.__code__))
        for fn in (llm_module.layer_pre, llm_module.layer_post, llm_module.final_norm)
    }
    assert counts == {"layer_pre": 4, "layer_post": 2, "final_norm": 2}, counts


@pytest.mark.gpu
@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_compiled_layers_match_the_plain_forward_on_cuda():
    """bf16 on the GPU, decode and whole-step graphs on, FlashInfer: compiled layers
    draw the same greedy and seeded tokens as the plain ones over the staggered mix, and a
    200-token run's hidden rows stay within bf16 rounding of the plain run's, the last rows
    no further off than the first (no drift)."""
    m = random_lm(CUDA_LLM).to("cuda", torch.bfloat16)
    reqs = {k: v for k, v in REQUESTS.items() if k != "hot"}
    arrival = {k: ARRIVAL[k] for k in reqs}
    outs, hidden = {}, {}
    for name, model in (("plain", m), ("compiled", _compiled_copy(m))):
        eng = LLMEngine(
            model,
            EngineConfig(num_blocks=256, block_size=16, max_num_seqs=4,
                         max_num_batched_tokens=64, enable_prefix_caching=False),
            "cuda",
            torch.bfloat16,
        )
        outs[name] = _staggered(eng, reqs, arrival)
        assert eng.runner.graphs.decode_replays > 200 and eng.runner.graphs.prefill_steps > 0
        hidden[name] = _decode_hidden(eng, _prompt(90, 9), REQUESTS["greedy"][1])
    for rid in reqs:
        assert outs["compiled"][rid] == outs["plain"][rid], rid
    diff = (hidden["compiled"] - hidden["plain"]).abs().amax(dim=-1)
    scale = hidden["plain"].abs().amax()
    print(f"compiled vs plain layers: max |diff| / max |h| {(diff.max() / scale).item():.2e}")
    assert diff.max() <= 3e-2 * scale, (diff.max(), scale)
    assert diff[-50:].mean() <= 2 * diff[:50].mean() + 1e-3 * scale, (diff[:50], diff[-50:])
