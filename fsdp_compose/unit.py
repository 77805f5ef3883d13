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
import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .collectives import Work, all_gather_flat, labelled
from .extensions import ShardExtensions
from .flat import FlatShard, ManagedParam, make_full_param
from .gather_plan import FullBuffer, GatherPlan
from .grads import ReduceSpec, UnitGradients
from .meshes import DataParallelMesh, ParamPlacing, PostForwardGroup, reduce_scatter_group
from .offload import UnitDevices
from .policies import OffloadPolicy
from .sharding import FlatLayout, copy_param_from_segments, write_param_into_segments
from .streams import issued_on, record_event, wait_for
from .subclass_params import shard_mesh
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


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _plain_tensors(method: _Method) -> _Method:
    """Run ``method`` with torch.func's transforms (``jvp``, ``vmap``, ``grad``) switched off: the buffers and full
    parameters it makes are the unit's own, plain tensors, never wrapped for the transform of the forward that
    gathers them. Inside the transform the parameters are then constants, as torch's ``fully_shard`` makes them."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return cast(_Method, run)


@dataclass
class _PendingGather:
    """An all-gather in flight. It holds its input too: an asynchronous collective reads it until the wait."""

    work: Work | None
    output: torch.Tensor
    input: torch.Tensor
    encoded: bool  # the output needs the all-gather extension's decode
    plan: GatherPlan | None = None  # several dtypes or protocol parameters in one all-gather (gather_plan.py)
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
        # Per (dtype group, compute dtype), its sharded slots' full parameters (kept, storage freed when sharded): an
        # fp32 eval forward between a bf16 forward and its backward must not replace the bf16 tensors that autograd
        # saved, so the backward's gather refills those.
        self._fulls: dict[tuple[int, torch.dtype], FullBuffer] = {}
        # What a protocol parameter's hooks receive (torch's policy class); set by fully_shard
        self.hook_policy: torch_fsdp.MixedPrecisionPolicy = torch_fsdp.MixedPrecisionPolicy(param_dtype, reduce_dtype)
        self.shards = FlatShard(params, placings, self.dp, self.devices, owner_name, frozen_params)
        self.grads = UnitGradients(self._reduce_spec(), self.params)

    def __repr__(self) -> str:
        """What this unit is: its modules, mesh, parameters (global and local sizes), dtypes and state."""
        mesh = self.dp.mesh
        names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        params = self.params
        local = sum(mp.sharded._local_tensor.numel() for mp in params)
        total = sum(mp.sharded.numel() for mp in params)
        dtype = str(self.orig_dtype).removeprefix("torch.")
        compute = "" if self.policy_param_dtype is None else f", param_dtype={self.policy_param_dtype}"
        return (
            f"ShardedUnit({self.owner_name}, mesh={tuple(mesh.shape)} {mesh.device_type}{names}, "
            f"params={len(params)}, numel={total}, local_numel={local} ({self.shard_device.type}), dtype={dtype}"
            f"{compute.replace('torch.', '')}, state={self.state.value})"
        )

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

    def _trainable_dtypes(self) -> set[torch.dtype]:
        return {mp.sharded.dtype for mp in self.params if mp.trainable}

    @property
    def reduce_dtype(self) -> torch.dtype:
        """Gradients are reduced (and accumulated) in this: the policy's ``reduce_dtype``, else its ``param_dtype``,
        else the trainable parameters' dtype; with several trainable dtypes in one unit (and no policy) the widest of
        them (torch's fully_shard refuses that case)."""
        if self.policy_reduce_dtype is not None or self.policy_param_dtype is not None:
            return self.policy_reduce_dtype or self.param_dtype
        dtypes = self._trainable_dtypes()
        if len(dtypes) <= 1:
            return dtypes.pop() if dtypes else self.shards.dtype
        widest = self.shards.dtype
        for dtype in sorted(dtypes, key=str):
            widest = torch.promote_types(widest, dtype)
        return widest

    def _reduce_spec(self) -> ReduceSpec:
        dtypes = self._trainable_dtypes()
        return ReduceSpec(
            owner_name=self.owner_name,
            dp=self.dp,
            reduce_group=self.reduce_group,
            device=self.device,
            devices=self.devices,
            reduce_dtype=self.reduce_dtype,
            # several trainable dtypes: each gradient is cast to its parameter's dtype where it is handed out
            grad_dtype=dtypes.pop() if len(dtypes) == 1 else (self.reduce_dtype if dtypes else self.shards.dtype),
            extensions=self.extensions,
        )

    def compute_dtype_for(self, own: torch.dtype, dtype: torch.dtype) -> torch.dtype:
        """The compute dtype of a parameter of dtype ``own`` when the unit is gathered in ``dtype``.

        The unit's own dtype group (and every parameter of a one-dtype unit) takes ``dtype``; in a unit of several
        dtypes the others take the policy's ``param_dtype`` when ``dtype`` is it, else keep their own (as torch's
        fully_shard casts each parameter to ``param_dtype`` or leaves it).
        """
        if own == self.shards.dtype or (self.policy_param_dtype is not None and dtype == self.policy_param_dtype):
            return dtype
        return own

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
    @_plain_tensors
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
        if not self.shards.uniform:
            self._start_plan(dtype, async_op=async_op)
            return
        transform = self.extensions.all_gather
        numel = self.layout.segment_numel
        flat = self.shards.flat
        cast_in_place = transform is None and dtype != flat.dtype and self.world_size > 1 and numel > 0
        gathers = self.world_size > 1 and numel > 0
        if transform is not None:
            stream = None  # an extension's encode decides the collective's size: it runs on the compute stream
        # Allocated on the compute stream, which frees it after the copy-out (the rule in streams.py).
        gathered = torch.empty(self.world_size * numel, dtype=dtype, device=self.device) if gathers else None
        with labelled(f"fsdp_compose::all_gather[{self.owner_name}]"), issued_on(stream, self.device):
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

    def _start_plan(self, dtype: torch.dtype, *, async_op: bool) -> None:
        """Several dtype groups or protocol parameters: one all-gather of all their inputs (see gather_plan.py).

        Runs on the compute stream: a pre-hook may communicate (float8's amax) and decides the collective's size.
        """
        inputs = [
            self.devices.to_compute(group.flat, self.compute_dtype_for(group.dtype, dtype))
            for group in self.shards.groups
        ]
        with labelled(f"fsdp_compose::all_gather[{self.owner_name}]"):
            for mp in self.shards.protocol:
                assert mp.subclass is not None
                module = mp.owners[0][0]
                local = mp.sharded._local_tensor
                inputs.extend(mp.subclass.all_gather_inputs(local, shard_mesh(self.dp.mesh), module, self.hook_policy))
            plan = GatherPlan.copy_in(inputs, self.world_size, self.rank, self.device)
            work = None
            if self.world_size > 1 and plan.shard.numel() > 0:
                work = all_gather_flat(plan.output, plan.shard, self.group, async_op=async_op)
        self._pending_gather = _PendingGather(work, plan.output, plan.shard, encoded=False, plan=plan)
        self._to(UnitState.GATHERING)

    def _copy_out_plan(self, plan: GatherPlan, dtype: torch.dtype) -> None:
        """Split the gathered inputs into every group's full parameters and every protocol parameter's outputs; the
        post-hooks then build (first gather) or refill (``out=``) the unsharded protocol parameters."""
        outs: list[torch.Tensor] = []
        fulls = []
        for index, group in enumerate(self.shards.groups):
            full = self._full_buffer(self.compute_dtype_for(group.dtype, dtype), index)
            outs.extend(full.outs)
            fulls.append(full)
        protocol = self.shards.protocol
        first = len(self.shards.groups)
        for mp in protocol:
            assert mp.subclass is not None
            count = len(mp.subclass.input_sizes)
            dtypes, numels = plan.input_dtypes[first : first + count], plan.input_numels[first : first + count]
            first += count
            buffers = mp.subclass.output_buffers(dtypes, numels, self.world_size, self.device)
            outs.extend(b.view(self.world_size, -1) for b in buffers)
        plan.copy_out(outs, self.world_size)
        for full in fulls:
            full.relay()
        for mp in protocol:
            assert mp.subclass is not None
            own = self.compute_dtype_for(mp.sharded.dtype, dtype)
            unsharded = mp.subclass.unshard(mp.sharded._local_tensor, own, mp.trainable)
            if mp.full is not unsharded:
                mp.full = mp.full_data = unsharded
                mp.full_hooked = False
                self._hook_full(mp)

    def _start_group_gather(self, block: torch.Tensor, *, async_op: bool) -> None:
        """All-gather the post-forward blocks within the group of k ranks: all ``W`` segments, in order."""
        assert self.post_forward is not None
        gathered = torch.empty(self.world_size * self.layout.segment_numel, dtype=block.dtype, device=block.device)
        with labelled(f"fsdp_compose::all_gather[{self.owner_name}]"):
            work = all_gather_flat(gathered, block.view(-1), self.post_forward.group, async_op=async_op)
        self._pending_gather = _PendingGather(work, gathered, block, encoded=False)
        self._to(UnitState.GATHERING)

    @_plain_tensors
    def finish_unshard(self) -> None:
        """Wait for the all-gather, fill the full parameters and register them on the modules."""
        if self.state is not UnitState.GATHERING:
            return
        assert self._pending_gather is not None and self.compute_dtype is not None
        pending, self._pending_gather = self._pending_gather, None
        wait_for(pending.issued, self.device)
        if pending.work is not None:
            with labelled(f"fsdp_compose::all_gather_wait[{self.owner_name}]"):
                pending.work.wait()
        dtype = self.compute_dtype
        with labelled(f"fsdp_compose::all_gather_copy_out[{self.owner_name}]"):
            if pending.plan is not None:
                self._copy_out_plan(pending.plan, dtype)
            else:
                self._copy_out(pending, dtype)
            for mp in self.params:
                if mp.slot is None:
                    full_data = self._ensure_full(mp, self.compute_dtype_for(mp.sharded.dtype, dtype))
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

    def _copy_out(self, pending: _PendingGather, dtype: torch.dtype) -> None:
        """One dtype group: the gathered segments (decoded by an extension) into its full parameters."""
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

    def _full_buffer(self, dtype: torch.dtype, group: int = 0) -> FullBuffer:
        """A dtype group's full parameters with storage allocated: built on first use and when the layout, the
        dtype or a parameter object changed; otherwise the same tensors, their storage resized back."""
        key = (group, dtype)
        full = self._fulls.get(key)
        groups = self.shards.groups
        layout = groups[group].layout if groups else self.layout
        members = [mp for mp in self.params if mp.group == group and mp.slot is not None]
        fresh = full is None or full.layout is not layout
        if full is None or fresh:
            full = self._fulls[key] = FullBuffer.build(layout, dtype, self.device)
        for mp in members:
            assert mp.slot is not None
            current = None if fresh else mp.full
            if current is not None and current.dtype != dtype:  # keep it with its buffer (autograd may hold it)
                self._fulls[(group, current.dtype)].params[id(mp)] = (current, mp.full_data, mp.full_hooked)
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
        mp.use_full_of(dtype)
        if mp.full is None:
            if mp.slot is None and dtype == mp.sharded.dtype and not self.devices.offloaded:
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

    @_plain_tensors
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
        for mp in self.params:
            if mp.subclass is not None:
                mp.subclass.free()

    def reshard_to_group(self) -> None:
        """After forward with ``reshard_after_forward=k``: keep this rank's ``W/k`` segments, free the rest.

        The kept block is cut from the full parameters (already in the compute dtype), so backward all-gathers
        ``1/k`` of the unit per rank within the group instead of ``1/W`` over the whole shard group.
        """
        assert self.post_forward is not None, "reshard_after_forward=k sets the post-forward group"
        if not self.shards.uniform:
            raise NotImplementedError(
                f"reshard_after_forward={self.post_forward.size} on {self.owner_name}, whose parameters have several "
                "dtypes or use FSDP2's all-gather hooks; use True or False for this unit"
            )
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
        new_whole = [
            self.shards.kept_whole(len(mp.sharded.shape), mp.trainable, mp.subclass is not None) for mp in self.params
        ]
        if new_whole != old_whole:
            self._relayout()
        for mp in self.params:
            if mp.full is not None:
                mp.full.requires_grad_(mp.trainable)
                self._hook_full(mp)
        self.grads.refresh(self.params)
        spec = self._reduce_spec()
        if spec != self.grads.spec:  # a unit of several dtypes: which are trainable decides the reduce dtype
            self.grads = _rebuilt_gradients(self.grads, spec, self.params)
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
        new.grads = UnitGradients(new._reduce_spec(), new.params)
        _carry_settings(self.grads, new.grads)
        return new


def _carry_settings(old: UnitGradients, new: UnitGradients) -> None:
    """The user's settings of a gradient side (divide factor, FSDP2's all-reduce hook and unused-parameter mode)."""
    new.divide_factor = old.divide_factor
    new.reduced_hook = old.reduced_hook
    new.reduced_hook_stream = old.reduced_hook_stream
    new.zero_unused = old.zero_unused


def _rebuilt_gradients(old: UnitGradients, spec: ReduceSpec, params: list[ManagedParam]) -> UnitGradients:
    """The gradient side for new dtypes, keeping its settings and the callbacks set on the old one."""
    new = UnitGradients(spec, params)
    _carry_settings(old, new)
    new.on_finished = old.on_finished
    new.make_room = old.make_room
    return new
