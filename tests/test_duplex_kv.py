"""The duplex sessions' paged KV (pipeline/duplex/kv.py): sessions of an engine's pool decode
through the pool's decode-step graphs (`KVPages.decode`: the step's ids, positions, slots and
page table staged as `llm_engine.graphs.DecodeGraphs` takes them), and a session's unit then
equals the same session decoded eagerly. CUDA graphs cannot run here: `EagerReplay` is
DecodeGraphs with its replay run eagerly from the staged inputs (the step the graph would
compute), so the staging the duplex decode writes is what is checked."""

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
from pipeline.thinker.llm_engine.graphs import DecodeGraphs, Staging, decode_fields
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


def test_graph_decode_of_an_engines_pool_equals_the_eager_step(served):
    engine, _ = served
    pages = KVPages.of_engine(engine.llm)
    fake = EagerReplay(pages)
    pages.decode_graphs = lambda: fake  # what a CUDA pool replays, run eagerly
    names = ["audio_greedy", "audio_sampling", "omni_greedy"]  # different lengths and draws
    graphed = sessions(served, pages, names)
    eager = sessions(served, None, names)  # the model's standalone pool, eager steps
    for k in range(6):
        got = run_units([UnitRequest(s, *ins[k]) for s, ins in graphed])
        want = run_units([UnitRequest(s, *ins[k]) for s, ins in eager])
        for (g, w, name) in zip(got, want, names, strict=True):
            where = f"{name} unit {k}"
            assert not isinstance(g, BaseException), (where, g)
            assert (g.token_ids, g.is_listen, g.end_of_turn) == \
                (w.token_ids, w.is_listen, w.end_of_turn), where
        for (a, _), (b, _) in zip(graphed, eager, strict=True):
            assert a.thinker.kv.length == b.thinker.kv.length
            for x, y in zip(a.thinker.kv.snapshot(), b.thinker.kv.snapshot(), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    # the decode steps went through the staging, at their bucket (3 sessions -> 4 rows)
    assert fake.buckets and set(fake.buckets) <= {1, 2, 4} and 4 in fake.buckets
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
