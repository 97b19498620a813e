"""The project's Triton kernels compiled for Hopper (sm_90) on this machine, without a GPU.

Why: on CPU the tests run the kernels in Triton's interpreter, which executes them op by op
and compiles nothing: a kernel that runs there may still fail to compile for the GPU, spill
registers to local memory, or be specialized on a value that changes request by request (a
compile, ~1 s, in the middle of serving). This builds each kernel as its engine launches
it: the wrapper is called on CPU tensors of the full-size model's shapes while Triton's
driver is one that names an H100 / H200 (sm_90) and compiles without launching, so the
signature and the specialization are Triton's own; Triton's compiler and ptxas make the
cubin, and `cuobjdump` (both ship in Triton's wheel) reads its resources and instructions.

Each case calls its wrapper at several values of the arguments that change during serving
(token counts, slots, position offsets, batch sizes) and counts the distinct kernels
compiled: one means nothing new compiles while serving.

Prints, per kernel and case: variants compiled, warps, registers, local memory (spills),
shared memory, SASS instructions, fused multiply-adds (FFMA) and tensor-core MMAs.

    python -m bench.triton_hopper [--json F] [--sass DIR]

Needs TRITON_INTERPRET unset (the interpreter replaces the kernels it would compile).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pipeline import presets
from pipeline.triton_kernels import INTERPRET, triton

ARCH = 90  # H100 / H200


@dataclasses.dataclass
class Compiled:
    kernel: str
    case: str
    variants: int  # distinct kernels compiled over the case's launches
    num_warps: int
    registers: int
    local_bytes: int  # spills (and any per-thread stack)
    shared_bytes: int
    instructions: int
    ffma: int
    mma: int  # tensor-core instructions (HMMA / HGMMA): TF32 or lower precision products
    opcodes: dict[str, int]
    sass: str


@contextlib.contextmanager
def hopper() -> Iterator[list]:
    """Triton's launches inside compile for sm_90 and do not run; yields the list each
    compiled kernel is appended to, as (kernel name, CompiledKernel)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Hopper:  # what JITFunction.run asks of a driver before it compiles
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", ARCH, 32)

    compiled: list = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    before = driver._active  # None on a machine with no GPU (reset_active would raise)
    driver.set_active(Hopper())
    JITFunction.run = compile_only
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver.set_active(before)


# "        /*05d0*/   @!P0 FFMA R11, R18, R18, R11 ;": the opcode after the address and any
# predicate
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, *flags, f.name], check=True,
                              capture_output=True, text=True).stdout


def _describe(name: str, case: str, kernels: list) -> Compiled:
    distinct = {id(k): k for k in kernels}
    kernel = kernels[0]
    cubin = kernel.asm["cubin"]
    res = _cuobjdump(cubin, "-res-usage")
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    sass = _cuobjdump(cubin, "-sass")
    ops = collections.Counter(m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass))
    return Compiled(
        kernel=name, case=case, variants=len(distinct), num_warps=kernel.metadata.num_warps,
        registers=int(usage.get("REG", 0)),
        local_bytes=int(usage.get("LOCAL", 0)) + int(usage.get("STACK", 0)),
        shared_bytes=int(usage.get("SHARED", 0)) + kernel.metadata.shared,
        instructions=sum(ops.values()), ffma=ops["FFMA"],
        mma=sum(n for op, n in ops.items() if "MMA" in op),
        opcodes=dict(ops.most_common()), sass=sass,
    )


# --- the cases: each calls its kernel's wrapper as the engine does, at the values of the
# arguments that change while serving.

def _talker(dtype: torch.dtype) -> None:
    """The fused Talker's rope_kv_: decode steps of 1-8 streams at any slot and prefills of
    any prompt length at slices of the positions table (`TalkerFused.forward`)."""
    from pipeline.config import talker_config_from_hf
    from pipeline.talker.rope_kv import rope_kv_

    cfg = talker_config_from_hf(presets.full_hf_config())
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    slots, cap = 8, 2048
    kv = torch.zeros(2, slots, hkv, cap, d, dtype=dtype)
    rope_cs = torch.zeros(cap + 1, 2, d, dtype=dtype)
    table = torch.arange(cap, dtype=torch.long).expand(slots, cap)
    for b, length, row0, offset in ((1, 1, 0, 0), (1, 1, 5, 17), (4, 1, 1, 100), (8, 1, 0, 3),
                                     (1, 12, 0, 0), (1, 12, 3, 1), (1, 16, 7, 32), (1, 50, 2, 9),
                                     (2, 128, 0, 0)):
        qkv = torch.zeros(b, length, h + 2 * hkv, d, dtype=dtype)
        positions = table[:b, offset:offset + length]
        rope_kv_(qkv, rope_cs, positions, positions, kv, row0, h, hkv)


def _thinker(dtype: torch.dtype) -> None:
    """The Thinker's qk_norm_rope_kv: q, k, v as views of the q|k|v GEMM's output for steps
    of any token count (`Qwen3LM` under `fuse_qk_rope_kv`)."""
    from pipeline.config import llm_config_from_hf
    from pipeline.thinker.qk_rope_kv import qk_norm_rope_kv

    llm = llm_config_from_hf(presets.full_hf_config())
    hq, hkv, d = llm.num_attention_heads, llm.num_key_value_heads, llm.head_dim
    kv = torch.zeros(64, 2, 16, hkv, d, dtype=dtype)  # (blocks, K / V, block, Hkv, D)
    q_w, k_w = torch.ones(d, dtype=dtype), torch.ones(d, dtype=dtype)
    for t in (1, 2, 3, 8, 16, 17, 256, 2600):
        qkv = torch.zeros(t, (hq + 2 * hkv) * d, dtype=dtype)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        cos = torch.zeros(t, 1, d)  # the rotary table's rows: fp32
        rows = torch.zeros(2, t, dtype=torch.long)
        qk_norm_rope_kv(q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), q_w, k_w,
                        llm.rms_norm_eps, cos, cos.clone(), kv, rows)


def _pool_attention() -> None:
    """Code2Wav's pool_attention at the slot step's shapes: 1, 2 and 4 chunks (2 estimator
    rows each), a chunk's frames against a window of the pool."""
    from pipeline.code2wav import pool_attention as pa

    heads, dh, slots, cap = 8, 64, 8, 512
    k_pool = torch.zeros(2, slots, cap, heads, dh)
    v_pool = torch.zeros(2, slots, cap, heads, dh)
    for rows in (2, 4, 8):
        q = torch.zeros(rows, heads, 56, dh)
        cfg = torch.zeros(rows, dtype=torch.long)
        mask = torch.ones(rows, 1, 1, 192, dtype=torch.bool)
        pa.pool_attention(q, k_pool, v_pool, cfg, cfg.clone(), mask, 192)


CASES: dict[str, Callable[[], None]] = {
    "talker rope_kv bf16": lambda: _talker(torch.bfloat16),
    "talker rope_kv fp32": lambda: _talker(torch.float32),
    "thinker qk_rope_kv bf16": lambda: _thinker(torch.bfloat16),
    "thinker qk_rope_kv fp32": lambda: _thinker(torch.float32),
    "code2wav pool_attention fp32": _pool_attention,
}


def compile_all() -> list[Compiled]:
    if triton is None:
        raise SystemExit("triton is not installed")
    if INTERPRET:
        raise SystemExit("TRITON_INTERPRET=1 runs the kernels in the interpreter: unset it")
    out = []
    for case, call in CASES.items():
        with hopper() as compiled:
            call()
        by_kernel: dict[str, list] = {}
        for name, kernel in compiled:
            by_kernel.setdefault(name, []).append(kernel)
        out += [_describe(name, case, kernels) for name, kernels in by_kernel.items()]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the reports (without SASS) here")
    p.add_argument("--sass", type=Path, help="write each kernel's SASS into this folder")
    args = p.parse_args(argv)
    reports = compile_all()
    print(f"triton {triton.__version__}, sm_{ARCH}")
    print(f"{'case':30} {'variants':>8} {'warps':>5} {'regs':>4} {'local B':>7} "
          f"{'shared B':>8} {'SASS':>5} {'FFMA':>4} {'MMA':>4}")
    for r in reports:
        print(f"{r.case:30} {r.variants:8} {r.num_warps:5} {r.registers:4} {r.local_bytes:7} "
              f"{r.shared_bytes:8} {r.instructions:5} {r.ffma:4} {r.mma:4}")
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
        for r in reports:
            (args.sass / (r.case.replace(" ", "_") + ".sass")).write_text(r.sass)
    if args.json:
        rows = [{k: v for k, v in dataclasses.asdict(r).items() if k != "sass"} for r in reports]
        args.json.write_text(json.dumps({"triton": triton.__version__, "arch": ARCH,
                                         "kernels": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
