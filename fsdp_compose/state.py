"""Per-call settings and the hooks that drive one training step (the step itself is step.py and backward.py).

``fully_shard`` attaches one ``ShardState`` to the module instance (an attribute; no class swap, no registry) and
registers bound methods of it as module hooks. The hooks decide no collective: they tell the root's step (through
``StepOwner``) what happened, and it walks the declared schedule (docs/schedule.md)::

    root pre-forward        lazy init on the first call (find the root, check every unit, make the StepContext);
                            then StepContext.begin_forward: finish the last step, refresh trainability, move inputs
    unit pre-forward        _open: gather unless gathered, prefetch the next unit in registration order; cast
                            inputs; wrap them in _PostBackward (its backward: this call's input gradients exist)
    user forward            runs unchanged on full parameters
    unit post-forward       cast outputs; outputs that need grad go through _PreBackward (one ForwardCall per call);
                            close_forward once every module ran (reshard per reshard_after_forward)
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
(``torch.compiler.disable``): they issue collectives and swap parameters, which a graph cannot hold.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .autograd_hooks import (
    ForwardCall,
    autograd_tensors,
    cast_floating,
    check_backward_reads_none_of,
    check_not_compiled_autograd,
    in_backward,
    map_tensors,
    tensors_in,
    unique_tensors,
)
from .collectives import labelled
from .policies import MixedPrecisionPolicy, PrefetchPoint
from .unit import ShardedUnit, UnitState

if TYPE_CHECKING:
    from .flat import ManagedParam

logger = logging.getLogger(__name__)

__all__ = [
    "STATE_ATTR",
    "GradientAccumulation",
    "ShardState",
    "StepOwner",
    "reshards_after_forward",
    "states_under",
]

GradientAccumulation = Literal["unsharded", "sharded"]

# Name of the instance attribute holding the state. A constant name, not a registry: the state lives and dies with
# the module (and is copied with it by copy.deepcopy).
STATE_ATTR = "_fsdp_compose_state"


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _outside_compile(hook: _Hook) -> _Hook:
    """Run ``hook`` eagerly even inside a compiled region (a graph break): it issues collectives and swaps
    parameters on modules, which a traced graph cannot hold. torch's own FSDP does the same with its hooks."""
    return cast(_Hook, torch.compiler.disable(hook))


def reshards_after_forward(setting: bool | int | None, *, is_root: bool) -> bool:
    """``reshard_after_forward`` as it acts: unset, every unit but the root frees its parameters after forward (the
    root's are needed first in backward)."""
    return (not is_root) if setting is None else bool(setting)


def states_under(module: nn.Module) -> list[ShardState]:
    """Every state on ``module`` and its submodules, in pre-order, each once (a list-form state appears once)."""
    seen: set[int] = set()
    found = []
    for sub in module.modules():
        state = sub.__dict__.get(STATE_ATTR)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            found.append(state)
    return found


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
        ctx.state.pre_backward(ctx)
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
        return tuple(t.detach() for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        entry = ctx.entry
        entry.posts_left -= 1
        if entry.posts_left == 0:
            ctx.state.post_backward()
        return (None, None, *grads)


class BackwardOwner(Protocol):
    """One backward's walk as the hooks see it (``backward.BackwardWalk``): they call it directly."""

    def gather_for_backward(self, state: ShardState) -> None: ...

    def call_backward_done(self, state: ShardState) -> None: ...

    def gradient_made(self, state: ShardState, mp: ManagedParam) -> None: ...


class StepOwner(Protocol):
    """The root's step as the hooks see it: ``step.StepContext``, which ``fully_shard`` hands in as the state's
    ``make_step`` (step.py imports this module; this module does not import the step)."""

    @property
    def backward(self) -> BackwardOwner | None: ...  # the walk of the backward running now

    gather_stream: torch.Stream | None

    def begin_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]: ...

    def end_forward(self, *, raised: bool = False) -> None: ...

    def begin_backward(self, running: object = None) -> None: ...

    def next_in_schedule(self, state: ShardState) -> ShardState | None: ...

    def next_call_number(self) -> int: ...

    def reset(self) -> None: ...


class ShardState:
    """Everything one ``fully_shard`` call attached: its modules, its unit, its settings and this step's entries."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        unit: ShardedUnit,
        mesh: DeviceMesh,
        device: torch.device,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
        auto_refresh_trainable: bool,
    ) -> None:
        self.modules = modules
        self.unit = unit
        self.mesh = mesh
        self.device = device
        self.mp_policy = mp_policy
        self.auto_refresh_trainable = auto_refresh_trainable
        # Settings (changed through the fc.set_* functions).
        # None: decided at lazy init (the root keeps); an int k: keep 1/k per rank (see ShardedUnit.reshard_to_group)
        self.reshard_after_forward_setting = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.gradient_accumulation: GradientAccumulation = "unsharded"
        self.requires_all_reduce = True  # HSDP: all-reduce over replicas after the reduce-scatter
        self.full_precision_in_eval = False
        self.collective_checks = False  # fc.set_collective_checks: any unit under a root turns them on for it
        self.max_reduce_inputs = 1  # set_reduce_scatter_max_input_buffers: read on the root
        # Prefetch targets set with fc.set_modules_to_*_prefetch (None: implicit, from the declared schedule).
        self.forward_prefetch: list[ShardState] | None = None
        self.backward_prefetch: list[ShardState] | None = None
        self.backward_prefetch_point: PrefetchPoint = "midway"  # fc.set_backward_prefetch_point
        # FSDP2's set_unshard_in_backward(False): no backward all-gather (an embedding's backward reads no weight); a
        # backward that does read one is refused at the pre-backward (autograd_hooks.check_backward_reads_none_of).
        self.unshard_in_backward = True
        # Set at lazy init.
        self.root: ShardState | None = None
        self.ctx: StepOwner | None = None  # the root's step, on every state under it
        # Makes the root's step at lazy init (``step.StepContext``, handed in by ``fully_shard``).
        self.make_step: Callable[[ShardState, list[ShardState]], StepOwner] | None = None
        # Full parameters kept across the last (no-sync) backward by reshard_after_backward=False.
        self.kept_unsharded = False
        self.entries: list[ForwardCall] = []  # forward calls whose backward has not run yet
        # Forward calls a backward of this step already ran: a backward through a retained graph
        # (``retain_graph=True``) runs them again, so the next backward asks autograd about them too.
        self.ran: list[ForwardCall] = []
        self.recomputes_due = 0  # calls this backward recomputes (set by the step when it begins)
        self.reset_step()
        unit.gather.fulls.hooks = weakref.ref(self)  # its full parameters' gradient hooks call gradient_made

    def reset_step(self) -> None:
        """Forget this step's forward: entries, open calls, casts."""
        self.entries = []
        self.ran = []
        self.reset_forward()

    def reset_forward(self) -> None:
        self.active = 0  # calls of this unit's modules inside their forward right now
        self.entered = False  # gathered for forward in this root forward (or entered: see StepContext.reset)
        self.opened = False  # gathered for forward; closes when every module ran (or at the root's end of forward)
        self.opening_needs_backward = False  # some call of the current opening returned outputs that need grad
        self.pending_modules: set[int] = set()  # list form: modules not yet run in the current opening
        self.calls: dict[int, list[ForwardCall]] = {}  # module id -> entries of calls between pre- and post-forward
        self.full_precision_now = False
        self.incoming_dtype: dict[int, torch.dtype] = {}  # module id -> dtype its inputs had before the cast

    # ------------------------------------------------------------------ hooks registration
    def register_hooks(self) -> None:
        for module in self.modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward, always_call=True)
            module.register_state_dict_pre_hook(self._reshard_for_state_dict)
            module.register_load_state_dict_pre_hook(self._reshard_for_load_state_dict)

    def _reshard_for_state_dict(self, *unused: Any) -> None:
        self.unit.gather.reshard()

    def _reshard_for_load_state_dict(self, *unused: Any) -> None:
        self.unit.gather.reshard()

    # ------------------------------------------------------------------ root and lazy init
    @property
    def is_root(self) -> bool:
        return self.root is self

    @property
    def reshard_after_forward(self) -> bool:
        return reshards_after_forward(self.reshard_after_forward_setting, is_root=self.root is self)

    @property
    def reduces_now(self) -> bool:
        """Reduce in this backward: when syncing, and on every micro-batch in sharded accumulation mode."""
        return self.requires_gradient_sync or self.gradient_accumulation == "sharded"

    @property
    def gradients_final(self) -> bool:
        """This backward delivers final gradients (an optimizer step may follow): synced, and all-reduced over
        replicas where there are any."""
        replicas = self.unit.dp.replicate_group is not None
        return self.requires_gradient_sync and (self.requires_all_reduce or not replicas)

    # ------------------------------------------------------------------ gathering
    @property
    def gather_stream(self) -> torch.Stream | None:
        """The root's side stream for all-gather copy-in (None on a CPU device or before lazy init)."""
        return self.ctx.gather_stream if self.ctx is not None else None

    def compute_dtype(self, module: nn.Module) -> torch.dtype:
        if self.full_precision_in_eval and not module.training:
            return self.unit.orig_dtype
        return self.unit.param_dtype

    def start_gather(self, *, async_op: bool) -> None:
        """Issue this unit's all-gather in its compute dtype if it needs one (or is gathered in another dtype)."""
        dtype = self.compute_dtype(self.modules[0])
        gather = self.unit.gather
        if gather.state in (UnitState.UNSHARDED, UnitState.GATHERING) and gather.compute_dtype != dtype:
            gather.reshard()  # e.g. prefetched in fp32 by an eval forward: its backward needs the bf16 tensors
        if gather.needs_gather:
            self.unit.start_unshard(dtype, async_op=async_op, stream=self.gather_stream)

    def gather_now(self) -> None:
        self.start_gather(async_op=False)
        self.unit.gather.finish()

    # ------------------------------------------------------------------ forward
    @_outside_compile
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        with labelled(f"fsdp_compose::pre_forward[{self.unit.owner_name}]"):
            if in_backward():
                # A forward inside backward: an activation-checkpoint recompute. The unit needs its parameters now, at
                # its turn in the gather order (a recompute before the unit's own pre-backward starts its backward).
                walk = self.ctx.backward if self.ctx is not None else None
                if walk is not None:
                    walk.gather_for_backward(self)
                else:
                    self.gather_now()  # no step yet, or a backward that began under another root (nested roots)
                args, kwargs = cast_inputs(self, module, args, kwargs, self.compute_dtype(module))
                if self.recomputes_due and torch.is_grad_enabled():
                    # A reentrant checkpoint's recompute: its own backward follows, which ends this call's backward.
                    self.recomputes_due -= 1
                    args, kwargs = _wrap_inputs(self, args, kwargs, ForwardCall(), per_input=False)
                return args, kwargs
            if self.root is None:
                lazy_init(self)
            ctx = self.ctx
            if ctx is not None and self.is_root and self.active == 0:
                args, kwargs = ctx.begin_forward(args, kwargs)
            compute_dtype = self.compute_dtype(module)
            if not self.opened or id(module) not in self.pending_modules:
                self._open(module, compute_dtype)  # first call of this unit since it closed, or a module run again
            self.pending_modules.discard(id(module))
            self.active += 1
            entry = ForwardCall(ctx.next_call_number() if ctx is not None else 0)
            self.calls.setdefault(id(module), []).append(entry)
            args, kwargs = cast_inputs(self, module, args, kwargs, compute_dtype)
            if torch.is_grad_enabled():
                args, kwargs = _wrap_inputs(self, args, kwargs, entry)
            elif not torch.is_inference_mode_enabled():
                _note_recomputable(self, entry, args, kwargs)
            return args, kwargs

    def _open(self, module: nn.Module, compute_dtype: torch.dtype) -> None:
        """Gather the unit for forward (a no-op when it is gathered already) and prefetch the next in the schedule."""
        unit = self.unit
        self.full_precision_now = self.full_precision_in_eval and not module.training
        # Kept unsharded since an in-place update, or gathered in another precision: gather again.
        stale = unit.gather.state is UnitState.UNSHARDED and unit.is_stale()
        if unit.gather.state is not UnitState.SHARDED and (stale or unit.gather.compute_dtype != compute_dtype):
            unit.gather.reshard()
        unit.gather.explicit = False  # an fc.unshard issued before this forward is consumed here
        unit.grads.accumulating = not self.reduces_now
        self.kept_unsharded = False
        unit.start_unshard(compute_dtype, async_op=False, stream=self.gather_stream)
        unit.gather.finish()
        unit.grads.input.note_accumulators()
        self.opened = True
        self.entered = True
        self.opening_needs_backward = False
        self.pending_modules = {id(m) for m in self.modules}
        ctx = self.ctx
        if ctx is not None and ctx.backward is None:
            if self.forward_prefetch is not None:
                targets = self.forward_prefetch
            else:
                following = ctx.next_in_schedule(self)
                targets = [] if following is None else [following]
            for target in targets:
                if not target.opened:
                    target.start_gather(async_op=True)

    @_outside_compile
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Also runs when forward raised (``always_call``): ``output`` is then None and the call just ends."""
        with labelled(f"fsdp_compose::post_forward[{self.unit.owner_name}]"):
            output = cast_outputs(self, module, output)
            if in_backward():
                return output  # activation-checkpoint recompute: the original forward's hooks serve its backward
            calls = self.calls.get(id(module))
            if not calls or self.active == 0:
                if self.ctx is not None and self.is_root and output is None and self.active == 0:
                    self.ctx.end_forward(raised=True)  # the root's forward raised before any unit call ended
                return output  # its pre-forward did not run (e.g. it raised before)
            entry = calls.pop()
            self.active -= 1
            found = tensors_in(output) if torch.is_grad_enabled() else []
            if torch._C._are_functorch_transforms_active():
                # Inside torch.func.jvp / vmap / grad an autograd Function without setup_context raises, also on plain
                # outputs (a unit called on a tensor captured from outside the transform): hook them instead.
                return _hook_transformed_outputs(self, found, entry, output)
            needing = unique_tensors(t for t in found if t.requires_grad)
            if needing:
                # One node per output (why: ForwardCall): an output the loss ignores leaves the unit out of the graph.
                hooked = [_PreBackward.apply(self, t) for t in needing]
                entry.pre = [weakref.ref(t.grad_fn) for t in hooked]
                replacement = {id(old): new for old, new in zip(needing, hooked, strict=True)}
                output = map_tensors(lambda t: replacement.get(id(t), t), output)
                self.entries.append(entry)
                self.opening_needs_backward = True
            elif entry.inputs is not None and not found:
                self.entries.append(entry)  # recomputed in backward (reentrant checkpoint): resharded until then
            if self.active == 0 and not self.pending_modules:
                self.close_forward()
            if self.ctx is not None and self.is_root and self.active == 0:
                self.ctx.end_forward(raised=output is None)
            return output

    def close_forward(self) -> None:
        """The current opening ends: reshard per ``reshard_after_forward`` (always when no output needs grad)."""
        if not self.opened:
            return
        self.opened = False
        self.pending_modules = set()
        if not self.opening_needs_backward:
            self.unit.gather.reshard()
        elif self.reshard_after_forward:
            if self.unit.gather.post_forward is not None:
                self.unit.gather.reshard_to_group()
            else:
                self.unit.gather.reshard()

    # ------------------------------------------------------------------ backward
    @_outside_compile
    def pre_backward(self, node: object = None) -> None:
        with labelled(f"fsdp_compose::pre_backward[{self.unit.owner_name}]"):
            check_not_compiled_autograd(self.unit.owner_name)
            ctx = self.ctx
            if ctx is None:
                self.gather_now()
                return
            if not self.unshard_in_backward:
                check_backward_reads_none_of(self.unit.owner_name, node, self.unit.shards.params)
            ctx.begin_backward(node)
            if ctx.backward is not None:
                ctx.backward.gather_for_backward(self)
            else:
                self.gather_now()

    def gradient_made(self, mp: ManagedParam) -> None:
        """Post-accumulate-grad hook of one of the unit's full parameters: the backward's walk takes the gradient
        (and may free the parameter at once); outside a backward of the root's step, the unit's gradients."""
        walk = self.ctx.backward if self.ctx is not None else None
        if walk is not None:
            walk.gradient_made(self, mp)
        else:
            self.unit.grads.capture(mp)

    @_outside_compile
    def post_backward(self) -> None:
        """One call's backward is done; the backward's walk finishes the unit once every call it runs here is."""
        walk = self.ctx.backward if self.ctx is not None else None
        if walk is not None:
            with labelled(f"fsdp_compose::post_backward[{self.unit.owner_name}]"):
                walk.call_backward_done(self)

    def __repr__(self) -> str:
        modules = ", ".join(type(m).__name__ for m in self.modules)
        root = None if self.root is None else self.is_root  # None: decided at the first forward
        phase = "forward" if self.active else "awaiting_backward" if self.entries else "idle"
        return f"ShardState([{modules}], root={root}, phase={phase}, unit={self.unit!r})"

    # ------------------------------------------------------------------ copy.deepcopy
    def __deepcopy__(self, memo: dict[int, Any]) -> ShardState:
        new = object.__new__(ShardState)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.unit = self.unit.copy_for(memo)
        new.unit.gather.fulls.hooks = weakref.ref(new)
        new.modules = tuple(copy.deepcopy(m, memo) for m in self.modules)
        new.forward_prefetch = copy.deepcopy(self.forward_prefetch, memo)
        new.backward_prefetch = copy.deepcopy(self.backward_prefetch, memo)
        new.root = None
        new.ctx = None
        new.kept_unsharded = False
        new.reset_step()
        return new


def lazy_init(root: ShardState) -> None:
    """``root`` becomes the root of every state below it. Checks run first: a bad model fails before a collective."""
    states: list[ShardState] = []
    seen: set[int] = set()
    for module in root.modules:
        for state in states_under(module):
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    for state in states:
        state.unit.shards.check_materialized()
    for state in states:
        state.root = root
        state.ctx = None
    if root.make_step is None:
        raise RuntimeError(f"internal error in fsdp_compose: {root.unit.owner_name} has no step factory")
    root.ctx = root.make_step(root, states)
    for state in states:
        state.ctx = root.ctx
    logger.debug("lazy init: root %s with %d units", root.unit.owner_name, len(states))


def _wrap_inputs(
    state: ShardState, args: tuple[Any, ...], kwargs: dict[str, Any], entry: ForwardCall, *, per_input: bool = True
) -> tuple[Any, Any]:
    """``per_input=False``: one node over all inputs (a reentrant checkpoint's recompute, which begins after the
    backward asked which nodes it runs: its one node ends the call)."""
    needing = unique_tensors(t for t in tensors_in((args, kwargs)) if t.requires_grad)
    if not needing or torch._C._are_functorch_transforms_active():
        # Nothing to hook, or a torch.func transform is active: an autograd Function without setup_context raises
        # there, on the transform's own wrapped inputs and on plain ones captured from outside it alike. The final
        # callback finishes this call.
        return args, kwargs
    if per_input:  # one node per input (why: ForwardCall)
        wrapped = [_PostBackward.apply(state, entry, t)[0] for t in needing]
        entry.post = [weakref.ref(t.grad_fn) for t in wrapped]
    else:
        wrapped = list(_PostBackward.apply(state, entry, *needing))
        entry.post = [weakref.ref(wrapped[0].grad_fn)]
    entry.posts_left = len(entry.post)  # until a backward asks which of them it runs
    replacement = {id(old): new for old, new in zip(needing, wrapped, strict=True)}
    new_args, new_kwargs = map_tensors(lambda t: replacement.get(id(t), t), (args, kwargs))
    return new_args, new_kwargs


def _note_recomputable(state: ShardState, entry: ForwardCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A call under no_grad inside a forward with grad may be a reentrant checkpoint's forward (or run inside one):
    keep its inputs that need grad (weakly), or else the root's call it runs in."""
    needing = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if needing:
        entry.inputs = [weakref.ref(t) for t in needing]
        return
    root = state.root
    open_calls = [e for calls in root.calls.values() for e in calls] if root is not None and root is not state else []
    if open_calls and open_calls[-1].grad_enabled and state.unit.grads.trainable:
        entry.inputs, entry.anchor = [], open_calls[-1]


def _hook_transformed_outputs(state: ShardState, found: list[torch.Tensor], entry: ForwardCall, output: Any) -> Any:
    """Outputs under a ``torch.func`` transform (``jvp``, ``vmap``, ``grad``): an autograd Function cannot wrap them,
    so the plain tensors under them (primal and tangent, whose backward both read the unit's parameters; or the
    outputs themselves when they are plain, computed from tensors captured from outside the transform) get tensor
    hooks, and the call counts as run by every backward until one runs (its reach cannot be asked)."""
    plain = unique_tensors(p for t in found for p in autograd_tensors(t) if p.requires_grad)
    if plain:
        entry.always = True
        for tensor in plain:
            tensor.register_hook(lambda grad: state.pre_backward())
        state.entries.append(entry)
        state.opening_needs_backward = True
    if state.active == 0 and not state.pending_modules:
        state.close_forward()
    if state.ctx is not None and state.is_root and state.active == 0:
        state.ctx.end_forward()
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
            state.incoming_dtype.setdefault(id(module), leaf.dtype)
            return leaf.to(dtype)
        return leaf

    new_args, new_kwargs = map_tensors(cast, (args, kwargs))
    return new_args, new_kwargs


def cast_outputs(state: ShardState, module: nn.Module, output: Any) -> Any:
    """``output_dtype`` when set; otherwise a non-root unit that cast its inputs down hands its outputs back in
    the dtype those inputs came in, so a bf16 block inside an fp32 model just works."""
    incoming = state.incoming_dtype.pop(id(module), None)
    if state.full_precision_now:
        return output
    dtype = state.mp_policy.output_dtype
    if dtype is None and incoming is not None and not state.is_root:
        dtype = incoming
    if dtype is None:
        return output
    return map_tensors(lambda v: cast_floating(v, dtype), output)
