"""The functions that act on a sharded module (``fully_shard`` itself lives in init.py, which builds on this module).

FSDP2 puts these on a swapped class; here they are plain functions taking the module, so the class never changes.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from .hooks import hook_gradients, outside_step, post_forward, pre_forward
from .meshes import post_forward_group_for, reshard_after_forward_setting
from .policies import PREFETCH_POINTS, PrefetchPoint
from .state import STATE_ATTR, GradientAccumulation, ShardState, states_under

__all__ = [
    "UnshardHandle",
    "get_state",
    "is_fully_sharded",
    "no_sync",
    "refresh_trainable",
    "register_forward_method",
    "reset_step",
    "reshard",
    "set_collective_checks",
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


# ---------------------------------------------------------------------- functions on a sharded module
def get_state(module: nn.Module) -> ShardState | None:
    """The state ``fully_shard`` attached to this module instance, or None."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    return module.__dict__.get(STATE_ATTR)


def is_fully_sharded(module: nn.Module) -> bool:
    """True when ``fully_shard`` was called on this module (directly or as part of a list)."""
    return get_state(module) is not None


def _check_bool(value: object, name: str, function: str) -> None:
    """Flags must be real bools: a string such as "no" is truthy and would silently mean True."""
    if not isinstance(value, bool):
        raise TypeError(f"fc.{function}: {name} must be True or False, got {value!r}")


def _check_module(module: object, function: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fc.{function} takes a sharded nn.Module, got {type(module).__name__}")


def _require_state(module: nn.Module, function: str) -> ShardState:
    _check_module(module, function)
    state = get_state(module)
    if state is None:
        raise ValueError(f"fc.{function}: this {type(module).__name__} is not sharded; call fc.fully_shard on it first")
    return state


def _states(module: nn.Module, recurse: bool, function: str) -> list[ShardState]:
    _check_module(module, function)
    _check_bool(recurse, "recurse", function)
    if not recurse:
        return _require_state(module, function).members
    states = states_under(module)
    if not states:
        raise ValueError(
            f"fc.{function}: no module under this {type(module).__name__} is sharded; call fc.fully_shard first"
        )
    return states


class UnshardHandle:
    """Returned by ``fc.unshard(module, async_op=True)``: ``wait()`` finishes the all-gather and registers the full
    parameters. Without a ``wait()``, the module's next forward consumes the pending all-gather (no second one)."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    def wait(self) -> None:
        for member in self._state.members:
            member.params.finish()
            hook_gradients(member)


def unshard(module: nn.Module, *, async_op: bool = False) -> UnshardHandle | None:
    """All-gather the module's own unit now (e.g. to prefetch, or to run code outside forward on full parameters).

    The gathered parameters are used by the module's next forward (they are not discarded at the start of a step);
    they are freed after it per ``reshard_after_forward``, or with ``fc.reshard``.
    """
    _check_bool(async_op, "async_op", "unshard")
    state = _require_state(module, "unshard")
    # picks up parameters replaced since the last step first
    for member in state.members:
        member.start_gather(async_op=async_op, after_writes=outside_step(state.step))
        member.params.explicit = True
    handle = UnshardHandle(state)
    if async_op:
        return handle
    handle.wait()
    return None


def reshard(module: nn.Module) -> None:
    """Free the module's own full parameters and register the sharded ones again (no communication)."""
    for member in _require_state(module, "reshard").members:
        member.params.reshard()


def set_collective_checks(module: nn.Module, enabled: bool = True) -> None:
    """Check at every step, before any collective, that all ranks are about to run the same collectives.

    Ranks that freeze different parameters, or disagree on no-sync, reshard settings or the set of sharded units,
    otherwise hang or silently mix gradients. The check all-reduces the step schedule's 64-bit fingerprint once per
    step over the root's data-parallel ranks and raises the same ``RuntimeError`` on every rank, naming the unit and
    what differs.
    Per instance; set it on the root (or any module under it, with every rank doing the same).
    """
    _check_bool(enabled, "enabled", "set_collective_checks")
    for state in _states(module, True, "set_collective_checks"):
        state.collective_checks = enabled


def reset_step(module: nn.Module) -> None:
    """Forget the current step of the root ``module`` (or of the root above it): complete this rank's side of
    the step's collectives, drop the gradients it holds but has not delivered to ``.grad`` yet (no-sync accumulation
    included), reshard every unit.

    Not needed after an exception raised on every rank: the next forward of the root does the same for a step that
    did not finish (the gradients of an interrupted accumulation window are dropped, since the failed micro-batch's
    are mixed in). A backward that was interrupted is completed to its end — every all-gather and reduce-scatter it
    would have issued, with the results thrown away — so ranks that stopped at different points agree again. That
    also covers an exception on one rank only (an out-of-memory error on one device, in its forward or its loss):
    call ``reset_step`` in the ``except`` clause before any other collective. It walks the other ranks' backward with
    zeros and returns; their backward raises ``StepAbandoned`` at its end, with nothing kept, and ``reset_step``
    there has nothing left to do: ``except RuntimeError: fc.reset_step(model); continue`` on every rank keeps them
    in step. The same holds after an exception inside one rank's backward: its reset completes the rest of that
    backward with zeros, and the others learn it from the backward's closing word (docs/schedule.md, "The end of a
    step"). Without a backward running, every rank must call it at the same point.
    """
    state = _require_state(module, "reset_step")
    root = state.root
    step = root.step if root is not None else None
    if step is not None:
        step.reset()  # the step belongs to the root: reset all of it, whichever of its modules was passed
        return
    for sub in states_under(module):  # never ran a forward: nothing but held state to drop
        sub.grads.discard()
        sub.params.reshard()
        sub.record.forget_step()


def set_requires_gradient_sync(module: nn.Module, requires_sync: bool, *, recurse: bool = True) -> None:
    """When False, backward keeps full gradients and accumulates them; the next synced backward reduces them."""
    _check_bool(requires_sync, "requires_sync", "set_requires_gradient_sync")
    for state in _states(module, recurse, "set_requires_gradient_sync"):
        state.requires_gradient_sync = requires_sync


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Context manager for gradient accumulation: no reduction inside, previous settings restored after."""
    states = _states(module, True, "no_sync")
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
    states = _states(module, recurse, "set_reshard_after_forward")
    settings = [
        reshard_after_forward_setting(value, state.params.dp.mesh, state.params.owner_name, allow_none=False)
        for state in states
    ]
    for state, setting in zip(states, settings, strict=True):
        if isinstance(setting, int) and not isinstance(setting, bool) and not state.params.shards.uniform:
            raise NotImplementedError(
                f"set_reshard_after_forward({setting}) on {state.params.owner_name}, whose parameters have several "
                "dtypes or use FSDP2's all-gather hooks: a group size is not supported there; use True or False"
            )
    for state, setting in zip(states, settings, strict=True):
        state.reshard_after_forward_setting = setting
        state.params.post_forward = post_forward_group_for(setting, state.params.dp.mesh)


def set_reshard_after_backward(module: nn.Module, value: bool, *, recurse: bool = True) -> None:
    """Keep full parameters after backward (False), e.g. across no-sync micro-batches to skip re-gathering.

    A unit kept unsharded across an optimizer step is gathered again at its next forward (the step is detected from
    the sharded parameters' version counters), so the values stay right.
    """
    _check_bool(value, "value", "set_reshard_after_backward")
    for state in _states(module, recurse, "set_reshard_after_backward"):
        state.reshard_after_backward = value


def _state_list(modules: Iterable[nn.Module], function: str) -> list[ShardState]:
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise TypeError(
            f"fc.{function} takes a list of sharded modules, got {type(modules).__name__}; wrap a single module "
            "in a list"
        )
    listed = list(modules)
    for index, m in enumerate(listed):
        if not isinstance(m, nn.Module):
            raise TypeError(f"fc.{function}: entry {index} of modules is a {type(m).__name__}, not an nn.Module")
    return [member for m in listed for member in _require_state(m, function).members]


def set_modules_to_forward_prefetch(module: nn.Module, modules: Iterable[nn.Module]) -> None:
    """At ``module``'s forward, start the all-gathers of ``modules`` (replacing the implicit next-unit prefetch).

    Every rank must configure the same prefetches. An empty list turns forward prefetch off for ``module``.
    """
    state = _require_state(module, "set_modules_to_forward_prefetch")
    state.forward_prefetch = _state_list(modules, "set_modules_to_forward_prefetch")


def set_modules_to_backward_prefetch(module: nn.Module, modules: Iterable[nn.Module]) -> None:
    """At ``module``'s backward, start the all-gathers of ``modules`` (replacing the implicit previous-unit one)."""
    state = _require_state(module, "set_modules_to_backward_prefetch")
    state.backward_prefetch = _state_list(modules, "set_modules_to_backward_prefetch")


def set_backward_prefetch_point(module: nn.Module, point: PrefetchPoint = "midway", *, recurse: bool = True) -> None:
    """When each unit issues its implicit backward prefetch (the next unit's all-gather) during its own backward.

    - ``"midway"`` (the default): once half the bytes of the unit's trainable full parameters have their gradients
      (backward frees each full parameter as soon as its gradient is accumulated), after older reduce-scatters
      completed (on an accelerator checked, on CPU waited for where a wait cannot block a peer); at the unit's end
      at the latest. A unit with no trainable parameter, and the root (needed at both ends of backward), prefetch
      at their start once older reduce-scatters completed. What the prefetch holds then replaces parameters
      already freed, and it still overlaps the rest of the unit's backward.
    - ``"before"``: when the unit's backward starts (torch FSDP2's timing): the most overlap, the most memory
      (the next unit's all-gather output lives through the whole backward of this one).
    - ``"after"``: once the unit's backward is done and older reduce-scatters completed (FSDP1's
      ``BackwardPrefetch.BACKWARD_POST``): the least memory, the next all-gather exposed unless a reduce-scatter
      hides it.

    The collectives and their order are the same for every point. docs/schedule.md shows where each one puts the
    bytes; docs/benchmarks.md measures them.
    """
    if point not in PREFETCH_POINTS:
        raise ValueError(
            f"set_backward_prefetch_point: point must be one of {', '.join(map(repr, PREFETCH_POINTS))}, got {point!r}"
        )
    for state in _states(module, recurse, "set_backward_prefetch_point"):
        state.backward_prefetch_point = point


def set_backward_prefetch_post(module: nn.Module, enabled: bool = True, *, recurse: bool = True) -> None:
    """``fc.set_backward_prefetch_point(module, "after")`` (``enabled``), else back to ``"midway"``, the default.

    FSDP1's ``BackwardPrefetch.BACKWARD_POST``: each unit's implicit backward prefetch is issued once its own
    backward is done.
    """
    _check_bool(enabled, "enabled", "set_backward_prefetch_post")
    set_backward_prefetch_point(module, "after" if enabled else "midway", recurse=recurse)


def set_optimizer_in_backward(
    module: nn.Module, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *, recurse: bool = True
) -> list[torch.optim.Optimizer]:
    """Step each unit's parameters during backward, as soon as its gradients are reduced (pytorch/pytorch#98667).

    ``optimizer`` builds an optimizer from a list of parameters (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``);
    one is built per unit and returned (for learning-rate schedules and checkpoints). After a unit's reduce-scatter
    (and, for HSDP, its all-reduce) its optimizer steps and its gradients are freed, so no gradient outlives its unit
    and there is no separate ``optimizer.step()``. Only synced backwards step (not no-sync micro-batches).
    Gradient clipping over the whole model is not possible in this mode (each unit steps before the others' gradients
    exist), and a unit used twice in one backward is not supported (its second use would see updated weights).
    Per instance: a ``copy.deepcopy`` of the module does not carry the optimizers.
    """
    if not callable(optimizer):
        raise TypeError(
            "fc.set_optimizer_in_backward: optimizer must build an optimizer from a list of parameters (e.g. "
            f"lambda ps: torch.optim.AdamW(ps, lr=1e-3)), got {type(optimizer).__name__}"
        )
    built = []
    for state in _states(module, recurse, "set_optimizer_in_backward"):
        params = [mp.sharded for mp in state.params.shards.params]
        if not params:
            continue
        opt = optimizer(params)  # type: ignore[arg-type]
        state.grads.delivery.on_finished = _StepInBackward(state, opt)
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
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(
            f"fc.set_gradient_divide_factor: factor must be a real number (e.g. 2.0), got {factor!r} "
            f"({type(factor).__name__})"
        )
    if not math.isfinite(factor) or not factor > 0:
        raise ValueError(
            f"fc.set_gradient_divide_factor: gradient divide factor must be positive and finite, got {factor}; "
            "1.0 gives the plain sum over ranks"
        )
    for state in _states(module, recurse, "set_gradient_divide_factor"):
        state.grads.divide_factor = float(factor)


def set_requires_all_reduce(module: nn.Module, requires_all_reduce: bool, *, recurse: bool = True) -> None:
    """HSDP: skip (False) or do (True) the all-reduce over replicas after each reduce-scatter.

    With sharded accumulation, skip it on all micro-batches but the last: the reduce-scattered shards add up locally
    and the last micro-batch all-reduces their sum once.
    """
    _check_bool(requires_all_reduce, "requires_all_reduce", "set_requires_all_reduce")
    for state in _states(module, recurse, "set_requires_all_reduce"):
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
    states = _states(module, recurse, "set_gradient_accumulation")
    for state in states:  # every unit is checked before any changes
        if state.grads.has_pending() and state.gradient_accumulation != mode:
            raise RuntimeError(
                f"cannot switch gradient accumulation of {state.params.owner_name} to {mode!r} while no-sync "
                "gradients are pending; switch after a synced backward"
            )
    for state in states:
        state.gradient_accumulation = mode


def set_full_precision_in_eval(module: nn.Module, enabled: bool = True, *, recurse: bool = True) -> None:
    """Run forwards of this module in the parameters' original dtype while it is in eval mode (``module.eval()``).

    Per instance: other sharded modules in the process keep their mixed-precision policy in eval.
    """
    _check_bool(enabled, "enabled", "set_full_precision_in_eval")
    for state in _states(module, recurse, "set_full_precision_in_eval"):
        state.full_precision_in_eval = enabled


def refresh_trainable(module: nn.Module) -> None:
    """Catch up with ``requires_grad`` changes now, in every unit under ``module``.

    Needed only with ``auto_refresh_trainable=False``; by default the root checks at every forward (one bool
    comparison per parameter) and refreshes what changed. Until refreshed, a unit keeps its previous view: a newly
    frozen parameter still gets (and reduces) gradients, a newly unfrozen one gets none. Every rank must make the same
    change; under ``frozen_params="replicate"`` a change that moves a parameter between whole and sharded all-gathers
    it once.
    """
    for state in _states(module, True, "refresh_trainable"):
        state.refresh_trainable()


class _UnshardingMethod:
    """Instance attribute standing in for a method: the call runs as a call of the module's unit, as ``forward`` does.

    The unit is gathered around it (if it is not already), its inputs and outputs are hooked the same way, so a loss
    on the method's outputs trains the unit; forwards the method runs inside (``generate`` calls ``forward``) enter
    the unit again, which costs nothing while it is gathered."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = _require_state(self.module, self.name)
        method = getattr(type(self.module), self.name)
        hooked = pre_forward(state, self.module, args, kwargs)
        if hooked is not None:
            args, kwargs = hooked
        output = None
        try:
            output = method(self.module, *args, **kwargs)
        finally:
            output = post_forward(state, self.module, args, output)
        return output


def register_forward_method(module: nn.Module, name: str) -> None:
    """Gather ``module``'s own unit around ``module.<name>(...)`` (e.g. ``generate``); bound to this instance only.

    The forwards the method runs are ordinary forwards; the gather serves the parameters it uses outside them. Unlike
    a forward, the method's inputs are not cast by ``mp_policy`` (its forwards cast theirs)."""
    _require_state(module, "register_forward_method")
    if not isinstance(name, str):
        raise TypeError(f"fc.register_forward_method: name must be a method name (str), got {type(name).__name__}")
    if not callable(getattr(type(module), name, None)):
        raise ValueError(f"{type(module).__name__} has no method {name!r} to register")
    if isinstance(module.__dict__.get(name), _UnshardingMethod):
        return
    module.__dict__[name] = _UnshardingMethod(module, name)
