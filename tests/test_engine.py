"""Engine correctness on CPU: paged attention, continuous batching, chunked prefill,
multimodal embedding overrides, preemption (tiny Qwen3, fp32, torch backend)."""

from __future__ import annotations

import random

import pytest
import torch
from _tiny_lm import CUDA_LLM, has_flashinfer, random_lm, tiny_llm_config  # tests/ is on sys.path

from pipeline.thinker.llm_engine.attention import AttnMetadata, TorchAttention
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.handoff import SamplingParams
from pipeline.thinker.llm import Qwen3LM

CFG = tiny_llm_config()
GREEDY = SamplingParams(max_tokens=12, stop_ids=())


@pytest.fixture(scope="module")
def model() -> Qwen3LM:
    return random_lm(CFG)


def _engine(model, launch_ahead: bool = False, **kw) -> LLMEngine:
    """launch_ahead: launch step N+1 before finishing step N, as on CUDA."""
    base = {
        "num_blocks": 256,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
    }
    eng = LLMEngine(model, EngineConfig(**{**base, **kw}))
    eng.launch_ahead = launch_ahead
    return eng


def _close(a, b, atol, what):
    d = (a - b).abs()
    assert d.max() <= atol, f"{what}: max diff {d.max():.3e}, mean {d.mean():.3e}"


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------
# Paged attention vs dense


def _dense_ref(q, k, v, n_past):
    """Causal attention of q (n_q, Hq, D) over k, v (n_kv, Hkv, D); query i is at n_past + i."""
    n_q, n_kv = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    mask = torch.arange(n_kv)[None, :] <= (n_past + torch.arange(n_q))[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("decode", [False, True])
def test_paged_torch_attention_matches_dense(decode):
    torch.manual_seed(1)
    Hq, Hkv, D, bs, nblocks = 4, 2, 16, 4, 64
    kv = torch.zeros(nblocks + 1, 2, bs, Hkv, D)
    free = list(range(nblocks))
    random.Random(0).shuffle(free)  # random, non-contiguous block tables
    # (cached tokens, new tokens) per sequence
    shapes = [(0, 7), (5, 1), (9, 6), (13, 1)] if not decode else [(0, 1), (5, 1), (11, 1), (16, 1)]
    tables, full_k, full_v = [], [], []
    qs, ks, vs, slots, indptr, kv_lens = [], [], [], [], [0], []
    for n_past, n_new in shapes:
        n = n_past + n_new
        table = [free.pop() for _ in range((n + bs - 1) // bs)]
        tables.append(table)
        k_all, v_all = torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)
        for t in range(n_past):  # pre-fill the cached prefix
            kv[table[t // bs], 0, t % bs] = k_all[t]
            kv[table[t // bs], 1, t % bs] = v_all[t]
        qs.append(torch.randn(n_new, Hq, D))
        ks.append(k_all[n_past:])
        vs.append(v_all[n_past:])
        slots += [table[t // bs] * bs + t % bs for t in range(n_past, n)]
        indptr.append(indptr[-1] + n_new)
        kv_lens.append(n)
        full_k.append(k_all)
        full_v.append(v_all)
    width = max(map(len, tables))
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    meta = AttnMetadata(
        torch.tensor(indptr, dtype=torch.int32),
        torch.tensor(kv_lens, dtype=torch.int32),
        bt,
        bt,
        torch.tensor(slots),
        decode,
        bs,
    )
    assert meta.is_decode == decode
    out = TorchAttention().forward(kv, torch.cat(qs), torch.cat(ks), torch.cat(vs), meta, D**-0.5)
    for b, (n_past, n_new) in enumerate(shapes):
        ref = _dense_ref(qs[b], full_k[b], full_v[b], n_past)
        _close(out[indptr[b] : indptr[b + 1]], ref, 1e-5, f"seq {b} (past {n_past}, new {n_new})")
    # the CSR view FlashInfer plans from
    kv_indptr, kv_indices, last = meta.paged_csr()
    assert kv_indices.tolist() == [x for t in tables for x in t]
    assert last.tolist() == [(n - 1) % bs + 1 for n in kv_lens]
    assert kv_indptr.tolist()[-1] == sum(map(len, tables))


# ---------------------------------------------------------------------------------------
# Batching, chunking, multimodal rows


def _alone(model, prompt, sampling=GREEDY, **kw):
    return _engine(model, **kw).generate({"x": prompt}, sampling)["x"]


@pytest.mark.parametrize("ahead", [False, True])
def test_continuous_batching_equals_each_alone(model, ahead):
    lens = [5, 17, 9, 30, 3]
    arrive = [0, 0, 2, 3, 7]  # step index at which each request is added
    prompts = {f"r{i}": _prompt(n, seed=i) for i, n in enumerate(lens)}
    eng = _engine(model, max_num_seqs=3, launch_ahead=ahead)
    got = {rid: [] for rid in prompts}
    step = 0
    while step <= max(arrive) or eng.has_unfinished():
        for i, rid in enumerate(prompts):
            if arrive[i] == step:
                eng.add_request(rid, prompts[rid], GREEDY)
        for o in eng.step():
            got[o.request_id] += o.token_ids
        assert len(eng.scheduler.running) <= 3
        step += 1
    for rid, p in prompts.items():
        assert got[rid] == _alone(model, p), rid
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_chunked_prefill_equals_unchunked(model):
    prompts = {"a": _prompt(45, 10), "b": _prompt(23, 11), "c": _prompt(8, 12)}
    ref = _engine(model).generate(prompts, GREEDY)
    for budget in (7, 16):
        got = _engine(model, max_num_batched_tokens=budget).generate(prompts, GREEDY)
        assert got == ref, f"budget {budget}"


def test_chunked_prefill_logits_match_one_shot(model):
    """Tighter than token equality: the hidden states of decode rows agree numerically."""
    p = _prompt(33, 13)
    outs = []
    for budget in (512, 5):
        eng = _engine(model, max_num_batched_tokens=budget)
        eng.add_request("r", p, SamplingParams(max_tokens=4, stop_ids=()), return_hidden=True)
        rows = []
        while eng.has_unfinished():
            rows += [o.hidden for o in eng.step() if o.hidden is not None]
        outs.append(torch.cat(rows))
    _close(outs[0], outs[1], 1e-5, "chunked vs one-shot decode hidden")


def test_mm_embeds_override_equals_direct_embeds(model):
    p = _prompt(26, 20)
    pos = torch.tensor([3, 4, 5, 6, 15, 16, 17])
    emb = torch.randn(len(pos), CFG.hidden_size) * 0.5
    # Reference: the same embeddings fed directly (no cache, no engine).
    with torch.no_grad():
        x = model.embed(torch.tensor(p))
        x[pos] = emb
        first = int(model.compute_logits(model(x, torch.arange(len(p)))[-1:]).argmax())
    for budget in (512, 4):  # chunk boundaries cut through the multimodal runs
        eng = _engine(model, max_num_batched_tokens=budget)
        eng.add_request("m", p, GREEDY, mm_positions=pos, mm_embeds=emb)
        eng.add_request("t", p, GREEDY)  # same ids, no override: must not be affected
        got = {"m": [], "t": []}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.token_ids
        assert got["m"][0] == first
        assert got["t"] == _alone(model, p)
        assert got["m"] != got["t"]
        # continuation: greedy over the direct-embedding sequence
        with torch.no_grad():
            seq = torch.cat([x, model.embed(torch.tensor(got["m"][:-1]))])
            ref = model.compute_logits(model(seq, torch.arange(seq.shape[0]))[len(p) - 1 :]).argmax(
                -1
            )
        assert got["m"] == ref.tolist(), f"budget {budget}"


@pytest.mark.parametrize("ahead", [False, True])
def test_preemption_recompute_is_token_exact(model, ahead):
    """Few blocks: sequences get preempted and recomputed, outputs unchanged."""
    prompts = {f"r{i}": _prompt(10 + 3 * i, 30 + i) for i in range(4)}
    sampling = SamplingParams(max_tokens=16, stop_ids=())
    eng = _engine(model, num_blocks=20, block_size=4, launch_ahead=ahead)
    got = eng.generate(prompts, sampling)
    assert eng.stats().num_preemptions > 0
    for rid, p in prompts.items():
        assert got[rid] == _alone(model, p, sampling), rid
    assert eng.block_manager.num_free == 20


def test_request_that_cannot_fit_is_refused(model):
    eng = _engine(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("big", _prompt(10, 1), SamplingParams(max_tokens=10))


def test_a_gpu_without_flashinfer_runs_torch_attention_and_says_so(model, monkeypatch, caplog):
    """The engine serves on the torch backend when flashinfer cannot be imported, but on CUDA
    it warns (that backend captures no CUDA graph: several times slower) and the engine's
    stats say which it runs (`flashinfer_attention`, a number like every stat); on CPU torch
    is the expected one, said quietly."""
    from pipeline.thinker.llm_engine import attention

    eng = _engine(model)
    assert eng.stats().flashinfer_attention == 0 and not eng.launch_ahead
    assert LLMEngine(model, EngineConfig(num_blocks=8)).launch_ahead is False  # CPU: off

    def missing():
        raise ImportError("No module named 'flashinfer'")

    monkeypatch.setattr(attention, "import_flashinfer", missing)
    kw = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
          "max_num_pages": 8, "dtype": torch.float32}
    with caplog.at_level("WARNING", logger=attention.__name__):
        cpu = attention.make_backend(torch.device("cpu"), **kw)
        assert not caplog.records  # torch is CPU's backend: nothing to warn about
        gpu = attention.make_backend(torch.device("cuda"), **kw)
    assert isinstance(cpu, TorchAttention) and isinstance(gpu, TorchAttention)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "torch backend" in caplog.text and "No module named 'flashinfer'" in caplog.text


@pytest.mark.parametrize("ahead", [False, True])
def test_abort_reports_and_frees(model, ahead):
    eng = _engine(model, max_num_batched_tokens=8, launch_ahead=ahead)
    eng.add_request("a", _prompt(30, 1), GREEDY)
    eng.step()  # 'a' is mid-prefill
    assert eng.block_manager.num_used > 0
    assert eng.abort("a")
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    assert not eng.has_unfinished()
    assert not eng.abort("a")


@pytest.mark.parametrize("ahead", [False, True])
def test_engine_seeded_sampling_and_stop(model, ahead):
    p = _prompt(11, 40)
    sp = SamplingParams(temperature=1.0, top_k=50, max_tokens=10, stop_ids=(), seed=7)
    a = _alone(model, p, sp)
    eng = _engine(model, launch_ahead=ahead)
    eng.add_request(
        "other", _prompt(7, 41), SamplingParams(temperature=1.0, max_tokens=10, stop_ids=())
    )
    eng.add_request("s", p, sp)
    got = {"s": [], "other": []}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.token_ids
    assert got["s"] == a  # reproducible, independent of batch mates
    # stop id: generation ends on the first occurrence, reason "stop"
    greedy = _alone(model, p)
    stop = greedy[4]
    eng = _engine(model, launch_ahead=ahead)
    eng.add_request("g", p, SamplingParams(max_tokens=12, stop_ids=(stop,)))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    toks = [t for o in outs for t in o.token_ids]
    assert toks == greedy[: greedy.index(stop) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    eng = _engine(model, launch_ahead=ahead)
    eng.add_request("g", p, SamplingParams(max_tokens=12, stop_ids=(stop,), ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [t for o in outs for t in o.token_ids] == greedy and outs[-1].finish_reason == "length"


# ---------------------------------------------------------------------------------------
# CUDA: FlashInfer and CUDA graphs vs the torch backend (bench/gpu_llm.py does full size)


@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_flashinfer_and_graphs_match_torch_backend_on_cuda(monkeypatch):
    from pipeline.thinker.llm_engine import engine as engine_module

    m = random_lm(CUDA_LLM).to("cuda", torch.bfloat16)
    prompts = {f"r{i}": _prompt(n, 50 + i) for i, n in enumerate((5, 40, 17))}
    sp = SamplingParams(max_tokens=10, stop_ids=())
    outs = {}
    shipped = engine_module.make_backend
    for backend, graphs in (("torch", False), ("flashinfer", False), ("flashinfer", True)):
        pick = (lambda device, **kw: TorchAttention()) if backend == "torch" else shipped
        monkeypatch.setattr(engine_module, "make_backend", pick)
        eng = LLMEngine(
            m,
            EngineConfig(num_blocks=64, block_size=16, cuda_graphs=graphs, max_num_seqs=4),
            "cuda",
            torch.bfloat16,
        )
        assert eng.uses_cuda_graphs == graphs
        assert eng.stats().flashinfer_attention == (backend == "flashinfer")
        outs[(backend, graphs)] = eng.generate(prompts, sp)
    assert outs[("flashinfer", True)] == outs[("flashinfer", False)]
    # bf16 kernels may flip a near-tie late in a sequence: compare the first tokens only
    for rid in prompts:
        assert outs[("flashinfer", False)][rid][:3] == outs[("torch", False)][rid][:3], rid


@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_decode_steps_are_timed_on_cuda():
    """Launching ahead with graphs, every pure-decode step gets a GPU span and, launched
    behind the step before it, an idle gap (small here: nothing else holds the host)."""
    m = random_lm(CUDA_LLM).to("cuda", torch.bfloat16)
    eng = LLMEngine(
        m,
        EngineConfig(num_blocks=64, block_size=16, cuda_graphs=True, max_num_seqs=4),
        "cuda",
        torch.bfloat16,
    )
    assert eng.launch_ahead  # on CUDA
    eng.generate({"r0": _prompt(20, 7)}, SamplingParams(max_tokens=24, stop_ids=()))
    s = eng.stats()
    assert s.decode_gpu_steps >= 20 and s.decode_gpu_ms > 0
    assert s.decode_idle_gaps >= s.decode_gpu_steps - 2
    assert 0 <= s.decode_idle_ms <= s.decode_idle_gaps * 5.0


def test_decode_times_tell_the_gpu_span_from_the_hosts_late_launch():
    """DecodeTimes on stamped fake events (ms): a decode step's GPU span runs from its start
    event to its done event; the GPU's idle gap before it counts only when it was launched
    with another step in flight, from that step's done; a prefill step is not timed but
    its done still bounds the next gap."""
    from pipeline.thinker.llm_engine.runner import DecodeTimes, LaunchedStep

    class Stamp:
        def __init__(self, ms: float) -> None:
            self.ms = ms

    times = DecodeTimes(elapsed=lambda a, b: b.ms - a.ms)

    def finish(start: float, done: float, behind: bool, decode: bool = True) -> None:
        step = LaunchedStep([], None, None, [], Stamp(done), Stamp(start), behind)
        times.finished(step, decode)

    finish(0, 30, behind=False, decode=False)  # a prefill: not timed
    finish(30, 36, behind=True)  # launched while the prefill ran: no gap
    finish(39, 45, behind=True)  # the host launched it 3 ms after the GPU went idle
    finish(100, 106, behind=False)  # the engine had no work before it: its span only
    assert (times.steps, times.gpu_ms) == (3, 18)
    assert (times.gaps, times.idle_ms, times.max_idle_ms) == (2, 3, 3)
    # without CUDA nothing is recorded
    finish_cpu = LaunchedStep([], None, None, [], None)
    times.finished(finish_cpu, True)
    assert times.steps == 3
