"""Pure sharding math: which rows each rank owns and where they live in a unit's flat buffers.

No processes and no collectives here, so every function is testable on its own (tests/test_sharding_math.py).

Layout of one unit on a mesh of ``world_size`` ranks. Every parameter is split on dim 0 with ``torch.chunk``
semantics: rank ``r`` owns rows ``[r*c, min((r+1)*c, dim0))`` where ``c = ceil(dim0 / world_size)``, so trailing ranks
may own fewer rows or none. Each rank's shard of each parameter is padded to ``c`` rows and the padded shards are laid
end to end in one flat *segment* of ``segment_numel`` elements::

    segment (one rank)   = [ p0 rows (c0 x n0) | p1 rows (c1 x n1) | ... ]
    gathered (all ranks) = [ segment of rank 0 | segment of rank 1 | ... ]   shape (world_size, segment_numel)

So one all-gather of the segment gives every parameter, and one reduce-scatter of a ``(world_size, segment_numel)``
gradient buffer gives every rank its own rows. Because torch.chunk pads only at the end, the rows of the padded
chunks, read in rank order, are the parameter's rows followed by padding: the first ``dim0`` rows are the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "FlatLayout",
    "ParamSlot",
    "chunk_rows",
    "copy_param_from_segments",
    "divide_factors",
    "local_rows",
    "padded_rows",
    "write_grad_into_segments",
    "write_param_into_segments",
]


def padded_rows(dim0: int, world_size: int) -> int:
    """Rows of every rank's padded shard: ``ceil(dim0 / world_size)``."""
    return -(-dim0 // world_size)


def chunk_rows(dim0: int, world_size: int) -> list[int]:
    """Rows each rank owns under ``torch.chunk(t, world_size, dim=0)`` (missing chunks are empty)."""
    c = padded_rows(dim0, world_size)
    return [max(0, min(c, dim0 - r * c)) for r in range(world_size)]


def local_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of ``full`` (a view), exactly ``torch.chunk(full, world_size)[rank]`` or an empty slice."""
    c = padded_rows(full.shape[0], world_size)
    start = min(rank * c, full.shape[0])
    return full[start : min(start + c, full.shape[0])]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside a rank's flat segment."""

    shape: torch.Size  # the full (unsharded) shape
    offset: int  # element offset of this parameter's padded shard in the segment
    rows: int  # padded rows per rank
    row_numel: int  # elements per row (product of shape[1:])

    @property
    def numel(self) -> int:
        """Padded shard elements in the segment."""
        return self.rows * self.row_numel


@dataclass(frozen=True)
class FlatLayout:
    """Flat layout of a unit's parameters: one slot per parameter, ``segment_numel`` elements per rank."""

    world_size: int
    slots: tuple[ParamSlot, ...]
    segment_numel: int

    @classmethod
    def build(cls, shapes: Sequence[torch.Size], world_size: int) -> FlatLayout:
        slots = []
        offset = 0
        for shape in shapes:
            if len(shape) == 0:
                raise ValueError("0-dim tensors have no dim 0 to shard; replicate them instead")
            row_numel = math.prod(shape[1:])
            rows = padded_rows(shape[0], world_size)
            slots.append(ParamSlot(torch.Size(shape), offset, rows, row_numel))
            offset += rows * row_numel
        return cls(world_size, tuple(slots), offset)

    def shard_view(self, segment: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """The view of ``segment`` holding this rank's (unpadded) rows of parameter ``index``."""
        slot = self.slots[index]
        rows = chunk_rows(slot.shape[0], self.world_size)[rank]
        return segment[slot.offset : slot.offset + rows * slot.row_numel].view(rows, *slot.shape[1:])


def _full_and_padded_blocks(
    full: torch.Tensor, gathered: torch.Tensor, slot: ParamSlot
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs (rows of ``full``, matching region of ``gathered``) that cover every real row exactly once.

    ``gathered`` is ``(world_size, segment_numel)``. Ranks whose chunk is complete form one strided block; the rank
    holding the remainder forms a second, smaller block; ranks holding only padding are skipped.
    """
    dim0 = slot.shape[0]
    if dim0 == 0 or slot.row_numel == 0:
        return []
    flat_rows = full.view(dim0, slot.row_numel)
    region = gathered[:, slot.offset : slot.offset + slot.numel]
    full_ranks = dim0 // slot.rows
    pairs = []
    if full_ranks:
        pairs.append((flat_rows[: full_ranks * slot.rows].view(full_ranks, slot.numel), region[:full_ranks]))
    rest = dim0 - full_ranks * slot.rows
    if rest:
        pairs.append((flat_rows[full_ranks * slot.rows :].reshape(-1), region[full_ranks, : rest * slot.row_numel]))
    return pairs


def copy_param_from_segments(full: torch.Tensor, gathered: torch.Tensor, slot: ParamSlot) -> None:
    """Write parameter rows from an all-gathered ``(world_size, segment_numel)`` buffer into contiguous ``full``."""
    for dst, src in _full_and_padded_blocks(full, gathered, slot):
        dst.copy_(src)


def write_grad_into_segments(
    grad: torch.Tensor, buffer: torch.Tensor, slot: ParamSlot, *, accumulate: bool = False, scale: float = 1.0
) -> None:
    """Write (or add, with ``accumulate``) ``grad / scale`` into a ``(world_size, segment)`` reduce-scatter buffer.

    The buffer may have a wider dtype than ``grad`` (fp32 accumulation of bf16 gradients): the cast happens in the
    same pass. Padding positions are left as they are: a reduce-scatter is elementwise, so whatever they hold stays
    in padding positions of the output, which nobody reads.
    """
    grad = grad if grad.is_contiguous() else grad.contiguous()
    for src, dst in _full_and_padded_blocks(grad, buffer, slot):
        if accumulate:
            dst.add_(src, alpha=1.0 / scale)
        elif scale == 1.0:
            dst.copy_(src)
        else:
            torch.div(src, scale, out=dst)


def write_param_into_segments(full: torch.Tensor, segments: torch.Tensor, slot: ParamSlot, first: int) -> None:
    """Write the rows of ``full`` that belong to segments ``first, first + 1, ...`` into ``segments``.

    ``segments`` is ``(count, segment_numel)``: rows ``first .. first + count - 1`` of a gathered buffer. The inverse of
    ``copy_param_from_segments`` for a contiguous range of ranks; padding positions are left as they are.
    """
    dim0 = slot.shape[0]
    if dim0 == 0 or slot.row_numel == 0:
        return
    rows = full.reshape(dim0, slot.row_numel)
    for index in range(segments.shape[0]):
        start = min((first + index) * slot.rows, dim0)
        owned = rows[start : min(start + slot.rows, dim0)]
        segments[index, slot.offset : slot.offset + owned.numel()].view_as(owned).copy_(owned)


def divide_factors(world_size: int, divide_factor: float | None, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post) divisors whose product is the divide factor (default: the data-parallel size, replicas included).

    fp16 has a small range: the sum over ``world_size`` ranks of in-range values can overflow, so for fp16 every rank
    pre-divides by ``world_size`` (the sum of the quotients is then an average, in range whenever the inputs are) and
    the rest of the factor is applied after. Other dtypes have fp32's range: one post-division is the most accurate.
    """
    total = float(world_size if divide_factor is None else divide_factor)
    if reduce_dtype != torch.float16 or world_size <= 1:
        return 1.0, total
    pre = float(world_size)
    return pre, total / pre
