"""FSDP2's method names on a sharded module, bound per instance, for code written against torch's ``FSDPModule``.

Torch's ``fully_shard`` swaps the module's class to add methods (``model.set_requires_gradient_sync(False)``,
``model.unshard()``...). fsdp_compose never swaps the class; its equivalents are functions taking the module. Trainers
written for FSDP2 call the methods, so ``bind_fsdp2_methods(model)`` (or ``fully_shard(..., fsdp2_methods=True)``)
puts one callable per FSDP2 method name in each sharded module's instance ``__dict__``: opt-in, per instance,
nothing bound on a class or globally, and a ``copy.deepcopy`` of the module gets callables bound to the copy.

``_METHODS`` maps each name to the function the bound method calls with the module first, under FSDP2's signature
and semantics (docs/integrations.md has the table): the ``fc`` function itself where its parameters are FSDP2's, else
a function here. A setting fsdp_compose has no machinery for is one of:

- accepted and ignored (each function's docstring, which the bound method shows, says why): the setting is already
  what fsdp_compose always does, or it only decides where FSDP2 allocates communication buffers. The arguments are
  checked as FSDP2 takes them and nothing changes: the results are those of FSDP2 with that setting;
- not mapped (``_not_mapped``: ``set_custom_all_gather``, ``set_custom_reduce_scatter``): its contract does not map
  onto fsdp_compose's; it raises ``NotImplementedError`` naming the ``fc.ShardExtensions`` alternative, rather than
  silently not calling the user's code.

Streams, for the settings that name them: on an accelerator, each root's step issues its all-gathers from a side
stream of its own (``StepContext.gather_stream``, from ``collectives.side_stream``), which allocates their buffers
(an ``fc.ShardExtensions`` all-gather runs on the current stream instead); reduce-scatters and all-reduces are issued
from the current stream. On CPU there is no side stream: everything runs on the current stream.

``set_all_reduce_hook`` and ``set_reduce_scatter_unused_params`` act on the unit's gradient delivery (grads.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .. import api
from ..api import get_state
from ..state import states_under

__all__ = ["FSDP2_METHOD_NAMES", "bind_fsdp2_methods", "has_fsdp2_methods", "share_comm_ctx"]


def _check_bool(value: object, name: str, method: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}: {name} must be True or False, got {value!r}")


# ---------------------------------------------------------------------- FSDP2's methods, as functions of the module
# Where FSDP2 names or passes a parameter differently from the fc function (test_fsdp2_compat checks the signatures).
def _unshard(module: nn.Module, async_op: bool = False) -> api.UnshardHandle | None:
    return api.unshard(module, async_op=async_op)


def _set_reshard_after_forward(module: nn.Module, reshard_after_forward: bool, recurse: bool = True) -> None:
    api.set_reshard_after_forward(module, reshard_after_forward, recurse=recurse)


def _set_reshard_after_backward(module: nn.Module, reshard_after_backward: bool, *, recurse: bool = True) -> None:
    api.set_reshard_after_backward(module, reshard_after_backward, recurse=recurse)


def _set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    # FSDP2's flag also switches the HSDP all-reduce; fc keeps the two independent, so the bound method sets both.
    api.set_requires_gradient_sync(module, requires_gradient_sync, recurse=recurse)
    api.set_requires_all_reduce(module, requires_gradient_sync, recurse=recurse)


def _not_mapped(method: str, alternative: str) -> Callable[..., None]:
    def refuse(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{method} (torch FSDP2) has no fsdp_compose equivalent with the same contract, and ignoring it would "
            f"silently skip your code; {alternative}"
        )

    return refuse


_EXTENSIONS_HINT = "pass fc.ShardExtensions({field}=...) to fc.fully_shard instead (see fsdp_compose/extensions.py)"


def _set_post_optim_event(module: nn.Module, event: torch.Event) -> None:
    # FSDP2 makes its all-gather streams wait on the event; fsdp_compose's all-gather stream waits for the current
    # stream at the root's forward (docs/design.md, "Streams"), so making that stream wait gives the same ordering for
    # every later all-gather. A CPU stream's record_event() returns None: nothing to wait for, as in FSDP2.
    api._require_state(module, "set_post_optim_event")
    if event is not None:
        event.wait()


def _set_all_reduce_hook(
    module: nn.Module, hook: Callable[[torch.Tensor], None], *, stream: torch.cuda.Stream | None = None
) -> None:
    # This module's own unit (FSDP2: its own parameter group), not recursive. The hook gets the unit's reduced rows
    # (after the reduce-scatter, and after the all-reduce over replicas under HSDP) and may change them in place.
    state = api._require_state(module, "set_all_reduce_hook")
    if not callable(hook):
        raise TypeError(f"set_all_reduce_hook: hook must be callable as hook(reduce_output), got {type(hook).__name__}")
    if stream is not None and state.params.dp.replicate_group is not None:
        raise ValueError("stream cannot be set when using native HSDP")  # FSDP2's check and message
    state.grads.delivery.reduced_hook = hook
    state.grads.delivery.reduced_hook_stream = stream


def _set_gradient_divide_factor(module: nn.Module, factor: float) -> None:
    # FSDP2's method sets this module's own unit only (not recursive), unlike fc.set_gradient_divide_factor's default.
    api.set_gradient_divide_factor(module, factor, recurse=False)


def _set_reduce_scatter_divide_factor(module: nn.Module, factor: float) -> None:
    warnings.warn(
        "set_reduce_scatter_divide_factor is deprecated in torch FSDP2; use set_gradient_divide_factor",
        FutureWarning,
        stacklevel=3,
    )
    _set_gradient_divide_factor(module, factor)


def _set_reduce_scatter_unused_params(
    module: nn.Module, reduce_scatter_unused_params: bool, *, recurse: bool = True
) -> None:
    # Every trainable unit that ran reduce-scatters, with zeros for parameters without a gradient, so ranks never
    # issue different collectives either way. True also gives a parameter that no rank had a gradient for a zero
    # .grad, as FSDP2 does; False (the default) leaves it None.
    _check_bool(reduce_scatter_unused_params, "reduce_scatter_unused_params", "set_reduce_scatter_unused_params")
    for state in api._states(module, recurse, "set_reduce_scatter_unused_params"):
        state.grads.zero_unused = reduce_scatter_unused_params


def _set_reduce_scatter_max_input_buffers(module: nn.Module, max_input_buffers: int, *, recurse: bool = True) -> None:
    if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
        raise ValueError(f"set_reduce_scatter_max_input_buffers: expected an int >= 1, got {max_input_buffers!r}")
    for state in api._states(module, recurse, "set_reduce_scatter_max_input_buffers"):
        # read on the root: reduce-scatter inputs alive beside the one filled
        state.max_reduce_inputs = max_input_buffers


def _set_unshard_in_backward(module: nn.Module, unshard_in_backward: bool) -> None:
    _check_bool(unshard_in_backward, "unshard_in_backward", "set_unshard_in_backward")
    for member in api._require_state(module, "set_unshard_in_backward").members:
        member.unshard_in_backward = unshard_in_backward


# ---------------------------------------------------------------------- accepted and ignored (the docstring says why)
def _set_is_last_backward(module: nn.Module, is_last_backward: bool) -> None:
    """fsdp_compose's end of backward always waits for every reduction and clears its prefetch state (FSDP2 with
    True); False only lets FSDP2 skip that wait, which changes no gradient."""
    _check_bool(is_last_backward, "is_last_backward", "set_is_last_backward")
    api._require_state(module, "set_is_last_backward")


def _set_force_sum_reduction_for_comms(module: nn.Module, enable: bool) -> None:
    """fsdp_compose always reduces with SUM and divides locally (FSDP2 with True); False (FSDP2 may then use AVG or
    PREMUL_SUM) gives the same averages up to rounding."""
    _check_bool(enable, "enable", "set_force_sum_reduction_for_comms")
    api._require_state(module, "set_force_sum_reduction_for_comms")


def _set_separate_reduce_scatter_group(module: nn.Module, enable: bool = True, *, recurse: bool = True) -> None:
    """fsdp_compose already reduce-scatters on a group of its own (meshes.reduce_scatter_group) wherever it can."""
    _check_bool(enable, "enable", "set_separate_reduce_scatter_group")
    api._states(module, recurse, "set_separate_reduce_scatter_group")


def _set_allocate_memory_from_process_group_for_comm(module: nn.Module, enable: bool) -> None:
    """A performance setting: fsdp_compose's communication buffers come from torch.empty."""
    _check_bool(enable, "enable", "set_allocate_memory_from_process_group_for_comm")
    api._require_state(module, "set_allocate_memory_from_process_group_for_comm")


def _set_symm_mem_for_comm(module: nn.Module, backend: str = "NCCL") -> None:
    """A performance setting: fsdp_compose's staging buffers are ordinary device memory."""
    if backend != "NCCL":
        raise ValueError(f'set_symm_mem_for_comm: only backend "NCCL" exists in torch FSDP2, got {backend!r}')
    api._require_state(module, "set_symm_mem_for_comm")


def _set_unshard_async_op(module: nn.Module, async_op: bool) -> None:
    """FSDP2's True allocates the pre-forward/pre-backward all-gather buffers on the current stream. fsdp_compose
    allocates them on the root step's side stream on an accelerator, on the current stream on CPU (module docstring,
    "Streams"), whatever the value: where memory comes from, never what is computed. Recursive like FSDP2's."""
    _check_bool(async_op, "async_op", "_set_unshard_async_op")
    api._states(module, True, "_set_unshard_async_op")


_METHODS: dict[str, Callable[..., Any]] = {
    "reshard": api.reshard,
    "unshard": _unshard,
    "reset_iter_state": api.reset_step,
    "set_is_last_backward": _set_is_last_backward,
    "set_requires_gradient_sync": _set_requires_gradient_sync,
    "set_requires_all_reduce": api.set_requires_all_reduce,
    "set_reshard_after_forward": _set_reshard_after_forward,
    "set_reshard_after_backward": _set_reshard_after_backward,
    "set_modules_to_forward_prefetch": api.set_modules_to_forward_prefetch,
    "set_modules_to_backward_prefetch": api.set_modules_to_backward_prefetch,
    "set_custom_all_gather": _not_mapped(
        "set_custom_all_gather", _EXTENSIONS_HINT.format(field="all_gather") + " (an encode/decode of the payload)"
    ),
    "set_custom_reduce_scatter": _not_mapped(
        "set_custom_reduce_scatter",
        _EXTENSIONS_HINT.format(field="reduce_scatter") + " (a hook that must leave the sum over ranks)",
    ),
    "set_all_reduce_hook": _set_all_reduce_hook,
    "set_post_optim_event": _set_post_optim_event,
    "set_reduce_scatter_divide_factor": _set_reduce_scatter_divide_factor,
    "set_gradient_divide_factor": _set_gradient_divide_factor,
    "set_force_sum_reduction_for_comms": _set_force_sum_reduction_for_comms,
    "set_reduce_scatter_unused_params": _set_reduce_scatter_unused_params,
    "set_reduce_scatter_max_input_buffers": _set_reduce_scatter_max_input_buffers,
    "set_separate_reduce_scatter_group": _set_separate_reduce_scatter_group,
    "set_unshard_in_backward": _set_unshard_in_backward,
    "set_allocate_memory_from_process_group_for_comm": _set_allocate_memory_from_process_group_for_comm,
    "set_symm_mem_for_comm": _set_symm_mem_for_comm,
    "_set_unshard_async_op": _set_unshard_async_op,  # private in FSDP2, but its own tests and some trainers call it
}

# The public methods of torch 2.13's FSDPModule (tests check this list against torch's class).
FSDP2_METHOD_NAMES: tuple[str, ...] = tuple(sorted(name for name in _METHODS if not name.startswith("_")))


class _BoundMethod:
    """One FSDP2 method bound to one module instance (stored in that instance's ``__dict__``).

    A plain object holding the module and the method's name: ``copy.deepcopy`` of the module copies it with the
    module's own memo, so the copy's method acts on the copy."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        self.__doc__ = _METHODS[name].__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _METHODS[self.name](self.module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<fsdp_compose FSDP2 method {self.name} of {type(self.module).__name__}>"


def bind_fsdp2_methods(module: nn.Module, *, recurse: bool = True) -> nn.Module:
    """Give ``module`` (and, with ``recurse``, every sharded module under it) FSDP2's methods as instance attributes.

    After ``fc.bind_fsdp2_methods(model)``, code written for torch's ``FSDPModule`` calls them unchanged:
    ``model.set_requires_gradient_sync(False)``, ``block.set_gradient_divide_factor(1.0)``, ``model.unshard()``...
    Nothing is bound on the class or globally; ``isinstance(model, FSDPModule)`` stays False (see
    ``has_fsdp2_methods`` for guards). Like FSDP2's class swap, the bound names take precedence over methods of the
    same name on the module's class. Returns ``module``.
    """
    api._check_module(module, "bind_fsdp2_methods")
    _check_bool(recurse, "recurse", "fc.bind_fsdp2_methods")
    if recurse:
        states = states_under(module)
        if not states:
            raise ValueError(
                f"fc.bind_fsdp2_methods: no module under this {type(module).__name__} is sharded; call "
                "fc.fully_shard first"
            )
        targets = [m for state in states for m in state.modules]
    else:
        targets = list(api._require_state(module, "bind_fsdp2_methods").modules)
    for target in targets:
        for name in _METHODS:
            target.__dict__[name] = _BoundMethod(target, name)
    return module


def has_fsdp2_methods(module: nn.Module) -> bool:
    """True for a torch ``FSDPModule`` and for a module fsdp_compose sharded with FSDP2's methods bound: the
    drop-in replacement for ``isinstance(module, FSDPModule)`` in guards before calling those methods."""
    if isinstance(module, FSDPModule):
        return True
    if not isinstance(module, nn.Module):  # False like isinstance, so it drops into any guard
        return False
    return get_state(module) is not None and isinstance(module.__dict__.get("set_requires_gradient_sync"), _BoundMethod)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """torch's ``share_comm_ctx``: FSDP2 makes roots (pipeline stages) share its communication streams, so their
    buffers come from one pool. fsdp_compose's roots keep their own all-gather side streams on an accelerator (module
    docstring, 'Streams'; on CPU everything runs on the current stream), which changes where memory comes from, not
    what is computed: this only checks that the modules are sharded."""
    for index, m in enumerate(modules):
        if not isinstance(m, nn.Module) or get_state(m) is None:
            raise ValueError(f"fc.share_comm_ctx: entry {index} ({type(m).__name__}) is not a sharded module")
