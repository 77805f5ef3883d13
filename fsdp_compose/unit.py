"""A unit: the parameters of one ``fully_shard`` call and their flat shard buffer (gradients: see grads.py).

1. ``unshard``  — all-gather the flat shard segment of every rank, copy each parameter's rows out into its own full
   tensor, and register those full tensors on the owning modules (so the user's forward runs unchanged).
2. ``reshard``  — register the sharded DTensor parameters again and free the full tensors' storage. The storage
   object is kept and resized to zero, so tensors autograd saved still alias it and see the data again after the next
   all-gather refills it.

Parameters are *sharded* (``Shard(0)``, rows in ``flat``) or *kept whole* on every rank (``Replicate()``, never
communicated): 0-dim parameters, and frozen ones under ``frozen_params="replicate"``.

The sharded parameters' local tensors are views into ``flat``, so the all-gather reads them with no copy-in and the
optimizer's in-place updates land in the buffer directly. Anything that breaks those views (``to_empty``,
``load_state_dict(assign=True)``, ``copy.deepcopy``) is detected by identity and repaired by ``adopt`` before the next
all-gather, keeping the ``nn.Parameter`` objects the optimizer holds. Under ``CPUOffloadPolicy`` ``flat`` lives in
host memory and the all-gather reads a device copy of it instead (offload.py holds every host <-> device transfer).
"""

from __future__ import annotations

import copy
import enum
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from .collectives import Work, all_gather_flat
from .extensions import ShardExtensions
from .grads import UnitGradients
from .meshes import DataParallelMesh, ParamPlacing, PostForwardGroup
from .offload import UnitDevices
from .policies import OffloadPolicy
from .sharding import FlatLayout, copy_param_from_segments, local_rows, write_param_into_segments

logger = logging.getLogger(__name__)

__all__ = ["ManagedParam", "ShardedUnit", "UnitState"]

# Attribute set on every sharded parameter so a later fully_shard on a submodule can tell that an enclosing call
# already owns it. It lives on the parameter instance (not in a registry) and names the owner for error messages.
OWNER_ATTR = "_fsdp_compose_owner"
# Attribute set on the user's original parameter once a unit replaced it, so that a later fully_shard on a module that
# still uses it (a tie) can tell; it names the unit that took it.
MOVED_ATTR = "_fsdp_compose_moved_to"


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # an all-gather is in flight
    UNSHARDED = "unsharded"
    # After forward with reshard_after_forward=k: sharded parameters registered, plus 1/k of the gathered buffer kept
    # so that backward re-gathers within a group of k ranks (e.g. one node) instead of the whole shard group.
    GROUP_SHARDED = "group_sharded"


@dataclass
class ManagedParam:
    """One parameter of a unit. ``owners`` lists every (module, attribute) holding it (ties inside the unit)."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    placing: ParamPlacing
    sharded: DTensor  # an nn.Parameter holding a DTensor
    slot: int | None  # index into the unit's FlatLayout; None: kept whole on every rank
    trainable: bool  # requires_grad as of the last trainability refresh
    original: weakref.ref[nn.Parameter] | None = None  # the user's parameter this one replaced (for ties)
    local: torch.Tensor | None = None  # the view into ``flat`` that ``sharded`` must hold; None: needs adopting
    full: nn.Parameter | None = None  # the unsharded parameter used by forward/backward
    full_data: torch.Tensor | None = None  # ``full.data``: writes through it do not bump ``full``'s version
    gathered_version: int = field(default=-1)  # sharded._version when ``full`` was last filled
    full_hooked: bool = False  # ``full`` carries the post-accumulate-grad hook that moves its gradients

    def register(self, tensor: torch.Tensor) -> None:
        for module, name in self.owners:
            module._parameters[name] = tensor  # type: ignore[assignment]


def _make_sharded_param(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: torch.Size,
    stride: tuple[int, ...],
    requires_grad: bool,
) -> DTensor:
    dtensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    param = nn.Parameter(dtensor, requires_grad=requires_grad)
    _install_copier(param)
    return cast(DTensor, param)


def _install_copier(param: torch.Tensor) -> None:
    # ``copy.deepcopy`` looks ``__deepcopy__`` up on the instance first. torch's Tensor.__deepcopy__ takes a DTensor
    # whose local tensor is a view at a non-zero offset (ours: a slice of the flat buffer) for a plain tensor with
    # storage and fails, so each sharded parameter carries its own copier. It also keeps the mesh shared.
    param.__dict__["__deepcopy__"] = _ShardedParamCopier(param)


class _ShardedParamCopier:
    """``copy.deepcopy`` of one sharded parameter: a DTensor parameter over a clone of its local shard (and grad)."""

    def __init__(self, param: torch.Tensor) -> None:
        # A strong reference (a cycle the GC collects): a weakref would make torch.utils.swap_tensors, which
        # Module.to_empty uses on DTensor parameters, refuse the parameter.
        self._param = param

    def __call__(self, memo: dict[int, Any]) -> DTensor:
        param = self._param
        assert isinstance(param, DTensor)
        new = _make_sharded_param(
            param._local_tensor.detach().clone(),
            param.device_mesh,
            tuple(param.placements),
            param.shape,
            tuple(param.stride()),
            param.requires_grad,
        )
        memo[id(param)] = new
        grad = param.grad
        if isinstance(grad, DTensor):
            new.grad = DTensor.from_local(
                grad._local_tensor.clone(),
                grad.device_mesh,
                grad.placements,
                run_check=False,
                shape=grad.shape,
                stride=grad.stride(),
            )
        owner = getattr(param, OWNER_ATTR, None)
        if owner is not None:
            setattr(new, OWNER_ATTR, owner)
        return new


def _make_full_param(
    local: torch.Tensor, placing: ParamPlacing, requires_grad: bool
) -> tuple[nn.Parameter, torch.Tensor]:
    """The parameter forward/backward use, and the tensor the all-gather writes into.

    A plain parameter, or for a TP parameter a DTensor with its TP placements (TP modules expect DTensor weights).
    Writes go through ``.data`` of the local tensor, which has its own version counter, so refilling the storage
    after a reshard does not trip autograd's check on tensors saved in forward.
    """
    if placing.tp_mesh is None:
        full = nn.Parameter(local, requires_grad=requires_grad)
        return full, full.data
    dtensor = DTensor.from_local(
        local,
        placing.tp_mesh,
        placing.tp_placements,
        run_check=False,
        shape=placing.global_shape,
        stride=placing.global_stride,
    )
    full = nn.Parameter(dtensor, requires_grad=requires_grad)
    return full, cast(DTensor, full)._local_tensor.data


@dataclass
class _PendingGather:
    """An all-gather in flight. It holds its input too: an asynchronous collective reads it until the wait."""

    work: Work | None
    output: torch.Tensor
    input: torch.Tensor
    encoded: bool  # the output needs the all-gather extension's decode


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
    """Parameters of one ``fully_shard`` call on a 1-D mesh, sharded on dim 0 into one flat buffer."""

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
        # The flat layout, the all-gather and the reduce-scatter run over the shard group.
        self.group: dist.ProcessGroup = self.dp.shard_group
        self.rank = self.dp.shard_rank
        self.world_size = self.dp.shard_size
        self.device = device  # where it computes: the mesh's device
        self.devices = UnitDevices.of(offload_policy or OffloadPolicy(), device)
        self.owner_name = owner_name
        self.frozen_params = frozen_params
        self.state = UnitState.SHARDED
        self._pending_gather: _PendingGather | None = None
        self.post_forward: PostForwardGroup | None = None  # set by reshard_after_forward=k (1 < k < world size)
        self._group_block: torch.Tensor | None = None  # GROUP_SHARDED: this rank's W/k segments of the gathered buffer
        dtypes = [p.dtype for _, p, _ in params if p.ndim > 0] or [p.dtype for _, p, _ in params] or [torch.float32]
        self.orig_dtype: torch.dtype = dtypes[0]
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        trainable = [p.requires_grad for _, p, _ in params]
        whole = [self._kept_whole(len(pl.global_shape), t) for pl, t in zip(placings, trainable, strict=True)]
        values = [(p.to_local() if isinstance(p, DTensor) else p).detach() for _, p, _ in params]
        news, slots = self._build_flat(placings, values, whole, trainable, are_full=True)
        self.params = [
            ManagedParam(fqn, owners, placing, new, slot, trainable=p.requires_grad, original=weakref.ref(p))
            for (fqn, p, owners), placing, new, slot in zip(params, placings, news, slots, strict=True)
        ]
        for mp in self.params:
            self._installed(mp)
        for _, p, _ in params:
            setattr(p, MOVED_ATTR, owner_name)
        self.grads = UnitGradients(self)

    # ------------------------------------------------------------------ building the flat buffer
    def _kept_whole(self, ndim: int, trainable: bool) -> bool:
        return ndim == 0 or (self.frozen_params == "replicate" and not trainable)

    def _build_flat(
        self,
        placings: list[ParamPlacing],
        values: list[torch.Tensor],
        whole: list[bool],
        requires_grad: list[bool],
        *,
        are_full: bool,
    ) -> tuple[list[DTensor], list[int | None]]:
        """A new ``flat`` holding the sharded parameters' rows; new DTensor parameters over it (and whole ones).

        ``values`` are the tensors FSDP shards (the TP-local tensor of a TP parameter) in full (``are_full``), or
        this rank's shards of them.
        """
        sharded = [i for i, w in enumerate(whole) if not w]
        self.layout = FlatLayout.build([placings[i].local_shape for i in sharded], self.world_size)
        on_meta = any(v.is_meta for v in values)
        self.flat = self.devices.new_flat(self.layout.segment_numel, self.orig_dtype, meta=on_meta)
        slots: list[int | None] = [None] * len(values)
        for position, i in enumerate(sharded):
            slots[i] = position
        news = []
        for i, value in enumerate(values):
            slot = slots[i]
            placing = placings[i]
            if slot is None:
                local = self.devices.place(value, meta=on_meta)
            else:
                local = self.layout.shard_view(self.flat, slot, self.rank)
                with torch.no_grad():
                    local.copy_(local_rows(value, self.rank, self.world_size) if are_full else value)
            placements = (
                *self.dp.placements(whole=slot is None, split_factor=placing.split_factor),
                *placing.tp_placements,
            )
            news.append(
                _make_sharded_param(
                    local,
                    placing.spmd_mesh,
                    placements,
                    placing.global_shape,
                    placing.global_stride,
                    requires_grad[i],
                )
            )
        return news, slots

    def _installed(self, mp: ManagedParam) -> None:
        setattr(mp.sharded, OWNER_ATTR, self.owner_name)
        mp.local = mp.sharded._local_tensor
        mp.full = mp.full_data = None
        mp.register(mp.sharded)

    def _reinstall(self, values: list[torch.Tensor], *, are_full: bool) -> None:
        """Rebuild ``flat`` from ``values`` and swap the new DTensors into the existing parameter objects.

        ``torch.utils.swap_tensors`` keeps the ``nn.Parameter`` objects optimizers hold. A gradient survives when the
        parameter keeps its placement; one whose placement changes (sharded <-> whole) is dropped.
        """
        whole = [self._kept_whole(len(mp.sharded.shape), mp.trainable) for mp in self.params]
        news, slots = self._build_flat(
            [mp.placing for mp in self.params],
            values,
            whole,
            [mp.sharded.requires_grad for mp in self.params],
            are_full=are_full,
        )
        for mp, new, slot in zip(self.params, news, slots, strict=True):
            grad = mp.sharded.grad if (slot is None) == (mp.slot is None) else None
            torch.utils.swap_tensors(mp.sharded, new)
            _install_copier(mp.sharded)  # the swap moved the copier that pointed at ``new``
            mp.sharded.grad = grad
            mp.slot = slot
            self._installed(mp)

    # ------------------------------------------------------------------ keeping the views intact
    def views_intact(self) -> bool:
        """Cheap per-step check (identity only) that every parameter is still ours and still a view into ``flat``."""
        for mp in self.params:
            module, name = mp.owners[0]
            current: object = module._parameters.get(name)
            if current is not mp.sharded or mp.sharded._local_tensor is not mp.local:
                return False
        return True

    def check_materialized(self) -> None:
        """Raise before any collective if a parameter is still on the meta device."""
        for mp in self.params:
            module, name = mp.owners[0]
            current = module._parameters.get(name)
            if current is not None and current.is_meta:
                raise RuntimeError(
                    f"parameter '{mp.fqn}' of the unit rooted at {self.owner_name} is still on the meta device at "
                    "its first forward; materialize it first: module.to_empty(device=...) and then initialize "
                    "(e.g. reset_parameters()) before calling the model"
                )

    def adopt(self) -> None:
        """Make every parameter a view into a fresh ``flat`` again, keeping the ``nn.Parameter`` objects.

        Picks up a parameter object the user registered in place of ours (it must be a DTensor of the same global
        shape) and copies every current local shard into a new flat buffer (after ``to_empty``,
        ``load_state_dict(assign=True)`` or ``copy.deepcopy``).
        """
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(f"internal: adopt() on {self.owner_name} while {self.state.value}")
        self.check_materialized()
        for mp in self.params:
            module, name = mp.owners[0]
            current: object = module._parameters.get(name)
            if current is not mp.sharded:
                if not isinstance(current, DTensor) or current.shape != mp.sharded.shape:
                    raise ValueError(
                        f"parameter '{mp.fqn}' of the unit rooted at {self.owner_name} was replaced by "
                        f"{type(current).__name__} of shape {tuple(getattr(current, 'shape', ()))}; a sharded "
                        "module needs DTensor parameters of the same global shape (use load_state_dict without "
                        "assign=True, or fc.load_full_state_dict)"
                    )
                mp.sharded = current
                mp.register(current)
        self._reinstall([mp.sharded._local_tensor for mp in self.params], are_full=False)
        logger.debug("re-adopted %d parameters of %s into a new flat buffer", len(self.params), self.owner_name)

    def copy_for(self, memo: dict[int, Any]) -> ShardedUnit:
        """This unit for a ``copy.deepcopy`` of its modules: same mesh, the copied parameters, adopted lazily.

        The copied parameters are clones (not views into a flat buffer), so the new unit marks them for ``adopt``.
        """
        new = object.__new__(ShardedUnit)
        new.__dict__.update(self.__dict__)
        new.params = [
            ManagedParam(
                mp.fqn,
                [(copy.deepcopy(module, memo), name) for module, name in mp.owners],
                mp.placing,
                copy.deepcopy(mp.sharded, memo),
                mp.slot,
                trainable=mp.trainable,
            )
            for mp in self.params
        ]
        new.flat = torch.zeros(0, dtype=self.orig_dtype, device="meta")
        new.state = UnitState.SHARDED
        new._pending_gather = None
        new._group_block = None
        new.grads = UnitGradients(new)
        new.grads.divide_factor = self.grads.divide_factor
        return new

    # ------------------------------------------------------------------ trainability
    def trainability_changed(self) -> bool:
        return any(mp.sharded.requires_grad != mp.trainable for mp in self.params)

    def refresh_trainable(self) -> bool:
        """Catch up with ``requires_grad`` changes: which parameters get full gradients and are reduced, and (under
        ``frozen_params="replicate"``) which are kept whole. Returns whether anything changed.

        Moving a parameter between sharded and whole re-lays out the unit, which all-gathers it once in its
        original dtype: every rank must make the same change (as with any change to the model).
        """
        if not self.trainability_changed():
            return False
        if self.grads.has_pending():
            self.grads.refresh()  # raises: gradients from no-sync micro-batches would be lost
        old_whole = [mp.slot is None for mp in self.params]
        for mp in self.params:
            mp.trainable = mp.sharded.requires_grad
        new_whole = [self._kept_whole(len(mp.sharded.shape), mp.trainable) for mp in self.params]
        if new_whole != old_whole:
            self._relayout()
        for mp in self.params:
            if mp.full is not None:
                mp.full.requires_grad_(mp.trainable)
                self._hook_full(mp)
        self.grads.refresh()
        return True

    def _hook_full(self, mp: ManagedParam) -> None:
        """Once per full parameter that requires grad: hand each gradient to ``grads.capture`` as it is made."""
        if mp.full is not None and mp.full.requires_grad and not mp.full_hooked:
            mp.full.register_post_accumulate_grad_hook(_CaptureGrad(self, mp))
            mp.full_hooked = True

    def _relayout(self) -> None:
        compute_dtype = self.param_dtype
        self.reshard()
        self.param_dtype = self.orig_dtype  # gather the master values, not a low-precision copy
        try:
            self.unshard()
            values = [cast(torch.Tensor, mp.full_data).clone() for mp in self.params]
            self.reshard()
        finally:
            self.param_dtype = compute_dtype
        self._reinstall(values, are_full=True)
        logger.debug("re-laid out %s: %d parameters kept whole", self.owner_name, self.layout.segment_numel)

    def release(self, original: nn.Parameter) -> list[tuple[nn.Module, str]]:
        """Stop managing the parameter that replaced ``original`` (it moves to an enclosing unit: a tie).

        Returns the (module, attribute) pairs that held it; the caller registers its own parameter there.
        """
        if self.state is not UnitState.SHARDED or self.grads.has_pending():
            raise RuntimeError(f"cannot move a tied parameter out of {self.owner_name} while it is in use")
        index = next(i for i, mp in enumerate(self.params) if mp.original is not None and mp.original() is original)
        released = self.params.pop(index)
        self._reinstall([mp.sharded._local_tensor for mp in self.params], are_full=False)
        self.grads.refresh()
        return released.owners

    # ------------------------------------------------------------------ unshard / reshard
    @property
    def shard_device(self) -> torch.device:
        """Where the sharded parameters and their gradients live (the compute device unless offloaded)."""
        return self.devices.shard

    @property
    def is_unsharded(self) -> bool:
        return self.state is UnitState.UNSHARDED

    def is_stale(self) -> bool:
        """True when unsharded but a sharded parameter changed since (e.g. an optimizer step in between)."""
        return any(mp.sharded._version != mp.gathered_version for mp in self.params)

    @property
    def needs_gather(self) -> bool:
        return self.state is UnitState.SHARDED or self.state is UnitState.GROUP_SHARDED

    def start_unshard(self, *, async_op: bool) -> None:
        """Issue the all-gather (no-op when already unsharded or gathering)."""
        if self.state is UnitState.GROUP_SHARDED:
            block = self._group_block
            self._group_block = None
            if block is not None and block.dtype == self.param_dtype:
                self._start_group_gather(block, async_op=async_op)
                return
            self.state = UnitState.SHARDED  # gathered in another precision since: gather from the shards
        if self.state is not UnitState.SHARDED:
            return
        if not self.views_intact():
            self.adopt()
        transform = self.extensions.all_gather
        numel = self.layout.segment_numel
        if transform is None and self.param_dtype != self.orig_dtype and self.world_size > 1 and numel > 0:
            # Cast straight into this rank's segment of the output and all-gather in place (the input is a view of
            # the output): no separate low-precision copy of the shard lives next to the output while it runs.
            gathered = torch.empty(self.world_size * numel, dtype=self.param_dtype, device=self.device)
            shard = gathered[self.rank * numel : (self.rank + 1) * numel]
            self.devices.copy_to_compute(shard, self.flat)
            work = all_gather_flat(gathered, shard, self.group, async_op=async_op)
            self._pending_gather = _PendingGather(work, gathered, shard, encoded=False)
            self.state = UnitState.GATHERING
            return
        shard = self.devices.to_compute(self.flat, self.param_dtype)
        if transform is not None:
            shard = transform.encode(shard)
        if self.world_size == 1 or numel == 0:
            self._pending_gather = _PendingGather(None, shard, shard, encoded=transform is not None)
        else:
            gathered = torch.empty(self.world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
            work = all_gather_flat(gathered, shard, self.group, async_op=async_op)
            self._pending_gather = _PendingGather(work, gathered, shard, encoded=transform is not None)
        self.state = UnitState.GATHERING

    def _start_group_gather(self, block: torch.Tensor, *, async_op: bool) -> None:
        """All-gather the post-forward blocks within the group of k ranks: all ``W`` segments, in order."""
        assert self.post_forward is not None
        gathered = torch.empty(self.world_size * self.layout.segment_numel, dtype=block.dtype, device=block.device)
        work = all_gather_flat(gathered, block.view(-1), self.post_forward.group, async_op=async_op)
        self._pending_gather = _PendingGather(work, gathered, block, encoded=False)
        self.state = UnitState.GATHERING

    def finish_unshard(self) -> None:
        """Wait for the all-gather, fill the full parameters and register them on the modules."""
        if self.state is not UnitState.GATHERING:
            return
        assert self._pending_gather is not None
        pending, self._pending_gather = self._pending_gather, None
        if pending.work is not None:
            pending.work.wait()
        gathered = pending.output
        transform = self.extensions.all_gather
        if pending.encoded and transform is not None:
            segments = transform.decode(gathered.view(self.world_size, -1), self.param_dtype)
            segments = segments[:, : self.layout.segment_numel]
        else:
            segments = gathered.view(self.world_size, self.layout.segment_numel)
        for mp in self.params:
            full_data = self._ensure_full(mp)
            if mp.slot is not None:
                copy_param_from_segments(full_data, segments, self.layout.slots[mp.slot])
            elif full_data.data_ptr() != mp.sharded._local_tensor.data_ptr():
                self.devices.copy_to_compute(full_data, mp.sharded._local_tensor)
            mp.gathered_version = mp.sharded._version
            assert mp.full is not None
            mp.register(mp.full)
        self.state = UnitState.UNSHARDED

    def unshard(self) -> None:
        self.start_unshard(async_op=False)
        self.finish_unshard()

    def _ensure_full(self, mp: ManagedParam) -> torch.Tensor:
        """The full parameter's ``.data`` with storage allocated (created on first use, resized back after)."""
        if mp.full is None or mp.full.dtype != self.param_dtype:
            if mp.slot is None and self.param_dtype == self.orig_dtype and not self.devices.offloaded:
                local = mp.sharded._local_tensor  # whole: the full parameter aliases it, no copy
            else:
                local = torch.empty(mp.placing.local_shape, dtype=self.param_dtype, device=self.device)
            mp.full, mp.full_data = _make_full_param(local, mp.placing, mp.trainable)
            mp.full_hooked = False
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
        if self.state is UnitState.GROUP_SHARDED:
            self._group_block = None
            self.state = UnitState.SHARDED
        if self.state is UnitState.SHARDED:
            return
        for mp in self.params:
            mp.register(mp.sharded)
            full_data = mp.full_data
            if full_data is not None and full_data.untyped_storage().data_ptr() != mp.sharded._local_tensor.data_ptr():
                full_data.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

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
        block = torch.zeros(per_member, self.layout.segment_numel, dtype=self.param_dtype, device=self.device)
        for mp in self.params:
            if mp.slot is not None and mp.full_data is not None:
                write_param_into_segments(mp.full_data, block, self.layout.slots[mp.slot], first)
        self.reshard()
        self._group_block = block
        self.state = UnitState.GROUP_SHARDED

    # ------------------------------------------------------------------ gradients (see grads.py)
    def has_pending_full_grads(self) -> bool:
        return any(mp.full is not None and mp.full.grad is not None for mp in self.params)

    def has_accumulated_grads(self) -> bool:
        return self.grads.accumulated is not None
