"""What a function about to be captured as a CUDA graph runs, recorded on the CPU.

A CUDA graph cannot capture a host sync: `AtenOps` records every aten op a call runs, and
`HOST_READS` names those that read a device tensor back to the host (a scalar read-back or a
data-dependent shape)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "item"})


class AtenOps(TorchDispatchMode):
    """`with AtenOps() as ops: fn()`, then `ops.names`: the aten ops fn ran."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
