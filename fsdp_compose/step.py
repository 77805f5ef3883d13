"""One training step of one root: everything that belongs to the step rather than to a unit.

The root's ``ShardState`` owns a ``StepContext``; the other states only point at their root. The context holds the
forward order, the backward gather schedule, the reduce-scatter order and the one reduction in flight, the final
callback, and the accumulation window. Its phase (``StepPhase``) moves::

    IDLE --begin_step--> FORWARD --end_forward--> AWAITING_BACKWARD --begin_backward--> BACKWARD --final--> IDLE
                         FORWARD --end_forward (no output needs grad)--> IDLE

A new root forward always begins a new step, whatever the last one left behind: a backward that raised midway (its
collectives are completed, its held gradients dropped: they are partial), a forward with no backward after it, an
explicit ``fc.reset_step``. Every decision that picks a collective is made from settings and from the forward order,
both the same on every rank, never from what a rank's data did:

- all-gathers in backward follow the reverse forward order through one cursor (``gather_for_backward``): a unit's
  pre-backward first issues the all-gathers of every unit before it in that order, so a unit whose output never
  reached this rank's loss is still gathered at the same point as on the ranks that use it;
- reduce-scatters go out in reverse registration order on their own process group (``meshes.reduce_scatter_group``)
  as soon as it is a unit's turn; a unit this rank did not run in forward is staged with zeros when its turn comes,
  one that ran but got no gradient here waits for the final callback.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo.compiled_autograd
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from .checks import check_ranks_agree
from .collectives import labelled
from .grads import GradState
from .streams import side_stream
from .transitions import checked
from .unit import UnitState

if TYPE_CHECKING:
    from .state import ShardState

logger = logging.getLogger(__name__)

__all__ = ["StepContext", "StepPhase", "check_not_compiled_autograd", "in_backward"]


def in_backward() -> bool:
    """True while autograd runs a backward on this thread (e.g. an activation-checkpoint recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


def check_not_compiled_autograd(owner: str) -> None:
    """Raise when this backward runs under compiled autograd, before the unit issues any collective of it.

    Compiled autograd captures the backward graph, hooks included, and replays it: the units' backward hooks keep
    per-step state and issue collectives, and trained with wrong gradients when replayed that way (measured, for
    torch's own ``fully_shard`` too). Compiling the blocks' forward still compiles their backward (AOTAutograd).
    """
    compiled_autograd = torch._dynamo.compiled_autograd
    if compiled_autograd.compiled_autograd_enabled or compiled_autograd.in_compiled_autograd_region:
        raise RuntimeError(
            f"{owner}: backward runs under compiled autograd (torch._dynamo.config.compiled_autograd), which "
            "fsdp_compose does not support: its backward hooks must run in eager autograd. Turn compiled autograd "
            "off; torch.compile of the blocks still compiles their backward (see docs/compile.md)"
        )


class StepPhase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    AWAITING_BACKWARD = "awaiting_backward"
    BACKWARD = "backward"


_ALLOWED: dict[StepPhase, frozenset[StepPhase]] = {
    StepPhase.IDLE: frozenset({StepPhase.FORWARD, StepPhase.BACKWARD}),
    StepPhase.FORWARD: frozenset({StepPhase.AWAITING_BACKWARD, StepPhase.IDLE}),
    # A second root forward before backward (two forwards, one backward) keeps waiting for that backward.
    StepPhase.AWAITING_BACKWARD: frozenset({StepPhase.BACKWARD, StepPhase.FORWARD, StepPhase.IDLE}),
    # A second backward over a retained graph starts from IDLE; BACKWARD -> FORWARD is an aborted backward.
    StepPhase.BACKWARD: frozenset({StepPhase.IDLE, StepPhase.FORWARD}),
}


class StepContext:
    """Per-root state of the current step (see the module docstring)."""

    def __init__(self, root: ShardState, states: list[ShardState]) -> None:
        self.root = root
        self.states = states  # every state under the root, pre-order (registration order)
        self.phase = StepPhase.IDLE
        self.forward_order: list[ShardState] = []  # units in the order the previous forward ran them
        self.recording: list[ShardState] = []  # the order this forward runs them
        self.backward_order: list[ShardState] = []
        self._backward_position: dict[int, int] = {}
        self.gather_cursor = 0  # backward_order[:gather_cursor] had their backward all-gathers issued
        self.next_reduction = 0  # position in reversed(states) of the next reduce-scatter to issue
        self.reducing: list[ShardState] = []  # units whose reduce-scatter went out and may still hold its input
        # The last backward left no-sync gradients in accumulation buffers (decided from settings, so it is the same
        # on every rank), and the backward that reduces them "drains" the window (see begin_backward).
        self.gradients_held = False
        self.draining = False
        # All-gather copy-in and issue overlap compute on this side stream (None on a CPU device: streams.py).
        self.gather_stream = side_stream(root.device)
        for state in states:
            state.unit.grads.make_room = self.complete_reduction_in_flight

    def _to(self, new: StepPhase) -> None:
        self.phase = checked(self.phase, new, _ALLOWED, f"step of {self.root.unit.owner_name}")

    # ------------------------------------------------------------------ forward
    def begin_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Root pre-forward: clean up whatever the last step left, refresh trainability, move inputs."""
        if self.phase is StepPhase.BACKWARD:
            self.abort_backward()
        if self.root.collective_checks:
            check_ranks_agree(self.root)  # before anything of this step communicates
        if self.recording:
            self.forward_order, self.recording = self.recording, []
        for state in self.states:
            unit = state.unit
            unit.grads.drop_if_user_zeroed()
            if not unit.explicit and state.kept_unsharded is False:
                # A prefetch nobody used, parameters kept after a forward that had no backward, or a group block
                # left from one: free them (the next gather sees any update made since, also through ``.data``).
                if unit.state is not UnitState.SHARDED:
                    unit.reshard()
            unit.adopt_if_changed()  # e.g. model.to(dtype) since the last step: its dtype is the compute dtype now
            state.reset_step()
            # The cheap per-step trainability check: one bool comparison per parameter.
            if state.auto_refresh_trainable and unit.refresh_trainable():
                logger.debug("trainability of %s changed: refreshed", unit.owner_name)
        self._to(StepPhase.FORWARD)
        if self.root.device.type != "cpu":
            # Blocking, like DDP: a caller may refill a pinned host batch right after model(x) returns.
            args, kwargs = tree_map(self._to_device, (args, kwargs))
        return args, kwargs

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != self.root.device:
            return value.to(self.root.device)
        return value

    def record_forward(self, state: ShardState) -> None:
        self.recording.append(state)

    def next_in_forward(self, state: ShardState) -> list[ShardState]:
        """The unit expected after ``state`` in this forward (from the previous forward's order)."""
        order = self.forward_order
        try:
            index = order.index(state) + 1
        except ValueError:
            return []
        return [order[index]] if index < len(order) else []

    def end_forward(self, expects_backward: bool) -> None:
        if self.phase is StepPhase.FORWARD:
            self._to(StepPhase.AWAITING_BACKWARD if expects_backward else StepPhase.IDLE)

    # ------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        """The first pre-backward hook of this backward: queue the final callback, fix the backward schedule."""
        if self.phase is StepPhase.BACKWARD:
            return
        self._to(StepPhase.BACKWARD)
        Variable._execution_engine.queue_callback(self._final_callback)
        self.draining = self.gradients_held and any(state.reduces_now for state in self.states)
        # Backward runs the root first (its outputs are last), then the other units in reverse forward order.
        order = self.recording or self.forward_order
        self.backward_order = order[:1] + order[:0:-1]
        self._backward_position = {}
        for position, state in enumerate(self.backward_order):
            self._backward_position.setdefault(id(state), position)
        self.gather_cursor = 0
        self.next_reduction = 0
        self.reducing = []

    def gather_for_backward(self, state: ShardState) -> None:
        """Pre-backward of ``state``: issue the backward all-gathers up to it in the fixed order, then its own.

        Each unit the cursor passes is gathered (asynchronously, unless it is ``state``) and its prefetch targets
        are issued: the next unit in backward order, or the explicit ``fc.set_modules_to_backward_prefetch`` list.
        While draining an accumulation window the implicit prefetch is skipped (the next unit's parameters would
        wait through this unit's reduce-scatter on top of every accumulation buffer: the step's peak).
        """
        # A reduce-scatter in flight that has completed frees its input before this unit's all-gather output is
        # allocated (a check, not a wait); while draining an accumulation window it completes in any case, so the
        # two never coexist next to every unit's accumulation buffer.
        self.complete_reduction_in_flight()
        target = self._backward_position.get(id(state))
        if target is not None:
            while self.gather_cursor <= target:
                passed = self.backward_order[self.gather_cursor]
                self.gather_cursor += 1
                if passed is state:
                    # Copied out before its prefetch is issued: the prefetch's output then never coexists with
                    # this unit's all-gather output and full parameters (the same all-gathers, in the same order).
                    state.gather_now()
                else:
                    passed.start_gather(async_op=True)
                self._prefetch_after(passed)
        state.gather_now()

    def _prefetch_after(self, state: ShardState) -> None:
        if state.backward_prefetch is not None:
            targets = state.backward_prefetch
        elif self.draining:
            return
        else:
            position = self._backward_position[id(state)] + 1
            targets = self.backward_order[position : position + 1]
        for target in targets:
            if not target.in_backward_phase:
                target.start_gather(async_op=True)

    # ------------------------------------------------------------------ reductions
    def complete_reduction_in_flight(self) -> None:
        """Free the inputs of reduce-scatters in flight before a new buffer is allocated: every one that has completed.

        No blocking wait while this rank still has backward all-gathers to issue: another rank may issue its side of
        a reduce-scatter only in its final callback (a unit whose output missed its loss), after all-gathers that
        need this rank. Every reduction in flight is checked, not only the last: one that had not completed when the
        next went out would otherwise hold its full-size input until the end of backward.
        """
        if not self.reducing:
            return
        # Blocking is safe once this rank has issued every all-gather of its backward: no peer then waits on it.
        gathers_left = self.phase is StepPhase.BACKWARD and self.gather_cursor < len(self.backward_order)
        for state in self.reducing:
            state.unit.grads.advance(only_if_done=gathers_left)
        self.reducing = [s for s in self.reducing if s.unit.grads.state is GradState.REDUCE_SCATTERING]

    def issue_reductions_in_order(self, *, final: bool = False) -> None:
        """Issue staged reduce-scatters in one fixed order, the same on every rank.

        The order is reverse registration order (blocks last to first, then the root): the natural backward order,
        so in the common case every unit goes as soon as it is staged. A unit staged early waits for the ones
        before it. A unit this rank did not run in this forward can get no gradient any more: it is staged (with
        zeros, or with what it accumulated) when its turn comes; one that ran but got no gradient here waits for the
        final callback (``final``), which stages the rest.
        """
        order = self.states
        ran = {id(state) for state in self.recording}
        while self.next_reduction < len(order):
            state = order[len(order) - 1 - self.next_reduction]
            grads = state.unit.grads
            if state.reduces_now and grads.trainable and not state.reduce_issued:
                if grads.state is not GradState.STAGED:
                    if not final and id(state) in ran:
                        return  # its gradients may still come
                    grads.stage()
                # one reduce-scatter in flight at a time: the previous one completes (its input buffer is freed)
                # before the next starts, while backward goes on
                self.complete_reduction_in_flight()
                grads.reduce(all_reduce_replicas=state.requires_all_reduce, synchronising=state.requires_gradient_sync)
                state.reduce_issued = True
                self.reducing.append(state)
            self.next_reduction += 1

    def _complete_collective_order(self, *, run_post_backward: bool) -> None:
        """Issue and wait for the rest of this backward's collectives, in the order every rank follows.

        The final callback and an aborted step share it, so both end at the same point on every rank. First the
        backward all-gathers no pre-backward reached here: a later unit's pre-backward passes the cursor over a unit
        whose output missed this rank's loss, but nothing passes the last units in backward order, and a backward
        that raised stopped the cursor wherever it was. Other ranks gathered those units, so this rank issues the
        same all-gathers, with the same prefetches, in the same order; nothing here needs the results, so each unit
        that keeps nothing after backward is resharded as soon as the cursor has passed it. Then (final callback
        only) the post-backward of units whose hook never fired, then every reduce-scatter left, then the waits.
        """
        while self.gather_cursor < len(self.backward_order):
            passed = self.backward_order[self.gather_cursor]
            self.gather_cursor += 1
            passed.start_gather(async_op=True)
            self._prefetch_after(passed)
            if not passed.in_backward_phase and not self._keeps_after_backward(passed):
                passed.unit.reshard()
        if run_post_backward:
            for state in reversed(self.states):
                if state.post_backward_pending:
                    state.post_backward()
        self.issue_reductions_in_order(final=True)
        for state in reversed(self.states):
            state.unit.grads.finish()  # the reductions overlapped the rest of backward; wait for what is left

    def _keeps_after_backward(self, state: ShardState) -> bool:
        return not state.reshard_after_backward and not state.requires_gradient_sync

    def _final_callback(self) -> None:
        """End of backward (queued by the first pre-backward hook): finish every unit, then reset per-step state.

        A unit whose post-backward never fired here (its inputs needed no gradient, or this rank never used it)
        finishes now; a trainable one is reduced with whatever it has (zeros), because another rank may have used
        it and the collectives must match. A backward that synchronises gradients reshards every unit whatever
        ``reshard_after_backward`` says: an optimizer step follows it, so full parameters kept across it would be
        stale (an update through ``.data`` bumps no version counter to tell).
        """
        with labelled("fsdp_compose::final_callback"):
            self._complete_collective_order(run_post_backward=True)
            for state in reversed(self.states):
                grads = state.unit.grads
                grads.settle()  # the one point where the host waits for device-to-host copies of gradients
                if not state.reduces_now:
                    grads.accumulate()
                grads.mark_held()
                keep = self._keeps_after_backward(state)
                if not keep and state.unit.state is not UnitState.SHARDED:
                    state.unit.reshard()
                if state.unit.state is UnitState.GATHERING:
                    state.unit.finish_unshard()
                state.reset_step()
                state.kept_unsharded = keep and state.unit.state is UnitState.UNSHARDED
                state.unit.shards.replaced.arm()  # an optimizer built before fully_shard fails at its step
            self.gradients_held = any(state.unit.grads.state is GradState.ACCUMULATING for state in self.states)
            self.draining = False
            self._to(StepPhase.IDLE)

    def abort_backward(self) -> None:
        """A step that never reached its final callback (it raised, or ``fc.reset_step``): drop its gradients.

        A backward that raised stopped at a different point of the collective order on each rank (a unit reached
        the loss on some ranks only; a rank raised alone), so every rank first completes the whole order, the same
        for all: the remaining backward all-gathers, then every reduce-scatter (and HSDP all-reduce), staged with
        whatever is there, waited for and thrown away. Then the gradients held but not delivered are dropped
        (partial: the failed micro-batch's are mixed in) and every unit is resharded.
        """
        logger.warning(
            "%s: the step did not finish (an exception, or fc.reset_step): gradients not yet in .grad are dropped",
            self.root.unit.owner_name,
        )
        for state in self.states:
            state.unit.grads.dropping = True
            for mp in state.unit.params:
                if mp.full is not None:
                    mp.full.grad = None  # partial; the reductions below carry zeros in their place
        if self.phase is StepPhase.BACKWARD:
            self._complete_collective_order(run_post_backward=False)  # partial gradients: no post-backward
        for state in self.states:
            state.unit.grads.discard()
            if state.unit.state is not UnitState.SHARDED:
                state.unit.reshard()
            state.reset_step()
            state.kept_unsharded = False
        self.gradients_held = False
        self.draining = False
        self.recording = []
        self.reducing = []
        self.phase = StepPhase.IDLE

    def reset(self) -> None:
        """``fc.reset_step``: forget the current step (held no-sync gradients too) and reshard every unit."""
        if self.phase is StepPhase.BACKWARD or any(s.unit.grads.has_pending() for s in self.states):
            self.abort_backward()
        for state in self.states:
            state.unit.explicit = False
            if state.unit.state is not UnitState.SHARDED:
                state.unit.reshard()
            state.reset_step()
            state.kept_unsharded = False
        self.recording = []
        self.phase = StepPhase.IDLE
