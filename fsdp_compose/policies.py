"""Per-unit policies: numerics (mixed precision), where shards live (offload), which mesh dims are data-parallel.

Policies are plain frozen values handed to one ``fully_shard`` call; nothing here is process-global. Torch's own
policy objects (``torch.distributed.fsdp.MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``,
``DataParallelMeshDims``) are accepted too: ``fully_shard`` converts them at the boundary with the ``as_*``
functions below, field by field, so code written for torch's ``fully_shard`` passes its policies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.distributed.fsdp as torch_fsdp

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "as_dp_mesh_dims",
    "as_mp_policy",
    "as_offload_policy",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of one unit's communication and compute.

    Sharded parameters, their gradients and the optimizer state always stay in the parameters' original dtype.

    - ``param_dtype``: dtype of the all-gather and of the full parameters used in forward/backward (None: original).
    - ``reduce_dtype``: dtype of the gradient reduction (None: ``param_dtype``, or original when that is None too).
    - ``output_dtype``: cast floating-point forward outputs to this dtype (None: leave them).
    - ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(
                    f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype or None, got {dtype!r}; "
                    "use e.g. torch.bfloat16"
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep shards and gradients on the mesh's device (no offload)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards and gradients in CPU memory; the optimizer steps on CPU. ``pin_memory`` speeds host transfers."""

    pin_memory: bool = True


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data-parallel (torch 2.13's ``fully_shard(dp_mesh_dims=...)``).

    With it, ``mesh`` is the whole mesh (e.g. ``("dp", "tp")``) and every parameter a DTensor on it with
    ``Replicate()`` on the data-parallel dims. ``shard``: the dim(s) parameters are sharded over (several are
    flattened into one); ``replicate``: the HSDP replica dim(s) (likewise). The dims not named keep the parameters'
    own placements (tensor parallel).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for field in ("shard", "replicate"):
            value = getattr(self, field)
            if value is None or isinstance(value, str):
                continue
            if not isinstance(value, tuple) or not value or not all(isinstance(n, str) for n in value):
                raise TypeError(
                    f"DataParallelMeshDims.{field} must be a mesh dim name, a non-empty tuple of names or None, "
                    f"got {value!r}"
                )
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs at least one of shard= and replicate=")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _qualname(value: object) -> str:
    """``module.Class`` of ``value``: torch's policies and ours share class names, so messages name the module."""
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def as_mp_policy(policy: object, where: str) -> MixedPrecisionPolicy:
    """``policy`` as an ``fsdp_compose.MixedPrecisionPolicy``: ours as is, torch's converted field by field."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, torch_fsdp.MixedPrecisionPolicy):
        return MixedPrecisionPolicy(**{f.name: getattr(policy, f.name) for f in fields(MixedPrecisionPolicy)})
    raise TypeError(
        f"mp_policy of {where} must be an fsdp_compose.MixedPrecisionPolicy or a "
        f"torch.distributed.fsdp.MixedPrecisionPolicy, got {_qualname(policy)}"
    )


def as_offload_policy(policy: object, where: str) -> OffloadPolicy:
    """``policy`` as an ``fsdp_compose`` offload policy: ours as is, torch's converted (``pin_memory`` kept)."""
    if isinstance(policy, OffloadPolicy):
        return policy
    if isinstance(policy, torch_fsdp.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if type(policy) is torch_fsdp.OffloadPolicy:  # a subclass of torch's we do not know would lose its meaning
        return OffloadPolicy()
    raise TypeError(
        f"offload_policy of {where} must be one of fsdp_compose.OffloadPolicy, fsdp_compose.CPUOffloadPolicy, "
        f"torch.distributed.fsdp.OffloadPolicy, torch.distributed.fsdp.CPUOffloadPolicy; got {_qualname(policy)}"
    )


def as_dp_mesh_dims(dims: object, where: str) -> DataParallelMeshDims | None:
    """``dims`` as an ``fsdp_compose.DataParallelMeshDims`` (torch's converted), or None."""
    if dims is None or isinstance(dims, DataParallelMeshDims):
        return dims
    torch_dims = getattr(torch_fsdp, "DataParallelMeshDims", None)
    if torch_dims is not None and isinstance(dims, torch_dims):
        shard, replicate = dims.shard, dims.replicate
        return DataParallelMeshDims(
            shard=tuple(shard) if isinstance(shard, list) else shard,
            replicate=tuple(replicate) if isinstance(replicate, list) else replicate,
        )
    raise TypeError(
        f"dp_mesh_dims of {where} must be an fsdp_compose.DataParallelMeshDims or a "
        f"torch.distributed.fsdp.DataParallelMeshDims (or None), got {_qualname(dims)}"
    )


# When a unit gathered for its backward issues its implicit prefetch (the next unit's all-gather):
# "before" its backward (FSDP2's timing), "midway" through it (the default), "after" it (FSDP1's BACKWARD_POST).
# See fc.set_backward_prefetch_point.
PrefetchPoint = Literal["before", "midway", "after"]
PREFETCH_POINTS: tuple[PrefetchPoint, ...] = ("before", "midway", "after")
