"""What the project's Triton kernels share (code2wav/pool_attention.py, talker/rope_kv.py,
thinker/qk_rope_kv.py): whether one can run on a device, and rounding to bf16.

On CUDA the kernels need Triton (shipped with PyTorch's CUDA builds). Under
`TRITON_INTERPRET=1` they run on CPU tensors in Triton's interpreter: the tests run them
that way, the engines never do.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `available` is False, callers keep their torch ops
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether an engine may use the kernels on `device`: CUDA with Triton. (On CPU they
    run only in Triton's interpreter, far slower than torch's ops: for tests.)"""
    return triton is not None and device.type == "cuda"


def runs_here(device: torch.device) -> bool:
    """Whether the kernels can run on `device` at all: `available`, or CPU in the
    interpreter."""
    return available(device) or (triton is not None and INTERPRET and device.type == "cpu")


if triton is not None:

    @triton.jit
    def round_bf16(x):
        """fp32 -> the nearest bf16 value (ties to even), kept in fp32, so it stores exactly.
        By the bits: Triton's interpreter truncates a cast to bf16 where the GPU rounds, and
        an explicit rounding between a product and a sum leaves the compiler no fused
        multiply-add to form across it."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
