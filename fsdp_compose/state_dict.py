"""Full (unsharded) state dicts: gather to plain tensors, and load plain tensors into a sharded module.

``module.state_dict()`` already returns the sharded DTensors (no communication) and works with
``torch.distributed.checkpoint`` for saving on N ranks and loading on M. These two functions are for the other
direction: a consolidated checkpoint (e.g. for export or for a Hugging Face-style file) and loading one that only
rank 0 read from disk.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .offload import collective_device

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(module: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Plain tensors equal to the unsharded module's ``state_dict()``.

    Every rank must call it (each DTensor is gathered with a collective). With ``rank0_only`` the other ranks get an
    empty dict, and with ``cpu_offload`` the tensors are moved to CPU one at a time, so at most one full parameter
    per rank is on the device at once.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    result: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        full = _on_mesh_device(value).full_tensor() if isinstance(value, DTensor) else value
        if keep:
            result[key] = (full.cpu() if cpu_offload else full).detach()
    return result


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, broadcast_from_rank0: bool = False
) -> None:
    """Load a full (unsharded) state dict into a sharded module: each rank keeps its own rows.

    With ``broadcast_from_rank0`` only rank 0 needs ``state_dict`` (other ranks may pass ``{}``); tensors are
    broadcast one at a time. Keys and shapes are checked first (on rank 0, the verdict shared with every rank), so a
    wrong checkpoint raises the same ``ValueError`` everywhere and leaves the module as it was.
    """
    targets = module.state_dict()
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = _check(targets, state_dict) if (rank == 0 or not broadcast_from_rank0) else None
    if broadcast_from_rank0:
        verdict: list[str | None] = [problem]
        dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
    if problem is not None:
        raise ValueError(problem)
    with torch.no_grad():
        for key, target in targets.items():
            local_target = target.to_local() if isinstance(target, DTensor) else target
            if broadcast_from_rank0:
                device = collective_device(target)  # the mesh's, also where the shard is in host memory
                full = state_dict[key].to(device) if rank == 0 else None
                if full is None:
                    full = torch.empty(target.shape, dtype=target.dtype, device=device)
                dist.broadcast(full, src=0)
            else:
                full = state_dict[key]
            piece = _local_piece(full, target) if isinstance(target, DTensor) else full
            local_target.copy_(piece)


def _on_mesh_device(value: DTensor) -> DTensor:
    """``value`` with its local tensor on the mesh's device, where its collectives run (a no-op unless offloaded)."""
    local = value.to_local()
    device = collective_device(value)
    if local.device.type == device.type:
        return value
    return DTensor.from_local(
        local.to(device),
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _check(targets: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> str | None:
    missing = sorted(set(targets) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(targets))
    if missing or unexpected:
        return f"full state dict does not match the module: missing keys {missing}, unexpected keys {unexpected}"
    for key, target in targets.items():
        value = state_dict[key]
        if tuple(value.shape) != tuple(target.shape):
            return (
                f"full state dict entry '{key}' has shape {tuple(value.shape)}, the module's parameter has "
                f"{tuple(target.shape)}; load a checkpoint of the same model configuration"
            )
    return None


def _local_piece(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` for ``target``'s placements (``torch.chunk`` semantics on every cut).

    Plain shards apply in mesh-dim order; a ``_StridedShard`` (FSDP on a dim TP already cut) applies after them,
    on the piece they left: exactly how fully_shard built the local tensor.
    """
    coordinate = target.device_mesh.get_coordinate()
    assert coordinate is not None
    mesh = target.device_mesh
    placements: list[tuple[int, Placement]] = list(enumerate(target.placements))
    ordered = [p for p in placements if not isinstance(p[1], _StridedShard)]
    ordered += [p for p in placements if isinstance(p[1], _StridedShard)]
    piece = full
    for mesh_dim, placement in ordered:
        if isinstance(placement, (Shard, _StridedShard)):
            chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece
