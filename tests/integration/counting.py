"""Counts collectives issued in a worker: a dispatch mode over the c10d ops (both libraries' reduce-scatters and
all-gathers go through them, whatever Python function issued them).

Only ops of the ``c10d`` namespace count (torch's FSDP2 also dispatches ``fsdp::all_gather_copy_in``, a local copy).
Bytes: an all-gather's output, a reduce-scatter's input, an all-reduce's tensors (what one rank hands the collective
for the whole group, the number both libraries size their buffers by)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


class CollectiveCounter(TorchDispatchMode):
    """``counts``: ``all_gather``, ``reduce_scatter``, ``all_reduce`` and ``<name>_bytes`` for each."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            name = str(func.overloadpacket.__name__)
            if "reduce_scatter" in name:  # (output, input, ...)
                self._add("reduce_scatter", args[1])
            elif "allgather" in name or "all_gather" in name:  # (output, input, ...)
                self._add("all_gather", args[0])
            elif "allreduce" in name or "all_reduce" in name:  # (tensors, ...)
                self._add("all_reduce", args[0])
        return func(*args, **(kwargs or {}))

    def _add(self, kind: str, tensors: Any) -> None:
        self.counts[kind] += 1
        self.counts[f"{kind}_bytes"] += _nbytes(tensors)
