"""``fully_shard`` and the functions that act on a sharded module.

``fully_shard`` first validates everything (types, mesh, parameters) without touching the model, then shards: so a
bad call raises a clear error with the model as it was, and no collective has run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Shard

from .extensions import ShardExtensions
from .meshes import PostForwardGroup, check_dp_mesh, check_post_forward_size, param_placing, post_forward_group
from .offload import check_offload_policy
from .policies import MixedPrecisionPolicy, OffloadPolicy
from .state import STATE_ATTR, GradientAccumulation, ShardState, states_under
from .unit import MOVED_ATTR, OWNER_ATTR, ShardedUnit

__all__ = [
    "fully_shard",
    "get_state",
    "is_fully_sharded",
    "no_sync",
    "refresh_trainable",
    "register_forward_method",
    "reshard",
    "set_full_precision_in_eval",
    "set_gradient_accumulation",
    "set_gradient_divide_factor",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_optimizer_in_backward",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "unshard",
]

ModuleOrList = TypeVar("ModuleOrList", nn.Module, list[nn.Module])

_ParamEntry = tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]


def fully_shard(
    module: ModuleOrList,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    extensions: ShardExtensions | None = None,
    frozen_params: Literal["shard", "replicate"] = "shard",
    auto_refresh_trainable: bool = True,
) -> ModuleOrList:
    """Shard ``module``'s parameters over the data-parallel ranks of ``mesh`` and attach the hooks that gather them.

    The module keeps its class; its parameters become ``nn.Parameter(DTensor)`` with placement ``Shard(0)``, the
    local shard being this rank's ``torch.chunk`` of dim 0. Call it on submodules first (e.g. every transformer
    block), then on the root: each call's unit holds the parameters not already held by a sharded submodule.
    A list of modules shares one unit (gathered once before the first of them runs).

    Returns the same object(s) it was given.
    """
    modules = _as_module_list(module)
    mesh = _resolve_mesh(mesh)
    owner_name = _describe(modules)
    reshard_after_forward = _reshard_after_forward_setting(reshard_after_forward, mesh, owner_name)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be an fc.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if extensions is not None and not isinstance(extensions, ShardExtensions):
        raise TypeError(f"extensions must be an fc.ShardExtensions, got {type(extensions).__name__}")
    if frozen_params not in ("shard", "replicate"):
        raise ValueError(f'frozen_params must be "shard" or "replicate", got {frozen_params!r}')
    ignored = _ignored_ids(ignored_params)

    check_offload_policy(offload_policy, mesh, owner_name)
    params, lifts = _collect_params(modules, ignored, owner_name)
    device = _mesh_device(mesh)
    _check_params(params, shard_placement_fn, owner_name)
    placings = [param_placing(fqn, p, mesh, owner_name) for fqn, p, _ in params]

    # Everything is validated: from here on the model changes.
    for m in modules:
        _move_buffers(m, device)
    owners_of = {id(p): owners for _, p, owners in params}
    for child_state, param in lifts:  # tied parameters move up from a submodule's unit into this one
        owners_of[id(param)].extend(child_state.unit.release(param))
    unit = ShardedUnit(
        params,
        placings,
        mesh,
        device,
        mp_policy.param_dtype,
        mp_policy.reduce_dtype,
        owner_name,
        frozen_params,
        extensions,
        offload_policy,
    )
    unit.post_forward = _post_forward_group(reshard_after_forward, mesh)
    state = ShardState(
        tuple(modules),
        unit,
        mesh,
        device,
        reshard_after_forward,
        mp_policy,
        auto_refresh_trainable,
    )
    for m in modules:
        m.__dict__[STATE_ATTR] = state
    state.register_hooks()
    return module


# ---------------------------------------------------------------------- validation helpers
def _reshard_after_forward_setting(
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


def _post_forward_group(setting: bool | int | None, mesh: DeviceMesh) -> PostForwardGroup | None:
    """The group an int setting (normalized, so ``1 < k < W``) reshards to after forward; None for the others."""
    if isinstance(setting, int) and not isinstance(setting, bool):
        return post_forward_group(mesh, setting)
    return None


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


def _resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
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
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build one with "
            'init_device_mesh("cuda", (world_size,))'
        )
    check_dp_mesh(mesh)
    return mesh


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _ignored_ids(ignored_params: Iterable[nn.Parameter] | None) -> set[int]:
    if ignored_params is None:
        return set()
    ignored = list(ignored_params)
    for p in ignored:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ignored_params must hold parameters, got {type(p).__name__}")
    return {id(p) for p in ignored}


def _describe(modules: list[nn.Module]) -> str:
    return "[" + ", ".join(type(m).__name__ for m in modules) + "]" if len(modules) > 1 else type(modules[0]).__name__


def _collect_params(
    modules: list[nn.Module], ignored: set[int], owner_name: str
) -> tuple[list[_ParamEntry], list[tuple[ShardState, nn.Parameter]]]:
    """Parameters this call manages: all under ``modules`` except ignored ones and those of sharded submodules.

    A parameter that a sharded submodule's unit already took but that is also used outside that submodule (a tie,
    e.g. an embedding and an output head) is *lifted*: returned in ``lifts`` so that it moves into this unit, the
    closest unit containing every use. Returns (entries, lifts); nothing is changed here.
    """
    entries: dict[int, _ParamEntry] = {}
    taken: dict[int, ShardState] = {}  # id of a user parameter a sharded submodule's unit replaced -> that state
    sharded_by_child: dict[int, str] = {}  # id of a sharded parameter of a submodule -> its unit
    visited: set[int] = set()

    def visit(module: nn.Module, prefix: str) -> None:
        if id(module) in visited:
            return
        visited.add(id(module))
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
            if get_state(child) is not None:
                for state in states_under(child):
                    for mp in state.unit.params:
                        original = mp.original() if mp.original is not None else None
                        if original is not None:
                            taken[id(original)] = state
                        sharded_by_child[id(mp.sharded)] = state.unit.owner_name
                continue
            visit(child, prefix + child_name + ".")

    for module in modules:
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
                f"a parameter of the unit on {state.unit.owner_name} is tied to one used by {owner_name}, but that "
                "unit already ran a forward; call fully_shard on every module before the first forward"
            )
    return list(entries.values()), lifts


def _check_params(
    params: list[_ParamEntry],
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    owner_name: str,
) -> None:
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
        if shard_placement_fn is not None:
            placement: Placement | None = shard_placement_fn(param)
            if placement is not None and placement != Shard(0):
                raise NotImplementedError(
                    f"shard_placement_fn returned {placement} for '{fqn}'; only Shard(0) (or None) is supported yet"
                )
    dtypes = {p.dtype for _, p, _ in params if p.ndim > 0}
    if len(dtypes) > 1:
        listing = ", ".join(f"'{fqn}': {p.dtype}" for fqn, p, _ in params[:8])
        raise ValueError(
            f"parameters of {owner_name} have different dtypes ({listing}); one unit shares one flat buffer — cast "
            "them to one dtype or call fully_shard on the submodules that differ first"
        )


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)


# ---------------------------------------------------------------------- functions on a sharded module
def get_state(module: nn.Module) -> ShardState | None:
    """The state ``fully_shard`` attached to this module instance, or None."""
    return module.__dict__.get(STATE_ATTR)


def is_fully_sharded(module: nn.Module) -> bool:
    """True when ``fully_shard`` was called on this module (directly or as part of a list)."""
    return get_state(module) is not None


def _require_state(module: nn.Module) -> ShardState:
    state = get_state(module)
    if state is None:
        raise ValueError(f"this {type(module).__name__} is not sharded; call fc.fully_shard on it first")
    return state


def _states(module: nn.Module, recurse: bool) -> list[ShardState]:
    if not recurse:
        return [_require_state(module)]
    states = states_under(module)
    if not states:
        raise ValueError(f"no module under this {type(module).__name__} is sharded; call fc.fully_shard first")
    return states


class UnshardHandle(Protocol):
    def wait(self) -> None: ...


class _PendingUnshard:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the all-gather and registers full parameters."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    def wait(self) -> None:
        self._state.unit.finish_unshard()


def unshard(module: nn.Module, *, async_op: bool = False) -> UnshardHandle | None:
    """All-gather the module's own unit now (e.g. to prefetch or to run code outside forward on full parameters)."""
    state = _require_state(module)
    state.unit.start_unshard(async_op=async_op)
    if async_op:
        return _PendingUnshard(state)
    state.unit.finish_unshard()
    return None


def reshard(module: nn.Module) -> None:
    """Free the module's own full parameters and register the sharded ones again (no communication)."""
    _require_state(module).unit.reshard()


def set_requires_gradient_sync(module: nn.Module, requires_sync: bool, *, recurse: bool = True) -> None:
    """When False, backward keeps full gradients and accumulates them; the next synced backward reduces them."""
    for state in _states(module, recurse):
        state.requires_gradient_sync = requires_sync


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Context manager for gradient accumulation: no reduction inside, previous settings restored after."""
    states = _states(module, True)
    previous = [state.requires_gradient_sync for state in states]
    for state in states:
        state.requires_gradient_sync = False
    try:
        yield
    finally:
        for state, value in zip(states, previous, strict=True):
            state.requires_gradient_sync = value


def set_reshard_after_forward(module: nn.Module, value: bool | int, *, recurse: bool = True) -> None:
    """Free full parameters after forward (True), keep them until backward (False: no second all-gather), or keep
    ``1/k`` of them per rank (an int ``k``: backward re-gathers within groups of ``k`` ranks, e.g. one node).

    With an int, every rank must make the same call (it may create the process groups of size ``k``).
    """
    states = _states(module, recurse)
    settings = [
        _reshard_after_forward_setting(value, state.unit.dp.mesh, state.unit.owner_name, allow_none=False)
        for state in states
    ]
    for state, setting in zip(states, settings, strict=True):
        state.reshard_after_forward_setting = setting
        state.unit.post_forward = _post_forward_group(setting, state.unit.dp.mesh)


def set_reshard_after_backward(module: nn.Module, value: bool, *, recurse: bool = True) -> None:
    """Keep full parameters after backward (False), e.g. across no-sync micro-batches to skip re-gathering.

    A unit kept unsharded across an optimizer step is gathered again at its next forward (the step is detected from
    the sharded parameters' version counters), so the values stay right.
    """
    for state in _states(module, recurse):
        state.reshard_after_backward = value


def _state_list(modules: Iterable[nn.Module]) -> list[ShardState]:
    return [_require_state(m) for m in modules]


def set_modules_to_forward_prefetch(module: nn.Module, modules: Iterable[nn.Module]) -> None:
    """At ``module``'s forward, start the all-gathers of ``modules`` (replacing the implicit next-unit prefetch).

    Every rank must configure the same prefetches. An empty list turns forward prefetch off for ``module``.
    """
    _require_state(module).forward_prefetch = _state_list(modules)


def set_modules_to_backward_prefetch(module: nn.Module, modules: Iterable[nn.Module]) -> None:
    """At ``module``'s backward, start the all-gathers of ``modules`` (replacing the implicit previous-unit one)."""
    _require_state(module).backward_prefetch = _state_list(modules)


def set_optimizer_in_backward(
    module: nn.Module, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *, recurse: bool = True
) -> list[torch.optim.Optimizer]:
    """Step each unit's parameters during backward, as soon as its gradients are reduced (seed 004, #98667).

    ``optimizer`` builds an optimizer from a list of parameters (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``);
    one is built per unit and returned (for learning-rate schedules and checkpoints). After a unit's reduce-scatter
    (and, for HSDP, its all-reduce) its optimizer steps and its gradients are freed, so no gradient outlives its unit
    and there is no separate ``optimizer.step()``. Only synced backwards step (not no-sync micro-batches).
    Gradient clipping over the whole model is not possible in this mode (each unit steps before the others' gradients
    exist), and a unit used twice in one backward is not supported (its second use would see updated weights).
    Per instance: a ``copy.deepcopy`` of the module does not carry the optimizers.
    """
    built = []
    for state in _states(module, recurse):
        params = [mp.sharded for mp in state.unit.params]
        if not params:
            continue
        opt = optimizer(params)  # type: ignore[arg-type]
        state.unit.grads.on_finished = _StepInBackward(state, opt)
        built.append(opt)
    return built


class _StepInBackward:
    def __init__(self, state: ShardState, optimizer: torch.optim.Optimizer) -> None:
        self.state = state
        self.optimizer = optimizer

    def __call__(self) -> None:
        if self.state.requires_gradient_sync:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def set_gradient_divide_factor(module: nn.Module, factor: float, *, recurse: bool = True) -> None:
    """Divide reduced gradients by ``factor`` instead of the data-parallel size (1.0 gives the plain sum)."""
    if not factor > 0:
        raise ValueError(f"gradient divide factor must be positive, got {factor}")
    for state in _states(module, recurse):
        state.unit.grads.divide_factor = float(factor)


def set_requires_all_reduce(module: nn.Module, requires_all_reduce: bool, *, recurse: bool = True) -> None:
    """HSDP: skip (False) or do (True) the all-reduce over replicas after each reduce-scatter.

    With sharded accumulation, skip it on all micro-batches but the last: the reduce-scattered shards add up locally
    and the last micro-batch all-reduces their sum once.
    """
    for state in _states(module, recurse):
        state.requires_all_reduce = requires_all_reduce


def set_gradient_accumulation(module: nn.Module, mode: GradientAccumulation, *, recurse: bool = True) -> None:
    """How no-sync micro-batches accumulate gradients.

    - ``"unsharded"`` (default): full-size gradients accumulate locally in ``reduce_dtype`` directly in the
      reduce-scatter layout; the synced micro-batch reduce-scatters that buffer in place. One reduce-scatter per
      accumulation window; full-size gradient memory for the units that hold gradients.
    - ``"sharded"`` (ZeRO-2 style): every micro-batch reduce-scatters and accumulates into the sharded ``.grad``
      (original dtype, e.g. fp32). One reduce-scatter per micro-batch; only 1/world_size of the gradient memory.
    """
    if mode not in ("unsharded", "sharded"):
        raise ValueError(f'gradient accumulation mode must be "unsharded" or "sharded", got {mode!r}')
    for state in _states(module, recurse):
        if state.unit.has_accumulated_grads() and state.gradient_accumulation != mode:
            raise RuntimeError(
                f"cannot switch gradient accumulation of {state.unit.owner_name} to {mode!r} while no-sync "
                "gradients are pending; switch after a synced backward"
            )
        state.gradient_accumulation = mode


def set_full_precision_in_eval(module: nn.Module, enabled: bool = True, *, recurse: bool = True) -> None:
    """Run forwards of this module in the parameters' original dtype while it is in eval mode (``module.eval()``).

    Per instance: other sharded modules in the process keep their mixed-precision policy in eval.
    """
    for state in _states(module, recurse):
        state.full_precision_in_eval = enabled


def refresh_trainable(module: nn.Module) -> None:
    """Catch up with ``requires_grad`` changes now, in every unit under ``module``.

    Needed only with ``auto_refresh_trainable=False``; by default the root checks at every forward (one bool
    comparison per parameter) and refreshes what changed. Until refreshed, a unit keeps its previous view: a newly
    frozen parameter still gets (and reduces) gradients, a newly unfrozen one gets none. Every rank must make the same
    change; under ``frozen_params="replicate"`` a change that moves a parameter between whole and sharded all-gathers
    it once.
    """
    for state in _states(module, True):
        state.unit.refresh_trainable()


class _UnshardingMethod:
    """Instance attribute standing in for a method: unshard around it like around forward."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = _require_state(self.module)
        method = getattr(type(self.module), self.name)
        hooked = state.pre_forward(self.module, args, kwargs)
        if hooked is not None:
            args, kwargs = hooked
        output = method(self.module, *args, **kwargs)
        result = state.post_forward(self.module, args, output)
        return output if result is None else result


def register_forward_method(module: nn.Module, name: str) -> None:
    """Unshard around ``module.<name>(...)`` as around forward (e.g. ``generate``); bound to this instance only."""
    _require_state(module)
    if not callable(getattr(type(module), name, None)):
        raise ValueError(f"{type(module).__name__} has no method {name!r} to register")
    if isinstance(module.__dict__.get(name), _UnshardingMethod):
        return
    module.__dict__[name] = _UnshardingMethod(module, name)
