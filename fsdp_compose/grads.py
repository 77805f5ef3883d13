"""Gradient reduction of one unit: which parameters are reduced, their reduce-scatter layout, the buffers in flight.

Only trainable parameters (``requires_grad`` as of the last trainability refresh) take part, laid out with the same
``torch.chunk`` row split as the parameters but in their own flat layout, so frozen parameters never cost
reduce-scatter bytes. One backward of a unit goes::

    stage()       move the full gradients into a (world_size, segment + tail) buffer — the reduce-scatter input —
                  and free them (or add them to the no-sync accumulation buffer, which then *is* that input)
    reduce()      start one reduce-scatter of the staged buffer over the shard group, asynchronously: it overlaps
                  the next units' backward
    advance()     (when the next unit reduces) wait for it and free its input; for HSDP start the asynchronous
                  all-reduce over the replicate group
    finish()      wait for what is left; every rank's rows become (or are added to) its sharded DTensor ``.grad``
                  (under CPU offload, after one copy of the reduced shard to host memory)

The tail of the buffer is written by every rank into every segment: one "had a gradient" count per trainable
parameter and the gradients of 0-dim parameters. After the reduce-scatter every rank therefore knows which parameters
got a gradient on any rank (a parameter unused everywhere keeps ``.grad = None``, as in single-process training) and
holds the summed 0-dim gradients, with no second collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.tensor import DTensor

from .collectives import Work, all_reduce, reduce_scatter_flat
from .sharding import FlatLayout, write_grad_into_segments

if TYPE_CHECKING:
    from .unit import ManagedParam, ShardedUnit

__all__ = ["UnitGradients", "divide_factors"]


@dataclass
class _InFlight:
    """One reduction on its way: the running collective, its output, and the reduce-scatter input while it runs."""

    work: Work | None
    output: torch.Tensor
    buffer: torch.Tensor | None  # kept alive until the reduce-scatter completes
    missing_locally: bool
    all_reduce_started: bool = False


def divide_factors(world_size: int, divide_factor: float | None, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post) divisors whose product is the divide factor (default: the data-parallel size, replicas included).

    fp16 sums of many ranks overflow and fp16 pre-divided values underflow, so for fp16 the factor is split:
    pre-divide by the largest power of two not above its square root (exact in binary floating point), post-divide by
    the rest. Other dtypes have fp32's range: one post-division is the most accurate.
    """
    total = float(world_size if divide_factor is None else divide_factor)
    if reduce_dtype != torch.float16:
        return 1.0, total
    pre = 1.0
    while (pre * 2.0) ** 2 <= total:
        pre *= 2.0
    return pre, total / pre


class UnitGradients:
    """The gradient side of a ``ShardedUnit``."""

    def __init__(self, unit: ShardedUnit) -> None:
        self.unit = unit
        self.trainable: list[ManagedParam] = []
        self.layout = FlatLayout.build([], unit.world_size)
        self.slot: dict[int, int] = {}  # id(ManagedParam) -> slot in ``layout`` (sharded trainable parameters)
        self.scalar: dict[int, int] = {}  # id(ManagedParam) -> tail column (0-dim trainable parameters)
        self.accumulated: torch.Tensor | None = None  # no-sync accumulation, in the reduce-scatter layout
        self.staged: torch.Tensor | None = None  # written this backward, waiting for its reduce-scatter
        self.in_flight: _InFlight | None = None  # a reduction started and not finished
        self.unreduced_over_replicas: torch.Tensor | None = None  # HSDP partial sums while all-reduce is skipped
        self.on_finished: Callable[[], None] | None = None  # e.g. the optimizer step in backward
        # Set by the root: completes the reduce-scatter in flight, so that at most one full-size gradient buffer
        # (the one being filled) is alive at a time.
        self.make_room: Callable[[], None] | None = None
        self.locally_seen: set[int] = set()  # parameters with a gradient on this rank since the last reduce
        self.written: set[int] = set()  # parameters whose region in ``accumulated`` holds a gradient already
        self.column: dict[int, int] = {}  # id(ManagedParam) -> its "had a gradient" flag column in the tail
        self.divide_factor: float | None = None  # fc.set_gradient_divide_factor (None: the data-parallel size)
        self.accumulating = False  # set by the state each forward: a no-sync micro-batch (gradients kept here)
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the layout from the parameters' cached ``trainable`` flags (the unit keeps those current)."""
        if self.accumulated is not None or self.staged is not None:
            raise RuntimeError(
                f"requires_grad of parameters in the unit rooted at {self.unit.owner_name} changed while "
                "gradients from no-sync micro-batches are pending; finish the accumulation with a synced backward "
                "(or zero_grad and start over) before freezing or unfreezing parameters"
            )
        self.trainable = [mp for mp in self.unit.params if mp.trainable]
        sharded = [mp for mp in self.trainable if mp.slot is not None]
        self.layout = FlatLayout.build([mp.placing.local_shape for mp in sharded], self.unit.world_size)
        self.slot = {id(mp): i for i, mp in enumerate(sharded)}
        self.scalar = {id(mp): i for i, mp in enumerate(mp for mp in self.trainable if mp.slot is None)}
        self.column = {id(mp): i for i, mp in enumerate(self.trainable)}

    @property
    def tail(self) -> int:
        return len(self.trainable) + len(self.scalar)

    def has_pending(self) -> bool:
        return (
            self.accumulated is not None
            or self.staged is not None
            or self.in_flight is not None
            or self.unreduced_over_replicas is not None
        )

    def _new_buffer(self) -> torch.Tensor:
        unit = self.unit
        return torch.empty(
            unit.world_size, self.layout.segment_numel + self.tail, dtype=unit.reduce_dtype, device=unit.device
        )

    def capture(self, mp: ManagedParam) -> None:
        """Post-accumulate-grad hook of a full parameter: while accumulating, move its gradient into the buffer.

        In a no-sync micro-batch (and in the synced one that ends an accumulation window) each gradient is written
        (or added) into the unit's buffer in the reduce-scatter layout as soon as autograd produced it, and freed, so
        the unit never holds all its full gradients next to the accumulation buffer.
        """
        if self.accumulated is None and not self.accumulating:
            # A plain synced step: allocating the buffer at the first gradient would keep it alive for the rest of
            # the unit's backward (for the root, whose head gradient comes first, all of backward); stage() moves
            # the gradients at post-backward instead.
            return
        grad = _local_grad(mp)
        if grad is None or id(mp) not in self.column:
            return
        self._write_one(mp, grad, self._pre_divisor())

    def _pre_divisor(self) -> float:
        return divide_factors(self.unit.dp.size, self.divide_factor, self.unit.reduce_dtype)[0]

    def _scalar_column(self, mp: ManagedParam) -> int:
        """Tail column of a 0-dim parameter's gradient (after the segment and the flag columns)."""
        return self.layout.segment_numel + len(self.trainable) + self.scalar[id(mp)]

    def _start_buffer(self, *, make_room: bool) -> torch.Tensor:
        if make_room and self.make_room is not None:
            self.make_room()
        self.accumulated = self._new_buffer()
        self.written = set()
        return self.accumulated

    def _write_one(self, mp: ManagedParam, grad: torch.Tensor, pre: float) -> None:
        buffer = self.accumulated if self.accumulated is not None else self._start_buffer(make_room=True)
        fresh = id(mp) not in self.written
        segment = self.layout.segment_numel
        if id(mp) in self.scalar:
            column = buffer[:, self._scalar_column(mp)]
            source = grad.reshape(1).expand(self.unit.world_size)
            column.copy_(source).div_(pre) if fresh else column.add_(source, alpha=1.0 / pre)
        else:
            slot = self.layout.slots[self.slot[id(mp)]]
            write_grad_into_segments(grad, buffer, slot, accumulate=not fresh, scale=pre)
        flag = buffer[:, segment + self.column[id(mp)]]
        flag.fill_(1.0) if fresh else flag.add_(1.0)
        self.written.add(id(mp))
        self.locally_seen.add(id(mp))
        assert mp.full is not None
        mp.full.grad = None

    def _flush(self) -> None:
        """Move gradients the hook did not see into the buffer (all of them in a plain synced step)."""
        pre = self._pre_divisor()
        for mp in self.trainable:
            grad = _local_grad(mp)
            if grad is not None:
                self._write_one(mp, grad, pre)

    def _complete(self, buffer: torch.Tensor) -> None:
        """Zero the regions (and flags) of parameters that got no gradient on this rank, so the buffer is whole."""
        segment = self.layout.segment_numel
        for mp in self.trainable:
            if id(mp) in self.written:
                continue
            if id(mp) in self.scalar:
                buffer[:, self._scalar_column(mp)].zero_()
            else:
                slot = self.layout.slots[self.slot[id(mp)]]
                buffer[:, slot.offset : slot.offset + slot.numel].zero_()
            buffer[:, segment + self.column[id(mp)]].zero_()

    def accumulate(self) -> None:
        """A no-sync micro-batch ended: its gradients are in the accumulation buffer (moved there by ``capture``)."""
        self._flush()

    def stage(self) -> None:
        """This backward's gradients, added to any accumulated ones, become the reduce-scatter input — the same
        buffer, in place: no second buffer, no copy. A second stage before the reduce adds to the first."""
        if not self.trainable:
            return
        self.finish()  # a second use of the unit in one backward: its first reduction completes first
        self._flush()
        buffer = self.accumulated if self.accumulated is not None else self._start_buffer(make_room=False)
        self._complete(buffer)
        if self.staged is None:
            self.staged = buffer
        else:
            self.staged.add_(buffer)
        self.accumulated = None
        self.written = set()

    def reduce(self, *, all_reduce_replicas: bool = True) -> None:
        """Start the reduce-scatter of the staged buffer over the shard group (asynchronously).

        The reduction then moves on in ``advance`` (wait for it; for HSDP start the all-reduce over replicas) and
        ends in ``finish`` (wait; hand out the gradients). With ``all_reduce_replicas=False`` (HSDP, accumulating)
        the reduce-scattered shard is kept as a partial sum over this replica's ranks, added in by the next
        reduction that does all-reduce.
        """
        buffer = self.staged
        if buffer is None:
            return
        self.staged = None
        self.finish()  # at most one reduction of this unit in flight
        unit = self.unit
        output = torch.empty(self.layout.segment_numel + self.tail, dtype=unit.reduce_dtype, device=unit.device)
        hook = unit.extensions.reduce_scatter
        work: Work | None = None
        if hook is not None:
            hook(output, buffer.view(-1), unit.group)
        elif unit.world_size == 1:
            output.copy_(buffer.view(-1))
        else:
            work = reduce_scatter_flat(output, buffer.view(-1), unit.group, async_op=True)
        # Reading the flags costs a device sync, so only a rank that lacked a gradient itself reads them.
        missing_locally = len(self.locally_seen) < len(self.trainable)
        self.locally_seen = set()
        skip_all_reduce = unit.dp.replicate_group is not None and not all_reduce_replicas
        self.in_flight = _InFlight(work, output, buffer if work is not None else None, missing_locally)
        if skip_all_reduce:
            self._wait_reduce_scatter(self.in_flight)
            self.in_flight = None
            if self.unreduced_over_replicas is None:
                self.unreduced_over_replicas = output
            else:
                self.unreduced_over_replicas.add_(output)

    def _wait_reduce_scatter(self, flight: _InFlight) -> None:
        if flight.buffer is not None:
            assert flight.work is not None
            flight.work.wait()
            flight.work = None
            flight.buffer = None  # the reduce-scatter input is free now

    def advance(self) -> None:
        """The reduce-scatter completes (its input buffer is freed); HSDP starts the asynchronous all-reduce over
        replicas, which overlaps the rest of backward. Without replicas the gradients are handed out right away."""
        flight = self.in_flight
        if flight is None or (flight.buffer is None and flight.work is not None):
            return  # nothing in flight, or the all-reduce already runs
        self._wait_reduce_scatter(flight)
        replicas = self.unit.dp.replicate_group
        if replicas is None:
            self.finish()
            return
        if flight.all_reduce_started:
            return
        if self.unreduced_over_replicas is not None:
            flight.output.add_(self.unreduced_over_replicas)
            self.unreduced_over_replicas = None
            flight.missing_locally = True  # the flags then count every micro-batch: read them
        all_reduce_hook = self.unit.extensions.all_reduce
        if all_reduce_hook is not None:
            flight.work = all_reduce_hook(flight.output, replicas)
        else:
            flight.work = all_reduce(flight.output, replicas, async_op=True)
        flight.all_reduce_started = True

    def finish(self) -> None:
        """Wait for what is in flight and hand every rank its rows as sharded ``.grad`` (then ``on_finished``)."""
        flight = self.in_flight
        if flight is None:
            return
        if self.unit.dp.replicate_group is not None and not flight.all_reduce_started:
            self.advance()
        self.in_flight = None
        self._wait_reduce_scatter(flight)
        if flight.work is not None:
            flight.work.wait()
        output, missing_locally = flight.output, flight.missing_locally
        unit = self.unit
        segment = self.layout.segment_numel
        _, post = divide_factors(unit.dp.size, self.divide_factor, unit.reduce_dtype)
        if post != 1.0:
            output.div_(post)
        output = unit.devices.to_shard(output)  # offloaded: the sharded .grad lives in host memory
        had_grad = (output[segment : segment + len(self.trainable)] > 0).tolist() if missing_locally else None
        for index, mp in enumerate(self.trainable):
            if had_grad is not None and not had_grad[index]:
                continue
            if id(mp) in self.scalar:
                rows = output[segment + len(self.trainable) + self.scalar[id(mp)]].view(())
            else:
                rows = self.layout.shard_view(output, self.slot[id(mp)], unit.rank)
            self._add_to_sharded_grad(mp, rows)
        if self.on_finished is not None:
            self.on_finished()

    def _add_to_sharded_grad(self, mp: ManagedParam, rows: torch.Tensor) -> None:
        rows = rows.to(self.unit.orig_dtype)
        current = mp.sharded.grad
        if current is None:
            mp.sharded.grad = DTensor.from_local(
                rows,
                mp.sharded.device_mesh,
                mp.sharded.placements,
                run_check=False,
                shape=mp.sharded.shape,
                stride=mp.sharded.stride(),
            )
        else:
            cast(DTensor, current)._local_tensor.add_(rows)


def _local_grad(mp: ManagedParam) -> torch.Tensor | None:
    """The full parameter's gradient as the tensor FSDP shards: the TP-local gradient of a TP parameter."""
    if mp.full is None or mp.full.grad is None:
        return None
    grad = mp.full.grad
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != mp.placing.tp_placements:
            grad = grad.redistribute(grad.device_mesh, mp.placing.tp_placements)
        return grad.to_local()
    return grad
