"""Per-step work: every running decode gets its token in every step, a step computes at most
`max_num_batched_tokens`, and a prompt's prefill chunks start once the rows they need exist;
the outputs equal those of unchunked steps (chunked prefill and encoder batching: within the
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
    s.postprocess(plan, [1 for x in plan.seqs if x.sample])
    return plan


# ---------------------------------------------------------------------------------------
# Scheduler


def test_scripted_arrivals_keep_every_decode_in_every_step():
    s = Scheduler(BlockManager(512, 4), 8, max_num_batched_tokens=16)
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
    base = {"num_blocks": 256, "block_size": 4}
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


def test_engine_chunked_equals_unchunked_and_reports_its_work(model):
    arrivals = {0: [("a", 20)], 3: [("b", 90)], 5: [("c", 40), ("d", 7)]}
    chunked = _engine(model, max_num_batched_tokens=32)
    plain = _engine(model, max_num_batched_tokens=512)
    assert _scripted(chunked, arrivals) == _scripted(plain, arrivals)
    st, ref = chunked.stats(), plain.stats()
    assert st.max_decode_wait_steps == 0 and 16 < st.max_step_prefill_tokens < 32
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
    whole = _engine(model, max_num_batched_tokens=512)
    whole.add_request("r", prompt, sp, pos, torch.cat(rows), mm_spans=spans)
    ref = _drain(whole)

    eng = _engine(model, max_num_batched_tokens=512)
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


def test_configs_refuse_bad_sizes():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(num_blocks=8, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="kv_cache_bytes or num_blocks"):
        EngineConfig(kv_cache_bytes=None)
    with pytest.raises(ValueError, match="vision_batch_size"):
        ThinkerEngineConfig(vision_batch_size=0)
    with pytest.raises(ValueError, match="prefetch_capacity"):
        ThinkerEngineConfig(prefetch_capacity=-1)


# ---------------------------------------------------------------------------------------
# Thinker (embedded tiny checkpoint, fp32 on CPU)


@pytest.fixture(scope="module")
def thinker(tiny_source):
    def make(tokens: int = 8192, cache: int = 0, device: str = "cpu", **llm) -> ThinkerEngine:
        llm = {"kv_cache_bytes": 32 * 2**20, "block_size": 4, "max_num_batched_tokens": tokens,
               **llm}
        cfg = ThinkerEngineConfig(
            llm=EngineConfig(**llm),
            encoder_cache_size=cache,
            dtype="float32",  # the equality below is a float32 one on CUDA too
            warm_up=False,  # the scripted schedules count every step's work from the first
        )
        eng = ThinkerEngine.from_source(tiny_source, cfg, device=device)
        # Synchronous steps (launching ahead is CUDA's): the scripts below check what each
        # step returns, and launching ahead returns a step's ids one step later.
        eng.llm.launch_ahead = False
        return eng

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
    """Run the script, checking that no running decode waits a step; with `work`, the media
    each step encoded. Returns the outputs and each step's count of encoded media."""
    out: dict[str, dict] = {}
    counts: list[int] = []
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
            counts.append(len(work.take()))
        i += 1
    for o in out.values():
        o["hidden"] = torch.cat(o["hidden"]) if o["hidden"] else torch.zeros(0)
    return out, counts


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
def test_thinker_chunked_keeps_every_decode_and_equals_unchunked(
    thinker, monkeypatch, device
):
    if device == "cuda":  # float32: the torch attention backend (FlashInfer's is half precision)
        from pipeline.thinker.llm_engine import engine as engine_module
        from pipeline.thinker.llm_engine.attention import TorchAttention

        monkeypatch.setattr(engine_module, "make_backend", lambda device, **kw: TorchAttention())
    eng = thinker(tokens=24, device=device)
    plain = thinker(device=device)
    work = _EncoderWork(eng, monkeypatch)

    def script(e):
        return {0: [_req(e, "a", 0, max_tokens=30)], 4: [_req(e, "b", 1)], 5: [_req(e, "c", 2)]}

    got, counts = _drive(eng, script(eng), work)
    ref, _ = _drive(plain, script(plain))
    _same(got, ref)
    assert counts[0] == 4 and sum(counts) == 12  # each request's media in the step admitting it
    st = eng.stats()
    assert st["max_decode_wait_steps"] == 0
    assert st["max_step_prefill_tokens"] < 24 < plain.stats()["max_step_prefill_tokens"]
    assert st["max_decode_gap_ms"] > 0 and st["max_step_ms"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_media_inside_a_cached_prefix_are_still_skipped(thinker, monkeypatch):
    eng = thinker(tokens=16)
    work = _EncoderWork(eng, monkeypatch)
    _drive(eng, {0: [_req(eng, "q1", 0)]})
    assert len(work.take()) == 4
    follow = _req(eng, "q2", 0, follow_up="And the sound?")
    before = eng.stats()
    got, _ = _drive(eng, {0: [follow]})
    st = eng.stats()
    assert work.take() == [] and st["media_skipped"] == 4
    assert st["prefix_cache_hits"] - before["prefix_cache_hits"] >= follow.audio_bounds[-1][1]
    off = thinker(enable_prefix_caching=False)
    ref, _ = _drive(off, {0: [_req(off, "q2", 0, follow_up="And the sound?")]})
    _same(got, ref)


def test_encoder_cache_hits_are_not_encoded_again(thinker, monkeypatch):
    eng = thinker(tokens=16, cache=8, enable_prefix_caching=False)
    work = _EncoderWork(eng, monkeypatch)
    first, _ = _drive(eng, {0: [_req(eng, "x", 0)]})
    assert len(work.take()) == 4 and (eng.cache.hits, eng.cache.misses) == (0, 4)
    # The same media behind a running decode: all four hits, nothing encoded.
    script = {0: [_req(eng, "r", 5, max_tokens=20)], 3: [_req(eng, "x", 0)]}
    second, counts = _drive(eng, script, work)
    assert counts[3] == 0 and (eng.cache.hits, eng.cache.misses) == (4, 8)
    assert not eng._streams
    _same(first, {"x": second["x"]})


def test_abort_mid_prefill_frees_everything(thinker):
    eng = thinker(tokens=8)
    total = eng.stats()["num_total_blocks"]
    eng.open("run", _req(eng, "run", 0, max_tokens=40))
    eng.step()
    while not eng.llm._seqs["run"].output_ids:
        eng.step()
    eng.open("enc", _req(eng, "enc", 1))
    for _ in range(3):
        eng.step()
    seq = eng.llm._seqs["enc"]
    assert 0 < seq.num_computed < seq.num_prompt  # encoded, part-prefilled
    eng.abort("enc")
    assert "enc" not in eng._streams and "enc" not in eng.llm._seqs
    deltas = eng.step()
    assert not [d for d in deltas if d.request_id == "enc"]  # nothing more comes for it
    assert any(d.request_id == "run" and d.token_ids for d in deltas)  # decoding goes on
    eng.abort("run")
    eng.step()
    assert not eng.has_work()
    assert eng.stats()["num_free_blocks"] == total
