"""Per-step budget: every running decode gets its token in every step, and a step does at
most `max_prefill_tokens_per_step` prompt tokens and `max_encoder_items_per_step` encoder
items, so a new request holds the running decodes up by one bounded step. Media are
encoded across steps and a prompt's prefill chunks start once the rows they need exist;
the outputs equal the unbudgeted run's (chunked prefill and encoder batching: within the
bound tests/test_thinker.py uses for batched == alone)."""

from __future__ import annotations

import pytest
import torch
from _tiny_lm import random_lm, tiny_llm_config  # tests/ is on sys.path
from test_thinker import _png, _wav  # tests/ is on sys.path

from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.thinker.llm_engine.kv_cache import BlockManager
from pipeline.thinker.llm_engine.scheduler import Scheduler, Sequence
from pipeline.handoff import AudioInput, ImageInput, SamplingParams
from pipeline.processing.processor import Processor
from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from pipeline.thinker.llm import Qwen3LM

SP = SamplingParams(max_tokens=100, stop_ids=(7,))


def _seq(rid: str, n: int, num_ready: int | None = None) -> Sequence:
    seq = Sequence(rid, list(range(10, 10 + n)), SP)
    if num_ready is not None:
        seq.num_ready = num_ready
    return seq


def _decoding(seqs: list[Sequence]) -> list[Sequence]:
    return [q for q in seqs if q.output_ids and q.num_uncomputed == 1]


def _step(s: Scheduler):
    """One step with a fake model that samples token 1; checks the per-step bounds."""
    decoding = _decoding(s.running)
    plan = s.schedule()
    shares = {id(x.seq): x for x in plan.seqs}
    for q in decoding:
        assert id(q) in shares and shares[id(q)].num_new == 1 and shares[id(q)].sample, q
    assert plan.num_tokens <= s.max_num_batched_tokens
    if decoding:  # the prefill bound is for steps somebody waits on
        assert sum(x.num_new for x in plan.seqs if x.num_new > 1) <= s.max_prefill_tokens
    s.postprocess(plan, [1 for x in plan.seqs if x.sample])
    return plan


# ---------------------------------------------------------------------------------------
# Scheduler


def test_scripted_arrivals_keep_every_decode_in_every_step():
    s = Scheduler(BlockManager(512, 4), 8, max_num_batched_tokens=40, max_prefill_tokens=16)
    arrivals = {0: [("a", 30)], 2: [("b", 50)], 3: [("c", 7), ("d", 70)], 9: [("e", 33)]}
    for i in range(40):
        for rid, n in arrivals.get(i, []):
            s.add(_seq(rid, n))
        _step(s)
    assert not s.waiting and len(_decoding(s.running)) == 5


def test_prefill_of_an_older_sequence_does_not_push_out_a_newer_decode():
    """b (older) waits for its media after 8 tokens while c (newer) starts decoding; once
    b's rows come, its chunks leave one token of the budget to c in every step."""
    s = Scheduler(BlockManager(256, 4), 8, max_num_batched_tokens=8)
    a, b, c = _seq("a", 4), _seq("b", 60, num_ready=8), _seq("c", 3)
    for q in (a, b, c):
        s.add(q)
    for _ in range(3):
        _step(s)
    assert b.num_computed == 8 and not b.output_ids and c.output_ids  # b waits for its rows
    b.num_ready = 10**9
    while not b.output_ids:
        left = b.num_uncomputed
        plan = _step(s)
        assert len(plan.seqs) == 3 and plan.num_tokens == min(8, 2 + left)  # b: the rest
    assert b.num_computed == 60


def test_nothing_is_computed_past_num_ready():
    s = Scheduler(BlockManager(64, 4), 8, max_num_batched_tokens=100)
    q = _seq("q", 30, num_ready=0)
    s.add(q)
    assert s.schedule().is_empty and q in s.waiting  # nothing ready: not admitted
    q.num_ready = 10
    for _ in range(2):
        _step(s)
    assert q.num_computed == 10 and not q.output_ids
    q.num_ready = 10**9
    _step(s)
    assert q.num_computed == 30 and q.output_ids == [1]


# ---------------------------------------------------------------------------------------
# LLM engine (tiny Qwen3, fp32, torch backend)

CFG = tiny_llm_config()


@pytest.fixture(scope="module")
def model() -> Qwen3LM:
    return random_lm(CFG)


def _engine(model, **kw) -> LLMEngine:
    base = {"num_blocks": 256, "block_size": 4, "attention_backend": "torch"}
    return LLMEngine(model, EngineConfig(**{**base, **kw}))


def _scripted(eng: LLMEngine, arrivals: dict[int, list[tuple[str, int]]]) -> dict[str, list]:
    sp = SamplingParams(max_tokens=12, stop_ids=())
    out: dict[str, list[int]] = {}
    i = 0
    while i <= max(arrivals) or eng.has_unfinished():
        for rid, n in arrivals.get(i, []):
            g = torch.Generator().manual_seed(n)
            eng.add_request(rid, torch.randint(0, 1000, (n,), generator=g).tolist(), sp)
            out[rid] = []
        for o in eng.step():
            out[o.request_id] += o.token_ids
        i += 1
    return out


def test_engine_budget_equals_unbudgeted_and_reports_its_work(model):
    arrivals = {0: [("a", 20)], 3: [("b", 90)], 5: [("c", 40), ("d", 7)]}
    budgeted = _engine(model, max_num_batched_tokens=32, max_prefill_tokens_per_step=16)
    plain = _engine(model, max_num_batched_tokens=512, max_prefill_tokens_per_step=None)
    assert _scripted(budgeted, arrivals) == _scripted(plain, arrivals)
    st, ref = budgeted.stats(), plain.stats()
    assert st.max_decode_wait_steps == 0 and st.max_step_prefill_tokens == 16
    assert ref.max_step_prefill_tokens == 90 and st.max_step_ms > 0


def _drain(eng: LLMEngine) -> list[int]:
    ids: list[int] = []
    while eng.has_unfinished():
        ids += [t for o in eng.step() for t in o.token_ids]
    return ids


def test_rows_supplied_over_steps_equal_rows_given_at_once(model):
    """Two media spans whose rows come one step apart; the prompt is computed up to the
    first span still without rows, then on: same tokens as a request with all rows."""
    from pipeline.thinker.llm_engine.scheduler import MediaSpan

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1000, (60,), generator=g).tolist()
    spans = [MediaSpan(10, 20, "image:a:0"), MediaSpan(30, 45, "image:b:0")]
    rows = [torch.randn(sp.end - sp.start, CFG.hidden_size, generator=g) for sp in spans]
    pos = torch.cat([torch.arange(sp.start, sp.end) for sp in spans])
    sp = SamplingParams(max_tokens=6, stop_ids=())
    whole = _engine(model, max_num_batched_tokens=512, max_prefill_tokens_per_step=None)
    whole.add_request("r", prompt, sp, pos, torch.cat(rows), mm_spans=spans)
    ref = _drain(whole)

    eng = _engine(model, max_num_batched_tokens=512, max_prefill_tokens_per_step=None)
    with pytest.raises(ValueError, match="no loader"):
        eng.add_request("bad", prompt, sp, mm_spans=spans)
    eng.add_request("r", prompt, sp, mm_spans=spans, num_ready=10)
    eng.step()
    assert eng._seqs["r"].num_computed == 10
    with pytest.raises(ValueError, match="before num_ready"):
        eng.supply_media("r", [spans[0]], rows[:1])  # None = all ready, but span 1 has none
    eng.supply_media("r", [spans[0]], rows[:1], num_ready=30)
    eng.step()
    assert eng._seqs["r"].num_computed == 30
    with pytest.raises(ValueError, match="twice"):
        eng.supply_media("r", [spans[0]], rows[:1])
    eng.supply_media("r", [spans[1]], rows[1:])
    got = _drain(eng)
    assert got == ref and not eng.has_unfinished()


def test_configs_refuse_bad_budgets():
    with pytest.raises(ValueError, match="max_prefill_tokens_per_step"):
        EngineConfig(num_blocks=8, max_prefill_tokens_per_step=0)
    with pytest.raises(ValueError, match="max_encoder_items_per_step"):
        ThinkerEngineConfig(max_encoder_items_per_step=-1)
    with pytest.raises(ValueError, match="audio_seconds_per_item"):
        ThinkerEngineConfig(audio_seconds_per_item=0)


# ---------------------------------------------------------------------------------------
# Thinker (embedded tiny checkpoint, fp32 on CPU)


@pytest.fixture(scope="module")
def thinker(tiny_source):
    def make(
        items: int, prefill: int | None, cache: int = 0, device: str = "cpu", **llm
    ) -> ThinkerEngine:
        # The torch attention backend: float32 on CUDA too (FlashInfer's kernels are half precision).
        # Synchronous steps (launch ahead is CUDA's default): the scripts below check what
        # each step returns, and launching ahead returns a step's ids one step later.
        llm = {"kv_cache_bytes": 32 * 2**20, "block_size": 4, "attention_backend": "torch",
               "launch_ahead": False, **llm}
        cfg = ThinkerEngineConfig(
            llm=EngineConfig(max_prefill_tokens_per_step=prefill, **llm),
            encoder_cache_size=cache,
            max_encoder_items_per_step=items,
            dtype="float32",  # the equality below is a float32 one on CUDA too
            compile_mm_encoder=False,
            compile_llm_ops=False,
            warm_up=False,  # the scripted schedules count every step's work from the first
        )
        return ThinkerEngine.from_source(tiny_source, cfg, device=device)

    return make


def _req(eng: ThinkerEngine, rid: str, seed: int, max_tokens: int = 6, follow_up: str = ""):
    """Image, clip, image, image, question: the clip's slots lie between the images'."""
    content = [
        {"type": "image", "data": _png(500, 700, seed)},
        {"type": "audio", "data": _wav(2.0, 300.0 + 50 * seed)},
        {"type": "image", "data": _png(300, 300, seed + 100)},
        {"type": "image", "data": _png(400, 300, seed + 200)},
        {"type": "text", "text": "What is it?"},
    ]
    msgs = [{"role": "user", "content": content}]
    if follow_up:
        msgs += [
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": follow_up},
        ]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Processor(eng.model.cfg, eng.tokenizer).build(
        msgs, speech_output=True, request_id=rid, sampling=sp
    )


class _EncoderWork:
    """Encoder items run since the last `take()` (instrumenting the real encoders)."""

    def __init__(self, eng: ThinkerEngine, monkeypatch) -> None:
        self.items: list[ImageInput | AudioInput] = []
        enc_i, enc_a = eng.model.encode_images, eng.model.encode_audios

        def images(items, *a):
            self.items += items
            return enc_i(items, *a)

        def audios(items, *a):
            self.items += items
            return enc_a(items, *a)

        monkeypatch.setattr(eng.model, "encode_images", images)
        monkeypatch.setattr(eng.model, "encode_audios", audios)

    def take(self) -> list[ImageInput | AudioInput]:
        items, self.items = self.items, []
        return items


def _drive(eng: ThinkerEngine, arrivals: dict[int, list], work: _EncoderWork | None = None):
    """Run the script; with `work`, check the bounds of every step with a running decode.
    Returns the outputs, each step's encoder items and whether a request ever had prefill
    computed while media of it were still to encode."""
    out: dict[str, dict] = {}
    costs: list[int] = []
    pipelined = False
    i = 0
    while i <= max(arrivals) or eng.has_work():
        for r in arrivals.get(i, []):
            eng.open(r.request_id, r)
            out[r.request_id] = {"ids": [], "hidden": []}
        decoding = {
            rid for rid, q in eng.llm._seqs.items() if q.output_ids and q.num_uncomputed == 1
        }
        deltas = eng.step()
        got = {d.request_id for d in deltas if d.token_ids}
        assert decoding <= got, f"step {i}: {decoding - got} waited"
        for d in deltas:
            out[d.request_id]["ids"] += d.token_ids
            if d.spoken_hidden is not None:
                out[d.request_id]["hidden"].append(d.spoken_hidden)
        if work is not None:
            items = work.take()
            costs.append(sum(eng._item_cost(m) for m in items))
            if decoding:
                budget = eng.config.max_encoder_items_per_step
                assert costs[-1] <= budget or len(items) == 1, f"step {i}: {costs[-1]} items"
            assert eng.stats()["max_step_prefill_tokens"] <= eng.llm.scheduler.max_prefill_tokens
        pipelined |= any(
            st.todo and eng.llm._seqs[rid].num_computed > 0 for rid, st in eng._streams.items()
        )
        i += 1
    for o in out.values():
        o["hidden"] = torch.cat(o["hidden"]) if o["hidden"] else torch.zeros(0)
    return out, costs, pipelined


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid]["ids"] == b[rid]["ids"], rid
        torch.testing.assert_close(a[rid]["hidden"], b[rid]["hidden"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)
def test_thinker_budget_bounds_every_step_and_equals_unbudgeted(thinker, monkeypatch, device):
    eng = thinker(items=3, prefill=24, device=device)
    plain = thinker(items=0, prefill=None, device=device)
    work = _EncoderWork(eng, monkeypatch)

    def script(e):
        return {0: [_req(e, "a", 0, max_tokens=30)], 4: [_req(e, "b", 1)], 5: [_req(e, "c", 2)]}

    got, costs, pipelined = _drive(eng, script(eng), work)
    ref, _, _ = _drive(plain, script(plain))
    _same(got, ref)
    assert costs[0] == 6  # nothing decodes yet: a's media (3 + 1 + 1 + 1) in one batch
    assert max(costs[1:]) <= 3 and sum(costs) == 18
    assert pipelined  # prefill chunks ran while later media of the prompt were encoding
    st = eng.stats()
    assert st["max_decode_wait_steps"] == 0 and 0 < st["max_step_encoder_items"] <= 3
    assert st["max_step_prefill_tokens"] <= 24 < plain.stats()["max_step_prefill_tokens"]
    assert st["max_decode_gap_ms"] > 0 and st["max_step_ms"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_media_inside_a_cached_prefix_are_still_skipped(thinker, monkeypatch):
    eng = thinker(items=2, prefill=16)
    work = _EncoderWork(eng, monkeypatch)
    _drive(eng, {0: [_req(eng, "q1", 0)]})
    assert len(work.take()) == 4
    follow = _req(eng, "q2", 0, follow_up="And the sound?")
    before = eng.stats()
    got, _, _ = _drive(eng, {0: [follow]})
    st = eng.stats()
    assert work.take() == [] and st["media_skipped"] == 4
    assert st["prefix_cache_hits"] - before["prefix_cache_hits"] >= follow.audio_bounds[-1][1]
    off = thinker(items=0, prefill=None, enable_prefix_caching=False)
    ref, _, _ = _drive(off, {0: [_req(off, "q2", 0, follow_up="And the sound?")]})
    _same(got, ref)


def test_encoder_cache_hits_cost_no_budget(thinker, monkeypatch):
    eng = thinker(items=2, prefill=16, cache=8, enable_prefix_caching=False)
    work = _EncoderWork(eng, monkeypatch)
    first, _, _ = _drive(eng, {0: [_req(eng, "x", 0)]})
    assert len(work.take()) == 4 and (eng.cache.hits, eng.cache.misses) == (0, 4)
    # The same media behind a running decode: all four hits go in its first step.
    script = {0: [_req(eng, "r", 5, max_tokens=20)], 3: [_req(eng, "x", 0)]}
    second, costs, _ = _drive(eng, script, work)
    assert costs[3] == 0 and (eng.cache.hits, eng.cache.misses) == (4, 8)
    assert not eng._streams and eng.stats()["max_step_encoder_items"] == 0
    _same(first, {"x": second["x"]})


def test_abort_mid_encoding_frees_everything(thinker):
    eng = thinker(items=1, prefill=8)
    total = eng.stats()["num_total_blocks"]
    eng.open("run", _req(eng, "run", 0, max_tokens=40))
    eng.step()
    while not eng.llm._seqs["run"].output_ids:
        eng.step()
    eng.open("enc", _req(eng, "enc", 1))
    for _ in range(3):
        eng.step()
    st = eng._streams["enc"]
    assert st.todo and eng.llm._seqs["enc"].num_computed > 0  # part-encoded, part-prefilled
    eng.abort("enc")
    assert "enc" not in eng._streams and "enc" not in eng.llm._seqs
    deltas = eng.step()
    assert not [d for d in deltas if d.request_id == "enc"]  # nothing more comes for it
    assert any(d.request_id == "run" and d.token_ids for d in deltas)  # decoding goes on
    eng.abort("run")
    eng.step()
    assert not eng.has_work()
    assert eng.stats()["num_free_blocks"] == total
