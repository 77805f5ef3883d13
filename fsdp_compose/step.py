"""One training step of one root: the owner of the step, walking the declared schedule (schedule.py).

The root's ``ShardState`` owns a ``StepContext``; the other states only point at their root. One step, top to
bottom (every collective named here is read from the schedule, never chosen by which hook fired first)::

    root pre-forward   begin_forward: finish what the last step left, check ranks agree (opt-in), refresh
                       trainability, move inputs
    unit pre-forward   gather the unit if it is not gathered (a unit may be entered any number of times, wholly or
                       one module at a time); prefetch the next unit in registration order
    unit post-forward  outputs that need grad get the unit's pre-backward node (an _Entry); the unit closes (reshards
                       per reshard_after_forward) when every module of it ran, or at the root's end of forward
    first pre-backward begin_backward: agree with the other ranks which units this backward runs (one small
                       all-reduce); queue the final callback
    unit pre-backward  gather_for_backward: the gather cursor issues every backward all-gather up to this unit
    unit post-backward once every call of the unit this backward runs here is done: reshard, stage its gradients;
                       the reduce cursor issues the reductions whose turn has come (a unit this rank does not run
                       reduces zeros at its turn)
    final callback     end_backward: the rest of the order (gathers, then reductions), wait, reshard, reset

A step ends through ``end_backward`` or ``abandon`` (an exception, ``fc.reset_step``); both walk the rest of the
agreed order, so ranks that stopped at different points meet at its end.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo.compiled_autograd
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from .checks import check_ranks_agree
from .collectives import labelled
from .grads import GradState
from .schedule import BackwardPass, StepAbandoned, StepSchedule, agree_on_backward
from .streams import side_stream
from .unit import UnitState

if TYPE_CHECKING:
    from .state import ShardState

logger = logging.getLogger(__name__)

__all__ = ["StepContext", "StepPhase", "check_not_compiled_autograd", "in_backward"]

# On a CPU (gloo) device a wait blocks the host. Waiting for a reduce-scatter to make room for the next buffer is
# safe once this rank has issued every all-gather of the backward; before that a peer might need one of them first,
# so the wait polls for at most this long and then lets the buffer stay (memory, never a hang).
_POLL_SECONDS = 1.0


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
    AWAITING_BACKWARD = "awaiting_backward"  # a forward with outputs that need grad ended; no backward finished since
    BACKWARD = "backward"


class StepContext:
    """Per-root state of the current step (see the module docstring)."""

    def __init__(self, root: ShardState, states: list[ShardState]) -> None:
        self.root = root
        self.states = states  # every state under the root, pre-order (registration order)
        self.schedule = StepSchedule(root, states)
        self.phase = StepPhase.IDLE
        self.backward: BackwardPass | None = None
        self.reducing: list[ShardState] = []  # reductions issued whose input may still be alive, oldest first
        # The last backward left no-sync gradients in accumulation buffers (decided from settings, so it is the same
        # on every rank), and the backward that reduces them "drains" the window (see begin_backward).
        self.gradients_held = False
        self.draining = False
        # All-gather copy-in and issue overlap compute on this side stream (None on a CPU device: streams.py).
        self.gather_stream = side_stream(root.device)
        for state in states:
            state.unit.grads.make_room = self.make_room

    @property
    def in_backward(self) -> bool:
        return self.backward is not None

    def _where(self, state: ShardState | None = None) -> str:
        """Rank, unit and schedule position, for internal errors."""
        rank = self.root.unit.dp.shard_rank
        bp = self.backward
        position = "" if bp is None else f", gather cursor {bp.gather_cursor}, reduce cursor {bp.reduce_cursor}"
        unit = (
            "" if state is None else f" unit {state.unit.owner_name} (position {self.schedule.position.get(id(state))})"
        )
        return f"shard rank {rank}{unit}, step phase {self.phase.value}{position}"

    # ------------------------------------------------------------------ forward
    def begin_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Root pre-forward: finish what the last step left, refresh trainability, move inputs.

        A forward while a backward is pending (an eval forward between a forward and its backward, two forwards and
        one backward) keeps the pending forward's entries; otherwise it starts a new step.
        """
        if self.phase is StepPhase.BACKWARD:
            self.abandon()  # a backward that raised: its final callback never ran
        if any(state.collective_checks for state in self.states):
            check_ranks_agree(self.root)  # before anything of this step communicates
        continuing = self.phase is StepPhase.AWAITING_BACKWARD
        for state in self.states:
            unit = state.unit
            unit.grads.drop_if_user_zeroed()
            if not unit.explicit and state.kept_unsharded is False and unit.state is not UnitState.SHARDED:
                # A prefetch nobody used, parameters kept after a forward, or a group block left from one: free them
                # (the next gather sees any update made since, also through ``.data``).
                unit.reshard()
            unit.adopt_if_changed()  # e.g. model.to(dtype) since the last step: its dtype is the compute dtype now
            if continuing:
                state.reset_forward()
            else:
                state.reset_step()
            if state.auto_refresh_trainable and unit.refresh_trainable():
                logger.debug("trainability of %s changed: refreshed", unit.owner_name)
        self.phase = StepPhase.FORWARD
        if self.root.device.type != "cpu":
            # Blocking, like DDP: a caller may refill a pinned host batch right after model(x) returns.
            args, kwargs = tree_map(self._to_device, (args, kwargs))
        return args, kwargs

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != self.root.device:
            return value.to(self.root.device)
        return value

    def end_forward(self) -> None:
        """The root's forward returned: close units still open (a group only partly run, or run outside the root's
        forward), then wait for a backward if any output needs one."""
        if self.phase is not StepPhase.FORWARD:
            return
        for state in self.states:
            if state.active == 0:
                state.close_forward()
        pending = any(state.entries for state in self.states)
        self.phase = StepPhase.AWAITING_BACKWARD if pending else StepPhase.IDLE

    # ------------------------------------------------------------------ backward
    def begin_backward(self, running: object = None) -> None:
        """The first pre-backward of a backward (``running``: its node): agree on its participants, queue the final
        callback."""
        if self.backward is not None:
            return
        reached = [any(entry.runs_in_this_backward(running) for entry in state.entries) for state in self.states]
        checks = any(state.collective_checks for state in self.states)
        try:
            participants, quitting = agree_on_backward(self.schedule, reached, abandoning=False, checks=checks)
        except RuntimeError:
            self.abandon(agreed=True)  # every rank raises here: nothing of this backward was issued
            raise
        if quitting:
            self.abandon(agreed=True)
            raise StepAbandoned(
                f"fsdp_compose: rank(s) {quitting} abandoned this step (fc.reset_step) while this rank ran its "
                f"backward under {self.root.unit.owner_name}: no gradient of it is kept on any rank. Skip the step "
                "on every rank (the next forward starts a new one)"
            )
        takes_part = {id(s) for s, p in zip(self.states, participants, strict=True) if p}
        here = {id(s) for s, r in zip(self.states, reached, strict=True) if r}
        # Post-backward hooks each participant waits for here. A call whose inputs need no gradient has none (its
        # backward's end is not observable): such a unit finishes in the final callback.
        awaiting: dict[int, int] = {}
        for state in self.states:
            if id(state) in here:
                calls = [e for e in state.entries if e.runs_in_this_backward(running)]
                observable = all(e.post_backward_runs() for e in calls)
                awaiting[id(state)] = len(calls) if observable else -1
        self.backward = BackwardPass(
            task=int(torch._C._current_graph_task_id()),
            gather_order=[s for s in self.schedule.gather_order if id(s) in takes_part],
            reduce_order=[s for s in self.schedule.reduce_order if id(s) in takes_part],
            reached_here=here,
            awaiting=awaiting,
            consumed={id(e) for s in self.states for e in s.entries if e.runs_in_this_backward(running)},
        )
        self.phase = StepPhase.BACKWARD
        self.draining = self.gradients_held and any(s.reduces_now for s in self.backward.gather_order)
        Variable._execution_engine.queue_callback(self._final_callback)

    def gather_for_backward(self, state: ShardState) -> None:
        """``state`` needs its parameters for backward: issue the backward all-gathers up to it in the agreed order.

        Each unit the cursor passes is gathered (asynchronously, unless it is ``state``) and its prefetch targets are
        issued: the next participant in the order, or the explicit ``fc.set_modules_to_backward_prefetch`` list.
        While draining an accumulation window the implicit prefetch is skipped (the next unit's parameters would
        wait through this unit's reduce-scatter on top of every accumulation buffer: the step's peak).
        """
        bp = self.backward
        if bp is None:
            state.gather_now()  # a backward that began before this root's (nested roots): nothing to follow
            return
        self.reap()
        target = bp.position(state)
        if target is None:
            if id(state) in bp.done:
                raise RuntimeError(f"internal error in fsdp_compose: {self._where(state)} gathered after its backward")
            state.gather_now()  # run by this backward although no entry said so (a forward inside backward)
            return
        while bp.gather_cursor <= target:
            passed = bp.gather_order[bp.gather_cursor]
            bp.gather_cursor += 1
            self._issue_backward_gather(passed, now=passed is state)
        if id(state) not in bp.done:
            state.gather_now()

    def _issue_backward_gather(self, passed: ShardState, *, now: bool) -> None:
        bp = self.backward
        assert bp is not None
        if id(passed) not in bp.gathered:
            bp.gathered.add(id(passed))
            if now:
                # Copied out before its prefetch is issued: the prefetch's output then never coexists with this
                # unit's all-gather output and full parameters (the same all-gathers, in the same order).
                passed.gather_now()
            else:
                passed.start_gather(async_op=True)
        if passed.backward_prefetch is not None:
            targets = [t for t in passed.backward_prefetch if bp.takes_part(t)]
        elif self.draining:
            targets = []
        else:
            following = bp.gather_cursor  # the cursor already points past ``passed``
            targets = bp.gather_order[following : following + 1]
        for target in targets:
            if id(target) not in bp.gathered:
                bp.gathered.add(id(target))
                target.start_gather(async_op=True)

    def call_backward_done(self, state: ShardState) -> None:
        """A ``_PostBackward`` of ``state`` ran: once every call of it this backward runs here has, finish it."""
        bp = self.backward
        if bp is None or id(state) in bp.done or not bp.takes_part(state):
            return
        left = bp.awaiting.get(id(state), 0)
        if left < 0:
            return  # finishes in the final callback
        bp.awaiting[id(state)] = left - 1
        if left - 1 <= 0:
            self._finish_unit(state)
            self.issue_reductions()

    def _finish_unit(self, state: ShardState) -> None:
        """The unit's backward is done here: free its full parameters, then stage (or accumulate) its gradients."""
        bp = self.backward
        assert bp is not None
        bp.done.add(id(state))
        if id(state) not in bp.gathered:
            self._pass_gathers_up_to(state)  # peers gather it: so does this rank, before its reduction
        if state.reshard_after_backward or id(state) not in bp.reached_here:
            # Free the full parameters first: the gradients live apart from them (in ``.grad`` or the buffer).
            if not (id(state) not in bp.reached_here and state.unit.state is UnitState.GATHERING):
                state.unit.reshard()
        state.opened = False
        grads = state.unit.grads
        if not state.reduces_now:
            grads.accumulate()
        elif grads.trainable:
            grads.stage()

    def _pass_gathers_up_to(self, state: ShardState) -> None:
        bp = self.backward
        assert bp is not None
        target = bp.position(state)
        if target is None:
            return
        while bp.gather_cursor <= target:
            passed = bp.gather_order[bp.gather_cursor]
            bp.gather_cursor += 1
            self._issue_backward_gather(passed, now=False)

    # ------------------------------------------------------------------ reductions
    def issue_reductions(self, *, final: bool = False) -> None:
        """Issue reductions in the agreed order as far as their gradients are complete here.

        A participant this rank's backward does not run is complete by definition (it reduces zeros, or what it
        accumulated) and goes at its turn; one this rank runs waits for its last call's post-backward, or for the
        final callback (``final``), which completes every unit left.
        """
        bp = self.backward
        assert bp is not None
        while bp.reduce_cursor < len(bp.reduce_order):
            state = bp.reduce_order[bp.reduce_cursor]
            if id(state) not in bp.done:
                if id(state) in bp.reached_here and not final:
                    return  # its gradients may still come
                self._finish_unit(state)
            grads = state.unit.grads
            if state.reduces_now and grads.trainable:
                if grads.state is not GradState.STAGED:
                    grads.stage()
                with labelled(f"fsdp_compose::reduce_scatter[{state.unit.owner_name}]"):
                    grads.reduce(
                        all_reduce_replicas=state.requires_all_reduce, synchronising=state.requires_gradient_sync
                    )
                if grads.state is GradState.REDUCE_SCATTERING:
                    self.reducing.append(state)
            bp.reduce_cursor += 1

    def reap(self) -> None:
        """Move every reduction in flight that has completed on (a check, not a wait): frees its input."""
        for state in self.reducing:
            state.unit.grads.advance(only_if_done=True)
        self.reducing = [s for s in self.reducing if s.unit.grads.state is GradState.REDUCE_SCATTERING]

    def make_room(self) -> None:
        """Before a new reduce-scatter input is filled: fewer than ``max_reduce_inputs`` others may stay alive
        (``set_reduce_scatter_max_input_buffers``, FSDP2's meaning; default 1: the previous reduce-scatter completes
        before the next input is filled, so one input is alive at a time).

        The oldest in flight completes first. On an accelerator a wait only orders streams, so it always waits. On a
        CPU device a wait blocks the host: it blocks only once this rank has issued every all-gather of the
        backward (no peer can then be waiting for one of ours); before that it polls for a bounded time.
        """
        self.reap()
        limit = self.root.max_reduce_inputs
        bp = self.backward
        blocking = self.root.device.type != "cpu" or bp is None or not bp.gathers_left
        deadline = time.monotonic() + _POLL_SECONDS
        while len(self.reducing) >= limit:
            oldest = self.reducing[0]
            grads = oldest.unit.grads
            if blocking:
                grads.advance()
            else:
                while not grads.reduce_scatter_done() and time.monotonic() < deadline:
                    time.sleep(0)
                if not grads.reduce_scatter_done():
                    return  # a peer may still need our all-gathers: let the buffer stay
                grads.advance()
            self.reducing = [s for s in self.reducing if s.unit.grads.state is GradState.REDUCE_SCATTERING]

    # ------------------------------------------------------------------ the end of a step
    def _complete_collective_order(self) -> None:
        """Issue and wait for the rest of this backward's collectives, in the agreed order.

        The final callback and an abandoned step share it, so both end at the same point on every rank: every
        backward all-gather the cursor has not passed (units this rank never needed; each freed once done), every
        unit not finished yet (its post-backward never came here), every reduction left, then the waits.
        """
        bp = self.backward
        assert bp is not None
        while bp.gathers_left:
            passed = bp.gather_order[bp.gather_cursor]
            bp.gather_cursor += 1
            self._issue_backward_gather(passed, now=False)
        for state in bp.reduce_order:
            if id(state) not in bp.done:
                self._finish_unit(state)
        self.issue_reductions(final=True)
        for state in reversed(self.states):
            state.unit.grads.finish()  # the reductions overlapped the rest of backward; wait for what is left
        self.reducing = []

    def _keeps_after_backward(self, state: ShardState) -> bool:
        """Full parameters stay across a backward only where asked and no optimizer step can follow it: a step's
        update through ``.data`` would bump no version counter to tell they are stale."""
        return not state.reshard_after_backward and not state.gradients_final

    def _final_callback(self) -> None:
        """End of backward (queued by its first pre-backward): finish every participant, then reset.

        A participant whose post-backward never fired here (its inputs needed no gradient, or this rank never ran
        it) finishes now; a trainable one is reduced with whatever it has (zeros), because another rank may have
        used it and the collectives must match.
        """
        with labelled("fsdp_compose::final_callback"):
            bp = self.backward
            if bp is None:
                return
            self._complete_collective_order()
            for state in bp.gather_order:
                grads = state.unit.grads
                grads.settle()  # the one point where the host waits for device-to-host copies of gradients
                grads.mark_held()
                keep = self._keeps_after_backward(state)
                if not keep and state.unit.state is not UnitState.SHARDED:
                    state.unit.reshard()
                if state.unit.state is UnitState.GATHERING:
                    state.unit.finish_unshard()
                state.kept_unsharded = keep and state.unit.state is UnitState.UNSHARDED
                # The calls this backward ran are consumed; calls it did not run wait for a later backward (a
                # chunked loss runs the head's backward once per chunk, then the body's).
                state.entries = [e for e in state.entries if id(e) not in bp.consumed]
                state.unit.shards.replaced.arm()  # an optimizer built before fully_shard fails at its step
            self.gradients_held = any(state.unit.grads.state is GradState.ACCUMULATING for state in self.states)
            self.draining = False
            self.backward = None
            self.phase = StepPhase.IDLE

    def abandon(self, *, agreed: bool = False) -> None:
        """A step that never reached its final callback (it raised, or ``fc.reset_step``): drop its gradients.

        Inside a backward, every rank first completes the whole agreed order: the remaining backward all-gathers,
        then every reduction, staged with whatever is there, waited for and thrown away. Then the gradients held
        but not delivered are dropped (partial: the failed micro-batch's are mixed in) and every unit is resharded.
        ``agreed``: the participants' agreement already told every rank (nothing of the backward was issued).
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
        if self.backward is not None and not agreed:
            self._complete_collective_order()
        for state in self.states:
            state.unit.grads.discard()
            if state.unit.state is not UnitState.SHARDED:
                state.unit.reshard()
            state.reset_step()
            state.kept_unsharded = False
        self.gradients_held = False
        self.draining = False
        self.reducing = []
        self.backward = None
        self.phase = StepPhase.IDLE

    def reset(self) -> None:
        """``fc.reset_step``: forget the current step (held no-sync gradients too) and reshard every unit.

        After a forward whose backward is pending, another rank may be running that backward (this rank raised in
        its loss): the ranks then agree on abandoning it through the backward's agreement, and every rank raises
        the same ``StepAbandoned`` unless all of them abandon it.
        """
        quitting: list[int] = []
        everyone = False
        if self.phase in (StepPhase.AWAITING_BACKWARD, StepPhase.FORWARD) and self.backward is None:
            _, quitting = agree_on_backward(self.schedule, [False] * len(self.states), abandoning=True, checks=False)
            everyone = len(quitting) == _ranks_in(self.root)
        if self.backward is not None or any(s.unit.grads.has_pending() for s in self.states):
            self.abandon()
        for state in self.states:
            state.unit.explicit = False
            if state.unit.state is not UnitState.SHARDED:
                state.unit.reshard()
            state.reset_step()
            state.kept_unsharded = False
        self.backward = None
        self.phase = StepPhase.IDLE
        if quitting and not everyone:
            raise StepAbandoned(
                f"fsdp_compose: this rank abandoned the step (fc.reset_step) under {self.root.unit.owner_name} while "
                f"other ranks ran its backward (abandoning: {quitting}): no gradient of it is kept on any rank. Skip "
                "the step on every rank (the next forward starts a new one)"
            )


def _ranks_in(root: ShardState) -> int:
    dp = root.unit.dp
    return dp.size if dp.size > 0 else 1
