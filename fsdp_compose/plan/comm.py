"""Collective calls and bytes of a step, counted from the ops the dispatcher sees.

Every ``torch.distributed`` collective reaches the dispatcher as a ``c10d`` op (``dist.all_gather_single`` is
``c10d._allgather_base_``, ...), and DTensor's redistributions as ``_c10d_functional`` ops, so a dispatch mode sees
both, on any backend, the fake process group included, without patching anything. :class:`CollectiveTally` turns
such an op into (kind, group, bytes) with the benchmarks' conventions (``benchmarks/comm.py``):

- all-gather: the output tensor's bytes (``group size`` x shard, what every rank ends up holding);
- reduce-scatter: the input tensor's bytes (``group size`` x shard);
- all-reduce, broadcast: the tensor's bytes; all-to-all: the input's bytes.

The group is named by its mesh dimension (``shard``, ``replicate``, ``tp``) when the caller says which process
group is which; other groups are named by size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["CollectiveTally"]

# op name -> (kind, where the counted tensors are: an argument index or "out")
_C10D: dict[str, tuple[str, int | str]] = {
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
}
_FUNCOL: dict[str, tuple[str, int | str]] = {
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
    "broadcast_": ("broadcast", 0),
}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
_NOT_COUNTED = {"wait_tensor", "barrier", "monitored_barrier_"}


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class CollectiveOp:
    """One collective seen: its kind, group name, bytes, and the tensors whose storages it reads or fills."""

    kind: str
    group: str
    nbytes: int
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


@dataclass
class CollectiveTally:
    """Calls and bytes per (kind, group) of the collectives passed to :meth:`observe`."""

    group_labels: dict[str, str] = field(default_factory=dict)  # process-group name -> label
    calls: dict[str, dict[str, int]] = field(default_factory=dict)
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    unknown: dict[str, int] = field(default_factory=dict)  # collective ops not understood -> calls

    @property
    def total_bytes(self) -> int:
        return sum(n for per_group in self.bytes.values() for n in per_group.values())

    def _group(self, args: tuple[Any, ...], namespace: str) -> str:
        if namespace == "c10d":
            for arg in args:
                if isinstance(arg, torch.ScriptObject):
                    try:
                        pg = torch._C._distributed_c10d.ProcessGroup.unbox(arg)
                    except RuntimeError:
                        continue
                    label = self.group_labels.get(pg.group_name)
                    if label is None:  # e.g. fsdp_compose's reduce-scatter group: labelled by its description
                        label = self.group_labels.get(getattr(pg, "group_desc", ""), f"group of {pg.size()}")
                    return label
            return "?"
        names = [arg for arg in args if isinstance(arg, str)]
        return self.group_labels.get(names[-1], f"group {names[-1]}") if names else "?"

    def observe(self, func: Any, args: tuple[Any, ...], out: Any) -> CollectiveOp | None:
        """Count ``func`` when it is a collective; returns what was counted (``None`` for other ops)."""
        namespace = getattr(func, "namespace", "")
        if namespace not in _NAMESPACES:
            return None
        name = func._opname
        table = _C10D if namespace == "c10d" else _FUNCOL
        if name in _NOT_COUNTED:
            return None
        if name not in table:
            key = f"{namespace}.{name}"
            self.unknown[key] = self.unknown.get(key, 0) + 1
            return None
        kind, where = table[name]
        counted = out if where == "out" else args[int(where)]
        group = self._group(args, namespace)
        nbytes = _nbytes(counted)
        self.calls.setdefault(kind, {})
        self.bytes.setdefault(kind, {})
        self.calls[kind][group] = self.calls[kind].get(group, 0) + 1
        self.bytes[kind][group] = self.bytes[kind].get(group, 0) + nbytes
        tensors_in = tuple(t for t in tree_leaves(args) if isinstance(t, torch.Tensor))
        tensors_out = tuple(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if namespace == "c10d" and isinstance(where, int):  # in-place ops: the outputs are arguments
            outputs = tuple(t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor))
            inputs = tuple(t for t in tensors_in if all(t is not o for o in outputs))
            return CollectiveOp(kind, group, nbytes, inputs, outputs)
        return CollectiveOp(kind, group, nbytes, tensors_in, tensors_out)

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{kind: {group: {"calls": n, "bytes": b}}}``."""
        return {
            kind: {group: {"calls": self.calls[kind][group], "bytes": nbytes} for group, nbytes in groups.items()}
            for kind, groups in sorted(self.bytes.items())
        }
