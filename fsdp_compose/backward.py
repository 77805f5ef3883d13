"""One backward's walk through its compiled program (program.py): two cursors and the reductions in flight.

``StepContext.begin_backward`` builds it with the program compiled from the participants the ranks agreed on, and
drops it in the final callback. The program says what goes out and in which order (its gather path and reduce path);
the walk decides when. What the walk knows of each unit (its step on the gather path, the calls it runs here, whether
it is gathered or finished, what it prefetched) is in the unit's record, set when the backward begins
(``state.UnitStepRecord.forget_backward``) and moved on only here:

- ``gather_for_backward``: the gather cursor passes every step of the gather path up to the unit needed now, issuing
  its all-gather where the step lists one (a unit this rank does not run is gathered at its turn all the same). A
  unit it needs now prefetches the next step at its ``backward_prefetch_point`` (``fc.set_backward_prefetch_point``);
- ``gradient_made``: a full parameter's gradient was accumulated: the parameter is freed at once where nothing
  can read it any more, and the unit's midway prefetch goes out once half its parameter bytes are freed;
- ``call_backward_done``: a unit's call finished its backward here; the unit is finished once every call this
  backward runs here has (``awaiting``), then the reduce cursor issues every step of the reduce path whose turn has
  come;
- ``make_room`` / ``issue_reductions``: the window: older reduce-scatters complete before a new input is filled (on
  an accelerator) or before the new one is issued (on CPU);
- ``issue_rest`` / ``wait_rest``: the rest of both paths, in the final callback or when a step is abandoned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .grads import GradState
from .program import GatherStep, Program, ReduceStep
from .transitions import internal_error
from .unit import UnitState

if TYPE_CHECKING:
    from .flat import ManagedParam
    from .state import ShardState

__all__ = ["BackwardWalk"]


@dataclass
class BackwardWalk:
    """One backward: its program (the paths through the participants the ranks agreed on) and the two cursors."""

    program: Program
    consumed: set[int]  # ids of the entries (forward calls) this backward runs: dropped at its end
    draining: bool  # this backward reduces gradients held over no-sync micro-batches: no implicit prefetch
    max_reduce_inputs: int  # set_reduce_scatter_max_input_buffers of the root
    # A wait on a collective only orders streams (an accelerator), or it blocks the host until every peer issued it
    # (gloo on a CPU device): ``StepContext.accelerated``.
    accelerated: bool
    where: Callable[[ShardState | None], str]  # rank, unit and step position, for internal errors
    gather_cursor: int = 0  # the next step of ``program.gathers``
    reduce_cursor: int = 0  # the next step of ``program.reductions``
    reducing: list[ShardState] = field(default_factory=list)  # reductions whose input may be alive, oldest first
    # autograd's id of this backward (``torch._C._current_graph_task_id``: a nested one, a reentrant recompute's,
    # differs); None: nothing is freed early
    graph_task: int | None = None

    def __post_init__(self) -> None:
        self.reduce_steps: dict[int, ReduceStep] = {id(step.state): step for step in self.program.reductions}

    def gather_for_backward(self, states: list[ShardState]) -> None:
        """``states`` (a unit and its siblings: ``ShardState.members``) need their parameters for backward: pass the
        gather path's steps up to the last of them.

        Each step the cursor passes is gathered (asynchronously, unless it is needed now) and its prefetch issued:
        the steps its explicit ``fc.set_modules_to_backward_prefetch`` list placed right after it, else the next step
        (none where that is needed now too: a peer needs all of them before its unit's backward can go on, so none
        waits behind a prefetch's turn in the reduce-scatter window). While draining an accumulation window the
        implicit prefetch is skipped (the next unit's parameters would wait through this unit's reduce-scatter on top
        of every accumulation buffer: the step's peak).
        """
        self.reap()
        for state in states:
            record = state.record
            if record.position is None:
                # Run by this backward although no forward entry of this step said so (a forward inside the
                # backward, a unit nested in a recomputed one): the ranks agreed on, and compiled, a program without
                # it, so a gather here could not be checked to match the other ranks'.
                what = "after its backward" if record.done else "by a backward no forward entry of it announced"
                raise RuntimeError(
                    f"fsdp_compose: unit {state.params.owner_name} needs its parameters {what} ({self.where(state)}), "
                    "outside the schedule this backward agreed on. Run the unit's forward before the backward that "
                    "uses it (not from inside a backward hook or a custom autograd Function's backward)"
                )
        target = max(state.record.position or 0 for state in states)
        self._advance_gathers(target, needed={id(state) for state in states})
        for state in states:
            if not state.record.done and state.unshard_in_backward:
                self._gather(state, None, now=True)  # wait for it and copy out (one rank: gather it here)

    def _pass(self, step: GatherStep, *, now: bool, needed: set[int]) -> None:
        passed = step.state
        record = passed.record
        if not passed.unshard_in_backward:
            record.gathered = True  # its backward reads no parameter: nothing to gather
        elif now or not record.gathered:
            # Needed ``now``: copied out before its prefetch is issued, so the prefetch's output never coexists with
            # this unit's all-gather output and full parameters (the same all-gathers, in the same order). Prefetched
            # already: only the wait and the copy-out.
            self._gather(passed, None if record.gathered else step, now=now)
            record.gathered = True
        steps = self.program.gathers
        if passed.backward_prefetch is not None:
            placed = []
            while self.gather_cursor < len(steps) and steps[self.gather_cursor].placed:
                placed.append(steps[self.gather_cursor].state)
                self.gather_cursor += 1
            self._prefetch(placed)
        elif not self.draining:
            following = self.gather_cursor  # the cursor already points past ``passed``
            targets = [step.state for step in steps[following : following + 1] if id(step.state) not in needed]
            point = passed.backward_prefetch_point
            if not targets or not now or not record.reached_here or point == "before":
                self._prefetch(targets)
            elif point == "after":
                record.held_prefetch, record.held_until_freed = targets, None
            else:
                # Midway: once half the bytes of its full parameters that backward may free early are freed.
                params = passed.params
                half = 0
                if passed.reshard_after_forward and params.state is UnitState.UNSHARDED:
                    if self._frees_early(passed, nested=False):
                        half = params.fulls.early_freeable_bytes(passed.grads.trainable) // 2
                if half > 0:
                    record.held_prefetch, record.held_until_freed = targets, half
                else:
                    # Nothing of it can be freed early (no trainable parameter, or the root, whose parameters are
                    # needed at both ends of backward): now, once the window has room.
                    self._prefetch(targets, after_reductions=True)

    def _frees_early(self, state: ShardState, *, nested: bool | None = None) -> bool:
        """May a full parameter of ``state`` whose gradient was just accumulated be freed now, before its unit ends?

        autograd runs every node reading a parameter before the node accumulating its gradient, so then nothing of
        this backward reads it: if this is the unit's only (or last running) call here, the unit reshards at its end
        anyway, no recompute of it is due, and this is the backward itself, not a nested one (a reentrant
        checkpoint: ``graph_task`` None frees nothing early, ``step._recomputes_inside``). ``FullParams.free_early``
        adds the last check: nothing but the library's own tensors views it.
        """
        if self.graph_task is None:
            return False
        if nested is None:
            nested = torch._C._current_graph_task_id() != self.graph_task
        record = state.record
        return (
            not nested
            and record.reached_here
            and not record.done
            and (record.calls_here == 1 or record.awaiting == 1)
            and state.reshard_after_backward
            and record.recomputes_due == 0
        )

    def gradient_made(self, state: ShardState, mp: ManagedParam) -> None:
        """A full parameter of ``state`` got its gradient: to the unit's gradients where they are filling a buffer
        (``make_room`` first for a new one); free it where ``_frees_early`` allows; midway prefetch once half the
        unit is freed."""
        grads = state.grads
        if grads.takes_each_gradient():
            if grads.needs_buffer():
                self.make_room()
            grads.capture(mp)
        params = state.params
        if params.state is not UnitState.UNSHARDED or not self._frees_early(state):
            return
        freed = params.fulls.free_early(mp)
        if not freed:
            return
        record = state.record
        record.freed_early += freed
        if not record.held_prefetch or record.held_until_freed is None or record.freed_early < record.held_until_freed:
            return
        if not self.accelerated:
            # gloo reports a reduce-scatter complete only once it is waited for: wait (where ``issue_reductions``
            # may; the unit's reduce-scatter would wait for it anyway). On an accelerator a check: a wait would stall
            # compute.
            self._wait_for_reductions(keep=self.max_reduce_inputs - 1)
        else:
            self.reap()
        if len(self.reducing) < self.max_reduce_inputs:
            record.landing, record.held_prefetch = record.held_prefetch, []
            self._prefetch(record.landing)

    def _prefetch(self, targets: list[ShardState], *, after_reductions: bool = False) -> None:
        for target in targets:
            record = target.record
            if not record.gathered and target.unshard_in_backward and record.position is not None:
                if after_reductions:
                    # The reduce-scatter this unit is about to issue waits for the older ones anyway (the window):
                    # waiting first keeps them from living next to the prefetched all-gather output.
                    self._wait_for_reductions(keep=self.max_reduce_inputs - 1)
                record.gathered = True
                self._gather(target, self.program.gathers[record.position], now=False)

    def _gather(self, state: ShardState, step: GatherStep | None, *, now: bool) -> None:
        """Issue the unit's all-gather where its ``step`` lists one (``now``: then wait for it and copy out). Without a
        step, or where it lists none, only what is local, when wanted ``now``: the wait and copy-out of an earlier
        issue, or a gather that moves nothing between ranks (one rank, kept-whole parameters only). A collective
        issued where the step lists none, or none where it lists one, would break the program every rank runs."""
        params = state.params
        issued = params.issued
        if now:
            state.gather_now()
        elif step is not None and step.operation is not None:
            state.start_gather(async_op=True)
        if (params.issued != issued) != (step is not None and step.operation is not None):
            listed = "none" if step is None or step.operation is None else str(step.operation)
            raise internal_error(
                self.where(state), f"its backward all-gather went against its step of the program (it lists {listed})"
            )

    def call_backward_done(self, state: ShardState) -> None:
        """A ``_PostBackward`` of ``state`` ran: once every call of it this backward runs here has, finish it."""
        record = state.record
        if record.done or record.position is None or record.awaiting < 0:
            return  # a unit awaiting -1 finishes in the final callback
        record.awaiting -= 1
        if record.awaiting <= 0:
            self._finish_unit(state)
            self.issue_reductions()

    def _finish_unit(self, state: ShardState) -> None:
        """The unit's backward is done here: free its full parameters, land what it prefetched midway, stage (or
        accumulate) its gradients, then issue its prefetch if it was held back to here."""
        record = state.record
        record.done = True
        if not record.gathered and record.position is not None:
            self._advance_gathers(record.position)  # peers gather it: so does this rank, before its reduction
        if state.reshard_after_backward and state.params.state is not UnitState.GATHERING:
            # Free the full parameters first (the gradients live apart from them), on every rank alike, whether it ran
            # the unit or not. One still gathering (never needed here) is freed in the final callback, when waiting
            # for its all-gather cannot block a peer.
            state.params.reshard()
        # A peer issues what ``state`` prefetched midway at the latest when its gather cursor passes ``state`` or at
        # the end of its own backward of ``state``; until then it may block only on all-gathers up to ``state`` and
        # reductions before it. So this rank may wait for that all-gather once its reduce cursor is at ``state``
        # (always, in a model run in registration order): else a stream wait could close a cycle between two ranks.
        cursor, steps = self.reduce_cursor, self.program.reductions
        may_wait = cursor < len(steps) and steps[cursor].state is state
        landing, record.landing = record.landing, []
        for prefetched in landing:
            # Its copy-out (all-gather output next to the full parameters) happens now, not at its pre-backward:
            # then it never meets this unit's reduce-scatter input and output (issued next); where it may not wait,
            # or the all-gather has not arrived, at its pre-backward.
            params = prefetched.params
            if params.state is UnitState.GATHERING and prefetched.record.reached_here:
                if params.arrived() or may_wait:
                    prefetched.gather_now()
        record.opened = False
        grads = state.grads
        if grads.trainable and grads.input.buffer is None:
            self.make_room()  # a new reduce-scatter input is filled next
        if not self.reduce_steps[id(state)].reduces:
            grads.accumulate()
        elif grads.trainable:
            grads.stage()
        held, record.held_prefetch = record.held_prefetch, []
        if held:
            self._prefetch(held, after_reductions=True)

    def _advance_gathers(self, target: int, needed: set[int] | None = None) -> None:
        """Move the gather cursor past step ``target``, issuing every backward all-gather on the way (those of
        ``needed``, ids of states, synchronously: they are wanted now)."""
        needed = needed or set()
        while self.gather_cursor <= target:
            step = self.program.gathers[self.gather_cursor]
            self.gather_cursor += 1
            self._pass(step, now=id(step.state) in needed, needed=needed)

    # ------------------------------------------------------------------ reductions
    def issue_reductions(self, *, final: bool = False) -> None:
        """Issue the reduce path's steps in order as far as their gradients are complete here.

        A participant this rank's backward does not run is complete by definition (it reduces zeros, or what it
        accumulated) and goes at its turn; one this rank runs waits for its last call's post-backward, or for the
        final callback (``final``), which completes every unit left.
        """
        steps = self.program.reductions
        while self.reduce_cursor < len(steps):
            step = steps[self.reduce_cursor]
            state, record = step.state, step.state.record
            if not record.done:
                if record.reached_here and not final:
                    return  # its gradients may still come
                self._finish_unit(state)
            grads = state.grads
            if step.reduces and grads.trainable:
                if grads.state is not GradState.STAGED:
                    if grads.input.buffer is None:
                        self.make_room()
                    grads.stage()
                if not self.accelerated:
                    # The window's wait on CPU (``make_room``): older reductions complete before this one is issued,
                    # also for an input staged in place (an accumulation buffer, filled without ``make_room``): each
                    # in flight holds gloo's copy of its input. On an accelerator the wait came before the filling,
                    # and an accumulation buffer is alive anyway: a wait here would only stall compute.
                    self._wait_for_reductions(keep=self.max_reduce_inputs - 1)
                grads.reduce(all_reduce_replicas=step.replicas, synchronising=step.synchronising)
                if grads.state is GradState.REDUCE_SCATTERING:
                    self.reducing.append(state)
            self.reduce_cursor += 1

    def reap(self) -> None:
        """Move the completed reductions on (a check, not a wait), oldest first, up to the first still running: what
        comes next (HSDP's replica all-reduce) goes out in the agreed order on every rank, not in completion order."""
        still: list[ShardState] = []
        for state in self.reducing:
            grads = state.grads
            if not still:
                grads.advance(only_if_done=True)
            if grads.state is GradState.REDUCE_SCATTERING:
                still.append(state)
        self.reducing = still

    def make_room(self) -> None:
        """Before a new reduce-scatter input is filled: on an accelerator at most ``max_reduce_inputs - 1`` others
        stay alive (FSDP2's ``set_reduce_scatter_max_input_buffers``). On CPU a wait blocks the host: only what
        completed is freed here, the wait comes before the issue (``issue_reductions``; docs/schedule.md "The
        reduce-scatter window"). Either way only once every all-gather a peer may need first is out (``wait_after``).
        """
        if not self.accelerated:
            self.reap()
            return
        self._wait_for_reductions(keep=self.max_reduce_inputs - 1)

    def _wait_for_reductions(self, *, keep: int) -> None:
        """Complete the oldest reductions in flight until at most ``keep`` remain (``make_room``, ``wait_after``)."""
        self.reap()
        while len(self.reducing) > keep:
            oldest = self.reducing[0]
            if self.gather_cursor <= oldest.record.wait_after:
                return
            oldest.grads.advance()
            self.reducing = [s for s in self.reducing if s.grads.state is GradState.REDUCE_SCATTERING]

    def issue_rest(self) -> None:
        """Issue the rest of the program (``wait_rest`` completes it): every step of the gather path the cursor has not
        passed (units this rank never needed; each freed once done), every unit not finished (its post-backward never
        came here), every step of the reduce path left, HSDP's all-reduces over replicas. The final callback and an
        abandoned step share it, so both issue the same on every rank."""
        self._advance_gathers(len(self.program.gathers) - 1)
        for step in self.program.reductions:
            if not step.state.record.done:
                self._finish_unit(step.state)
        self.issue_reductions(final=True)
        for step in self.program.reductions:
            grads = step.state.grads
            if grads.state is GradState.REDUCE_SCATTERING and grads.spec.dp.replicate_group is not None:
                grads.advance()  # on CPU after its reduce-scatter's wait

    def wait_rest(self) -> None:
        """Wait for every reduction still in flight (they overlapped the rest of backward) and hand the rows out."""
        for step in self.program.reductions:
            step.state.grads.finish()
        self.reducing = []

    @property
    def participants(self) -> list[ShardState]:
        """The units taking part, in the gather path's order."""
        return [step.state for step in self.program.gathers]
