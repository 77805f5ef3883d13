"""A unit's parameters: the sharded storage, the gather, the full parameters; one ``fully_shard`` call's worth.

A unit is two objects, both held by its ``ShardState`` (state.py): its parameters (``UnitParams``, here) and its
gradients (grads.py ``UnitGradients``: the reduce-scatter input and the delivery to ``.grad``). The parameters are
made of three parts, each in its own file, which know nothing of each other's insides:

- the flat shard buffer(s) and the DTensor parameters viewing them (flat.py ``FlatShard``);
- the gather state machine (gathering.py ``UnitGather``: all-gather, wait, reshard), which owns the full parameters
  the gathered bytes land in (full_params.py ``FullParams``).

What stays here is what concerns the parameters as a whole: which dtypes the unit computes and reduces in (the
``ReduceSpec`` its gradient side is built from); catching up with parameters the user replaced, cast or (un)froze
since the last step (each may re-lay out the shards); moving a tied parameter out to an enclosing unit; and
``copy.deepcopy``. What a change means for the gradients (a rebuild in another dtype, a new layout) the state does,
which owns both. The engine (hooks.py, step.py, backward.py) calls the parts directly: ``params.gather`` (start, wait,
reshard, state) and ``params.shards`` (parameters, layout). Nothing here runs in a step that changes nothing: the
step's start and every gather from the shards ask ``ShardState.params_changed`` (one identity pass) and come here
only for a change.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .extensions import ShardExtensions
from .flat import FlatShard, ManagedParam
from .full_params import FullParams
from .gathering import UnitGather, UnitState
from .grads import ReduceSpec
from .meshes import DataParallelMesh, ParamPlacing, reduce_scatter_group
from .offload import UnitDevices
from .policies import OffloadPolicy
from .subclass_params import check_hooks_added

logger = logging.getLogger(__name__)

__all__ = ["UnitParams"]


class UnitParams:
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
        self.reduce_group = reduce_scatter_group(self.dp)
        self.world_size = self.dp.shard_size
        self.device = device  # where it computes: the mesh's device
        self.devices = UnitDevices.of(offload_policy or OffloadPolicy(), device)
        self.owner_name = owner_name
        self.policy_param_dtype = param_dtype  # None: the parameters' own dtype
        self.policy_reduce_dtype = reduce_dtype  # None: the compute dtype
        self.shards = FlatShard(params, placings, self.dp, self.devices, owner_name, frozen_params)
        # What a protocol parameter's hooks receive (torch's policy class); fully_shard sets the whole policy
        self._attach_gather(torch_fsdp.MixedPrecisionPolicy(param_dtype, reduce_dtype))

    def _attach_gather(self, hook_policy: torch_fsdp.MixedPrecisionPolicy) -> None:
        """A fresh gather state machine (SHARDED) and full parameters over this unit's shards."""
        fulls = FullParams(self.shards, self.devices, self.world_size, self.policy_param_dtype)
        self.gather = UnitGather(
            self.shards, fulls, self.dp, self.devices, self.extensions, self.owner_name, hook_policy
        )

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
            f"{compute.replace('torch.', '')}, state={self.gather.state.value})"
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

    # ------------------------------------------------------------------ the gather (gathering.py)
    def unshard(self, dtype: torch.dtype) -> None:
        self.adopt_if_changed()
        self.gather.start(dtype, async_op=False, stream=None)
        self.gather.finish()

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
        if self.gather.state is not UnitState.SHARDED:
            return
        if self.shards.defer_hookless:  # FSDP2's all-gather hooks: read again before the first gather (torch too)
            self.shards.read_hooks(_added_hooks_check(self))
        if not self.shards.views_intact():
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
                self.gather.fulls.hook(mp)

    def _relayout(self) -> None:
        self.gather.reshard()
        self.unshard(self.shards.dtype)  # gather the master values, not a low-precision copy
        values = [cast(torch.Tensor, mp.full_data).clone() for mp in self.shards.params]
        self.gather.reshard()
        self.shards.reinstall(values, are_full=True)
        logger.debug("re-laid out %s: %d elements sharded per rank", self.owner_name, self.shards.layout.segment_numel)

    # ------------------------------------------------------------------ copy.deepcopy
    def copy_for(self, memo: dict[int, Any]) -> UnitParams:
        """This unit for a ``copy.deepcopy`` of its modules: same mesh and groups, the copied parameters (adopted at
        the first gather), its own copy of the extensions (hooks may keep state, e.g. error feedback)."""
        if self.gather.state is not UnitState.SHARDED:
            raise RuntimeError(
                f"copy.deepcopy of a sharded module while its unit {self.owner_name} is {self.gather.state.value}; "
                "call fc.reshard(module) first (units are resharded between training steps)"
            )
        new = object.__new__(UnitParams)
        new.__dict__.update(self.__dict__)
        new.shards = self.shards.copy_for(memo)
        new.extensions = copy.deepcopy(self.extensions, memo)
        new._attach_gather(self.gather.hook_policy)  # SHARDED, nothing in flight, no full parameters yet
        new.gather.post_forward, new.gather.compute_dtype = self.gather.post_forward, self.gather.compute_dtype
        return new


def _added_hooks_check(unit: UnitParams) -> Callable[[list[tuple[str, torch.Tensor, int, bool]]], None]:
    """``fully_shard``'s checks on protocol parameters under ``unit``'s settings, for hooks attached to local shards
    since (``subclass_params.check_hooks_added``)."""
    return functools.partial(
        check_hooks_added,
        unit.owner_name,
        mesh=unit.dp.mesh,
        offloaded=unit.devices.offloaded,
        all_gather_extension=unit.extensions.all_gather is not None,
        group_reshard=unit.gather.post_forward is not None,
    )
