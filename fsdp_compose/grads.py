"""Gradient reduction of one unit: a small state machine from autograd's full gradients to sharded ``.grad``.

Only trainable parameters (``requires_grad`` as of the last trainability refresh) take part, laid out with the same
``torch.chunk`` split as the parameters but in their own flat layout, so frozen parameters never cost
reduce-scatter bytes. The pipeline's states (``GradState``) and what moves it::

    IDLE --capture/accumulate--> ACCUMULATING   full gradients written (or added) into a (world_size, segment + tail)
                                                buffer in the reduce-scatter layout as autograd makes them
    IDLE/ACCUMULATING --stage--> STAGED         the buffer is complete (zeros where this rank had no gradient)
    STAGED --reduce--> REDUCE_SCATTERING        one asynchronous reduce-scatter over the shard group's reduce group
    REDUCE_SCATTERING --advance--> ALL_REDUCING HSDP: the asynchronous all-reduce over replicas starts
    REDUCE_SCATTERING/ALL_REDUCING --finish--> IDLE
                                                every rank's rows are added to its sharded ``.grad`` (under CPU
                                                offload after one copy to host memory); user post-accumulate-grad
                                                hooks on the sharded parameters fire after a synchronising reduction
    any --discard--> IDLE                       a failed step or a user's zero_grad drops what is held

A transition not in ``_ALLOWED`` raises: "which reduction is running" is a named state, not a combination of fields.

The tail of the buffer is written by every rank into every segment: the gradients of 0-dim parameters and, only
where the backward's agreement could not tell, one "had a gradient" count per trainable parameter. A parameter no rank
had a gradient for keeps ``.grad = None``, as in single-process training. Which parameters get one is usually known
before any gradient exists: at its start each backward's agreement (``schedule.agree_on_backward``) carries, per
parameter, whether autograd will accumulate into it on this rank; when every trainable parameter of a unit gets one
on some rank (``flags_needed`` is False), its buffer has no flag columns and the reduce-scatter moves exactly the
gradient bytes torch's ``fully_shard`` moves. Otherwise (a branch no rank ran, a reentrant activation-checkpoint
recompute autograd cannot see ahead, a reduction outside a backward) the counts ride in the same collective.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .collectives import Work, all_reduce, labelled, reduce_scatter_flat
from .extensions import ShardExtensions
from .flat import ManagedParam, local_grad, run_post_accumulate_grad_hooks
from .meshes import DataParallelMesh
from .offload import UnitDevices
from .sharding import FlatLayout, chunk_rows, divide_factors, write_grad_into_segments
from .streams import current_stream, issued_on, record_event
from .transitions import checked

logger = logging.getLogger(__name__)

__all__ = ["GradState", "ReduceSpec", "UnitGradients", "divide_factors"]


class GradState(enum.Enum):
    IDLE = "idle"
    ACCUMULATING = "accumulating"
    STAGED = "staged"
    REDUCE_SCATTERING = "reduce_scattering"
    ALL_REDUCING = "all_reducing"


_ALLOWED: dict[GradState, frozenset[GradState]] = {
    GradState.IDLE: frozenset({GradState.ACCUMULATING, GradState.STAGED}),
    GradState.ACCUMULATING: frozenset({GradState.STAGED, GradState.IDLE}),
    GradState.STAGED: frozenset({GradState.REDUCE_SCATTERING, GradState.IDLE}),
    GradState.REDUCE_SCATTERING: frozenset({GradState.ALL_REDUCING, GradState.IDLE}),
    GradState.ALL_REDUCING: frozenset({GradState.IDLE}),
}


@dataclass(frozen=True)
class ReduceSpec:
    """What the gradient side needs to know about its unit (rebuilt when the unit's dtypes change)."""

    owner_name: str
    dp: DataParallelMesh
    reduce_group: dist.ProcessGroup  # the shard group's reduce-scatter group (see meshes.reduce_scatter_group)
    device: torch.device  # where the reduction runs (the mesh's device)
    devices: UnitDevices
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype  # the sharded parameters' dtype, which ``.grad`` takes
    extensions: ShardExtensions


@dataclass
class _InFlight:
    """One reduction on its way: the running collective, its output, and the reduce-scatter input while it runs."""

    work: Work | None
    output: torch.Tensor
    buffer: torch.Tensor | None  # the reduce-scatter input, kept alive until the reduce-scatter completes
    missing_locally: bool
    flagged: bool  # the rows carry "had a gradient" counts after the segment
    synchronising: bool  # the gradients are final after this reduction (user hooks fire)


@dataclass
class _Delivery:
    """Reduced rows on their way to ``.grad``: the output (host memory under offload), the flags a rank that lacked
    a gradient reads (host), and the event after which the host may read both (None: nothing to wait for)."""

    output: torch.Tensor
    flags: torch.Tensor | None
    ready: torch.Event | None
    synchronising: bool
    flagged: bool


class UnitGradients:
    """The gradient side of a ``ShardedUnit``: a ``GradState`` machine over one buffer and one reduction in flight."""

    def __init__(self, spec: ReduceSpec, params: list[ManagedParam]) -> None:
        self.spec = spec
        self.state = GradState.IDLE
        self.buffer: torch.Tensor | None = None  # ACCUMULATING / STAGED: the reduce-scatter input being filled
        self.flight: _InFlight | None = None  # REDUCE_SCATTERING / ALL_REDUCING
        self.deliveries: list[_Delivery] = []  # reduced, waiting for a device-to-host copy (see _deliver)
        self.replica_partial: torch.Tensor | None = None  # HSDP partial sums while the all-reduce is skipped
        self.on_finished: Callable[[], None] | None = None  # e.g. the optimizer step in backward
        # Set by the step context: completes another unit's reduce-scatter in flight, so that at most one full-size
        # gradient buffer (the one being filled) is alive at a time.
        self.make_room: Callable[[], None] | None = None
        self.locally_seen: set[int] = set()  # parameters with a gradient on this rank since the last reduce
        # Whether a new buffer needs "had a gradient" columns: set per backward from its agreement (False when every
        # trainable parameter gets a gradient on some rank), True outside a backward. ``flagged``: the layout of
        # what is held now (a buffer, HSDP partial sums), kept for the rest of an accumulation window.
        self.flags_needed = True
        self.flagged = True
        # id(full parameter) -> the autograd node that accumulates into it, noted when the unit is gathered for
        # forward (``note_accumulators``: making the node takes a view, which needs the storage). Held, so every
        # graph uses the same node and a backward can ask autograd ahead whether it will run (``expects_gradient``).
        self.accumulators: dict[int, torch.autograd.graph.Node] = {}
        self.written: set[int] = set()  # parameters whose region in ``buffer`` holds a gradient already
        self.divide_factor: float | None = None  # fc.set_gradient_divide_factor (None: the data-parallel size)
        # FSDP2's set_all_reduce_hook: called on this rank's reduced rows before they become ``.grad`` (and the stream
        # it runs on, None: the current one); FSDP2's set_reduce_scatter_unused_params(True): a parameter no rank had
        # a gradient for gets a zero ``.grad`` instead of keeping None.
        self.reduced_hook: Callable[[torch.Tensor], None] | None = None
        self.reduced_hook_stream: torch.Stream | None = None
        self.zero_unused = False
        self.accumulating = False  # set by the state each forward: a no-sync micro-batch (gradients kept here)
        # A failed step completes its collectives (every rank must) but hands nothing out: set by
        # ``StepContext.abandon``, cleared by ``discard``.
        self.dropping = False
        # (id of .grad, its version) per parameter when held gradients were last left between steps: a user's
        # zero_grad changes them, which tells that the held gradients must be dropped too.
        self._marks: dict[int, tuple[int, int, int]] = {}
        self._placeholders: dict[int, int] = {}  # id(mp) -> id of the zero .grad that mark_held put there
        self.refresh(params)

    # ------------------------------------------------------------------ state machine
    def _to(self, new: GradState) -> None:
        self.state = checked(self.state, new, _ALLOWED, f"gradient pipeline of {self.spec.owner_name}")

    def refresh(self, params: list[ManagedParam]) -> None:
        """Rebuild the layout from the parameters' cached ``trainable`` flags (the unit keeps those current)."""
        if self.has_pending():
            raise RuntimeError(
                f"requires_grad of parameters in the unit rooted at {self.spec.owner_name} changed while "
                "gradients from no-sync micro-batches are pending; finish the accumulation with a synced backward "
                "(or zero_grad and start over) before freezing or unfreezing parameters"
            )
        self.trainable = [mp for mp in params if mp.trainable]
        self.accumulators = {}  # full parameters may be new objects after a change of layout
        sharded = [mp for mp in self.trainable if mp.slot is not None]
        world_size = self.spec.dp.shard_size
        self.layout = FlatLayout.build(
            [mp.placing.local_shape for mp in sharded], world_size, [mp.placing.shard_dim for mp in sharded]
        )
        self.slot = {id(mp): i for i, mp in enumerate(sharded)}  # sharded trainable parameter -> layout slot
        self.scalar = {id(mp): i for i, mp in enumerate(mp for mp in self.trainable if mp.slot is None)}
        self.column = {id(mp): i for i, mp in enumerate(self.trainable)}  # its "had a gradient" flag column
        # Where each sharded trainable parameter's rows are in the reduce-scatter output (size, stride, offset).
        self._rows_at = {id(mp): self._rows_view(mp) for mp in self.trainable if id(mp) not in self.scalar}
        # Padding positions of the reduce-scatter input: (rank, start, stop). Zeroed in every new buffer so the
        # collective never reads uninitialised memory (NaN under deterministic mode, trips NCCL's NaN check).
        self.padding = [
            (rank, slot.offset + rows * slot.row_numel, slot.offset + slot.numel)
            for slot in self.layout.slots
            for rank, rows in enumerate(chunk_rows(slot.dim_size, world_size))
            if rows < slot.rows
        ]

    def _rows_view(self, mp: ManagedParam) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        slot = self.layout.slots[self.slot[id(mp)]]
        size = tuple(slot.chunk_shape(chunk_rows(slot.dim_size, self.spec.dp.shard_size)[self.spec.dp.shard_rank]))
        strides = [1] * len(size)
        for dim in range(len(size) - 2, -1, -1):
            strides[dim] = strides[dim + 1] * size[dim + 1]
        return size, tuple(strides), slot.offset

    def tail(self, flagged: bool) -> int:
        """Columns after the segment: the flag counts (when ``flagged``), then the 0-dim gradients."""
        return (len(self.trainable) if flagged else 0) + len(self.scalar)

    def has_pending(self) -> bool:
        return self.state is not GradState.IDLE or self.replica_partial is not None

    def _choose_layout(self) -> None:
        """A new buffer starts a window unless HSDP partial sums are held: those fix the layout until delivered."""
        if self.replica_partial is None:
            self.flagged = self.flags_needed and not self.zero_unused

    def _new_buffer(self) -> torch.Tensor:
        spec = self.spec
        self._choose_layout()
        buffer = torch.empty(
            spec.dp.shard_size,
            self.layout.segment_numel + self.tail(self.flagged),
            dtype=spec.reduce_dtype,
            device=spec.device,
        )
        for rank, start, stop in self.padding:
            buffer[rank, start:stop].zero_()
        return buffer

    def _pre_divisor(self) -> float:
        return divide_factors(self.spec.dp.size, self.divide_factor, self.spec.reduce_dtype)[0]

    def _scalar_column(self, mp: ManagedParam, flagged: bool) -> int:
        """Tail column of a 0-dim parameter's gradient (after the segment and the flag columns, if any)."""
        return self.layout.segment_numel + self.tail(flagged) - len(self.scalar) + self.scalar[id(mp)]

    # ------------------------------------------------------------------ filling the buffer
    def capture(self, mp: ManagedParam) -> None:
        """Post-accumulate-grad hook of a full parameter: while accumulating, move its gradient into the buffer.

        In a no-sync micro-batch (and in the synced one that ends an accumulation window) each gradient is written
        (or added) into the unit's buffer in the reduce-scatter layout as soon as autograd produced it, and freed, so
        the unit never holds all its full gradients next to the accumulation buffer.
        """
        if self.buffer is None and not self.accumulating:
            # A plain synced step: allocating the buffer at the first gradient would keep it alive for the rest of
            # the unit's backward (for the root, whose head gradient comes first, all of backward); stage() moves
            # the gradients at post-backward instead.
            return
        if self.state not in (GradState.IDLE, GradState.ACCUMULATING, GradState.STAGED):
            return  # a second use while this unit's reduction runs: stage() finishes that first, then flushes
        grad = local_grad(mp)
        if grad is None or id(mp) not in self.column:
            return
        self._write_one(mp, grad, self._pre_divisor())

    def note_accumulators(self) -> None:
        """Called with the full parameters gathered (a view of each makes its accumulating node)."""
        for mp in self.trainable:
            full = mp.full
            if full is not None and full.requires_grad and id(full) not in self.accumulators:
                with torch.enable_grad():
                    view = full.view_as(full)
                node = view.grad_fn.next_functions[0][0] if view.grad_fn is not None else None
                if node is not None:  # None under inference mode or a torch.func transform: noted next time
                    self.accumulators[id(full)] = node

    def expects_gradient(self, mp: ManagedParam) -> bool:
        """Will ``mp`` have a gradient here when the backward now starting reduces it? Yes if it got one earlier in
        the accumulation window or if autograd will run the node accumulating into its full parameter (in a backward
        only). Not knowing is safe: a False only costs "had a gradient" flags."""
        if id(mp) in self.locally_seen:
            return True
        full = mp.full
        node = self.accumulators.get(id(full)) if full is not None else None
        return node is not None and bool(torch._C._will_engine_execute_node(node))

    def _buffer_for_writing(self) -> torch.Tensor:
        if self.buffer is None:
            if self.make_room is not None:
                self.make_room()
            self.buffer = self._new_buffer()
            self.written = set()
            self._to(GradState.ACCUMULATING)
        return self.buffer

    def _write_one(self, mp: ManagedParam, grad: torch.Tensor, pre: float) -> None:
        buffer = self._buffer_for_writing()
        fresh = id(mp) not in self.written
        segment = self.layout.segment_numel
        if id(mp) in self.scalar:
            column = buffer[:, self._scalar_column(mp, self.flagged)]
            source = grad.reshape(1).expand(self.spec.dp.shard_size)
            column.copy_(source).div_(pre) if fresh else column.add_(source, alpha=1.0 / pre)
        else:
            slot = self.layout.slots[self.slot[id(mp)]]
            write_grad_into_segments(grad, buffer, slot, accumulate=not fresh, scale=pre)
        if self.flagged:
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
            grad = local_grad(mp)
            if grad is not None:
                self._write_one(mp, grad, pre)

    def _complete(self, buffer: torch.Tensor) -> None:
        """Zero the regions (and flags) of parameters that got no gradient on this rank, so the buffer is whole."""
        segment = self.layout.segment_numel
        for mp in self.trainable:
            if id(mp) in self.written:
                continue
            if id(mp) in self.scalar:
                buffer[:, self._scalar_column(mp, self.flagged)].zero_()
            else:
                slot = self.layout.slots[self.slot[id(mp)]]
                buffer[:, slot.offset : slot.offset + slot.numel].zero_()
            if self.flagged:
                buffer[:, segment + self.column[id(mp)]].zero_()
            self.written.add(id(mp))  # its region now holds a (zero) gradient: later writes add to it

    def accumulate(self) -> None:
        """A no-sync micro-batch ended: its gradients are in the accumulation buffer (moved there by ``capture``)."""
        if self.trainable:
            self._flush()

    def stage(self) -> None:
        """This backward's gradients, added to any accumulated ones, become the reduce-scatter input — the same
        buffer, in place: no second buffer, no copy. Staging again before the reduce adds to it."""
        if not self.trainable:
            return
        if self.state in (GradState.REDUCE_SCATTERING, GradState.ALL_REDUCING):
            self.finish()  # a second use of the unit in one backward: its first reduction completes first
        if self.state is GradState.IDLE and self._stage_all():
            return
        self._flush()
        self._complete(self._buffer_for_writing())
        if self.state is not GradState.STAGED:
            self._to(GradState.STAGED)

    def _stage_all(self) -> bool:
        """The common case in one op: nothing accumulated and every trainable parameter has its gradient here.

        ``torch._chunk_cat`` chunks each gradient on dim 0 into ``world_size`` padded chunks and lays chunk ``r`` of
        every gradient end to end in row ``r``: exactly the reduce-scatter layout, padding zeroed, cast to the reduce
        dtype in the same pass. A block of ones fills the flag columns, 0-dim gradients their columns.
        Returns False (nothing written) when the case does not apply.
        """
        spec = self.spec
        world_size = spec.dp.shard_size
        if any(slot.dim != 0 for slot in self.layout.slots):
            return False  # _chunk_cat chunks dim 0; a Shard(k) parameter's chunks are along k
        grads: list[torch.Tensor] = []
        scalars: list[torch.Tensor] = []
        for mp in self.trainable:
            grad = local_grad(mp)
            if grad is None:
                return False
            if id(mp) in self.scalar:
                scalars.append(grad.reshape(1, 1).expand(world_size, 1))
            elif grad.numel() > 0:
                grads.append(grad)
        dtypes = {grad.dtype for grad in grads + scalars}
        if len(dtypes) != 1:
            return False  # one dtype in, however many out: _chunk_cat casts only to its output's dtype
        dtype = dtypes.pop()
        pre = self._pre_divisor()
        if pre != 1.0 and dtype != spec.reduce_dtype:
            return False  # the per-parameter path divides before the cast (bit-identical results either way)
        if self.make_room is not None:
            self.make_room()
        self._choose_layout()
        buffer = torch.empty(
            world_size, self.layout.segment_numel + self.tail(self.flagged), dtype=spec.reduce_dtype, device=spec.device
        )
        # the flag columns: one element broadcast (no block of ones next to the buffer and the gradients)
        flags = [torch.ones((), dtype=dtype, device=spec.device).expand(world_size, len(self.trainable))]
        torch._chunk_cat([*grads, *flags[: int(self.flagged)], *scalars], dim=0, num_chunks=world_size, out=buffer)
        if pre != 1.0:
            buffer.div_(pre)  # the flag columns too: they are only compared with zero
        for mp in self.trainable:
            mp.full.grad = None  # type: ignore[union-attr]
            self.locally_seen.add(id(mp))
        self.written = set(self.locally_seen)
        self.buffer = buffer
        self._to(GradState.STAGED)
        return True

    # ------------------------------------------------------------------ the reduction
    def reduce(self, *, all_reduce_replicas: bool, synchronising: bool) -> None:
        """Start the reduce-scatter of the staged buffer over the shard group (asynchronously).

        The reduction then moves on in ``advance`` (wait for it; for HSDP start the all-reduce over replicas) and
        ends in ``finish`` (wait; hand out the gradients). With ``all_reduce_replicas=False`` (HSDP, accumulating)
        the reduce-scattered shard is kept as a partial sum over this replica's ranks, added in by the next
        reduction that does all-reduce.
        """
        if self.state is not GradState.STAGED:
            return
        buffer = self.buffer
        assert buffer is not None
        self.buffer = None
        spec = self.spec
        output = torch.empty(
            self.layout.segment_numel + self.tail(self.flagged), dtype=spec.reduce_dtype, device=spec.device
        )
        hook = spec.extensions.reduce_scatter
        work: Work | None = None
        with labelled(f"fsdp_compose::reduce_scatter[{self.spec.owner_name}]"):
            if hook is not None:
                hook(output, buffer.view(-1), spec.reduce_group)
            elif spec.dp.shard_size == 1:
                output.copy_(buffer.view(-1))
            else:
                work = reduce_scatter_flat(output, buffer.view(-1), spec.reduce_group, async_op=True)
        # Reading the flags costs a device sync, so only a rank that lacked a gradient itself reads them.
        missing_locally = len(self.locally_seen) < len(self.trainable)
        self.locally_seen = set()
        self.flight = _InFlight(
            work, output, buffer if work is not None else None, missing_locally, self.flagged, synchronising
        )
        self._to(GradState.REDUCE_SCATTERING)
        if spec.dp.replicate_group is not None and not all_reduce_replicas:
            self._wait_reduce_scatter(self.flight)
            if self.replica_partial is None:
                self.replica_partial = output
            else:
                self.replica_partial.add_(output)
            self.flight = None
            self._to(GradState.IDLE)

    def _wait_reduce_scatter(self, flight: _InFlight) -> None:
        if flight.buffer is not None:
            assert flight.work is not None
            with labelled(f"fsdp_compose::reduce_scatter_wait[{self.spec.owner_name}]"):
                flight.work.wait()
            flight.work = None
            flight.buffer = None  # the reduce-scatter input is free now

    def advance(self, *, only_if_done: bool = False) -> None:
        """The reduce-scatter completes (its input buffer is freed); HSDP starts the asynchronous all-reduce over
        replicas, which overlaps the rest of backward. Without replicas the gradients are handed out right away.

        ``only_if_done``: do nothing unless the reduce-scatter has already completed. During backward another rank
        may issue its side of this reduce-scatter only at the end of its backward (a unit that got no gradient
        there), after all-gathers that need this rank: blocking on it here would deadlock.
        """
        if self.state is not GradState.REDUCE_SCATTERING:
            return  # nothing in flight, or the all-reduce already runs
        flight = self.flight
        assert flight is not None
        if only_if_done and flight.work is not None and not flight.work.is_completed():
            return
        self._wait_reduce_scatter(flight)
        replicas = self.spec.dp.replicate_group
        if replicas is None:
            self.finish()
            return
        if self.replica_partial is not None:
            flight.output.add_(self.replica_partial)
            self.replica_partial = None
            flight.missing_locally = True  # the flags then count every micro-batch: read them
        all_reduce_hook = self.spec.extensions.all_reduce
        with labelled(f"fsdp_compose::all_reduce[{self.spec.owner_name}]"):
            if all_reduce_hook is not None:
                flight.work = all_reduce_hook(flight.output, replicas)
            else:
                flight.work = all_reduce(flight.output, replicas, async_op=True)
        self._to(GradState.ALL_REDUCING)

    def finish(self) -> None:
        """Wait for what is in flight and hand every rank its rows as sharded ``.grad`` (then ``on_finished``)."""
        if self.state is GradState.REDUCE_SCATTERING and self.spec.dp.replicate_group is not None:
            self.advance()
        if self.state not in (GradState.REDUCE_SCATTERING, GradState.ALL_REDUCING):
            return
        flight = self.flight
        assert flight is not None
        self._wait_reduce_scatter(flight)
        if flight.work is not None:
            with labelled(f"fsdp_compose::all_reduce_wait[{self.spec.owner_name}]"):
                flight.work.wait()
        self.flight = None
        self._to(GradState.IDLE)
        if self.dropping:
            return
        with labelled(f"fsdp_compose::deliver_gradients[{self.spec.owner_name}]"):
            self._deliver(flight)

    def _deliver(self, flight: _InFlight) -> None:
        """Start handing out the reduced rows: the device-side part now, the rest once the host may read them.

        Two things need the host to see device data: the "had a gradient" flags (read only by a rank that lacked
        a gradient itself) and, under CPU offload, the rows themselves (the sharded ``.grad`` lives in host memory).
        Both are copied asynchronously and an event is recorded; ``settle`` waits for it and hands the rows out.
        Within a backward that happens in the final callback, so nothing in backward waits for the device.
        """
        output, spec = flight.output, self.spec
        segment = self.layout.segment_numel
        _, post = divide_factors(spec.dp.size, self.divide_factor, spec.reduce_dtype)
        if post != 1.0:
            output.div_(post)
        if self.reduced_hook is not None:
            self._run_reduced_hook(output, flight.flagged)
        missing = flight.missing_locally and flight.flagged
        flags = output[segment : segment + len(self.trainable)] > 0 if missing else None
        if output.dtype != spec.grad_dtype:
            output = output.to(spec.grad_dtype)  # one cast for the unit (an elementwise cast: same values)
        delivery = _Delivery(output, flags, None, flight.synchronising, flight.flagged)
        if spec.devices.offloaded or flags is not None:
            delivery.output = spec.devices.to_shard(output)  # offloaded: the sharded .grad lives in host memory
            if flags is not None:
                delivery.flags = spec.devices.to_host(flags)
            delivery.ready = record_event(spec.device)
            self.deliveries.append(delivery)
            if torch._C._current_graph_task_id() == -1:  # not in a backward: no final callback will settle it
                self.settle()
            return
        self._hand_out(delivery)

    def _run_reduced_hook(self, output: torch.Tensor, flagged: bool) -> None:
        """FSDP2's all-reduce hook: ``hook(rows)`` on this rank's reduced, divided gradient rows in the reduce dtype
        (after the HSDP all-reduce), one flat tensor; what it writes in place is what ``.grad`` receives. The
        "had a gradient" flags are not in it; 0-dim gradients (kept in the tail) are appended and copied back."""
        assert self.reduced_hook is not None
        segment = self.layout.segment_numel
        start = segment + self.tail(flagged) - len(self.scalar)
        scalars = output[start : start + len(self.scalar)]
        rows = torch.cat([output[:segment], scalars]) if len(self.scalar) else output[:segment]
        device = self.spec.device
        stream = self.reduced_hook_stream if device.type != "cpu" else None
        with issued_on(stream, device):
            self.reduced_hook(rows)
        if stream is not None:
            current_stream(device).wait_stream(stream)
        if len(self.scalar):
            output[:segment].copy_(rows[:segment])
            scalars.copy_(rows[segment:])

    def settle(self) -> None:
        """Wait for the copies of the deliveries ``_deliver`` started and hand their rows out (the end of backward)."""
        deliveries, self.deliveries = self.deliveries, []
        for delivery in deliveries:
            if delivery.ready is not None:
                delivery.ready.synchronize()
            self._hand_out(delivery)

    def _hand_out(self, delivery: _Delivery) -> None:
        """Every rank's rows become (or are added to) the sharded ``.grad``; hooks and ``on_finished`` run after."""
        output = delivery.output
        had_grad = None if delivery.flags is None else delivery.flags.tolist()
        base = output.storage_offset()
        adds: list[torch.Tensor] = []
        into: list[torch.Tensor] = []
        delivered = []
        for index, mp in enumerate(self.trainable):
            if had_grad is not None and not had_grad[index]:
                continue
            if id(mp) in self.scalar:
                rows = output.as_strided((), (), base + self._scalar_column(mp, delivery.flagged))
            else:
                size, stride, offset = self._rows_at[id(mp)]
                rows = output.as_strided(size, stride, base + offset)
            if rows.dtype != mp.sharded.dtype:  # a unit with several trainable dtypes reduces in one of them
                rows = rows.to(mp.sharded.dtype)
            current = mp.sharded.grad
            if current is None or id(current) == self._placeholders.get(id(mp)):  # a placeholder holds only zeros
                mp.sharded.grad = DTensor(rows, mp.sharded._spec, requires_grad=False)
            else:
                into.append(current._local_tensor)  # type: ignore[attr-defined]
                adds.append(rows)
            delivered.append(mp)
        if into:
            torch._foreach_add_(into, adds)
        if delivery.synchronising:
            for mp in delivered:
                run_post_accumulate_grad_hooks(mp.sharded)
        if delivery.synchronising and self._placeholders:
            # A parameter no rank had a gradient for keeps ``.grad = None`` (as in single-process training), also
            # where a held-gradient placeholder stood: otherwise optimizers would step it (weight decay, momentum).
            for index, mp in enumerate(self.trainable):
                placeholder = self._placeholders.get(id(mp))
                got_one = had_grad is None or had_grad[index]
                if placeholder is not None and not got_one and id(mp.sharded.grad) == placeholder:
                    mp.sharded.grad = None
            self._placeholders = {}
        if self.on_finished is not None:
            self.on_finished()

    # ------------------------------------------------------------------ gradients held between steps
    def mark_held(self) -> None:
        """Gradients stay held here past this backward (no-sync): make ``.grad`` tell us if the user drops them.

        Each trainable parameter without a sharded ``.grad`` gets a zero one (no memory: a broadcast zero), and its
        identity and version are noted: ``zero_grad()`` either sets it to None or
        zeroes it in place, and ``drop_if_user_zeroed`` sees either at the next step.
        """
        if not self.has_pending():
            return
        self._marks = {}
        for mp in self.trainable:
            grad = mp.sharded.grad
            if grad is None:
                # One zero broadcast to the shard's shape: it costs no memory (a real zero gradient here would add
                # a sharded gradient's worth to the whole accumulation window) and still records zero_grad.
                local = mp.sharded._local_tensor
                grad = _like_sharded(mp, torch.zeros((), dtype=local.dtype, device=local.device).expand(local.shape))
                mp.sharded.grad = grad
                self._placeholders[id(mp)] = id(grad)
            self._marks[id(mp)] = (id(grad), *_versions(grad))

    def drop_if_user_zeroed(self) -> bool:
        """Drop the held gradients when the user zeroed the sharded ``.grad`` since ``mark_held``; True if dropped."""
        if not self._marks or not self.has_pending():
            self._marks = {}
            return False
        dropped = False
        for mp in self.trainable:
            mark = self._marks.get(id(mp))
            grad = mp.sharded.grad
            if mark is None:
                continue
            if grad is None or id(grad) != mark[0]:
                dropped = True
            elif _versions(grad) != mark[1:] and not bool(grad._local_tensor.any()):  # type: ignore[attr-defined]
                dropped = True
            if dropped:
                break
        if dropped:
            self._marks = {}
            logger.info(
                "%s: .grad was zeroed during gradient accumulation: held gradients dropped", self.spec.owner_name
            )
            self.discard()
        return dropped

    def discard(self) -> None:
        """Drop everything held or in flight (a failed step, a user's zero_grad). Waits for a running collective:
        every rank issued it, so every rank must complete it. Rows already reduced are handed out (they are final),
        except in a failed step (``dropping``): rows of it still waiting for their copy are its partial gradients."""
        if self.dropping:
            for delivery in self.deliveries:
                if delivery.ready is not None:
                    delivery.ready.synchronize()
            self.deliveries = []
        self.settle()
        flight = self.flight
        if flight is not None:
            self._wait_reduce_scatter(flight)
            if flight.work is not None:
                flight.work.wait()
        self.flight = None
        self.buffer = None
        self.replica_partial = None
        self.written = set()
        self.locally_seen = set()
        self._marks = {}
        self.dropping = False
        # ``_placeholders`` stay: a zero placeholder the user zeroed in place is still ``.grad`` and must be
        # replaced, not added into, at the next delivery.
        self.state = GradState.IDLE


def _like_sharded(mp: ManagedParam, local: torch.Tensor) -> DTensor:
    """``local`` as a gradient of the sharded parameter: its mesh, placements, global shape and stride."""
    return DTensor.from_local(
        local,
        mp.sharded.device_mesh,
        mp.sharded.placements,
        run_check=False,
        shape=mp.sharded.shape,
        stride=mp.sharded.stride(),
    )


def _versions(grad: torch.Tensor) -> tuple[int, int]:
    """Version counters of a sharded ``.grad`` and of its local tensor: an in-place zero_ bumps at least one."""
    local = getattr(grad, "_local_tensor", grad)
    return grad._version, local._version
