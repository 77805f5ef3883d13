"""A unit's parameters as this rank's shards: one flat buffer, and DTensor parameters that are views into it.

Parameters are *sharded* (``Shard(0)``, or the dim ``shard_placement_fn`` chose; rows in ``flat``) or *kept whole*
on every rank (``Replicate()``, never communicated): 0-dim parameters, and frozen ones under
``frozen_params="replicate"``.

The sharded parameters' local tensors are views into ``flat``, so the all-gather reads them with no copy-in and the
optimizer's in-place updates land in the buffer directly. Anything that breaks those views (``to_empty``,
``load_state_dict(assign=True)``, ``copy.deepcopy``, ``model.to(dtype)``) is detected by identity and repaired by
``adopt`` before the next all-gather, keeping the ``nn.Parameter`` objects the optimizer holds (and taking the new
dtype, if the module was cast). Under ``CPUOffloadPolicy`` ``flat`` lives in host memory (see offload.py).

Nothing here communicates: the gather side is unit.py, the gradient side grads.py.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .meshes import DataParallelMesh, ParamPlacing
from .offload import UnitDevices
from .replaced import ReplacedParams
from .sharding import FlatLayout, local_rows
from .subclass_params import SubclassShard, carry_instance_hooks, has_fsdp_hooks, is_tensor_subclass, shard_subclass

logger = logging.getLogger(__name__)

__all__ = [
    "MOVED_ATTR",
    "OWNER_ATTR",
    "FlatShard",
    "ManagedParam",
    "ShardGroup",
    "make_full_param",
]

# Attribute set on every sharded parameter so a later fully_shard on a submodule can tell that an enclosing call
# already owns it. It lives on the parameter instance (not in a registry) and names the owner for error messages.
OWNER_ATTR = "_fsdp_compose_owner"
# Attribute set on the user's original parameter once a unit replaced it, so that a later fully_shard on a module that
# still uses it (a tie) can tell; it names the unit that took it.
MOVED_ATTR = "_fsdp_compose_moved_to"


@dataclass
class ManagedParam:
    """One parameter of a unit. ``owners`` lists every (module, attribute) holding it (ties inside the unit)."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    placing: ParamPlacing
    sharded: DTensor  # an nn.Parameter holding a DTensor
    slot: int | None  # index into its dtype group's FlatLayout (or the protocol list); None: kept whole
    trainable: bool  # requires_grad as of the last trainability refresh
    original: weakref.ref[nn.Parameter] | None = None  # the user's parameter this one replaced (for ties)
    local: torch.Tensor | None = None  # the view into ``flat`` that ``sharded`` must hold; None: needs adopting
    full: nn.Parameter | None = None  # the unsharded parameter used by forward/backward
    full_data: torch.Tensor | None = None  # ``full.data``: writes through it do not bump ``full``'s version
    gathered_version: int = field(default=-1)  # sharded._version when ``full`` was last filled
    # A kept-whole parameter's full tensors of other compute dtypes (dtype -> full, full_data): an eval
    # forward in full precision between a bf16 forward and its backward must not replace the tensor autograd saved.
    other_fulls: dict[torch.dtype, tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=dict)
    group: int | None = None  # index into ``FlatShard.groups`` of a plain sharded parameter
    subclass: SubclassShard | None = None  # a parameter using FSDP2's all-gather hooks (subclass_params.py)

    def use_full_of(self, dtype: torch.dtype) -> None:
        """Keep the current full tensor (autograd may hold it) under its dtype and take the one of ``dtype``, or none
        yet (a kept-whole parameter's; a sharded slot's live in its dtype's ``FullBuffer``)."""
        if self.full is not None and self.full.dtype != dtype:
            self.other_fulls[self.full.dtype] = (self.full, self.full_data)
            cached = self.other_fulls.pop(dtype, None)
            if cached is not None:
                self.full, self.full_data = cached
            else:
                self.full = None

    def register(self, tensor: torch.Tensor) -> None:
        for module, name in self.owners:
            module._parameters[name] = tensor  # type: ignore[assignment]

    def registered(self) -> object:
        """The parameter the owning module holds right now (``sharded``, ``full``, or one the user put there)."""
        module, name = self.owners[0]
        return module._parameters.get(name)


@dataclass
class ShardGroup:
    """The sharded plain parameters of one dtype: their flat layout and this rank's flat buffer.

    A unit has one group per dtype of its sharded plain parameters (usually one). ``members[slot]`` is the position in
    ``FlatShard.params`` of the parameter in the layout's slot ``slot``.
    """

    dtype: torch.dtype
    layout: FlatLayout
    flat: torch.Tensor
    members: list[int]


def _make_sharded_param(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: torch.Size,
    stride: tuple[int, ...],
    requires_grad: bool,
) -> DTensor:
    param = nn.Parameter(sharded_dtensor(local, mesh, placements, shape, stride), requires_grad=requires_grad)
    install_copier(param)
    return cast(DTensor, param)


def sharded_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: torch.Size,
    stride: Sequence[int],
) -> DTensor:
    """A DTensor over ``local`` itself, where it lies: a sharded parameter or gradient.

    Not ``DTensor.from_local``: it moves a local tensor to the mesh's device type, so an offloaded shard (host
    memory, accelerator mesh) would silently become a device copy, detached from the unit's flat buffer; and it runs
    a tensor subclass (the FSDP2 all-gather protocol) through autograd views.
    """
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def install_copier(param: torch.Tensor) -> None:
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
            new.grad = sharded_dtensor(
                grad._local_tensor.clone(), grad.device_mesh, grad.placements, grad.shape, grad.stride()
            )
        owner = getattr(param, OWNER_ATTR, None)
        if owner is not None:
            setattr(new, OWNER_ATTR, owner)
        return new


class FlatShard:
    """This rank's shards of one unit's parameters: the layout, the flat buffer and the DTensor parameters."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        placings: list[ParamPlacing],
        dp: DataParallelMesh,
        devices: UnitDevices,
        owner_name: str,
        frozen_params: str,
    ) -> None:
        self.dp = dp
        self.rank = dp.shard_rank
        self.world_size = dp.shard_size
        self.devices = devices
        self.owner_name = owner_name
        self.frozen_params = frozen_params
        # True until ``read_hooks`` reads FSDP2's all-gather hooks again, before the unit's first gather: until then
        # a tensor subclass without them is sharded its own way, as a protocol parameter (hooks may be attached to
        # its local shard until then, as torch's fully_shard allows).
        self.defer_hookless = True
        # The parameters' own dtype (the first sharded plain parameter's; a unit may hold several, see ``groups``):
        # sharded parameters, their gradients and the optimizer state stay in their own dtypes.
        self.dtype: torch.dtype = _primary_dtype([p for _, p, _ in params])
        trainable = [p.requires_grad for _, p, _ in params]
        whole = [
            self.kept_whole(len(pl.global_shape), t, has_fsdp_hooks(p))
            for pl, t, (_, p, _) in zip(placings, trainable, params, strict=True)
        ]
        values = [(p.to_local() if isinstance(p, DTensor) else p).detach() for _, p, _ in params]
        news, slots, storage = self._build(placings, values, whole, trainable, are_full=True)
        self.params = [
            ManagedParam(fqn, owners, placing, new, slot, trainable=p.requires_grad, original=weakref.ref(p))
            for (fqn, p, owners), placing, new, slot in zip(params, placings, news, slots, strict=True)
        ]
        for mp, (group, subclass) in zip(self.params, storage, strict=True):
            mp.group, mp.subclass = group, subclass
            self._installed(mp)
        self._classify()
        for _, p, _ in params:
            setattr(p, MOVED_ATTR, owner_name)
        originals = [(mp.fqn, mp.original) for mp in self.params if mp.original is not None]
        self.replaced = ReplacedParams(owner_name, originals)

    def uses_protocol(self, value: torch.Tensor) -> bool:
        """Is ``value`` (a parameter's local tensor) sharded as a protocol parameter (subclass_params.py)?"""
        return has_fsdp_hooks(value) or (self.defer_hookless and is_tensor_subclass(value))

    def hooks_changed(self) -> list[ManagedParam]:
        """Sharded parameters whose local shard's hooks no longer match how they are sharded: hooks attached after
        ``fully_shard`` to a plain one, or a tensor subclass still without them."""
        return [
            mp
            for mp in self.params
            if mp.slot is not None and (mp.subclass is not None) != has_fsdp_hooks(mp.sharded._local_tensor)
        ]

    def read_hooks(self, check_added: Callable[[list[tuple[str, torch.Tensor, int, bool]]], None]) -> None:
        """Read FSDP2's all-gather hooks on the local shards once more, before the unit's first gather, as torch's lazy
        init does ("allow monkey patch after init"): a plain parameter whose local shard got ``fsdp_pre_all_gather``
        / ``fsdp_post_all_gather`` since ``fully_shard`` (e.g. after ``to_empty``) becomes a protocol parameter; a
        tensor subclass that still has none trains as a plain parameter of the flat buffer (its shard copied in with
        ``copy_``, as torch's all-gather copy-in does; its class is dropped). ``check_added`` raises, before anything
        changes, for added hooks the unit's settings cannot serve (``subclass_params.check_hooks_added``). Later
        re-adoptions read the hooks anyway (``_build``)."""
        changed = self.hooks_changed()
        check_added(
            [
                (mp.fqn, mp.sharded._local_tensor, mp.placing.shard_dim, mp.placing.tp_mesh is not None)
                for mp in changed
                if mp.subclass is None
            ]
        )
        hookless = [mp.fqn for mp in changed if mp.subclass is not None]
        if hookless:
            logger.warning(
                "%s: tensor-subclass parameter(s) %s got no fsdp_pre_all_gather / fsdp_post_all_gather hooks before "
                "the first all-gather; they train as plain parameters (their shards copied into the flat buffer)",
                self.owner_name,
                ", ".join(hookless[:4]),
            )
        self.defer_hookless = False
        if changed:
            self.reinstall([mp.sharded._local_tensor for mp in self.params], are_full=False)

    def kept_whole(self, ndim: int, trainable: bool, protocol: bool = False) -> bool:
        """Whether a parameter is kept whole on every rank (a protocol parameter is always sharded its own way)."""
        return not protocol and (ndim == 0 or (self.frozen_params == "replicate" and not trainable))

    def _classify(self) -> None:
        """``protocol``: the parameters using FSDP2's all-gather hooks, in slot order; ``uniform``: one dtype group
        and no protocol parameter, so the unit's single flat buffer is all it gathers (the fast path)."""
        self.protocol = [mp for mp in self.params if mp.subclass is not None]
        self.uniform = len(self.groups) <= 1 and not self.protocol

    def _build(
        self,
        placings: list[ParamPlacing],
        values: list[torch.Tensor],
        whole: list[bool],
        requires_grad: list[bool],
        *,
        are_full: bool,
    ) -> tuple[list[DTensor], list[int | None], list[tuple[int | None, SubclassShard | None]]]:
        """New flat buffers holding the sharded parameters' rows; new DTensor parameters over them (and whole ones).

        ``values`` are the tensors FSDP shards (the TP-local tensor of a TP parameter) in full (``are_full``), or
        this rank's shards of them. Sharded plain parameters are grouped by dtype, one flat buffer per group (the
        group of ``self.dtype`` first); protocol parameters are sharded with their own ops (subclass_params.py).
        Returns the new parameters, their slots and (group, protocol state) per parameter.
        """
        sharded = [i for i, w in enumerate(whole) if not w]
        protocol = [i for i in sharded if self.uses_protocol(values[i])]
        plain = [i for i in sharded if not self.uses_protocol(values[i])]
        order = sorted({values[i].dtype for i in plain}, key=lambda d: (d != self.dtype, str(d)))
        on_meta = any(v.is_meta for v in values)
        self.groups = []
        slots: list[int | None] = [None] * len(values)
        storage: list[tuple[int | None, SubclassShard | None]] = [(None, None)] * len(values)
        for index, dtype in enumerate(order):
            members = [i for i in plain if values[i].dtype == dtype]
            layout = FlatLayout.build(
                [placings[i].local_shape for i in members], self.world_size, [placings[i].shard_dim for i in members]
            )
            flat = self.devices.new_flat(layout.segment_numel, dtype, meta=on_meta)
            self.groups.append(ShardGroup(dtype, layout, flat, members))
            for position, i in enumerate(members):
                slots[i] = position
                storage[i] = (index, None)
        for position, i in enumerate(protocol):
            padded, rows = shard_subclass(
                values[i], placings[i].local_shape, self.rank, self.world_size, is_full=are_full
            )
            slots[i] = position
            storage[i] = (None, SubclassShard(padded, rows, placings[i].local_shape))
        if self.groups:
            self.layout, self.flat = self.groups[0].layout, self.groups[0].flat
        else:
            self.layout = FlatLayout.build([], self.world_size)
            self.flat = self.devices.new_flat(0, self.dtype, meta=on_meta)
        news = []
        for i, value in enumerate(values):
            slot = slots[i]
            placing = placings[i]
            group, subclass = storage[i]
            if slot is None:
                local = self.devices.place(value, meta=on_meta)
            elif subclass is not None:
                local = subclass.local()
            else:
                assert group is not None
                target = self.groups[group]
                local = target.layout.shard_view(target.flat, slot, self.rank)
                with torch.no_grad():
                    local.copy_(local_rows(value, self.rank, self.world_size, placing.shard_dim) if are_full else value)
            placements = placing.sharded_placements(
                self.dp.placements(whole=slot is None, split_factor=placing.split_factor, dim=placing.shard_dim)
            )
            news.append(
                _make_sharded_param(
                    local, placing.spmd_mesh, placements, placing.global_shape, placing.global_stride, requires_grad[i]
                )
            )
            if subclass is not None:
                # Hooks attached to the local shard this one replaces (nn.Parameter made a new local tensor)
                carry_instance_hooks(value, news[-1]._local_tensor)
        return news, slots, storage

    def _installed(self, mp: ManagedParam) -> None:
        setattr(mp.sharded, OWNER_ATTR, self.owner_name)
        mp.local = mp.sharded._local_tensor
        mp.full = mp.full_data = None
        mp.register(mp.sharded)

    def reinstall(self, values: list[torch.Tensor], *, are_full: bool) -> None:
        """Rebuild ``flat`` from ``values`` and swap the new DTensors into the existing parameter objects.

        ``torch.utils.swap_tensors`` keeps the ``nn.Parameter`` objects optimizers hold. A gradient survives when the
        parameter keeps its placement; one whose placement changes (sharded <-> whole) is dropped.
        """
        whole = [
            self.kept_whole(len(mp.sharded.shape), mp.trainable, has_fsdp_hooks(v))
            for mp, v in zip(self.params, values, strict=True)
        ]
        news, slots, storage = self._build(
            [mp.placing for mp in self.params],
            values,
            whole,
            [mp.sharded.requires_grad for mp in self.params],
            are_full=are_full,
        )
        for mp, new, slot, (group, subclass) in zip(self.params, news, slots, storage, strict=True):
            grad = mp.sharded.grad if (slot is None) == (mp.slot is None) else None
            torch.utils.swap_tensors(mp.sharded, new)
            install_copier(mp.sharded)  # the swap moved the copier that pointed at ``new``
            if grad is not None and grad.dtype != mp.sharded.dtype:
                grad = grad.to(mp.sharded.dtype)
            mp.sharded.grad = grad
            mp.slot = slot
            mp.group, mp.subclass = group, subclass
            self._installed(mp)
        self._classify()

    # ------------------------------------------------------------------ keeping the views intact
    def views_intact(self) -> bool:
        """Cheap check (identity only) that every parameter is still ours and still a view into ``flat``."""
        for mp in self.params:
            if mp.registered() is not mp.sharded or mp.sharded._local_tensor is not mp.local:
                return False
        return True

    def unchanged(self, *, gathered: bool) -> bool:
        """The step's one identity pass: every parameter the modules hold is still ours (its sharded DTensor viewing
        ``flat``, or while ``gathered`` its full parameter) and requires grad as when it was laid out."""
        for mp in self.params:
            held = mp.registered()
            if gathered and held is mp.full and mp.full is not None:
                if mp.full.requires_grad != mp.trainable:
                    return False
            elif held is not mp.sharded or mp.sharded._local_tensor is not mp.local:
                return False
            elif mp.sharded.requires_grad != mp.trainable:
                return False
        return True

    def check_materialized(self) -> None:
        """Raise before any collective if a parameter is still on the meta device."""
        for mp in self.params:
            current = mp.registered()
            if isinstance(current, torch.Tensor) and current.is_meta:
                raise RuntimeError(
                    f"parameter '{mp.fqn}' of the unit rooted at {self.owner_name} is still on the meta device at "
                    "its first forward; materialize it first: module.to_empty(device=...) and then initialize "
                    "(e.g. reset_parameters()) before calling the model"
                )

    def adopt(self) -> None:
        """Make every parameter a view into a fresh ``flat`` again, keeping the ``nn.Parameter`` objects.

        Picks up a parameter object the user registered in place of ours (it must be a DTensor of the same global
        shape and placements) and copies every current local shard into a new flat buffer (after ``to_empty``,
        ``load_state_dict(assign=True)``, ``copy.deepcopy`` or ``model.to(dtype)``: the unit takes the dtype its
        parameters have now). Raises before changing anything when the parameters cannot be adopted.
        """
        self.check_materialized()
        currents: list[DTensor] = []
        for mp in self.params:
            current = mp.registered()
            if current is not mp.sharded and (not isinstance(current, DTensor) or current.shape != mp.sharded.shape):
                raise ValueError(
                    f"parameter '{mp.fqn}' of the unit rooted at {self.owner_name} was replaced by "
                    f"{type(current).__name__} of shape {tuple(getattr(current, 'shape', ()))}; a sharded "
                    "module needs DTensor parameters of the same global shape (use load_state_dict without "
                    "assign=True, or fc.load_full_state_dict)"
                )
            if isinstance(current, DTensor) and tuple(current.placements) != tuple(mp.sharded.placements):
                # Its local tensor would be another piece of the parameter (e.g. Shard(0) rows for a Shard(1) one).
                raise ValueError(
                    f"parameter '{mp.fqn}' of the unit rooted at {self.owner_name} was replaced by a DTensor with "
                    f"placements {tuple(current.placements)}, the unit shards it as {tuple(mp.sharded.placements)}; "
                    "load values without assign=True (or redistribute the DTensor to those placements first)"
                )
            currents.append(current)  # type: ignore[arg-type]
        for mp, current in zip(self.params, currents, strict=True):
            if current is not mp.sharded:
                mp.sharded = current
                mp.register(current)
        # Parameters cast since (all of them, or some: the unit then regroups them by dtype)
        new_dtype = _primary_dtype(currents)
        if new_dtype != self.dtype:
            logger.debug("%s: parameters were cast from %s to %s", self.owner_name, self.dtype, new_dtype)
            self.dtype = new_dtype
        self.reinstall([mp.sharded._local_tensor for mp in self.params], are_full=False)
        logger.debug("re-adopted %d parameters of %s into a new flat buffer", len(self.params), self.owner_name)

    def release(self, original: nn.Parameter) -> ManagedParam:
        """Stop managing the parameter that replaced ``original`` (it moves to an enclosing unit: a tie)."""
        index = next(i for i, mp in enumerate(self.params) if mp.original is not None and mp.original() is original)
        released = self.params.pop(index)
        self.reinstall([mp.sharded._local_tensor for mp in self.params], are_full=False)
        return released

    def copy_for(self, memo: dict[int, Any]) -> FlatShard:
        """This flat shard for a ``copy.deepcopy`` of its modules: the copied parameters, adopted lazily.

        The copied parameters are clones (not views into a flat buffer), so the next gather re-adopts them.
        """
        new = object.__new__(FlatShard)
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
        new.flat = torch.zeros(0, dtype=self.dtype, device="meta")
        new.groups = []
        new._classify()
        new.replaced = ReplacedParams(self.owner_name, [])
        return new


def _primary_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """A unit's own dtype: the first sharded plain parameter's (else the first parameter's, else fp32)."""
    for p in params:
        if p.ndim > 0 and not has_fsdp_hooks(p._local_tensor if isinstance(p, DTensor) else p):
            return p.dtype
    return params[0].dtype if params else torch.float32


def make_full_param(
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
