"""Counts collectives issued in a worker: a dispatch mode over the c10d ops (both libraries' reduce-scatters and
all-gathers go through them, whatever Python function issued them).

Only collective ops count: the ``c10d`` namespace and the functional ``_c10d_functional`` one (torch's FSDP2 also
dispatches ``fsdp::all_gather_copy_in``, a local copy). Bytes: an all-gather's output, a reduce-scatter's input, an
all-reduce's tensors (what one rank hands the collective for the whole group, the number both libraries size their
buffers by)."""

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
        name = str(func.overloadpacket.__name__)
        if func.namespace == "c10d":
            if "reduce_scatter" in name:  # (output, input, ...)
                self._add("reduce_scatter", _nbytes(args[1]))
            elif "allgather" in name or "all_gather" in name:  # (output, input, ...)
                self._add("all_gather", _nbytes(args[0]))
            elif "allreduce" in name or "all_reduce" in name:  # (tensors, ...)
                self._add("all_reduce", _nbytes(args[0]))
        elif func.namespace == "_c10d_functional":
            if "reduce_scatter" in name:  # (input, op, group_size, group_name)
                self._add("reduce_scatter", _nbytes(args[0]))
            elif "all_gather" in name:  # (input, group_size, group_name)
                self._add("all_gather", _nbytes(args[0]) * int(args[1]))
            elif "all_reduce" in name:  # (input, op, group_name)
                self._add("all_reduce", _nbytes(args[0]))
        return func(*args, **(kwargs or {}))

    def _add(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.counts[f"{kind}_bytes"] += nbytes
