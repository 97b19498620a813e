"""Automatic prefix caching: block accounting (ref counts, LRU eviction, no leaks), the
hash chain (tokens and media content keys, full blocks only), cached == uncached prefill
(tiny Qwen3, torch backend, CPU; FlashInfer on CUDA), and the Thinker skipping encoders
for media inside a cached prefix.

Measured, cached vs uncached logits on CPU (torch backend): fp32 within 4e-6 of logits
up to ~7 (block sizes 4 and 16), bf16 bit-equal. The suffix prefill attends to cached K/V
an earlier step wrote, exactly as a later chunk of a chunked prefill does, so only the
summation order of the matmuls and attention can differ.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from _tiny_lm import has_flashinfer, random_lm, tiny_llm_config  # tests/ is on sys.path
from test_thinker import _png, _wav  # tests/ is on sys.path
from test_thinker import _run as run_thinker

from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.thinker.llm_engine.kv_cache import BlockManager, hash_block
from pipeline.thinker.llm_engine.scheduler import MediaSpan, Scheduler, Sequence
from pipeline.handoff import SamplingParams
from pipeline.processing.processor import Processor
from pipeline.thinker.llm import Qwen3LM

CFG = tiny_llm_config()
GREEDY = SamplingParams(max_tokens=10, stop_ids=())
FP32_ATOL = 1e-5  # the chunked-prefill bound of tests/test_engine.py
BF16_ATOL = 1 / 32  # one bf16 ulp at |logit| in [4, 8)


@pytest.fixture(scope="module")
def model() -> Qwen3LM:
    return random_lm(CFG)


def _engine(
    model, dtype=torch.float32, device="cpu", loader=None, launch_ahead=False, **kw
) -> LLMEngine:
    """launch_ahead: launch step N+1 before finishing step N, as on CUDA."""
    base = {
        "num_blocks": 256,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
    }
    eng = LLMEngine(model, EngineConfig(**{**base, **kw}), device, dtype, loader)
    eng.launch_ahead = launch_ahead
    return eng


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def _run(eng: LLMEngine, rid: str, prompt: list[int], sp=GREEDY, **kw) -> list[int]:
    eng.add_request(rid, prompt, sp, **kw)
    out: list[int] = []
    while eng.has_unfinished():
        out += [t for o in eng.step() if o.request_id == rid for t in o.token_ids]
    return out


class _Logits:
    """Records the logits of every row an engine samples from (eager or graph steps)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def watch(self, eng: LLMEngine) -> LLMEngine:
        runner = eng.runner
        sample, replay = runner._sample_eager, runner._decode_replay

        def record(logits, *args):
            self.rows.append(logits.float().cpu())
            return sample(logits, *args)

        def replayed(plan, *args):  # a decode graph samples inside: read its logits
            step = replay(plan, *args)
            rows = [i for i, s in enumerate(plan.seqs) if s.sample]
            self.rows.append(runner.graphs.decode.logits[rows].float().cpu())
            return step

        runner._sample_eager, runner._decode_replay = record, replayed
        return eng

    def take(self) -> torch.Tensor:
        out, self.rows = torch.cat(self.rows), []
        return out


def _close(a, b, atol, what):
    d = (a - b).abs()
    assert d.max() <= atol, f"{what}: max diff {d.max():.3e}, mean {d.mean():.3e}"


def _check_accounting(bm: BlockManager, tables: list[list[int]]) -> None:
    """Every block in exactly one state; ref counts equal the tables holding the block;
    only hashed blocks are shared; no hashed block is in the free list."""
    held: dict[int, int] = {}
    for t in tables:
        for b in t:
            held[b] = held.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == held.get(b, 0), f"block {b}"
        if held.get(b, 0) > 1:
            assert bm.block_hash(b) is not None, f"unhashed block {b} shared"
    free, cached = set(bm._free), set(bm._cached)
    assert not free & cached and not (free | cached) & set(held)
    assert len(free) + len(cached) + len(held) == bm.num_blocks
    assert all(bm.block_hash(b) is None for b in free)
    assert all(bm.block_hash(b) is not None for b in cached)
    hashed = {bm.block_hash(b): b for b in range(bm.num_blocks) if bm.block_hash(b) is not None}
    assert bm._by_hash == hashed  # one block per hash, and the index agrees


# ---------------------------------------------------------------------------------------
# Block manager: ref counts, LRU eviction, the allocator's invariant


def test_block_manager_refcounts_and_lru_eviction():
    bm = BlockManager(6, 4)
    h = [hash_block(b"", [i] * 4) for i in range(3)]
    a: list[int] = []
    bm.allocate(a, 12)
    assert [bm.register(blk, hh) for blk, hh in zip(a, h)] == [True] * 3
    a_blocks = list(a)
    b: list[int] = []
    hit = bm.match_prefix([h[0], h[1], hash_block(b"", [9] * 4)])
    assert hit == a[:2] and bm.hit_cost(hit) == 0  # in use: sharing costs no free block
    bm.take_cached(b, hit)
    assert [bm.ref_count(x) for x in a] == [2, 2, 1]
    bm.free(a)  # a[2] -> cached (ref 0), a[0..1] still held by b
    assert bm.num_free == 4 and bm.num_cached == 3
    _check_accounting(bm, [b])
    bm.free(b)  # released last block first: LRU order a[2], a[1], a[0]
    assert bm.num_free == 6 and bm.num_used == 0
    assert bm.hit_cost(bm.match_prefix(h)) == 3  # evictable: taking them costs free blocks
    c: list[int] = []
    bm.allocate(c, 12)  # the 3 never-cached blocks first: nothing evicted
    assert bm.num_evictions == 0 and not set(c) & set(a_blocks)
    bm.allocate(c, 20)  # 2 more: evicts the least recently released, the chain's tail
    assert bm.num_evictions == 2 and c[3:] == [a_blocks[2], a_blocks[1]]
    assert bm.match_prefix(h) == [a_blocks[0]]  # the head survives; its children are gone
    assert bm.block_hash(c[3]) is None  # an evicted block is handed out clean
    d: list[int] = []
    bm.take_cached(d, [a_blocks[0]])
    _check_accounting(bm, [c, d])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(c, 24)  # a[0] is referenced: never handed out
    bm.free(c)
    bm.free(d)
    _check_accounting(bm, [])


def test_duplicate_registration_and_caching_off():
    bm = BlockManager(4, 4)
    hh = hash_block(b"", [1, 2, 3, 4])
    x: list[int] = []
    y: list[int] = []
    bm.allocate(x, 4)
    bm.allocate(y, 4)
    assert bm.register(x[0], hh) and not bm.register(y[0], hh)  # computed twice: one wins
    yb = y[0]
    bm.free(y)
    assert yb in bm._free and bm.match_prefix([hh]) == x
    off = BlockManager(4, 4, enable_caching=False)
    t: list[int] = []
    off.allocate(t, 4)
    assert not off.register(t[0], hh) and off.match_prefix([hh]) == []


def test_hash_chain_keys_tokens_media_and_parent():
    toks = [5, 6, 7, 8]
    base = hash_block(b"", toks)
    assert hash_block(b"", toks) == base
    assert hash_block(b"", [5, 6, 7, 9]) != base
    assert hash_block(base, toks) != base  # the parent is part of the key
    a = hash_block(b"", toks, [("image:aa:0", 0, 1, 3)])
    assert a != base and a != hash_block(b"", toks, [("image:bb:0", 0, 1, 3)])
    assert a != hash_block(b"", toks, [("image:aa:0", 1, 1, 3)])  # other rows of the media


# ---------------------------------------------------------------------------------------
# Scheduler: what is shared, what is computed


def _sched(num_blocks=64, bs=4, budget=100) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, bs), max_num_seqs=8, max_num_batched_tokens=budget)


def _step(s: Scheduler, tok: int = 1):
    plan = s.schedule()
    s.postprocess(plan, [tok for x in plan.seqs if x.sample])
    return plan


def test_partial_last_block_not_shared_and_one_token_always_computed():
    s = _sched()
    bm = s.blocks
    sp = SamplingParams(max_tokens=20, stop_ids=())
    a = Sequence("a", list(range(100, 110)), sp)  # 10 tokens: 2 full blocks + 2 tokens
    s.add(a)
    _step(s)
    assert a.num_cached_blocks == 2 and bm.num_cached == 2  # the partial block is private
    b = Sequence("b", list(range(100, 112)), sp)  # shares a's 10 prompt tokens and more
    s.add(b)
    plan = _step(s)
    sb = next(x for x in plan.seqs if x.seq is b)
    assert (sb.start, sb.num_new) == (8, 4)  # 2 blocks from the cache, never a's partial one
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.ref_count(x) for x in a.block_table[:2]] == [2, 2]
    # a decodes: token 10 (its first output, fed back) fills block 2 -> published then
    assert bm.block_hash(a.block_table[2]) is None
    _step(s)
    assert a.num_computed == 12 and bm.block_hash(a.block_table[2]) is not None
    # A prompt that is exactly 2 cached blocks still computes its last block (for logits),
    # into a fresh block: a cached block is never written.
    c = Sequence("c", list(range(100, 108)), sp)
    s.add(c)
    plan = _step(s)
    sc = next(x for x in plan.seqs if x.seq is c)
    assert (sc.start, sc.num_new, sc.sample) == (4, 4, True)
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert (s.num_prefix_hits, s.num_prefix_queries) == (8 + 4, 10 + 12 + 8)
    for rid in ("a", "b", "c"):
        s.abort(rid)
    _check_accounting(bm, [])
    assert bm.num_free == bm.num_blocks


def test_prompt_blocks_are_shared_once_launched_output_blocks_once_resolved():
    """Launching ahead: the next step is planned while one is in flight. Its prompt blocks
    are published when it is launched (a later step runs after it on the stream), so a
    request planned meanwhile reuses them; a block holding a pending output id is not."""
    s = _sched()
    bm = s.blocks
    sp = SamplingParams(max_tokens=20, stop_ids=())
    a = Sequence("a", list(range(100, 111)), sp)  # 11 tokens: 2 full blocks + 3
    s.add(a)
    first = s.schedule()
    s.advance(first)  # launched, not resolved: its id is pending
    assert a.num_cached_blocks == 2 and bm.num_cached == 2
    b = Sequence("b", list(range(100, 114)), sp)
    s.add(b)
    second = s.schedule()  # planned while the first is in flight
    sb = next(x for x in second.seqs if x.seq is b)
    assert (sb.start, sb.num_new) == (8, 6) and b.block_table[:2] == a.block_table[:2]
    s.advance(second)  # a's pending id is fed: block 2 is full but its last id unknown
    assert bm.block_hash(a.block_table[2]) is None
    s.resolve(first, [7])
    s.resolve(second, [8, 9])
    assert bm.block_hash(a.block_table[2]) is not None  # its ids are known now
    assert a.output_ids == [7, 8] and b.output_ids == [9]
    for rid in ("a", "b"):
        s.abort(rid)
    _check_accounting(bm, [])


def test_admission_counts_evictable_hits_against_free_blocks():
    """Taking a cached block with ref count 0 removes it from the free pool: admission
    must count it, or the fresh blocks after it could not be allocated."""
    s = _sched(num_blocks=5, bs=4)
    s.add(Sequence("a", list(range(12)), SamplingParams(max_tokens=1, stop_ids=())))
    _step(s)  # a computes 3 full blocks and finishes: they stay cached, evictable
    assert s.blocks.num_free == 5 and s.blocks.num_cached == 3
    s.add(Sequence("r", [90, 91, 92], SamplingParams(max_tokens=2, stop_ids=())))
    b = Sequence("b", list(range(20)), SamplingParams(max_tokens=1, stop_ids=()))
    s.add(b)  # 3 hits (all evictable) + 2 fresh = 5 > 4 free while r holds one block
    plan = _step(s)
    assert [x.seq.request_id for x in plan.seqs] == ["r"] and s.waiting[0] is b
    _step(s)  # r finishes
    plan = _step(s)
    assert [(x.seq.request_id, x.start, x.num_new) for x in plan.seqs] == [("b", 12, 8)]
    # r's block was published once full; it, not one of b's hits, made room
    assert s.blocks.num_evictions == 1
    _check_accounting(s.blocks, [])


# ---------------------------------------------------------------------------------------
# Engine: cached == uncached


@pytest.mark.parametrize(
    ("dtype", "atol", "bs"),
    [(torch.float32, FP32_ATOL, 4), (torch.float32, FP32_ATOL, 16), (torch.bfloat16, BF16_ATOL, 4)],
)
def test_multi_turn_follow_up_cached_equals_uncached(model, dtype, atol, bs):
    """Three turns; each prompt is the previous prompt + its answer + a new user turn.
    Logits of every step (the prefill's and each decode's) and the greedy tokens agree."""
    m = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    logits = _Logits()
    cached = logits.watch(_engine(m, dtype, block_size=bs))
    prompt, worst, computed = _prompt(37, 1), 0.0, 0
    for turn in range(3):
        before = cached.stats()
        got = _run(cached, f"t{turn}", prompt)
        got_logits = logits.take()
        st = cached.stats()
        uncached = logits.watch(_engine(m, dtype, block_size=bs, enable_prefix_caching=False))
        ref = _run(uncached, "u", prompt)
        ref_logits = logits.take()
        assert got == ref, f"turn {turn}"
        _close(got_logits, ref_logits, atol, f"turn {turn} logits")
        worst = max(worst, float((got_logits - ref_logits).abs().max()))
        # The hit is everything the last turn computed, in whole blocks.
        assert st.prefix_cache_queries - before.prefix_cache_queries == len(prompt)
        assert st.prefix_cache_hits - before.prefix_cache_hits == computed // bs * bs
        computed = len(prompt) + len(got) - 1  # the last output token is never fed back
        prompt = prompt + got + _prompt(9, 10 + turn)
    assert cached.stats().num_free_blocks == cached.stats().num_total_blocks
    print(f"{dtype} bs={bs}: max |cached - uncached| logits {worst:.2e}")


def test_shared_system_prompt_is_shared_while_running(model):
    system = _prompt(26, 3)  # 6 full blocks of 4 + 2 tokens
    users = [system + _prompt(7, 4), system + _prompt(11, 5)]
    eng = _engine(model)
    eng.add_request("a", users[0], GREEDY)
    got = {"a": [], "b": []}
    for step in range(2):
        for o in eng.step():  # step 0: a's prefill publishes its 6 system blocks
            got[o.request_id] += o.token_ids
        if step == 0:
            eng.add_request("b", users[1], GREEDY)
    a, b = eng._seqs["a"], eng._seqs["b"]
    assert b.num_cached_tokens == 24 and b.block_table[:6] == a.block_table[:6]
    assert all(eng.block_manager.ref_count(x) == 2 for x in a.block_table[:6])
    _check_accounting(eng.block_manager, [a.block_table, b.block_table])
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.token_ids
    st = eng.stats()
    assert (st.prefix_cache_hits, st.prefix_cache_queries) == (24, len(users[0]) + len(users[1]))
    assert st.num_free_blocks == st.num_total_blocks and st.num_cached_blocks > 0
    off = _engine(model, enable_prefix_caching=False)
    assert got == {"a": _run(off, "a", users[0]), "b": _run(off, "b", users[1])}


def test_same_placeholders_with_other_media_do_not_hit(model):
    ids = _prompt(30, 6)
    pos = torch.arange(10, 22)
    e1, e2 = torch.randn(12, CFG.hidden_size) * 0.5, torch.randn(12, CFG.hidden_size) * 0.5
    span = lambda key: [MediaSpan(10, 22, key)]
    eng = _engine(model)
    _run(eng, "x", ids, mm_positions=pos, mm_embeds=e1, mm_spans=span("img:one"))
    assert eng.cached_prefix_len(ids, span("img:one")) == 28
    assert eng.cached_prefix_len(ids, span("img:two")) == 8  # the blocks before the media
    assert eng.cached_prefix_len(ids) == 8  # no key: placeholders are not content
    got = _run(eng, "y", ids, mm_positions=pos, mm_embeds=e2, mm_spans=span("img:two"))
    assert eng._seqs == {} and eng.stats().prefix_cache_hits == 8
    ref = _run(
        _engine(model, enable_prefix_caching=False), "y", ids, mm_positions=pos, mm_embeds=e2
    )
    assert got == ref
    # same media again: hits past it, and equals the uncached run with that media
    again = _run(eng, "z", ids, mm_positions=pos, mm_embeds=e1, mm_spans=span("img:one"))
    off = _engine(model, enable_prefix_caching=False)
    assert again == _run(off, "z", ids, mm_positions=pos, mm_embeds=e1)
    # rows without content keys: cacheable only up to the first multimodal position
    unkeyed = _engine(model)
    _run(unkeyed, "p", ids, mm_positions=pos, mm_embeds=e1)
    _run(unkeyed, "q", ids, mm_positions=pos, mm_embeds=e1)
    assert unkeyed.stats().prefix_cache_hits == 8


def test_bad_media_spans_are_refused(model):
    eng = _engine(model)
    ids, pos, emb = _prompt(20, 7), torch.arange(4, 8), torch.zeros(4, CFG.hidden_size)
    for spans, match in [
        ([MediaSpan(4, 8, "k"), MediaSpan(6, 10, "j")], "sorted, disjoint"),
        ([MediaSpan(4, 30, "k")], "inside the prompt"),
        ([MediaSpan(4, 8, "")], "keyed"),
        ([MediaSpan(4, 6, "k")], "outside every span"),
        ([MediaSpan(2, 8, "k")], "has 4 of its 6 rows"),
        ([MediaSpan(4, 8, "k"), MediaSpan(10, 12, "j")], "no loader"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.add_request("r", ids, GREEDY, mm_positions=pos, mm_embeds=emb, mm_spans=spans)


def test_left_out_media_rows_are_loaded_after_eviction(model):
    """A request that left out the rows of a span it expected cached gets them from the
    loader when its prefix was evicted before it ran, and computes the same tokens."""
    ids = _prompt(30, 8)
    pos, emb = torch.arange(6, 18), torch.randn(12, CFG.hidden_size) * 0.5
    spans = [MediaSpan(6, 12, "m:0"), MediaSpan(12, 18, "m:6")]
    calls: list[list[MediaSpan]] = []

    def loader(rid, need):
        calls.append(need)
        return [emb[sp.start - 6 : sp.end - 6] for sp in need]

    sp = SamplingParams(max_tokens=4, stop_ids=())
    eng = _engine(model, loader=loader, num_blocks=12)
    full = _run(eng, "a", ids, sp, mm_positions=pos, mm_embeds=emb, mm_spans=spans)
    assert eng.cached_prefix_len(ids, spans) == 28  # both spans inside the cached prefix
    # still cached: the rows are never asked for
    assert _run(eng, "b", ids, sp, mm_spans=spans) == full and calls == []
    # evict everything (a long unrelated request), then the same prompt without rows
    _run(eng, "evict", _prompt(40, 9), SamplingParams(max_tokens=8, stop_ids=()))
    assert eng.cached_prefix_len(ids, spans) == 0
    assert _run(eng, "c", ids, sp, mm_spans=spans) == full
    assert calls == [spans]
    _check_accounting(eng.block_manager, [])


@pytest.mark.parametrize("ahead", [False, True])
def test_eviction_abort_and_preemption_keep_accounting_and_outputs(model, ahead):
    """A small cache under a stream of requests sharing prefixes, with aborts and
    preemption: after every step the ref counts equal the live tables, finished and
    aborted requests leak nothing, and every finished output equals the uncached one."""
    rng = random.Random(0)
    bases = [_prompt(13, 20 + i) for i in range(3)]
    eng = _engine(
        model, num_blocks=20, max_num_seqs=4, max_num_batched_tokens=24,
        launch_ahead=ahead,
    )
    prompts, got, aborted = {}, {}, set()
    live = lambda: [s.block_table for s in eng.scheduler.running]
    for i in range(24):
        rid = f"r{i}"
        prompts[rid] = rng.choice(bases) + _prompt(rng.randint(1, 9), 100 + i)
        eng.add_request(
            rid, prompts[rid], SamplingParams(max_tokens=rng.randint(4, 20), stop_ids=())
        )
        got[rid] = []
        for _ in range(rng.randint(1, 3)):
            for o in eng.step():
                got[o.request_id] += o.token_ids
            _check_accounting(eng.block_manager, live())
        if i % 5 == 4:
            victim = rng.choice(list(eng._seqs))
            assert eng.abort(victim)
            aborted.add(victim)
            _check_accounting(eng.block_manager, live())
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.token_ids
        _check_accounting(eng.block_manager, live())
    st = eng.stats()
    assert st.num_free_blocks == st.num_total_blocks
    assert st.prefix_cache_hits > 0 and eng.block_manager.num_evictions > 0
    assert st.num_preemptions > 0
    _check_accounting(eng.block_manager, [])
    off = _engine(model, enable_prefix_caching=False)
    for rid, p in prompts.items():
        if rid not in aborted:
            sp = SamplingParams(max_tokens=len(got[rid]), stop_ids=())
            assert got[rid] == _run(off, rid, p, sp), rid


# ---------------------------------------------------------------------------------------
# Thinker: encoders skipped for media inside a cached prefix


@pytest.fixture(scope="module")
def thinker_factory(tiny_source):
    from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig

    def make(encoder_cache_size: int = 0, **llm) -> ThinkerEngine:
        llm = {"kv_cache_bytes": 32 * 2**20, "block_size": 4, **llm}
        cfg = ThinkerEngineConfig(llm=EngineConfig(**llm), encoder_cache_size=encoder_cache_size)
        return ThinkerEngine.from_source(tiny_source, cfg, device="cpu")

    return make


class _EncoderCalls:
    """Counts the images and clips each encoder is run on."""

    def __init__(self, eng, monkeypatch):
        self.images = self.audios = 0
        enc_i, enc_a = eng.model.encode_images, eng.model.encode_audios

        def images(items, *a):
            self.images += len(items)
            return enc_i(items, *a)

        def audios(items, *a):
            self.audios += len(items)
            return enc_a(items, *a)

        monkeypatch.setattr(eng.model, "encode_images", images)
        monkeypatch.setattr(eng.model, "encode_audios", audios)


def _turns(eng, rid, *, image_seed=0, question="What is it?", follow_up=None, max_tokens=6):
    """A user turn with an image and a clip; with `follow_up`, the same turn answered and a
    new question after it."""
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "data": _png(500, 700, image_seed)},
                {"type": "audio", "data": _wav(2.0, 440.0)},
                {"type": "text", "text": question},
            ],
        }
    ]
    if follow_up:
        msgs += [
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": follow_up},
        ]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Processor(eng.model.cfg, eng.tokenizer).build(
        msgs, speech_output=True, request_id=rid, sampling=sp
    )


def _run_thinker(eng, reqs) -> dict[str, tuple[list[int], torch.Tensor]]:
    return {rid: (o["ids"], o["hidden"]) for rid, o in run_thinker(eng, reqs).items()}


def _same(a, b):
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=1e-4)


def test_follow_up_about_the_same_media_runs_no_encoder(thinker_factory, monkeypatch):
    eng = thinker_factory()
    calls = _EncoderCalls(eng, monkeypatch)
    _run_thinker(eng, [_turns(eng, "q1")])
    assert (calls.images, calls.audios) == (1, 1)
    follow = _turns(eng, "q2", follow_up="And the sound?")
    last_media = max(follow.image_bounds[-1][1], follow.audio_bounds[-1][1])
    before = eng.stats()
    got = _run_thinker(eng, [follow])["q2"]
    st = eng.stats()
    assert (calls.images, calls.audios) == (1, 1)  # both media inside the cached prefix
    assert st["media_skipped"] == 2
    assert st["prefix_cache_hits"] - before["prefix_cache_hits"] >= last_media
    assert st["num_free_blocks"] == st["num_total_blocks"]
    off = thinker_factory(enable_prefix_caching=False)
    _same(got, _run_thinker(off, [_turns(off, "q2", follow_up="And the sound?")])["q2"])


def test_partially_cached_media_is_encoded(thinker_factory, monkeypatch):
    """Block size 16: the follow-up diverges right after the clip, so the cached prefix
    ends inside the clip's slots: the image is skipped, the clip is encoded for the rows
    past the prefix."""
    eng = thinker_factory(block_size=16)
    calls = _EncoderCalls(eng, monkeypatch)
    _run_thinker(eng, [_turns(eng, "a", question="What is it?")])
    follow = _turns(eng, "b", question="What is that?")
    spans = [x.span for x in eng._media_slots(follow)]
    hit = eng.llm.cached_prefix_len(follow.input_ids, spans)
    (a_start, a_end) = follow.audio_bounds[-1]
    assert follow.image_bounds[-1][1] <= hit and a_start < hit < a_end  # the scenario
    got = _run_thinker(eng, [follow])["b"]
    assert (calls.images, calls.audios) == (1, 2)
    off = thinker_factory(block_size=16, enable_prefix_caching=False)
    _same(got, _run_thinker(off, [_turns(off, "b", question="What is that?")])["b"])


def test_other_media_behind_the_same_placeholders_is_encoded(thinker_factory, monkeypatch):
    eng = thinker_factory()
    calls = _EncoderCalls(eng, monkeypatch)
    _run_thinker(eng, [_turns(eng, "p", image_seed=0)])
    other = _turns(eng, "o", image_seed=1)  # same size: the very same token ids
    first = _turns(eng, "p", image_seed=0)
    assert other.input_ids == first.input_ids
    before = eng.stats()
    got = _run_thinker(eng, [other])["o"]
    hit = eng.stats()["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hit <= other.image_bounds[0][0]  # nothing from the first image on is shared
    assert (calls.images, calls.audios) == (2, 2)  # the clip comes after the new image
    off = thinker_factory(enable_prefix_caching=False)
    _same(got, _run_thinker(off, [_turns(off, "o", image_seed=1)])["o"])


def test_media_left_out_then_evicted_is_encoded_on_demand(thinker_factory, monkeypatch):
    """The follow-up is admitted with its media skipped (its prefix was cached), waits
    behind a long request that evicts that prefix, then runs: the engine asks the Thinker
    for the rows and the output equals the uncached one."""
    first = thinker_factory()
    n = len(_turns(first, "x").input_ids)
    nb = (n + 6 + 3) // 4 + 6  # the request, plus 6 blocks
    eng = thinker_factory(num_blocks=nb, max_num_seqs=1)
    calls = _EncoderCalls(eng, monkeypatch)
    ref = _run_thinker(eng, [_turns(eng, "x")])["x"]
    long = Processor(eng.model.cfg, eng.tokenizer).build(
        [{"role": "user", "content": "hello"}], request_id="long"
    )
    room = nb * 4 - len(long.input_ids)  # grows over the whole cache: evicts x's blocks
    long.sampling = SamplingParams(max_tokens=room, ignore_eos=True)
    got = _run_thinker(eng, [long, _turns(eng, "y")])["y"]  # y waits: max_num_seqs 1
    st = eng.stats()
    assert st["media_skipped"] == 2 and eng.llm.block_manager.num_evictions > 0
    assert (calls.images, calls.audios) == (2, 2)  # x at admission, y on demand
    _same(got, ref)
    assert st["num_free_blocks"] == st["num_total_blocks"]


# ---------------------------------------------------------------------------------------
# CUDA: FlashInfer paged prefill over a cached prefix (kv_len > q_len)


@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_flashinfer_cached_prefill_matches_uncached_on_cuda():
    m = random_lm(tiny_llm_config(hidden_size=256, intermediate_size=512, head_dim=128,
                                  max_position_embeddings=2048)).to("cuda", torch.bfloat16)
    logits = _Logits()
    kw = {"block_size": 16, "max_num_seqs": 4}
    for graphs in (False, True):
        cached = logits.watch(_engine(m, torch.bfloat16, "cuda", cuda_graphs=graphs, **kw))
        assert cached.uses_cuda_graphs == graphs
        first = _prompt(300, 60)
        out = _run(cached, "a", first)
        logits.take()
        # a 46-token suffix over 304 cached tokens (paged prefill, kv_len > q_len), then a
        # 1-token suffix over 288 (a decode-shaped step: the decode kernel or its graph)
        for follow in (first + out + _prompt(40, 61), first[:289]):
            got = _run(cached, f"f{len(follow)}", follow)
            got_logits = logits.take()
            uncached = logits.watch(
                _engine(
                    m, torch.bfloat16, "cuda", cuda_graphs=False, enable_prefix_caching=False, **kw
                )
            )
            ref = _run(uncached, "u", follow)
            ref_logits = logits.take()
            diff = float((got_logits[0] - ref_logits[0]).abs().max())
            scale = float(ref_logits[0].abs().max())
            print(
                f"graphs={graphs} suffix {len(follow)}: prefill logits diff {diff:.3e} / {scale:.1f}"
            )
            # bf16 kernels split the same sums differently: a few bf16 ulps of the logits'
            # scale; wrong K/V (a bad page table or offset) is off by the scale itself
            assert diff <= 0.02 * scale, f"graphs={graphs}: {diff:.3e} vs scale {scale:.1f}"
            assert got[:3] == ref[:3]
        assert cached.stats().prefix_cache_hits == (300 + 9) // 16 * 16 + 288
