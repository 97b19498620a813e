"""Regional torch.compile of the DiT blocks (`compile_dit_blocks`, the engine's
`token2wav_compile_estimator`) on CPU, fp32:

  * the graph count: a counting backend (Dynamo's graphs run as is, no codegen: fast) over an
    engine decoding 4 chunks of one stream, then 4 chunks of two streams batched;
  * compiled == eager with Inductor: DiT forward_chunk without and with caches at 2 and 4
    rows, and a whole engine's PCM. Inductor needs a C++ compiler on CPU; each graph costs
    ~15 s to compile cold on 2 cores, so the tests are built to need few graphs (the
    engine test finds the DiT test's graphs in Inductor's on-disk cache);
  * the compiled slot path with the adaLN table: `slot_post` sees the same input layout and
    stays one graph.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from pipeline.code2wav.assets import load_code2wav, tiny_code2wav_config
from pipeline.code2wav.dit import DiT, compile_dit_blocks
from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from pipeline.code2wav.voice import VoiceCache
from tests.test_code2wav_engine import _codes, _feeds, _run

CXX = os.environ.get("CXX", "g++")
needs_inductor = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"Inductor on CPU needs a C++ compiler ({CXX} not found)"
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def voice(ckpt):
    return VoiceCache(ckpt / "assets" / "token2wav").default()


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    d = (a - b).abs()
    assert a.shape == b.shape and d.max() <= atol, f"{what}: max {d.max():.3g} mean {d.mean():.3g}"


def test_graph_count_over_streaming_chunks(ckpt, voice):
    """One stream, 4 chunks (cache grows 50 -> 250 frames, trimmed to 150), then two streams
    batched (4 rows) for 4 chunks and a short final chunk: 3 graphs (no cache; a template
    clone's normal tensors; inference tensors), none for the new L, T or batch."""
    flow, hift, cfg = load_code2wav(ckpt, "cpu", torch.float32)
    counter = CompileCounter()
    compile_dit_blocks(flow.decoder.estimator, backend=counter)
    eng = Code2WavEngine(flow, hift, cfg)
    one = {"s0": [(_codes(k, 25), False) for k in range(4)]}
    two = {f"t{i}": [(_codes(10 * i + k, 25), False) for k in range(4)] for i in range(2)}
    two["t0"].append((_codes(50, 9), True))
    two["t1"].append((_codes(51, 9), True))
    _run(eng, one, voice)
    _run(eng, two, voice)
    assert eng.counters["batch_size_2"] == 5
    assert counter.frame_count == 3, f"{counter.frame_count} graphs for the DiT blocks"


@needs_inductor
def test_compiled_dit_forward_chunk_matches_eager():
    torch.manual_seed(0)
    dit = DiT(tiny_code2wav_config().dit).eval()
    g = torch.Generator().manual_seed(1)

    def chunks(rows: int) -> list[tuple[torch.Tensor, ...]]:
        # setup-like first chunk (40 frames, no cache), two full chunks, a short final one;
        # one Euler step's t_emb expanded over the rows, as CausalCFM passes it
        t_emb = dit.time_embedding(torch.rand(1, generator=g)).expand(rows, -1)
        spks = torch.randn(rows, 80, generator=g)
        return [
            (
                torch.randn(rows, 80, t, generator=g),
                torch.randn(rows, 80, t, generator=g),
                t_emb,
                spks,
                torch.randn(rows, 80, t, generator=g),
            )
            for t in (40, 50, 50, 18)
        ]

    def run(inputs: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        outs, cnn, att = [], None, None
        for x, mu, t_emb, spks, cond in inputs:
            v, cnn, att = dit.forward_chunk(x, mu, t_emb, spks, cond, cnn, att)
            outs += [v, cnn, att]
        return outs

    with torch.inference_mode():
        inputs = {rows: chunks(rows) for rows in (2, 4)}  # 1 and 2 streams (CFG-doubled)
        ref = {rows: run(x) for rows, x in inputs.items()}
        compile_dit_blocks(dit)
        out = {rows: run(x) for rows, x in inputs.items()}
    for rows, expected in ref.items():
        assert out[rows][-1].shape[3] == 40 + 50 + 50 + 18
        for i, (a, b) in enumerate(zip(out[rows], expected)):
            name = ("v", "cnn", "att")[i % 3]
            _assert_close(a, b, f"rows {rows}, chunk {i // 3}, output {name}")
    # one graph without a cache, one with: no recompile for new L, T or rows
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@needs_inductor
def test_engine_compile_knob_matches_eager(ckpt, voice):
    eager = Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32))
    flow, hift, cfg = load_code2wav(ckpt, "cpu", torch.float32)
    compiled = Code2WavEngine(
        flow, hift, cfg, Code2WavEngineConfig(token2wav_compile_estimator=True)
    )
    assert all(b._compiled_call_impl is not None for b in flow.decoder.estimator.blocks)
    a, b = _run(eager, _feeds(2), voice), _run(compiled, _feeds(2), voice)
    assert compiled.counters["batch_size_2"] == 3
    for sid in a:
        d = np.abs(a[sid] - b[sid])
        assert a[sid].shape == b[sid].shape and d.max() < 1e-5, (
            f"{sid}: max {d.max():.3g} mean {d.mean():.3g}"
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_on_cuda_match_eager(ckpt, voice):
    """The plain path with compiled DiT blocks on the GPU: same PCM as the eager engine."""
    eager = Code2WavEngine(*load_code2wav(ckpt, "cuda", torch.float32))
    compiled = Code2WavEngine(
        *load_code2wav(ckpt, "cuda", torch.float32),
        Code2WavEngineConfig(token2wav_compile_estimator=True),
    )
    a, b = _run(eager, _feeds(2), voice), _run(compiled, _feeds(2), voice)
    for sid in a:
        assert np.abs(a[sid] - b[sid]).max() < 1e-5


@needs_inductor
def test_compiled_slot_pool_matches_eager(ckpt, voice, monkeypatch):
    """The slot path compiled (its two parts around the pool, `compile_slot_blocks`) against
    the same path eager, batches of 1 and 3 rows: one graph per part for every batch size.
    Both with the shipped split matmuls, made to split the tiny DiT's products too (one chunk's
    112 rows split, three chunks' do not)."""
    from pipeline.code2wav import dit

    monkeypatch.setattr(dit, "SPLIT_MIN_K", 1)
    slots = Code2WavEngineConfig(token2wav_slot_pool=True, token2wav_dit_split_matmuls=True)
    eager = Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32), slots)
    compiled = Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32), Code2WavEngineConfig(
        token2wav_slot_pool=True, token2wav_compile_estimator=True,
        token2wav_dit_split_matmuls=True))
    for n in (1, 3):
        a, b = _run(eager, _feeds(n), voice), _run(compiled, _feeds(n), voice)
        for sid in a:
            _assert_close(torch.from_numpy(a[sid]), torch.from_numpy(b[sid]), sid)
        for eng in (eager, compiled):
            for sid in list(eng.streams):
                eng.abort(sid)
    assert compiled.counters["batch_size_3"] == 3
    # slot_pre, slot_post for one chunk (products split) and for three (whole), plus the plain
    # path's block graph built by setup_cache
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


@needs_inductor
def test_compiled_slot_pool_with_the_adaln_table(ckpt, voice, monkeypatch):
    """`token2wav_dit_adaln_table` under `compile_slot_blocks`: `slot_post` gets its
    modulations in the layout it has without the table (shapes, strides, offsets, dtype), so
    it is the same graph (Dynamo guards on sizes and strides: none of its own for the table);
    only `slot_pre` has one more, reading the table's row. The PCM within the bound of the
    eager slot path without it. The split configuration of the test above, whose graphs
    Inductor's cache holds by then (the table's `slot_pre` is the one compiled cold)."""
    from pipeline.code2wav import dit

    monkeypatch.setattr(dit, "SPLIT_MIN_K", 1)
    slots = Code2WavEngineConfig(token2wav_slot_pool=True, token2wav_dit_split_matmuls=True)
    ref = _run(Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32), slots), _feeds(1),
               voice)
    layouts, pcm = {}, {}
    for on in (False, True):
        flow, hift, cfg = load_code2wav(ckpt, "cpu", torch.float32)
        eng = Code2WavEngine(flow, hift, cfg, dataclasses.replace(
            slots, token2wav_compile_estimator=True, token2wav_dit_adaln_table=on))
        block = flow.decoder.estimator.blocks[1]
        post, seen = block._slot_post, layouts.setdefault(on, set())

        def recorded(x, attn_out, mod, cnn_cache, tail, post=post, seen=seen):
            seen.add(tuple((t.shape, t.stride(), t.storage_offset(), t.dtype,
                            t.untyped_storage().nbytes()) for t in mod))
            return post(x, attn_out, mod, cnn_cache, tail)

        block._slot_post = recorded
        pcm[on] = _run(eng, _feeds(1), voice)
    assert layouts[True] == layouts[False] and len(layouts[True]) == 1
    for sid in ref:
        _assert_close(torch.from_numpy(ref[sid]), torch.from_numpy(pcm[True][sid]), sid)
    # the plain path's block graph (setup_cache), slot_pre with c and with the table's row,
    # one slot_post for both
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


@needs_inductor
def test_compiled_slot_post_gathers_the_conv_tails_itself(ckpt, voice, monkeypatch):
    """`token2wav_dit_tails_in_post`: the compiled `slot_post` gathers the rows' conv tails
    from the pool itself (a load of its conv windows' kernel, not a launch of its own). The
    same PCM bit for bit as the compiled path without it, at 1 and 3 rows, and eager with it
    as without; one more `slot_post` graph (it takes the pool and the rows' index)."""
    from pipeline.code2wav import dit

    monkeypatch.setattr(dit, "SPLIT_MIN_K", 1)
    slots = Code2WavEngineConfig(token2wav_slot_pool=True, token2wav_dit_split_matmuls=True)
    pcm = {}
    for compiled in (False, True):
        for on in (False, True):
            eng = Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32), dataclasses.replace(
                slots, token2wav_compile_estimator=compiled, token2wav_dit_tails_in_post=on))
            assert eng.flow.decoder.estimator.blocks[0].tails_in_post is on
            pcm[compiled, on] = []
            for n in (1, 3):
                pcm[compiled, on].append(_run(eng, _feeds(n), voice))
                for sid in list(eng.streams):
                    eng.abort(sid)
    for compiled in (False, True):
        for a, b in zip(pcm[compiled, False], pcm[compiled, True], strict=True):
            for sid in a:
                assert np.array_equal(a[sid], b[sid]), (compiled, sid)
    # the plain path's block graph; slot_pre; slot_post split (one chunk) and whole (three),
    # each with the tails and with the pool
    assert counters["stats"]["unique_graphs"] == 6, dict(counters["stats"])


@needs_inductor
def test_compiled_slot_path_with_the_kv_write_kernel(ckpt, voice, monkeypatch):
    """`token2wav_dit_kv_write_kernel` under `compile_slot_blocks`: the compiled `slot_pre`'s
    k and v (v a view of its q|k|v product) go to `write_kv` as they come, and the PCM is the
    compiled path's without it, bit for bit."""
    from pipeline.code2wav import dit
    from pipeline.code2wav import pool_attention as pa

    if not pa.runs_here(torch.device("cpu")):
        pytest.skip("needs Triton (its interpreter on CPU)")
    monkeypatch.setattr(pa, "available", lambda device: True)  # the engine takes it on CPU
    monkeypatch.setattr(dit, "SPLIT_MIN_K", 1)
    pcm = {}
    for on in (False, True):
        eng = Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32), Code2WavEngineConfig(
            token2wav_slot_pool=True, token2wav_dit_split_matmuls=True,
            token2wav_compile_estimator=True, token2wav_dit_kv_write_kernel=on))
        assert eng.kv_write_kernel is on
        pcm[on] = _run(eng, _feeds(1), voice)
    for sid in pcm[False]:
        assert np.array_equal(pcm[False][sid], pcm[True][sid]), sid
