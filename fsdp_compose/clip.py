"""Gradient-norm clipping for gradients sharded over any mix of meshes and placements.

``torch.nn.utils.clip_grad_norm_`` asks every DTensor gradient for its norm and stacks the results: that needs every
gradient on one mesh (torch issue #170862 — a model whose units live on different meshes, e.g. FSDP blocks next to
FSDP + TP blocks, fails or miscomputes), and it reduces each norm separately. Here the math is done on the local
tensors instead:

* a DTensor's global ``sum |g|^p`` is the sum of its local ``sum |g|^p`` over the mesh dims whose placement *shards*
  it (``Shard`` or ``_StridedShard``): those ranks hold disjoint pieces. ``Replicate`` dims hold copies, so reducing
  over them would count the same values several times; they are skipped. The inf-norm uses max instead of sum.
* gradients are grouped by the process groups they reduce over (one mesh dim = one process group; a 1-D FSDP mesh
  ``mesh["dp"]`` and the dp dim of the 2-D (dp, tp) mesh it was sliced from share one), local contributions of a
  group are summed first, and every process group gets **one** all-reduce of the stacked partial results of all
  groups that reduce over it — not one per parameter. A gradient sharded over several dims is all-reduced over each
  dim's group in turn (sums and maxes commute, so the order does not matter).
* plain (non-DTensor) gradients, e.g. of ``ignored_params``, are counted once, as their local values: like DDP's,
  they are assumed identical on every rank (averaged by whoever owns them). A plain gradient that differs between
  ranks makes the total norm differ between ranks.

The per-tensor norms are computed in fp32 whatever the gradient dtype (``torch._foreach_norm`` where supported), the
total norm is ``(sum)^(1/p)``, and every gradient's local tensor is scaled in place by
``min(max_norm / (total + 1e-6), 1)`` — the same formula as torch's. Every rank gets the same total norm.

Collectives are issued in the order of the parameters, so every rank must pass the same parameters in the same order
(as for torch's version). A DTensor parameter without a gradient still joins its group's collectives (contributing
zero), so ranks never disagree on which collectives run because one of them lacks a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from .offload import collective_device

__all__ = ["clip_grad_norm_"]


@dataclass
class _Group:
    """Gradients whose ``sum |g|^p`` (or max) is all-reduced over the same process groups (none for plain ones)."""

    process_groups: tuple[dist.ProcessGroup, ...]
    device: torch.device  # where this group's partial result is all-reduced (the mesh's device)
    grads: list[torch.Tensor] = field(default_factory=list)  # local tensors, scaled in place


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradient norm of ``parameters``, whose gradients may be DTensors on any meshes and placements.

    Like ``torch.nn.utils.clip_grad_norm_``: the norm is taken over all gradients as if they were one vector, and the
    gradients are scaled in place by ``min(max_norm / (total_norm + 1e-6), 1)``. Works for 1-D FSDP ``(Shard(0),)``,
    HSDP ``(Replicate(), Shard(0))``, FSDP + TP (``_StridedShard``/``Shard`` on several dims), 3-D meshes, plain
    gradients (assumed identical on every rank, counted once) and any mix of them in one call.

    Args:
        parameters: a tensor or an iterable of tensors (parameters); those without ``.grad`` contribute nothing.
        max_norm: the largest total norm left after clipping.
        norm_type: ``p`` of the p-norm, > 0; ``float("inf")`` for the max-norm.
        error_if_nonfinite: raise ``RuntimeError`` if the total norm is nan or inf (costs a device sync).
        foreach: use ``torch._foreach_*`` kernels (``None``: where the device supports them).

    Returns:
        The total norm before clipping: a 0-dim fp32 plain tensor, the same on every rank.

    Every rank must pass the same parameters in the same order: the collectives follow the parameters' order.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    p = float(norm_type)
    if not p > 0:  # also rejects nan
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    max_norm = float(max_norm)
    with torch.no_grad():
        groups = _group_gradients(params)
        if not groups:
            return torch.tensor(0.0)
        total = _total_norm(groups, p, foreach)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        _scale_(groups, coef, foreach)
    return total


# ---------------------------------------------------------------------------------------------------- grouping
def _group_gradients(params: list[torch.Tensor]) -> list[_Group]:
    """Sort the local gradient tensors into groups, in order of first appearance (the same order on every rank)."""
    groups: dict[tuple[int, ...], _Group] = {}
    spec_cache: dict[tuple[int, object], tuple[dist.ProcessGroup, ...] | None] = {}
    for param in params:
        grad = param.grad
        source = grad if grad is not None else param  # a DTensor parameter without a gradient still takes part
        if isinstance(source, DTensor):
            cache_key = (id(source.device_mesh), source.placements)
            if cache_key not in spec_cache:
                spec_cache[cache_key] = _shard_process_groups(source)
            process_groups = spec_cache[cache_key]
            if process_groups is None:  # this rank is not on the gradient's mesh: nothing to count or clip
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else None
        else:
            if grad is None:
                continue
            process_groups = ()
            local = grad
        key = tuple(id(pg) for pg in process_groups)
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Group(process_groups, collective_device(source))
        if local is not None:
            group.grads.append(local)
    return list(groups.values())


def _shard_process_groups(tensor: DTensor) -> tuple[dist.ProcessGroup, ...] | None:
    """The process groups of the mesh dims that shard ``tensor`` (None when this rank is not on its mesh)."""
    mesh = tensor.device_mesh
    if mesh.get_coordinate() is None:
        return None
    process_groups = []
    for dim, placement in enumerate(tensor.placements):
        if placement.is_partial():
            raise ValueError(
                f"clip_grad_norm_ got a gradient with placements {tensor.placements}: a Partial gradient holds "
                "unreduced partial sums, so its norm is undefined until it is reduced (redistribute it first)"
            )
        if isinstance(placement, (Shard, _StridedShard)) and mesh.size(dim) > 1:
            process_groups.append(mesh.get_group(dim))
    return tuple(process_groups)


# -------------------------------------------------------------------------------------------------------- norm
def _total_norm(groups: list[_Group], p: float, foreach: bool | None) -> torch.Tensor:
    """The global p-norm: per group a local partial result, one all-reduce per process group, then combine."""
    inf = math.isinf(p)
    device = groups[0].device
    # One row per group: [sum |g|^p] for finite p; [max |g|, any nan] for inf (MAX may drop nan, the flag may not).
    rows = [_local_partial(group, p, inf, foreach).to(device) for group in groups]
    partial = torch.stack(rows)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    reduced: list[int] = []
    for group in groups:
        for pg in group.process_groups:
            if id(pg) in reduced:
                continue
            reduced.append(id(pg))
            rows_on_pg = [i for i, g in enumerate(groups) if any(q is pg for q in g.process_groups)]
            index = torch.tensor(rows_on_pg, device=device)
            values = partial.index_select(0, index).to(group.device)
            dist.all_reduce(values, op=op, group=pg)
            partial.index_copy_(0, index, values.to(device))
    if inf:
        total = partial[:, 0].max()
        return torch.where(partial[:, 1].max() > 0, torch.full_like(total, math.nan), total)
    return partial.sum() ** (1.0 / p)


def _local_partial(group: _Group, p: float, inf: bool, foreach: bool | None) -> torch.Tensor:
    """This rank's ``sum |g|^p`` (shape ``()``) or ``[max |g|, any nan]`` (shape ``(2,)``) of one group, in fp32."""
    norms = _local_norms([g for g in group.grads if g.numel() > 0], p, foreach)  # inf-norm has no empty identity
    if inf:
        if not norms:
            return torch.zeros(2, device=group.device)
        stacked = torch.stack([n.to(group.device) for n in norms])
        return torch.stack([stacked.max(), stacked.isnan().any().float()])
    if not norms:
        return torch.zeros((), device=group.device)
    return torch.stack([n.to(group.device) for n in norms]).pow(p).sum()


def _local_norms(tensors: list[torch.Tensor], p: float, foreach: bool | None) -> list[torch.Tensor]:
    norms: list[torch.Tensor] = []
    for (device, _), same in _by_device_and_dtype(tensors).items():
        if _use_foreach(same, device, foreach):
            norms.extend(torch._foreach_norm(same, p, dtype=torch.float32))
        else:
            norms.extend(torch.linalg.vector_norm(t, p, dtype=torch.float32) for t in same)
    return norms


# ----------------------------------------------------------------------------------------------------- scaling
def _scale_(groups: list[_Group], coef: torch.Tensor, foreach: bool | None) -> None:
    for (device, _), same in _by_device_and_dtype([g for group in groups for g in group.grads]).items():
        coef_here = coef.to(device)
        if _use_foreach(same, device, foreach):
            torch._foreach_mul_(same, coef_here)
        else:
            for t in same:
                t.mul_(coef_here)


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return foreach
