"""Whole-step prefill graphs (`graphs.PrefillGraphs`, behind `graphs.LLMGraphRunner`).

Claims tested here:
  * on CPU, the graphs' host side (keys, staging, padded rows and one-row padding
    sequences in the scratch slot, FlashInfer's plan, the static attention output) computes
    what the plain forward does: the same tokens for requests run one at a time (prompt
    chunks and decodes in buckets 16 and 24) and in a staggered mix (up to 4 sequences a
    step), a new turn over a cached prefix, and multimodal rows; hidden rows to fp32
    rounding. Only the capture (a direct call) and
    FlashInfer's kernel (the torch backend over the plan the step made, writing only the
    planned rows, as FlashInfer does) are replaced;
  * CUDA (bf16, FlashInfer, captured): the same tokens as the eager engine and hidden rows
    within bf16 rounding over a 200-token run, no drift.
"""

from __future__ import annotations

import pytest
import torch
from _tiny_lm import CUDA_LLM, has_flashinfer, random_lm  # tests/ is on sys.path

import pipeline.thinker.llm_engine.graphs as graphs_module
from pipeline.config import LLMConfig
from pipeline.thinker.llm_engine.attention import AttnMetadata, FlashInferAttention, TorchAttention
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.thinker.llm_engine.graphs import LLMGraphRunner, PrefillGraphs, prefill_fields
from pipeline.handoff import SamplingParams
from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from tests.test_device_sampling import (
    ARRIVAL,
    CFG,
    REQUESTS,
    _DirectRunner,
    _engine,
    _prompt,
    _staggered,
)
from tests.test_thinker import _request as thinker_request
from tests.test_thinker import _run

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return random_lm(CFG)


class _TorchPrefillWrapper:
    """FlashInfer's graph-mode prefill wrapper as the graphs use it: `plan` copies the CSR
    page table (as FlashInfer copies it into its buffers), `run` attends over it with the
    torch backend and writes only the planned rows of `out`."""

    def __init__(self, seqs: int, block_size: int, scale: float) -> None:
        self.seqs, self.block_size, self.scale, self.plans, self.csr = (
            seqs,
            block_size,
            scale,
            [],
            None,
        )

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, *args, causal, **kw) -> None:
        assert causal and qo_indptr.shape == kv_indptr.shape == (self.seqs + 1,)
        self.csr = tuple(x.clone() for x in (qo_indptr, kv_indptr, kv_indices, last_page_len))
        self.plans.append(qo_indptr.tolist())

    def run(self, q, kv, out):
        qo_indptr, kv_indptr, indices, last = self.csr
        pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        bt = torch.zeros(self.seqs, max(pages), dtype=torch.int32)
        for i, (lo, p) in enumerate(zip(kv_indptr.tolist(), pages)):
            bt[i, :p] = indices[lo : lo + p]
        meta = AttnMetadata(
            qo_indptr=qo_indptr.clone(),
            kv_lens=((torch.tensor(pages) - 1) * self.block_size + last).to(torch.int32),
            block_tables=bt,
            block_tables_cpu=bt,
            slot_mapping=torch.zeros(0, dtype=torch.long),  # K/V were written by the caller
            is_decode=False,
            block_size=self.block_size,
        )
        t = int(qo_indptr[-1])
        out[:t] = TorchAttention()._prefill(kv, q, meta, self.scale)[:t]
        return out


class _PlannedTorchAttention(FlashInferAttention):
    def __init__(self, cfg: LLMConfig, max_num_pages: int, block_size: int) -> None:
        self.num_qo_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.block_size, self.max_num_pages = cfg.head_dim, block_size, max_num_pages
        self.dtype, self.wrappers = torch.float32, {}

    def graph_prefill_wrapper(self, seqs: int, tokens: int):
        if (seqs, tokens) not in self.wrappers:
            scale = self.head_dim**-0.5
            self.wrappers[seqs, tokens] = _TorchPrefillWrapper(seqs, self.block_size, scale)
        return self.wrappers[seqs, tokens]


def _graph_engine(model, monkeypatch, max_tokens: int, **kw) -> LLMEngine:
    monkeypatch.setattr(graphs_module, "GraphRunner", _DirectRunner)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    eng = _engine(model, **kw)
    backend = _PlannedTorchAttention(CFG, eng.kv_cache.num_blocks + 1, eng.kv_cache.block_size)
    whole = PrefillGraphs(
        model,
        eng.kv_cache,
        backend,
        max_tokens,
        (1, 2, 4),
        CFG.head_dim**-0.5,
        torch.float32,
        CPU,
    )
    whole.capture()
    eng.runner.graphs = LLMGraphRunner(prefill=whole)
    return eng


def _alone(eng: LLMEngine) -> dict[str, list[int]]:
    """Every request of REQUESTS run by itself: every step holds one sequence."""
    got = {}
    for rid, (prompt, sp) in REQUESTS.items():
        eng.add_request(rid, prompt, sp)
        ids = []
        while eng.has_unfinished():
            for o in eng.step():
                ids += o.token_ids
        got[rid] = ids
    return got


def _hidden(eng: LLMEngine, rid: str, prompt: list[int], **kw) -> torch.Tensor:
    eng.add_request(
        rid, prompt, SamplingParams(max_tokens=12, stop_ids=()), return_hidden=True, **kw
    )
    rows = []
    while eng.has_unfinished():
        rows += [o.hidden for o in eng.step() if o.hidden is not None]
    return torch.cat(rows)


def _counting(eng: LLMEngine) -> list[int]:
    """Counts the steps the engine launches (a list of one counter)."""
    count, launch = [0], eng.runner.launch

    def counted(plan, guests=None):
        count[0] += 1
        return launch(plan, guests)

    eng.runner.launch = counted
    return count


def test_prefill_graph_steps_equal_the_plain_forward_on_cpu(model, monkeypatch):
    """Requests one at a time (every step one sequence: prompt chunks of 16 and decodes)
    and the staggered mix (up to 4 sequences a step, padded to a batch bucket with one-row
    sequences): the same tokens as the plain forward. With 24-token buckets every step of
    the mix fits a graph; with 16 the steps whose padding would not fit take the plain
    forward."""
    fields = prefill_fields(4, 24, 9)
    assert fields["qo_indptr"][1] == (5,) and fields["kv_last_page_len"][1] == (4,)
    torch.manual_seed(0)
    ref = _alone(_engine(model, enable_prefix_caching=False))
    for max_tokens in (16, 24):
        torch.manual_seed(0)
        eng = _graph_engine(model, monkeypatch, max_tokens, enable_prefix_caching=False)
        whole = eng.runner.graphs.prefill
        assert whole.buckets == ((16,) if max_tokens == 16 else (16, 24))
        assert whole.key(1, 1) == (1, 16) and whole.key(3, 16) == (
            None if max_tokens == 16 else (4, 24)
        )
        assert whole.key(5, 5) is None and whole.key(1, 25) is None
        launched = _counting(eng)
        got = _alone(eng)
        assert (
            whole.steps
            == launched[0]
            == sum(sp.max_tokens + (len(p) > 16) for p, sp in REQUESTS.values())
        )
        for rid in REQUESTS:
            assert got[rid] == ref[rid], (max_tokens, rid)
        plans = [p for w in whole.backend.wrappers.values() for p in w.plans]
        assert len(plans) == whole.steps + len(whole.keys)  # + one plan per capture
        assert [0, 1] in plans and [0, 16] in plans  # the real rows, not the bucket's
    torch.manual_seed(0)
    ref = _staggered(_engine(model))
    for max_tokens in (16, 24):
        torch.manual_seed(0)
        eng = _graph_engine(model, monkeypatch, max_tokens)
        launched = _counting(eng)
        got = _staggered(eng)
        whole = eng.runner.graphs.prefill
        for rid in REQUESTS:
            assert got[rid] == ref[rid], (max_tokens, rid)
        if max_tokens == 24:
            assert whole.steps == launched[0]
        else:
            assert 0 < whole.steps < launched[0]
        # steps of 3 sequences ran padded to 4: a fourth sequence of one row
        padded = [p for p in whole.backend.wrappers[4, max_tokens].plans[1:] if p[4] == p[3] + 1]
        assert padded and whole.backend.wrappers[2, 16].plans[1:]


def test_prefill_graph_hidden_rows_over_a_cached_prefix_and_media(model, monkeypatch):
    """A new turn over a cached history (the KV covers more than the step's rows) and a
    prompt with multimodal rows: the returned hidden rows of the graphs' steps equal the
    plain forward's to fp32 rounding (a GEMM over the padded bucket may sum in another
    order), and the cache hit happened on both."""
    history = _prompt(40, 21)
    media = torch.randn(6, CFG.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.1
    rows = {}
    for name, eng in (("graphs", _graph_engine(model, monkeypatch, 16)), ("plain", _engine(model))):
        first = _hidden(eng, "a", history + _prompt(5, 22))
        turn = _hidden(eng, "b", history + _prompt(7, 23))
        mm = _hidden(eng, "m", _prompt(14, 24), mm_positions=torch.arange(3, 9), mm_embeds=media)
        assert eng.stats().prefix_cache_hits == 40
        rows[name] = (first, turn, mm)
        if name == "graphs":  # the turn: its 7 new rows over 40 cached, one graph step
            whole = eng.runner.graphs.prefill
            assert [0, 7] in whole.backend.wrappers[1, 16].plans and whole.steps >= 3 + 3 * 11
    for got, want in zip(rows["graphs"], rows["plain"]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_a_prefill_graph_captures_never_reads_the_device_back(model, monkeypatch):
    """A CUDA graph cannot capture a sync: every aten op of one graph's forward (the model
    over the static buffers, the K/V writes at the staged slots; FlashInfer's planned kernel
    stood in for by a copy) on the CPU, with no scalar read-back or data-dependent shape."""
    from _graph_ops import HOST_READS, AtenOps

    class Copy:
        def run(self, q, kv, out):
            return out.copy_(q)

    eng = _graph_engine(model, monkeypatch, 16)
    whole = eng.runner.graphs.prefill
    whole.backend.graph_prefill_wrapper = lambda seqs, tokens: Copy()
    with torch.inference_mode(), AtenOps() as ops:
        whole._forward((2, 16))
    assert "index_copy_" in ops.names  # the K/V writes at the staged slots ran
    assert not ops.names & HOST_READS


def test_a_thinker_with_prefill_graphs_streams_the_same(tiny_source, monkeypatch):
    """Two media requests (an image's slices and an audio clip spliced into the prompt) at
    once through the Thinker with its LLM's steps in prefill graphs: the same ids and spoken
    hidden rows as the plain Thinker, and its stats count the graph steps."""
    monkeypatch.setattr(graphs_module, "GraphRunner", _DirectRunner)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    cfg = ThinkerEngineConfig(llm=EngineConfig(kv_cache_bytes=32 * 2**20))
    plain, eng = (ThinkerEngine.from_source(tiny_source, cfg, device="cpu") for _ in range(2))
    llm = eng.llm
    backend = _PlannedTorchAttention(
        eng.model.cfg.llm, llm.kv_cache.num_blocks + 1, llm.kv_cache.block_size
    )
    whole = PrefillGraphs(
        eng.model.llm, llm.kv_cache, backend, 512, (1, 2), llm.runner.scale, torch.float32, CPU
    )
    whole.capture()
    llm.runner.graphs = LLMGraphRunner(prefill=whole)
    reqs = {"a": {"image_seed": 5}, "b": {"image_seed": 6, "audio_freq": 330.0}}
    got = _run(eng, [thinker_request(eng, rid, **kw) for rid, kw in reqs.items()])
    want = _run(plain, [thinker_request(plain, rid, **kw) for rid, kw in reqs.items()])
    for rid in reqs:
        assert got[rid]["ids"] == want[rid]["ids"], rid
        assert got[rid]["hidden"].shape[0] > 0
        torch.testing.assert_close(got[rid]["hidden"], want[rid]["hidden"], rtol=1e-5, atol=1e-5)
    stats = eng.stats()
    assert stats["llm_prefill_graph_steps"] == whole.steps > 0
    assert plain.stats()["llm_prefill_graph_steps"] == 0
    # both prompts (media rows and all, > 256 tokens together) in one step of two sequences
    (step,) = [p for p in backend.wrappers[2, 512].plans[1:] if p[1] > 1 and p[2] - p[1] > 1]
    assert step[2] > 256


@pytest.mark.gpu
@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_prefill_graphs_match_the_plain_forward_on_cuda():
    """Captured whole-step graphs (bf16, FlashInfer's graph-mode prefill inside) against the
    eager forward: requests one at a time (every prompt a graph step) and a staggered mix
    draw the same greedy and seeded tokens; over a 200-token run after a 40-token prompt
    (one graph step), every decode row's hidden state stays within bf16 rounding of the eager
    run's, the last rows no further off than the first (no drift)."""
    m = random_lm(CUDA_LLM).to("cuda", torch.bfloat16)
    reqs = {k: v for k, v in REQUESTS.items() if k != "hot"}
    arrival = {k: ARRIVAL[k] for k in reqs}
    outs, alone, hidden = {}, {}, {}
    for graphs in (False, True):
        eng = LLMEngine(
            m,
            EngineConfig(num_blocks=256, block_size=16, max_num_seqs=4, cuda_graphs=graphs,
                         max_num_batched_tokens=64, enable_prefix_caching=False),
            "cuda",
            torch.bfloat16,
        )
        assert eng.uses_cuda_graphs == graphs
        outs[graphs] = _staggered(eng, reqs, arrival)
        alone[graphs] = {}
        for rid, (prompt, sp) in reqs.items():
            eng.add_request(rid, prompt, sp)
            ids = []
            while eng.has_unfinished():
                for o in eng.step():
                    ids += o.token_ids
            alone[graphs][rid] = ids
        if graphs:
            assert eng.runner.graphs.prefill_steps >= len(reqs)
        eng.add_request("h", _prompt(40, 9), REQUESTS["greedy"][1], return_hidden=True)
        rows = []
        while eng.has_unfinished():
            rows += [o.hidden for o in eng.step() if o.hidden is not None]
        hidden[graphs] = torch.cat(rows).float()
    for rid in reqs:
        assert outs[True][rid] == outs[False][rid], rid
        assert alone[True][rid] == alone[False][rid], rid
    diff = (hidden[True] - hidden[False]).abs().amax(dim=-1)  # per row
    scale = hidden[False].abs().amax()
    print(f"prefill graphs vs eager: max |diff| / max |h| {(diff.max() / scale).item():.2e}")
    assert diff.max() <= 3e-2 * scale, (diff.max(), scale)
    assert diff[-50:].mean() <= 2 * diff[:50].mean() + 1e-3 * scale, (diff[:50], diff[-50:])
