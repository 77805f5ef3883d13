"""One training step of one root: the owner of the step, walking the declared schedule (program.py).

The root's ``ShardState`` owns a ``StepContext``; every state under the root points at it (``state.step``). One step,
top to bottom (every collective named here is read from the schedule, never chosen by which hook fired first)::

    root pre-forward   begin_forward: finish what the last step left, check ranks agree (opt-in), refresh
                       trainability, move inputs
    unit pre-forward   gather the unit if it is not gathered (a unit may be entered any number of times, wholly or
                       one module at a time); prefetch the next unit in registration order
    unit post-forward  outputs that need grad get the unit's pre-backward node (a ForwardCall); the unit closes
                       (reshards per reshard_after_forward) when every module of it ran, or at the root's end of
                       forward
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
import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import Variable
from torch.autograd.graph import Node
from torch.utils._pytree import tree_map

from .agreement import (
    Agreement,
    PendingAgreement,
    StepAbandoned,
    agreement_group,
    decide_flag_columns,
    held_layouts,
    issue_agreement,
    start_agreement,
)
from .backward import BackwardWalk
from .checks import check_ranks_agree
from .collectives import labelled, side_stream, wait_for_compute
from .grads import GradState
from .program import Program, StepSchedule, backward_program, unit_names

if TYPE_CHECKING:
    from .state import ForwardCall, ShardState

logger = logging.getLogger(__name__)

__all__ = ["StepContext", "StepPhase"]


class StepPhase(enum.Enum):
    """Where the root's step is (``StepContext.phase``, written only by the step)."""

    IDLE = "idle"
    FORWARD = "forward"
    AWAITING_BACKWARD = "awaiting_backward"  # a forward with outputs that need grad ended; no backward finished since
    BACKWARD = "backward"


class StepContext:
    """Per-root state of the current step (see the module docstring)."""

    def __init__(self, root: ShardState, states: list[ShardState]) -> None:
        self.root = root
        self.states = states  # every state under the root, pre-order (registration order)
        self.schedule = StepSchedule(root, states, unit_names(root.modules[0], states))
        self.phase = StepPhase.IDLE
        self.backward: BackwardWalk | None = None
        self.programs: list[Program] = []  # the programs of this step's backwards, as compiled (program.py)
        # This backward's agreement (program.py), until the final callback reads it; the group it goes over.
        self.agreement: PendingAgreement | None = None
        self.agreement_group = agreement_group(root.params.dp)
        # The step already ended on every rank (this rank raised StepAbandoned, or its fc.reset_step met the others
        # in the agreement): another fc.reset_step has nothing left to do, on any rank.
        self.ended_everywhere = False
        self.calls_seen = 0  # forward calls of units so far (their order: see _build_walk's wait_after)
        self.forward_raised = False  # the last root forward raised: its remaining all-gathers were never issued
        # The last backward left no-sync gradients in accumulation buffers (decided from settings, so it is the same
        # on every rank), and the backward that reduces them "drains" the window (see begin_backward).
        self.gradients_held = False
        self.draining = False
        # All-gather copy-in and issue overlap compute on this side stream (None on a CPU device: collectives.py).
        self.gather_stream = side_stream(root.device)
        # The walk's waits take the accelerator's side (backward.BackwardWalk). Derived from the device; the tests set
        # it on a CPU root to run that side on gloo, where each wait blocks the host: stricter than a stream wait, so
        # a wait cycle between ranks' streams shows as a hang there.
        self.accelerated = root.device.type != "cpu"

    def next_call_number(self) -> int:
        self.calls_seen += 1
        return self.calls_seen

    def _where(self, state: ShardState | None = None) -> str:
        """Rank, unit and schedule position, for internal errors."""
        rank = self.root.params.dp.shard_rank
        bp = self.backward
        position = "" if bp is None else f", gather cursor {bp.gather_cursor}, reduce cursor {bp.reduce_cursor}"
        unit = (
            ""
            if state is None
            else f" unit {state.params.owner_name} (position {self.schedule.position.get(id(state))})"
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
        self.ended_everywhere = False
        for state in self.states:
            state.record.entries = [entry for entry in state.record.entries if entry.alive()]  # graphs nobody runs
        pending = any(state.record.entries for state in self.states)
        if any(state.collective_checks for state in self.states):
            check_ranks_agree(self.schedule, self.agreement_group)  # before anything of this step communicates
        continuing = self.phase is StepPhase.AWAITING_BACKWARD and pending
        self.forward_raised = False
        for state in self.states:
            state.begin_step(continuing=continuing)
        # The side stream's all-gathers read the shards, which the optimizer (and any re-layout above) wrote on the
        # compute stream: it waits for them once here, not at every gather (gathers outside a step wait themselves).
        if self.gather_stream is not None:
            wait_for_compute(self.gather_stream, self.root.device)
        self.phase = StepPhase.FORWARD
        self.programs = self.programs if continuing else []
        if self.root.device.type != "cpu":
            # Blocking, like DDP: a caller may refill a pinned host batch right after model(x) returns.
            args, kwargs = tree_map(functools.partial(_to_device, self.root.device), (args, kwargs))
        return args, kwargs

    def prefetch_forward(self, state: ShardState) -> None:
        """``state`` was opened for forward: prefetch the next unit in registration order (or the list of
        ``fc.set_modules_to_forward_prefetch``), unless this forward runs inside a backward (a recompute, whose
        gathers the walk orders)."""
        if self.backward is not None:
            return
        following = self.schedule.next_after(state)
        implicit = [] if following is None else [following]
        for target in implicit if state.forward_prefetch is None else state.forward_prefetch:
            if not target.record.opened:
                target.start_gather(async_op=True, after_writes=self.phase is StepPhase.IDLE)

    def end_forward(self, *, raised: bool = False) -> None:
        """The root's forward returned (or ``raised``): close units still open (a group only partly run, or run
        outside the root's forward), then wait for a backward if any output needs one."""
        if self.phase is not StepPhase.FORWARD:
            return
        self.forward_raised = raised
        for state in self.states:
            if state.record.active == 0:
                state.close_opening()
        pending = any(state.record.entries for state in self.states)
        self.phase = StepPhase.AWAITING_BACKWARD if pending else StepPhase.IDLE

    # ------------------------------------------------------------------ backward
    def begin_backward(self, running: object = None) -> None:
        """The first pre-backward of a backward (``running``: its node): issue the agreement on its participants,
        build the walk, queue the final callback. The answer is read here only where it changes what this rank
        issues (docs/schedule.md, "When the host waits for it"); else this rank's own answer is the union, and the
        final callback reads it (did a rank abandon the step?) before any gradient is handed out."""
        if self.backward is not None:
            return
        # The calls of each unit this backward runs here (autograd is asked once per call).
        running_calls = {
            id(state): [e for e in (*state.record.entries, *state.record.ran) if e.runs_in_this_backward(running)]
            for state in self.states
        }
        reached = [bool(running_calls[id(state)]) for state in self.states]
        pending, agreed = issue_agreement(
            self.schedule, self.states, self.agreement_group, reached, gradients_held=self.gradients_held
        )
        read = agreed is None  # this rank's own answer is not the union: the agreement is read now
        if agreed is None:
            try:
                agreed = pending.result()
            except RuntimeError:
                self.abandon(agreed=True)  # every rank raises here: nothing of this backward was issued
                raise
        self.agreement = pending
        # Until the final callback knows no rank abandoned the step, reduced rows wait there (delivery.py).
        hold = not read or bool(agreed.quitting) or agreed.trainability_differs
        for state in self.states:
            state.grads.delivery.hold = hold
        decide_flag_columns(self.states, agreed)
        for state in self.states:
            state.record.recomputes_due = sum(entry.inputs is not None for entry in running_calls[id(state)])
        walk = self.backward = self._build_walk(agreed.participants, running_calls, live=True)
        self.programs.append(walk.program)
        self.phase = StepPhase.BACKWARD
        Variable._execution_engine.queue_callback(self._final_callback)

    # ------------------------------------------------------------------ the end of a step
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
            bp.issue_rest()
            # Read before the waits for the reductions in flight: on an accelerator the host then waits for the
            # backward's compute and this small all-reduce only, and the optimizer's kernels queue behind the rest.
            word = self._closing_word(abandoning=False).result(also=self.agreement)
            agreed = self.agreement.result() if self.agreement is not None else None  # read with the word
            self.agreement = None
            quitting = agreed.quitting if agreed is not None else []
            quitting += word.quitting
            owner = self.root.params.owner_name
            error: RuntimeError | None = None
            if quitting:
                error = StepAbandoned(
                    f"fsdp_compose: rank(s) {quitting} abandoned this step (fc.reset_step) while this rank ran its "
                    f"backward under {owner}: no gradient of it is kept on any rank. Skip the step (fc.reset_step "
                    "here does nothing more); the next forward starts a new one"
                )
            elif agreed is not None and agreed.trainability_differs:
                error = RuntimeError(
                    f"fsdp_compose: the ranks train different parameters under {owner} (their requires_grad differ): "
                    "their reductions would mix the gradients of different parameters, so no gradient of this step "
                    "is kept on any rank. Freeze and unfreeze the same parameters on every rank at the same step; "
                    "fc.set_collective_checks(model, True) names the unit and the parameters that differ, at the "
                    "next forward"
                )
            if error is not None:
                # Every rank has issued this backward's collectives: complete them and drop what they reduced.
                self.abandon(agreed=True)
                self.ended_everywhere = True
                raise error
            bp.wait_rest()
            for state in self.states:
                state.grads.input.flags_needed = True  # what reduces outside a backward cannot know who has what
                state.grads.delivery.hold = False
                state.record.recomputes_due = 0
            for state in bp.participants:
                state.end_backward(bp.consumed)
            # Calls no backward has run yet (pipelined micro-batches, the body under a chunked loss) keep the step
            # waiting for theirs.
            pending = any(state.record.entries for state in self.states)
            self.gradients_held = any(state.grads.state is GradState.ACCUMULATING for state in self.states)
            self.draining = False
            self.backward = None
            self.phase = StepPhase.AWAITING_BACKWARD if pending else StepPhase.IDLE

    def abandon(self, *, agreed: bool = False) -> None:
        """A step that never reached its final callback (it raised, or ``fc.reset_step``): drop its gradients.

        Inside a backward, every rank first completes the whole agreed order: the remaining backward all-gathers,
        then every reduction, staged with whatever is there, waited for and thrown away. Then the gradients held
        but not delivered are dropped (partial: the failed micro-batch's are mixed in) and every unit is resharded.
        ``agreed``: the participants' agreement already told every rank (nothing of the backward was issued).
        """
        logger.warning(
            "%s: the step did not finish (an exception, or fc.reset_step): gradients not yet in .grad are dropped",
            self.root.params.owner_name,
        )
        for state in self.states:
            state.grads.dropping = True
            for mp in state.params.shards.params:
                if mp.full is not None:
                    mp.full.grad = None  # partial; the reductions below carry zeros in their place
        walk = self.backward if not agreed else None
        if walk is not None:
            walk.issue_rest()
            # The others raise StepAbandoned at the end of their backward.
            word = self._closing_word(abandoning=True)
            walk.wait_rest()
            word.wait()
            self.ended_everywhere = True
        if self.agreement is not None:
            self.agreement.wait()  # issued by every rank: completed by every rank, its answer unused
        self.agreement = None
        for state in self.states:
            state.grads.delivery.hold = False
            state.grads.discard()
            state.forget_step()
        self.gradients_held = False
        self.draining = False
        self.backward = None
        self.phase = StepPhase.IDLE

    def _closing_word(self, *, abandoning: bool) -> PendingAgreement:
        """Issue the word that tells which ranks abandoned this backward after its agreement (an exception inside it,
        then ``fc.reset_step``): one small all-reduce, issued by every rank once its walk has issued everything, before
        the waits, so it overlaps them (docs/schedule.md, "The end of a step")."""
        return start_agreement(
            self.schedule, self.agreement_group, [], abandoning=abandoning, checks=False, expected=[], held=[]
        )

    def _build_walk(
        self, participants: list[bool], running_calls: dict[int, list[ForwardCall]], *, live: bool
    ) -> BackwardWalk:
        """The walk of one backward through its program, compiled from the agreed participants and (``live``) the state
        the forward left the units in, else their settings; ``running_calls``: what this rank runs. Each unit's record
        gets this backward's facts about it (``UnitStepRecord.forget_backward``)."""
        taking_part = [state for state, takes in zip(self.states, participants, strict=True) if takes]
        flags = {id(state): state.grads.next_layout() for state in taking_part}
        group = self.agreement_group
        control = None if group is None else (str(group.group_name), group.size())
        program = backward_program(self.schedule, taking_part, live=live, control=control, flags=flags)
        path = [step.state for step in program.gathers]
        reached = False
        consumed: set[int] = set()
        for state in self.states:
            record = state.record
            record.forget_backward(wait_after=len(path))
            calls = running_calls.get(id(state))
            if calls:
                # Post-backward hooks it waits for here. A call whose inputs need no gradient has none (its backward's
                # end is not observable): such a unit finishes in the final callback.
                observable = all([entry.post_backward_runs() for entry in calls])  # each counts its input nodes
                consumed.update(map(id, calls))
                reached = True
                record.reached_here = True
                record.calls_here = len(calls)
                record.awaiting = len(calls) if observable else -1
        first: list[int] = []  # per step of the gather path: the order of its unit's first and last forward call
        last: list[int] = []
        for position, state in enumerate(path):
            record = state.record
            record.position = position
            seqs = [entry.seq for entry in (*record.entries, *record.ran)]
            first.append(min(seqs, default=-1))
            last.append(max(seqs, default=-1))
        # Per participant ``v``: the last gather position among ``v`` and every participant with a forward call after
        # ``v``'s first one (its backward may come before ``v``'s gradients are complete, on any rank).
        for index, state in enumerate(path):
            if first[index] < 0:
                continue  # no call recorded here: wait only once every gather is out (forget_backward's default)
            wait_after = index
            for position in range(index + 1, len(path)):
                if last[position] > first[index]:
                    wait_after = position
            state.record.wait_after = wait_after
        self.draining = self.gradients_held and any(step.reduces for step in program.reductions)
        return BackwardWalk(
            program=program,
            consumed=consumed,
            draining=self.draining,
            max_reduce_inputs=self.root.max_reduce_inputs,
            accelerated=self.accelerated,
            where=self._where,
            graph_task=torch._C._current_graph_task_id() if reached and not _recomputes_inside(running_calls) else None,
        )

    def _zero_walk(self, agreed: Agreement, *, replayed: bool) -> BackwardWalk:
        """The walk of the others' backward, for this rank to complete with zeros.

        After a loss that raised here the units are where the others' are at the start of their backward (the same
        forward ran). After a forward that raised here (``replayed``), they are put where the others' finished
        forward leaves them: resharded where they reshard after forward (their backward all-gather comes in the
        walk); kept where they keep their parameters: the program is then compiled from the settings, as the others'
        forward left their units, so it lists no backward all-gather for those, also where this rank's failed forward
        freed them."""
        if replayed:
            for state in self.states:
                if state.reshard_after_forward and not state.params.explicit:
                    state.params.reshard()
        decide_flag_columns(self.states, agreed)
        return self._build_walk(agreed.participants, {}, live=not replayed)

    def reset(self) -> None:
        """``fc.reset_step``: forget the current step (held no-sync gradients too) and reshard every unit.

        Other ranks may be running this step's backward (this rank raised in its loss or forward): this rank joins
        its agreement as abandoning, walks it with zeros and returns; they raise ``StepAbandoned`` at its end."""
        if self.ended_everywhere:  # until the next forward
            self._forget()
            return
        replayed = self.forward_raised and self.backward is None
        if replayed:
            # This rank's forward stopped at an exception; the others (if it raised here only) go on through theirs:
            # issue the forward all-gathers they issue after that point, in registration order.
            for state in self.states:
                if not state.record.entered and state.params.needs_gather and not state.params.explicit:
                    state.gather_now(after_writes=self.phase is StepPhase.IDLE)
            self.forward_raised = False
        if self.backward is None:
            # Every rank calls reset_step at the same point, or this rank alone while the others run the backward
            # of the step it abandons: either way they meet in the backward's agreement, and the step then ends on
            # every rank (another reset_step has nothing left to do).
            reached = [False] * len(self.states)
            held = held_layouts(self.states)
            pending = start_agreement(
                self.schedule, self.agreement_group, reached, abandoning=True, checks=False, held=held
            )
            agreed = pending.result()
            if any(agreed.participants):
                self.backward = self._zero_walk(agreed, replayed=replayed)
            self.ended_everywhere = True
        if self.backward is not None or any(s.grads.has_pending() for s in self.states):
            self.abandon()
        self._forget()

    def _forget(self) -> None:
        for state in self.states:
            state.forget_step()
        self.backward = None
        self.phase = StepPhase.IDLE


def _to_device(device: torch.device, value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value


def _recomputes_inside(running_calls: dict[int, list[ForwardCall]]) -> bool:
    """Does this backward run a reentrant activation checkpoint (``torch.utils.checkpoint(use_reentrant=True)``,
    or Megatron's or DeepSpeed's, which share the name ``CheckpointFunction``)?

    Its recompute reads the parameters of the modules it runs from the modules themselves, with no edge of the graph
    to order it before their gradients: such a backward frees no parameter early (``BackwardWalk._frees_early``).
    A unit called inside the checkpoint is seen by its entry; a checkpoint inside a unit's forward by the graph
    below the units' outputs, walked once.
    """
    stack: list[Node] = []
    for calls in running_calls.values():
        for entry in calls:
            if entry.inputs is not None or entry.anchor is not None:
                return True
            for ref in entry.pre:
                node = ref()
                if node is not None:
                    stack.append(node)
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        for following, _ in node.next_functions:
            if following is not None:
                stack.append(following)
    return False
