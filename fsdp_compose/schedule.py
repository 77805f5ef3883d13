"""The declared collective schedule of one root: which collectives a step issues, in which order, on every rank.

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
ranks all-reduce that mask (``agree_on_backward``, one small collective per backward, before any other of it). A unit
that some rank runs takes part on every rank: the others gather it and reduce zeros for it at its place in the order.
The same collective carries "this rank abandoned the step" (``fc.reset_step`` after an exception on one rank), so
every rank raises the same error instead of waiting for collectives that will never come, and, per parameter, whether
autograd will accumulate a gradient into it on this rank: where every trainable parameter of a unit gets one on some
rank, its reduce-scatter needs no "had a gradient" flags (``grads.py``).

``describe_schedule(model)`` prints the schedule of a sharded model before it runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .collectives import all_reduce_max

if TYPE_CHECKING:
    from .state import ShardState

__all__ = ["StepAbandoned", "StepSchedule", "agree_on_backward"]


class StepAbandoned(RuntimeError):
    """Some rank abandoned the step (``fc.reset_step``) while others ran its backward: raised on every rank."""


@dataclass(frozen=True)
class ScheduledUnit:
    """One unit's place in the schedule and the collectives it issues in a step."""

    position: int  # registration order under the root
    state: ShardState
    name: str

    is_root: bool = False

    def collectives(self) -> list[str]:
        state, unit = self.state, self.state.unit
        gathers = unit.world_size > 1 and unit.layout.segment_numel > 0
        setting = state.reshard_after_forward_setting
        reshards = (not self.is_root) if setting is None else bool(setting)
        found = []
        if gathers:
            found.append("all_gather(forward)")
            if reshards:
                found.append("all_gather(backward)")
        if unit.grads.trainable and state.reduces_now and unit.world_size > 1:
            found.append("reduce_scatter")
        if unit.grads.trainable and unit.dp.replicate_group is not None and state.requires_all_reduce:
            found.append("all_reduce(replicas)")
        return found


class StepSchedule:
    """The units of one root in the orders every rank follows (see the module docstring)."""

    def __init__(self, root: ShardState, states: list[ShardState], names: dict[int, str] | None = None) -> None:
        """``names``: id(state) -> the name to print (module paths; default: the unit's class names)."""
        self.root = root
        named = names or {}
        self.units = [ScheduledUnit(i, s, named.get(id(s), s.unit.owner_name), s is root) for i, s in enumerate(states)]
        self._names = {id(u.state): u.name for u in self.units}
        self.position = {id(s): i for i, s in enumerate(states)}
        others = [s for s in states if s is not root]
        # The root first: its outputs are the loss's inputs, so its backward hook fires first. It keeps its
        # parameters after forward by default, so its "gather" usually costs nothing.
        self.gather_order: list[ShardState] = [root, *reversed(others)]
        # The root last: its own parameters (embeddings) get their gradients last.
        self.reduce_order: list[ShardState] = [*reversed(others), root]

    def parameter_count(self) -> int:
        """Parameters of all units (trainable or not: the count every rank has, whatever it froze)."""
        return sum(len(u.state.unit.params) for u in self.units)

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
        names = self._names
        lines.append("backward all-gathers (gather cursor): " + " -> ".join(names[id(s)] for s in self.gather_order))
        lines.append("reductions (reduce cursor): " + " -> ".join(names[id(s)] for s in self.reduce_order))
        lines.append("each backward: one all-reduce of the units it runs (agreed participation), then only those units")
        return "\n".join(lines)

    def fingerprint(self) -> int:
        """64 bits of the schedule: ranks with different fingerprints would issue different collectives."""
        text = repr([(u.name, u.collectives()) for u in self.units])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed at the start of a backward."""

    participants: list[bool]  # per unit (registration order): some rank runs it in this backward
    gradient_somewhere: list[bool]  # per parameter (units in order, then their params): some rank expects a gradient
    quitting: list[int]  # ranks that abandoned the step


def agree_on_backward(
    schedule: StepSchedule,
    reached: list[bool],
    *,
    abandoning: bool,
    checks: bool,
    expected: list[bool] | None = None,
) -> Agreement:
    """All-reduce (MAX) this rank's participation mask, the parameters it expects gradients for (``expected``, one
    per ``parameter_count``; None: none), whether it abandons the step, and (with collective checks) the schedule's
    fingerprint, over the root's data-parallel groups.

    Raises ``RuntimeError`` on every rank when fingerprints differ (collective checks on): before any collective of
    the backward, so nothing hangs.
    """
    root = schedule.root
    dp = root.unit.dp
    groups = [g for g in (dp.shard_group, dp.replicate_group) if g is not None and dist.get_world_size(g) > 1]
    expected = expected if expected is not None else [False] * schedule.parameter_count()
    if not groups:
        return Agreement(reached, expected, [0] if abandoning else [])
    world = dist.get_world_size()
    me = dist.get_rank()
    n = len(reached) + len(expected)
    fingerprint = schedule.fingerprint() if checks else 0
    # [mask..., abandoning ranks..., fingerprint, -fingerprint]: one MAX gives the union, the set of ranks that
    # abandon, and whether every fingerprint was equal (max == -max(-x) only when all are equal).
    flags = [0] * world
    if abandoning:
        flags[me] = 1
    row = [*map(int, reached), *map(int, expected), *flags, fingerprint, -fingerprint]
    values = torch.tensor(row, dtype=torch.int64, device=root.device)
    for group in groups:
        all_reduce_max(values, group)
    if is_fake(values):
        # The planner simulates one rank of identical ones (FakeTensorMode, fake process group): what this rank
        # runs is what every rank runs.
        return Agreement(reached, expected, [me] if abandoning else [])
    result = values.tolist()
    quitting = [rank for rank in range(world) if result[n + rank]]
    if checks and not quitting and result[n + world] != -result[n + world + 1]:
        raise RuntimeError(
            f"fsdp_compose collective check: the ranks' collective schedules under {root.unit.owner_name} differ at "
            "the start of a backward (units, trainable parameters, sync or reshard settings); every rank must make "
            "the same changes at the same step. fc.describe_schedule(model) on each rank shows what differs"
        )
    participants = [bool(v) for v in result[: len(reached)]]
    return Agreement(participants, [bool(v) for v in result[len(reached) : n]], quitting)
