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
ranks all-reduce that mask (``start_agreement``, one small collective per backward, its first). A unit
that some rank runs takes part on every rank: the others gather it and reduce zeros for it at its place in the order.
The same collective carries "this rank abandoned the step" (``fc.reset_step`` after an exception on one rank: that
rank walks the backward with zeros, the others raise ``StepAbandoned`` at its end), and, per parameter, whether
autograd will accumulate a gradient into it on this rank: where every trainable parameter of a unit gets one on some
rank, its reduce-scatter needs no "had a gradient" flags (``grads.py``). It stays in flight: a rank reads it at the
first hook only where the answer changes what it issues (``StepContext.begin_backward``), else in the final callback.

``describe_schedule(model)`` prints the schedule of a sharded model before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from .collectives import Work, all_reduce_max
from .program import StepSchedule

if TYPE_CHECKING:
    from .meshes import DataParallelMesh

__all__ = ["Agreement", "PendingAgreement", "StepAbandoned", "StepSchedule", "agreement_group", "start_agreement"]


class StepAbandoned(RuntimeError):
    """Some rank abandoned the step (``fc.reset_step``) while others ran its backward: raised on every rank."""


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed at the start of a backward."""

    participants: list[bool]  # per unit (registration order): some rank runs it in this backward
    gradient_somewhere: list[bool]  # per parameter (units in order, then their params): some rank expects a gradient
    quitting: list[int]  # ranks that abandoned the step
    # per unit: the layout some rank holds partial gradients in (2: with "had a gradient" columns, 1: without, 0: no
    # rank holds any). A window's later buffers must take it on every rank (``step._decide_flag_columns``).
    held_layout: list[int]


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
    with unset_fake_temporarily():  # mesh bookkeeping uses real tensors, also while planning under fake tensors
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

    def result(self) -> Agreement:
        """Wait for the all-reduce (the host's one wait for it) and decode it.

        Raises ``RuntimeError`` when fingerprints differ (collective checks on): a rank with checks on waits for the
        agreement before any other collective of its backward, so nothing hangs.
        """
        if self._result is None:
            self._result = self._decode()
        return self._result

    def wait(self) -> None:
        """Complete the all-reduce (every rank issued it) without reading it: a step that ends without its answer."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def _decode(self) -> Agreement:
        me = dist.get_rank() if dist.is_initialized() else 0
        values = self.values
        if values is None:  # this rank is the only data-parallel rank
            return Agreement(self.reached, self.expected, [me] if self.abandoning else [], self.held)
        self.wait()
        if is_fake(values):
            # The planner simulates one rank of identical ones (FakeTensorMode, fake process group): what this rank
            # runs is what every rank runs.
            return Agreement(self.reached, self.expected, [me] if self.abandoning else [], self.held)
        result = values.tolist()
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
        participants = [bool(v) for v in result[: len(self.reached)]]
        expected = [bool(v) for v in result[len(self.reached) : masks]]
        return Agreement(participants, expected, quitting, [int(v) for v in result[masks:n]])


def start_agreement(
    schedule: StepSchedule,
    group: dist.ProcessGroup | None,
    reached: list[bool],
    *,
    abandoning: bool,
    checks: bool,
    expected: list[bool] | None = None,
    held: list[int] | None = None,
) -> PendingAgreement:
    """Issue the all-reduce (MAX) of this rank's participation mask, the parameters it expects gradients for
    (``expected``, one per ``parameter_count``; None: none), the layout it holds partial gradients in per unit
    (``held``, ``Agreement.held_layout``; None: none), whether it abandons the step, and (with collective checks) the
    schedule's fingerprint, over ``group`` (``agreement_group``). Nothing waits for it here."""
    expected = expected if expected is not None else [False] * schedule.parameter_count()
    held = held if held is not None else [0] * len(schedule.units)
    owner = schedule.root.unit.owner_name
    if group is None:
        return PendingAgreement(None, None, reached, expected, held, abandoning=abandoning, checks=checks, owner=owner)
    world = dist.get_world_size()
    fingerprint = schedule.fingerprint() if checks else 0
    # [mask..., abandoning ranks..., fingerprint, -fingerprint]: one MAX gives the union, the set of ranks that
    # abandon, and whether every fingerprint was equal (max == -max(-x) only when all are equal).
    flags = [0] * world
    if abandoning:
        flags[dist.get_rank()] = 1
    row = [*map(int, reached), *map(int, expected), *held, *flags, fingerprint, -fingerprint]
    values = torch.tensor(row, dtype=torch.int64, device=schedule.root.device)
    work = all_reduce_max(values, group, async_op=True)
    return PendingAgreement(values, work, reached, expected, held, abandoning=abandoning, checks=checks, owner=owner)
