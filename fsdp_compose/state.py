"""Per-call settings and the hooks that drive one training step (the step's own state is step.py).

``fully_shard`` attaches one ``ShardState`` to the module instance (an attribute; no class swap, no registry) and
registers bound methods of it as module hooks. One step, top to bottom::

    root pre-forward        lazy init on the first call (find the root, check every unit, build the StepContext);
                            then StepContext.begin_step: clean up the last step, refresh trainability, move inputs
    unit pre-forward        all-gather (or take the prefetched / explicitly unsharded one); prefetch the next
                            unit; cast inputs; wrap them in _PostBackward so backward can tell when their
                            gradients exist
    user forward            runs unchanged on full parameters
    unit post-forward       cast outputs; reshard (per reshard_after_forward; always when no output needs grad);
                            hook the outputs (runs even when forward raised: registered with always_call)
    ---- loss.backward() ----
    output hook (pre-bw)    StepContext.gather_for_backward: all-gathers in the fixed backward order up to this
                            unit, prefetch; the first one queues the final callback
    user backward           autograd fills the full parameters' .grad (moved into the buffer as they come when
                            accumulating)
    _PostBackward.backward  the unit's input gradients exist: reshard, stage its gradients in the reduce-scatter
                            layout, issue reduce-scatters in the fixed order (async, one in flight)
    final callback          units whose post-backward never fired stage (zeros) and reduce at their turn; wait
                            for every reduction; reshard; reset

Each unit's phase in the step (``UnitPhase``) moves IDLE -> FORWARD -> AWAITING_BACKWARD -> BACKWARD -> IDLE;
a forward during BACKWARD is an activation-checkpoint recompute. Hooks are kept out of ``torch.compile``'s traced
regions (``torch.compiler.disable``): they issue collectives and swap parameters, which a graph cannot hold.
"""

from __future__ import annotations

import copy
import enum
import logging
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .collectives import labelled
from .policies import MixedPrecisionPolicy
from .step import StepContext, check_not_compiled_autograd, in_backward
from .transitions import checked
from .unit import ShardedUnit, UnitState

logger = logging.getLogger(__name__)

__all__ = ["STATE_ATTR", "GradientAccumulation", "ShardState", "UnitPhase", "states_under"]

GradientAccumulation = Literal["unsharded", "sharded"]

# Name of the instance attribute holding the state. A constant name, not a registry: the state lives and dies with
# the module (and is copied with it by copy.deepcopy).
STATE_ATTR = "_fsdp_compose_state"


class UnitPhase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    AWAITING_BACKWARD = "awaiting_backward"  # forward done, some output needs grad
    BACKWARD = "backward"  # unsharded for backward; a forward now is an activation-checkpoint recompute


_ALLOWED: dict[UnitPhase, frozenset[UnitPhase]] = {
    UnitPhase.IDLE: frozenset({UnitPhase.FORWARD, UnitPhase.BACKWARD}),
    UnitPhase.FORWARD: frozenset({UnitPhase.AWAITING_BACKWARD, UnitPhase.IDLE}),
    UnitPhase.AWAITING_BACKWARD: frozenset({UnitPhase.BACKWARD, UnitPhase.FORWARD, UnitPhase.IDLE}),
    UnitPhase.BACKWARD: frozenset({UnitPhase.IDLE, UnitPhase.FORWARD}),
}


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _outside_compile(hook: _Hook) -> _Hook:
    """Run ``hook`` eagerly even inside a compiled region (a graph break): it issues collectives and swaps
    parameters on modules, which a traced graph cannot hold. torch's own FSDP does the same with its hooks."""
    return cast(_Hook, torch.compiler.disable(hook))


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


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward runs once all their gradients are computed.

    By then the unit's own backward is done (its ops consumed those inputs), so its parameter gradients can be
    reduced and its full parameters freed — layer by layer, not at the end of backward.
    """

    @staticmethod
    def forward(ctx: Any, state: ShardState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


class ShardState:
    """Everything one ``fully_shard`` call attached: its modules, its unit, its settings and its phase."""

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
        self.collective_checks = False  # fc.set_collective_checks: read on the root
        # Prefetch targets set with fc.set_modules_to_*_prefetch (None: implicit, from the recorded forward order).
        self.forward_prefetch: list[ShardState] | None = None
        self.backward_prefetch: list[ShardState] | None = None
        # Set at lazy init.
        self.root: ShardState | None = None
        self.ctx: StepContext | None = None  # on the root only
        # Full parameters kept across the last (no-sync) backward by reshard_after_backward=False.
        self.kept_unsharded = False
        self.reset_step()

    def reset_step(self) -> None:
        self.phase = UnitPhase.IDLE
        self.full_precision_now = False
        self.forward_pending: set[int] = set()  # ids of this state's modules whose forward has not run yet
        self.incoming_dtype: dict[int, torch.dtype] = {}  # module id -> dtype its inputs had before the cast
        self.post_backward_pending = False
        self.reduce_issued = False  # this unit's reduce-scatter went out in this backward

    def _to(self, new: UnitPhase) -> None:
        self.phase = checked(self.phase, new, _ALLOWED, f"{self.unit.owner_name}'s phase")

    # ------------------------------------------------------------------ hooks registration
    def register_hooks(self) -> None:
        for module in self.modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward, always_call=True)
            module.register_state_dict_pre_hook(self._reshard_for_state_dict)
            module.register_load_state_dict_pre_hook(self._reshard_for_load_state_dict)

    def _reshard_for_state_dict(self, *unused: Any) -> None:
        self.unit.reshard()

    def _reshard_for_load_state_dict(self, *unused: Any) -> None:
        self.unit.reshard()

    # ------------------------------------------------------------------ root and lazy init
    @property
    def is_root(self) -> bool:
        return self.root is self

    @property
    def reshard_after_forward(self) -> bool:
        if self.reshard_after_forward_setting is None:
            return not self.is_root
        return bool(self.reshard_after_forward_setting)

    @property
    def reduces_now(self) -> bool:
        """Reduce in this backward: when syncing, and on every micro-batch in sharded accumulation mode."""
        return self.requires_gradient_sync or self.gradient_accumulation == "sharded"

    @property
    def in_backward_phase(self) -> bool:
        return self.phase is UnitPhase.BACKWARD

    def lazy_init(self) -> None:
        """Become the root of every state below this one. Checks run first, so a bad model fails before a collective."""
        states: list[ShardState] = []
        seen: set[int] = set()
        for module in self.modules:
            for state in states_under(module):
                if id(state) not in seen:
                    seen.add(id(state))
                    states.append(state)
        for state in states:
            state.unit.shards.check_materialized()
        for state in states:
            state.root = self
            state.ctx = None
        self.ctx = StepContext(self, states)
        logger.debug("lazy init: root %s with %d units", self.unit.owner_name, len(states))

    # ------------------------------------------------------------------ gathering
    def compute_dtype(self, module: nn.Module) -> torch.dtype:
        if self.full_precision_in_eval and not module.training:
            return self.unit.orig_dtype
        return self.unit.param_dtype

    @property
    def gather_stream(self) -> torch.Stream | None:
        """The root's side stream for all-gather copy-in (None on a CPU device or before lazy init)."""
        root = self.root
        return root.ctx.gather_stream if root is not None and root.ctx is not None else None

    def start_gather(self, *, async_op: bool) -> None:
        """Issue this unit's all-gather in its compute dtype, if it needs one."""
        if self.unit.needs_gather:
            self.unit.start_unshard(self.compute_dtype(self.modules[0]), async_op=async_op, stream=self.gather_stream)

    def gather_now(self) -> None:
        unit = self.unit
        unit.start_unshard(self.compute_dtype(self.modules[0]), async_op=False, stream=self.gather_stream)
        unit.finish_unshard()

    # ------------------------------------------------------------------ forward
    @_outside_compile
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        with labelled("fsdp_compose::pre_forward"):
            return self._pre_forward(module, args, kwargs)

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        backward_running = in_backward()
        if backward_running and self.phase in (UnitPhase.BACKWARD, UnitPhase.AWAITING_BACKWARD):
            # Activation-checkpoint recompute: cast exactly as the first forward did. A unit recomputed before its
            # own pre-backward hook fired (a checkpoint around an enclosing module) starts its backward here, at the
            # cursor's turn: a recompute that re-gathered as a forward would reshard after it, and gather again
            # at the pre-backward, an all-gather after this rank's last scheduled one.
            if self.phase is UnitPhase.AWAITING_BACKWARD:
                self._begin_unit_backward()  # gathers it
            else:
                self.gather_now()
            return self._cast_inputs(module, args, kwargs, self.compute_dtype(module))
        if self.root is None:
            self.lazy_init()
        first = not self.forward_pending or id(module) not in self.forward_pending
        if first and self.ctx is not None and not backward_running:
            args, kwargs = self.ctx.begin_step(args, kwargs)
        compute_dtype = self.compute_dtype(module)
        if not first:
            # list form: another module of this call gathered the unit already
            self.forward_pending.discard(id(module))
            return self._cast_inputs(module, args, kwargs, compute_dtype)
        self.forward_pending = {id(m) for m in self.modules}
        self.forward_pending.discard(id(module))
        self._to(UnitPhase.FORWARD)
        self.full_precision_now = self.full_precision_in_eval and not module.training
        unit = self.unit
        # Kept unsharded since an in-place update, or gathered in another precision: gather again. (A unit being
        # prefetched right now was gathered after any update: only its precision can be wrong.)
        stale = unit.is_unsharded and unit.is_stale()
        if unit.state is not UnitState.SHARDED and (stale or unit.compute_dtype != compute_dtype):
            unit.reshard()
        unit.explicit = False  # an fc.unshard issued before this forward is consumed here
        unit.grads.accumulating = not self.reduces_now
        self.kept_unsharded = False
        unit.start_unshard(compute_dtype, async_op=False, stream=self.gather_stream)
        unit.finish_unshard()
        root = self.root
        if root is not None and root.ctx is not None and not backward_running:
            root.ctx.record_forward(self)
            targets = self.forward_prefetch if self.forward_prefetch is not None else root.ctx.next_in_forward(self)
            for target in targets:
                target.start_gather(async_op=True)
        args, kwargs = self._cast_inputs(module, args, kwargs, compute_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._wrap_inputs(args, kwargs)
        return args, kwargs

    def _cast_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if dtype == self.unit.orig_dtype or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype:
                self.incoming_dtype.setdefault(id(module), leaf.dtype)
                leaves[i] = leaf.to(dtype)
        new_args, new_kwargs = tree_unflatten(leaves, spec)
        return new_args, new_kwargs

    def _cast_outputs(self, module: nn.Module, output: Any) -> Any:
        """``output_dtype`` when set; otherwise a non-root unit that cast its inputs down hands its outputs back in
        the dtype those inputs came in, so a bf16 block inside an fp32 model just works."""
        incoming = self.incoming_dtype.pop(id(module), None)
        if self.full_precision_now:
            return output
        dtype = self.mp_policy.output_dtype
        if dtype is None and incoming is not None and not self.is_root:
            dtype = incoming
        if dtype is None:
            return output
        return tree_map(lambda v: _cast_floating(v, dtype), output)

    def _wrap_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions:
            return args, kwargs  # nothing to hook: the final callback finishes this unit
        wrapped = _PostBackward.apply(self, *(leaves[i] for i in positions))
        for i, tensor in zip(positions, wrapped, strict=True):
            leaves[i] = tensor
        new_args, new_kwargs = tree_unflatten(leaves, spec)
        return new_args, new_kwargs

    @_outside_compile
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Also runs when forward raised (``always_call``): ``output`` is then None and the unit just reshards."""
        with labelled("fsdp_compose::post_forward"):
            return self._post_forward(module, output)

    def _post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.phase is UnitPhase.BACKWARD and in_backward():
            return self._cast_outputs(module, output)  # activation-checkpoint recompute
        output = self._cast_outputs(module, output)
        if self.phase is not UnitPhase.FORWARD:
            return output  # its pre-forward did not run (e.g. it raised before) or a list module already closed
        self.forward_pending.discard(id(module))
        if self.forward_pending:
            return output  # list form: the other modules of this call have not run yet
        # Outputs that need no gradient (no_grad, or a method that disables grad inside) mean no backward will
        # come through this unit: reshard even where reshard_after_forward says keep (the root, by default).
        grad_outputs = [
            tensor
            for leaf in tree_flatten(output)[0]
            if torch.is_grad_enabled() and isinstance(leaf, torch.Tensor)
            for tensor in _autograd_tensors(leaf)
            if tensor.requires_grad
        ]
        if not grad_outputs:
            self.unit.reshard()
            self._to(UnitPhase.IDLE)
        else:
            if self.reshard_after_forward:
                if self.unit.post_forward is not None:
                    self.unit.reshard_to_group()
                else:
                    self.unit.reshard()
            for leaf in grad_outputs:
                leaf.register_hook(self._pre_backward)
            self._to(UnitPhase.AWAITING_BACKWARD)
        if self.ctx is not None:
            self.ctx.end_forward(expects_backward=bool(grad_outputs))
        return output

    # ------------------------------------------------------------------ backward
    @_outside_compile
    def _pre_backward(self, grad: torch.Tensor) -> None:
        with labelled("fsdp_compose::pre_backward"):
            if self.phase is UnitPhase.BACKWARD:
                return  # another output of this unit (or its recompute started its backward): already gathered
            self._begin_unit_backward()

    def _begin_unit_backward(self) -> None:
        check_not_compiled_autograd(self.unit.owner_name)
        root = self.root
        if root is not None and root.ctx is not None:
            root.ctx.begin_backward()
            root.ctx.gather_for_backward(self)
        else:
            self.gather_now()
        self._to(UnitPhase.BACKWARD)
        self.post_backward_pending = True

    @_outside_compile
    def post_backward(self) -> None:
        """The unit's backward is done: hand its gradients to the reduction (or accumulate them) and reshard."""
        if not self.post_backward_pending:
            return
        with labelled("fsdp_compose::post_backward"):
            self.post_backward_pending = False
            self._to(UnitPhase.IDLE)
            # Free the full parameters first: the gradients live apart from them (in ``.grad`` or already in the
            # gradient buffer), and the reduction below may wait for the previous unit's reduce-scatter, whose
            # buffers are then alive at the same time; the full parameters need not be.
            if self.reshard_after_backward:
                self.unit.reshard()
            grads = self.unit.grads
            if not self.reduces_now:
                grads.accumulate()
            elif grads.trainable:
                grads.stage()
                if self.reduce_issued:  # a second use of the unit in this backward: its turn has passed, go now
                    grads.reduce(
                        all_reduce_replicas=self.requires_all_reduce, synchronising=self.requires_gradient_sync
                    )
                    grads.finish()
                elif self.root is not None and self.root.ctx is not None:
                    self.root.ctx.issue_reductions_in_order()

    def __repr__(self) -> str:
        modules = ", ".join(type(m).__name__ for m in self.modules)
        root = None if self.root is None else self.is_root  # None: decided at the first forward
        return f"ShardState([{modules}], root={root}, phase={self.phase.value}, unit={self.unit!r})"

    # ------------------------------------------------------------------ copy.deepcopy
    def __deepcopy__(self, memo: dict[int, Any]) -> ShardState:
        new = object.__new__(ShardState)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.unit = self.unit.copy_for(memo)
        new.modules = tuple(copy.deepcopy(m, memo) for m in self.modules)
        new.forward_prefetch = copy.deepcopy(self.forward_prefetch, memo)
        new.backward_prefetch = copy.deepcopy(self.backward_prefetch, memo)
        new.root = None
        new.ctx = None
        new.kept_unsharded = False
        new.reset_step()
        return new


def _autograd_tensors(output: torch.Tensor) -> list[torch.Tensor]:
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


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
