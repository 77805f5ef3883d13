"""A unit's parameters: the sharded storage, the gather state machine and the full parameters of one
``fully_shard`` call.

A unit is two objects, both held by its ``ShardState`` (state.py): its parameters (``UnitParams``, here) and its
gradients (grads.py ``UnitGradients``: the reduce-scatter input and the delivery to ``.grad``). ``UnitParams`` owns
the flat shard buffer(s) and the DTensor parameters viewing them (flat.py ``FlatShard``), the full parameters the
gathered bytes land in (full_params.py ``FullParams``), and the one gather state machine (``UnitState``)::

    SHARDED --start--> GATHERING --finish--> UNSHARDED --reshard--> SHARDED
    UNSHARDED --reshard_to_group--> GROUP_SHARDED --start--> GATHERING     (reshard_after_forward=k)
    GROUP_SHARDED --reshard--> SHARDED

1. ``start(dtype)`` issues one flat all-gather of every rank's segment in the compute ``dtype``; ``finish`` waits for
   it, and full_params.py copies each parameter's rows out into its own full tensor and registers those on the
   owning modules, so the user's forward runs unchanged.
2. ``reshard`` registers the sharded DTensor parameters again and frees the full tensors' storage (full_params.py).

This is the one place that decides which all-gather a unit issues (its flat buffer, one ``GatherPlan`` of several
dtypes or protocol parameters, or the post-forward block within a group of ``k`` ranks) and when it waits; which
unit gathers when is the step's (hooks.py, backward.py). A transition not listed in ``_ALLOWED`` raises. It also
holds what concerns the parameters as a whole: the dtypes the unit computes and reduces in (the ``ReduceSpec`` its
gradient side is built from), catching up with parameters the user replaced, cast or (un)froze since the last step
(each may re-lay out the shards), and ``copy.deepcopy``. What a change means for the gradients the state does, which
owns both.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .collectives import Work, all_gather_flat, labelled, record_event, wait_for
from .extensions import ShardExtensions
from .flat import FlatShard, ManagedParam
from .full_params import FullParams, GatherPlan
from .grads import ReduceSpec
from .meshes import DataParallelMesh, ParamPlacing, PostForwardGroup, reduce_scatter_group, replica_reduce_group
from .offload import UnitDevices
from .policies import MixedPrecisionPolicy, OffloadPolicy
from .sharding import write_param_into_segments
from .subclass_params import check_hooks_added, shard_mesh
from .transitions import internal_error, transition_error

logger = logging.getLogger(__name__)

__all__ = ["UnitParams", "UnitState"]


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # an all-gather is in flight
    UNSHARDED = "unsharded"
    # After forward with reshard_after_forward=k: sharded parameters registered, plus 1/k of the gathered buffer kept
    # so that backward re-gathers within a group of k ranks (e.g. one node) instead of the whole shard group.
    GROUP_SHARDED = "group_sharded"


_ALLOWED: dict[UnitState, frozenset[UnitState]] = {
    UnitState.SHARDED: frozenset({UnitState.GATHERING, UnitState.UNSHARDED}),  # UNSHARDED: a parked gather taken back
    UnitState.GATHERING: frozenset({UnitState.UNSHARDED, UnitState.SHARDED}),  # SHARDED: its copy-out raised
    UnitState.UNSHARDED: frozenset({UnitState.SHARDED, UnitState.GROUP_SHARDED}),
    UnitState.GROUP_SHARDED: frozenset({UnitState.GATHERING, UnitState.SHARDED}),
}


@dataclass
class _PendingGather:
    """An all-gather in flight. It holds its input too: an asynchronous collective reads it until the wait."""

    work: Work | None
    output: torch.Tensor
    input: torch.Tensor
    encoded: bool  # the output needs the all-gather extension's decode
    plan: GatherPlan | None = None  # several dtypes or protocol parameters in one all-gather (full_params.py)
    collective: bool = True  # an all-gather filled ``output`` (False: one rank, the output is the shard itself)
    issued: torch.Event | None = None  # recorded on the side stream after the copy-in and the collective's issue
    stream: torch.Stream | None = None  # the side stream it was issued on, which allocated its buffers


class UnitParams:
    """Parameters of one ``fully_shard`` call, sharded on dim 0 over the data-parallel mesh's shard group, and their
    gather state (the module docstring).

    ``start``, ``finish`` and ``reshard`` make the unit's own, plain tensors (``_plain_tensors``): with torch.func's
    transforms (``jvp``, ``vmap``, ``grad``) switched off, never wrapped for the transform of the forward that gathers
    them (inside it the parameters are constants, as torch's ``fully_shard`` makes them); and outside inference mode,
    so a first forward under ``torch.inference_mode()`` does not make the full parameters inference tensors, which
    no later training forward could refill.

    An exception inside ``finish`` or ``reshard`` (an allocation, a storage a reader made non-resizable) leaves the
    unit sharded, with its full parameters forgotten (``FullParams.discard``): the next gather makes new ones.
    """

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        placings: list[ParamPlacing],
        mesh: DeviceMesh,
        device: torch.device,
        owner_name: str,
        *,
        mp_policy: MixedPrecisionPolicy,
        frozen_params: str = "shard",
        extensions: ShardExtensions | None = None,
        offload_policy: OffloadPolicy | None = None,
        post_forward: PostForwardGroup | None = None,
    ) -> None:
        self.dp = replica_reduce_group(DataParallelMesh.of(mesh))
        self.extensions = extensions or ShardExtensions()
        # The flat layout and the all-gather run over the shard group; reduce-scatters over a separate group of the
        # same ranks, so the two never have to be issued in one agreed order (see meshes.reduce_scatter_group).
        self.group = self.dp.shard_group
        self.reduce_group = reduce_scatter_group(self.dp)
        self.rank = self.dp.shard_rank
        self.world_size = self.dp.shard_size
        self.device = device  # where it computes: the mesh's device
        self.devices = UnitDevices.of(offload_policy or OffloadPolicy(), device)
        self.owner_name = owner_name
        self.policy_param_dtype = mp_policy.param_dtype  # None: the parameters' own dtype
        self.policy_reduce_dtype = mp_policy.reduce_dtype  # None: the compute dtype
        # What a protocol parameter's hooks receive (torch's policy class)
        self.hook_policy = torch_fsdp.MixedPrecisionPolicy(
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            output_dtype=mp_policy.output_dtype,
            cast_forward_inputs=mp_policy.cast_forward_inputs,
        )
        self.post_forward = post_forward  # set by reshard_after_forward=k (1 < k < world size)
        self.shards = FlatShard(params, placings, self.dp, self.devices, owner_name, frozen_params)
        self._reset_gather()

    def _reset_gather(self) -> None:
        """SHARDED, nothing in flight, no full parameters yet."""
        self.fulls = FullParams(self.shards, self.devices, self.world_size, self.policy_param_dtype)
        self.state = UnitState.SHARDED
        self.explicit = False  # gathered by fc.unshard: the next forward consumes it rather than discarding it
        self.compute_dtype: torch.dtype | None = None  # dtype of the full parameters gathered last
        self._pending_gather: _PendingGather | None = None
        self._group_block: torch.Tensor | None = None  # GROUP_SHARDED: this rank's W/k segments of the gathered buffer
        # SHARDED with the full parameters of the last gather kept, in this dtype (``park``): the next gather in it
        # takes them back without a collective while the shards are unchanged
        self.parked: torch.dtype | None = None
        self.issued = 0  # all-gathers issued so far (the backward walk checks each against its program step)

    def __repr__(self) -> str:
        """What this unit is: its modules, mesh, parameters (global and local sizes), dtypes and state."""
        mesh = self.dp.mesh
        names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        params = self.shards.params
        local = sum(mp.sharded._local_tensor.numel() for mp in params)
        total = sum(mp.sharded.numel() for mp in params)
        dtype = str(self.orig_dtype).removeprefix("torch.")
        compute = "" if self.policy_param_dtype is None else f", param_dtype={self.policy_param_dtype}"
        return (
            f"UnitParams({self.owner_name}, mesh={tuple(mesh.shape)} {mesh.device_type}{names}, "
            f"params={len(params)}, numel={total}, local_numel={local} ({self.shard_device.type}), dtype={dtype}"
            f"{compute.replace('torch.', '')}, state={self.state.value})"
        )

    # ------------------------------------------------------------------ dtypes
    @property
    def orig_dtype(self) -> torch.dtype:
        """The sharded parameters' dtype (changes with ``model.to(dtype)``)."""
        return self.shards.dtype

    @property
    def param_dtype(self) -> torch.dtype:
        """The compute dtype of forward and backward by policy (the parameters' own dtype without one)."""
        return self.policy_param_dtype or self.shards.dtype

    def _trainable_dtypes(self) -> set[torch.dtype]:
        return {mp.sharded.dtype for mp in self.shards.params if mp.trainable}

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

    def reduce_spec(self) -> ReduceSpec:
        """What the unit's gradient side is built from: groups, devices, dtypes, extensions."""
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

    @property
    def shard_device(self) -> torch.device:
        """Where the sharded parameters and their gradients live (the compute device unless offloaded)."""
        return self.devices.shard

    def is_stale(self) -> bool:
        """True when unsharded but a sharded parameter changed in place since (e.g. an optimizer step)."""
        return any(mp.sharded._version != mp.gathered_version for mp in self.shards.params)

    # ------------------------------------------------------------------ re-adopting changed parameters
    def adopt_if_changed(self) -> None:
        """Pick up parameters replaced or cast since the last gather (see ``FlatShard.adopt``). Runs at the start of
        a step that changed something (``ShardState.params_changed``), before anything picks a compute dtype from the
        parameters' dtype, and before a gather from the shards that finds a change the same way."""
        if self.state is not UnitState.SHARDED:
            return
        if self.shards.defer_hookless:  # FSDP2's all-gather hooks: read again before the first gather (torch too)
            self.shards.read_hooks(_added_hooks_check(self))
        if not self.shards.views_intact():
            self._unpark()
            self.shards.adopt()

    # ------------------------------------------------------------------ trainability
    def current_requires_grad(self, mp: ManagedParam) -> bool:
        """``requires_grad`` of the parameter the module holds now: the full one while unsharded."""
        registered = mp.registered()
        if registered is mp.full and mp.full is not None:
            return mp.full.requires_grad
        return mp.sharded.requires_grad

    def trainability_changed(self) -> bool:
        for mp in self.shards.params:
            if self.current_requires_grad(mp) != mp.trainable:
                return True
        return False

    def apply_trainability(self) -> None:
        """Take the ``requires_grad`` the module's parameters have now: which get full gradients and (under
        ``frozen_params="replicate"``) which are kept whole. The caller rebuilds the gradient side after.

        Moving a parameter between sharded and whole re-lays out the unit, which all-gathers it once in its
        original dtype: every rank must make the same change (as with any change to the model).
        """
        old_whole = [mp.slot is None for mp in self.shards.params]
        for mp in self.shards.params:
            mp.trainable = self.current_requires_grad(mp)
            mp.sharded.requires_grad_(mp.trainable)
        new_whole = [
            self.shards.kept_whole(len(mp.sharded.shape), mp.trainable, mp.subclass is not None)
            for mp in self.shards.params
        ]
        if new_whole != old_whole:
            self._relayout()
        for mp in self.shards.params:
            if mp.full is not None:
                mp.full.requires_grad_(mp.trainable)

    def _relayout(self) -> None:
        self.reshard()
        self.start(self.shards.dtype, async_op=False, stream=None)  # the master values, not a low-precision copy
        self.finish()
        values = [cast(torch.Tensor, mp.full_data).clone() for mp in self.shards.params]
        self.reshard()
        self.shards.reinstall(values, are_full=True)
        logger.debug("re-laid out %s: %d elements sharded per rank", self.owner_name, self.shards.layout.segment_numel)

    # ------------------------------------------------------------------ copy.deepcopy
    def copy_for(self, memo: dict[int, Any]) -> UnitParams:
        """This unit for a ``copy.deepcopy`` of its modules: same mesh and groups, the copied parameters (adopted at
        the first gather), its own copy of the extensions (hooks may keep state, e.g. error feedback)."""
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(
                f"copy.deepcopy of a sharded module while its unit {self.owner_name} is {self.state.value}; "
                "call fc.reshard(module) first (units are resharded between training steps)"
            )
        new = object.__new__(UnitParams)
        new.__dict__.update(self.__dict__)
        new.shards = self.shards.copy_for(memo)
        new.extensions = copy.deepcopy(self.extensions, memo)
        new._reset_gather()
        new.compute_dtype = self.compute_dtype
        return new

    # ------------------------------------------------------------------ the gather
    def _to(self, new: UnitState) -> None:
        if new not in _ALLOWED[self.state]:
            raise transition_error(self.state, new, f"unit {self.owner_name}")
        self.state = new

    # ------------------------------------------------------------------ issue
    def start(self, dtype: torch.dtype, *, async_op: bool, stream: torch.Stream | None) -> None:
        """Issue the all-gather in ``dtype`` (no-op when already unsharded or gathering).

        ``stream``: a side stream for the copy-in and the collective's issue, so they overlap compute (None: the
        current stream; always None on a CPU device). The buffers are allocated on it; ``finish`` makes the compute
        stream wait for it and it wait for the copy-out. The caller (``ShardState.start_gather``) has resharded a
        group block kept in another dtype, picked up parameters replaced or cast (``ShardState.params_changed``) and
        ordered the stream after the compute stream's last writes of the shards.
        """
        with _plain_tensors():
            if self.state is UnitState.GROUP_SHARDED:
                block = self._group_block
                self._group_block = None
                if block is not None and block.dtype == dtype:
                    self._start_group_gather(block, async_op=async_op)
                    return
                block_dtype = None if block is None else block.dtype
                raise internal_error(f"unit {self.owner_name}", f"a group block in {block_dtype} gathered as {dtype}")
            if self.state is not UnitState.SHARDED:
                return
            if self.parked is not None:
                if self.parked == dtype and not self.is_stale():
                    self.parked = None
                    self.fulls.register(dtype)
                    self._to(UnitState.UNSHARDED)
                    return
                self._unpark()
            self.compute_dtype = dtype
            if not self.shards.uniform:
                self._start_plan(dtype, async_op=async_op)
                return
            transform = self.extensions.all_gather
            numel = self.shards.layout.segment_numel
            flat = self.shards.flat
            cast_in_place = transform is None and dtype != flat.dtype and self.world_size > 1 and numel > 0
            gathers = self.world_size > 1 and numel > 0
            if transform is not None:
                stream = None  # an extension's encode decides the collective's size: it runs on the compute stream
            with labelled(f"fsdp_compose::all_gather[{self.owner_name}]"), stream or contextlib.nullcontext():
                # Allocated on the side stream, which waits for the copy-out before the buffer goes (``finish``).
                gathered = torch.empty(self.world_size * numel, dtype=dtype, device=self.device) if gathers else None
                if cast_in_place:
                    # Cast straight into this rank's segment of the output and all-gather in place (the input is a view
                    # of the output): no separate low-precision copy of the shard lives next to the output while it
                    # runs. Offloaded, the shard crosses to the device in its own dtype first and is cast there.
                    if gathered is None:
                        raise internal_error(f"unit {self.owner_name}", "gathered is missing")
                    shard = gathered[self.rank * numel : (self.rank + 1) * numel]
                    shard.copy_(self.devices.to_compute(flat, flat.dtype))
                    work = all_gather_flat(gathered, shard, self.group, async_op=async_op)
                    pending = _PendingGather(work, gathered, shard, encoded=False)
                else:
                    # one rank: the copy-out casts (or, in the shards' dtype, the full parameters are the shards)
                    one_rank = not gathers and transform is None and not self.devices.offloaded
                    shard = flat if one_rank else self.devices.to_compute(flat, dtype)
                    if transform is not None and gathers:
                        shard = transform.encode(shard)
                        gathered = torch.empty(self.world_size * shard.numel(), dtype=shard.dtype, device=self.device)
                    if gathered is None:
                        pending = _PendingGather(None, shard, shard, encoded=False, collective=False)
                    else:
                        work = all_gather_flat(gathered, shard, self.group, async_op=async_op)
                        pending = _PendingGather(work, gathered, shard, encoded=transform is not None)
            if stream is not None:
                pending.issued, pending.stream = record_event(self.device, stream), stream
            self._pending_gather = pending
            self.issued += pending.collective
            self._to(UnitState.GATHERING)

    def _start_plan(self, dtype: torch.dtype, *, async_op: bool) -> None:
        """Several dtype groups or protocol parameters: one all-gather of all their inputs (see full_params.py).

        Runs on the compute stream: a pre-hook may communicate (float8's amax) and decides the collective's size.
        """
        inputs = [
            self.devices.to_compute(group.flat, self.fulls.compute_dtype_for(group.dtype, dtype))
            for group in self.shards.groups
        ]
        with labelled(f"fsdp_compose::all_gather[{self.owner_name}]"):
            for mp in self.shards.protocol:
                if mp.subclass is None:
                    raise internal_error(f"unit {self.owner_name}", "mp.subclass is missing")
                module = mp.owners[0][0]
                local = mp.sharded._local_tensor
                inputs.extend(mp.subclass.all_gather_inputs(local, shard_mesh(self.dp.mesh), module, self.hook_policy))
            plan = GatherPlan.copy_in(inputs, self.world_size, self.rank, self.device)
            work = None
            collective = self.world_size > 1 and plan.shard.numel() > 0
            if collective:
                work = all_gather_flat(plan.output, plan.shard, self.group, async_op=async_op)
        self._pending_gather = _PendingGather(
            work, plan.output, plan.shard, encoded=False, plan=plan, collective=collective
        )
        self.issued += collective
        self._to(UnitState.GATHERING)

    def _start_group_gather(self, block: torch.Tensor, *, async_op: bool) -> None:
        """All-gather the post-forward blocks within the group of k ranks: all ``W`` segments, in order."""
        if self.post_forward is None:
            raise internal_error(f"unit {self.owner_name}", "self.post_forward is missing")
        numel = self.world_size * self.shards.layout.segment_numel
        gathered = torch.empty(numel, dtype=block.dtype, device=block.device)
        work = None
        if numel > 0:  # a unit of kept-whole parameters only has nothing to gather
            with labelled(f"fsdp_compose::all_gather[{self.owner_name}]"):
                work = all_gather_flat(gathered, block.view(-1), self.post_forward.group, async_op=async_op)
        self._pending_gather = _PendingGather(work, gathered, block, encoded=False, collective=numel > 0)
        self.issued += numel > 0
        self._to(UnitState.GATHERING)

    @property
    def needs_gather(self) -> bool:
        """Nothing gathered yet (or parked, with the shards changed since), or only the post-forward group's segments
        (``reshard_after_forward=k``)."""
        if self.state is UnitState.SHARDED:
            return self.parked is None or self.is_stale()
        return self.state is UnitState.GROUP_SHARDED

    # ------------------------------------------------------------------ wait and copy out
    def arrived(self) -> bool:
        """GATHERING: has the all-gather completed (a check, not a wait)? True when there is nothing to wait for."""
        pending = self._pending_gather
        return pending is None or pending.work is None or pending.work.is_completed()

    def finish(self) -> None:
        """Wait for the all-gather, fill the full parameters and register them on the modules."""
        if self.state is not UnitState.GATHERING:
            return
        if self._pending_gather is None or self.compute_dtype is None:
            raise internal_error(f"unit {self.owner_name}", "self._pending_gather or self.compute_dtype is missing")
        pending, self._pending_gather = self._pending_gather, None
        try:
            with _plain_tensors():
                self._copy_out(pending, self.compute_dtype)
        except BaseException:
            self._forget_gather()
            raise
        self._to(UnitState.UNSHARDED)

    def _copy_out(self, pending: _PendingGather, dtype: torch.dtype) -> None:
        """Wait for the all-gather, fill the full parameters from its output and register them on the modules."""
        if pending.issued is not None:  # issued on the side stream
            wait_for(pending.issued, self.device)
        if pending.work is not None:
            with labelled(f"fsdp_compose::all_gather_wait[{self.owner_name}]"):
                pending.work.wait()
        with labelled(f"fsdp_compose::all_gather_copy_out[{self.owner_name}]"):
            if pending.plan is not None:
                self.fulls.copy_out_plan(pending.plan, dtype)
            elif not pending.collective and not pending.encoded and self.fulls.alias_shards(dtype):
                pass  # one rank, no cast: the full parameters are the shards themselves
            else:
                # the flat all-gather's output as ``(world_size, segment)`` rows (decoded by an extension)
                segment_numel = self.shards.layout.segment_numel
                transform = self.extensions.all_gather
                if pending.encoded and transform is not None:
                    decoded = transform.decode(pending.output.view(self.world_size, -1), dtype)
                    self.fulls.copy_out(decoded[:, :segment_numel], dtype)
                else:
                    self.fulls.copy_out(pending.output.view(self.world_size, segment_numel), dtype)
            if pending.collective and self.device.type == "cpu":
                # gloo's worker thread keeps its reference to a finished collective's tensors until it gets
                # around to dropping the work, after ``Work.wait`` has returned, so dropping ours would free the
                # buffer some time later, while the next unit may already be computing (a block-sized buffer
                # more at a step's peak, in some steps only): its storage is released now. On an accelerator the
                # compute stream's ordering rule frees it (collectives.py), which a resize would bypass.
                pending.output.untyped_storage().resize_(0)
            if pending.stream is not None:
                # The compute stream read buffers the side stream allocated: the side stream's next allocation
                # may reuse their blocks, so it waits for this copy-out first (no record_stream needed).
                copied_out = record_event(self.device)
                if copied_out is not None:
                    pending.stream.wait_event(copied_out)
            self.fulls.register(dtype)

    # ------------------------------------------------------------------ free
    def reshard(self) -> None:
        """Register the sharded parameters again and free the full parameters' storage (keeping the objects)."""
        if self.state is UnitState.GATHERING:
            self.finish()
        self.explicit = False
        self._unpark()
        if self.state is UnitState.GROUP_SHARDED:
            self._group_block = None
            self._to(UnitState.SHARDED)
        if self.state is UnitState.UNSHARDED:
            try:
                with _plain_tensors():
                    self.fulls.free()
            except BaseException:
                self._forget_gather()
                raise
            self._to(UnitState.SHARDED)

    def park(self) -> None:
        """After a forward no backward follows, for a unit set to keep its parameters: the sharded parameters on the
        modules again (``parameters()``, ``state_dict``, ``copy.deepcopy`` see a sharded unit), the full ones kept, so
        the next forward takes them back without an all-gather unless an in-place write changed the shards since
        (``start``; ``is_stale``). A unit with FSDP2-protocol parameters (their unsharded form is theirs) reshards."""
        if self.state is UnitState.GATHERING:
            self.finish()
        if self.state is not UnitState.UNSHARDED or self.shards.protocol or self.explicit:
            return
        self.fulls.unregister()
        self.parked = self.compute_dtype
        self._to(UnitState.SHARDED)

    def _unpark(self) -> None:
        if self.parked is not None:
            self.parked = None
            self.fulls.free_storage()

    def _forget_gather(self) -> None:
        """A copy-out or a free raised: the unit is sharded again and its full parameters forgotten (the next gather
        makes new ones: the old ones' storage may be what failed); the caller re-raises."""
        self.fulls.discard()
        self.parked = None
        self._to(UnitState.SHARDED)

    def reshard_to_group(self) -> None:
        """After forward with ``reshard_after_forward=k``: keep this rank's ``W/k`` segments, free the rest.

        The kept block is cut from the full parameters (already in the compute dtype), so backward all-gathers
        ``1/k`` of the unit per rank within the group instead of ``1/W`` over the whole shard group.
        """
        if self.post_forward is None:
            raise internal_error(f"unit {self.owner_name}", "reshard_after_forward=k sets the post-forward group")
        if not self.shards.uniform:
            raise NotImplementedError(
                f"reshard_after_forward={self.post_forward.size} on {self.owner_name}, whose parameters have several "
                "dtypes or use FSDP2's all-gather hooks; use True or False for this unit"
            )
        if self.state is UnitState.GATHERING:
            self.finish()
        if self.state is not UnitState.UNSHARDED:
            self.reshard()
            return
        per_member = self.world_size // self.post_forward.size
        first = self.post_forward.position * per_member
        if self.compute_dtype is None:
            raise internal_error(f"unit {self.owner_name}", "self.compute_dtype is missing")
        layout = self.shards.layout
        block = torch.zeros(per_member, layout.segment_numel, dtype=self.compute_dtype, device=self.device)
        for mp in self.shards.params:
            if mp.slot is not None and mp.full_data is not None:
                write_param_into_segments(mp.full_data, block, layout.slots[mp.slot], first)
        self.fulls.free()
        self._group_block = block
        self._to(UnitState.GROUP_SHARDED)


def _plain_tensors() -> contextlib.AbstractContextManager[object]:
    """What ``start``, ``finish`` and ``reshard`` run under (the class docstring): no torch.func transform, and, where
    inference mode is on, normal tensors made without autograd recording."""
    if not torch.is_inference_mode_enabled():
        return torch._C._DisableFuncTorch()
    stack = contextlib.ExitStack()
    for context in (torch._C._DisableFuncTorch(), torch.inference_mode(False), torch.no_grad()):
        stack.enter_context(context)
    return stack


def _added_hooks_check(unit: UnitParams) -> Callable[[list[tuple[str, torch.Tensor, int, bool]]], None]:
    """``fully_shard``'s checks on protocol parameters under ``unit``'s settings, for hooks attached to local shards
    since (``subclass_params.check_hooks_added``)."""
    return functools.partial(
        check_hooks_added,
        unit.owner_name,
        mesh=unit.dp.mesh,
        offloaded=unit.devices.offloaded,
        all_gather_extension=unit.extensions.all_gather is not None,
        group_reshard=unit.post_forward is not None,
    )
