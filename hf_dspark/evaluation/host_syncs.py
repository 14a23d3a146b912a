"""Counting host round-trips: every call that makes the host wait for a value computed on the device.

On a GPU each of these stalls the host until the queued kernels are done, so a decoding loop that reads one
confidence per slot pays a full device round-trip per slot. On the CPU they cost nothing, but they are the same
calls, so counting them here measures what a GPU would wait for (used by tests and benchmarks).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that return host values (or branch on them).
HOST_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
}


def _index_reads(index) -> int:
    """Host reads hidden in an index: a tensor as a slice bound or a scalar index (read as an int), or a boolean
    mask (the result's shape depends on its values). Integer index tensors gather on the device: not counted."""
    parts = index if isinstance(index, tuple) else (index,)
    reads = 0
    for part in parts:
        if isinstance(part, slice):
            reads += sum(isinstance(bound, torch.Tensor) for bound in (part.start, part.stop, part.step))
        elif isinstance(part, torch.Tensor) and (part.dtype == torch.bool or part.ndim == 0):
            reads += 1
    return reads


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.total`` (and ``syncs.by_kind``)."""

    def __init__(self):
        super().__init__()
        self.by_kind: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = HOST_READS.get(func)
        if kind is not None:
            self.by_kind[kind] += 1
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            reads = _index_reads(args[1])
            if reads:
                self.by_kind["index"] += reads
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())
