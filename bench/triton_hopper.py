"""The project's Triton kernels compiled for Hopper (sm_90) on this machine, without a GPU.

Why: on CPU the tests run the kernels in Triton's interpreter, which executes them op by op
and compiles nothing: a kernel that runs there may still fail to compile for the GPU, spill
registers to local memory, or be specialized on a value that changes request by request (a
compile, ~1 s, in the middle of serving). This builds each kernel as its engine launches
it: the wrapper is called on CPU tensors of the full-size model's shapes while Triton's
driver is one that names an H100 / H200 (sm_90) and compiles without launching, so the
signature and the specialization are Triton's own; Triton's compiler and ptxas make the
cubin, and `cuobjdump` (both ship in Triton's wheel) reads its resources and instructions.

Each case launches its kernel as a start-up warm-up would, then at other values of the
arguments that change while serving (token counts, slots, position offsets, batch sizes,
chunk lengths), and counts the kernels compiled after the warm-up: zero means nothing
compiles in the middle of a request.

Prints, per kernel and case: kernels compiled (all, and after the warm-up), warps, and the
largest registers, local memory (spills) and shared memory over them; the first kernel's
SASS instructions, fused multiply-adds (FFMA) and tensor-core MMAs.

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
    after_warmup: int  # of them, compiled after the case's warm-up launches
    num_warps: int
    registers: int
    local_bytes: int  # spills (and any per-thread stack)
    shared_bytes: int
    instructions: int
    ffma: int
    mma: int  # tensor-core instructions (HMMA / HGMMA): TF32 or lower precision products
    opcodes: dict[str, int]
    sass: str


class Launches:
    """What each launch ran, in order, as (kernel name, CompiledKernel), and how many of
    them were a warm-up's (`warmed()` marks its end)."""

    def __init__(self) -> None:
        self.kernels: list = []
        self.warm = 0

    def warmed(self) -> None:
        self.warm = len(self.kernels)


@contextlib.contextmanager
def hopper() -> Iterator[Launches]:
    """Triton's launches inside compile for sm_90 and do not run: yields their record."""
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

    launches = Launches()
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launches.kernels.append((self.fn.__name__, kernel))
        return kernel

    before = driver._active  # None on a machine with no GPU (reset_active would raise)
    driver.set_active(Hopper())
    JITFunction.run = compile_only
    try:
        yield launches
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


def _describe(name: str, case: str, kernels: list, warm: int) -> Compiled:
    """`kernels`: what each launch ran, in launch order, the first `warm` the warm-up's.
    Resources: the largest over the distinct kernels; instructions: the first's."""
    distinct = {id(k): k for k in kernels}
    warmed = {id(k) for k in kernels[:warm]}
    usage = []
    for k in distinct.values():
        res = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", _cuobjdump(k.asm["cubin"],
                                                                             "-res-usage")))
        usage.append((int(res.get("REG", 0)), int(res.get("LOCAL", 0)) + int(res.get("STACK", 0)),
                      int(res.get("SHARED", 0)) + k.metadata.shared))
    kernel = kernels[0]
    sass = _cuobjdump(kernel.asm["cubin"], "-sass")
    ops = collections.Counter(m.group(1).split(".")[0] for m in _SASS_OP.finditer(sass))
    return Compiled(
        kernel=name, case=case, variants=len(distinct), after_warmup=len(distinct.keys() - warmed),
        num_warps=kernel.metadata.num_warps,
        registers=max(u[0] for u in usage), local_bytes=max(u[1] for u in usage),
        shared_bytes=max(u[2] for u in usage),
        instructions=sum(ops.values()), ffma=ops["FFMA"],
        mma=sum(n for op, n in ops.items() if "MMA" in op),
        opcodes=dict(ops.most_common()), sass=sass,
    )


# --- the cases: each calls its kernel's wrapper as the engine does, first as a warm-up
# would (then calls `warmed()`), then at the values of the arguments that change while
# serving.

def _talker(dtype: torch.dtype, warmed: Callable[[], None]) -> None:
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
    for i, (b, length, row0, offset) in enumerate((
            (1, 1, 0, 0), (1, 1, 5, 17), (4, 1, 1, 100), (8, 1, 0, 3), (1, 12, 0, 0),
            (1, 12, 3, 1), (1, 16, 7, 32), (1, 50, 2, 9), (2, 128, 0, 0))):
        qkv = torch.zeros(b, length, h + 2 * hkv, d, dtype=dtype)
        positions = table[:b, offset:offset + length]
        rope_kv_(qkv, rope_cs, positions, positions, kv, row0, h, hkv)
        if i == 0:
            warmed()


def _thinker(dtype: torch.dtype, warmed: Callable[[], None]) -> None:
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
        if t == 1:
            warmed()


def _pool_attention(warmed: Callable[[], None]) -> None:
    """Code2Wav's pool_attention at the slot step's shapes: 1, 2 and 4 chunks (2 estimator
    rows each), a chunk's frames against a window of the pool (the engine's warm-up runs
    every batch size; the graphs replay these shapes)."""
    from pipeline.code2wav import pool_attention as pa

    heads, dh, slots, cap = 8, 64, 8, 512
    k_pool = torch.zeros(2, slots, cap, heads, dh)
    v_pool = torch.zeros(2, slots, cap, heads, dh)
    for rows in (2, 4, 8):
        q = torch.zeros(rows, heads, 56, dh)
        cfg = torch.zeros(rows, dtype=torch.long)
        mask = torch.ones(rows, 1, 1, 192, dtype=torch.bool)
        pa.pool_attention(q, k_pool, v_pool, cfg, cfg.clone(), mask, 192)
    warmed()


def _kv_write(dtype: torch.dtype, warmed: Callable[[], None]) -> None:
    """Code2Wav's write_kv (`token2wav_dit_kv_write_kernel`): a block's new keys and values
    into the slot pool, v a view of the q|k|v product, at 1 chunk (the warm-up), then 2, 4
    and 8 (2 estimator rows a chunk, 56 frames each)."""
    from pipeline.code2wav import pool_attention as pa

    heads, dh, slots, cap = 8, 64, 9, 512
    pools = [torch.zeros(2, slots, cap, heads, dh, dtype=dtype) for _ in range(2)]
    for chunks in (1, 2, 4, 8):
        rows, t = 2 * chunks, 56
        qkv = torch.zeros(rows, t, 3 * heads * dh, dtype=dtype)
        k = torch.zeros(rows, t, heads, dh, dtype=dtype)
        v = qkv[..., 2 * heads * dh:].reshape(rows, t, heads, dh)
        pa.write_kv(k, v, *pools, torch.zeros(rows * t, dtype=torch.long))
        if chunks == 1:
            warmed()


def _conv_windows(warmed: Callable[[], None], frame_major: bool = False) -> None:
    """The causal vocoder's conv windows (`token2wav_vocoder_window_kernel`): every conv's
    call of a stream's chunks, recorded from the vocoder's torch path (the tiny config's:
    kernel sizes, dilations, rates and paddings are the released ones, only the channel
    counts differ, and those the kernel takes unspecialized), replayed for the kernel: the
    warm-up's chunks of one stream and of eight, then streams at other chunk lengths."""
    from pipeline.code2wav import causal_hift
    from pipeline.code2wav.assets import random_vocoder, tiny_code2wav_config
    from pipeline.code2wav.conv_windows import conv_windows

    vocoder = random_vocoder(tiny_code2wav_config(), 0, "minicpmo-utils-1.0.7")
    vocoder.gemm_convs(True)
    calls: list = []
    conv = causal_hift._Conv.conv

    def record(self, x, left=0, right=0, up=1, bias=True):
        (k,), (d,), (st,) = self.kernel_size, self.dilation, self.stride
        calls.append((x.shape, x.stride(), x.storage_offset(), x.dtype, k, d, st, left, right,
                      up))
        return conv(self, x, left, right, up, bias)

    def stream(batch: int, sizes: list[int]) -> list:
        calls.clear()
        states = causal_hift.CausalVocoderState.empty(batch, vocoder, "cpu").split()
        mel = torch.zeros(batch, 80, sum(sizes))
        o = 0
        for i, n in enumerate(sizes):
            _, states = causal_hift.vocode_chunk(vocoder, states, mel[:, :, o:o + n],
                                                 i == len(sizes) - 1)
            o += n
        return list(calls)

    causal_hift._Conv.conv = record
    try:  # the engine's warm-up: full chunks (50 mel frames) at 1 and 8 streams, a flush
        warm = stream(1, [50, 50, 50, 7]) + stream(8, [50, 50])
        later = stream(3, [50, 33, 50, 12]) + stream(2, [21, 50, 1])
    finally:
        causal_hift._Conv.conv = conv
    for calls_ in (warm, later):
        for shape, stride, offset, dtype, *geometry in calls_:  # the input's layout too
            size = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
            x = torch.empty(size, dtype=dtype).as_strided(shape, stride, offset)
            conv_windows(x, *geometry, frame_major=frame_major and shape[0] > 1)
        if calls_ is warm:
            warmed()

CASES: dict[str, Callable[[Callable[[], None]], None]] = {
    "talker rope_kv bf16": lambda warmed: _talker(torch.bfloat16, warmed),
    "talker rope_kv fp32": lambda warmed: _talker(torch.float32, warmed),
    "thinker qk_rope_kv bf16": lambda warmed: _thinker(torch.bfloat16, warmed),
    "thinker qk_rope_kv fp32": lambda warmed: _thinker(torch.float32, warmed),
    "code2wav pool_attention fp32": _pool_attention,
    "code2wav write_kv fp32": lambda warmed: _kv_write(torch.float32, warmed),
    "code2wav write_kv bf16": lambda warmed: _kv_write(torch.bfloat16, warmed),
    "code2wav conv_windows": _conv_windows,
    "code2wav conv_windows frame-major": lambda warmed: _conv_windows(warmed, frame_major=True),
}


def compile_all() -> list[Compiled]:
    if triton is None:
        raise SystemExit("triton is not installed")
    if INTERPRET:
        raise SystemExit("TRITON_INTERPRET=1 runs the kernels in the interpreter: unset it")
    out = []
    for case, call in CASES.items():
        with hopper() as launches:
            call(launches.warmed)
        by_kernel: dict[str, list] = {}
        for name, kernel in launches.kernels:
            by_kernel.setdefault(name, []).append(kernel)
        n_warm = collections.Counter(name for name, _ in launches.kernels[:launches.warm])
        out += [_describe(name, case, kernels, n_warm[name])
                for name, kernels in by_kernel.items()]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the reports (without SASS) here")
    p.add_argument("--sass", type=Path, help="write each kernel's SASS into this folder")
    args = p.parse_args(argv)
    reports = compile_all()
    print(f"triton {triton.__version__}, sm_{ARCH}")
    print(f"{'case':30} {'kernels':>7} {'later':>5} {'warps':>5} {'regs':>4} {'local B':>7} "
          f"{'shared B':>8} {'SASS':>5} {'FFMA':>4} {'MMA':>4}")
    for r in reports:
        print(f"{r.case:30} {r.variants:7} {r.after_warmup:5} {r.num_warps:5} {r.registers:4} "
              f"{r.local_bytes:7} {r.shared_bytes:8} {r.instructions:5} {r.ffma:4} {r.mma:4}")
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
