"""The fused QK-norm + RoPE + K/V cache write (`pipeline/thinker/qk_rope_kv.py`,
`Qwen3LM.fuse_qk_rope_kv`, which the Thinker takes wherever the kernel runs).

Claims tested here, on CPU in Triton's interpreter (the engine takes the kernel there only
because `available` is patched):
  * the kernel against `qk_norm_rope` + `write_kv` on random inputs (1-37 tokens; GQA 4/2 x
    16 and Qwen3-8B's 32/8 x 128; q|k|v as views of one GEMM output and as buffers of their
    own): in bf16 q and the cached k equal the plain ops' bit for bit but at most 1e-3 of
    the elements, each within one bf16 ulp of its head's largest element (the norm's sum of
    squares, summed in another order, can move a value across a rounding boundary); in fp32
    within 2^-20 of the head's largest element; v and every other cache row bit for bit;
  * the tiny LLM through the engine in bf16, knob on against off: a 40-token prompt and 64
    greedy tokens, then a second turn prefilled over the cached prefix and 16 more: the same
    tokens and logits within one bf16 ulp of the largest logit, the last rows no further off
    than the first (no drift);
  * the same in fp32 through the decode graphs and the whole-step prefill graphs (their
    host sides, as the graphs' own CPU tests run them): the same tokens for a staggered
    mix; a prefill graph's forward makes no K/V copies and no host reads (the kernel takes
    the staged rows);
  * compile_ops with the knob (Inductor's CPU code): the q|k|v half compiled, the same tokens;
  * the Thinker: the plain ops where the kernel does not run (CPU), the kernel where it does.
  * CUDA (`-k cuda`): bf16, FlashInfer, decode + whole-step graphs and compiled layers,
    kernel on against off: the same tokens, hidden rows within bf16 rounding, no drift.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from _tiny_lm import CUDA_LLM, has_flashinfer, random_lm  # tests/ is on sys.path

from pipeline.thinker.llm_engine.attention import kv_rows, write_kv
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.thinker.llm_engine.graphs import PrefillGraphs
from pipeline.handoff import SamplingParams
from pipeline.thinker import qk_rope_kv
from pipeline.thinker.llm import Qwen3LM, RotaryEmbedding, qk_norm_rope
from tests.test_device_sampling import (
    ARRIVAL,
    CFG,
    REQUESTS,
    _cpu_graph_engine,
    _decode_hidden,
    _engine,
    _prompt,
    _staggered,
)
from tests.test_prefill_graphs import _graph_engine
from tests.test_prefill_graphs import _PlannedTorchAttention as PlannedPrefill

CPU = torch.device("cpu")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernel tests' device
needs_kernel = pytest.mark.skipif(
    not qk_rope_kv.runs_here(DEV), reason="needs Triton (CUDA, or its interpreter on CPU)"
)
# The engine tests run the tiny LLM on CPU: the kernel there only in Triton's interpreter,
# which conftest turns on where there is no CUDA.
needs_kernel_on_cpu = pytest.mark.skipif(
    not qk_rope_kv.runs_here(CPU), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)


BLOCK, BLOCKS = 4, 16


def _case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, views: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    # rows of very different sizes, as the residual stream's are
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * torch.rand(t, 1, generator=g) * 8
    q, k, v = qkv.to(DEV, dtype).split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if not views:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_w, k_w = (torch.rand(d, generator=g).add(0.5).to(DEV, dtype) for _ in range(2))
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEV)
    cos, sin = RotaryEmbedding(d, 4096, 1e6).to(DEV)(positions)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:t].to(DEV)
    kv = torch.randn(BLOCKS, 2, BLOCK, hkv, d, generator=g).to(DEV, dtype)
    return (q, k, v, q_w, k_w, cos, sin, kv, kv_rows(slots, BLOCK)), slots


def _within(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """bf16: bit for bit but rare elements, each within one ulp of its head's largest
    element; fp32: within 2^-20 of it."""
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    head_max = want.abs().amax(-1, keepdim=True)
    ulps = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert (diff <= ulps * head_max).all(), f"{what}: max diff {diff.max():.3e}"
    if dtype == torch.bfloat16:
        assert (diff > 0).float().mean() <= 1e-3, f"{what}: {int((diff > 0).sum())} differ"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "t, hq, hkv, d, views",
    [(1, 4, 2, 16, True), (5, 32, 8, 128, True), (37, 4, 2, 16, False), (3, 32, 8, 128, False)],
)
def test_kernel_equals_qk_norm_rope_and_write_kv(t, hq, hkv, d, views, dtype):
    (q, k, v, q_w, k_w, cos, sin, kv, rows), slots = _case(t, hq, hkv, d, dtype, views, t)
    want_kv, got_kv = kv.clone(), kv.clone()
    want_q, want_k = qk_norm_rope(q, k, q_w, k_w, 1e-6, cos, sin)
    write_kv(want_kv, rows, want_k, v)
    got_q = qk_rope_kv.qk_norm_rope_kv(q, k, v, q_w, k_w, 1e-6, cos, sin, got_kv, rows)
    assert got_q.shape == want_q.shape and got_q.dtype == dtype and got_q.is_contiguous()
    _within(got_q, want_q, dtype, "q")
    # K per slot: the step's slots within the bound, every other slot untouched
    got_k, want_k, old_k = (x[:, 0].flatten(0, 1) for x in (got_kv, want_kv, kv))
    _within(got_k[slots], want_k[slots], dtype, "cached k")
    others = torch.ones(BLOCKS * BLOCK, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.equal(got_k[others], old_k[others])
    assert torch.equal(got_kv[:, 1], want_kv[:, 1])  # V: the step's rows and the others


@needs_kernel
def test_kernel_rounds_bf16_to_nearest_even():
    """The kernel's bf16 roundings are torch's (to nearest, ties to even), on inputs where
    a truncating cast differs: cos / sin halfway between two bf16 values (1 + k/128 + 1/256,
    k odd), rows of +-1 (so RMSNorm with eps 0 is exact) times odd integer weights, whose
    products with the table and their sums need more bits than bf16 holds."""
    g = torch.Generator().manual_seed(5)
    t, hq, hkv, d = 3, 4, 2, 16

    def odd(*shape: int, below: int) -> torch.Tensor:  # +-1, +-3, ... up to below - 1
        sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
        return sign * (torch.randint(0, below // 2, shape, generator=g) * 2 + 1)

    def halfway(*shape: int) -> torch.Tensor:  # fp32 ties between neighbouring bf16 values
        return torch.sign(odd(*shape, below=2)) * (1 + odd(*shape, below=128).abs() / 128 + 1 / 256)

    qkv = odd(t, hq + 2 * hkv, d, below=2).to(DEV, torch.bfloat16)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    q_w, k_w = (odd(d, below=8).to(DEV, torch.bfloat16) for _ in range(2))
    cos, sin = (halfway(t, 1, d).to(DEV) for _ in range(2))
    rows = kv_rows(torch.tensor([5, 0, 9], device=DEV), BLOCK)
    kv = torch.zeros(BLOCKS, 2, BLOCK, hkv, d, dtype=torch.bfloat16, device=DEV)
    want_kv = kv.clone()
    want_q, want_k = qk_norm_rope(q, k, q_w, k_w, 0.0, cos, sin)
    write_kv(want_kv, rows, want_k, v)

    def chopped(x: torch.Tensor) -> torch.Tensor:  # fp32 -> bf16 by dropping bits
        return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32)

    c, s_ = chopped(cos), chopped(sin)
    n = q_w.float() * q.float()
    rotated = torch.cat([-n[..., d // 2 :], n[..., : d // 2]], dim=-1)
    assert not torch.equal(chopped(chopped(n * c) + chopped(rotated * s_)), want_q.float())
    got_q = qk_rope_kv.qk_norm_rope_kv(q, k, v, q_w, k_w, 0.0, cos, sin, kv, rows)
    assert torch.equal(got_q, want_q) and torch.equal(kv, want_kv)


@needs_kernel
def test_kernel_refuses_what_it_cannot_take():
    (q, k, v, q_w, k_w, cos, sin, kv, rows), _ = _case(2, 4, 2, 16, torch.float16, True, 0)
    with pytest.raises(ValueError, match="one of"):
        qk_rope_kv.qk_norm_rope_kv(q, k, v, q_w, k_w, 1e-6, cos, sin, kv, rows)
    (q, k, v, q_w, k_w, cos, sin, kv, rows), _ = _case(2, 4, 2, 16, torch.float32, True, 0)
    with pytest.raises(ValueError, match="contiguous"):
        qk_rope_kv.qk_norm_rope_kv(q, k, v, q_w, k_w, 1e-6, cos, sin, kv.transpose(0, 1), rows)


# ---------------------------------------------------------------------------------------
# Through the engine


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """The engine's layers take the kernel on CPU (Triton's interpreter) too."""
    monkeypatch.setattr(qk_rope_kv, "available", lambda device: True)


def _fused(model: Qwen3LM) -> Qwen3LM:
    """A copy of `model` with the kernel on, counting its calls (`kernel_calls[0]`)."""
    m = copy.deepcopy(model)
    assert m.fuse_qk_rope_kv()
    kernel, m.kernel_calls = m.ops.qk_rope_kv, [0]

    def counted(*args):
        m.kernel_calls[0] += 1
        return kernel(*args)

    m.ops.qk_rope_kv = counted
    return m


def _turns(eng: LLMEngine, history: list[int], new: list[int]) -> tuple[list[int], torch.Tensor]:
    """A 64-token greedy turn, then a second turn over its cached prefix (the history, the
    answer, `new`) with 16 more: all ids and hidden rows."""
    ids, rows = [], []

    def turn(rid: str, prompt: list[int], n: int) -> None:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=n, stop_ids=()), return_hidden=True)
        while eng.has_unfinished():
            for o in eng.step():
                ids.extend(o.token_ids)
                rows.extend([o.hidden] if o.hidden is not None else [])

    turn("a", history, 64)
    turn("b", history + ids + new, 16)
    assert eng.stats().prefix_cache_hits >= len(history)  # the second turn's prefill hit
    return ids, torch.cat(rows)


@needs_kernel_on_cpu
@torch.no_grad()
def test_engine_bf16_same_tokens_and_logits_no_drift(kernel_on_cpu):
    model = random_lm(CFG).to(torch.bfloat16)
    fused = _fused(model)
    got = {}
    for name, m in (("plain", model), ("fused", fused)):
        cfg = EngineConfig(num_blocks=64, block_size=4)
        eng = LLMEngine(m, cfg, "cpu", torch.bfloat16)
        ids, hidden = _turns(eng, _prompt(40, 1), _prompt(9, 2))
        got[name] = ids, model.compute_logits(hidden).float()
    (ids_p, logits_p), (ids_f, logits_f) = got["plain"], got["fused"]
    assert ids_f == ids_p and len(ids_p) == 80
    assert fused.kernel_calls[0] == CFG.num_hidden_layers * 80  # 2 prefills + 78 decodes
    diff = (logits_f - logits_p).abs().amax(dim=-1)  # per row
    scale = logits_p.abs().amax()
    print(f"fused vs plain bf16 logits: max |diff| / max |logit| {(diff.max() / scale):.2e}")
    assert diff.max() <= 2.0**-7 * scale, (diff.max(), scale)
    assert diff[-16:].mean() <= 2 * diff[:16].mean() + 2.0**-9 * scale, (diff[:16], diff[-16:])


SHORT = {
    rid: (prompt, replace(sp, max_tokens=24))
    for rid, (prompt, sp) in REQUESTS.items()
    if rid in ("greedy", "pen", "sampled", "ban_greedy")
}
SHORT_ARRIVAL = {rid: ARRIVAL[rid] for rid in SHORT}


@needs_kernel_on_cpu
@torch.no_grad()
def test_graph_paths_same_tokens(kernel_on_cpu, monkeypatch):
    """Decode graphs + whole-step prefill graphs on one engine (steps of 1-16 tokens, up to
    4 sequences): the plain engine's tokens."""
    model = random_lm(CFG)
    fused = _fused(model)
    torch.manual_seed(0)
    want = _staggered(_engine(model), SHORT, SHORT_ARRIVAL)
    eng = _cpu_graph_engine(fused, monkeypatch)
    kv = eng.kv_cache
    whole = PrefillGraphs(
        fused, kv, PlannedPrefill(CFG, kv.num_blocks + 1, kv.block_size), 16, (1, 2, 4),
        CFG.head_dim**-0.5, torch.float32, CPU,
    )
    whole.capture()
    eng.runner.graphs.prefill = whole
    torch.manual_seed(0)
    got = _staggered(eng, SHORT, SHORT_ARRIVAL)
    for rid in SHORT:
        assert got[rid] == want[rid], rid
    assert eng.runner.graphs.decode_replays > 20 and whole.steps > 3
    assert fused.kernel_calls[0] > 0


@needs_kernel_on_cpu
def test_a_prefill_graph_with_the_kernel_makes_no_copies_or_host_reads(kernel_on_cpu, monkeypatch):
    """What a prefill graph captures with the knob on: no `index_copy_` (the kernel writes
    K/V at the rows the graph computes from its staged slots) and no read of a device
    tensor back to the host."""
    from _graph_ops import HOST_READS, AtenOps

    class Copy:
        def run(self, q, kv, out):
            return out.copy_(q)

    whole = _graph_engine(_fused(random_lm(CFG)), monkeypatch, 16).runner.graphs.prefill
    whole.backend.graph_prefill_wrapper = lambda seqs, tokens: Copy()
    whole.x.normal_()  # rows staged by the capture: every one writes the scratch slot
    kv = whole.kv_cache
    before = [layer[kv.scratch_block].clone() for layer in kv.layers]
    with torch.inference_mode(), AtenOps() as ops:
        whole._forward((2, 16))
    assert not ops.names & ({"index_copy_", "index_put_"} | HOST_READS), ops.names
    for layer, old in zip(kv.layers, before):  # the kernel wrote K and V there
        assert not torch.equal(layer[kv.scratch_block], old)


@needs_kernel_on_cpu
@torch.no_grad()
def test_compiled_layers_with_the_kernel(kernel_on_cpu):
    """compile_ops and the knob together: the layers run the compiled q|k|v half (one
    graph for one token, one for many) and the kernel; the plain engine's tokens."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import pipeline.thinker.llm as llm_module

    torch._dynamo.reset()
    model = random_lm(CFG)
    compiled = _fused(model)
    compiled.fuse_projections()
    compiled.compile_ops()
    sp = SamplingParams(max_tokens=32, stop_ids=())
    got = {}
    for name, m in (("plain", model), ("compiled", compiled)):
        eng = _engine(m)
        got[name] = eng.generate({"r": _prompt(20, 3)}, sp)["r"]
    assert got["compiled"] == got["plain"]
    entries = _debug_get_cache_entry_list(llm_module.layer_qkv.__code__)
    assert len(entries) == 4  # first layer / the others, one token / many
    assert not _debug_get_cache_entry_list(llm_module.layer_pre.__code__)


def test_the_thinker_takes_the_kernel_where_it_runs(tiny_source, monkeypatch):
    from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig

    cfg = ThinkerEngineConfig(llm=EngineConfig(kv_cache_bytes=8 * 2**20), warm_up=False)
    eng = ThinkerEngine.from_source(tiny_source, cfg, device="cpu")
    assert eng.model.llm.ops.qk_rope_kv is None  # CPU: the plain ops
    monkeypatch.setattr(qk_rope_kv, "available", lambda device: True)
    eng = ThinkerEngine.from_source(tiny_source, cfg, device="cpu")
    assert eng.model.llm.ops.qk_rope_kv is qk_rope_kv.qk_norm_rope_kv


# ---------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not has_flashinfer(), reason="needs CUDA and flashinfer")
@torch.no_grad()
def test_fused_qk_rope_kv_matches_the_plain_layers_on_cuda():
    """bf16, FlashInfer, decode and whole-step graphs, plain and compiled layers: the
    kernel draws the same greedy and seeded tokens over the staggered
    mix, and a 200-token run's hidden rows stay within bf16 rounding of the plain run's,
    the last rows no further off than the first (no drift)."""
    m = random_lm(CUDA_LLM).to("cuda", torch.bfloat16)
    reqs = {k: v for k, v in REQUESTS.items() if k != "hot"}
    arrival = {k: ARRIVAL[k] for k in reqs}
    for compiled in (False, True):
        outs, hidden = {}, {}
        for fused in (False, True):
            model = copy.deepcopy(m)
            model.fuse_projections()
            if compiled:
                model.compile_ops()
            assert model.fuse_qk_rope_kv(fused) == fused
            eng = LLMEngine(
                model,
                EngineConfig(num_blocks=256, block_size=16, max_num_seqs=4,
                             max_num_batched_tokens=64, enable_prefix_caching=False),
                "cuda",
                torch.bfloat16,
            )
            outs[fused] = _staggered(eng, reqs, arrival)
            g = eng.runner.graphs
            assert g.decode_replays > 200 and g.prefill_steps > 0
            hidden[fused] = _decode_hidden(eng, _prompt(90, 9), REQUESTS["greedy"][1])
        for rid in reqs:
            assert outs[True][rid] == outs[False][rid], (compiled, rid)
        diff = (hidden[True] - hidden[False]).abs().amax(dim=-1)
        scale = hidden[False].abs().amax()
        print(f"compiled={compiled}: fused vs plain max |diff| / max |h| "
              f"{(diff.max() / scale).item():.2e}")
        assert diff.max() <= 3e-2 * scale, (compiled, diff.max(), scale)
        assert diff[-50:].mean() <= 2 * diff[:50].mean() + 1e-3 * scale, (compiled,)
