"""Collective bytes: the theoretical minimum of a step, to set beside what ``fc.CollectiveRecorder`` counts.

The benchmarks count collectives with ``fsdp_compose.CollectiveRecorder`` (``fsdp_compose/recorder.py``: one record
per call of ``torch.distributed``'s collectives, the same recorder the tests and the planner use); its byte
conventions are the ones below:

- all-gather: the output tensor's bytes (``world_size`` x shard, what every rank ends up holding);
- reduce-scatter: the input tensor's bytes (``world_size`` x shard);
- all-reduce: the tensor's bytes.

Not seen: DDP's all-reduces (issued by its C++ reducer) and barriers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["UnitSpec", "min_collective_bytes"]


@dataclass(frozen=True)
class UnitSpec:
    """One ``fully_shard`` unit for the byte model: its parameters and how it behaves in a step."""

    params: tuple[nn.Parameter, ...]
    reshard_after_forward: bool  # gathered again in backward
    trainable: bool  # reduce-scattered in backward
    gathered: bool = True  # False: kept whole on every rank (frozen, frozen_params="replicate"), never all-gathered


def padded_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of a dim-0 sharded parameter once every rank's shard is padded to ``ceil(dim0 / world_size)`` rows."""
    if len(shape) == 0:
        return 0  # 0-dim parameters are replicated, not gathered
    return -(-shape[0] // world_size) * world_size * math.prod(shape[1:])


def min_collective_bytes(
    units: list[UnitSpec], world_size: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> int:
    """All-gather in forward, again in backward for resharded units, and one reduce-scatter per trainable unit.

    Units kept whole (``gathered=False``) cost nothing: they are neither gathered nor, being frozen, reduced.
    """
    param_size = torch.empty((), dtype=param_dtype).element_size()
    reduce_size = torch.empty((), dtype=reduce_dtype).element_size()
    total = 0
    for unit in units:
        numel = sum(padded_numel(p.shape, world_size) for p in unit.params)
        if unit.gathered:
            total += numel * param_size * (2 if unit.reshard_after_forward else 1)
        if unit.trainable:
            total += numel * reduce_size
    return total
