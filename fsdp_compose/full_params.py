"""A unit's full parameters: the tensors an all-gather's bytes land in, kept across reshards.

Why they are a class of their own: a full parameter outlives the gather that filled it. autograd saves the full
parameters a forward used, so resharding frees their storage (resized to zero) but keeps the tensor objects, and the
next all-gather refills the same storage, where backward finds the values again. The objects are kept per (dtype
group, compute dtype): an fp32 eval forward between a bf16 forward and its backward must not replace the bf16
tensors that autograd saved. This module owns that cache, the copy-out of the gathered segments into it (the flat
path and ``GatherPlan``'s path for several dtypes or protocol parameters), registering the full parameters on the
modules and the sharded ones again, and the hook that hands each full gradient to the unit's gradient side.

The all-gather of a unit whose parameters have several dtypes or use FSDP2's tensor-subclass protocol
(``GatherPlan``): a unit with one dtype and plain tensors gathers its flat buffer directly (the fast path).
Otherwise its rank's all-gather input is the concatenation of each dtype group's flat segment (flat.py
``ShardGroup``), cast to that group's compute dtype, and each protocol parameter's pre-hook outputs
(subclass_params.py), exactly as returned, in that order, sent as **one** all-gather: in their common dtype when
they share one, else as bytes (``uint8`` views), as torch's ``foreach_all_gather`` does, so the collective's size
equals torch's. A float8 input is always sent as bytes: gloo has no float8 all-gather, and the bytes are the same.
The copy-out is one ``split_with_sizes_copy`` of the gathered ``(world_size, input)`` buffer into every group's full
parameters (their ``FullBuffer`` columns) and every protocol parameter's kept all-gather outputs.

Issuing and waiting for the all-gather, and the states around it, are unit.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .flat import FlatShard, ManagedParam, make_full_param
from .offload import UnitDevices
from .sharding import FlatLayout, copy_param_from_segments
from .transitions import internal_error

__all__ = ["FullBuffer", "FullParams", "GatherPlan", "allocate_storage", "gather_dtype"]


class FullParams:
    """The full parameters of one unit's ``shards``, on the compute device, in the dtype of the last gather."""

    def __init__(
        self,
        shards: FlatShard,
        devices: UnitDevices,
        world_size: int,
        policy_param_dtype: torch.dtype | None,
    ) -> None:
        self.shards = shards
        self.devices = devices
        self.device = devices.compute
        self.world_size = world_size
        self.policy_param_dtype = policy_param_dtype  # None: the parameters' own dtype
        # Per (dtype group, compute dtype), its sharded slots' full parameters (kept, storage freed when sharded)
        self._fulls: dict[tuple[int, torch.dtype], FullBuffer] = {}
        # A shard group of one rank: id(ManagedParam) -> (full parameter, its .data, the shard it aliases)
        self._aliases: dict[int, tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = {}

    def compute_dtype_for(self, own: torch.dtype, dtype: torch.dtype) -> torch.dtype:
        """The compute dtype of a parameter of dtype ``own`` when the unit is gathered in ``dtype``.

        The unit's own dtype group (and every parameter of a one-dtype unit) takes ``dtype``; in a unit of several
        dtypes the others take the policy's ``param_dtype`` when ``dtype`` is it, else keep their own (as torch's
        fully_shard casts each parameter to ``param_dtype`` or leaves it).
        """
        if own == self.shards.dtype or (self.policy_param_dtype is not None and dtype == self.policy_param_dtype):
            return dtype
        return own

    # ------------------------------------------------------------------ filling them
    def alias_shards(self, dtype: torch.dtype) -> bool:
        """A shard group of one rank, computing in the shards' own dtype: every sharded parameter's full parameter
        is a view of its shard, which holds the whole parameter (no copy in, none out, nothing to free: the plain
        model's parameters, as kept-whole ones are). True when that applies (then nothing else is to be filled)."""
        shards = self.shards
        if self.world_size != 1 or not shards.uniform or dtype != shards.dtype or self.devices.offloaded:
            return False
        for mp in shards.params:
            if mp.slot is None:
                continue
            local = mp.sharded._local_tensor
            alias = held = self._aliases.get(id(mp))
            if alias is None or alias[2] is not local:
                full, data = make_full_param(local, mp.placing, mp.trainable)
                alias = self._aliases[id(mp)] = (full, data, local)
            if mp.full is not None and (held is None or mp.full is not held[0]):
                self._keep(mp, mp.full)  # a full parameter of another dtype's buffer (an alias is never kept)
            mp.full, mp.full_data = alias[0], alias[1]
        return True

    def _keep(self, mp: ManagedParam, current: nn.Parameter) -> None:
        """``current`` stays with its dtype's buffer while another dtype is gathered (autograd may hold it)."""
        held = self._fulls.get((mp.group or 0, current.dtype))
        if held is not None:
            held.params[id(mp)] = (current, mp.full_data)

    def _is_alias(self, mp: ManagedParam, full: torch.Tensor) -> bool:
        alias = self._aliases.get(id(mp))
        return alias is not None and alias[0] is full

    def copy_out(self, segments: torch.Tensor, dtype: torch.dtype) -> None:
        """One dtype group: the gathered ``(world_size, segment)`` rows into its full parameters (cast to ``dtype``
        on the way: one rank's shards are copied out in their own dtype)."""
        full = self._buffer(dtype)
        if full.splits and self.shards.layout.segment_numel > 0:
            if segments.dtype == dtype:
                torch.split_with_sizes_copy(segments, full.splits, dim=1, out=full.outs)
            else:
                torch._foreach_copy_(full.outs, list(segments.split(full.splits, dim=1)))
        for index in full.relaid:
            copy_param_from_segments(full.param_view(index), segments, self.shards.layout.slots[index])

    def copy_out_plan(self, plan: GatherPlan, dtype: torch.dtype) -> None:
        """Split the gathered inputs into every group's full parameters and every protocol parameter's outputs; the
        post-hooks then build (first gather) or refill (``out=``) the unsharded protocol parameters."""
        outs: list[torch.Tensor] = []
        fulls = []
        for index, group in enumerate(self.shards.groups):
            full = self._buffer(self.compute_dtype_for(group.dtype, dtype), index)
            outs.extend(full.outs)
            fulls.append(full)
        protocol = self.shards.protocol
        first = len(self.shards.groups)
        for mp in protocol:
            if mp.subclass is None:
                raise internal_error(f"parameter {mp.fqn}", "mp.subclass is missing")
            count = len(mp.subclass.input_sizes)
            dtypes, numels = plan.input_dtypes[first : first + count], plan.input_numels[first : first + count]
            first += count
            buffers = mp.subclass.output_buffers(dtypes, numels, self.world_size, self.device)
            outs.extend(b.view(self.world_size, -1) for b in buffers)
        plan.copy_out(outs, self.world_size)
        for full in fulls:
            full.relay()
        for mp in protocol:
            if mp.subclass is None:
                raise internal_error(f"parameter {mp.fqn}", "mp.subclass is missing")
            own = self.compute_dtype_for(mp.sharded.dtype, dtype)
            unsharded = mp.subclass.unshard(mp.sharded._local_tensor, own, mp.trainable)
            if mp.full is not unsharded:
                mp.full = mp.full_data = unsharded

    def register(self, dtype: torch.dtype) -> None:
        """After the copy-out: fill the kept-whole parameters, then register every full parameter on its modules."""
        for mp in self.shards.params:
            if mp.slot is None:
                full_data = self._ensure_whole(mp, self.compute_dtype_for(mp.sharded.dtype, dtype))
                if full_data.data_ptr() != mp.sharded._local_tensor.data_ptr():
                    self.devices.copy_to_compute(full_data, mp.sharded._local_tensor)
            elif mp.full is not None and mp.full.requires_grad != mp.trainable:
                mp.full.requires_grad_(mp.trainable)
            mp.gathered_version = mp.sharded._version
            full = mp.full
            if full is None:
                raise internal_error(f"parameter {mp.fqn}", "mp.full is missing")
            mp.register(full)

    def _buffer(self, dtype: torch.dtype, group: int = 0) -> FullBuffer:
        """A dtype group's full parameters with storage allocated: built on first use and when the layout, the
        dtype or a parameter object changed; otherwise the same tensors, their storage resized back."""
        key = (group, dtype)
        full = self._fulls.get(key)
        groups = self.shards.groups
        layout = groups[group].layout if groups else self.shards.layout
        fresh = full is None or full.layout is not layout
        if full is None or fresh:
            full = self._fulls[key] = FullBuffer.build(layout, dtype, self.device)
        for mp in self.shards.params:
            if mp.group != group or mp.slot is None:
                continue
            current = None if fresh else mp.full
            if current is not None and self._aliases and self._is_alias(mp, current):
                current = None  # a view of the shard (``alias_shards``): kept there, not in a buffer
            elif current is not None and current.dtype != dtype:  # keep it with its buffer (autograd may hold it)
                self._keep(mp, current)
                current = None
            cached = full.params.get(id(mp))
            if current is None and cached is not None and mp.full is not None:
                mp.full, mp.full_data = cached
            elif current is None:
                mp.full, mp.full_data = make_full_param(full.param_view(mp.slot), mp.placing, mp.trainable)
                full.params[id(mp)] = (mp.full, mp.full_data)
                full.note_own_references(mp.slot)
        for data in full.slots:
            allocate_storage(data)
        return full

    def _ensure_whole(self, mp: ManagedParam, dtype: torch.dtype) -> torch.Tensor:
        """A kept-whole parameter's full ``.data`` with storage allocated (created on first use, resized back after)."""
        mp.use_full_of(dtype)
        if mp.full is None:
            if mp.slot is None and dtype == mp.sharded.dtype and not self.devices.offloaded:
                local = mp.sharded._local_tensor  # whole: the full parameter aliases it, no copy
            else:
                local = torch.empty(mp.placing.local_shape, dtype=dtype, device=self.device)
            mp.full, mp.full_data = make_full_param(local, mp.placing, mp.trainable)
        elif mp.full.requires_grad != mp.trainable:
            mp.full.requires_grad_(mp.trainable)
        if mp.full_data is None:
            raise internal_error(f"parameter {mp.fqn}", "mp.full_data is missing")
        allocate_storage(mp.full_data)
        return mp.full_data

    # ------------------------------------------------------------------ freeing them
    def free(self) -> None:
        """Register the sharded parameters on the modules again and free every full parameter's storage (the tensor
        objects stay, for the next gather to refill)."""
        self.unregister()
        self.free_storage()

    def unregister(self) -> None:
        """The sharded parameters on the modules again; the full ones keep their values (``UnitParams.park``)."""
        for mp in self.shards.params:
            # ``requires_grad_`` the user called while the full parameters were registered belongs to the
            # parameter the module will hold from now on: the trainability check reads the sharded one.
            owner, attribute = mp.owners[0]
            held = mp.full
            if held is not None and owner._parameters.get(attribute) is held and held.requires_grad != mp.trainable:
                mp.sharded.requires_grad_(held.requires_grad)
            mp.register(mp.sharded)

    def free_storage(self) -> None:
        """Free every full parameter's storage (the tensor objects stay, for the next gather to refill)."""
        for mp in self.shards.params:
            full_data = mp.full_data
            if (
                mp.slot is None
                and full_data is not None
                and full_data.untyped_storage().data_ptr() != mp.sharded._local_tensor.data_ptr()
            ):
                full_data.untyped_storage().resize_(0)
        for full in self._fulls.values():
            for data in full.slots:
                data.untyped_storage().resize_(0)
        for mp in self.shards.params:
            if mp.subclass is not None:
                mp.subclass.free()

    def discard(self) -> None:
        """After an exception inside a gather or a free: the sharded parameters on the modules again and every full
        parameter forgotten, so the next gather makes new ones (the old ones' storage may be what failed: one a
        reader made non-resizable, an inference tensor)."""
        for mp in self.shards.params:
            mp.register(mp.sharded)
            mp.full = mp.full_data = None
            mp.other_fulls.clear()
            if mp.subclass is not None:
                mp.subclass.free()
        self._fulls.clear()
        self._aliases.clear()

    def early_freeable_bytes(self, trainable: list[ManagedParam]) -> int:
        """The storage bytes of ``trainable``'s full parameters that ``free_early`` could free."""
        total = 0
        for mp in trainable:
            full = self._early_buffer(mp)
            if full is not None and mp.slot is not None:
                slot = full.slots[mp.slot]
                total += slot.numel() * slot.element_size()
        return total

    def _early_buffer(self, mp: ManagedParam) -> FullBuffer | None:
        """The buffer holding ``mp``'s current full parameter, if it is a sharded slot's (not kept whole, not a
        protocol parameter)."""
        full_param = mp.full
        if mp.slot is None or mp.subclass is not None or full_param is None:
            return None
        full = self._fulls.get((mp.group or 0, full_param.dtype))
        if full is None or full.params.get(id(mp), (None,))[0] is not full_param:
            return None
        return full

    def free_early(self, mp: ManagedParam) -> int:
        """Free one sharded parameter's full storage before the rest of its unit (its gradient is made); the bytes.

        Nothing is freed (0) for a parameter that is kept whole, a protocol parameter, one not in the dtype last
        gathered, or one whose storage something other than this unit's own tensors still views (a tensor a graph
        saved through ``.detach()`` or ``.data``: it could still be read). The caller vouches that no node of the
        running backward reads the parameter any more; the next gather refills it, as after a whole reshard.
        """
        full = self._early_buffer(mp)
        if full is None or mp.slot is None:
            return 0
        own = full.own_references.get(mp.slot)
        storage = full.slots[mp.slot].untyped_storage()
        # ``storage`` itself is one reference, as the temporary one was when ``own`` was counted
        if own is None or torch._C._storage_Use_Count(storage._cdata) > own:
            return 0
        freed = storage.size()
        storage.resize_(0)
        return int(freed)


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
    backward free each full parameter as soon as its gradient is made (``FullParams.free_early``) instead of when the
    whole unit's backward ends. The full parameters are views of their storage through ``.data`` (their own version
    counter): refilling it does not trip autograd's check on tensors saved in forward.
    """

    layout: FlatLayout
    dtype: torch.dtype
    slots: list[torch.Tensor]  # per slot: its padded columns, then (a Shard(k) slot) its full parameter
    splits: list[int]
    outs: list[torch.Tensor]
    relaid: set[int]  # slots sharded on a dim k > 0: their full parameter follows the padded columns
    # id(ManagedParam) -> (full parameter, its .data, hooked) in this dtype: set again when this dtype is gathered
    params: dict[int, tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=dict)
    # slot -> how many tensors of this library's own view its storage (once its full parameter exists): more at
    # ``FullParams.free_early`` means someone else still views it
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

    def note_own_references(self, index: int) -> None:
        self.own_references[index] = _references(self.slots[index])


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
