"""The entry points of a step: the hooks ``fully_shard`` registers on a unit's modules and in autograd's graph.

nn.Module and autograd call these functions; each hands what happened down to the unit (state.py: its own gather,
close and record), the root's step (step.py: forward prefetch, the step's boundaries) or the running backward's
walk (backward.py: every backward collective, in the agreed order; docs/schedule.md)::

    root pre-forward        lazy init on the first call (find the root, check every unit, make the StepContext);
                            then StepContext.begin_forward: finish the last step, refresh trainability, move inputs
    unit pre-forward        ShardState.open_for_forward (gather unless gathered), StepContext.prefetch_forward (the
                            next unit); cast inputs; wrap them in _PostBackward (its backward: this call's input
                            gradients exist)
    user forward            runs unchanged on full parameters
    unit post-forward       cast outputs; outputs that need grad go through _PreBackward (one ForwardCall per call);
                            ShardState.close_opening once every module ran (reshard per reshard_after_forward)
    ---- loss.backward() ----
    _PreBackward.backward   pre_backward: the first one agrees the backward's participants across ranks; then the
                            gather cursor issues the all-gathers up to this unit
    user backward           autograd fills the full parameters' .grad (moved into the buffer as they come when
                            accumulating)
    _PostBackward.backward  post_backward: once every call of the unit this backward runs is done, the unit is
                            resharded, its gradients staged, and the reduce cursor issues the reductions due
    final callback          the rest of the agreed order; wait; deliver; reshard

A unit may be entered any number of times, wholly or one module at a time; a forward while autograd runs a backward
is an activation-checkpoint recompute. Hooks are kept out of ``torch.compile``'s traced regions
(``torch.compiler.disable``): they issue collectives and swap parameters, which a graph cannot hold. What a forward
call leaves for its step goes into the unit's ``UnitStepRecord`` (state.py); nothing here keeps state of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch._dynamo.compiled_autograd
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .collectives import labelled
from .state import ForwardCall, ShardState, states_under
from .step import StepContext, StepPhase

if TYPE_CHECKING:
    from .flat import ManagedParam

logger = logging.getLogger(__name__)

__all__ = [
    "autograd_tensors",
    "cast_floating",
    "cast_inputs",
    "cast_outputs",
    "check_backward_reads_none_of",
    "compiled_autograd_error",
    "hook_gradients",
    "lazy_init",
    "outside_step",
    "post_forward",
    "pre_forward",
    "register_hooks",
    "tensors_in",
]

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _outside_compile(hook: _Hook) -> _Hook:
    """Run ``hook`` eagerly even inside a compiled region (a graph break): it issues collectives and swaps
    parameters on modules, which a traced graph cannot hold. torch's own FSDP does the same with its hooks."""
    return cast(_Hook, torch.compiler.disable(hook))


def register_hooks(state: ShardState) -> None:
    """The unit's module hooks, bound to ``state`` (``functools.partial``: ``copy.deepcopy`` of a module copies
    them with their state)."""
    for module in state.modules:
        module.register_forward_pre_hook(functools.partial(pre_forward, state), prepend=True, with_kwargs=True)
        module.register_forward_hook(functools.partial(post_forward, state), always_call=True)
        module.register_state_dict_pre_hook(functools.partial(_reshard, state))
        module.register_load_state_dict_pre_hook(functools.partial(_reshard, state))


def _reshard(state: ShardState, *unused: Any) -> None:
    """Before ``state_dict`` / ``load_state_dict``: the module's parameters are its sharded DTensors again."""
    for member in state.members:
        member.params.reshard()


# ---------------------------------------------------------------------- the forward
@_outside_compile
def pre_forward(
    state: ShardState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    members = state.members
    if any(member.host is not None for member in members):
        raise RuntimeError(
            f"fsdp_compose: unit {state.params.owner_name} is in host memory (fc.move_to_host); call "
            "fc.move_to_device(model) before a forward"
        )
    with labelled(f"fsdp_compose::pre_forward[{state.params.owner_name}]"):
        record = state.record
        step = state.step
        if torch._C._current_graph_task_id() != -1:
            # A forward inside backward: an activation-checkpoint recompute. The unit needs its parameters now, at
            # its turn in the gather order (a recompute before the unit's own pre-backward starts its backward).
            _gather_for_backward(state, step)
            reentrant = state.enter_recompute(module)
            for sibling in state.siblings:
                sibling.enter_recompute(module)
            args, kwargs = cast_inputs(state, module, args, kwargs, state.compute_dtype(module))
            if reentrant:
                args, kwargs = _wrap_inputs(state, args, kwargs, ForwardCall(), per_input=False)
            return args, kwargs
        if state.root is None:
            step = lazy_init(state)
        if step is not None and state.root is state and record.active == 0:
            args, kwargs = step.begin_forward(args, kwargs)
        compute_dtype = state.compute_dtype(module)
        if not record.opened or id(module) not in record.pending_modules:
            # first call of this unit since it closed, or a module run again
            for member in members:
                member.open_for_forward(module, compute_dtype, after_writes=outside_step(step))
                hook_gradients(member)
            if step is not None:
                step.prefetch_forward(members[-1])
        entry = ForwardCall(step.next_call_number() if step is not None else 0)
        for member in members:
            member.enter_call(module, entry)
        args, kwargs = cast_inputs(state, module, args, kwargs, compute_dtype)
        if torch.is_grad_enabled():
            args, kwargs = _wrap_inputs(state, args, kwargs, entry)
        elif not torch.is_inference_mode_enabled():
            _note_recomputable(state, entry, args, kwargs)
        return args, kwargs


@_outside_compile
def post_forward(state: ShardState, module: nn.Module, args: Any, output: Any) -> Any:
    """Also runs when forward raised (``always_call``): ``output`` is then None and the call just ends."""
    with labelled(f"fsdp_compose::post_forward[{state.params.owner_name}]"):
        output = cast_outputs(state, module, output)
        if torch._C._current_graph_task_id() != -1:
            return output  # activation-checkpoint recompute: the original forward's hooks serve its backward
        record = state.record
        step = state.step if state.root is state else None
        members = state.members
        entry = state.leave_call(module)
        for sibling in state.siblings:
            sibling.leave_call(module)
        if entry is None:
            if step is not None and output is None and record.active == 0:
                step.end_forward(raised=True)  # the root's forward raised before any unit call ended
            return output  # its pre-forward did not run (e.g. it raised before)
        grad_enabled = torch.is_grad_enabled()
        if torch._C._are_functorch_transforms_active():
            # Inside torch.func.jvp / vmap / grad an autograd Function without setup_context raises, also on plain
            # outputs (a unit called on a tensor captured from outside the transform): hook them instead.
            return _hook_transformed_outputs(state, tensors_in(output) if grad_enabled else [], entry, output)
        needing = tensors_in(output, requiring_grad=True) if grad_enabled else []
        if needing:
            # One node per output (why: ForwardCall): an output the loss ignores leaves the unit out of the graph.
            replacement = {id(tensor): _PreBackward.apply(state, tensor) for tensor in needing}
            entry.pre += [weakref.ref(hooked.grad_fn) for hooked in replacement.values()]
            output = map_tensors(lambda t: replacement.get(id(t), t), output)
            for member in members:
                member.expect_backward(entry)
        elif entry.inputs is not None and not (grad_enabled and tensors_in(output)):
            # recomputed in backward (reentrant checkpoint): resharded until then
            for member in members:
                member.record.entries.append(entry)
        for member in members:
            member.close_if_done()
        if step is not None and record.active == 0:
            step.end_forward(raised=output is None)
        return output


# ---------------------------------------------------------------------- the backward
@_outside_compile
def pre_backward(state: ShardState, node: object = None) -> None:
    with labelled(f"fsdp_compose::pre_backward[{state.params.owner_name}]"):
        compiled_autograd = torch._dynamo.compiled_autograd
        if compiled_autograd.compiled_autograd_enabled or compiled_autograd.in_compiled_autograd_region:
            raise compiled_autograd_error(state.params.owner_name)  # before the unit issues any collective of it
        step = state.step
        members = state.members
        if step is not None and not state.unshard_in_backward:
            check_backward_reads_none_of(
                state.params.owner_name, node, [mp for member in members for mp in member.params.shards.params]
            )
        if step is not None:
            step.begin_backward(node)
        _gather_for_backward(state, step)


def _gather_for_backward(state: ShardState, step: StepContext | None) -> None:
    """The unit and its siblings need their parameters in a backward: at their turn in the running backward's walk,
    else at once (no step yet, or a backward that began under another root: nested roots)."""
    walk = step.backward if step is not None else None
    if walk is not None:
        walk.gather_for_backward(state.members)
    for member in state.members:
        if walk is None:
            member.gather_now(after_writes=outside_step(step))
        hook_gradients(member)


@_outside_compile
def post_backward(state: ShardState) -> None:
    """One call's backward is done; the backward's walk finishes the unit once every call it runs here is."""
    step = state.step
    walk = step.backward if step is not None else None
    if walk is not None:
        with labelled(f"fsdp_compose::post_backward[{state.params.owner_name}]"):
            for member in reversed(state.members):  # the reduce order
                walk.call_backward_done(member)


def outside_step(step: StepContext | None) -> bool:
    """Is a gather now outside the root's forward and backward (``ShardState.start_gather``'s ``after_writes``)?"""
    return step is None or step.phase is StepPhase.IDLE


# ---------------------------------------------------------------------- the gradients
_GRADIENT_HOOK = "_fsdp_compose_gradient_hook"  # attribute of a full parameter: the handle of its hook below


class _GradientMade:
    """Post-accumulate-grad hook of a full parameter: hands each gradient to the running backward's walk (which may
    free the parameter at once) or, outside a backward of the root's step, to the unit's gradients.

    It holds the state and the parameter record weakly: autograd keeps a tensor's hooks alive from C++, so a strong
    reference back to the unit would form a cycle the garbage collector cannot see, and a deleted model (with its
    buffers and process groups) would never be freed.
    """

    def __init__(self, state: ShardState, mp: ManagedParam) -> None:
        self.state = weakref.ref(state)
        self.mp = weakref.ref(mp)

    def __call__(self, param: torch.Tensor) -> None:
        state, mp = self.state(), self.mp()
        if state is None or mp is None:
            return
        walk = state.step.backward if state.step is not None else None
        if walk is not None:
            walk.gradient_made(state, mp)
        else:
            state.grads.capture(mp)


def hook_gradients(state: ShardState) -> None:
    """Once the unit is gathered for compute: every full parameter that trains carries ``_GradientMade`` (a new
    tensor, or one whose ``requires_grad`` was switched on) before autograd can accumulate into it."""
    for mp in state.params.shards.params:
        full = mp.full
        if full is not None and full.requires_grad and not hasattr(full, _GRADIENT_HOOK):
            setattr(full, _GRADIENT_HOOK, full.register_post_accumulate_grad_hook(_GradientMade(state, mp)))


def lazy_init(root: ShardState) -> StepContext:
    """``root`` becomes the root of every state below it and owns their step. Checks run first: a bad model fails
    before a collective."""
    states: list[ShardState] = []
    seen: set[int] = set()
    for module in root.modules:
        for state in states_under(module):
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    for state in states:
        state.params.shards.check_materialized()
    for state in states:
        state.root = root
        state.step = None
    step = StepContext(root, states)
    for state in states:
        state.step = step
        state.gather_stream = step.gather_stream
    logger.debug("lazy init: root %s with %d units", root.params.owner_name, len(states))
    return step


class _PreBackward(torch.autograd.Function):
    """Identity on one output of a unit whose backward runs before the unit's own: gather its parameters for it.

    The output is a detached alias, not a view, so a caller may still modify it in place."""

    @staticmethod
    def forward(ctx: Any, state: ShardState, output: torch.Tensor) -> torch.Tensor:
        ctx.state = state
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.ran = True  # see ForwardCall.outputs_pending
        pre_backward(ctx.state, ctx)
        return None, grad


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs (one per node, see ``ForwardCall``) whose backward runs once their gradients
    are computed.

    Once the last input node of a call that this backward runs has run, the unit's own backward for the call is done
    (its ops consumed those inputs), so once every call's is, its parameter gradients can be reduced and its full
    parameters freed — layer by layer, not at the end of backward.
    """

    @staticmethod
    def forward(ctx: Any, state: ShardState, entry: ForwardCall, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.entry = entry
        return tuple(tensor.detach() for tensor in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        entry = ctx.entry
        entry.posts_left -= 1
        if entry.posts_left == 0:
            post_backward(ctx.state)
        return (None, None, *grads)


def _wrap_inputs(
    state: ShardState, args: tuple[Any, ...], kwargs: dict[str, Any], entry: ForwardCall, *, per_input: bool = True
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``per_input=False``: one node over all inputs (a reentrant checkpoint's recompute, which begins after the
    backward asked which nodes it runs: its one node ends the call)."""
    needing = tensors_in((args, kwargs), requiring_grad=True)
    if not needing or torch._C._are_functorch_transforms_active():
        # Nothing to hook, or a torch.func transform is active: an autograd Function without setup_context raises
        # there, on the transform's own wrapped inputs and on plain ones captured from outside it alike. The final
        # callback finishes this call.
        return args, kwargs
    if per_input:  # one node per input (why: ForwardCall)
        wrapped = [_PostBackward.apply(state, entry, tensor)[0] for tensor in needing]
        entry.post = [weakref.ref(node_output.grad_fn) for node_output in wrapped]
    else:
        wrapped = list(_PostBackward.apply(state, entry, *needing))
        entry.post = [weakref.ref(wrapped[0].grad_fn)]
    entry.posts_left = len(entry.post)  # until a backward asks which of them it runs
    replacement = dict(zip(map(id, needing), wrapped, strict=True))
    new_args, new_kwargs = map_tensors(lambda t: replacement.get(id(t), t), (args, kwargs))
    return new_args, new_kwargs


def _note_recomputable(state: ShardState, entry: ForwardCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A call under no_grad inside a forward with grad may be a reentrant checkpoint's forward (or run inside one):
    keep its inputs that need grad (weakly), or else the root's call it runs in."""
    needing = tensors_in((args, kwargs), requiring_grad=True)
    if needing:
        entry.inputs = [weakref.ref(t) for t in needing]
        return
    root = state.root
    open_calls = []
    if root is not None and root is not state:
        open_calls = [e for calls in root.record.calls.values() for e in calls]
    if open_calls and open_calls[-1].grad_enabled and state.grads.trainable:
        entry.inputs, entry.anchor = [], open_calls[-1]


def _hook_transformed_outputs(state: ShardState, found: list[torch.Tensor], entry: ForwardCall, output: Any) -> Any:
    """Outputs under a ``torch.func`` transform (``jvp``, ``vmap``, ``grad``): an autograd Function cannot wrap them,
    so the plain tensors under them (primal and tangent, whose backward both read the unit's parameters; or the
    outputs themselves when they are plain, computed from tensors captured from outside the transform) get tensor
    hooks, and the call counts as run by every backward until one runs (its reach cannot be asked)."""
    record = state.record
    plain = tensors_in([p for t in found for p in autograd_tensors(t)], requiring_grad=True)
    members = state.members
    if plain:
        entry.always = True
        for tensor in plain:
            tensor.register_hook(lambda grad: pre_backward(state))
        for member in members:
            member.expect_backward(entry)
    for member in members:
        member.close_if_done()
    step = state.step
    if step is not None and state.root is state and record.active == 0:
        step.end_forward()
    return output


def cast_inputs(
    state: ShardState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast floating inputs to ``param_dtype`` under torch's rule: whenever the policy names a ``param_dtype`` and
    ``cast_forward_inputs`` is on, even when it equals the parameters' own dtype (an fp32 unit fed bf16 by an upstream
    unit's ``output_dtype`` must compute in fp32). Not in a full-precision eval forward (``dtype`` is then the
    parameters' own dtype, not the policy's): FSDP1's full-precision eval leaves the inputs alone too."""
    policy_dtype = state.mp_policy.param_dtype
    if policy_dtype is None or dtype != policy_dtype or not state.mp_policy.cast_forward_inputs:
        return args, kwargs

    def cast(leaf: torch.Tensor) -> torch.Tensor:
        if leaf.is_floating_point() and leaf.dtype != dtype:
            state.record.incoming_dtype.setdefault(id(module), leaf.dtype)
            return leaf.to(dtype)
        return leaf

    new_args, new_kwargs = map_tensors(cast, (args, kwargs))
    return new_args, new_kwargs


def cast_outputs(state: ShardState, module: nn.Module, output: Any) -> Any:
    """``output_dtype`` when set; otherwise a non-root unit that cast its inputs down hands its outputs back in
    the dtype those inputs came in, so a bf16 block inside an fp32 model just works."""
    incoming = state.record.incoming_dtype.pop(id(module), None)
    if state.record.full_precision_now:
        return output
    dtype = state.mp_policy.output_dtype
    if dtype is None and incoming is not None and state.root is not state:
        dtype = incoming
    if dtype is None:
        return output
    return map_tensors(lambda v: cast_floating(v, dtype), output)


# ---------------------------------------------------------------------- what the hooks ask autograd
def compiled_autograd_error(owner: str) -> RuntimeError:
    """The error of a backward that runs under compiled autograd (checked at every pre-backward).

    Compiled autograd captures the backward graph, hooks included, and replays it: the units' backward hooks keep
    per-step state and issue collectives, and trained with wrong gradients when replayed that way (measured, for
    torch's own ``fully_shard`` too). Compiling the blocks' forward still compiles their backward (AOTAutograd).
    """
    return RuntimeError(
        f"{owner}: backward runs under compiled autograd (torch._dynamo.config.compiled_autograd), which "
        "fsdp_compose does not support: its backward hooks must run in eager autograd. Turn compiled autograd "
        "off; torch.compile of the blocks still compiles their backward (see docs/compile.md)"
    )


def check_backward_reads_none_of(owner: str, node: object, params: Sequence[ManagedParam]) -> None:
    """``set_unshard_in_backward(False)`` promised that the unit's backward reads none of its parameters: check the
    graph below ``node`` (the unit's pre-backward) down to the unit's inputs before it runs, and name the parameter
    a node saved for backward. The unit's full parameters are freed after forward: a read would fail in torch with
    "setStorage ... storage of size 0", naming nothing."""
    storages = {mp.full.untyped_storage()._cdata: mp.fqn for mp in params if mp.full is not None}
    stack = [n for n, _ in getattr(node, "next_functions", ()) if n is not None]
    seen: set[int] = set()
    while stack:
        current = stack.pop()
        if id(current) in seen or type(current).__name__ in ("AccumulateGrad", "_PostBackwardBackward"):
            continue
        seen.add(id(current))
        for attr in dir(current):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(current, attr)
            except RuntimeError:  # already freed by an earlier backward: autograd raises its own error
                continue
            name = storages.get(value.untyped_storage()._cdata) if isinstance(value, torch.Tensor) else None
            if name is not None:
                raise RuntimeError(
                    f"fsdp_compose: set_unshard_in_backward(False) on {owner}, but its backward reads parameter "
                    f"{name!r} ({type(current).__name__} saved it in forward), which is not gathered for backward. "
                    "Leave set_unshard_in_backward(True) for this unit; False suits units whose backward needs no "
                    "parameter (an embedding's)"
                )
        stack.extend(n for n, _ in current.next_functions if n is not None)


def autograd_tensors(output: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of an output that backward reaches: the output itself, or inside a torch.func transform (``jvp``)
    the plain tensors under its wrapper, the primal and the tangent. The tangent's backward reads the unit's full
    parameters too, so it needs the pre-backward hook as much as the primal (a loss on a jvp's tangent)."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(output):
        return [output]
    tensors = [output]
    tangent = torch.autograd.forward_ad.unpack_dual(output).tangent
    if tangent is not None:
        tensors.append(tangent)
    found = []
    for tensor in tensors:
        while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
            tensor = torch._C._functorch.get_unwrapped(tensor)
        found.append(tensor)
    return found


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def tensors_in(value: Any, *, requiring_grad: bool = False) -> list[torch.Tensor]:
    """Every tensor in a module's inputs or outputs, once each, in order (``requiring_grad``: those that require
    grad), whatever holds them: ``torch.utils._pytree`` knows tuples, lists, dicts and namedtuples; module outputs are
    also dataclasses (torch's own FSDP tests return them, as do many model libraries), and a unit must see every
    tensor of its outputs to hook its backward.

    Not torch's ``_apply_to_tensors`` (FSDP2's walk): its recursive closure is a reference cycle that keeps ``fn``,
    and so whatever ``fn`` saw, alive until the cyclic garbage collector runs; a unit tells a graph nobody will run
    from a live one by weak references (``ForwardCall.alive``), so its walks must not keep tensors alive (measured:
    a reentrant checkpoint over a block some ranks skip hangs with it)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [value]
    while stack:  # depth first, in order: what is pushed last is visited first
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen and (item.requires_grad or not requiring_grad):
                seen.add(id(item))
                found.append(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            for f in reversed(dataclasses.fields(item)):
                if f.init:
                    stack.append(getattr(item, f.name))
        else:
            leaves, _ = tree_flatten(item)
            if len(leaves) != 1 or leaves[0] is not item:  # else a leaf that is no tensor
                stack.extend(reversed(leaves))
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with every tensor ``t`` in it replaced by ``fn(t)`` (containers rebuilt only where needed; not
    torch's ``_apply_to_tensors``, for the reason ``tensors_in`` gives)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            old = getattr(value, f.name)
            new = map_tensors(fn, old)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    leaves, spec = tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return value  # a leaf that is no tensor
    new_leaves = []
    changed = False
    for leaf in leaves:
        new = fn(leaf) if isinstance(leaf, torch.Tensor) else map_tensors(fn, leaf)
        changed = changed or new is not leaf
        new_leaves.append(new)
    return tree_unflatten(new_leaves, spec) if changed else value
