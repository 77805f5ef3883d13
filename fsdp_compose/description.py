"""``fc.describe(model)``: what ``fully_shard`` made of a model, as text; the first thing to run when in doubt.

For every sharded unit under the module (pre-order, the root first): its module path, its mesh (shape, dim names,
device type), its mixed-precision policy and settings, and every parameter with its global shape, dtype, placements,
local shard shape and bytes. Shard bytes are this rank's (``local bytes``, no communication); with
``all_ranks=True`` every rank of each unit's shard group reports its own (a collective: call it on every rank).
Parameters of the module that no unit manages (``ignored_params``, or modules outside every ``fully_shard`` call) are
listed at the end.

``describe`` reads the model and changes nothing; it works before the first forward, between steps and while a unit
is gathered. ``describe_units`` returns the same information as data.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .api import get_state
from .policies import MixedPrecisionPolicy
from .program import StepSchedule, unit_names
from .state import reshards_after_forward, states_under

if TYPE_CHECKING:
    from .state import ShardState

__all__ = ["ParamDescription", "UnitDescription", "describe", "describe_units", "print_description"]


@dataclass(frozen=True)
class ParamDescription:
    """One managed parameter as this rank holds it."""

    name: str  # path from the described module
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype  # the sharded parameter's dtype (optimizer state and .grad have it too)
    placements: tuple[Placement, ...]  # the DTensor's placements, data-parallel dims first
    mesh_shape: tuple[int, ...]  # the DTensor's mesh: the unit's mesh, plus the TP dims for a TP parameter
    mesh_dim_names: tuple[str, ...] | None
    local_shape: tuple[int, ...]  # this rank's shard
    local_bytes: int
    device: torch.device  # where this rank's shard lives (host memory under CPU offload)
    requires_grad: bool
    kept_whole: bool  # never communicated: 0-dim, or frozen under frozen_params="replicate"


@dataclass(frozen=True)
class UnitDescription:
    """One ``fully_shard`` call: its modules, mesh, policy, settings and parameters."""

    paths: tuple[str, ...]  # module paths from the described module ("" is the module itself)
    module_types: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    device_type: str
    shard_rank: int  # this rank's index in the unit's shard group (the last mesh dim)
    shard_size: int
    mp_policy: MixedPrecisionPolicy
    compute_dtype: torch.dtype  # what the all-gather and forward/backward use: param_dtype, else the parameters'
    reduce_dtype: torch.dtype  # what gradients are reduced (and accumulated) in: reduce_dtype, else compute_dtype
    reshard_after_forward: bool | int
    reshard_after_backward: bool
    requires_gradient_sync: bool
    params: tuple[ParamDescription, ...]
    bytes_per_shard_rank: tuple[int, ...] | None  # filled by all_ranks=True; index = shard rank

    @property
    def local_bytes(self) -> int:
        """Bytes of this rank's shards of the unit's parameters (the sum of the local tensors' nbytes)."""
        return sum(p.local_bytes for p in self.params)


def describe_units(module: nn.Module, *, all_ranks: bool = False) -> list[UnitDescription]:
    """Every sharded unit under ``module`` (pre-order), as data. ``all_ranks``: see :func:`describe`."""
    paths = _module_paths(module)
    states = states_under(module)
    units = [_describe_unit(state, paths, outermost=i == 0) for i, state in enumerate(states)]
    if all_ranks:
        units = _gather_bytes(units, states)
    return units


def describe(module: nn.Module, *, all_ranks: bool = False, params: bool = True) -> str:
    """A readable report of how ``module`` is sharded on this rank: units, meshes, policies, settings, parameters.

    Reads only this rank's objects unless ``all_ranks=True``, which adds the shard bytes of every rank of each
    unit's shard group; that gathers over those groups, so every rank must call it (then print on one rank, or use
    :func:`print_description`). ``params=False``: one line per unit instead of a parameter table per unit.
    """
    units = describe_units(module, all_ranks=all_ranks)
    return _render(module, units, _unmanaged(module, units), params=params)


def print_description(
    module: nn.Module,
    *,
    all_ranks: bool = False,
    params: bool = True,
    file: TextIO | None = None,
    ranks: Sequence[int] | None = (0,),
) -> None:
    """Write :func:`describe`'s report to ``file`` (default ``sys.stdout``) on the given global ``ranks`` (None:
    every rank). With ``all_ranks=True`` every rank must call it (the report gathers shard bytes)."""
    text = describe(module, all_ranks=all_ranks, params=params)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or rank in ranks:
        out = sys.stdout if file is None else file
        out.write(text + "\n")
        out.flush()


# ---------------------------------------------------------------------- collecting
def _module_paths(module: nn.Module) -> dict[int, str]:
    return {id(sub): path for path, sub in module.named_modules(remove_duplicate=True)}


def _mesh_names(mesh: DeviceMesh) -> tuple[str, ...] | None:
    names = mesh.mesh_dim_names
    return tuple(names) if names is not None else None


def _param_name(state: ShardState, fqn: str, paths: dict[int, str]) -> str:
    """The parameter's path from the described module (``fqn`` is relative to the unit's module)."""
    modules = state.modules
    owner = modules[0]
    if len(modules) > 1:  # list form: the first module that has this parameter path
        for candidate in modules:
            try:
                candidate.get_parameter(fqn)
            except AttributeError:
                continue
            owner = candidate
            break
    prefix = paths.get(id(owner), "?")
    return f"{prefix}.{fqn}" if prefix else fqn


def _describe_param(name: str, param: DTensor, kept_whole: bool) -> ParamDescription:
    local = param.to_local()
    mesh = param.device_mesh
    return ParamDescription(
        name=name,
        shape=tuple(param.shape),
        dtype=param.dtype,
        placements=tuple(param.placements),
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=_mesh_names(mesh),
        local_shape=tuple(local.shape),
        local_bytes=local.numel() * local.element_size(),
        device=local.device,
        requires_grad=param.requires_grad,
        kept_whole=kept_whole,
    )


def _describe_unit(state: ShardState, paths: dict[int, str], *, outermost: bool) -> UnitDescription:
    mesh = state.mesh
    shard_dim = mesh.ndim - 1
    with torch.no_grad():
        params = tuple(
            _describe_param(_param_name(state, mp.fqn, paths), mp.sharded, mp.slot is None)
            for mp in state.params.shards.params
        )
    own = [p.dtype for p in params if p.shape] or [p.dtype for p in params] or [torch.float32]
    compute = state.mp_policy.param_dtype or own[0]
    return UnitDescription(
        paths=tuple(paths.get(id(m), "?") for m in state.modules),
        module_types=tuple(type(m).__name__ for m in state.modules),
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=_mesh_names(mesh),
        device_type=mesh.device_type,
        shard_rank=mesh.get_local_rank(shard_dim),
        shard_size=mesh.size(shard_dim),
        mp_policy=state.mp_policy,
        compute_dtype=compute,
        reduce_dtype=state.mp_policy.reduce_dtype or compute,
        reshard_after_forward=_reshard_after_forward(state, outermost=outermost),
        reshard_after_backward=state.reshard_after_backward,
        requires_gradient_sync=state.requires_gradient_sync,
        params=params,
        bytes_per_shard_rank=None,
    )


def _reshard_after_forward(state: ShardState, *, outermost: bool) -> bool | int:
    """The setting as it acts (``state.reshards_after_forward``); before the first forward no unit knows it is the
    root yet: the outermost unit under the described module is taken for it. ``k``: kept 1/k per rank."""
    setting = state.reshard_after_forward_setting
    if setting is not None and not isinstance(setting, bool):
        return int(setting)
    return reshards_after_forward(setting, is_root=outermost if state.root is None else state.root is state)


def _gather_bytes(units: list[UnitDescription], states: list[ShardState]) -> list[UnitDescription]:
    """Every shard rank's bytes per unit: one all_gather_object per distinct shard group, in a fixed order."""
    groups: dict[int, tuple[dist.ProcessGroup, int, list[int]]] = {}
    for i, state in enumerate(states):
        group = state.mesh.get_group(state.mesh.ndim - 1)
        entry = groups.setdefault(id(group), (group, state.mesh.size(state.mesh.ndim - 1), []))
        entry[2].append(i)
    per_unit: dict[int, tuple[int, ...]] = {}
    for group, size, indices in groups.values():
        mine = [units[i].local_bytes for i in indices]
        gathered: list[list[int] | None] = [None] * size
        dist.all_gather_object(gathered, mine, group=group)
        for position, i in enumerate(indices):
            per_unit[i] = tuple(rank_bytes[position] for rank_bytes in gathered if rank_bytes is not None)
    return [dataclasses.replace(unit, bytes_per_shard_rank=per_unit[i]) for i, unit in enumerate(units)]


def _unmanaged(module: nn.Module, units: list[UnitDescription]) -> list[str]:
    """Parameters under ``module`` that no unit manages (ignored, or outside every fully_shard call)."""
    # While a unit is gathered its modules hold the full parameters, under the names of the sharded ones; a tied
    # parameter is listed once, under its first name, by both.
    managed = {p.name for unit in units for p in unit.params}
    sharded = {id(mp.sharded) for state in states_under(module) for mp in state.params.shards.params}
    return [name for name, param in module.named_parameters() if name not in managed and id(param) not in sharded]


# ---------------------------------------------------------------------- rendering
def format_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_placement(placement: Placement) -> str:
    if isinstance(placement, _StridedShard):
        return f"_StridedShard({placement.dim}, split_factor={placement.split_factor})"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    return repr(placement)


def _format_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None) -> str:
    return f"{shape} {names}" if names is not None else f"{shape} (unnamed)"


def _dtype(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype).removeprefix("torch.")


def _table(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _policy(unit: UnitDescription) -> str:
    policy = unit.mp_policy
    return (
        f"param_dtype={_dtype(policy.param_dtype)} reduce_dtype={_dtype(policy.reduce_dtype)} "
        f"output_dtype={_dtype(policy.output_dtype)} cast_forward_inputs={policy.cast_forward_inputs}"
    )


def _effective_dtypes(unit: UnitDescription) -> str:
    return f"gathers and computes in {_dtype(unit.compute_dtype)}, reduces gradients in {_dtype(unit.reduce_dtype)}"


def _where(unit: UnitDescription) -> str:
    return ", ".join(f"{path or '<root>'} ({kind})" for path, kind in zip(unit.paths, unit.module_types, strict=True))


def _per_rank(unit: UnitDescription) -> str:
    if unit.bytes_per_shard_rank is None:
        return "-"
    return " / ".join(format_bytes(b) for b in unit.bytes_per_shard_rank)


def _placements(placements: tuple[Placement, ...]) -> str:
    inner = ", ".join(format_placement(p) for p in placements)
    return f"({inner},)" if len(placements) == 1 else f"({inner})"


def _render_unit(index: int, count: int, unit: UnitDescription) -> list[str]:
    lines = [
        f"unit {index}/{count}: {_where(unit)}",
        f"  mesh {_format_mesh(unit.mesh_shape, unit.mesh_dim_names)} on {unit.device_type}; "
        f"shard rank {unit.shard_rank} of {unit.shard_size}",
        f"  mp_policy: {_policy(unit)}",
        f"  dtypes: {_effective_dtypes(unit)}",
        f"  settings: reshard_after_forward={unit.reshard_after_forward} "
        f"reshard_after_backward={unit.reshard_after_backward} requires_gradient_sync={unit.requires_gradient_sync}",
    ]
    shard_bytes = f"  shard bytes: {format_bytes(unit.local_bytes)} on this rank"
    if unit.bytes_per_shard_rank is not None:
        shard_bytes += f"; per shard rank: {_per_rank(unit)}"
    lines.append(shard_bytes)
    if not unit.params:
        lines.append("  no parameters")
        return lines
    rows = [["parameter", "shape", "dtype", "placements", "local shape", "local bytes", "notes"]]
    for p in unit.params:
        notes = [] if p.requires_grad else ["frozen"]
        if p.kept_whole:
            notes.append("kept whole")
        if p.mesh_shape != unit.mesh_shape or p.mesh_dim_names != unit.mesh_dim_names:
            notes.append(f"TP, on mesh {_format_mesh(p.mesh_shape, p.mesh_dim_names)}")
        if p.device.type != unit.device_type:
            notes.append(f"shard on {p.device.type}")
        rows.append(
            [
                p.name,
                str(p.shape),
                _dtype(p.dtype),
                _placements(p.placements),
                str(p.local_shape),
                format_bytes(p.local_bytes),
                ", ".join(notes),
            ]
        )
    return lines + _table(rows, "    ")


def _unit_notes(unit: UnitDescription) -> str:
    """Counts of the parameters that differ from a plain sharded, trainable one."""
    frozen = sum(not p.requires_grad for p in unit.params)
    whole = sum(p.kept_whole for p in unit.params)
    other_mesh = {
        _format_mesh(p.mesh_shape, p.mesh_dim_names)
        for p in unit.params
        if (p.mesh_shape, p.mesh_dim_names) != (unit.mesh_shape, unit.mesh_dim_names)
    }
    elsewhere = {p.device.type for p in unit.params if p.device.type != unit.device_type}
    notes = [f"{frozen} frozen"] if frozen else []
    notes += [f"{whole} kept whole"] if whole else []
    dims = [_shard_dim(p, unit) for p in unit.params]
    notes += [f"{dims.count(d)} sharded on dim {d}" for d in sorted({d for d in dims if d})]
    notes += [f"TP parameters on {m}" for m in sorted(other_mesh)]
    notes += [f"shards on {d}" for d in sorted(elsewhere)]
    return ", ".join(notes)


def _shard_dim(param: ParamDescription, unit: UnitDescription) -> int:
    """The dim data parallelism shards ``param`` on (``shard_placement_fn``); 0 also for a kept-whole one."""
    placement = param.placements[len(unit.mesh_shape) - 1]
    return placement.dim if isinstance(placement, Shard) else 0


def _render_compact(units: list[UnitDescription]) -> list[str]:
    rows = [["unit", "params", "bytes here", "per shard rank", "mesh", "compute / reduce", "reshard after fwd"]]
    rows[0].append("notes")
    for unit in units:
        rows.append(
            [
                _where(unit),
                str(len(unit.params)),
                format_bytes(unit.local_bytes),
                _per_rank(unit),
                _format_mesh(unit.mesh_shape, unit.mesh_dim_names),
                f"{_dtype(unit.compute_dtype)} / {_dtype(unit.reduce_dtype)}",
                str(unit.reshard_after_forward),
                _unit_notes(unit),
            ]
        )
    return _table(rows, "  ")


def _render(module: nn.Module, units: list[UnitDescription], unmanaged: list[str], *, params: bool) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = sum(u.local_bytes for u in units)
    n_params = sum(len(u.params) for u in units)
    meshes = sorted({(_format_mesh(u.mesh_shape, u.mesh_dim_names), u.device_type) for u in units})
    lines = [
        f"fsdp_compose: {type(module).__name__} with {len(units)} sharded unit(s), {n_params} parameter(s), "
        f"{format_bytes(total)} of shards on rank {rank} of {world}",
        "meshes: " + ("; ".join(f"{m} on {device}" for m, device in meshes) or "none"),
    ]
    if not units:
        lines.append("no module under it is sharded: call fc.fully_shard first")
    elif params:
        for i, unit in enumerate(units, start=1):
            lines += _render_unit(i, len(units), unit)
    else:
        lines += _render_compact(units)
    if unmanaged:
        lines.append(f"not managed by any unit ({len(unmanaged)}): " + ", ".join(unmanaged))
    return "\n".join(lines)


def step_schedule(module: nn.Module, names: dict[int, str] | None = None) -> StepSchedule:
    """The declared collective schedule of the sharded root ``module``, as the engine builds it for a step (every
    unit under it in registration order; ``StepContext`` makes the same from the same list). ``names``: id(state) ->
    the name to give each unit (default: its module paths under ``module``)."""
    root = get_state(module)
    if root is None:
        raise ValueError(
            f"fc.describe_schedule: {type(module).__name__} is not sharded; call fc.fully_shard on it (the root) first"
        )
    if root.root is not None and root.root is not root:
        raise ValueError(
            f"fc.describe_schedule: {type(module).__name__} is a unit under the root {root.root.params.owner_name}; "
            "describe the root"
        )
    states = states_under(module)
    return StepSchedule(root, states, names or unit_names(module, states))


def describe_schedule(module: nn.Module) -> str:
    """The collective schedule of the sharded ``module`` (the root of its units), before or after it ran: per unit in
    registration order the collectives it issues, then the orders a backward walks them in."""
    return step_schedule(module).describe()
