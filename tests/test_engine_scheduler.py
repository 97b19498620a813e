"""Block accounting and scheduling policy (CPU only, no model)."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import LLMConfig
from pipeline.thinker.llm_engine.kv_cache import BlockManager, KVCache, bytes_per_block, num_blocks_for_budget
from pipeline.thinker.llm_engine.scheduler import Scheduler, SeqStatus, Sequence
from pipeline.handoff import SamplingParams

SP = SamplingParams(max_tokens=100, stop_ids=(7,))


def _seq(rid: str, n: int, sp: SamplingParams = SP) -> Sequence:
    return Sequence(rid, list(range(10, 10 + n)), sp)


def _run(sched: Scheduler, tok: int = 1):
    """One step with a fake model that samples `tok` for every sampling sequence."""
    plan = sched.schedule()
    sampled = [tok for s in plan.seqs if s.sample]
    return plan, sched.postprocess(plan, sampled)


def test_budget_sizing():
    cfg = LLMConfig()
    per = bytes_per_block(cfg, 16, torch.bfloat16)
    assert per == 2 * 36 * 16 * 8 * 128 * 2
    assert num_blocks_for_budget(cfg, 16, torch.bfloat16, 10 * per + per // 2) == 10
    with pytest.raises(ValueError):
        num_blocks_for_budget(cfg, 16, torch.bfloat16, per - 1)
    tiny = LLMConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=8,
    )
    kv = KVCache(tiny, 5, 4, torch.float32, "cpu")
    assert kv.kv.shape == (2, 6, 2, 4, 1, 4)  # + scratch block
    assert kv.scratch_slot == 20


def test_block_manager_allocate_append_free():
    bm = BlockManager(8, 4)
    table: list[int] = []
    bm.allocate(table, 5)
    assert len(table) == 2 and bm.num_free == 6
    bm.allocate(table, 8)  # still fits in 2 blocks
    assert len(table) == 2
    slot = bm.append_slot(table, 9)  # token 8 opens a third block at offset 0
    assert len(table) == 3 and slot == table[2] * 4
    assert bm.append_slot(table, 10) == table[2] * 4 + 1
    assert bm.can_allocate(5) and not bm.can_allocate(6)
    with pytest.raises(RuntimeError):
        bm.allocate(table, 100)
    bm.free(table)
    assert table == [] and bm.num_free == 8


def test_prefill_then_decode_accounting():
    bm = BlockManager(32, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    s.add(_seq("a", 6))
    plan, _ = _run(s)
    assert [(x.start, x.num_new, x.sample) for x in plan.seqs] == [(0, 6, True)]
    assert len(s.running[0].block_table) == 2 and bm.num_free == 30
    plan, _ = _run(s)  # token 6 (7th) still in block 1
    assert [(x.start, x.num_new, x.is_decode) for x in plan.seqs] == [(6, 1, True)]
    _run(s)
    assert bm.num_free == 30
    _run(s)  # token 8 needs block 3
    assert bm.num_free == 29 and s.running[0].num_computed == 9


def test_admission_limits_max_num_seqs_and_token_budget():
    bm = BlockManager(100, 4)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=10)
    for rid, n in [("a", 4), ("b", 4), ("c", 4)]:
        s.add(_seq(rid, n))
    plan = s.schedule()
    # budget 10: a (4) + b (4); c is waiting on max_num_seqs=2 anyway
    assert [x.seq.request_id for x in plan.seqs] == ["a", "b"]
    assert [x.request_id for x in s.waiting] == ["c"]
    s.postprocess(plan, [1, 1])
    # token budget chunks a long prompt; the queue head blocks later arrivals (FIFO)
    s2 = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    s2.add(_seq("long", 25))
    s2.add(_seq("short", 2))
    plan = s2.schedule()
    assert [(x.seq.request_id, x.num_new, x.sample) for x in plan.seqs] == [("long", 10, False)]
    s2.postprocess(plan, [])
    plan = s2.schedule()
    assert [(x.seq.request_id, x.start, x.num_new) for x in plan.seqs] == [("long", 10, 10)]
    s2.postprocess(plan, [])
    plan = s2.schedule()  # 5 left for long, then short fits in the remaining budget
    assert [(x.seq.request_id, x.num_new, x.sample) for x in plan.seqs] == [
        ("long", 5, True),
        ("short", 2, True),
    ]


def test_refuse_admission_when_blocks_short():
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    s.add(_seq("a", 12))
    s.add(_seq("b", 8))
    plan = s.schedule()
    assert [x.seq.request_id for x in plan.seqs] == ["a"]  # b needs 2 blocks, 1 free
    assert s.waiting[0].request_id == "b" and bm.num_free == 1


def test_preemption_when_out_of_blocks():
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    s.add(_seq("old", 8))
    s.add(_seq("new", 8))
    _run(s)
    assert bm.num_free == 0
    # 'old' needs a 3rd block for token 8: preempt the newest ('new'), recompute later
    plan, _ = _run(s)
    assert [x.request_id for x in plan.preempted] == ["new"]
    assert [x.seq.request_id for x in plan.seqs] == ["old"]
    new = s.waiting[0]
    assert new.request_id == "new" and new.num_computed == 0 and new.block_table == []
    assert new.status == SeqStatus.WAITING and new.output_ids == [1]  # tokens kept
    # the only sequence cannot grow: it preempts itself instead of deadlocking
    s3 = Scheduler(BlockManager(2, 4), 8, 100)
    s3.add(_seq("x", 8))
    _run(s3)
    plan, _ = _run(s3)
    assert plan.seqs == [] and [x.request_id for x in plan.preempted] == ["x"]


def test_abort_frees_everything_everywhere():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=12)
    s.add(_seq("run", 6))
    s.add(_seq("mid", 20))
    s.add(_seq("wait", 5))
    _run(s)  # run: whole prompt; mid: 6 of 20 (mid-prefill); wait: not admitted
    mid = s.running[1]
    assert mid.num_computed == 6 and mid.block_table
    for rid in ("mid", "wait", "run"):
        seq = s.abort(rid)
        assert seq is not None and seq.finish_reason == "abort" and seq.block_table == []
    assert bm.num_free == 64 and not s.has_unfinished()
    assert s.abort("nope") is None


def test_stop_ids_max_tokens_ignore_eos():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, 8, 100)
    s.add(_seq("stop", 3))
    s.add(_seq("len", 3, SamplingParams(max_tokens=2, stop_ids=())))
    s.add(_seq("ign", 3, SamplingParams(max_tokens=3, stop_ids=(7,), ignore_eos=True)))
    _, ups = _run(s, tok=5)
    assert [u.finished for u in ups] == [False, False, False]
    _, ups = _run(s, tok=7)
    fin = {u.seq.request_id: u.seq.finish_reason for u in ups if u.finished}
    assert fin == {"stop": "stop", "len": "length"}
    _, ups = _run(s, tok=7)
    assert [(u.seq.request_id, u.seq.finish_reason) for u in ups] == [("ign", "length")]
    assert ups[0].seq.output_ids == [5, 7, 7]
    assert bm.num_free == 64


def test_advance_then_resolve_with_a_step_in_flight():
    """The launch-ahead halves: a sampled id is pending from `advance` to `resolve`; the step
    planned in between feeds it, skips a sequence whose pending id is its last, and a
    sequence preempted with its id pending, then stopped by it, leaves the waiting queue."""
    bm = BlockManager(6, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq("a", 4), _seq("b", 7, SamplingParams(max_tokens=1, stop_ids=()))
    s.add(a)
    s.add(b)
    p1 = s.schedule()
    s.advance(p1)
    assert a.output_ids == [-1] and b.output_ids == [-1] and a.num_computed == 4
    p2 = s.schedule()  # planned before p1's ids are known
    # b's pending id is its max_tokens-th: not scheduled; a feeds its pending id
    assert [(x.seq.request_id, x.start, x.num_new, x.sample) for x in p2.seqs] == [("a", 4, 1, True)]
    assert not p2.preempted
    s.advance(p2)
    ups = s.resolve(p1, [5, 9])
    assert [(u.seq.request_id, u.token_id, u.finished) for u in ups] == [("a", 5, False), ("b", 9, True)]
    assert b.finish_reason == "length" and a.output_ids == [5, -1] and bm.num_used == 2
    # a stops on the id p2 draws while p3 (launched after) holds its next row
    p3 = s.schedule()
    s.advance(p3)
    assert a.output_ids == [5, -1, -1]
    ups = s.resolve(p2, [7])
    assert a.is_finished and a.finish_reason == "stop" and a.output_ids == [5, 7]
    assert s.resolve(p3, [3]) == [] and a.output_ids == [5, 7]  # the extra row's id is dropped
    assert bm.num_used == 0 and not s.has_unfinished()
    # preempted with its id pending, then stopped by it: it leaves the waiting queue too
    c = _seq("c", 4)
    s.add(c)
    p = s.schedule()
    s.advance(p)
    s._preempt(c)
    assert list(s.waiting) == [c] and c.output_ids == [-1]
    s.resolve(p, [7])
    assert c.finish_reason == "stop" and not s.waiting and bm.num_used == 0
