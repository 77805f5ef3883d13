"""Pure sharding math: which rows each rank owns and where they live in a unit's flat buffers.

No processes and no collectives here, so every function is testable on its own (tests/test_sharding_math.py).

Layout of one unit on a mesh of ``world_size`` ranks. A parameter is split on dim 0 (unless told otherwise, below)
with ``torch.chunk`` semantics: rank ``r`` owns rows ``[r*c, min((r+1)*c, dim0))`` where ``c = ceil(dim0 /
world_size)``, so trailing ranks may own fewer rows or none. Each rank's shard of each parameter is padded to ``c``
rows and the padded shards are laid end to end in one flat *segment* of ``segment_numel`` elements::

    segment (one rank)   = [ p0 rows (c0 x n0) | p1 rows (c1 x n1) | ... ]
    gathered (all ranks) = [ segment of rank 0 | segment of rank 1 | ... ]   shape (world_size, segment_numel)

So one all-gather of the segment gives every parameter, and one reduce-scatter of a ``(world_size, segment_numel)``
gradient buffer gives every rank its own rows. Because torch.chunk pads only at the end, the rows of the padded
chunks, read in rank order, are the parameter's rows followed by padding: the first ``dim0`` rows are the parameter.

A parameter sharded on another dim ``k`` (``shard_placement_fn`` returning ``Shard(k)``) is split the same way along
``k``: a "row" is then one index of dim ``k`` (``row_numel`` = the product of the other dims), rank ``r`` owns
``torch.chunk(full, world_size, dim=k)[r]``, and its region holds that chunk contiguously in its own row-major order
(shape ``shape`` with ``shape[k]`` replaced by the owned count), padding after it. The local shard is thus a
contiguous view, as for dim 0 (where the two descriptions coincide); copying between the full tensor and the
gathered buffer goes through strided views that move the rank index next to dim ``k``.
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


def local_rows(full: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """This rank's rows of ``full`` along ``dim`` (a view): ``torch.chunk(full, world_size, dim)[rank]`` or an empty
    slice."""
    size = full.shape[dim]
    c = padded_rows(size, world_size)
    start = min(rank * c, size)
    return full.narrow(dim, start, min(start + c, size) - start)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside a rank's flat segment."""

    shape: torch.Size  # the full (unsharded) shape
    offset: int  # element offset of this parameter's padded shard in the segment
    rows: int  # padded rows (indices of the shard dim) per rank
    row_numel: int  # elements per row (product of the other dims)
    dim: int = 0  # the dim it is sharded on

    @property
    def numel(self) -> int:
        """Padded shard elements in the segment."""
        return self.rows * self.row_numel

    @property
    def dim_size(self) -> int:
        """Size of the shard dim (rows in all)."""
        return self.shape[self.dim]

    def chunk_shape(self, rows: int) -> torch.Size:
        """Shape of a chunk of ``rows`` rows: ``shape`` with the shard dim's size replaced."""
        return torch.Size((*self.shape[: self.dim], rows, *self.shape[self.dim + 1 :]))


@dataclass(frozen=True)
class FlatLayout:
    """Flat layout of a unit's parameters: one slot per parameter, ``segment_numel`` elements per rank."""

    world_size: int
    slots: tuple[ParamSlot, ...]
    segment_numel: int

    @classmethod
    def build(cls, shapes: Sequence[torch.Size], world_size: int, dims: Sequence[int] | None = None) -> FlatLayout:
        """Slots for ``shapes`` laid end to end, each sharded on its entry of ``dims`` (default: all on dim 0)."""
        dims = [0] * len(shapes) if dims is None else list(dims)
        if len(dims) != len(shapes):
            raise ValueError(f"got {len(shapes)} shapes but {len(dims)} shard dims")
        slots = []
        offset = 0
        for shape, dim in zip(shapes, dims, strict=True):
            if len(shape) == 0:
                raise ValueError("0-dim tensors have no dim 0 to shard; replicate them instead")
            if not 0 <= dim < len(shape):
                raise ValueError(f"shard dim {dim} is out of range for a tensor of shape {tuple(shape)}")
            row_numel = math.prod(size for i, size in enumerate(shape) if i != dim)
            rows = padded_rows(shape[dim], world_size)
            slots.append(ParamSlot(torch.Size(shape), offset, rows, row_numel, dim))
            offset += rows * row_numel
        return cls(world_size, tuple(slots), offset)

    def shard_view(self, segment: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """The (contiguous) view of ``segment`` holding this rank's unpadded chunk of parameter ``index``."""
        slot = self.slots[index]
        rows = chunk_rows(slot.dim_size, self.world_size)[rank]
        return segment[slot.offset : slot.offset + rows * slot.row_numel].view(slot.chunk_shape(rows))


def _full_and_padded_blocks(
    full: torch.Tensor, gathered: torch.Tensor, slot: ParamSlot
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs (rows of ``full``, matching region of ``gathered``) that cover every real row exactly once.

    ``gathered`` is ``(world_size, segment_numel)``. Ranks whose chunk is complete form one strided block; the rank
    holding the remainder forms a second, smaller block; ranks holding only padding are skipped.
    """
    if slot.dim:
        return _blocks_on_dim(full, gathered, slot)
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


def _blocks_on_dim(
    full: torch.Tensor, gathered: torch.Tensor, slot: ParamSlot
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``_full_and_padded_blocks`` for a parameter sharded on a dim ``k > 0``.

    The complete chunks of ``full`` are cut into ``(full_ranks, rows)`` along ``k`` and the rank index moved to the
    front: a strided view of the same shape as those ranks' regions read as ``(full_ranks, *padded chunk shape)``.
    ``full`` may have any strides.
    """
    size, dim = slot.dim_size, slot.dim
    if size == 0 or slot.row_numel == 0:
        return []
    region = gathered[:, slot.offset : slot.offset + slot.numel]
    full_ranks = size // slot.rows
    pairs = []
    whole = full.narrow(dim, 0, full_ranks * slot.rows).unflatten(dim, (full_ranks, slot.rows)).movedim(dim, 0)
    pairs.append((whole, region[:full_ranks].view(full_ranks, *slot.chunk_shape(slot.rows))))
    rest = size - full_ranks * slot.rows
    if rest:
        tail = region[full_ranks, : rest * slot.row_numel].view(slot.chunk_shape(rest))
        pairs.append((full.narrow(dim, full_ranks * slot.rows, rest), tail))
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
    size = slot.dim_size
    if size == 0 or slot.row_numel == 0:
        return
    for index in range(segments.shape[0]):
        start = min((first + index) * slot.rows, size)
        owned = full.narrow(slot.dim, start, min(start + slot.rows, size) - start)
        segments[index, slot.offset : slot.offset + owned.numel()].view(owned.shape).copy_(owned)
