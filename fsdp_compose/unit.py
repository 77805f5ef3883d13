"""A unit's gather state machine: all-gather the flat shards into full parameters, and free them again.

The states (``UnitState``) and what moves between them::

    SHARDED --start_unshard--> GATHERING --finish_unshard--> UNSHARDED --reshard--> SHARDED
    UNSHARDED --reshard_to_group--> GROUP_SHARDED --start_unshard--> GATHERING     (reshard_after_forward=k)
    GROUP_SHARDED --reshard--> SHARDED

1. ``start_unshard(dtype)`` issues one flat all-gather of every rank's segment in the compute ``dtype``;
   ``finish_unshard`` waits for it, copies each parameter's rows out into its own full tensor and registers those on
   the owning modules, so the user's forward runs unchanged.
2. ``reshard`` registers the sharded DTensor parameters again and frees the full tensors' storage. The storage object
   is kept and resized to zero, so tensors autograd saved still alias it and see the data again after the next
   all-gather refills it.

A transition not listed in ``_ALLOWED`` raises. The flat buffer and the sharded parameters are flat.py; the gradient
side is grads.py, which knows nothing of this module.
"""

from __future__ import annotations

import copy
import enum
import logging
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .collectives import Work, all_gather_flat, labelled
from .extensions import ShardExtensions
from .flat import FlatShard, ManagedParam, make_full_param
from .grads import ReduceSpec, UnitGradients
from .meshes import DataParallelMesh, ParamPlacing, PostForwardGroup, reduce_scatter_group
from .offload import UnitDevices
from .policies import OffloadPolicy
from .sharding import FlatLayout, copy_param_from_segments, write_param_into_segments
from .streams import issued_on, record_event, wait_for
from .transitions import checked

logger = logging.getLogger(__name__)

__all__ = ["ShardedUnit", "UnitState"]


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # an all-gather is in flight
    UNSHARDED = "unsharded"
    # After forward with reshard_after_forward=k: sharded parameters registered, plus 1/k of the gathered buffer kept
    # so that backward re-gathers within a group of k ranks (e.g. one node) instead of the whole shard group.
    GROUP_SHARDED = "group_sharded"


_ALLOWED: dict[UnitState, frozenset[UnitState]] = {
    UnitState.SHARDED: frozenset({UnitState.GATHERING}),
    UnitState.GATHERING: frozenset({UnitState.UNSHARDED}),
    UnitState.UNSHARDED: frozenset({UnitState.SHARDED, UnitState.GROUP_SHARDED}),
    UnitState.GROUP_SHARDED: frozenset({UnitState.GATHERING, UnitState.SHARDED}),
}


@dataclass
class _FullBuffer:
    """The full (unsharded) parameters of a unit's sharded slots, all in one storage, built once and reused.

    Parameter-major and padded: slot ``i`` owns ``world_size * slot.numel`` elements, viewed as ``(world_size,
    slot.numel)`` (``outs[i]``), exactly the columns of slot ``i`` in the all-gathered ``(world_size, segment)`` buffer.
    So the copy-out of a whole unit is one ``split_with_sizes_copy``, and freeing or refilling it is one storage resize.
    The full parameters are views of the same storage through ``.data`` (their own version counter): refilling it
    does not trip autograd's check on tensors saved in forward.
    """

    layout: FlatLayout
    dtype: torch.dtype
    data: torch.Tensor
    splits: list[int]
    outs: list[torch.Tensor]
    relaid: dict[int, int]  # slot sharded on a dim k > 0 -> where its full parameter starts, after the padded part
    # id(ManagedParam) -> (full parameter, its .data, hooked) of this dtype: set again when this dtype is gathered
    params: dict[int, tuple[Any, Any, bool]] | None = None

    @classmethod
    def build(cls, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> _FullBuffer:
        world_size = layout.world_size
        # A Shard(k) slot's region holds the ranks' chunks along k one after another, not the parameter: its full
        # parameter gets its own place after the padded part (same storage: freed and refilled with the rest).
        relaid: dict[int, int] = {}
        end = world_size * layout.segment_numel
        for index, slot in enumerate(layout.slots):
            if slot.dim != 0:
                relaid[index] = end
                end += slot.shape.numel()
        data = torch.empty(end, dtype=dtype, device=device)
        outs = [
            data[world_size * slot.offset : world_size * (slot.offset + slot.numel)].view(world_size, slot.numel)
            for slot in layout.slots
        ]
        return cls(layout, dtype, data, [slot.numel for slot in layout.slots], outs, relaid)

    def param_view(self, index: int) -> torch.Tensor:
        """The full parameter of slot ``index``: its first ``dim0`` rows (the rest is padding), or its own place."""
        slot = self.layout.slots[index]
        start = self.relaid.get(index, self.layout.world_size * slot.offset)
        return self.data.data[start : start + slot.shape.numel()].view(slot.shape)

    def allocate(self) -> None:
        storage = self.data.untyped_storage()
        needed = self.data.numel() * self.data.element_size()
        if storage.size() < needed:
            storage.resize_(needed)

    def free(self) -> None:
        self.data.untyped_storage().resize_(0)


@dataclass
class _PendingGather:
    """An all-gather in flight. It holds its input too: an asynchronous collective reads it until the wait."""

    work: Work | None
    output: torch.Tensor
    input: torch.Tensor
    encoded: bool  # the output needs the all-gather extension's decode
    issued: torch.Event | None = None  # recorded on the side stream after the copy-in and the collective's issue


class _CaptureGrad:
    """Post-accumulate-grad hook of a full parameter: hands the gradient to the unit's gradient side at once.

    It holds the unit and the parameter record weakly: autograd keeps a tensor's hooks alive from C++, so a strong
    reference back to the unit would form a cycle the garbage collector cannot see, and a deleted model (with its
    buffers and process groups) would never be freed.
    """

    def __init__(self, unit: ShardedUnit, mp: ManagedParam) -> None:
        self.unit = weakref.ref(unit)
        self.mp = weakref.ref(mp)

    def __call__(self, param: torch.Tensor) -> None:
        unit, mp = self.unit(), self.mp()
        if unit is not None and mp is not None:
            unit.grads.capture(mp)


class ShardedUnit:
    """Parameters of one ``fully_shard`` call, sharded on dim 0 over the data-parallel mesh's shard group."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        placings: list[ParamPlacing],
        mesh: DeviceMesh,
        device: torch.device,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        owner_name: str,
        frozen_params: str = "shard",
        extensions: ShardExtensions | None = None,
        offload_policy: OffloadPolicy | None = None,
    ) -> None:
        self.dp = DataParallelMesh.of(mesh)
        self.extensions = extensions or ShardExtensions()
        # The flat layout and the all-gather run over the shard group; reduce-scatters over a separate group of the
        # same ranks, so the two never have to be issued in one agreed order (see meshes.reduce_scatter_group).
        self.group: dist.ProcessGroup = self.dp.shard_group
        self.reduce_group = reduce_scatter_group(self.dp)
        self.rank = self.dp.shard_rank
        self.world_size = self.dp.shard_size
        self.device = device  # where it computes: the mesh's device
        self.devices = UnitDevices.of(offload_policy or OffloadPolicy(), device)
        self.owner_name = owner_name
        self.policy_param_dtype = param_dtype  # None: the parameters' own dtype
        self.policy_reduce_dtype = reduce_dtype  # None: the compute dtype
        self.state = UnitState.SHARDED
        self.explicit = False  # gathered by fc.unshard: the next forward consumes it rather than discarding it
        self.compute_dtype: torch.dtype | None = None  # dtype of the full parameters gathered last
        self._pending_gather: _PendingGather | None = None
        self.post_forward: PostForwardGroup | None = None  # set by reshard_after_forward=k (1 < k < world size)
        self._group_block: torch.Tensor | None = None  # GROUP_SHARDED: this rank's W/k segments of the gathered buffer
        # The sharded slots' full parameters, one buffer per compute dtype gathered (kept, storage freed when
        # sharded): an fp32 eval forward between a bf16 forward and its backward must not replace the bf16 tensors
        # that autograd saved, so the backward's gather refills those.
        self._fulls: dict[torch.dtype, _FullBuffer] = {}
        self.shards = FlatShard(params, placings, self.dp, self.devices, owner_name, frozen_params)
        self.grads = UnitGradients(self._reduce_spec(), self.params)

    # ------------------------------------------------------------------ dtypes
    @property
    def params(self) -> list[ManagedParam]:
        return self.shards.params

    @property
    def layout(self) -> FlatLayout:
        return self.shards.layout

    @property
    def flat(self) -> torch.Tensor:
        return self.shards.flat

    @property
    def orig_dtype(self) -> torch.dtype:
        """The sharded parameters' dtype (changes with ``model.to(dtype)``)."""
        return self.shards.dtype

    @property
    def param_dtype(self) -> torch.dtype:
        """The compute dtype of forward and backward by policy (the parameters' own dtype without one)."""
        return self.policy_param_dtype or self.shards.dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.policy_reduce_dtype or self.param_dtype

    def _reduce_spec(self) -> ReduceSpec:
        return ReduceSpec(
            owner_name=self.owner_name,
            dp=self.dp,
            reduce_group=self.reduce_group,
            device=self.device,
            devices=self.devices,
            reduce_dtype=self.reduce_dtype,
            grad_dtype=self.shards.dtype,
            extensions=self.extensions,
        )

    # ------------------------------------------------------------------ state machine
    def _to(self, new: UnitState) -> None:
        self.state = checked(self.state, new, _ALLOWED, f"unit {self.owner_name}")

    @property
    def is_unsharded(self) -> bool:
        return self.state is UnitState.UNSHARDED

    @property
    def needs_gather(self) -> bool:
        return self.state is UnitState.SHARDED or self.state is UnitState.GROUP_SHARDED

    @property
    def shard_device(self) -> torch.device:
        """Where the sharded parameters and their gradients live (the compute device unless offloaded)."""
        return self.devices.shard

    def is_stale(self) -> bool:
        """True when unsharded but a sharded parameter changed in place since (e.g. an optimizer step)."""
        return any(mp.sharded._version != mp.gathered_version for mp in self.params)

    # ------------------------------------------------------------------ re-adopting changed parameters
    def adopt_if_changed(self) -> None:
        """Pick up parameters replaced or cast since the last gather (see ``FlatShard.adopt``). Runs at the start of
        every step, before anything picks a compute dtype from the parameters' dtype, and before each gather."""
        if self.state is not UnitState.SHARDED or self.shards.views_intact():
            return
        before = self.shards.dtype
        self.shards.adopt()
        if self.shards.dtype != before:
            if self.grads.has_pending():
                raise RuntimeError(
                    f"the parameters of {self.owner_name} were cast from {before} to {self.shards.dtype} while "
                    "no-sync gradients are pending; cast the model between optimizer steps"
                )
            self.grads = _rebuilt_gradients(self.grads, self._reduce_spec(), self.params)

    # ------------------------------------------------------------------ unshard / reshard
    def start_unshard(self, dtype: torch.dtype, *, async_op: bool, stream: torch.Stream | None = None) -> None:
        """Issue the all-gather in ``dtype`` (no-op when already unsharded or gathering).

        ``stream``: a side stream for the copy-in and the collective's issue, so they overlap compute (None: the
        current stream; always None on a CPU device). ``finish_unshard`` makes the compute stream wait for it.
        """
        if self.state is UnitState.GROUP_SHARDED:
            block = self._group_block
            self._group_block = None
            if block is not None and block.dtype == dtype:
                self._start_group_gather(block, async_op=async_op)
                return
            self._to(UnitState.SHARDED)  # gathered in another precision since: gather from the shards
        if self.state is not UnitState.SHARDED:
            return
        self.adopt_if_changed()
        self.compute_dtype = dtype
        transform = self.extensions.all_gather
        numel = self.layout.segment_numel
        flat = self.shards.flat
        cast_in_place = transform is None and dtype != flat.dtype and self.world_size > 1 and numel > 0
        gathers = self.world_size > 1 and numel > 0
        if transform is not None:
            stream = None  # an extension's encode decides the collective's size: it runs on the compute stream
        # Allocated on the compute stream, which frees it after the copy-out (the rule in streams.py).
        gathered = torch.empty(self.world_size * numel, dtype=dtype, device=self.device) if gathers else None
        with labelled("fsdp_compose::all_gather"), issued_on(stream, self.device):
            if cast_in_place:
                # Cast straight into this rank's segment of the output and all-gather in place (the input is a view
                # of the output): no separate low-precision copy of the shard lives next to the output while it
                # runs. Offloaded, the shard crosses to the device in its own dtype first and is cast there.
                assert gathered is not None
                shard = gathered[self.rank * numel : (self.rank + 1) * numel]
                shard.copy_(self.devices.to_compute(flat, flat.dtype))
                work = all_gather_flat(gathered, shard, self.group, async_op=async_op)
                pending = _PendingGather(work, gathered, shard, encoded=False)
            else:
                shard = self.devices.to_compute(flat, dtype)
                if transform is not None and gathers:
                    shard = transform.encode(shard)
                    gathered = torch.empty(self.world_size * shard.numel(), dtype=shard.dtype, device=self.device)
                if gathered is None:
                    pending = _PendingGather(None, shard, shard, encoded=False)
                else:
                    work = all_gather_flat(gathered, shard, self.group, async_op=async_op)
                    pending = _PendingGather(work, gathered, shard, encoded=transform is not None)
        if stream is not None:
            pending.issued = record_event(self.device, stream)
        self._pending_gather = pending
        self._to(UnitState.GATHERING)

    def _start_group_gather(self, block: torch.Tensor, *, async_op: bool) -> None:
        """All-gather the post-forward blocks within the group of k ranks: all ``W`` segments, in order."""
        assert self.post_forward is not None
        gathered = torch.empty(self.world_size * self.layout.segment_numel, dtype=block.dtype, device=block.device)
        with labelled("fsdp_compose::all_gather"):
            work = all_gather_flat(gathered, block.view(-1), self.post_forward.group, async_op=async_op)
        self._pending_gather = _PendingGather(work, gathered, block, encoded=False)
        self._to(UnitState.GATHERING)

    def finish_unshard(self) -> None:
        """Wait for the all-gather, fill the full parameters and register them on the modules."""
        if self.state is not UnitState.GATHERING:
            return
        assert self._pending_gather is not None and self.compute_dtype is not None
        pending, self._pending_gather = self._pending_gather, None
        wait_for(pending.issued, self.device)
        if pending.work is not None:
            with labelled("fsdp_compose::all_gather_wait"):
                pending.work.wait()
        dtype = self.compute_dtype
        with labelled("fsdp_compose::all_gather_copy_out"):
            gathered = pending.output
            transform = self.extensions.all_gather
            if pending.encoded and transform is not None:
                segments = transform.decode(gathered.view(self.world_size, -1), dtype)
                segments = segments[:, : self.layout.segment_numel]
            else:
                segments = gathered.view(self.world_size, self.layout.segment_numel)
            full = self._full_buffer(dtype)
            if full.splits and self.layout.segment_numel > 0:
                torch.split_with_sizes_copy(segments, full.splits, dim=1, out=full.outs)
            for index in full.relaid:
                copy_param_from_segments(full.param_view(index), segments, self.layout.slots[index])
            for mp in self.params:
                if mp.slot is None:
                    full_data = self._ensure_full(mp, dtype)
                    if full_data.data_ptr() != mp.sharded._local_tensor.data_ptr():
                        self.devices.copy_to_compute(full_data, mp.sharded._local_tensor)
                elif mp.full is not None and mp.full.requires_grad != mp.trainable:
                    mp.full.requires_grad_(mp.trainable)
                    self._hook_full(mp)
                mp.gathered_version = mp.sharded._version
                assert mp.full is not None
                mp.register(mp.full)
        self._to(UnitState.UNSHARDED)

    def unshard(self, dtype: torch.dtype) -> None:
        self.start_unshard(dtype, async_op=False)
        self.finish_unshard()

    def _full_buffer(self, dtype: torch.dtype) -> _FullBuffer:
        """The sharded slots' full parameters with storage allocated: built on first use and when the layout, the
        dtype or a parameter object changed; otherwise the same tensors, their storage resized back."""
        full = self._fulls.get(dtype)
        fresh = full is None or full.layout is not self.layout
        if fresh:
            full = self._fulls[dtype] = _FullBuffer.build(self.layout, dtype, self.device)
            full.params = {}
        assert full is not None and full.params is not None
        for mp in self.params:
            if mp.slot is None:
                continue
            current = None if fresh else mp.full
            if current is not None and current.dtype != dtype:
                # Another dtype's full parameter: keep it with its buffer (autograd may hold it), take this dtype's.
                other = self._fulls.get(current.dtype)
                if other is not None and other.params is not None:
                    other.params[id(mp)] = (current, mp.full_data, mp.full_hooked)
                current = None
            cached = full.params.get(id(mp))
            if current is None and cached is not None and mp.full is not None:
                mp.full, mp.full_data, mp.full_hooked = cached
            elif current is None:
                mp.full, mp.full_data = make_full_param(full.param_view(mp.slot), mp.placing, mp.trainable)
                mp.full_hooked = False
                self._hook_full(mp)
                full.params[id(mp)] = (mp.full, mp.full_data, mp.full_hooked)
        full.allocate()
        return full

    def _ensure_full(self, mp: ManagedParam, dtype: torch.dtype) -> torch.Tensor:
        """A kept-whole parameter's full ``.data`` with storage allocated (created on first use, resized back after)."""
        if mp.full is None or mp.full.dtype != dtype:
            if mp.slot is None and dtype == self.shards.dtype and not self.devices.offloaded:
                local = mp.sharded._local_tensor  # whole: the full parameter aliases it, no copy
            else:
                local = torch.empty(mp.placing.local_shape, dtype=dtype, device=self.device)
            mp.full, mp.full_data = make_full_param(local, mp.placing, mp.trainable)
            mp.full_hooked = False
            self._hook_full(mp)
        elif mp.full.requires_grad != mp.trainable:
            mp.full.requires_grad_(mp.trainable)
            self._hook_full(mp)
        assert mp.full_data is not None
        storage = mp.full_data.untyped_storage()
        needed = mp.full_data.numel() * mp.full_data.element_size()
        if storage.size() < needed:
            storage.resize_(needed)
        return mp.full_data

    def reshard(self) -> None:
        """Register the sharded parameters again and free the full parameters' storage (keeping the objects)."""
        if self.state is UnitState.GATHERING:
            self.finish_unshard()
        self.explicit = False
        if self.state is UnitState.GROUP_SHARDED:
            self._group_block = None
            self._to(UnitState.SHARDED)
        if self.state is UnitState.UNSHARDED:
            self._free_full()
            self._to(UnitState.SHARDED)

    def _free_full(self) -> None:
        for mp in self.params:
            # ``requires_grad_`` the user called while the full parameters were registered belongs to the
            # parameter the module will hold from now on: the trainability check reads the sharded one.
            if mp.full is not None and mp.registered() is mp.full and mp.full.requires_grad != mp.trainable:
                mp.sharded.requires_grad_(mp.full.requires_grad)
            mp.register(mp.sharded)
            full_data = mp.full_data
            if (
                mp.slot is None
                and full_data is not None
                and full_data.untyped_storage().data_ptr() != mp.sharded._local_tensor.data_ptr()
            ):
                full_data.untyped_storage().resize_(0)
        for full in self._fulls.values():
            full.free()

    def reshard_to_group(self) -> None:
        """After forward with ``reshard_after_forward=k``: keep this rank's ``W/k`` segments, free the rest.

        The kept block is cut from the full parameters (already in the compute dtype), so backward all-gathers
        ``1/k`` of the unit per rank within the group instead of ``1/W`` over the whole shard group.
        """
        assert self.post_forward is not None, "reshard_after_forward=k sets the post-forward group"
        if self.state is UnitState.GATHERING:
            self.finish_unshard()
        if self.state is not UnitState.UNSHARDED:
            self.reshard()
            return
        per_member = self.world_size // self.post_forward.size
        first = self.post_forward.position * per_member
        assert self.compute_dtype is not None
        block = torch.zeros(per_member, self.layout.segment_numel, dtype=self.compute_dtype, device=self.device)
        for mp in self.params:
            if mp.slot is not None and mp.full_data is not None:
                write_param_into_segments(mp.full_data, block, self.layout.slots[mp.slot], first)
        self._free_full()
        self._group_block = block
        self._to(UnitState.GROUP_SHARDED)

    def has_pending_full_grads(self) -> bool:
        """Full-size ``.grad`` left on full parameters (none between steps: they move into the gradient buffer)."""
        return any(mp.full is not None and mp.full.grad is not None for mp in self.params)

    # ------------------------------------------------------------------ trainability
    def current_requires_grad(self, mp: ManagedParam) -> bool:
        """``requires_grad`` of the parameter the module holds now: the full one while unsharded."""
        registered = mp.registered()
        if registered is mp.full and mp.full is not None:
            return mp.full.requires_grad
        return mp.sharded.requires_grad

    def trainability_changed(self) -> bool:
        return any(self.current_requires_grad(mp) != mp.trainable for mp in self.params)

    def refresh_trainable(self) -> bool:
        """Catch up with ``requires_grad`` changes: which parameters get full gradients and are reduced, and (under
        ``frozen_params="replicate"``) which are kept whole. Returns whether anything changed.

        Moving a parameter between sharded and whole re-lays out the unit, which all-gathers it once in its
        original dtype: every rank must make the same change (as with any change to the model).
        """
        if not self.trainability_changed():
            return False
        if self.grads.has_pending():
            self.grads.refresh(self.params)  # raises: gradients from no-sync micro-batches would be lost
        old_whole = [mp.slot is None for mp in self.params]
        for mp in self.params:
            mp.trainable = self.current_requires_grad(mp)
            mp.sharded.requires_grad_(mp.trainable)
        new_whole = [self.shards.kept_whole(len(mp.sharded.shape), mp.trainable) for mp in self.params]
        if new_whole != old_whole:
            self._relayout()
        for mp in self.params:
            if mp.full is not None:
                mp.full.requires_grad_(mp.trainable)
                self._hook_full(mp)
        self.grads.refresh(self.params)
        return True

    def _hook_full(self, mp: ManagedParam) -> None:
        """Once per full parameter that requires grad: hand each gradient to ``grads.capture`` as it is made."""
        if mp.full is not None and mp.full.requires_grad and not mp.full_hooked:
            mp.full.register_post_accumulate_grad_hook(_CaptureGrad(self, mp))
            mp.full_hooked = True

    def _relayout(self) -> None:
        self.reshard()
        self.unshard(self.shards.dtype)  # gather the master values, not a low-precision copy
        values = [cast(torch.Tensor, mp.full_data).clone() for mp in self.params]
        self.reshard()
        self.shards.reinstall(values, are_full=True)
        logger.debug("re-laid out %s: %d elements sharded per rank", self.owner_name, self.layout.segment_numel)

    def release(self, original: nn.Parameter) -> list[tuple[nn.Module, str]]:
        """Stop managing the parameter that replaced ``original`` (it moves to an enclosing unit: a tie).

        Returns the (module, attribute) pairs that held it; the caller registers its own parameter there.
        """
        if self.state is not UnitState.SHARDED or self.grads.has_pending():
            raise RuntimeError(f"cannot move a tied parameter out of {self.owner_name} while it is in use")
        released = self.shards.release(original)
        self.grads.refresh(self.params)
        return released.owners

    # ------------------------------------------------------------------ copy.deepcopy
    def copy_for(self, memo: dict[int, Any]) -> ShardedUnit:
        """This unit for a ``copy.deepcopy`` of its modules: same mesh and groups, the copied parameters (adopted at
        the first gather), its own copy of the extensions (hooks may keep state, e.g. error feedback)."""
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(
                f"copy.deepcopy of a sharded module while its unit {self.owner_name} is {self.state.value}; call "
                "fc.reshard(module) first (units are resharded between training steps)"
            )
        new = object.__new__(ShardedUnit)
        new.__dict__.update(self.__dict__)
        new.shards = self.shards.copy_for(memo)
        new.extensions = copy.deepcopy(self.extensions, memo)
        new.explicit = False
        new._pending_gather = None
        new._group_block = None
        new._fulls = {}
        divide_factor = self.grads.divide_factor
        new.grads = UnitGradients(new._reduce_spec(), new.params)
        new.grads.divide_factor = divide_factor
        return new


def _rebuilt_gradients(old: UnitGradients, spec: ReduceSpec, params: list[ManagedParam]) -> UnitGradients:
    """The gradient side for new dtypes, keeping its settings and the callbacks set on the old one."""
    new = UnitGradients(spec, params)
    new.divide_factor = old.divide_factor
    new.on_finished = old.on_finished
    new.make_room = old.make_room
    return new
