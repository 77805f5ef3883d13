"""``fully_shard``'s two halves: validate everything without touching the model, then build the unit and state.

A bad call raises a clear error with the model as it was and no collective run: every check below runs before the
line marked "Everything is validated".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .api import get_state
from .extensions import ShardExtensions
from .flat import MOVED_ATTR, OWNER_ATTR
from .hooks import register_hooks
from .integrations.fsdp2 import bind_fsdp2_methods
from .meshes import (
    ParamPlacing,
    check_dp_mesh,
    dp_mesh_from_dims,
    param_placing,
    post_forward_group_for,
    reshard_after_forward_setting,
    spmd_param_placing,
    spmd_sharded_mesh,
)
from .offload import check_offload_policy
from .policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_dp_mesh_dims,
    as_mp_policy,
    as_offload_policy,
)
from .state import STATE_ATTR, ShardState, states_under
from .subclass_params import check_subclass_param, has_fsdp_hooks, is_tensor_subclass
from .unit import UnitParams

logger = logging.getLogger(__name__)

__all__ = ["fully_shard"]

# The argument's own type comes back (``fully_shard(model)`` is typed as the model's class, a list of Linear as that
# list); at run time a sequence must be a list or tuple.
ModuleOrList = TypeVar("ModuleOrList", bound="nn.Module | Sequence[nn.Module]")

_ParamEntry = tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]


def fully_shard(
    module: ModuleOrList,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy | torch_fsdp.MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | torch_fsdp.OffloadPolicy = OffloadPolicy(),
    ignored_params: nn.Parameter | Iterable[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | torch_fsdp.DataParallelMeshDims | None = None,
    extensions: ShardExtensions | None = None,
    frozen_params: Literal["shard", "replicate"] = "shard",
    auto_refresh_trainable: bool = True,
    fsdp2_methods: bool = False,
) -> ModuleOrList:
    """Shard ``module``'s parameters over the data-parallel ranks of ``mesh`` and attach the hooks that gather them.

    The module keeps its class; its parameters become ``nn.Parameter(DTensor)`` with placement ``Shard(0)``, the
    local shard being this rank's ``torch.chunk`` of dim 0. ``shard_placement_fn(param)`` may pick another dim per
    parameter: ``Shard(k)`` (negative ``k`` counts from the end; sizes need not divide) or None for dim 0, or FSDP2's
    ``ShardPlacementResult`` to shard it over another data-parallel mesh as well (a mixture of experts' expert weights
    over their expert-FSDP mesh): the parameters of each mesh are gathered and reduced as a unit of their own, right
    after this call's (docs/composition.md, "Mixture of experts"). Call it on submodules first (e.g. every transformer
    block), then on the root: each call's unit holds the parameters not already held by a sharded submodule.
    A list of modules shares one unit (gathered once before the first of them runs).

    Every argument of torch's ``fully_shard`` is accepted, torch's policy objects included (converted here).
    ``dp_mesh_dims``: ``mesh`` is then the full SPMD mesh and names which of its dims are data-parallel (see
    ``DataParallelMeshDims``). ``fsdp2_methods=True`` also binds FSDP2's method names on the module instance
    (``module.set_requires_gradient_sync(False)``, ``module.unshard()``...; see ``fc.bind_fsdp2_methods``).
    ``ignored_params``: parameters left alone (not sharded, cast, moved nor reduced); as in torch, one model-wide set
    may go to every call, each call ignoring those under its modules.

    Returns the same object(s) it was given.
    """
    modules = _as_module_list(module)
    owner_name = _describe(modules)
    mp_policy = as_mp_policy(mp_policy, f"fully_shard on {owner_name}")
    offload_policy = as_offload_policy(offload_policy, f"fully_shard on {owner_name}")
    dims = as_dp_mesh_dims(dp_mesh_dims, f"fully_shard on {owner_name}")
    if not isinstance(fsdp2_methods, bool):
        raise TypeError(f"fsdp2_methods of fully_shard on {owner_name} must be True or False, got {fsdp2_methods!r}")
    spmd_mesh = None
    if dims is not None:
        if mesh is None:
            raise ValueError(
                f"fully_shard on {owner_name}: dp_mesh_dims names dims of the mesh, so pass mesh= (the full SPMD "
                "mesh its parameters are distributed on)"
            )
        spmd_mesh = _check_mesh_type(mesh)
        mesh = dp_mesh_from_dims(spmd_mesh, dims, owner_name)
        check_dp_mesh(mesh, owner_name, roles_named=True)
    else:
        mesh = _resolve_mesh(mesh, owner_name)
    reshard_after_forward = reshard_after_forward_setting(reshard_after_forward, mesh, owner_name)
    if dims is not None and isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard on {owner_name}: reshard_after_forward={reshard_after_forward} (a group size) with "
            "dp_mesh_dims is not supported (nor by torch's fully_shard); use True or False"
        )
    if extensions is not None and not isinstance(extensions, ShardExtensions):
        raise TypeError(f"extensions must be an fc.ShardExtensions, got {type(extensions).__name__}")
    if frozen_params not in ("shard", "replicate"):
        raise ValueError(f'frozen_params must be "shard" or "replicate", got {frozen_params!r}')
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"shard_placement_fn of fully_shard on {owner_name} must be a function of a parameter (or None), got "
            f"{type(shard_placement_fn).__name__}"
        )
    if not isinstance(auto_refresh_trainable, bool):
        raise TypeError(
            f"auto_refresh_trainable of fully_shard on {owner_name} must be True or False, got "
            f"{auto_refresh_trainable!r}"
        )
    ignored = _ignored_ids(ignored_params, modules, owner_name)

    params, lifts, managed = _collect_params(modules, ignored, owner_name)
    device = _mesh_device(mesh)
    shard_dims, param_meshes = _check_params(params, shard_placement_fn, owner_name)
    groups = _mesh_groups(_MeshRoles(mesh, spmd_mesh, dims), params, shard_dims, param_meshes, owner_name)
    if len(groups) > 1:
        _check_mesh_groups(groups, owner_name, reshard_after_forward=reshard_after_forward)
    placings_of: list[list[ParamPlacing]] = []
    for (group_mesh, group_spmd, group_dp_dims), group_params, group_dims in groups:
        check_offload_policy(offload_policy, group_mesh, owner_name)
        _check_unit_kind(
            group_params,
            owner_name,
            group_mesh,
            reshard_after_forward=reshard_after_forward,
            extensions=extensions,
            offload_policy=offload_policy,
            dp_mesh_dims=dims,
        )
        if group_dp_dims is not None:
            assert group_spmd is not None
            # one mesh for every parameter of the unit
            sharded_mesh = spmd_sharded_mesh(group_spmd, group_dp_dims, group_mesh)
            placings = [
                spmd_param_placing(fqn, p, group_spmd, group_dp_dims, owner_name, dim, sharded_mesh)
                for (fqn, p, _), dim in zip(group_params, group_dims, strict=True)
            ]
        else:
            placings = [
                param_placing(fqn, p, group_mesh, owner_name, dim)
                for (fqn, p, _), dim in zip(group_params, group_dims, strict=True)
            ]
        placings_of.append(placings)

    # Everything is validated: from here on the model changes.
    for m in modules:
        _move_buffers(m, device)
    owners_of = {id(p): owners for _, p, owners in params}
    for child_state, param in lifts:  # tied parameters move up from a submodule's unit into this one
        owners_of[id(param)].extend(child_state.release(param))
    members = []
    for ((group_mesh, _, _), group_params, _), placings in zip(groups, placings_of, strict=True):
        label = "" if group_mesh is mesh else f"on {group_mesh.mesh_dim_names}"
        unit_params = UnitParams(
            group_params,
            placings,
            group_mesh,
            device,
            f"{owner_name} {label}" if label else owner_name,
            mp_policy=mp_policy,
            frozen_params=frozen_params,
            extensions=extensions,
            offload_policy=offload_policy,
            post_forward=post_forward_group_for(reshard_after_forward, group_mesh),
        )
        member = ShardState(
            tuple(modules),
            unit_params,
            group_mesh,
            device,
            reshard_after_forward,
            mp_policy,
            auto_refresh_trainable,
        )
        member.mesh_label = label
        members.append(member)
    state = members[0]
    state.add_siblings(members[1:])
    for m in modules:
        m.__dict__[STATE_ATTR] = state
    _mark_managed(managed)
    register_hooks(state)
    if fsdp2_methods:
        for m in modules:
            bind_fsdp2_methods(m, recurse=False)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "fully_shard on %s: %d parameters (%d kept whole), mesh %s %s, %s, reshard_after_forward=%s%s",
            owner_name,
            len(unit_params.shards.params),
            sum(mp.slot is None for mp in unit_params.shards.params),
            tuple(mesh.shape),
            mesh.mesh_dim_names,
            _precision_text(mp_policy),
            "default" if reshard_after_forward is None else reshard_after_forward,
            f", {len(lifts)} tied parameter(s) lifted from submodules" if lifts else "",
        )
    return module


def _precision_text(policy: MixedPrecisionPolicy) -> str:
    if policy == MixedPrecisionPolicy():
        return "no mixed precision"
    fields = ("param_dtype", "reduce_dtype", "output_dtype")
    dtypes = ", ".join(f"{f}={str(getattr(policy, f)).removeprefix('torch.')}" for f in fields)
    return f"{dtypes}, cast_forward_inputs={policy.cast_forward_inputs}"


# ---------------------------------------------------------------------- validation
def _as_module_list(module: Any) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        if get_state(m) is not None:
            raise ValueError(
                f"fully_shard was already called on this {type(m).__name__}; call it once per module "
                "(use fc.set_reshard_after_forward etc. to change settings)"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list")
    return modules


def _resolve_mesh(mesh: DeviceMesh | None, owner_name: str) -> DeviceMesh:
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "fully_shard(mesh=None) shards over the default process group, which is not initialized; call "
                "torch.distributed.init_process_group() first (torchrun sets its environment) or pass mesh="
            )
        backend = str(dist.get_backend())
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device_type = accelerator.type if accelerator is not None and backend != "gloo" else "cpu"
        return init_device_mesh(device_type, (dist.get_world_size(),))
    check_dp_mesh(_check_mesh_type(mesh), owner_name)
    return mesh


def _check_mesh_type(mesh: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build one with "
            'init_device_mesh("cuda", (world_size,))'
        )
    return mesh


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _ignored_ids(ignored_params: object, modules: list[nn.Module], owner_name: str) -> set[int]:
    """Ids of the parameters under ``modules`` to leave alone, from one ``nn.Parameter`` or an iterable of them.

    Torch's semantics: the same model-wide set may go to every ``fully_shard`` call, and each call ignores the
    parameters of that set that are under its modules; the others are not its concern. Refused, because the caller
    meant a parameter of these modules that would then silently be sharded: a tensor that is not an ``nn.Parameter``
    (``p.detach()``, ``p.data``), and a parameter that is not one of the modules' but is the very same memory as one
    of them (``nn.Parameter(p.data)``).
    """
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor) and not isinstance(ignored_params, nn.Parameter):
        raise TypeError(
            f"ignored_params of fully_shard on {owner_name} got a {_tensor_text(ignored_params)} that is not an "
            f"nn.Parameter{_alias_hint(ignored_params, modules)}; pass the module's parameter itself"
        )
    if isinstance(ignored_params, nn.Parameter):
        entries: list[object] = [ignored_params]
    elif isinstance(ignored_params, (str, bytes, Mapping)) or not isinstance(ignored_params, Iterable):
        raise TypeError(
            f"ignored_params of fully_shard on {owner_name} must be an nn.Parameter or an iterable of them (e.g. a "
            f"set), got {type(ignored_params).__name__}"
        )
    else:
        entries = list(ignored_params)
    owned = {id(p) for m in modules for _, p in m.named_parameters(remove_duplicate=False)}
    same_memory: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] | None = None
    ignored: set[int] = set()
    for index, entry in enumerate(entries):
        if not isinstance(entry, nn.Parameter):
            what = _tensor_text(entry) if isinstance(entry, torch.Tensor) else type(entry).__name__
            hint = _alias_hint(entry, modules) if isinstance(entry, torch.Tensor) else ""
            raise TypeError(
                f"ignored_params of fully_shard on {owner_name}: entry {index} is a {what}, not an "
                f"nn.Parameter{hint}; pass the module's parameters themselves"
            )
        if id(entry) in owned:
            ignored.add(id(entry))
            continue
        if same_memory is None:
            same_memory = _parameter_memory(modules)
        name = same_memory.get(_memory_key(entry)) if _has_memory(entry) else None
        if name is not None:
            raise ValueError(
                f"ignored_params of fully_shard on {owner_name}: entry {index} ({_tensor_text(entry)}) is not a "
                f"parameter of {owner_name} but the same memory as its parameter '{name}' (an nn.Parameter made "
                "from its .data?); pass the module's parameter itself"
            )
        # a parameter of another module: one model-wide set serves every fully_shard call
    return ignored


def _has_memory(tensor: torch.Tensor) -> bool:
    return not tensor.is_meta and not isinstance(tensor, DTensor) and tensor.data_ptr() != 0


def _memory_key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Where a tensor's elements are: two distinct tensors with equal keys are the same memory, element for element
    (views of one flat buffer at different offsets are not)."""
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def _parameter_memory(modules: list[nn.Module]) -> dict[tuple[int, tuple[int, ...], tuple[int, ...]], str]:
    return {
        _memory_key(p): name
        for m in modules
        for name, p in m.named_parameters(remove_duplicate=False)
        if _has_memory(p)
    }


def _tensor_text(tensor: torch.Tensor) -> str:
    return f"{type(tensor).__name__} of shape {tuple(tensor.shape)} and dtype {tensor.dtype}"


def _alias_hint(tensor: torch.Tensor, modules: list[nn.Module]) -> str:
    """Names the module parameter ``tensor`` shares memory with (``p.detach()``, ``p.data``), if any."""
    if tensor.is_meta or isinstance(tensor, DTensor):
        return ""
    pointer = tensor.untyped_storage().data_ptr()
    if pointer == 0:
        return ""
    for m in modules:
        for name, p in m.named_parameters():
            if not p.is_meta and not isinstance(p, DTensor) and p.untyped_storage().data_ptr() == pointer:
                return f" (it shares memory with parameter '{name}': a detached copy or .data of it?)"
    return ""


def _describe(modules: list[nn.Module]) -> str:
    return "[" + ", ".join(type(m).__name__ for m in modules) + "]" if len(modules) > 1 else type(modules[0]).__name__


def _mark_managed(managed: list[nn.Module]) -> None:
    """Set the two attributes torch's ``fully_shard`` sets on every module it manages (``managed``: what
    ``_collect_params`` walked, not into torch's ``replicate()`` or a sharded submodule), which others read to tell a
    sharded model: ``_is_fsdp_managed_module`` (transformers' ``is_fsdp_managed_module``, which turns on
    ``generate``'s ``synced_gpus`` so ranks that finish at different lengths keep issuing the same collectives;
    Dynamo, which then passes the module's parameters to a compiled graph as inputs, as the gathers swap them) and
    ``_fsdp_use_orig_params``."""
    for module in managed:
        module._is_fsdp_managed_module = True  # type: ignore[assignment]
        module._fsdp_use_orig_params = True  # type: ignore[assignment]


def _replicated(module: nn.Module) -> bool:
    """Managed by torch's composable ``replicate()`` (the DDP-based one or torch 2.13's FSDP-based one): both record
    themselves as "replicate" in the module's composable-API registry."""
    registry = _get_registry(module)
    return registry is not None and "replicate" in registry


def _collect_params(
    modules: list[nn.Module], ignored: set[int], owner_name: str
) -> tuple[list[_ParamEntry], list[tuple[ShardState, nn.Parameter]], list[nn.Module]]:
    """Parameters this call manages: all under ``modules`` except ignored ones and those of sharded submodules.

    A parameter that a sharded submodule's unit already took but that is also used outside that submodule (a tie,
    e.g. an embedding and an output head) is *lifted*: returned in ``lifts`` so that it moves into this unit, the
    closest unit containing every use. Returns (entries, lifts, the modules walked: those this call manages);
    nothing is changed here.
    """
    entries: dict[int, _ParamEntry] = {}
    taken: dict[int, ShardState] = {}  # id of a user parameter a sharded submodule's unit replaced -> that state
    sharded_by_child: dict[int, str] = {}  # id of a sharded parameter of a submodule -> its unit
    visited: dict[int, nn.Module] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        if id(module) in visited:
            return
        visited[id(module)] = module
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = prefix + name
            if id(param) in entries:
                entries[id(param)][2].append((module, name))
            else:
                entries[id(param)] = (fqn, param, [(module, name)])
        for child_name, child in module._modules.items():
            if child is None:
                continue
            if _replicated(child):
                continue  # torch's replicate() owns its parameters (and their gradient all-reduce), as in FSDP2
            if get_state(child) is not None:
                for state in states_under(child):
                    for mp in state.params.shards.params:
                        original = mp.original() if mp.original is not None else None
                        if original is not None:
                            taken[id(original)] = state
                        sharded_by_child[id(mp.sharded)] = state.params.owner_name
                continue
            visit(child, prefix + child_name + ".")

    for module in modules:
        if _replicated(module):
            raise ValueError(
                f"fully_shard on {owner_name}: this {type(module).__name__} is managed by torch's replicate(); "
                "shard its submodules or a parent instead (a parent's unit leaves replicate()'s parameters to it)"
            )
        visit(module, "")
    lifts: list[tuple[ShardState, nn.Parameter]] = []
    for fqn, param, _ in entries.values():
        if id(param) in taken:
            lifts.append((taken[id(param)], param))
            continue
        owner = getattr(param, OWNER_ATTR, None)
        if id(param) in sharded_by_child:
            raise ValueError(
                f"parameter '{fqn}' of {owner_name} is the sharded parameter of the unit on "
                f"{sharded_by_child[id(param)]} (tied after that fully_shard call); tie weights before calling "
                "fully_shard, then the enclosing call moves the shared parameter into its own unit"
            )
        if owner is not None:
            raise ValueError(
                f"parameter '{fqn}' is already sharded by the fully_shard call on {owner}, which encloses "
                f"{owner_name}; call fully_shard bottom-up: submodules first, then their parents"
            )
        moved_to = getattr(param, MOVED_ATTR, None)
        if moved_to is not None:
            raise ValueError(
                f"parameter '{fqn}' of {owner_name} is tied to a parameter that fully_shard on {moved_to} already "
                f"sharded, and {moved_to} is not inside {owner_name}; a tied parameter lives in the closest unit "
                "containing every use: call fully_shard on their common parent and not on this module (or pass "
                "both modules as one list)"
            )
    for state, _ in lifts:
        if state.root is not None:
            raise ValueError(
                f"a parameter of the unit on {state.params.owner_name} is tied to one used by {owner_name}, but that "
                "unit already ran a forward; call fully_shard on every module before the first forward"
            )
    return list(entries.values()), lifts, list(visited.values())


def _check_params(
    params: list[_ParamEntry],
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    owner_name: str,
) -> tuple[list[int], list[_MeshRoles | None]]:
    """Raise for parameters fully_shard cannot take; return the dim each one is sharded on, and the data-parallel
    mesh ``shard_placement_fn`` gave it (None: the call's)."""
    devices = {p.device for _, p, _ in params}
    if len(devices) > 1:
        listing = ", ".join(f"'{fqn}' on {p.device}" for fqn, p, _ in params[:8])
        raise ValueError(
            f"parameters of {owner_name} are on different devices ({listing}); move the module to one device "
            "(or to 'meta') before fully_shard"
        )
    for fqn, param, _ in params:
        if not param.is_floating_point() and not param.is_complex():
            raise TypeError(
                f"parameter '{fqn}' of {owner_name} has dtype {param.dtype}; only floating-point parameters can be "
                "sharded — pass it in ignored_params or make it a buffer"
            )
    # Several dtypes share a unit: each dtype group has its own flat buffer, gathered in one collective (see
    # full_params.py). A 0-dim parameter is kept whole and its gradient reduced with the unit's: it must have one of
    # the dtypes of the unit's other parameters.
    unit_dtypes = {p.dtype for _, p, _ in params if p.ndim > 0} or {p.dtype for _, p, _ in params}
    for fqn, param, _ in params:
        if param.ndim == 0 and param.dtype not in unit_dtypes:
            listing = " or ".join(sorted(str(d) for d in unit_dtypes))
            raise ValueError(
                f"parameter '{fqn}' of {owner_name} is a 0-dim {param.dtype} parameter in a unit of {listing} "
                f"parameters; its gradient is reduced with theirs, in {listing}. Cast it to {listing}, move it "
                "into a submodule and call fully_shard on that submodule first, or pass it in ignored_params (then "
                "its gradient is not reduced)"
            )
    meshes: list[_MeshRoles | None] = [None] * len(params)
    if shard_placement_fn is None:
        dims = [0] * len(params)
    else:
        dims = []
        for index, (fqn, param, _) in enumerate(params):
            placement = shard_placement_fn(param)
            if type(placement).__name__ == "ShardPlacementResult":
                meshes[index] = _placement_mesh(fqn, placement, owner_name)
                placement = placement.placement
            dims.append(_shard_dim(fqn, param, placement, owner_name))
    for (fqn, param, _), dim in zip(params, dims, strict=True):
        local = param._local_tensor if isinstance(param, DTensor) else param
        if has_fsdp_hooks(local):
            check_subclass_param(fqn, param, owner_name, dim)
        elif is_tensor_subclass(local) and isinstance(param, DTensor):
            raise TypeError(
                f"parameter '{fqn}' of {owner_name} is a DTensor (tensor parallel) over a {type(local).__name__}, a "
                "tensor subclass without FSDP2's all-gather hooks (fsdp_pre_all_gather / fsdp_post_all_gather); "
                "fsdp_compose shards such a subclass only as a plain (non-DTensor) parameter: apply tensor "
                "parallelism without the subclass, or pass it in ignored_params"
            )
        elif is_tensor_subclass(local) and param.ndim > 0:
            # Accepted, as by torch's fully_shard: it is sharded its own way, the hooks may be attached to its local
            # shard before the first gather (else it then trains as a plain parameter: FlatShard.read_hooks). So
            # it must be shardable as a protocol parameter.
            check_subclass_param(fqn, param, owner_name, dim, hooks_required=False)
    return dims, meshes


class _MeshRoles(NamedTuple):
    """A data-parallel mesh, and under ``dp_mesh_dims`` the full SPMD mesh and the dims it was taken from."""

    dp_mesh: DeviceMesh
    spmd_mesh: DeviceMesh | None
    dims: DataParallelMeshDims | None


def _placement_mesh(fqn: str, result: Any, owner_name: str) -> _MeshRoles:
    """The data-parallel mesh of FSDP2's ``ShardPlacementResult`` (its ``mesh_info.mesh``; with the full SPMD mesh
    and the dims where ``dp_mesh_dims`` made it), checked as a ``fully_shard`` mesh."""
    info = getattr(result, "mesh_info", None)
    mesh = getattr(info, "mesh", None)
    where = f"'{fqn}' of {owner_name} (its ShardPlacementResult's mesh)"
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"shard_placement_fn returned a ShardPlacementResult for '{fqn}' of {owner_name} whose mesh_info has no "
            f"DeviceMesh (got {type(mesh).__name__}); build it with FSDP2's FSDPMeshInfo(mesh=..., shard_mesh_dim=...)"
        )
    dims = as_dp_mesh_dims(getattr(info, "dp_mesh_dims", None), where)
    spmd = getattr(info, "spmd_mesh", None) if dims is not None else None
    if dims is not None and not isinstance(spmd, DeviceMesh):
        raise TypeError(f"{where}: mesh_info has dp_mesh_dims but no spmd_mesh; build it with FSDP2's _get_mesh_info")
    check_dp_mesh(mesh, where, roles_named=dims is not None)
    return _MeshRoles(mesh, spmd, dims)


_MeshGroup = tuple[_MeshRoles, list["_ParamEntry"], list[int]]


def _mesh_groups(
    roles: _MeshRoles, params: list[_ParamEntry], dims: list[int], meshes: list[_MeshRoles | None], owner_name: str
) -> list[_MeshGroup]:
    """The parameters per data-parallel mesh, in the order of registration: the call's mesh first (its group may be
    empty: the unit then holds only the hooks), then each other mesh in the order its first parameter comes. Under
    ``dp_mesh_dims`` every mesh comes with its SPMD mesh and dims, else none does."""
    groups: dict[DeviceMesh, _MeshGroup] = {roles.dp_mesh: (roles, [], [])}
    for entry, dim, param_roles in zip(params, dims, meshes, strict=True):
        if param_roles is not None and (param_roles.dims is None) != (roles.dims is None):
            raise ValueError(
                f"fully_shard on {owner_name}: parameter '{entry[0]}' has a ShardPlacementResult "
                f"{'without' if param_roles.dims is None else 'with'} dp_mesh_dims, the call "
                f"{'with' if roles.dims is not None else 'without'}; give both or neither"
            )
        found = roles if param_roles is None or param_roles.dp_mesh == roles.dp_mesh else param_roles
        group = groups.setdefault(found.dp_mesh, (found, [], []))
        group[1].append(entry)
        group[2].append(dim)
    return list(groups.values())


def _check_mesh_groups(groups: list[_MeshGroup], owner_name: str, *, reshard_after_forward: bool | int | None) -> None:
    """Raise for settings a unit with a mesh per parameter cannot combine with (before anything is touched)."""
    meshes = ", ".join(str(roles.dp_mesh.mesh_dim_names or roles.dp_mesh.shape) for roles, _, _ in groups)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard on {owner_name}: reshard_after_forward={reshard_after_forward} (a group size) with a mesh "
            f"per parameter ({meshes}) is not supported; use True or False"
        )


def _check_unit_kind(
    params: list[_ParamEntry],
    owner_name: str,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int | None,
    extensions: ShardExtensions | None,
    offload_policy: OffloadPolicy,
    dp_mesh_dims: object,
) -> None:
    """Raise for settings a unit of several dtypes, or with protocol parameters, cannot combine with."""
    # a tensor subclass without the hooks counts: they may be attached before the first gather
    locals_ = [(fqn, p._local_tensor if isinstance(p, DTensor) else p) for fqn, p, _ in params]
    protocol = [fqn for fqn, t in locals_ if has_fsdp_hooks(t) or (t.ndim > 0 and is_tensor_subclass(t))]
    dtypes = {p.dtype for _, p, _ in params if p.ndim > 0}
    if not protocol and len(dtypes) <= 1:
        return
    what = (
        f"parameters using FSDP2's all-gather hooks ({', '.join(repr(f) for f in protocol[:4])})"
        if protocol
        else f"parameters of several dtypes ({', '.join(sorted(str(d) for d in dtypes))})"
    )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard on {owner_name}: reshard_after_forward={reshard_after_forward} (a group size) with {what} "
            "is not supported; use True or False"
        )
    if extensions is not None and extensions.all_gather is not None:
        raise NotImplementedError(
            f"fully_shard on {owner_name}: an all_gather extension with {what} is not supported (the extension "
            "encodes one flat buffer); shard the differing submodule separately, or drop the extension"
        )
    if protocol and isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            f"fully_shard on {owner_name}: CPU offload with {what} is not supported yet; use OffloadPolicy()"
        )
    if protocol and dp_mesh_dims is not None:
        raise NotImplementedError(f"fully_shard on {owner_name}: dp_mesh_dims with {what} is not supported yet")
    if protocol and mesh.ndim > 1 and mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard on {owner_name}: {what} on a 2-D (HSDP) mesh need mesh_dim_names (their pre-hook "
            "receives the shard dim's mesh); build the mesh with init_device_mesh(..., mesh_dim_names=...)"
        )


def _shard_dim(fqn: str, param: nn.Parameter, placement: object, owner_name: str) -> int:
    """The dim ``shard_placement_fn``'s answer shards ``param`` on: 0 for None, negative dims normalized."""
    if isinstance(placement, Shard) and not isinstance(placement, _StridedShard):
        if param.ndim == 0:
            return 0  # kept whole on every rank: there is no dim to shard
        dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.ndim:
            raise ValueError(
                f"shard_placement_fn returned {placement!r} for '{fqn}' of {owner_name}, a parameter of shape "
                f"{tuple(param.shape)}; return Shard(dim) with -{param.ndim} <= dim < {param.ndim} (or None for dim 0)"
            )
        return dim
    if placement is None:
        return 0
    raise TypeError(
        f"shard_placement_fn returned {placement!r} for '{fqn}' of {owner_name}; it must return Shard(dim) to shard "
        "the parameter on that dim, None for dim 0, or FSDP2's ShardPlacementResult for another mesh"
    )


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)
