"""The causal vocoder's conv windows built by one Triton kernel: zero padding, nearest
upsampling and the window copy in one pass.

Why: each of the causal vocoder's convs is one matmul over its input's windows laid out
(B, C k, T) (causal_hift.py `_Conv`). Building them takes `F.pad` (a zero fill and a copy),
then the window copy, and for an upsampling conv `F.interpolate` before both: three or four
launches for each of a chunk's ~180 convs. This kernel writes the windows straight from the
conv's input: row c k + j, frame t of a batch row holds input
frame (t stride + j dilation - left) // up, or zero where that falls in the padding.

Only copies: the windows are bit for bit the torch path's, and so is every product over
them. On CPU it runs only in Triton's interpreter, in the tests (pipeline/triton_kernels.py).

`frame_major` writes them (B, T, C k) instead: the order the conv's product reads them in
(causal_hift.py `_Conv`), where torch.matmul would copy the (B, C k, T) windows into it.
"""

from __future__ import annotations

import torch

from pipeline.triton_kernels import INTERPRET, available, runs_here, triton

if triton is not None:
    import triton.language as tl

__all__ = ["available", "conv_windows", "runs_here"]

# A program writes ROWS window rows x FRAMES frames. Fixed, not chosen by the frame count:
# a chunk's frame counts vary (first, steady and last chunks), and a tile that followed them
# would compile a kernel mid-turn. (The interpreter compiles nothing and runs programs one
# by one, each op costing far more than on its data: there a tile covers the whole output.)
ROWS, FRAMES = 8, 128
# Frame-major stores run along the rows (C k floats a frame): more rows, fewer frames a tile.
ROWS_FM, FRAMES_FM = 64, 16


if triton is not None:

    # Frame counts, batch rows and the input's strides change chunk by chunk, and so does
    # the input's alignment (a decode window starts at any mel frame): not specialized on (a
    # value of 1 or a multiple of 16, a 16-byte aligned pointer), so a chunk of a new length,
    # offset or batch size compiles nothing.
    @triton.jit(do_not_specialize=["x_ptr", "t_in", "t_out", "rows", "batch_rows", "sx_b", "sx_c"])
    def _windows_kernel(
        x_ptr, out_ptr,
        t_in, t_out, rows, batch_rows,
        sx_b, sx_c, sx_t,
        K: tl.constexpr, DIL: tl.constexpr, STRIDE: tl.constexpr, LEFT: tl.constexpr,
        UP: tl.constexpr, R: tl.constexpr, BT: tl.constexpr, FRAME_MAJOR: tl.constexpr,
    ):
        q = tl.program_id(0) * R + tl.arange(0, R)  # rows of the (B C K, T_out) output
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        b, r = q // rows, q % rows  # window row r = c K + j of batch row b
        c, j = r // K, r % K
        p = t[None, :] * STRIDE + (j * DIL)[:, None] - LEFT  # in the upsampled input
        keep = (q < batch_rows)[:, None] & (t < t_out)[None, :]
        inside = keep & (p >= 0) & (p < t_in * UP)
        src = tl.where(inside, p, 0) // UP
        row = b.to(tl.int64) * sx_b + c * sx_c
        v = tl.load(x_ptr + row[:, None] + src * sx_t, mask=inside, other=0.0)
        if FRAME_MAJOR:  # (B, T_out, C K): frame t of batch row b is C K floats
            at = (b.to(tl.int64)[:, None] * t_out + t[None, :]) * rows + r[:, None]
        else:  # (B C K, T_out)
            at = q.to(tl.int64)[:, None] * t_out + t[None, :]
        tl.store(out_ptr + at, v, mask=keep)


def conv_windows(x: torch.Tensor, kernel: int, dilation: int = 1, stride: int = 1,
                 left: int = 0, right: int = 0, up: int = 1,
                 frame_major: bool = False) -> torch.Tensor:
    """The windows of a conv (taps `kernel`, `dilation`, `stride`) over x (B, C, T)
    upsampled `up` times (nearest) and padded with `left` / `right` zero frames, as a
    contiguous (B, C kernel, T_out): what `F.pad(F.interpolate(x, scale_factor=up),
    (left, right)).unfold(2, span, stride)[..., ::dilation].transpose(2, 3).reshape(B, C k,
    T_out)` gives; `frame_major`: as a contiguous (B, T_out, C kernel), the same windows
    `.permute(0, 2, 1, 3)` before the reshape."""
    b, c, t_in = x.shape
    span = dilation * (kernel - 1) + 1
    t_out = (t_in * up + left + right - span) // stride + 1
    if min(kernel, dilation, stride, up) < 1 or min(left, right) < 0 or t_out < 1:
        raise ValueError(f"conv_windows: no window of {span} frames fits {t_in} x {up} "
                         f"+ {left} + {right}")
    rows = c * kernel
    shape = (b, t_out, rows) if frame_major else (b, rows, t_out)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    tile_r, tile_t = (ROWS_FM, FRAMES_FM) if frame_major else (ROWS, FRAMES)
    if INTERPRET:
        tile_t = min(triton.next_power_of_2(t_out), 2**14)
        tile_r = max(1, min(triton.next_power_of_2(b * rows), 2**20 // tile_t))
    grid = (triton.cdiv(b * rows, tile_r), triton.cdiv(t_out, tile_t))
    _windows_kernel[grid](
        x, out, t_in, t_out, rows, b * rows, *x.stride(),
        K=kernel, DIL=dilation, STRIDE=stride, LEFT=left, UP=up, R=tile_r, BT=tile_t,
        FRAME_MAJOR=frame_major,
    )
    return out
