"""The backward's agreement: at its first hook, the ranks agree which units take part, in one small all-reduce.

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

The same row carries, with collective checks on, the schedule's fingerprint (``StepSchedule.fingerprint``), and
always a signature of which parameters train: ranks that differ raise the same error at the end of the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .collectives import Work, all_reduce_max

if TYPE_CHECKING:
    from .meshes import DataParallelMesh
    from .program import StepSchedule
    from .state import ShardState

__all__ = [
    "Agreement",
    "PendingAgreement",
    "StepAbandoned",
    "agreement_group",
    "decide_flag_columns",
    "held_layouts",
    "issue_agreement",
    "start_agreement",
]

# A prime below 2**61: the trainability signature fits the agreement's int64 row, negated too.
_SIGNATURE_MODULUS = (1 << 61) - 1


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
    # The compiled program sizes this row with program.agreement_row_size: change both together (test_program
    # compares every issued collective's size with the program's).
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
