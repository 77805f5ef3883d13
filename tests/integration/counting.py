"""Counts collectives issued in a worker: a dispatch mode over the c10d ops (both libraries' reduce-scatters and
all-gathers go through them, whatever Python function issued them). Only ops of the c10d namespaces count, so a
library's own helper ops whose names mention a collective (FSDP2's ``fsdp::all_gather_copy_in``) do not."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


class CollectiveCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in _COLLECTIVE_NAMESPACES:
            name = str(func.overloadpacket.__name__)
            if "reduce_scatter" in name:
                self.counts["reduce_scatter"] += 1
            elif "allgather" in name or "all_gather" in name:
                self.counts["all_gather"] += 1
            elif "allreduce" in name or "all_reduce" in name:
                self.counts["all_reduce"] += 1
        return func(*args, **(kwargs or {}))
