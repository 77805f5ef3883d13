"""A unit: the parameters of one ``fully_shard`` call, their flat shard buffer, and the three data movements.

1. ``unshard``  — all-gather the flat shard segment of every rank, copy each parameter's rows out into its own full
   tensor, and register those full tensors on the owning modules (so the user's forward runs unchanged).
2. ``reshard``  — register the sharded DTensor parameters again and free the full tensors' storage. The storage
   object is kept and resized to zero, so tensors autograd saved still alias it and see the data again after the next
   all-gather refills it.
3. ``reduce_grads`` — copy the full gradients into one ``(world_size, segment)`` buffer, reduce-scatter it once, and
   hand every sharded parameter its rows as a DTensor ``.grad`` (accumulating into an existing one).

The sharded parameters' local tensors are views into ``flat``, so the all-gather reads them with no copy-in and the
optimizer's in-place updates land in the buffer directly. Anything that breaks those views (``to_empty``,
``load_state_dict(assign=True)``, ``copy.deepcopy``) is detected by identity and repaired by ``adopt`` before the next
all-gather, keeping the ``nn.Parameter`` objects the optimizer holds.
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
from torch.distributed.tensor import DTensor, Replicate, Shard

from .collectives import Work, all_gather_flat, reduce_scatter_flat
from .sharding import FlatLayout, copy_param_from_segments, local_rows, write_grad_into_segments

logger = logging.getLogger(__name__)

__all__ = ["ManagedParam", "ShardedUnit", "UnitState"]

# Attribute set on every sharded parameter so a later fully_shard on a submodule can tell that an enclosing call
# already owns it. It lives on the parameter instance (not in a registry) and names the owner for error messages.
OWNER_ATTR = "_fsdp_compose_owner"


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # an all-gather is in flight
    UNSHARDED = "unsharded"


@dataclass
class ManagedParam:
    """One parameter of a unit. ``owners`` lists every (module, attribute) holding it (ties inside the unit)."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    sharded: DTensor  # an nn.Parameter holding a DTensor
    slot: int | None  # index into the unit's FlatLayout; None: a 0-dim parameter kept whole on every rank
    local: torch.Tensor | None = None  # the view into ``flat`` that ``sharded`` must hold; None: needs adopting
    full: nn.Parameter | None = None  # the unsharded parameter used by forward/backward
    full_data: torch.Tensor | None = None  # ``full.data``: writes through it do not bump ``full``'s version
    gathered_version: int = field(default=-1)  # sharded._version when ``full`` was last filled

    def register(self, tensor: torch.Tensor) -> None:
        for module, name in self.owners:
            module._parameters[name] = tensor  # type: ignore[assignment]


def _make_sharded_param(
    local: torch.Tensor, mesh: DeviceMesh, placement: Shard | Replicate, shape: torch.Size, requires_grad: bool
) -> DTensor:
    dtensor = DTensor.from_local(
        local, mesh, (placement,), run_check=False, shape=shape, stride=_contiguous_stride(shape)
    )
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
        placement = param.placements[0]
        assert isinstance(placement, (Shard, Replicate))
        new = _make_sharded_param(
            param._local_tensor.detach().clone(), param.device_mesh, placement, param.shape, param.requires_grad
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


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class ShardedUnit:
    """Parameters of one ``fully_shard`` call on a 1-D mesh, sharded on dim 0 into one flat buffer."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: DeviceMesh,
        device: torch.device,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        owner_name: str,
    ) -> None:
        self.mesh = mesh
        self.group: dist.ProcessGroup = mesh.get_group(0)
        self.rank = mesh.get_local_rank(0)
        self.world_size = mesh.size(0)
        self.device = device
        self.owner_name = owner_name
        self.state = UnitState.SHARDED
        self._pending_gather: tuple[Work | None, torch.Tensor] | None = None
        # The user's parameters this unit replaced (weakly held), so a parent's fully_shard can spot ties to them.
        self.original_params: list[weakref.ref[nn.Parameter]] = [weakref.ref(p) for _, p, _ in params]
        # No-sync accumulation in the reduce-scatter layout (see accumulate_grads) and which parameters it is for.
        self._accumulated: torch.Tensor | None = None
        self._accumulated_for: list[int] = []
        self._locally_seen: set[int] = set()  # parameters that had a gradient on this rank since the last reduce

        sharded_specs = [(fqn, p, owners) for fqn, p, owners in params if p.ndim > 0]
        replicated_specs = [(fqn, p, owners) for fqn, p, owners in params if p.ndim == 0]
        self.orig_dtype = params[0][1].dtype if params else torch.float32
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.layout = FlatLayout.build([p.shape for _, p, _ in sharded_specs], self.world_size)
        on_meta = any(p.is_meta for _, p, _ in params)
        self.flat = torch.zeros(self.layout.segment_numel, dtype=self.orig_dtype, device="meta" if on_meta else device)
        self.params: list[ManagedParam] = []
        for index, (fqn, param, owners) in enumerate(sharded_specs):
            view = self.layout.shard_view(self.flat, index, self.rank)
            with torch.no_grad():
                view.copy_(local_rows(param.detach(), self.rank, self.world_size))
            sharded = _make_sharded_param(view, mesh, Shard(0), param.shape, param.requires_grad)
            self.params.append(ManagedParam(fqn, owners, sharded, slot=index))
        for fqn, param, owners in replicated_specs:
            local = param.detach().to(self.flat.device, copy=True)
            sharded = _make_sharded_param(local, mesh, Replicate(), param.shape, param.requires_grad)
            self.params.append(ManagedParam(fqn, owners, sharded, slot=None))
        for mp in self.params:
            setattr(mp.sharded, OWNER_ATTR, owner_name)
            mp.local = mp.sharded._local_tensor
            mp.register(mp.sharded)

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
        shape), copies every current local shard into a new flat buffer and swaps the new views into the existing
        parameter objects with ``torch.utils.swap_tensors``, so optimizers that hold them keep working.
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
        self.flat = torch.zeros(self.layout.segment_numel, dtype=self.orig_dtype, device=self.device)
        for mp in self.params:
            old_local = mp.sharded._local_tensor
            if mp.slot is None:
                new_local = old_local.detach().to(self.device, copy=True)
                placement: Shard | Replicate = Replicate()
            else:
                new_local = self.layout.shard_view(self.flat, mp.slot, self.rank)
                with torch.no_grad():
                    new_local.copy_(old_local)
                placement = Shard(0)
            grad = mp.sharded.grad
            fresh = _make_sharded_param(new_local, self.mesh, placement, mp.sharded.shape, mp.sharded.requires_grad)
            torch.utils.swap_tensors(mp.sharded, fresh)
            _install_copier(mp.sharded)  # the swap moved the copier that pointed at ``fresh``
            mp.sharded.grad = grad
            setattr(mp.sharded, OWNER_ATTR, self.owner_name)
            mp.local = mp.sharded._local_tensor
            mp.full = mp.full_data = None
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
                copy.deepcopy(mp.sharded, memo),
                mp.slot,
            )
            for mp in self.params
        ]
        new.flat = torch.zeros(0, dtype=self.orig_dtype, device="meta")
        new.state = UnitState.SHARDED
        new._pending_gather = None
        new._accumulated = None
        new._accumulated_for = []
        new._locally_seen = set()
        return new

    # ------------------------------------------------------------------ unshard / reshard
    @property
    def is_unsharded(self) -> bool:
        return self.state is UnitState.UNSHARDED

    def is_stale(self) -> bool:
        """True when unsharded but a sharded parameter changed since (e.g. an optimizer step in between)."""
        return any(mp.sharded._version != mp.gathered_version for mp in self.params)

    def start_unshard(self, *, async_op: bool) -> None:
        """Issue the all-gather (no-op when already unsharded or gathering)."""
        if self.state is not UnitState.SHARDED:
            return
        if not self.views_intact():
            self.adopt()
        shard = self.flat if self.param_dtype == self.orig_dtype else self.flat.to(self.param_dtype)
        if self.world_size == 1:
            self._pending_gather = (None, shard)
        else:
            gathered = torch.empty(self.world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
            work = all_gather_flat(gathered, shard, self.group, async_op=async_op)
            self._pending_gather = (work, gathered)
        self.state = UnitState.GATHERING

    def finish_unshard(self) -> None:
        """Wait for the all-gather, fill the full parameters and register them on the modules."""
        if self.state is not UnitState.GATHERING:
            return
        assert self._pending_gather is not None
        work, gathered = self._pending_gather
        self._pending_gather = None
        if work is not None:
            work.wait()
        segments = gathered.view(self.world_size, self.layout.segment_numel)
        for mp in self.params:
            full_data = self._ensure_full(mp)
            if mp.slot is not None:
                copy_param_from_segments(full_data, segments, self.layout.slots[mp.slot])
            elif full_data.data_ptr() != mp.sharded._local_tensor.data_ptr():
                full_data.copy_(mp.sharded._local_tensor)
            mp.gathered_version = mp.sharded._version
            assert mp.full is not None
            mp.register(mp.full)
        self.state = UnitState.UNSHARDED

    def unshard(self) -> None:
        self.start_unshard(async_op=False)
        self.finish_unshard()

    def _ensure_full(self, mp: ManagedParam) -> torch.Tensor:
        """The full parameter's ``.data`` with storage allocated (created on first use, resized back after)."""
        requires_grad = mp.sharded.requires_grad
        if mp.full is None or mp.full.dtype != self.param_dtype:
            if mp.slot is None and self.param_dtype == self.orig_dtype:
                mp.full = nn.Parameter(mp.sharded._local_tensor, requires_grad=requires_grad)
            else:
                empty = torch.empty(mp.sharded.shape, dtype=self.param_dtype, device=self.device)
                mp.full = nn.Parameter(empty, requires_grad=requires_grad)
            mp.full_data = mp.full.data
        elif mp.full.requires_grad != requires_grad:
            mp.full.requires_grad_(requires_grad)
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
        if self.state is UnitState.SHARDED:
            return
        for mp in self.params:
            mp.register(mp.sharded)
            if mp.slot is not None and mp.full_data is not None:
                mp.full_data.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    # ------------------------------------------------------------------ gradients
    def has_trainable(self) -> bool:
        return any(mp.sharded.requires_grad for mp in self.params)

    def has_pending_full_grads(self) -> bool:
        return any(mp.full is not None and mp.full.grad is not None for mp in self.params)

    def _divide_factors(self, divide_factor: float | None) -> tuple[float, float]:
        """(pre, post) divisors whose product is the divide factor (default: the data-parallel size).

        fp16 sums of many ranks overflow and fp16 pre-divided values underflow, so for fp16 the factor is split:
        pre-divide by the largest power of two not above its square root (exact in binary floating point), post-divide
        by the rest. Other dtypes have fp32's range: one post-division is the most accurate.
        """
        total = float(self.world_size if divide_factor is None else divide_factor)
        if self.reduce_dtype != torch.float16:
            return 1.0, total
        pre = 1.0
        while (pre * 2.0) ** 2 <= total:
            pre *= 2.0
        return pre, total / pre

    def _grad_tail(self, trainable: list[ManagedParam]) -> dict[int, int]:
        return {id(mp): i for i, mp in enumerate(mp for mp in trainable if mp.slot is None)}

    def _write_grads(self, buffer: torch.Tensor, trainable: list[ManagedParam], *, fresh: bool, pre: float) -> None:
        """Move every trainable full gradient into ``buffer`` (copy when ``fresh``, else add) and free it.

        ``buffer`` is ``(world_size, segment + tail)``: the reduce-scatter layout, plus a tail that every rank writes
        into every segment — one "had a gradient" count per trainable parameter and the gradients of 0-dim
        parameters — so the reduce-scatter also delivers those sums to every rank (no second collective).
        """
        segment = self.layout.segment_numel
        scalar_column = self._grad_tail(trainable)
        flags = buffer[:, segment : segment + len(trainable)]
        scalars = buffer[:, segment + len(trainable) :]
        for index, mp in enumerate(trainable):
            grad = mp.full.grad if mp.full is not None else None
            if grad is not None:
                self._locally_seen.add(id(mp))
            if mp.slot is None:
                column = scalars[:, scalar_column[id(mp)]]
                if grad is None:
                    column.zero_() if fresh else None
                else:
                    source = grad.reshape(1).expand(self.world_size)
                    column.copy_(source).div_(pre) if fresh else column.add_(source, alpha=1.0 / pre)
            elif grad is None:
                if fresh:
                    slot = self.layout.slots[mp.slot]
                    buffer[:, slot.offset : slot.offset + slot.numel].zero_()
            else:
                write_grad_into_segments(grad, buffer, self.layout.slots[mp.slot], accumulate=not fresh, scale=pre)
            if fresh:
                flags[:, index].fill_(0.0 if grad is None else 1.0)
            elif grad is not None:
                flags[:, index].add_(1.0)
            if mp.full is not None:
                mp.full.grad = None

    def _trainable(self) -> list[ManagedParam]:
        return [mp for mp in self.params if mp.sharded.requires_grad]

    def accumulate_grads(self, divide_factor: float | None = None) -> None:
        """A no-sync micro-batch: add the full gradients into the unit's reduce-scatter buffer and free them.

        The buffer (in ``reduce_dtype``, e.g. fp32 under bf16 compute) persists until the synced backward, which
        adds its own gradients and reduce-scatters that same buffer in place: no second full-size buffer, no concat.
        """
        trainable = self._trainable()
        if not trainable or not any(mp.full is not None and mp.full.grad is not None for mp in trainable):
            return
        pre, _ = self._divide_factors(divide_factor)
        fresh = self._accumulated is None
        if self._accumulated is None:
            tail = len(trainable) + len(self._grad_tail(trainable))
            self._accumulated = torch.empty(
                self.world_size, self.layout.segment_numel + tail, dtype=self.reduce_dtype, device=self.device
            )
            self._accumulated_for = [id(mp) for mp in trainable]
        elif self._accumulated_for != [id(mp) for mp in trainable]:
            raise self._trainability_changed_error()
        self._write_grads(self._accumulated, trainable, fresh=fresh, pre=pre)

    def _trainability_changed_error(self) -> RuntimeError:
        return RuntimeError(
            f"requires_grad of parameters in the unit rooted at {self.owner_name} changed while gradients from "
            "no-sync micro-batches are pending; finish the accumulation with a synced backward (or zero_grad) "
            "before freezing or unfreezing parameters"
        )

    def has_accumulated_grads(self) -> bool:
        return self._accumulated is not None

    def reduce_grads(self, divide_factor: float | None = None) -> None:
        """Reduce-scatter the trainable gradients (this backward's and any accumulated ones) into sharded ``.grad``.

        Every rank issues exactly one reduce-scatter, also when it has no gradient for some parameters (an unused
        branch): those contribute zeros. Gradients are averaged over ranks (or divided by ``divide_factor``).
        """
        trainable = self._trainable()
        if not trainable:
            return
        pre, post = self._divide_factors(divide_factor)
        segment = self.layout.segment_numel
        scalar_column = self._grad_tail(trainable)
        tail = len(trainable) + len(scalar_column)
        buffer = self._accumulated
        if buffer is not None and self._accumulated_for != [id(mp) for mp in trainable]:
            raise self._trainability_changed_error()
        if buffer is None:
            buffer = torch.empty(self.world_size, segment + tail, dtype=self.reduce_dtype, device=self.device)
        self._write_grads(buffer, trainable, fresh=self._accumulated is None, pre=pre)
        self._accumulated = None
        missing_locally = len(self._locally_seen) < len(trainable)
        self._locally_seen = set()
        output = torch.empty(segment + tail, dtype=self.reduce_dtype, device=self.device)
        if self.world_size == 1:
            output.copy_(buffer.view(-1))
        else:
            reduce_scatter_flat(output, buffer.view(-1), self.group, async_op=False)
        del buffer
        if post != 1.0:
            output.div_(post)
        # Reading the flags costs a device sync, so only a rank that lacked a gradient itself reads them.
        had_grad = (output[segment : segment + len(trainable)] > 0).tolist() if missing_locally else None
        for index, mp in enumerate(trainable):
            if had_grad is not None and not had_grad[index]:
                continue
            if mp.slot is None:
                rows = output[segment + len(trainable) + scalar_column[id(mp)]].view(())
            else:
                rows = self.layout.shard_view(output, mp.slot, self.rank)
            self._accumulate_sharded_grad(mp, rows)

    def _accumulate_sharded_grad(self, mp: ManagedParam, rows: torch.Tensor) -> None:
        rows = rows.to(self.orig_dtype)
        if mp.sharded.grad is None:
            placement: Shard | Replicate = Replicate() if mp.slot is None else Shard(0)
            mp.sharded.grad = DTensor.from_local(
                rows,
                self.mesh,
                (placement,),
                run_check=False,
                shape=mp.sharded.shape,
                stride=_contiguous_stride(mp.sharded.shape),
            )
        else:
            cast(DTensor, mp.sharded.grad)._local_tensor.add_(rows)
