"""Small helpers shared by the stages."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Construct modules directly in `dtype` (no fp32 copy of a large model first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """"auto" = bf16 on CUDA, fp32 elsewhere; otherwise a torch dtype name."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def resolve_device(name: str) -> torch.device:
    """"auto" = cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def fuse_into_views(linears: list[nn.Linear], name: str = "weight") -> torch.Tensor:
    """Concatenate the linears' `name` tensors (weight or bias) along the output dim and make
    each a view of the joined tensor (no extra memory; state_dict and load_state_dict see the
    same parameters). A later `.to()` or load that replaces the parameters breaks the views:
    join after those."""
    params = [getattr(lin, name) for lin in linears]
    fused = torch.cat([p.data for p in params], dim=0)
    row = 0
    for lin, p in zip(linears, params):
        n = p.shape[0]
        setattr(lin, name, nn.Parameter(fused[row : row + n], requires_grad=p.requires_grad))
        row += n
    return fused


def drain(steps: Generator[object, None, T]) -> T:
    """Run a step-wise generator (one that yields between its GPU steps) to its end, with
    nothing between the steps; its return value. A step may yield work still in flight on
    the GPU (an object with `wait()`, such as a Code2Wav `Landing`): that is waited for,
    not polled."""
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value
        wait = getattr(step, "wait", None)
        if wait is not None:
            wait()
