"""The duplex sessions' paged KV (pipeline/duplex/kv.py): sessions of an engine's pool decode
through the engine's step, their rows its guests (`KVPages.decode` -> `LLMEngine.step(guests)`:
in the engine's decode graph beside its own requests' decodes, the step's ids, positions,
slots and page table staged as `llm_engine.graphs.DecodeGraphs` takes them), and a session's
unit then equals the same session decoded eagerly, and the engine's requests the same
requests alone. CUDA graphs cannot run here: `EagerReplay` is DecodeGraphs with its replay
run eagerly from the staged inputs (the step the graph would compute), so the staging the
fused decode writes is what is checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.checkpoint import ModelSource
from pipeline.duplex.batch import UnitRequest, run_units
from pipeline.duplex.config import DuplexConfig
from pipeline.duplex.kv import KVPages, SessionKV
from pipeline.duplex.session import DuplexSession
from pipeline.duplex.thinker import DuplexThinker, reference_special_tokens
from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from pipeline.thinker.llm_engine.attention import AttnMetadata
from pipeline.thinker.llm_engine.engine import EngineConfig
from pipeline.thinker.llm_engine.graphs import (
    DecodeGraphs,
    LLMGraphRunner,
    Staging,
    decode_fields,
)
from pipeline.thinker.llm_engine.sampling import sampling_fields
from tests import _duplex_inputs as di


class EagerReplay(DecodeGraphs):
    """DecodeGraphs whose `replay` runs the bucket's step eagerly from the staged inputs."""

    def __init__(self, pages: KVPages, sizes=(1, 2, 4, 8)):
        # DecodeGraphs.__init__ asks for FlashInfer: its fields, set here for the torch backend
        self.model, self.kv_cache, self.backend = pages.llm, pages.kv_cache, pages.backend
        self.sizes, self.scale, self.device = tuple(sizes), pages.scale, pages.device
        cfg = self.model.cfg
        self.vocab, rows = cfg.vocab_size, self.sizes[-1]
        self.staging = Staging({**decode_fields(rows, self.kv_cache.layers[0].shape[0]),
                                **sampling_fields(rows, self.vocab)}, self.device)
        self.noise = torch.ones(rows, self.vocab)
        self.hidden = torch.zeros(rows, cfg.hidden_size)
        self.logits = torch.zeros(rows, self.vocab)
        self.next_ids = torch.zeros(rows, dtype=torch.long)
        self._num_indices = 0
        self.buckets: list[int] = []

    def replay(self, bucket: int, sampled: bool) -> None:
        d, bs = self.staging.dev, self.kv_cache.block_size
        indptr = d["kv_indptr"][: bucket + 1].tolist()
        last = d["kv_last_page_len"][:bucket].tolist()
        tables = [d["kv_indices"][indptr[i] : indptr[i + 1]] for i in range(bucket)]
        bt = torch.zeros(bucket, max(len(t) for t in tables), dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        meta = AttnMetadata(
            qo_indptr=torch.arange(bucket + 1, dtype=torch.int32),
            kv_lens=torch.tensor([(len(t) - 1) * bs + n for t, n in zip(tables, last)],
                                 dtype=torch.int32),
            block_tables=bt, block_tables_cpu=bt,
            slot_mapping=d["slot_mapping"][:bucket], is_decode=True, block_size=bs)
        self._forward(bucket, meta, sampled)
        self.buckets.append(bucket)


@pytest.fixture(scope="module")
def served():
    from tests._duplex_ckpt import duplex_test_checkpoint

    source = ModelSource.open(str(duplex_test_checkpoint()))
    engine = ThinkerEngine.from_source(
        source, ThinkerEngineConfig(llm=EngineConfig(num_blocks=256, block_size=16)), "cpu")
    return engine, reference_special_tokens(source.tokenizer_dir)


def sessions(served, pages: KVPages | None, names: list[str]) -> list[tuple[DuplexSession, list]]:
    engine, special = served
    out = []
    for name in names:
        script = di.session(name)
        cfg = DuplexConfig(decode_mode=script.decode_mode, **script.duplex_kwargs)
        th = DuplexThinker(engine.model, engine.tokenizer, cfg, seed=script.seed,
                           special_tokens=special, pages=pages)
        s = DuplexSession(th, None)
        s.prepare(di.PREFIX, None, None, None)
        out.append((s, di.session_inputs(script)))
    return out


@pytest.fixture
def replayed(served):
    """The served engine's LLM with `EagerReplay` as its decode graphs (sizes 1, 2, 4, 8)."""
    llm = served[0].llm
    saved = llm.runner.graphs
    fake = EagerReplay(KVPages.of_engine(llm))
    llm.runner.graphs = LLMGraphRunner(decode=fake)
    yield llm, fake
    llm.runner.graphs = saved


NAMES = ["audio_greedy", "audio_sampling", "omni_greedy"]  # different lengths and draws


def _units_equal(graphed, eager, k: int) -> None:
    got = run_units([UnitRequest(s, *ins[k]) for s, ins in graphed])
    want = run_units([UnitRequest(s, *ins[k]) for s, ins in eager])
    for (g, w, name) in zip(got, want, NAMES, strict=True):
        where = f"{name} unit {k}"
        assert not isinstance(g, BaseException), (where, g)
        assert (g.token_ids, g.is_listen, g.end_of_turn) == \
            (w.token_ids, w.is_listen, w.end_of_turn), where
    for (a, _), (b, _) in zip(graphed, eager, strict=True):
        assert a.thinker.kv.length == b.thinker.kv.length
        for x, y in zip(a.thinker.kv.snapshot(), b.thinker.kv.snapshot(), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_graph_decode_of_an_engines_pool_equals_the_eager_step(served, replayed):
    """Sessions alone in the engine's decode graph (its guests, nothing of its own)."""
    engine, _ = served
    llm, fake = replayed
    pages = KVPages.of_engine(llm, llm.step)
    graphed = sessions(served, pages, NAMES)
    eager = sessions(served, None, NAMES)  # the model's standalone pool, eager steps
    for k in range(6):
        _units_equal(graphed, eager, k)
    # the decode steps went through the staging, at their bucket (3 sessions -> 4 rows)
    assert fake.buckets and set(fake.buckets) <= {1, 2, 4} and 4 in fake.buckets
    for s, _ in graphed + eager:
        s.close()
    assert engine.llm.block_manager.num_used == 0


def test_sessions_decode_in_the_steps_of_the_engines_requests(served, replayed):
    """The sessions' decode rows in the steps of the engine's own requests: one decode
    graph for both while the requests decode, one eager forward beside a request's
    prefill; the sessions' units equal the same sessions eager and alone, the requests'
    tokens (greedy and seeded) those of the same requests run alone."""
    from pipeline.handoff import SamplingParams

    engine, _ = served
    llm, fake = replayed
    requests = {"r0": ([5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True)),
                "r1": ([9] * 20, SamplingParams(max_tokens=30, ignore_eos=True,
                                                 temperature=0.8, seed=3))}
    alone = {}
    for rid, (ids, sp) in requests.items():
        alone |= llm.generate({rid: ids}, sp)
    got: dict[str, list[int]] = {rid: [] for rid in requests}

    def step(guests):
        for out in llm.step(guests):
            got[out.request_id] += out.token_ids

    pages = KVPages.of_engine(llm, step)
    graphed = sessions(served, pages, NAMES)
    eager = sessions(served, None, NAMES)
    fake.buckets.clear()
    for rid, (ids, sp) in requests.items():
        llm.add_request(rid, ids, sp)
    for k in range(6):
        _units_equal(graphed, eager, k)
        if k == 2:  # a prompt to prefill beside decoding sessions: an eager forward
            llm.add_request("r2", [3] * 17, SamplingParams(max_tokens=8, ignore_eos=True))
            requests["r2"] = ([3] * 17, SamplingParams(max_tokens=8, ignore_eos=True))
            got["r2"] = []
    while llm.has_unfinished():  # the requests' rest
        for out in llm.step():
            got[out.request_id] += out.token_ids
    alone |= llm.generate({"r2": requests["r2"][0]}, requests["r2"][1])
    assert got == alone
    # fused steps: the requests' rows and the sessions' (up to 2 + 3) in one bucket
    assert 8 in fake.buckets
    for s, _ in graphed + eager:
        s.close()
    assert engine.llm.block_manager.num_used == 0


def test_drop_and_rebuild_through_the_block_table_equal_a_fresh_prefill(served):
    """A span dropped and the tail moved down across block boundaries: the first layer's
    rows, re-rotated, are the K/V a fresh prefill of the kept tokens writes there (deeper
    layers' rows saw the dropped span), and the blocks past the length go back."""
    engine, _ = served
    pages = KVPages.of_engine(engine.llm)
    rng = np.random.default_rng(0)
    hidden = engine.model.llm.cfg.hidden_size
    rows = torch.from_numpy(rng.standard_normal((70, hidden)).astype(np.float32)) * 0.1
    kv = SessionKV(pages)
    kv.forward(rows)
    used = pages.blocks.num_used
    kv.drop(5, 30)  # 70 -> 40 tokens: 5 blocks -> 3
    fresh = SessionKV(pages)
    fresh.forward(torch.cat([rows[:5], rows[35:]]))
    assert kv.length == fresh.length == 40 and len(kv.table) == 3
    assert pages.blocks.num_used == used - 2 + 3
    got, want = kv.snapshot()[0], fresh.snapshot()[0]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # keys, re-rotated
    assert torch.equal(got[1], want[1])  # values move as they are
    kv.release()
    fresh.release()
    assert pages.blocks.num_used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the decode graphs)")
def test_sessions_decode_in_the_engines_graphs_beside_its_requests_cuda():
    """On CUDA (bf16, FlashInfer): sessions' decode rows in the engine's decode graphs beside
    a chat request's decodes, teacher-forced against twins decoded eagerly in the same pool
    (the same prefilled rows, the same tokens): their logits agree within bf16 reordering
    step after step; then units of scripted sessions through the fused steps all complete
    and the request runs to its length."""
    from pipeline.handoff import SamplingParams
    from tests._duplex_ckpt import duplex_test_checkpoint

    source = ModelSource.open(str(duplex_test_checkpoint()))
    engine = ThinkerEngine.from_source(source, ThinkerEngineConfig(llm=EngineConfig(
        num_blocks=256, block_size=16, max_guest_rows=4)), "cuda")
    llm = engine.llm
    if not llm.uses_cuda_graphs:
        pytest.skip("no decode graphs (FlashInfer not installed)")
    chat: list[int] = []

    def step(guests):
        for out in llm.step(guests):
            chat.extend(out.token_ids)

    fused, eager = KVPages.of_engine(llm, step), KVPages.of_engine(llm)
    llm.add_request("chat", [5, 6, 7, 8], SamplingParams(max_tokens=64, ignore_eos=True))
    step(None)  # its prefill: from here on its steps are decodes
    g = torch.Generator().manual_seed(0)
    hidden = llm.model.cfg.hidden_size
    pairs = []
    for n in (23, 40, 77):  # sessions of different lengths
        rows = (torch.randn(n, hidden, generator=g) * 0.1).to("cuda", llm.dtype)
        a, b = SessionKV(fused), SessionKV(eager)
        a.forward(rows)
        b.forward(rows)
        pairs.append((a, b))
    replays = llm.runner.graphs.decode_replays
    tokens = [1, 2, 3]
    worst, same = 0.0, 0
    for _ in range(12):
        for a, b in pairs:
            a.ensure(a.length + 1)
            b.ensure(b.length + 1)
        _, la = fused.decode([a for a, _ in pairs], tokens)
        hb, _ = eager.decode([b for _, b in pairs], tokens)
        with torch.inference_mode():
            lb = llm.model.compute_logits(hb)
        assert la is not None  # the graph computed them
        scale = lb.float().abs().max().item()
        worst = max(worst, (la.float() - lb.float()).abs().max().item() / scale)
        same += int((la.argmax(-1) == lb.argmax(-1)).sum())
        tokens = la.argmax(-1).tolist()
    print(f"fused vs eager logits: max |diff| / max |logit| {worst:.3g}; argmax equal "
          f"{same}/36")
    assert llm.runner.graphs.decode_replays >= replays + 12
    assert worst < 5e-2 and same >= 33
    for a, b in pairs:
        a.release()
        b.release()
    # scripted sessions' units through the fused steps
    served = (engine, reference_special_tokens(source.tokenizer_dir))
    live = sessions(served, fused, NAMES)
    for k in range(4):
        got = run_units([UnitRequest(s, *ins[k]) for s, ins in live])
        assert not any(isinstance(r, BaseException) for r in got), got
    while llm.has_unfinished():
        step(None)
    assert len(chat) == 64
    for s, _ in live:
        s.close()
    assert llm.block_manager.num_used == 0
