"""Mesh roles and where each parameter lives.

The ``mesh`` given to ``fully_shard`` is the data-parallel mesh: 1-D (shard) or 2-D (replicate, shard) for HSDP.
A parameter that is already a DTensor (tensor parallel, from ``parallelize_module`` on a mesh sharing the same root
mesh) keeps its TP placements; FSDP shards its *local* TP tensor on dim 0 (or the dim ``k`` that
``shard_placement_fn`` chose). The resulting DTensor lives on the combined mesh, data-parallel dims first::

    1-D FSDP           (Shard(k),)
    HSDP               (Replicate(), Shard(k))
    FSDP + TP          (Shard(k) | _StridedShard(k, split_factor=tp), *tp_placements)
    HSDP + TP          (Replicate(), Shard(k) | _StridedShard(...), *tp_placements)

``_StridedShard`` says that dim ``k`` was split by TP first and then by FSDP, so ``full_tensor()`` reassembles rows in
the right order. Parameters kept whole (0-dim, or frozen under ``frozen_params="replicate"``) use ``Replicate()``
on the data-parallel dims.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .policies import DataParallelMeshDims

logger = logging.getLogger(__name__)

__all__ = [
    "REDUCE_SCATTER_GROUP_DESC",
    "REPLICA_REDUCE_GROUP_DESC",
    "DataParallelMesh",
    "ParamPlacing",
    "PostForwardGroup",
    "check_dp_mesh",
    "check_post_forward_size",
    "dp_mesh_from_dims",
    "is_c10d_group",
    "param_placing",
    "post_forward_group",
    "post_forward_group_for",
    "reduce_scatter_group",
    "replica_reduce_group",
    "reshard_after_forward_setting",
    "spmd_param_placing",
    "spmd_sharded_mesh",
]


def check_dp_mesh(mesh: DeviceMesh, owner: str, *, roles_named: bool = False) -> None:
    """Raise a clear error for a mesh ``fully_shard`` cannot use (before anything is touched, no collective).

    ``roles_named``: the mesh came from ``dp_mesh_dims``, which says which dim replicates and which shards, so the
    guesses from dim names below do not apply."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"fully_shard on {owner}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() before building the mesh"
        )
    if mesh.device_type == "meta":
        raise ValueError(
            f"fully_shard on {owner} got a 'meta' mesh; the mesh says where the unit computes and "
            'communicates: build it on a real device (e.g. init_device_mesh("cuda", (world_size,))). To create '
            "parameters without memory, build the module under torch.device('meta') instead"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard on {owner}: this rank ({dist.get_rank()}) is not part of the mesh (ranks "
            f"{mesh.mesh.flatten().tolist()}); call fully_shard only on the mesh's ranks, or build the mesh over the "
            "ranks that hold this module"
        )
    for dim in range(mesh.ndim):
        try:
            mesh.get_group(dim)
        except RuntimeError as error:
            raise ValueError(
                f"fully_shard on {owner} got a mesh without process groups ({error}); build it with "
                "init_device_mesh(...) or DeviceMesh(...) without _init_backend=False"
            ) from None
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard takes a 1-D (shard) or 2-D (replicate, shard) data-parallel mesh, got {mesh.ndim}-D "
            f"{mesh.mesh_dim_names or ''}; for FSDP + TP pass the data-parallel part, e.g. mesh['dp'] or "
            "mesh['replicate', 'shard']"
        )
    if mesh.ndim == 2 and not roles_named:
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                "a 2-D mesh for HSDP needs mesh_dim_names, (replicate, shard) in that order: "
                'init_device_mesh(device, (replicas, shards), mesh_dim_names=("replicate", "shard"))'
            )
        first, second = (n.lower() for n in names)
        if {"tp", "cp", "pp", "ep"} & {first, second}:
            raise ValueError(
                f"mesh dims {names} look like a data-parallel x model-parallel mesh; fully_shard takes the "
                "data-parallel part only: pass mesh['dp'] (or mesh['replicate', 'shard'] for HSDP)"
            )
        if "shard" in first and "rep" in second:
            raise ValueError(
                f"mesh dims {names} look swapped: an HSDP mesh is (replicate, shard) — replicas on dim 0, the "
                "shard group on dim 1; build it with mesh_dim_names=(replicate, shard)"
            )


def dp_mesh_from_dims(mesh: DeviceMesh, dims: DataParallelMeshDims, owner: str) -> DeviceMesh:
    """The data-parallel mesh named by ``dims`` inside the full SPMD ``mesh``: ``(shard,)`` or ``(replicate, shard)``,
    several names of one role flattened into one dim (as torch's ``fully_shard`` does). Raises before any
    collective for names the mesh lacks; flattening creates process groups (every rank makes the same call)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"fully_shard on {owner}: dp_mesh_dims names mesh dims, but the mesh has no mesh_dim_names; build it "
            'with init_device_mesh(..., mesh_dim_names=("dp", "tp"))'
        )
    shard, replicate = dims.shard_names, dims.replicate_names
    for name in shard + replicate:
        if name not in names:
            raise ValueError(f"fully_shard on {owner}: dp_mesh_dims names mesh dim {name!r}, not in mesh dims {names}")
    if len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(f"fully_shard on {owner}: dp_mesh_dims names a mesh dim twice: {dims}")
    positions = [names.index(name) for name in shard]
    if positions and positions != list(range(positions[0], positions[0] + len(positions))):
        # The sharded parameters' mesh puts the flattened shard dims where the first of them was (torch's layout):
        # they must be neighbours, in mesh order, for that mesh to keep the others' order.
        raise NotImplementedError(
            f"fully_shard on {owner}: dp_mesh_dims shard dims {shard} must be adjacent dims of the mesh {names}, in "
            "its order; reorder them, or build the mesh with them next to each other"
        )

    def one_dim(role: tuple[str, ...]) -> DeviceMesh:
        return mesh[role[0]] if len(role) == 1 else mesh[role]._flatten("_".join(role))

    if not shard:
        # Pure replication (torch's DDP-style dp_mesh_dims): HSDP with a shard dim of one rank. Parameters stay
        # whole (Replicate() on the full mesh, as torch places them) and gradients are all-reduced over replicas.
        replicas = one_dim(replicate)
        name = replicas.mesh_dim_names[0]  # type: ignore[index]
        return replicas._unflatten(0, (replicas.size(), 1), (name, f"{name}{_UNSHARDED_SUFFIX}"))
    if not replicate:
        return one_dim(shard)
    if len(shard) == 1 and len(replicate) == 1:
        return mesh[replicate[0], shard[0]]
    return DeviceMesh._concatenate([one_dim(replicate), one_dim(shard)])


# The size-1 shard dim fsdp_compose adds under a replicate-only dp_mesh_dims (it never appears in placements).
_UNSHARDED_SUFFIX = "_fc_unsharded"


def _check_composable_dtensor(fqn: str, param: DTensor, owner: str, what: str, zero_dim_fix: str) -> None:
    """A DTensor parameter fully_shard can shard further: Shard(dim) / Replicate() placements, at least 1-D."""
    for placement in param.placements:
        if not isinstance(placement, (Shard, Replicate)) or isinstance(placement, _StridedShard):
            raise ValueError(
                f"parameter '{fqn}' of {owner} has {what} {placement}; fully_shard composes with Shard(dim) and "
                "Replicate() parameters"
            )
    if param.ndim == 0:
        raise ValueError(f"parameter '{fqn}' of {owner} is a 0-dim DTensor; {zero_dim_fix}")


def spmd_sharded_mesh(mesh: DeviceMesh, dims: DataParallelMeshDims, dp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of the sharded parameters under ``dp_mesh_dims`` (torch's ``_build_spmd_sharding_spec``): ``mesh``
    itself for one shard dim; for several, the data-parallel mesh ``dp_mesh`` (the shard dims flattened into one,
    after the flattened replicate dims for HSDP) where the first shard dim was, then the other non-data-parallel
    dims in order."""
    if len(dims.shard_names) <= 1:
        return mesh
    names = mesh.mesh_dim_names
    assert names is not None  # checked by dp_mesh_from_dims
    data_parallel = set(dims.shard_names + dims.replicate_names)
    first = dims.shard_names[0]
    parts = [dp_mesh if name == first else mesh[name] for name in names if name == first or name not in data_parallel]
    return parts[0] if len(parts) == 1 else DeviceMesh._concatenate(parts)


def spmd_param_placing(
    fqn: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    dims: DataParallelMeshDims,
    owner: str,
    shard_dim: int = 0,
    sharded_mesh: DeviceMesh | None = None,
) -> ParamPlacing:
    """With ``dp_mesh_dims``: the placing of a DTensor parameter on the full SPMD ``mesh``, which it keeps.

    Forward sees the parameter on ``mesh`` with its own placements (``Replicate()`` on the data-parallel dims); the
    sharded parameter replaces that ``Replicate()`` by ``Shard(0)`` on the shard dim, as torch's ``fully_shard`` does.
    With several shard dims it lives on ``sharded_mesh`` (``spmd_sharded_mesh``): their rows are chunked over the
    flattened shard group. Raises (nothing changed) unless ``param`` is a DTensor on ``mesh`` replicated on every
    data-parallel dim."""
    if not isinstance(param, DTensor):
        raise ValueError(
            f"fully_shard on {owner} with dp_mesh_dims: parameter '{fqn}' is a plain tensor; every parameter must be "
            "a DTensor on the full mesh (e.g. distribute_tensor(p, mesh, [Replicate()] * mesh.ndim)), or drop "
            "dp_mesh_dims and pass the data-parallel mesh"
        )
    if param.device_mesh != mesh:
        raise ValueError(
            f"fully_shard on {owner} with dp_mesh_dims: parameter '{fqn}' lives on mesh {param.device_mesh}, not on "
            f"the mesh passed to fully_shard ({mesh}); distribute it on that mesh"
        )
    names = mesh.mesh_dim_names
    assert names is not None  # checked by dp_mesh_from_dims
    data_parallel = set(dims.shard_names + dims.replicate_names)
    for name, placement in zip(names, param.placements, strict=True):
        if name in data_parallel and not isinstance(placement, Replicate):
            raise ValueError(
                f"fully_shard on {owner} with dp_mesh_dims: parameter '{fqn}' has placement {placement!r} on "
                f"data-parallel mesh dim {name!r}; it must be Replicate() there (fully_shard shards it)"
            )
    _check_composable_dtensor(fqn, param, owner, "placement", "keep it a plain tensor or a buffer")
    positions = tuple((names.index(n), "replicate") for n in dims.replicate_names)
    # every shard dim (none with replicate= only: the parameter is whole on every data-parallel dim)
    positions += tuple((names.index(n), "shard") for n in dims.shard_names)
    return ParamPlacing(
        param.shape,
        tuple(param.stride()),
        param.to_local().shape,
        sharded_mesh if sharded_mesh is not None else mesh,
        mesh,
        tuple(param.placements),
        shard_dim=shard_dim,
        dp_positions=positions,
    )


def is_c10d_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is one of c10d's own process groups (``init_process_group``, ``new_group``, a DeviceMesh's):
    fixed members, and every collective combines every member's values or fails.

    A Python subclass implements its collectives itself and may mean something else by them: torchft's
    ``ManagedProcessGroup`` reports the live replica count as its ``size()`` (DeviceMesh sees 1 rank), zeroes the
    inputs of a replica that is healing, and turns a failed collective into a no-op that leaves this rank's values
    as they were (the step is then not committed). Gradients survive that (torchft discards the step); values every
    rank must leave with the same (a step's agreement, collective checks) do not."""
    return type(group) is dist.ProcessGroup


@dataclass(frozen=True)
class DataParallelMesh:
    """The data-parallel mesh's roles: the shard group (gathers, reduce-scatters) and the optional replicate group.

    ``replicate_size`` is the mesh's replicate dim, fixed at ``fully_shard``; ``grads.divide_factors`` asks the
    replicate group at the time of the reduction (a torchft group's size is the number of replicas in this step's
    quorum)."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    # The all-reduces over replicas go over this group where it is not the replicate group (``replica_reduce_group``)
    replica_reduce_group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, mesh: DeviceMesh) -> DataParallelMesh:
        shard_dim = mesh.ndim - 1
        replicate = mesh.ndim == 2
        return cls(
            mesh=mesh,
            shard_group=mesh.get_group(shard_dim),
            shard_rank=mesh.get_local_rank(shard_dim),
            shard_size=mesh.size(shard_dim),
            replicate_group=mesh.get_group(0) if replicate else None,
            replicate_size=mesh.size(0) if replicate else 1,
        )

    @property
    def reduce_replicas(self) -> dist.ProcessGroup | None:
        """The group HSDP's all-reduces over replicas go over (None: no replicas)."""
        return self.replica_reduce_group or self.replicate_group

    @property
    def size(self) -> int:
        """All data-parallel ranks of the mesh: replicate x shard."""
        return self.shard_size * self.replicate_size

    @property
    def agreement_groups(self) -> list[dist.ProcessGroup]:
        """The groups a step's control values (the backward's agreement, collective checks) are all-reduced over:
        the shard group, and the replicate group where it is one of c10d's (``is_c10d_group``); each only where it
        has other ranks. A managed replicate group is left to its manager: its failures end the step there."""
        groups = [self.shard_group]
        if self.replicate_group is not None and is_c10d_group(self.replicate_group):
            groups.append(self.replicate_group)
        return [g for g in groups if dist.get_world_size(g) > 1]

    def placements(self, *, whole: bool, split_factor: int, dim: int = 0) -> tuple[Placement, ...]:
        if whole:
            shard: Placement = Replicate()
        elif split_factor > 1:
            shard = _StridedShard(dim, split_factor=split_factor)
        else:
            shard = Shard(dim)
        return (Replicate(), shard) if self.replicate_group is not None else (shard,)


@dataclass(frozen=True)
class ParamPlacing:
    """Where one parameter lives before FSDP (TP part) and what FSDP shards (``local_shape``'s dim ``shard_dim``)."""

    global_shape: torch.Size
    global_stride: tuple[int, ...]
    local_shape: torch.Size  # the TP-local shape, or the global shape for a plain tensor
    spmd_mesh: DeviceMesh  # data-parallel dims, then TP dims
    tp_mesh: DeviceMesh | None
    tp_placements: tuple[Placement, ...]
    shard_dim: int = 0  # the dim FSDP shards (``shard_placement_fn``), normalized: 0 <= shard_dim < ndim
    # With dp_mesh_dims: (position in the full mesh, "replicate" | "shard") of each data-parallel dim. The parameter
    # then lives on the full mesh (tp_mesh == spmd_mesh, tp_placements with Replicate() there) and the data-parallel
    # placements go at these positions instead of in front; with several shard dims the sharded parameter lives on
    # the flattened mesh instead (spmd_mesh, see ``spmd_sharded_mesh``).
    dp_positions: tuple[tuple[int, str], ...] = ()

    @property
    def split_factor(self) -> int:
        """How many TP pieces the shard dim was already cut into before FSDP's (1 when TP does not shard that dim):
        TP dims after the data-parallel shard dim in mesh order (all of them when data-parallel dims come first)."""
        factor = 1
        assert self.tp_mesh is None or self.tp_mesh.ndim == len(self.tp_placements)
        after = max((position for position, role in self.dp_positions if role == "shard"), default=-1)
        for dim, placement in enumerate(self.tp_placements):
            if dim > after and isinstance(placement, Shard) and placement.dim == self.shard_dim:
                assert self.tp_mesh is not None
                factor *= self.tp_mesh.size(dim)
        return factor

    @property
    def dp_dims(self) -> frozenset[int]:
        """Positions in ``tp_placements`` that are data-parallel (with dp_mesh_dims; else none)."""
        return frozenset(position for position, _ in self.dp_positions)

    def sharded_placements(self, dp_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """The sharded parameter's placements on ``spmd_mesh`` from the data-parallel ones ((replicate,) shard)."""
        if not self.dp_positions:
            return (*dp_placements, *self.tp_placements)
        shard_positions = [position for position, role in self.dp_positions if role == "shard"]
        if len(shard_positions) > 1:
            # Several shard dims (``spmd_sharded_mesh``): the data-parallel placements in one block where the first
            # shard dim was, on the flattened data-parallel mesh; the other data-parallel dims are not in that mesh.
            dropped = self.dp_dims
            placements: list[Placement] = []
            for position, placement in enumerate(self.tp_placements):
                if position == shard_positions[0]:
                    placements.extend(dp_placements)
                elif position not in dropped:
                    placements.append(placement)
            return tuple(placements)
        merged = list(self.tp_placements)
        shard = dp_placements[-1]
        for position, role in self.dp_positions:
            merged[position] = shard if role == "shard" else Replicate()
        return tuple(merged)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _root(mesh: DeviceMesh) -> DeviceMesh:
    return mesh._get_root_mesh()  # torch >= 2.10 (compat.MIN_TORCH)


def _combined_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh of a sharded TP (or EP) parameter: the data-parallel dims, then the parameter's own, related by the
    ranks they hold (their layouts over one world), not by the names of a common root: torchtitan's meshes are slices
    of several splits of one 1-D world mesh, none of which holds every name. The dims keep their process groups.
    None where they do not compose (unnamed, from different worlds, or overlapping ranks)."""
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    if dp_names is None or tp_names is None:
        return None
    root = _root(dp_mesh)
    names = (*dp_names, *tp_names)
    if set(names) <= set(root.mesh_dim_names or ()) and root[tp_names] == tp_mesh:
        return root[names]  # one init_device_mesh names both: its slice, which torch caches
    # One per pair, kept on the data-parallel mesh: every parameter of every unit on the pair asks for it again, and
    # building a mesh reads rank tensors (which a FakeTensorMode run, the planner's, cannot do after its setup).
    cache = _mesh_cache(dp_mesh, _COMBINED_MESHES_ATTR)
    key = (tp_names, tuple(str(tp_mesh.get_group(dim).group_name) for dim in range(tp_mesh.ndim)))
    if key not in cache:
        try:
            cache[key] = DeviceMesh._concatenate([dp_mesh, tp_mesh])
        except RuntimeError:
            cache[key] = None
    return cache[key]  # type: ignore[no-any-return]


# Attribute on a data-parallel DeviceMesh caching its meshes combined with a parameter's own mesh (see above).
_COMBINED_MESHES_ATTR = "_fsdp_compose_combined_meshes"


def param_placing(fqn: str, param: nn.Parameter, dp_mesh: DeviceMesh, owner: str, shard_dim: int = 0) -> ParamPlacing:
    """The placing of ``param`` under ``dp_mesh``; raises a clear error for a DTensor FSDP cannot compose with."""
    if not isinstance(param, DTensor):
        return ParamPlacing(param.shape, contiguous_stride(param.shape), param.shape, dp_mesh, None, (), shard_dim)
    tp_mesh = param.device_mesh
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    if dp_names is not None and tp_names is not None and set(dp_names) & set(tp_names):
        raise ValueError(
            f"parameter '{fqn}' of {owner} is tensor parallel on mesh dims {tp_names}, which the data-parallel mesh "
            f"{dp_names} includes; pass only the data-parallel part to fully_shard, e.g. mesh['dp']"
        )
    spmd_mesh = _combined_mesh(dp_mesh, tp_mesh)
    if spmd_mesh is None:
        raise ValueError(
            f"parameter '{fqn}' of {owner} is a DTensor on a mesh {tp_names or tp_mesh} whose ranks do not compose "
            f"with the data-parallel mesh {dp_names or dp_mesh} (each must be a named slice of one world: every "
            "data-parallel group crossing every group of the parameter's mesh once); build both from one "
            'init_device_mesh(..., mesh_dim_names=("dp", "tp")), or by splitting one world mesh, and pass mesh["dp"] '
            "to fully_shard"
        )
    _check_composable_dtensor(fqn, param, owner, "tensor-parallel placement", "keep it out of tensor parallel")
    return ParamPlacing(
        param.shape,
        tuple(param.stride()),
        param.to_local().shape,
        spmd_mesh,
        tp_mesh,
        tuple(param.placements),
        shard_dim,
    )


class _GroupCache(dict[Any, Any]):
    """Process groups cached in a mesh's ``__dict__``. ``copy.deepcopy`` of the mesh shares the cache (the groups
    are the process's, like the ones the mesh itself holds), and pickling drops it (rebuilt on first use). A plain
    dict of process groups would make the mesh uncopyable, and torch.compile deep-copies the mesh of every DTensor
    it guards on (a tensor-parallel parameter in a compiled block)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _GroupCache:
        return self

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_GroupCache, ())


def _mesh_cache(mesh: DeviceMesh, attr: str) -> _GroupCache:
    cache = mesh.__dict__.get(attr)
    if not isinstance(cache, _GroupCache):
        cache = mesh.__dict__[attr] = _GroupCache()
    return cache


# Attribute on a data-parallel DeviceMesh caching its post-forward groups by size: every unit resharding to groups of
# the same size on that mesh shares them (process groups are costly to create). It lives on the mesh instance.
_POST_FORWARD_GROUPS_ATTR = "_fsdp_compose_post_forward_groups"


@dataclass(frozen=True)
class PostForwardGroup:
    """``reshard_after_forward=k``: the group of ``k`` consecutive shard ranks this rank re-gathers from in backward.

    Member ``position`` of the group keeps segments ``[position * W/k, (position + 1) * W/k)`` of the unit's
    all-gathered buffer, so an all-gather over the group yields all ``W`` segments in order.
    """

    group: dist.ProcessGroup
    size: int
    position: int


def check_post_forward_size(value: int, shard_size: int, owner: str) -> None:
    """Raise (before any collective) unless ``value`` divides the shard group's size."""
    if value < 1 or shard_size % value:
        divisors = [d for d in range(1, shard_size + 1) if shard_size % d == 0]
        raise ValueError(
            f"reshard_after_forward={value} for {owner}: an int is the size of the group parameters are resharded to "
            f"after forward and must divide the shard group's size {shard_size}; use one of {divisors} "
            "(or True / False)"
        )


def post_forward_group(mesh: DeviceMesh, size: int) -> PostForwardGroup:
    """The post-forward group of ``size`` consecutive ranks of ``mesh``'s shard dim (collective: call on every rank)."""
    cache: dict[int, PostForwardGroup] = _mesh_cache(mesh, _POST_FORWARD_GROUPS_ATTR)
    if size in cache:
        return cache[size]
    shard_dim = mesh.ndim - 1
    shard_size = mesh.size(shard_dim)
    names = mesh.mesh_dim_names
    return _new_post_forward_group(mesh, size, shard_dim, shard_size, names, cache)


def _new_post_forward_group(
    mesh: DeviceMesh,
    size: int,
    shard_dim: int,
    shard_size: int,
    names: tuple[str, ...] | None,
    cache: dict[int, PostForwardGroup],
) -> PostForwardGroup:
    if names is not None:
        # Splitting the shard dim with DeviceMesh keeps group creation consistent on every rank of the root mesh,
        # including for a data-parallel submesh of a (dp, tp) mesh.
        inner = f"{names[shard_dim]}_fc_post_forward_{size}"
        split = mesh[names[shard_dim]]._unflatten(0, (shard_size // size, size), (f"{inner}_outer", inner))
        group = split.get_group(inner)
    else:
        # An unnamed mesh is a root 1-D mesh (slicing needs names): its rank tensor lists every rank.
        rows = mesh.mesh.reshape(-1, size).tolist()
        group, _ = dist.new_subgroups_by_enumeration(rows)
    assert group is not None
    result = PostForwardGroup(group, size, dist.get_rank(group))
    cache[size] = result
    return result


REPLICA_REDUCE_GROUP_DESC = "fsdp_compose_replica_all_reduce"


def replica_reduce_group(dp: DataParallelMesh) -> DataParallelMesh:
    """``dp`` with a group of its own for the all-reduces over replicas where the replicate dim spans the whole world
    (a shard group of one rank: HSDP as pure replication, an expert mesh whose experts every rank holds).

    Such a dim's group is torch's default group, which every 1-D mesh over the world all-gathers on. An all-reduce
    over replicas goes out once its unit's reduce-scatter completes, at a point of the backward that differs between
    ranks (a unit some ranks do not run reduces at its turn), so on one communicator with all-gathers it could meet
    them in another order on each rank: a hang. As for reduce-scatters (``reduce_scatter_group``), one group, found
    again in torch's registry by any later unit; a managed group (torchft) is left to its manager.
    """
    group = dp.replicate_group
    world = dist.get_world_size()
    if group is None or not is_c10d_group(group) or world == 1 or dist.get_world_size(group) != world:
        return dp
    return dataclasses.replace(dp, replica_reduce_group=_world_group(REPLICA_REDUCE_GROUP_DESC))


def _world_group(desc: str) -> dist.ProcessGroup:
    """A group of every rank, ours for the role ``desc`` names: found again in torch's registry by any later unit,
    else created (collective over the default group, as every rank makes the same ``fully_shard`` calls)."""
    world = dist.get_world_size()
    registry: dict[dist.ProcessGroup, dict[int, int]] = dist.distributed_c10d._world.pg_group_ranks
    for group, members in registry.items():
        if len(members) == world and getattr(group, "group_desc", None) == desc:
            return group
    created: dist.ProcessGroup = dist.new_group(list(range(world)), group_desc=desc)
    return created


REDUCE_SCATTER_GROUP_DESC = "fsdp_compose_reduce_scatter"
# Attribute on a root DeviceMesh caching the reduce-scatter groups of its dims, by dim name (see below).
_REDUCE_SCATTER_GROUPS_ATTR = "_fsdp_compose_reduce_scatter_groups"


def reduce_scatter_group(dp: DataParallelMesh) -> dist.ProcessGroup:
    """A process group of the shard group's ranks, for reduce-scatters only.

    All-gathers and reduce-scatters of one shard group then never share a communicator, so they need not be issued
    in the same order on every rank: a unit whose output reaches the loss on some ranks only reduces at its
    post-backward on those ranks and in the final callback on the others, while the all-gathers of the remaining
    backward go on in between (on NCCL the two also overlap). Reduce-scatters themselves follow one fixed order
    (see step.py).

    Creating groups is collective over the default group, and every rank must make the same calls in the same
    order (torch names groups by a per-process counter), so the groups are made for every shard group of the root
    mesh at once: when the shard group is the whole world, one group, found again in torch's registry by any later
    unit (``mesh=None`` builds a mesh per call); for a named dim of a root mesh spanning the world, one group per
    slice of that dim, cached on the root mesh. Other meshes (an unnamed mesh over part of the world, a root mesh
    over part of it) reduce-scatter on the shard group itself, and rely on every rank using the same units.
    """
    if dp.shard_size == 1:
        return dp.shard_group
    world = dist.get_world_size()
    if len(dist.get_process_group_ranks(dp.shard_group)) == world:
        return _world_group(REDUCE_SCATTER_GROUP_DESC)
    mesh = dp.mesh
    names = mesh.mesh_dim_names
    root = _root(mesh)
    root_names = root.mesh_dim_names or ()
    if names is None or names[-1] not in root_names or root.size() != world:
        logger.debug("reduce-scatters of mesh %s share the all-gather group", mesh)
        return dp.shard_group
    cache: dict[str, dist.ProcessGroup] = _mesh_cache(root, _REDUCE_SCATTER_GROUPS_ATTR)
    name = names[-1]
    if name not in cache:
        slices = root.mesh.movedim(root_names.index(name), -1).reshape(-1, dp.shard_size).tolist()
        group, _ = dist.new_subgroups_by_enumeration(slices, group_desc=REDUCE_SCATTER_GROUP_DESC)
        assert group is not None
        cache[name] = group
    return cache[name]


# ---------------------------------------------------------------------- reshard_after_forward
def reshard_after_forward_setting(
    value: object, mesh: DeviceMesh, owner: str, *, allow_none: bool = True
) -> bool | int | None:
    """Check ``reshard_after_forward`` and normalize it: an int that equals the shard group's size is True, 1 is
    False (every rank keeps everything); any other int stays (a post-forward group of that size)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward for {owner} must be None, a bool or an int, got {value!r}")
    shard_size = mesh.size(mesh.ndim - 1)
    check_post_forward_size(value, shard_size, owner)
    if value == shard_size:
        return True
    if value == 1:
        return False
    return value


def post_forward_group_for(setting: bool | int | None, mesh: DeviceMesh) -> PostForwardGroup | None:
    """The group an int setting (normalized, so ``1 < k < W``) reshards to after forward; None for the others."""
    if isinstance(setting, int) and not isinstance(setting, bool):
        return post_forward_group(mesh, setting)
    return None
