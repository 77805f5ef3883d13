"""The step as a program: the schedule every rank derives, and the collectives one forward and one backward issue,
in order, per process group.

Every rank derives it from data all ranks hold the same — the units in registration order, their groups and settings,
which parameters train — never from which tensors reached this rank's loss or in which order hooks fired. Which units
take part in a backward is agreed at its first hook (agreement.py); the backward's program is compiled from that answer
and from the state the (SPMD) forward left each unit in, and the walk (``backward.BackwardWalk``) runs it: its two
cursors index the program's two paths.

- ``Program.gathers``, the **gather path**: the participants in the gather order (the root, then the other units in
  reverse registration order), each followed by its explicit ``fc.set_modules_to_backward_prefetch`` targets not
  reached yet; each step says whether its unit all-gathers, and over which group. The gather cursor issues a step's
  all-gather when it passes it, and a unit needed now moves the cursor up to it;
- ``Program.reductions``, the **reduce path**: the participants in reverse registration order, the root last; each
  step says whether the unit reduces (its reduce-scatter and HSDP all-reduce) or accumulates. The reduce cursor issues
  a step's reductions when it reaches it and the unit's gradients are complete here.

The walk decides only *when* (prefetch points, the reduce-scatter window, gradients completing); *what* and *in which
order* are the program's. A unit whose live state disagrees with its step (an all-gather the step does not list, or
none where it lists one) is an internal error naming the rank, the unit and the position. ``fc.describe_schedule``
prints the same compiler's output for a step that runs every unit, and the collective checks fingerprint it, so what
is printed, what is compared across ranks and what runs are one list.

Why per process group (``Program.channels``), not one list: all-gathers, reduce-scatters (a group of their own:
``meshes.reduce_scatter_group``), replica all-reduces and the step's control all-reduces each go over their own
communicator, where only the relative order within one communicator must match across ranks. Their interleaving
depends on when gradients complete here, which differs between ranks by design (a unit some ranks do not run
reduces zeros at its turn, at once).

Each setting that decides a collective is derived here once (``gathers_in_backward`` and friends), from the
state's own properties: the walk and the printer read the same steps.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .state import reshards_after_forward
from .unit import UnitState

if TYPE_CHECKING:
    from .state import ShardState

__all__ = [
    "GatherStep",
    "Operation",
    "Program",
    "ReduceStep",
    "ScheduledUnit",
    "StepSchedule",
    "agreement_row_size",
    "backward_program",
    "forward_program",
    "gathers",
    "gathers_in_backward",
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
        name = names[0] if len(names) == 1 else "[" + ", ".join(names) + "]"
        found[id(state)] = f"{name} {state.mesh_label}" if state.mesh_label else name
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


@dataclass(frozen=True)
class GatherStep:
    """One unit on a backward's gather path (the module docstring)."""

    state: ShardState
    operation: Operation | None  # its backward all-gather; None: nothing goes between ranks
    placed: bool  # an explicit prefetch target of the step before it: issued by that step's prefetch


@dataclass(frozen=True)
class ReduceStep:
    """One unit on a backward's reduce path."""

    state: ShardState
    reduces: bool  # its gradients are reduced in this backward (else accumulated): ``ShardState.reduces_now``
    replicas: bool  # HSDP: all-reduced over replicas after the reduce-scatter (``requires_all_reduce``)
    synchronising: bool  # ``requires_gradient_sync``
    operations: list[Operation]  # its reduce-scatter and replica all-reduce (none: one rank, or nothing trainable)


@dataclass
class Program:
    """Per process group (its name), the collectives in issue order; for a backward, the two paths its walk runs."""

    channels: dict[str, list[Operation]] = field(default_factory=dict)
    gathers: list[GatherStep] = field(default_factory=list)
    reductions: list[ReduceStep] = field(default_factory=list)

    def add(self, operation: Operation) -> None:
        self.channels.setdefault(operation.group, []).append(operation)

    def operations(self) -> list[Operation]:
        """Every operation, channel after channel (each in issue order)."""
        return [op for ops in self.channels.values() for op in ops]


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
    params = state.params
    return params.needs_gather or params.compute_dtype != state.compute_dtype(state.modules[0])


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
    """One backward: its collectives (the agreement, the backward all-gathers, the reductions, the closing word) and
    the two paths its walk runs.

    ``participants``: the units the ranks agreed take part; ``live``: compiled at the backward's first hook from the
    units' state (else from their settings); ``control``: the agreement's group; ``flags``: id(state) -> its
    reduce-scatter carries "had a gradient" columns (None: none, as where every trainable parameter gets a gradient
    on some rank).
    """
    program = Program()
    names = schedule.names
    taking_part = set(map(id, participants))
    closing: Operation | None = None
    if control is not None:
        group, world = control
        root, key = names[id(schedule.root)], id(schedule.root)
        agreement = agreement_row_size(len(schedule.units), schedule.parameters, world)
        program.add(Operation("agreement", root, "backward", group, world, torch.int64, agreement, key))
        closing = Operation(
            "closing_word", root, "backward", group, world, torch.int64, agreement_row_size(0, 0, world), key
        )
    reached: set[int] = set()
    for state in schedule.gather_order:
        if id(state) not in taking_part:
            continue
        targets = [t for t in state.backward_prefetch or [] if id(t) in taking_part and t.unshard_in_backward]
        for target in [state, *targets]:
            if id(target) in reached:
                continue
            reached.add(id(target))
            operation = None
            if gathers_in_backward(target, live=live, is_root=target is schedule.root):
                params = target.params
                grouped = params.state is UnitState.GROUP_SHARDED if live else params.post_forward is not None
                operation = _gather(target, names[id(target)], "backward", post_forward=grouped)
                program.add(operation)
            program.gathers.append(GatherStep(target, operation, placed=target is not state))
    for state in schedule.reduce_order:
        if id(state) not in taking_part:
            continue
        operations = reductions(state, names[id(state)], flagged=False if flags is None else flags[id(state)])
        for operation in operations:
            program.add(operation)
        program.reductions.append(
            ReduceStep(state, state.reduces_now, state.requires_all_reduce, state.requires_gradient_sync, operations)
        )
    if closing is not None:
        program.add(closing)
    return program


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
    replicas = params.dp.reduce_replicas
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


def agreement_row_size(units: int, parameters: int, world: int) -> int:
    """Elements of the row ``start_agreement`` sends: per unit its participation and held layout, per parameter its
    gradient flag, per rank its abandon flag, then the fingerprint and the trainability signature, each beside its
    negation (the closing word: no unit, no parameter)."""
    return 2 * units + parameters + world + 4
