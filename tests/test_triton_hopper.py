"""The project's Triton kernels compiled for Hopper (sm_90) by Triton's own compiler and
ptxas, on this machine (`bench/triton_hopper.py`): what the interpreter the other tests run
them in cannot show (the compile itself, spills, specialization, the instructions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict[str, dict]:
    from triton import knobs

    if not Path(knobs.nvidia.cuobjdump.path).is_file():
        pytest.skip("this Triton wheel has no cuobjdump")
    out = tmp_path_factory.mktemp("hopper") / "kernels.json"
    # a process of its own: this one runs the kernels in the interpreter (conftest)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out.parent / "cache")
    # the compiler free to contract a multiply and an add (Triton's default up to 3.9, and
    # the GPU machine's): what the kernels' explicit roundings must keep it from doing
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "bench.triton_hopper", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["arch"] == 90
    return {k["case"]: k for k in report["kernels"]}


def test_every_kernel_compiles_for_hopper_without_spills(kernels):
    assert set(kernels) == {"talker rope_kv bf16", "talker rope_kv fp32",
                            "thinker qk_rope_kv bf16", "thinker qk_rope_kv fp32",
                            "code2wav pool_attention fp32", "code2wav write_kv fp32",
                            "code2wav write_kv bf16", "code2wav conv_windows",
                            "code2wav conv_windows frame-major"}
    for case, k in kernels.items():
        assert k["instructions"] > 0, case
        assert k["local_bytes"] == 0, f"{case}: {k['local_bytes']} bytes of local memory (spills)"
        assert k["registers"] <= 255, case


def test_serving_compiles_nothing_new(kernels):
    """Each case launched its kernel as a warm-up would, then at the token counts, slots,
    batch sizes, position offsets and chunk lengths that change step by step: nothing
    compiled after the warm-up, so no compile in the middle of a request. The LLM kernels
    compile once for all of them; the vocoder's windows once per conv geometry."""
    for case, k in kernels.items():
        assert k["after_warmup"] == 0, case
    for case in ("talker rope_kv bf16", "talker rope_kv fp32", "thinker qk_rope_kv bf16",
                 "thinker qk_rope_kv fp32", "code2wav write_kv fp32", "code2wav write_kv bf16"):
        assert kernels[case]["variants"] == 1, case


def test_talker_bf16_rounds_each_product_before_the_sum(kernels):
    """The Talker kernel rounds x * cos and x_rot * sin to bf16 and then their sum, as torch's
    bf16 ops do: compiled with FP fusion on, the code has no fused multiply-add (one rounding
    fewer) anywhere. (Its fp32 path may contract, as its module says.)"""
    assert kernels["talker rope_kv bf16"]["ffma"] == 0


def test_pool_attention_multiplies_in_ieee_fp32(kernels):
    """Code2Wav computes in fp32: the attention kernel's products run on the FP32 units,
    never on tensor cores (TF32)."""
    assert kernels["code2wav pool_attention fp32"]["mma"] == 0
