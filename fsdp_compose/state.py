"""Per-call state and the hooks that drive one training step.

``fully_shard`` attaches one ``ShardState`` to the module instance (an attribute; no class swap, no registry) and
registers bound methods of it as module hooks. One step, top to bottom::

    root pre-forward        lazy init on the first call (find the root, check every unit); per step: reset flags,
                            refresh trainability (one bool per parameter), adopt the last forward's unit order
    unit pre-forward        all-gather (unshard, or wait for the prefetched one); prefetch the next unit;
                            wrap the inputs in _PostBackward so backward can tell when their gradients exist
    user forward            runs unchanged on full parameters
    unit post-forward       reshard (per reshard_after_forward; always when no output needs grad); hook outputs
    ---- loss.backward() ----
    output hook (pre-bw)    all-gather again if resharded, prefetch the unit expected next in backward; the first
                            one queues the root's final callback
    user backward           autograd fills the full parameters' .grad
    _PostBackward.backward  the unit's input gradients exist: stage its gradients in the reduce-scatter layout,
                            start reduce-scatters in the fixed order (async, one in flight), reshard
    final callback          units whose post-backward never fired (no input needed grad, unused on this rank)
                            stage (zeros) and reduce at their turn; wait for every reduction; reset flags

A unit's states: SHARDED -> (GATHERING) -> UNSHARDED -> SHARDED, see ``unit.UnitState``.
"""

from __future__ import annotations

import copy
import enum
import logging
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .policies import MixedPrecisionPolicy
from .unit import ShardedUnit, UnitState

logger = logging.getLogger(__name__)

__all__ = ["STATE_ATTR", "GradientAccumulation", "ShardState", "TrainingState", "states_under"]

GradientAccumulation = Literal["unsharded", "sharded"]

# Name of the instance attribute holding the state. A constant name, not a registry: the state lives and dies with
# the module (and is copied with it by copy.deepcopy).
STATE_ATTR = "_fsdp_compose_state"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"  # unsharded for backward; a forward now is an activation-checkpoint recompute


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
    """Everything one ``fully_shard`` call attached: its modules, its unit, its settings and per-step flags."""

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
        # Prefetch targets set with fc.set_modules_to_*_prefetch (None: implicit, from the recorded forward order).
        self.forward_prefetch: list[ShardState] | None = None
        self.backward_prefetch: list[ShardState] | None = None
        # Set at lazy init.
        self.root: ShardState | None = None
        self.root_states: list[ShardState] = []  # on the root only: every state under it, pre-order
        self.forward_order: list[ShardState] = []  # root only: units in the order the last forward ran them
        self.recording: list[ShardState] = []  # root only: the order this forward runs them
        # Root only: the last backward left no-sync gradients in accumulation buffers (decided from the settings,
        # so it is the same on every rank), and this backward reduces them (see _pre_backward).
        self.gradients_held = False
        self.draining = False
        self._reset_step()

    def _reset_step(self) -> None:
        self.training_state = TrainingState.IDLE
        self.full_precision_now = False
        self.forward_pending: set[int] = set()  # ids of this state's modules whose forward has not finished
        self.post_backward_pending = False
        self.reduce_issued = False  # this unit's reduce-scatter went out in this backward
        self.final_callback_queued = False
        self.next_reduction = 0  # root only: position in reversed(root_states) of the next reduce-scatter to issue
        self.last_reduced: ShardState | None = None  # root only: the unit whose reduce-scatter went out last

    # ------------------------------------------------------------------ hooks registration
    def register_hooks(self) -> None:
        for module in self.modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward)
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
            state.unit.check_materialized()
        for state in states:
            state.root = self
            state.root_states = []
            state.unit.grads.make_room = self._complete_reduction_in_flight
        self.root_states = states
        logger.debug("lazy init: root %s with %d units", self.unit.owner_name, len(states))

    def _root_pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if self.recording:
            self.forward_order, self.recording = self.recording, []
        # A forward with grad enabled and no backward (e.g. evaluation without no_grad) leaves per-step flags set.
        for state in self.root_states:
            if state.unit.state in (UnitState.GATHERING, UnitState.GROUP_SHARDED):
                state.unit.reshard()  # a prefetch nobody used, or a forward that had no backward
            state._reset_step()
            # The cheap per-step trainability check: one bool comparison per parameter.
            if state.auto_refresh_trainable and state.unit.refresh_trainable():
                logger.debug("trainability of %s changed: refreshed", state.unit.owner_name)
        if self.device.type != "cpu":
            args, kwargs = tree_map(self._to_device, (args, kwargs))
        return args, kwargs

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != self.device:
            return value.to(self.device, non_blocking=True)
        return value

    # ------------------------------------------------------------------ forward
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return None  # activation-checkpoint recompute inside backward: parameters are already unsharded
        if self.forward_pending:
            return None  # list form: another module of this unit already unsharded it
        if self.root is None:
            self.lazy_init()
        if self.is_root:
            args, kwargs = self._root_pre_forward(args, kwargs)
        self.forward_pending = {id(m) for m in self.modules}
        self.training_state = TrainingState.FORWARD
        self.full_precision_now = self.full_precision_in_eval and not module.training
        unit = self.unit
        compute_dtype = self._compute_dtype(module)
        # Kept unsharded across an optimizer step, or gathered in another precision: gather again. (A unit being
        # prefetched right now was gathered after the step: only its precision can be wrong.)
        stale = unit.is_unsharded and unit.is_stale()
        if unit.state is not UnitState.SHARDED and (stale or unit.param_dtype != compute_dtype):
            unit.reshard()
        unit.param_dtype = compute_dtype
        unit.grads.accumulating = not self.reduces_now
        unit.unshard()
        if self.root is not None:
            self.root.recording.append(self)
            self._prefetch(self.forward_prefetch, self.root._next_in_forward(self, step=1))
        if compute_dtype != unit.orig_dtype and self.mp_policy.cast_forward_inputs:
            args, kwargs = tree_map(lambda v: _cast_floating(v, compute_dtype), (args, kwargs))
        if torch.is_grad_enabled():
            args, kwargs = self._wrap_inputs(args, kwargs)
        return args, kwargs

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

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return None
        self.forward_pending.discard(id(module))
        if self.forward_pending:
            return None
        self.training_state = TrainingState.IDLE
        output_dtype = self.mp_policy.output_dtype
        if output_dtype is not None and not self.full_precision_now:
            output = tree_map(lambda v: _cast_floating(v, output_dtype), output)
        # Outputs that need no gradient (no_grad, or a method that disables grad inside) mean no backward will
        # come through this unit: reshard even where reshard_after_forward says keep (the root, by default).
        grad_outputs = [
            leaf
            for leaf in tree_flatten(output)[0]
            if torch.is_grad_enabled() and isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        if not grad_outputs:
            self.unit.reshard()
        elif self.reshard_after_forward:
            if self.unit.post_forward is not None:
                self.unit.reshard_to_group()
            else:
                self.unit.reshard()
        for leaf in grad_outputs:
            leaf.register_hook(self._pre_backward)
        return output

    # ------------------------------------------------------------------ backward
    @property
    def reduces_now(self) -> bool:
        """Reduce in this backward: when syncing, and on every micro-batch in sharded accumulation mode."""
        return self.requires_gradient_sync or self.gradient_accumulation == "sharded"

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        root = self.root
        if root is not None and not root.final_callback_queued:
            root.final_callback_queued = True
            root.draining = root.gradients_held and any(state.reduces_now for state in root.root_states)
            Variable._execution_engine.queue_callback(root._final_callback)
        if root is not None and root.draining:
            # The backward that ends an accumulation window: every unit still holds its accumulation buffer, and a
            # reduce-scatter in flight adds its output (and, on gloo, the backend's copy of its input) on top. Let
            # it complete before this unit's parameters are gathered, so the two never coexist.
            root._complete_reduction_in_flight()
        self.unit.unshard()
        self.training_state = TrainingState.PRE_BACKWARD
        self.post_backward_pending = True
        if root is not None and (self.backward_prefetch is not None or not root.draining):
            # While draining, the implicit prefetch is skipped: the next unit's gathered parameters would wait
            # through this unit's reduce-scatter, on top of every accumulation buffer (the step's peak). Explicit
            # prefetch targets are the user's choice and always go.
            self._prefetch(self.backward_prefetch, root._next_in_forward(self, step=-1))

    # ------------------------------------------------------------------ prefetch
    def _compute_dtype(self, module: nn.Module) -> torch.dtype:
        unit = self.unit
        if self.full_precision_in_eval and not module.training:
            return unit.orig_dtype
        return self.mp_policy.param_dtype or unit.orig_dtype

    def _next_in_forward(self, state: ShardState, *, step: int) -> list[ShardState]:
        """Root: the unit expected after ``state`` in forward (step=1) or in backward (step=-1).

        Backward runs the root first (its outputs are last), then the other units in reverse forward order.
        """
        order = self.forward_order if step == 1 else self.forward_order[:1] + self.forward_order[:0:-1]
        try:
            index = order.index(state) + 1
        except ValueError:
            return []
        return [order[index]] if index < len(order) else []

    def _prefetch(self, explicit: list[ShardState] | None, implicit: list[ShardState]) -> None:
        """Start the all-gather of the units expected next, so it runs while this unit computes.

        Every rank prefetches the same units at the same point (the recorded order is the same wherever the same
        units run), so the collectives match. A prefetch that turns out unused is finished and freed at the end of
        the step.
        """
        for target in implicit if explicit is None else explicit:
            unit = target.unit
            if unit.needs_gather and target.training_state is not TrainingState.PRE_BACKWARD:
                unit.param_dtype = target._compute_dtype(target.modules[0])
                unit.start_unshard(async_op=True)

    def post_backward(self) -> None:
        """The unit's backward is done: hand its gradients to the reduction (or accumulate them) and reshard."""
        if not self.post_backward_pending:
            return
        self.post_backward_pending = False
        self.training_state = TrainingState.IDLE
        # Free the full parameters first: the gradients live apart from them (in ``.grad`` or already in the
        # gradient buffer), and the reduction below may wait for the previous unit's reduce-scatter, whose buffers
        # are then alive at the same time; the full parameters need not be.
        if self.reshard_after_backward:
            self.unit.reshard()
        grads = self.unit.grads
        if not self.reduces_now:
            grads.accumulate()
        elif grads.trainable:
            grads.stage()
            if self.reduce_issued:  # a second use of the unit in this backward: its turn has passed, go now
                grads.reduce(all_reduce_replicas=self.requires_all_reduce)
                grads.finish()
            elif self.root is not None:
                self.root._issue_reductions_in_order()

    def _complete_reduction_in_flight(self) -> None:
        """Root: let the last reduce-scatter finish (freeing its input) before a new gradient buffer is allocated."""
        if self.last_reduced is not None:
            self.last_reduced.unit.grads.advance()

    def _issue_reductions_in_order(self) -> None:
        """Root: issue staged reduce-scatters in one fixed order, the same on every rank.

        The order is reverse registration order (blocks last to first, then the root): the natural backward order,
        so in the common case every unit goes as soon as it is staged. A unit staged early waits for the ones before
        it; a unit a rank never ran (an unused branch) is staged with zeros by the final callback. Every rank thus
        issues the same collectives in the same order, whatever its data did (DDP orders its buckets the same way).
        """
        order = self.root_states
        while self.next_reduction < len(order):
            state = order[len(order) - 1 - self.next_reduction]
            if state.reduces_now and state.unit.grads.trainable:
                if state.unit.grads.staged is None:
                    return
                if self.last_reduced is not None:
                    # one reduce-scatter in flight at a time: the previous one completes (its input buffer is
                    # freed) before the next starts, while backward goes on
                    self.last_reduced.unit.grads.advance()
                state.unit.grads.reduce(all_reduce_replicas=state.requires_all_reduce)
                state.reduce_issued = True
                self.last_reduced = state
            self.next_reduction += 1

    def _final_callback(self) -> None:
        """End of backward (queued by the first pre-backward hook): finish every unit, then reset per-step state.

        A unit whose post-backward never fired here (its inputs needed no gradient, or this rank never used it)
        finishes now; a trainable one is reduced with whatever it has (zeros), because another rank may have used
        it and the collectives must match.
        """
        for state in reversed(self.root_states):
            if state.post_backward_pending:
                state.post_backward()
            elif state.reduces_now and not state.reduce_issued and state.unit.grads.trainable:
                state.unit.grads.stage()
            if state.reshard_after_backward and state.unit.state is not UnitState.SHARDED:
                state.unit.reshard()
        self._issue_reductions_in_order()
        for state in reversed(self.root_states):
            state.unit.grads.finish()  # the reductions overlapped the rest of backward; wait for what is left
            state._reset_step()
        self.gradients_held = any(not state.reduces_now and state.unit.grads.trainable for state in self.root_states)
        self.draining = False

    # ------------------------------------------------------------------ copy.deepcopy
    def __deepcopy__(self, memo: dict[int, Any]) -> ShardState:
        if self.unit.state is not UnitState.SHARDED:
            raise RuntimeError(
                f"copy.deepcopy of a sharded module while its unit {self.unit.owner_name} is unsharded; call "
                "fc.reshard(module) first (units are resharded between training steps)"
            )
        new = object.__new__(ShardState)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.modules = tuple(copy.deepcopy(m, memo) for m in self.modules)
        new.unit = self.unit.copy_for(memo)
        new.forward_prefetch = copy.deepcopy(self.forward_prefetch, memo)
        new.backward_prefetch = copy.deepcopy(self.backward_prefetch, memo)
        new.root = None
        new.root_states = []
        new.forward_order = []
        new.recording = []
        new.gradients_held = new.draining = False  # the copy's units start without accumulated gradients
        new._reset_step()
        return new


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
