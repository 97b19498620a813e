"""What the GPU scripts time is what ships: their `SHIPPED` configurations against
serve_config.yaml (the scripts themselves need CUDA; these checks do not)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from deployments.config import AppConfig, dataclass_from_dict

ROOT = Path(__file__).resolve().parents[1]


def _shipped_engine(stage: str, cls):
    doc = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg = AppConfig.model_validate(doc["applications"][0]["args"])
    return dataclass_from_dict(cls, cfg.stages()[stage].engine, stage)


def test_gpu_code2wav_times_the_shipped_code2wav_step():
    from bench import gpu_code2wav
    from pipeline.code2wav.engine import Code2WavEngineConfig

    shipped = _shipped_engine("code2wav", Code2WavEngineConfig)
    bench = gpu_code2wav.SHIPPED
    # what shapes a step: every fast path and the precision (not the batching policy, the
    # slot count or the waits, which the script sets per measurement)
    step = [f.name for f in dataclasses.fields(Code2WavEngineConfig)
            if f.name.startswith("token2wav_")]
    assert {k: getattr(bench, k) for k in step} == {k: getattr(shipped, k) for k in step}


def test_gpu_code2wav_flips_one_knob():
    from bench import gpu_code2wav

    on = gpu_code2wav.flipped("token2wav_dit_adaln_table")
    assert on.token2wav_dit_adaln_table is True
    assert dataclasses.replace(on, token2wav_dit_adaln_table=False) == gpu_code2wav.SHIPPED
    off = gpu_code2wav.flipped("token2wav_dit_pool_attention")
    assert off.token2wav_dit_pool_attention is False
    both = gpu_code2wav.flipped("token2wav_dit_adaln_table+token2wav_dit_pool_attention")
    assert both == dataclasses.replace(off, token2wav_dit_adaln_table=True)
    assert gpu_code2wav.flipped_name("token2wav_dit_adaln_table+token2wav_dit_pool_attention") \
        == "shipped, token2wav_dit_adaln_table=True, token2wav_dit_pool_attention=False"


def test_gpu_code2wav_says_whether_a_knob_gives_the_shipped_pcm():
    import numpy as np

    from bench import gpu_code2wav

    shipped = {"s0": [np.arange(4, dtype=np.float32)], "s1": [np.zeros(3, np.float32)]}
    same = {k: [c.copy() for c in v] for k, v in shipped.items()}
    assert gpu_code2wav.same_as(shipped, same, "exact") == {"bitwise": True, "max_abs": 0.0}
    other = {**same, "s1": [np.full(3, 2e-7, np.float32)]}
    got = gpu_code2wav.same_as(shipped, other, "reordered")
    assert not got["bitwise"] and abs(got["max_abs"] - 2e-7) < 1e-12


def test_gpu_code2wav_timeline_finds_where_no_kernel_runs():
    from bench import gpu_code2wav

    # kernels at [0, 10), [5, 12) overlapping, then [20, 25) and [40, 41): gaps of 8 and 15 us
    seq = [(0.0, "a", 10.0), (5.0, "b", 7.0), (20.0, "c", 5.0), (40.0, "d", 1.0)]
    got = gpu_code2wav.timeline(seq)
    assert got["span_ms"] == 0.041 and got["idle_ms"] == 0.023 and got["gaps"] == 2
    assert [(g["us"], g["at"], g["after"], g["before"]) for g in got["largest"]] == [
        (15.0, 3, "c", "d"), (8.0, 2, "b", "c")]
    assert gpu_code2wav.timeline([]) == {}


def test_gpu_code2wav_ties_each_costly_kernel_to_the_ops_that_launch_it():
    """`--profile-ops`' attribution, on stand-in profiler events: a kernel's GPU time summed
    per launching op (its aten callers, its shapes, the innermost pipeline/ source line)."""
    from types import SimpleNamespace as NS

    from bench import gpu_code2wav

    def frame(name, parent=None):
        return NS(name=name, cpu_parent=parent, kernels=[], input_shapes=None)

    def op(name, parent, shapes, kernels):
        return NS(name=name, cpu_parent=parent, input_shapes=shapes,
                  kernels=[NS(name=k, duration=us) for k, us in kernels])

    top = frame("pipeline/code2wav/engine.py(400): step")
    conv = frame("pipeline/code2wav/causal_hift.py(92): conv", top)
    attn = frame("pipeline/code2wav/dit.py(321): attend_slots", top)
    reshape = frame("aten::reshape", attn)
    clone = op("aten::clone", reshape, [[16, 656, 8, 64]], [])
    events = [
        op("aten::add", conv, [[8, 64, 4081], [64, 1]], [("legacy", 100.0)]),
        op("aten::add", conv, [[8, 64, 4081], [64, 1]], [("legacy", 120.0)]),
        op("aten::copy_", clone, [[16, 656, 8, 64]], [("legacy", 400.0)]),
        op("aten::mm", conv, [[64, 704], [704, 4081]], [("gemm", 50.0), ("gemm", 30.0)]),
        op("aten::fill_", None, [[4]], [("fill", 1.0)]),  # no pipeline/ caller
        clone, reshape, conv, top,
    ]
    rows = gpu_code2wav.kernel_sources(events, top=2, per_kernel=2)
    assert [(r["kernel"], r["ms"], r["n"]) for r in rows] == [("legacy", 0.62, 3), ("gemm", 0.08, 2)]
    assert rows[0]["ops"] == [
        {"op": "copy_<clone<reshape", "shapes": "[[16, 656, 8, 64]]", "ms": 0.4, "n": 1,
         "site": "code2wav/dit.py(321): attend_slots"},
        {"op": "add", "shapes": "[[8, 64, 4081], [64, 1]]", "ms": 0.22, "n": 2,
         "site": "code2wav/causal_hift.py(92): conv"}]
    assert gpu_code2wav.kernel_sources(events, top=3)[2]["ops"][0]["site"] == "?"
