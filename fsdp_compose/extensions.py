"""Per-instance extensions: hooks that apply to the parameters of the one ``fully_shard`` call that received them.

There is no registry and no global flag: the ``ShardExtensions`` object is stored on that call's unit, so two models
in one process — one with extensions, one without, one 1-D and one 2-D — never see each other's hooks (FSDP1 once
kept its 2-D extension in a module-level global: pytorch/pytorch#113237).

- ``all_gather``: a transform of the unit's local flat shard before the all-gather (``encode``) and of the gathered
  payload after it (``decode``): compressed or quantized all-gathers. ``Int8AllGather`` and ``CastAllGather`` ship
  here as examples.
- ``reduce_scatter``: replaces the gradient reduce-scatter (a communication hook). It must leave in ``output`` this
  rank's slice of the **sum** over the shard group of ``input``; fsdp_compose divides afterwards.
- ``all_reduce``: replaces the HSDP all-reduce over replicas (sum, in place); return a work handle to keep it
  asynchronous, or None when done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .collectives import Work

__all__ = ["AllGatherTransform", "CastAllGather", "Int8AllGather", "ShardExtensions"]


class AllGatherTransform(Protocol):
    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        """The 1-D local shard (compute dtype) -> a 1-D payload of the same size on every rank."""
        ...

    def decode(self, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(world_size, payload)`` gathered payloads -> ``(world_size, >= segment)`` values in ``dtype``."""
        ...


@dataclass(frozen=True)
class CastAllGather:
    """All-gather in a narrower floating dtype (e.g. fp32 parameters gathered as bf16: half the bytes)."""

    dtype: torch.dtype = torch.bfloat16

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        return shard.to(self.dtype)

    def decode(self, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return gathered.to(dtype)


@dataclass(frozen=True)
class Int8AllGather:
    """All-gather int8 values with one fp32 absmax scale per block of ``block`` values (~27% of fp32's bytes).

    Per-block scales keep small weights precise next to large ones in the same unit (one scale per shard does not:
    a LayerNorm weight of 1.0 would set the step for 0.02-sized projection weights). Payload per rank, as uint8: the
    int8 values padded to whole blocks, then the blocks' fp32 scales. ``decode`` returns the padded width; the unit
    reads the first ``segment`` columns.
    """

    block: int = 64

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        blocks = -(-shard.numel() // self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=shard.device)
        padded[: shard.numel()] = shard.detach().float()
        rows = padded.view(blocks, self.block)
        scales = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        quantized = torch.round(rows / scales).clamp_(-127, 127).to(torch.int8)
        return torch.cat([quantized.view(torch.uint8).reshape(-1), scales.reshape(-1).view(torch.uint8)])

    def decode(self, gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        world_size, payload = gathered.shape
        blocks = payload // (self.block + 4)
        values = gathered[:, : blocks * self.block].contiguous().view(torch.int8).view(world_size, blocks, self.block)
        scales = gathered[:, blocks * self.block :].contiguous().view(torch.float32).view(world_size, blocks, 1)
        return (values.float() * scales).view(world_size, blocks * self.block).to(dtype)


ReduceScatterHook = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], None]
AllReduceHook = Callable[[torch.Tensor, dist.ProcessGroup], "Work | None"]


@dataclass(frozen=True)
class ShardExtensions:
    """Hooks bound to one ``fully_shard`` call (see the module docstring)."""

    all_gather: AllGatherTransform | None = None
    reduce_scatter: ReduceScatterHook | None = None
    all_reduce: AllReduceHook | None = None
