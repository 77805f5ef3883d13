"""Gradient-norm clipping for gradients sharded over any mix of meshes and placements.

``torch.nn.utils.clip_grad_norm_`` stacks per-DTensor norms, which needs every gradient on one mesh (torch issue
#170862: FSDP blocks next to FSDP + TP blocks fail) and reduces each norm separately. Here torch's
``get_total_norm`` / ``clip_grads_with_norm_`` run on the local tensors, and only the reduction is ours: a
gradient's global ``sum |g|^p`` (max for the inf-norm) is its local one reduced over the mesh dims that *shard* it
(``Replicate`` dims hold copies; plain gradients are assumed identical on every rank, like DDP's, and counted once).
Gradients are grouped by those process groups, and each process group gets one all-reduce of the stacked partial
results of its groups, not one per parameter.

Collectives follow the parameters' order, so every rank must pass the same parameters in the same order. A DTensor
parameter without a gradient still joins its group's collectives, so no rank skips one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from .offload import collective_device

__all__ = ["clip_grad_norm_"]


@dataclass
class _Group:
    """Local gradients reduced over the same process groups (none for plain ones)."""

    process_groups: tuple[dist.ProcessGroup, ...]
    device: torch.device  # where the group's partial result is all-reduced (the mesh's device)
    grads: list[torch.Tensor] = field(default_factory=list)


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
        The total norm before clipping: a 0-dim fp32 plain tensor, the same on every rank. (Like torch's, the local
        norms of bf16 or fp16 gradients are rounded to their dtype.)

    Every rank must pass the same parameters in the same order: the collectives follow the parameters' order.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    p = float(norm_type)
    if not p > 0:  # also rejects nan
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    with torch.no_grad():
        groups = _group_gradients(params)
        if not groups:
            return torch.tensor(0.0)
        total = _total_norm(groups, p, foreach)
        if error_if_nonfinite:  # torch's check and message, on the global total (the same on every rank)
            get_total_norm([total], p, error_if_nonfinite=True)
        # clip_grads_with_norm_ scales the `.grad`s of what it is given, grouped by device and dtype only: given the
        # DTensor parameters, its foreach path raises for gradients on different meshes. So it gets the local
        # tensors, each as the `.grad` of a detached alias of itself (no copy).
        grads = [g for group in groups for g in group.grads]
        carriers = [g.detach() for g in grads]
        for carrier, grad in zip(carriers, grads, strict=True):
            carrier.grad = grad
        clip_grads_with_norm_(carriers, max_norm, total, foreach)
    return total


def _group_gradients(params: list[torch.Tensor]) -> list[_Group]:
    """Sort the local gradient tensors into groups, in order of first appearance (the same order on every rank)."""
    groups: dict[tuple[int, ...], _Group] = {}
    specs: dict[tuple[int, object], tuple[dist.ProcessGroup, ...] | None] = {}
    for param in params:
        grad = param.grad
        source = grad if grad is not None else param  # a DTensor parameter without a gradient still takes part
        if isinstance(source, DTensor):
            spec = (id(source.device_mesh), source.placements)
            if spec not in specs:
                specs[spec] = _shard_process_groups(source)
            process_groups = specs[spec]
            if process_groups is None:  # this rank is not on the gradient's mesh: nothing to count or clip
                continue
        elif grad is None:
            continue
        else:
            process_groups = ()
        key = tuple(id(pg) for pg in process_groups)
        if key not in groups:
            groups[key] = _Group(process_groups, collective_device(source))
        if grad is not None:
            groups[key].grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    return list(groups.values())


def _shard_process_groups(tensor: DTensor) -> tuple[dist.ProcessGroup, ...] | None:
    """The process groups of the mesh dims that shard ``tensor`` (None when this rank is not on its mesh)."""
    mesh = tensor.device_mesh
    if mesh.get_coordinate() is None:
        return None
    if any(placement.is_partial() for placement in tensor.placements):
        raise ValueError(
            f"clip_grad_norm_ got a gradient with placements {tensor.placements}: a Partial gradient holds "
            "unreduced partial sums, so its norm is undefined until it is reduced (redistribute it first)"
        )
    return tuple(
        mesh.get_group(dim)
        for dim, placement in enumerate(tensor.placements)
        if isinstance(placement, (Shard, _StridedShard)) and mesh.size(dim) > 1
    )


def _total_norm(groups: list[_Group], p: float, foreach: bool | None) -> torch.Tensor:
    """The global p-norm: per group a local partial result, one all-reduce per process group, then combine.

    A group's partial result is ``[sum |g|^p or max |g|, is nan]``: an all-reduce MAX may drop a nan, the flag not.
    """
    inf = math.isinf(p)
    rows = []
    for group in groups:
        # empty tensors add nothing, and the inf-norm of one raises (an empty shard is common)
        norm = get_total_norm([g for g in group.grads if g.numel()], p, foreach=foreach)
        value = norm.to(group.device, torch.float32)
        value = value if inf else value**p
        rows.append(torch.stack([value, value.isnan().float()]))
    reduced: set[int] = set()
    for group in groups:
        for pg in group.process_groups:
            if id(pg) in reduced:
                continue
            reduced.add(id(pg))
            on_pg = [i for i, other in enumerate(groups) if pg in other.process_groups]
            stacked = torch.stack([rows[i].to(group.device) for i in on_pg])
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pg)
            for i, row in zip(on_pg, stacked, strict=True):
                rows[i] = row
    values, nan = torch.stack([row.to(groups[0].device) for row in rows]).unbind(1)
    total = values.max() if inf else values.sum() ** (1.0 / p)
    return torch.where(nan.any(), math.nan, total)
