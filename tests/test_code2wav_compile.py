"""Regional torch.compile of the DiT blocks (`compile_dit_blocks`, `compile_slot_blocks`: what
the engine compiles on CUDA) on CPU, fp32:

  * the graph count: a counting backend (Dynamo's graphs run as is, no codegen: fast) over the
    plain path decoding 4 chunks of one stream, then 4 chunks of two streams batched;
  * compiled == eager with Inductor: DiT forward_chunk without and with caches at 2 and 4
    rows, and a whole engine's PCM. Inductor needs a C++ compiler on CPU; each graph costs
    ~15 s to compile cold on 2 cores, so the tests are built to need few graphs.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from pipeline.code2wav.assets import load_code2wav, tiny_code2wav_config
from pipeline.code2wav.dit import DiT, compile_dit_blocks, compile_slot_blocks
from pipeline.code2wav.engine import Code2WavEngine
from pipeline.code2wav.voice import VoiceCache
from tests._code2wav_plain import PlainEngine, stream_step
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
    batched (4 rows) for 4 chunks and a short final chunk: 2 graphs (no cache: the template;
    a cache), none for the new L, T or batch."""
    from pipeline.code2wav.stream import Crossfade

    flow, hift, cfg = load_code2wav(ckpt, "cpu", torch.float32)
    counter = CompileCounter()
    compile_dit_blocks(flow.decoder.estimator, backend=counter)
    plain = PlainEngine(flow, hift, cfg)
    _run(plain, {"s0": [(_codes(k, 25), False) for k in range(4)]}, voice)
    plain.open("t0", voice)
    plain.open("t1", voice)
    states = [plain.streams[t][0] for t in ("t0", "t1")]
    xf = Crossfade(3840, "cpu")
    for k in range(4):
        tokens = torch.tensor([[cfg.silence_code] * 3 + _codes(10 * i + k, 25) for i in range(2)])
        _, states = stream_step(flow, hift, cfg, states, tokens, False, xf)
    tokens = torch.tensor([_codes(50 + i, 9) for i in range(2)])
    stream_step(flow, hift, cfg, states, tokens, True, xf)
    assert counter.frame_count == 2, f"{counter.frame_count} graphs for the DiT blocks"


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


def _compiled_engine(ckpt):
    """An engine whose DiT blocks are compiled as the engine compiles them on CUDA."""
    eng = Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32))
    compile_dit_blocks(eng.flow.decoder.estimator)
    compile_slot_blocks(eng.flow.decoder.estimator)
    return eng


@needs_inductor
def test_compiled_slot_pool_matches_eager(ckpt, voice, monkeypatch):
    """The slot path compiled (its two parts around the pool, `compile_slot_blocks`, and the
    template's blocks) against the same path eager, batches of 1 and 3 rows: one graph per
    part for every batch size. Both with the large-K products made to split the tiny DiT's
    products too (one chunk's 112 rows split, three chunks' do not)."""
    from pipeline.code2wav import dit

    monkeypatch.setattr(dit, "SPLIT_MIN_K", 1)
    eager = Code2WavEngine(*load_code2wav(ckpt, "cpu", torch.float32))
    compiled = _compiled_engine(ckpt)
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
def test_compiled_slot_path_with_the_kv_write_kernel(ckpt, voice, monkeypatch):
    """The slot path compiled, with its new keys and values written by `write_kv` (Triton's
    interpreter here): the compiled `slot_pre`'s k and v (v a view of its q|k|v product) go
    to the kernel as they come, and the PCM is the compiled path's without it, bit for bit."""
    from pipeline.code2wav import dit
    from pipeline.code2wav import pool_attention as pa

    if not pa.runs_here(torch.device("cpu")):
        pytest.skip("needs Triton (its interpreter on CPU)")
    monkeypatch.setattr(dit, "SPLIT_MIN_K", 1)
    monkeypatch.setattr(pa, "MAX_ROWS", 0)  # the attention stays the gathers + SDPA
    pcm = {}
    for on in (False, True):
        monkeypatch.setattr(pa, "available", lambda device, on=on: on)
        eng = _compiled_engine(ckpt)
        assert all(b.attn.kv_kernel is on for b in eng.flow.decoder.estimator.blocks)
        pcm[on] = _run(eng, _feeds(1), voice)
    for sid in pcm[False]:
        assert np.array_equal(pcm[False][sid], pcm[True][sid]), sid
