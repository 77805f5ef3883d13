"""Counts all-gathers and reduce-scatters issued in a worker, with their bytes: a dispatch mode over the c10d ops,
which both torch's fully_shard and fsdp_compose go through whatever Python function issued them. The bytes are the
collective's output (all-gather) or input (reduce-scatter) on this rank."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket.__name__)
        if func.namespace not in ("c10d", "_c10d_functional"):
            pass  # e.g. torch's fsdp::all_gather_copy_in, no collective
        elif "reduce_scatter" in name:
            self.counts["reduce_scatter"] += 1
            self.bytes["reduce_scatter"] += _nbytes(args[1])
        elif "allgather" in name or "all_gather" in name:
            self.counts["all_gather"] += 1
            self.bytes["all_gather"] += _nbytes(args[0])
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, int]:
        return {
            "all_gather": self.counts["all_gather"],
            "all_gather_bytes": self.bytes["all_gather"],
            "reduce_scatter": self.counts["reduce_scatter"],
            "reduce_scatter_bytes": self.bytes["reduce_scatter"],
        }
