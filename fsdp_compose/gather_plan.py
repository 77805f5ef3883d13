"""The all-gather of a unit whose parameters have several dtypes or use FSDP2's tensor-subclass protocol.

A unit with one dtype and plain tensors gathers its flat buffer directly (unit.py, the fast path). Otherwise its
rank's all-gather input is the concatenation of

- each dtype group's flat segment (flat.py ``ShardGroup``), cast to that group's compute dtype, and
- each protocol parameter's pre-hook outputs (subclass_params.py), exactly as returned,

in that order, sent as **one** all-gather: in their common dtype when they share one, else as bytes (``uint8``
views), as torch's ``foreach_all_gather`` does, so the collective's size equals torch's. A float8 input is always
sent as bytes: gloo has no float8 all-gather, and the bytes are the same. The copy-out is one
``split_with_sizes_copy`` of the gathered ``(world_size, input)`` buffer into every group's full parameters (their
``FullBuffer`` columns) and every protocol parameter's kept all-gather outputs, viewed as bytes where needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .sharding import FlatLayout, copy_param_from_segments

__all__ = ["FullBuffer", "GatherPlan", "allocate_storage", "gather_dtype"]

_FLOAT8 = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def gather_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype the collective runs in: the inputs' common dtype, else bytes (always bytes for float8)."""
    if len(set(dtypes)) == 1 and dtypes[0] not in _FLOAT8:
        return dtypes[0]
    return torch.uint8


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


@dataclass
class FullBuffer:
    """The full (unsharded) parameters of one dtype group's sharded slots, built once and reused.

    One storage per slot, padded: slot ``i`` owns ``world_size * slot.numel`` elements, viewed as ``(world_size,
    slot.numel)`` (``outs[i]``), exactly the columns of slot ``i`` in the all-gathered ``(world_size, segment)`` buffer.
    So the copy-out of a whole group is one ``split_with_sizes_copy``. A storage per slot (not one for the group) lets
    backward free each full parameter as soon as its gradient is made (``free_slot``) instead of when the whole unit's
    backward ends. The full parameters are views of their storage through ``.data`` (their own version counter):
    refilling it does not trip autograd's check on tensors saved in forward.
    """

    layout: FlatLayout
    dtype: torch.dtype
    slots: list[torch.Tensor]  # per slot: its padded columns, then (a Shard(k) slot) its full parameter
    splits: list[int]
    outs: list[torch.Tensor]
    relaid: set[int]  # slots sharded on a dim k > 0: their full parameter follows the padded columns
    # id(ManagedParam) -> (full parameter, its .data, hooked) in this dtype: set again when this dtype is gathered
    params: dict[int, tuple[Any, Any, bool]] = field(default_factory=dict)
    # slot -> how many tensors of this library's own view its storage (once its full parameter exists): more at
    # ``free_slot`` means someone else still views it
    own_references: dict[int, int] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> FullBuffer:
        world_size = layout.world_size
        # A Shard(k) slot's columns hold the ranks' chunks along k one after another, not the parameter: its full
        # parameter gets its own place after them (same storage: freed and refilled with them).
        relaid = {index for index, slot in enumerate(layout.slots) if slot.dim != 0}
        slots = [
            torch.empty(
                world_size * slot.numel + (slot.shape.numel() if index in relaid else 0), dtype=dtype, device=device
            )
            for index, slot in enumerate(layout.slots)
        ]
        outs = [
            data[: world_size * slot.numel].view(world_size, slot.numel)
            for data, slot in zip(slots, layout.slots, strict=True)
        ]
        return cls(layout, dtype, slots, [slot.numel for slot in layout.slots], outs, relaid)

    def param_view(self, index: int) -> torch.Tensor:
        """The full parameter of slot ``index``: its first ``dim0`` rows (the rest is padding), or its own place."""
        slot = self.layout.slots[index]
        start = self.layout.world_size * slot.numel if index in self.relaid else 0
        return self.slots[index].data[start : start + slot.shape.numel()].view(slot.shape)

    def relay(self) -> None:
        """After the columns are filled: move each Shard(k) slot's chunks into its full parameter."""
        for index in self.relaid:
            slot = self.layout.slots[index]
            copy_param_from_segments(self.param_view(index), self.outs[index], dataclasses.replace(slot, offset=0))

    def allocate(self) -> None:
        for data in self.slots:
            allocate_storage(data)

    def free(self) -> None:
        for data in self.slots:
            data.untyped_storage().resize_(0)

    def note_own_references(self, index: int) -> None:
        self.own_references[index] = _references(self.slots[index])

    def slot_bytes(self, index: int) -> int:
        return _nbytes(self.slots[index])

    def free_slot(self, index: int) -> int:
        """Free one slot's storage (its full parameter's) unless a tensor not of this library's still views it; the
        bytes freed."""
        own = self.own_references.get(index)
        if own is None or _references(self.slots[index]) > own:
            return 0
        storage = self.slots[index].untyped_storage()
        freed = storage.size()
        storage.resize_(0)
        return freed


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def allocate_storage(tensor: torch.Tensor) -> None:
    """Resize ``tensor``'s storage back to its size if a reshard freed it (a no-op when it is allocated)."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() < nbytes:
        storage.resize_(nbytes)


def _references(tensor: torch.Tensor) -> int:
    """How many tensors view ``tensor``'s storage."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


@dataclass
class GatherPlan:
    """One issued all-gather of several inputs: what the copy-out needs to split it again."""

    dtype: torch.dtype  # the collective's dtype (``uint8``: bytes)
    input_dtypes: list[torch.dtype]
    input_numels: list[int]  # in each input's own dtype
    output: torch.Tensor  # (world_size * sum of the inputs' sizes in ``dtype``,)
    shard: torch.Tensor  # this rank's part of ``output`` (the collective's input)

    @classmethod
    def copy_in(cls, inputs: list[torch.Tensor], world_size: int, rank: int, device: torch.device) -> GatherPlan:
        """Allocate the output and copy the inputs into this rank's part of it (one foreach copy)."""
        dtypes = [t.dtype for t in inputs]
        dtype = gather_dtype(dtypes)
        sent = [_as(t, dtype) for t in inputs]
        sizes = [t.numel() for t in sent]
        total = sum(sizes)
        output = torch.empty(world_size * total, dtype=dtype, device=device)
        shard = output[rank * total : (rank + 1) * total]
        with torch.no_grad():
            torch._foreach_copy_(list(torch.split(shard, sizes)), sent)
        return cls(dtype, dtypes, [t.numel() for t in inputs], output, shard)

    def copy_out(self, outs: list[torch.Tensor], world_size: int) -> None:
        """Fill ``outs`` (each ``(world_size, n)``, contiguous, in the order of the inputs' parts) in one copy."""
        received = [_as(out, self.dtype) for out in outs]
        splits = [out.shape[1] for out in received]
        if received:
            torch.split_with_sizes_copy(self.output.view(world_size, -1), splits, dim=1, out=received)
