"""The step as a program: the schedule every rank derives, the agreement at each backward's first hook, and the
collectives one forward and one backward issue, in order, per process group.

Every rank derives it from data all ranks hold the same — the units in registration order, their groups and settings,
which parameters train — never from which tensors reached this rank's loss or in which order hooks fired. A backward
then walks it with two cursors (``backward.BackwardWalk``):

- the **gather cursor** goes through ``gather_order`` (the root, then the other units in reverse registration order):
  a unit's backward all-gather is issued when the cursor reaches it, and a unit needed now moves the cursor up to it,
  issuing every all-gather before it on the way;
- the **reduce cursor** goes through ``reduce_order`` (reverse registration order, the root last): a unit's
  reduce-scatter (and HSDP all-reduce) goes out when the cursor reaches it and its gradients are complete here.

Which units take part in a backward is the one thing the graph decides, and it can differ between ranks (a branch
whose output reaches the loss on some ranks only). So it is agreed: at the first hook of a backward every rank
computes which of its units' forward entries this backward will run (autograd says so before it runs them) and the
ranks all-reduce that mask (``start_agreement``, one small collective per backward, its first). A unit
that some rank runs takes part on every rank: the others gather it and reduce zeros for it at its place in the order.
The same collective carries "this rank abandoned the step" (``fc.reset_step`` after an exception on one rank: that
rank walks the backward with zeros, the others raise ``StepAbandoned`` at its end), and, per parameter, whether
autograd will accumulate a gradient into it on this rank: where every trainable parameter of a unit gets one on some
rank, its reduce-scatter needs no "had a gradient" flags (``grads.py``). It stays in flight: a rank reads it at the
first hook only where the answer changes what it issues (``StepContext.begin_backward``), else in the final callback.

A backward's program is compiled at its first hook (``StepContext.begin_backward``) from what every rank holds the
same: the schedule's orders, the units the ranks agreed take part, each unit's settings, and the state the (SPMD)
forward left each unit in. The walk (``backward.BackwardWalk``) then issues exactly that program: each collective it
issues is checked against the next one of its process group, and a mismatch is an internal error naming the rank,
the unit and the position. ``fc.describe_schedule`` prints the same compiler's output for a step that runs every
unit, and the collective checks fingerprint it, so what is printed, what is compared across ranks and what runs are
one list.

Why per process group, not one list: all-gathers, reduce-scatters (a group of their own: ``meshes.
reduce_scatter_group``), replica all-reduces and the step's control all-reduces each go over their own
communicator, where only the relative order within one communicator must match across ranks. Their interleaving
depends on when gradients complete here, which differs between ranks by design (a unit some ranks do not run
reduces zeros at its turn, at once).

Each setting that decides a collective is derived here once (``gathers_in_backward`` and friends), from the
state's own properties: the walk and the printer call the same functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from .collectives import Work, all_reduce_max
from .state import reshards_after_forward
from .unit import UnitState

if TYPE_CHECKING:
    from .meshes import DataParallelMesh
    from .state import ShardState

# A prime below 2**61: the trainability signature fits the agreement's int64 row, negated too.
_SIGNATURE_MODULUS = (1 << 61) - 1

__all__ = [
    "Agreement",
    "Operation",
    "PendingAgreement",
    "Program",
    "ScheduledUnit",
    "StepAbandoned",
    "StepSchedule",
    "agreement_group",
    "backward_program",
    "decide_flag_columns",
    "forward_program",
    "gathers",
    "gathers_in_backward",
    "held_layouts",
    "issue_agreement",
    "participant_orders",
    "start_agreement",
    "unit_names",
]


@dataclass(frozen=True)
class ScheduledUnit:
    """One unit's place in the schedule and the collectives it issues in a step."""

    position: int  # registration order under the root
    state: ShardState
    name: str

    is_root: bool = False

    def collectives(self) -> list[str]:
        """The kinds of collective the unit issues in a step that runs every unit (from program.py)."""
        found = ["all_gather(forward)"] if gathers(self.state) else []
        if gathers_in_backward(self.state, live=False, is_root=self.is_root):
            found.append("all_gather(backward)")
        kinds = {"reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce(replicas)"}
        found += [kinds[op.kind] for op in reductions(self.state, self.name, flagged=True)]
        return found


def unit_names(root_module: nn.Module, states: list[ShardState]) -> dict[int, str]:
    """id(state) -> the unit's module paths under the root (``[a, b]`` for a group): how schedules name units."""
    paths = {id(m): name or "(root)" for name, m in root_module.named_modules()}
    found = {}
    for state in states:
        names = [paths.get(id(m), type(m).__name__) for m in state.modules]
        found[id(state)] = names[0] if len(names) == 1 else "[" + ", ".join(names) + "]"
    return found


class StepSchedule:
    """The units of one root in the orders every rank follows (see the module docstring)."""

    def __init__(self, root: ShardState, states: list[ShardState], names: dict[int, str] | None = None) -> None:
        """``names``: id(state) -> the name to print (module paths; default: the unit's class names)."""
        self.root = root
        named = names or {}
        self.units = [
            ScheduledUnit(i, s, named.get(id(s), s.params.owner_name), s is root) for i, s in enumerate(states)
        ]
        self.names = {id(u.state): u.name for u in self.units}
        self.position = {id(s): i for i, s in enumerate(states)}
        others = [s for s in states if s is not root]
        # The root first: its outputs are the loss's inputs, so its backward hook fires first. It keeps its
        # parameters after forward by default, so its "gather" usually costs nothing.
        self.gather_order: list[ShardState] = [root, *reversed(others)]
        # The root last: its own parameters (embeddings) get their gradients last.
        self.reduce_order: list[ShardState] = [*reversed(others), root]
        # Parameters of all units (trainable or not: the count every rank has, whatever it froze). Fixed: a unit's
        # parameters are moved (a tie) only by fully_shard, before the root's lazy init makes its schedule.
        self.parameters = 0
        for state in states:
            self.parameters += len(state.params.shards.params)

    @property
    def states(self) -> list[ShardState]:
        return [u.state for u in self.units]

    def next_after(self, state: ShardState) -> ShardState | None:
        """The unit after ``state`` in registration order (the implicit forward prefetch target)."""
        index = self.position.get(id(state))
        if index is None or index + 1 >= len(self.units):
            return None
        return self.units[index + 1].state

    def describe(self) -> str:
        lines = ["forward (registration order; each unit all-gathers when first entered):"]
        for u in self.units:
            lines.append(f"  {u.position:>3} {u.name}: {', '.join(u.collectives()) or 'no collective'}")
        names = self.names
        lines.append("backward all-gathers (gather cursor): " + " -> ".join(names[id(s)] for s in self.gather_order))
        lines.append("reductions (reduce cursor): " + " -> ".join(names[id(s)] for s in self.reduce_order))
        lines.append("each backward: one all-reduce of the units it runs (agreed participation), then only those units")
        lines.append("the program of a step that runs every unit (per process group, in issue order):")
        for phase, program in (("forward", forward_program(self)), ("backward", self.full_backward())):
            for group, ops in program.channels.items():
                kinds = ", ".join(dict.fromkeys(op.kind for op in ops))
                lines.append(f"  {phase}, process group {group or '(none)'} ({kinds}):")
                lines += [f"    {index:>3} {op}" for index, op in enumerate(ops)]
        return "\n".join(lines)

    def full_backward(self) -> Program:
        """The program of a backward that every unit takes part in (what a step that runs all of them issues)."""
        size = math.prod(group.size() for group in self.root.params.dp.agreement_groups)
        control = ("data-parallel", size) if size > 1 else None
        return backward_program(self, self.states, live=False, control=control)

    def settings(self) -> list[tuple[str, dict[str, object]]]:
        """Per unit, the settings that decide its collectives in the next step (what the collective checks compare
        and name when ranks differ)."""
        described = []
        for u in self.units:
            state, params = u.state, u.state.params
            mps = params.shards.params
            described.append(
                (
                    f"{u.name} ({params.owner_name})",
                    {
                        "parameters": [mp.fqn for mp in mps],
                        "trainable": [params.current_requires_grad(mp) for mp in mps],
                        "kept whole": [mp.slot is None for mp in mps],
                        "requires_gradient_sync": state.requires_gradient_sync,
                        "gradient_accumulation": state.gradient_accumulation,
                        "requires_all_reduce": state.requires_all_reduce,
                        "reshard_after_forward": state.reshard_after_forward_setting,
                        "reshard_after_backward": state.reshard_after_backward,
                        "compute dtype": str(params.param_dtype),
                        "collectives": u.collectives(),
                    },
                )
            )
        return described

    def fingerprint(self) -> int:
        """64 bits of the settings and the program: ranks with different fingerprints would issue different
        collectives. The one rank check: exchanged at the root's forward (``check_ranks_agree``) and in each
        backward's agreement."""
        ops = [*forward_program(self).operations(), *self.full_backward().operations()]
        text = repr([self.settings(), [str(op) for op in ops]])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


@dataclass(frozen=True)
class Operation:
    """One collective of a step: ``numel`` elements of ``dtype`` (the all-gather's output, the reduce-scatter's
    input, the all-reduced tensor: torch's own conventions), None where an extension decides the size."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "agreement" | "closing_word"
    unit: str
    phase: str  # "forward" | "backward"
    group: str  # the process group's name (``ProcessGroup.group_name``)
    group_size: int
    dtype: torch.dtype
    numel: int | None
    key: int = field(default=0, compare=False, repr=False)  # id() of the unit's state (the root's: the control ops)

    def __str__(self) -> str:
        size = "?" if self.numel is None else str(self.numel)
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.kind}({self.unit}, {self.phase}) over {self.group_size} ranks: {size} x {dtype}"


@dataclass
class Program:
    """Per process group (its name), the collectives in issue order; ``issued`` counts what ran of each."""

    channels: dict[str, list[Operation]] = field(default_factory=dict)
    issued: dict[str, int] = field(default_factory=dict)

    def add(self, operation: Operation) -> None:
        self.channels.setdefault(operation.group, []).append(operation)

    def operations(self) -> list[Operation]:
        """Every operation, channel after channel (each in issue order)."""
        return [op for ops in self.channels.values() for op in ops]

    def check_done(self, where: Callable[[ShardState | None], str]) -> None:
        """The end of the backward: every operation of the program must have been issued (``where``: the rank and
        the step's position, asked only for the error)."""
        left: list[str] = []
        for name, ops in self.channels.items():
            left += map(str, ops[self.issued.get(name, 0) :])
        if left:
            raise RuntimeError(
                f"internal error in fsdp_compose: {where(None)}: the backward ended with operations of its program "
                f"never issued: {'; '.join(left)}; please report it with fc.describe_schedule(model)"
            )

    def expect(self, kind: str, state: ShardState, where: Callable[[ShardState | None], str]) -> None:
        """``state`` just issued a ``kind`` collective: it must be the next operation of one of the program's groups
        (else an internal error naming the rank, the unit and the position)."""
        for name, ops in self.channels.items():
            index = self.issued.get(name, 0)
            if index < len(ops) and ops[index].kind == kind and ops[index].key == id(state):
                self.issued[name] = index + 1
                return
        planned = [
            str(ops[self.issued.get(name, 0)])
            for name, ops in self.channels.items()
            if self.issued.get(name, 0) < len(ops)
        ]
        raise RuntimeError(
            f"internal error in fsdp_compose: {where(state)} issued a {kind} that is not next in the step's program "
            f"(next per process group: {'; '.join(planned) or 'nothing'}); please report it with "
            "fc.describe_schedule(model)"
        )


def gathers(state: ShardState) -> bool:
    """Does the unit's gather move anything between ranks (the flat segment, or its protocol parameters)?"""
    params = state.params
    return params.world_size > 1 and (params.shards.layout.segment_numel > 0 or not params.shards.uniform)


def gathers_in_backward(state: ShardState, *, live: bool, is_root: bool = False) -> bool:
    """Does the unit all-gather when the backward's gather cursor (or a prefetch) reaches it? ``live``: from the
    state its forward left it in (a unit kept gathered, or gathered in another dtype by an eval forward); else from
    its settings (``is_root``: it is the schedule's root), for a step that has not run."""
    if not state.unshard_in_backward or not gathers(state):
        return False
    if not live:
        return reshards_after_forward(state.reshard_after_forward_setting, is_root=is_root)
    gather = state.params
    return gather.needs_gather or gather.compute_dtype != state.compute_dtype(state.modules[0])


def _gather(state: ShardState, name: str, phase: str, *, post_forward: bool) -> Operation:
    params = state.params
    group_reshard = params.post_forward
    group = group_reshard.group if post_forward and group_reshard is not None else params.dp.shard_group
    numel = None  # sized by the gather plan, or by an extension's encode
    if params.shards.uniform and params.extensions.all_gather is None:
        numel = params.world_size * params.shards.layout.segment_numel
    return Operation(
        "all_gather",
        name,
        phase,
        str(group.group_name),
        group.size(),
        state.compute_dtype(state.modules[0]),
        numel,
        id(state),
    )


def forward_program(schedule: StepSchedule) -> Program:
    """The forward all-gathers of a step that enters every unit in registration order (the implicit prefetch's
    order), from sharded units."""
    program = Program()
    for scheduled in schedule.units:
        if gathers(scheduled.state):
            program.add(_gather(scheduled.state, scheduled.name, "forward", post_forward=False))
    return program


def backward_program(
    schedule: StepSchedule,
    participants: list[ShardState],
    *,
    live: bool,
    control: tuple[str, int] | None,
    flags: dict[int, bool] | None = None,
) -> Program:
    """One backward's collectives: the agreement, the backward all-gathers, the reductions, the closing word.

    ``participants``: the units the ranks agreed take part (``schedule.units``' order); ``live``: compiled at the
    backward's first hook from the units' state (else from their settings); ``control``: the agreement's group;
    ``flags``: id(state) -> its reduce-scatter carries "had a gradient" columns (None: none, as where every
    trainable parameter gets a gradient on some rank).
    """
    program = Program()
    control_ops: list[Operation] = []
    if control is not None:
        parameters = schedule.parameters
        group, world = control
        root = schedule.names[id(schedule.root)]
        agreement = agreement_row_size(len(schedule.units), parameters, world)
        control_ops = [
            Operation("agreement", root, "backward", group, world, torch.int64, agreement, id(schedule.root)),
            Operation(
                "closing_word",
                root,
                "backward",
                group,
                world,
                torch.int64,
                agreement_row_size(0, 0, world),
                id(schedule.root),
            ),
        ]
        program.add(control_ops[0])
        if live:
            program.issued[group] = 1  # the agreement went out before its answer could compile this program
    names = schedule.names
    taking_part = set(map(id, participants))
    gather_order, reduce_order = participant_orders(schedule, taking_part)
    # The order the gather cursor and its prefetches reach the participants: the gather order, each unit followed by
    # its explicit ``fc.set_modules_to_backward_prefetch`` targets not reached yet.
    reached: set[int] = set()
    for state in gather_order:
        for target in [state, *(state.backward_prefetch or [])]:
            if id(target) not in taking_part or id(target) in reached:
                continue
            if target is not state and not target.unshard_in_backward:
                continue
            reached.add(id(target))
            if gathers_in_backward(target, live=live, is_root=target is schedule.root):
                gather = target.params
                grouped = gather.state is UnitState.GROUP_SHARDED if live else gather.post_forward is not None
                program.add(_gather(target, names[id(target)], "backward", post_forward=grouped))
    for state in reduce_order:
        for operation in reductions(state, names[id(state)], flagged=False if flags is None else flags[id(state)]):
            program.add(operation)
    for operation in control_ops[1:]:
        program.add(operation)
    return program


def participant_orders(schedule: StepSchedule, taking_part: set[int]) -> tuple[list[ShardState], list[ShardState]]:
    """A backward's participants (``taking_part``: their ids) in the gather cursor's and the reduce cursor's order:
    what the program compiles and what the walk steps through."""
    gather_order = [state for state in schedule.gather_order if id(state) in taking_part]
    reduce_order = [state for state in schedule.reduce_order if id(state) in taking_part]
    return gather_order, reduce_order


def reductions(state: ShardState, name: str, *, flagged: bool) -> list[Operation]:
    """The reduce-scatter (over the shard group's reduce-scatter group) and the HSDP all-reduce over replicas a unit
    issues in a backward that reduces it."""
    params, grads = state.params, state.grads
    if not grads.trainable or not state.reduces_now:
        return []
    found = []
    spec = grads.spec
    width = grads.input.layout.segment_numel + grads.input.rows.tail(flagged)
    if params.world_size > 1:
        group = spec.reduce_group
        found.append(
            Operation(
                "reduce_scatter",
                name,
                "backward",
                str(group.group_name),
                group.size(),
                spec.reduce_dtype,
                width * params.world_size,
                id(state),
            )
        )
    replicas = params.dp.replicate_group
    if replicas is not None and state.requires_all_reduce:
        found.append(
            Operation(
                "all_reduce",
                name,
                "backward",
                str(replicas.group_name),
                replicas.size(),
                spec.reduce_dtype,
                width,
                id(state),
            )
        )
    return found


class StepAbandoned(RuntimeError):
    """Some rank abandoned the step (``fc.reset_step``) while others ran its backward: raised on every rank."""


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed at the start of a backward."""

    participants: list[bool]  # per unit (registration order): some rank runs it in this backward
    gradient_somewhere: list[bool]  # per parameter (units in order, then their params): some rank expects a gradient
    quitting: list[int]  # ranks that abandoned the step
    # per unit: the layout some rank holds partial gradients in (2: with "had a gradient" columns, 1: without, 0: no
    # rank holds any). A window's later buffers must take it on every rank (``decide_flag_columns``).
    held_layout: list[int]
    # The ranks' trainable parameters differ (their signatures, ``issue_agreement``): their reductions would add up the
    # gradients of different parameters where the layouts happen to have the same size. Every rank raises at the end.
    trainability_differs: bool = False


def agreement_group(dp: DataParallelMesh) -> dist.ProcessGroup | None:
    """The one group the agreement is all-reduced over: every data-parallel rank of the root (None: only this one),
    across replicas only where the replicate group is one of c10d's (``DataParallelMesh.agreement_groups``).

    One group, so the all-reduce can stay in flight: with a shard and a replicate group the second all-reduce would
    have to wait for the first one's result on the host (gloo runs each group on its own thread). With both
    dimensions larger than one, the data-parallel mesh flattened: a process group made once, at the root's lazy
    init, which every rank runs at the same point.
    """
    groups = dp.agreement_groups  # a managed replicate group (torchft's) is left to its manager
    if len(groups) <= 1:
        return groups[0] if groups else None
    return dp.mesh._flatten().get_group()


class PendingAgreement:
    """The agreement's all-reduce, issued and maybe still in flight; ``result`` waits for it once and reads it."""

    def __init__(
        self,
        values: torch.Tensor | None,
        work: Work | None,
        reached: list[bool],
        expected: list[bool],
        held: list[int],
        *,
        abandoning: bool,
        checks: bool,
        owner: str,
    ) -> None:
        self.values, self.work = values, work
        self.reached, self.expected, self.held = reached, expected, held
        self.abandoning, self.checks, self.owner = abandoning, checks, owner
        self._result: Agreement | None = None

    @property
    def known(self) -> bool:
        return self._result is not None

    def result(self, also: PendingAgreement | None = None) -> Agreement:
        """Wait for the all-reduce (the host's one wait for it) and decode it. ``also``: another agreement of this
        step still unread, read in the same transfer: on an accelerator each read from the device is a host wait,
        and the end of a backward reads two (the closing word and the backward's agreement) in one.

        Raises ``RuntimeError`` when fingerprints differ (collective checks on): a rank with checks on waits for the
        agreement before any other collective of its backward, so nothing hangs.
        """
        if self._result is None:
            rows = None
            if self.values is not None:
                self.wait()
                if also is not None and also._result is None and also.values is not None:
                    also.wait()
                    rows = torch.cat((self.values, also.values)).tolist()
                    also._result = also._decode(rows[self.values.numel() :])
                    rows = rows[: self.values.numel()]
                else:
                    rows = self.values.tolist()
            self._result = self._decode(rows)
        return self._result

    def wait(self) -> None:
        """Complete the all-reduce (every rank issued it) without reading it: a step that ends without its answer."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def _decode(self, result: list[int] | None) -> Agreement:
        me = dist.get_rank() if dist.is_initialized() else 0
        if result is None:  # this rank is the only data-parallel rank
            return Agreement(self.reached, self.expected, [me] if self.abandoning else [], self.held)
        world = dist.get_world_size()
        masks = len(self.reached) + len(self.expected)
        n = masks + len(self.held)
        quitting = [rank for rank in range(world) if result[n + rank]]
        if self.checks and not quitting and result[n + world] != -result[n + world + 1]:
            raise RuntimeError(
                f"fsdp_compose collective check: the ranks' collective schedules under {self.owner} differ at the "
                "start of a backward (units, trainable parameters, sync or reshard settings); every rank must make "
                "the same changes at the same step. fc.describe_schedule(model) on each rank shows what differs"
            )
        participants = list(map(bool, result[: len(self.reached)]))
        expected = list(map(bool, result[len(self.reached) : masks]))
        # An abandoning rank sends no signature (its reset knows nothing of trainability): only a step nobody
        # abandoned compares them, as with the fingerprints.
        differs = not quitting and result[n + world + 2] != -result[n + world + 3]
        return Agreement(participants, expected, quitting, list(map(int, result[masks:n])), differs)


def agreement_row_size(units: int, parameters: int, world: int) -> int:
    """Elements of the row ``start_agreement`` sends: per unit its participation and held layout, per parameter its
    gradient flag, per rank its abandon flag, then the fingerprint and the trainability signature, each beside its
    negation (the closing word: no unit, no parameter)."""
    return 2 * units + parameters + world + 4


def start_agreement(
    schedule: StepSchedule,
    group: dist.ProcessGroup | None,
    reached: list[bool],
    *,
    abandoning: bool,
    checks: bool,
    expected: list[bool] | None = None,
    held: list[int] | None = None,
    trained: int = 0,
) -> PendingAgreement:
    """Issue the all-reduce (MAX) of this rank's participation mask, the parameters it expects gradients for
    (``expected``, one per ``StepSchedule.parameters``; None: none), the layout it holds partial gradients in per unit
    (``held``, ``Agreement.held_layout``; None: none), whether it abandons the step, (with collective checks) the
    schedule's fingerprint, and ``trained`` (a signature of which parameters train), over ``group``
    (``agreement_group``). Nothing waits for it here."""
    expected = expected if expected is not None else [False] * schedule.parameters
    held = held if held is not None else [0] * len(schedule.units)
    owner = schedule.root.params.owner_name
    if group is None:
        return PendingAgreement(None, None, reached, expected, held, abandoning=abandoning, checks=checks, owner=owner)
    world = dist.get_world_size()
    fingerprint = schedule.fingerprint() if checks else 0
    # [mask..., abandoning ranks..., fingerprint, -fingerprint, trained, -trained]: one MAX gives the union, the set
    # of ranks that abandon, and whether every fingerprint (and signature) was equal (max == -max(-x) only then).
    flags = [0] * world
    if abandoning:
        flags[dist.get_rank()] = 1
    row = [*map(int, reached), *map(int, expected), *held, *flags, fingerprint, -fingerprint, trained, -trained]
    # Built in page-locked memory where the device is an accelerator: a copy from pageable memory would make the
    # host wait for every kernel queued before it (the whole forward, at the start of a backward).
    device = schedule.root.device
    values = torch.tensor(row, dtype=torch.int64, pin_memory=device.type != "cpu").to(device, non_blocking=True)
    work = all_reduce_max(values, group, async_op=True)
    return PendingAgreement(values, work, reached, expected, held, abandoning=abandoning, checks=checks, owner=owner)


def issue_agreement(
    schedule: StepSchedule,
    states: list[ShardState],
    group: dist.ProcessGroup | None,
    reached: list[bool],
    *,
    gradients_held: bool,
) -> tuple[PendingAgreement, Agreement | None]:
    """Issue a backward's agreement over ``group`` (``reached``: the units this rank runs in it; ``states``: the
    schedule's, in registration order; ``gradients_held``: inside an accumulation window), and this rank's own answer
    where it is the union (None: read the agreement now, since the answer changes what this rank issues)."""
    # Per parameter: will this rank have a gradient for it (its unit's reduce-scatter needs no flags when some rank
    # will, for every trainable parameter of the unit)
    checks = any(state.collective_checks for state in states)
    expected = []
    # Does user code act on a gradient as soon as it is delivered (an optimizer step in backward, a
    # post-accumulate-grad hook)? Then a delivery cannot wait for the final callback: the agreement is read first.
    acts_on_delivery = any(state.grads.delivery.on_finished is not None for state in states)
    # Which parameters train, as a number every rank compares in the agreement (a polynomial over the flags): ranks
    # that froze different parameters of equal size would otherwise reduce-scatter them into each other, silently.
    trained = 0
    trainable = []
    for state in states:
        for mp in state.params.shards.params:
            trained = (trained * 3 + 1 + mp.trainable) % _SIGNATURE_MODULUS
            expected.append(mp.trainable and state.grads.input.expects_gradient(mp))
            trainable.append(mp.trainable)
            if mp.trainable and getattr(mp.sharded, "_post_accumulate_grad_hooks", None):
                acts_on_delivery = True
    every_gradient = all(got or not train for got, train in zip(expected, trainable, strict=True))
    held = held_layouts(states)
    pending = start_agreement(
        schedule,
        group,
        reached,
        abandoning=False,
        checks=checks,
        expected=expected,
        held=held,
        trained=trained,
    )
    # Inside an accumulation window a rank holding nothing for a unit takes the layout other ranks hold it in.
    layouts_known = not gradients_held or all(
        layout or not state.grads.trainable for layout, state in zip(held, states, strict=True)
    )
    if not checks and all(reached) and every_gradient and layouts_known and not acts_on_delivery:
        return pending, Agreement(reached, expected, [], held)
    return pending, None


def held_layouts(states: list[ShardState]) -> list[int]:
    """Per unit, the layout this rank holds partial gradients in (``Agreement.held_layout``)."""
    layouts = [state.grads.held_layout() for state in states]
    return [0 if held is None else 2 if held else 1 for held in layouts]


def decide_flag_columns(states: list[ShardState], agreed: Agreement) -> None:
    """A unit whose every trainable parameter gets a gradient on some rank reduces without "had a gradient" flags;
    inside an accumulation window every rank takes the layout some rank already holds (it was decided at the
    window's first backward, when every rank decided alike, but a rank that got no gradient then holds nothing)."""
    gradient_somewhere = iter(agreed.gradient_somewhere)
    for state, layout in zip(states, agreed.held_layout, strict=True):
        got = [next(gradient_somewhere) for _ in state.params.shards.params]
        needed = any(mp.trainable and not some for mp, some in zip(state.params.shards.params, got, strict=True))
        state.grads.input.flags_needed = needed if layout == 0 else layout == 2
