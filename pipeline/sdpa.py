"""Which SDPA kernels run attention whose shapes change from call to call (CUDA).

cuDNN attention, SDPA's first choice for bf16 on recent GPUs, builds a graph for every new
shape it meets: host time paid inside the engine step at each new (batch, length), so it
stalls every request in that step (a Talker prefill of a new prompt length, a vision batch
of a new size or frame shape, an audio clip of a new length). Flash and memory-efficient
attention compute the same softmax(QK^T)V with no per-shape cost. So the encoders, the resampler and the Talker's
prefills (a streamed chunk's recompute prompt has any length) run under `any_shape()`;
attention captured once per shape in a CUDA graph keeps SDPA's own choice. On the CPU the
kernels allowed include SDPA's CPU ones (flash, math): nothing changes there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.nn.attention import SDPBackend, sdpa_kernel

NO_CUDNN_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]
# What `any_shape` allows; None = SDPA's own choice (benchmarks compare the two).
KERNELS: list[SDPBackend] | None = NO_CUDNN_ATTENTION


def any_shape() -> contextlib.AbstractContextManager:
    """The context for SDPA calls whose shapes vary."""
    return sdpa_kernel(KERNELS) if KERNELS is not None else contextlib.nullcontext()


@contextlib.contextmanager
def sdpa_choice(on: bool = True) -> Iterator[None]:
    """While `on`: `any_shape` calls get SDPA's own choice, cuDNN attention included (what
    benchmarks compare the shipped kernels with)."""
    global KERNELS
    shipped = KERNELS
    KERNELS = None if on else shipped
    try:
        yield
    finally:
        KERNELS = shipped
