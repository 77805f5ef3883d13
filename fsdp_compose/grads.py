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

The buffer, its layout and the "had a gradient" flags are ``ReduceScatterInput`` (below); handing the reduced rows
out as sharded ``.grad`` (and the gradients held between no-sync backwards) is ``delivery.GradientDelivery``.

The reduce-scatter input is ``(world_size, segment + tail)``: row ``r`` is what rank ``r`` receives, each trainable
parameter's gradient split with the same ``torch.chunk`` rows as the parameter (padding zeroed), so the
reduce-scatter moves exactly the bytes of the trainable parameters (frozen ones are not in it). The tail holds,
where needed, one "had a gradient" count per trainable parameter (``flagged``), then the gradients of 0-dim
parameters.

Flags are needed only when a backward cannot promise that every trainable parameter gets a gradient on some rank.
It can usually promise it before any gradient exists: the full parameters' accumulating autograd nodes are held
(``note_accumulators``, when the unit is gathered for forward), and at the start of a backward autograd says whether
it will run each of them (``expects_gradient``); the step's agreement combines the ranks' answers.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .collectives import Work, all_reduce, labelled, reduce_scatter_flat
from .delivery import GradientDelivery, ReduceSpec, RowsLayout
from .flat import ManagedParam
from .meshes import DataParallelMesh
from .sharding import FlatLayout, chunk_rows, write_grad_into_segments
from .transitions import internal_error, transition_error

logger = logging.getLogger(__name__)

__all__ = [
    "GradState",
    "ReduceScatterInput",
    "ReduceSpec",
    "UnitGradients",
    "divide_factors",
    "gradient_node",
    "local_grad",
]


def gradient_node(tensor: torch.Tensor) -> torch.autograd.graph.Node | None:
    """The autograd node that computes ``tensor``'s gradient: its ``grad_fn``, or for a leaf the node accumulating
    into it (reached through a view, which needs the storage). None where no graph is recorded (inference mode, a
    torch.func transform)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    with torch.enable_grad():
        view = tensor.view_as(tensor)
    return view.grad_fn.next_functions[0][0] if view.grad_fn is not None else None


def local_grad(mp: ManagedParam) -> torch.Tensor | None:
    """The full parameter's gradient as the tensor FSDP shards: the TP-local gradient of a TP parameter."""
    if mp.full is None or mp.full.grad is None:
        return None
    grad = mp.full.grad
    if isinstance(grad, DTensor):
        # On data-parallel dims (dp_mesh_dims) the local gradient is this rank's contribution whatever its placement
        # (Partial, typically): the reduce-scatter sums it, so only the TP dims are redistributed.
        dp_dims = mp.placing.dp_dims
        target = tuple(
            grad.placements[i] if i in dp_dims else placement for i, placement in enumerate(mp.placing.tp_placements)
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(grad.device_mesh, target)
        return grad.to_local()
    return grad


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


@dataclass
class _InFlight:
    """One reduction on its way: the running collective, its output, and the reduce-scatter input while it runs."""

    work: Work | None
    output: torch.Tensor | None  # None: one rank's gradients, handed out as they are (``rows``)
    buffer: torch.Tensor | None  # the reduce-scatter input, kept alive until it completes (None: copied at issue)
    missing_locally: bool
    flagged: bool  # the rows carry "had a gradient" counts after the segment
    synchronising: bool  # the gradients are final after this reduction (user hooks fire)
    rows: dict[int, torch.Tensor] | None = None  # id(ManagedParam) -> its gradient (``UnitGradients.stage``)


class ReduceScatterInput:
    """A unit's reduce-scatter input: layout, the buffer being filled, and which gradients it holds."""

    def __init__(self, spec: ReduceSpec, params: list[ManagedParam]) -> None:
        self.spec = spec
        self.buffer: torch.Tensor | None = None
        self.written: set[int] = set()  # parameters whose region in ``buffer`` holds a gradient already
        self.locally_seen: set[int] = set()  # parameters with a gradient on this rank since the last reduce
        # Whether a new buffer needs "had a gradient" columns: set per backward from its agreement (False when every
        # trainable parameter gets a gradient on some rank), True outside a backward. ``flagged``: the layout of
        # what is held now (a buffer, HSDP partial sums), kept for the rest of an accumulation window.
        self.flags_needed = True
        self.flagged = True
        # id(full parameter) -> the autograd node that accumulates into it (see the module docstring). Held, so
        # every graph uses the same node.
        self.accumulators: dict[int, torch.autograd.graph.Node] = {}
        self.refresh(params)

    def refresh(self, params: list[ManagedParam]) -> None:
        """Lay out the trainable parameters (``trainable`` as the unit last refreshed it)."""
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
        rows_at = {id(mp): self._rows_view(mp) for mp in self.trainable if id(mp) not in self.scalar}
        self.rows = RowsLayout(self.layout.segment_numel, self.trainable, rows_at, self.scalar)
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

    def new_buffer(self) -> torch.Tensor:
        spec = self.spec
        buffer = torch.empty(
            spec.dp.shard_size,
            self.layout.segment_numel + self.rows.tail(self.flagged),
            dtype=spec.reduce_dtype,
            device=spec.device,
        )
        for rank, start, stop in self.padding:
            buffer[rank, start:stop].zero_()
        self.buffer = buffer
        self.written = set()
        return buffer

    def write_one(self, mp: ManagedParam, grad: torch.Tensor, pre: float) -> None:
        """Write (or add) ``grad`` divided by ``pre`` into its region of the buffer (which exists) and free it."""
        buffer = self.buffer
        if buffer is None:
            raise internal_error(f"unit {self.spec.owner_name}", "buffer is missing")
        fresh = id(mp) not in self.written
        segment = self.layout.segment_numel
        if id(mp) in self.scalar:
            column = buffer[:, self.rows.scalar_column(mp, self.flagged)]
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
        if mp.full is None:
            raise internal_error(f"unit {self.spec.owner_name}", "mp.full is missing")
        mp.full.grad = None

    def complete(self) -> None:
        """Zero the regions (and flags) of parameters that got no gradient on this rank, so the buffer is whole."""
        buffer = self.buffer
        if buffer is None:
            raise internal_error(f"unit {self.spec.owner_name}", "buffer is missing")
        segment = self.layout.segment_numel
        for mp in self.trainable:
            if id(mp) in self.written:
                continue
            if id(mp) in self.scalar:
                buffer[:, self.rows.scalar_column(mp, self.flagged)].zero_()
            else:
                slot = self.layout.slots[self.slot[id(mp)]]
                buffer[:, slot.offset : slot.offset + slot.numel].zero_()
            if self.flagged:
                buffer[:, segment + self.column[id(mp)]].zero_()
            self.written.add(id(mp))  # its region now holds a (zero) gradient: later writes add to it

    def stage_all(self, pre: float, *, flagged: bool) -> bool:
        """The common case in one op: nothing accumulated and every trainable parameter has its gradient here.

        ``torch._chunk_cat`` chunks each gradient on dim 0 into ``world_size`` padded chunks and lays chunk ``r`` of
        every gradient end to end in row ``r``: exactly the reduce-scatter layout, padding zeroed, cast to the reduce
        dtype in the same pass. A block of ones fills the flag columns, 0-dim gradients their columns.
        ``flagged``: the buffer carries them (``UnitGradients.next_layout``). Returns False (nothing written) when the
        case does not apply.
        """
        spec = self.spec
        world_size = spec.dp.shard_size
        for slot in self.layout.slots:
            if slot.dim != 0:
                return False  # _chunk_cat chunks dim 0; a Shard(k) parameter's chunks are along k
        grads: list[torch.Tensor] = []
        scalars: list[torch.Tensor] = []
        dtypes: set[torch.dtype] = set()
        for mp in self.trainable:
            grad = local_grad(mp)
            if grad is None:
                return False
            if id(mp) in self.scalar:
                scalars.append(grad.reshape(1, 1).expand(world_size, 1))
                dtypes.add(grad.dtype)
            elif grad.numel() > 0:
                grads.append(grad)
                dtypes.add(grad.dtype)
        if len(dtypes) != 1:
            return False  # one dtype in, however many out: _chunk_cat casts only to its output's dtype
        dtype = dtypes.pop()
        if pre != 1.0 and dtype != spec.reduce_dtype:
            return False  # the per-parameter path divides before the cast (bit-identical results either way)
        self.flagged = flagged
        buffer = torch.empty(
            world_size,
            self.layout.segment_numel + self.rows.tail(self.flagged),
            dtype=spec.reduce_dtype,
            device=spec.device,
        )
        # the flag columns: one element broadcast (no block of ones next to the buffer and the gradients)
        flags = (
            [torch.ones((), dtype=dtype, device=spec.device).expand(world_size, len(self.trainable))]
            if self.flagged
            else []
        )
        torch._chunk_cat([*grads, *flags, *scalars], dim=0, num_chunks=world_size, out=buffer)
        if pre != 1.0:
            buffer.div_(pre)  # the flag columns too: they are only compared with zero
        for mp in self.trainable:
            mp.full.grad = None  # type: ignore[union-attr]
            self.locally_seen.add(id(mp))
        self.written = set(self.locally_seen)
        self.buffer = buffer
        return True

    def note_accumulators(self) -> None:
        """Called with the full parameters gathered (a view of each makes its accumulating node)."""
        for mp in self.trainable:
            full = mp.full
            if full is not None and full.requires_grad and id(full) not in self.accumulators:
                node = gradient_node(full)
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


class UnitGradients:
    """A unit's gradients: a ``GradState`` machine over one buffer and one reduction in flight."""

    def __init__(self, spec: ReduceSpec, params: list[ManagedParam]) -> None:
        self.spec = spec
        self.state = GradState.IDLE
        self.flight: _InFlight | None = None  # REDUCE_SCATTERING / ALL_REDUCING
        self.replica_partial: torch.Tensor | None = None  # HSDP partial sums while the all-reduce is skipped
        self.divide_factor: float | None = None  # fc.set_gradient_divide_factor (None: the data-parallel size)
        # FSDP2's set_reduce_scatter_unused_params(True): a parameter no rank had a gradient for gets a zero
        # ``.grad`` instead of keeping None.
        self.zero_unused = False
        self.accumulating = False  # set by the state each forward: a no-sync micro-batch (gradients kept here)
        # A failed step completes its collectives (every rank must) but hands nothing out: set by
        # ``StepContext.abandon``, cleared by ``discard``.
        self.dropping = False
        # Reduced rows to sharded .grad, FSDP2's all-reduce hook, gradients held between backwards (delivery.py).
        self.input = ReduceScatterInput(spec, params)  # the reduce-scatter input and its layout (below)
        # A shard group of one rank with nothing to reduce: this backward's gradients as autograd made them, staged
        # for delivery without a buffer (``_stage_in_place``), and those of the no-sync micro-batches before it,
        # summed where the first one was made (``_hold_in_place``).
        self.in_place: dict[int, torch.Tensor] | None = None
        self.held_in_place: dict[int, torch.Tensor] = {}
        self.delivery = GradientDelivery(spec, self.input.rows)
        self.refresh(params)

    def rebuilt(self, spec: ReduceSpec, params: list[ManagedParam]) -> UnitGradients:
        """This gradient side for new dtypes (the parameters were cast, or which are trainable changed): nothing
        pending, the same settings and the callback set on this one."""
        new = UnitGradients(spec, params)
        new.take_settings(self)
        new.delivery.on_finished = self.delivery.on_finished
        return new

    def divisors(self) -> tuple[float, float]:
        """(pre, post): this unit's gradients are divided by ``pre`` before the reduction and by ``post`` after it
        (``divide_factors``)."""
        return divide_factors(self.spec.dp, self.divide_factor, self.spec.reduce_dtype)

    def take_settings(self, old: UnitGradients) -> None:
        """The user's settings of ``old``: divide factor, FSDP2's all-reduce hook and unused-parameter mode."""
        self.divide_factor = old.divide_factor
        self.delivery.reduced_hook = old.delivery.reduced_hook
        self.delivery.reduced_hook_stream = old.delivery.reduced_hook_stream
        self.zero_unused = old.zero_unused

    # ------------------------------------------------------------------ state machine
    def _to(self, new: GradState) -> None:
        if new not in _ALLOWED[self.state]:
            raise transition_error(self.state, new, f"gradient pipeline of {self.spec.owner_name}")
        self.state = new

    def refresh(self, params: list[ManagedParam]) -> None:
        """Rebuild the layout from the parameters' cached ``trainable`` flags (the unit keeps those current)."""
        if self.has_pending():
            raise RuntimeError(
                f"requires_grad of parameters in the unit rooted at {self.spec.owner_name} changed while "
                "gradients from no-sync micro-batches are pending; finish the accumulation with a synced backward "
                "(or zero_grad and start over) before freezing or unfreezing parameters"
            )
        self.input.refresh(params)
        # The parameters that take part, as of this refresh (the reduce-scatter input's layout holds them).
        self.trainable: list[ManagedParam] = self.input.trainable
        self.delivery.layout = self.input.rows

    def held_layout(self) -> bool | None:
        """The layout (flag columns or not) of the partial gradients held here: a buffer or HSDP partial sums fix it
        for the rest of their window. None: nothing held."""
        if self.input.buffer is None and self.replica_partial is None:
            return None
        return self.input.flagged

    def next_layout(self) -> bool:
        """Does this unit's next reduce-scatter carry flag columns? The layout held, else (a new window's buffer)
        only where the backward could not promise gradients."""
        held = self.held_layout()
        return self.input.flags_needed and not self.zero_unused if held is None else held

    def has_pending(self) -> bool:
        return self.state is not GradState.IDLE or self.replica_partial is not None

    # ------------------------------------------------------------------ filling the buffer
    def held_tensors(self) -> list[torch.Tensor]:
        """What the unit holds between steps besides ``.grad``: an accumulation window's buffer or one rank's sums
        held in place, HSDP's partial sums (``fc.move_to_host`` moves them)."""
        held = [t for t in (self.input.buffer, self.replica_partial) if t is not None]
        return held + list(self.held_in_place.values())

    def capture(self, mp: ManagedParam) -> None:
        """Post-accumulate-grad hook of a full parameter: while accumulating, move its gradient into the buffer (on
        one rank, onto the sums held in place).

        In a no-sync micro-batch (and in the synced one that ends an accumulation window) each gradient is written
        (or added) into the unit's buffer in the reduce-scatter layout as soon as autograd produced it, and freed, so
        the unit never holds all its full gradients next to the accumulation buffer.
        """
        if not self.takes_each_gradient():
            # A plain synced step: allocating the buffer at the first gradient would keep it alive for the rest of
            # the unit's backward (for the root, whose head gradient comes first, all of backward); stage() moves
            # the gradients at post-backward instead.
            return
        if self.state not in (GradState.IDLE, GradState.ACCUMULATING, GradState.STAGED):
            return  # a second use while this unit's reduction runs: stage() finishes that first, then flushes
        grad = local_grad(mp)
        if grad is None or id(mp) not in self.input.column:
            return
        pre, _ = self.divisors()
        self._write_one(mp, grad, pre)

    def takes_each_gradient(self) -> bool:
        """Is each gradient moved as autograd makes it (``capture``)? While accumulating, where a buffer exists, and
        onto the sums a window holds in place (a synced micro-batch then never holds a second full gradient)."""
        return self.accumulating or self.input.buffer is not None or bool(self.held_in_place)

    def needs_buffer(self) -> bool:
        """Will the next gradient taken open a new buffer (not held in place)?"""
        return self.input.buffer is None and not self._works_in_place()

    def _buffer_for_writing(self) -> None:
        if self.input.buffer is None:
            self.input.flagged = self.next_layout()  # HSDP partial sums held fix it until delivered
            self.input.new_buffer()
            self._to(GradState.ACCUMULATING)

    def _write_one(self, mp: ManagedParam, grad: torch.Tensor, pre: float) -> None:
        if self._works_in_place():
            self._hold_in_place(mp, grad, pre)
            if self.state is GradState.IDLE:
                self._to(GradState.ACCUMULATING)
            return
        self._spill_held()
        self._buffer_for_writing()
        self.input.write_one(mp, grad, pre)

    def _hold_in_place(self, mp: ManagedParam, grad: torch.Tensor, pre: float) -> None:
        """One rank, a no-sync micro-batch: the first gradient of the window stays where autograd made it (cast to
        the reduce dtype and divided where asked), later ones are added to it, as the plain model accumulates."""
        held = self.held_in_place.get(id(mp))
        if held is None:
            cast = grad.to(self.spec.reduce_dtype)
            if pre != 1.0:
                cast = cast.div_(pre) if cast is not grad else grad / pre
            self.held_in_place[id(mp)] = cast
        else:
            held.add_(grad, alpha=1.0 / pre)
        mp.full.grad = None  # type: ignore[union-attr]

    def _spill_held(self) -> None:
        """Gradients held in place move into the buffer (an extension or hook reading a flat buffer was set since)."""
        if not self.held_in_place:
            return
        held, self.held_in_place = self.held_in_place, {}
        if self.state is GradState.ACCUMULATING:
            self._to(GradState.IDLE)  # the buffer's window starts here
        for mp in self.trainable:
            grad = held.get(id(mp))
            if grad is not None:
                self._buffer_for_writing()
                self.input.write_one(mp, grad, 1.0)  # divided already

    def _flush(self) -> None:
        """Move gradients the hook did not see into the buffer (all of them in a plain synced step)."""
        pre, _ = self.divisors()
        for mp in self.trainable:
            grad = local_grad(mp)
            if grad is not None:
                self._write_one(mp, grad, pre)

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
        if self.state in (GradState.IDLE, GradState.ACCUMULATING) and self._works_in_place():
            pre, _ = self.divisors()
            self._stage_in_place(pre)
            self._to(GradState.STAGED)
            return
        if self.state is GradState.IDLE:
            pre, _ = self.divisors()
            if self.input.stage_all(pre, flagged=self.next_layout()):
                self._to(GradState.STAGED)
                return
        self._spill_held()
        self._flush()
        self._buffer_for_writing()
        self.input.complete()
        if self.state is not GradState.STAGED:
            self._to(GradState.STAGED)

    def _works_in_place(self) -> bool:
        """One rank with nothing to reduce, nothing in a buffer, no extension or hook reading a flat buffer and no
        offload: the gradients need no buffer (``_stage_in_place``, ``_hold_in_place``)."""
        spec = self.spec
        return (
            spec.dp.shard_size == 1
            and spec.dp.reduce_replicas is None
            and spec.extensions.reduce_scatter is None
            and self.delivery.reduced_hook is None
            and not spec.devices.offloaded
            and not self.zero_unused
            and self.input.buffer is None
            and self.replica_partial is None
        )

    def _stage_in_place(self, pre: float) -> None:
        """Each gradient stays where autograd made it and becomes the sharded ``.grad`` as it is (the plain model's
        gradient: no buffer, no copy; only a cast to the reduce dtype and a divide factor's division where those are
        asked for), added to what the window's no-sync micro-batches held. A parameter without a gradient on the one
        rank keeps ``.grad`` as it is, as in single-process training."""
        for mp in self.trainable:
            grad = local_grad(mp)
            if grad is not None and mp.full is not None:
                self._hold_in_place(mp, grad, pre)
        self.in_place, self.held_in_place = self.held_in_place, {}

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
        if self.in_place is not None:
            rows, self.in_place = self.in_place, None
            self.flight = _InFlight(None, None, None, False, False, synchronising, rows)
            self._to(GradState.REDUCE_SCATTERING)
            return
        flagged = self.input.flagged
        # Reading the flags costs a device sync, so only a rank that lacked a gradient itself reads them.
        missing_locally = len(self.input.locally_seen) < len(self.trainable)
        buffer = self.input.buffer  # handed to the reduce-scatter: the input side forgets it
        if buffer is None:
            raise internal_error(f"unit {self.spec.owner_name}", "buffer is missing")
        self.input.buffer = None
        self.input.locally_seen = set()
        spec = self.spec
        hook = spec.extensions.reduce_scatter
        work: Work | None = None
        if hook is None and spec.dp.shard_size == 1:
            output = buffer.view(-1)  # one rank's rows are the whole input: nothing to scatter, nothing to copy
        else:
            numel = self.input.layout.segment_numel + self.input.rows.tail(flagged)
            output = torch.empty(numel, dtype=spec.reduce_dtype, device=spec.device)
            with labelled(f"fsdp_compose::reduce_scatter[{self.spec.owner_name}]"):
                if hook is not None:
                    hook(output, buffer.view(-1), spec.reduce_group)
                else:
                    work = reduce_scatter_flat(output, buffer.view(-1), spec.reduce_group, async_op=True)
        # Kept alive until the wait unless the collective copied it already (gloo): then it is freed now.
        kept = buffer if work is not None and not spec.input_copied_at_issue else None
        del buffer
        self.flight = _InFlight(work, output, kept, missing_locally, flagged, synchronising)
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
        if flight.work is not None and self.state is GradState.REDUCE_SCATTERING:
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
        if flight is None:
            raise internal_error(f"unit {self.spec.owner_name}", "flight is missing")
        if only_if_done and flight.work is not None and not flight.work.is_completed():
            return
        self._wait_reduce_scatter(flight)
        replicas = self.spec.dp.reduce_replicas
        if replicas is None:
            self.finish()
            return
        if flight.output is None:
            raise internal_error(f"unit {self.spec.owner_name}", "an in-place gradient has replicas to reduce")
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
        if flight is None:
            raise internal_error(f"unit {self.spec.owner_name}", "flight is missing")
        self._wait_reduce_scatter(flight)
        if flight.work is not None:
            with labelled(f"fsdp_compose::all_reduce_wait[{self.spec.owner_name}]"):
                flight.work.wait()
        self.flight = None
        self._to(GradState.IDLE)
        if self.dropping:
            return
        _, post = self.divisors()
        with labelled(f"fsdp_compose::deliver_gradients[{self.spec.owner_name}]"):
            if flight.rows is not None:
                self.delivery.deliver_in_place(flight.rows, post=post, synchronising=flight.synchronising)
            elif flight.output is not None:
                self.delivery.deliver(
                    flight.output,
                    post=post,
                    missing_locally=flight.missing_locally,
                    flagged=flight.flagged,
                    synchronising=flight.synchronising,
                )

    # ------------------------------------------------------------------ gradients held between steps
    def drop_if_user_zeroed(self) -> bool:
        """Drop the held gradients when the user zeroed the sharded ``.grad`` since ``mark_held``; True if dropped."""
        if not self.has_pending():
            self.delivery.marks = {}  # what they marked was delivered
            return False
        if not self.delivery.user_zeroed():
            return False
        logger.info("%s: .grad was zeroed during gradient accumulation: held gradients dropped", self.spec.owner_name)
        self.discard()
        return True

    def discard(self) -> None:
        """Drop everything held or in flight (a failed step, a user's zero_grad). Waits for a running collective:
        every rank issued it, so every rank must complete it. Rows already reduced are handed out (they are final),
        except in a failed step (``dropping``): rows of it still waiting for their copy are its partial gradients."""
        if self.dropping:
            self.delivery.drop_pending()
        self.delivery.settle()
        flight = self.flight
        if flight is not None:
            self._wait_reduce_scatter(flight)
            if flight.work is not None:
                flight.work.wait()
        self.flight = None
        self.in_place = None
        self.held_in_place = {}
        self.input.buffer = None
        self.replica_partial = None
        self.input.written = set()
        self.input.locally_seen = set()
        self.delivery.marks = {}
        self.dropping = False
        self.state = GradState.IDLE


def divide_factors(dp: DataParallelMesh, divide_factor: float | None, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post) divisors whose product is the divide factor (default: the data-parallel size, replicas included).

    The data-parallel size is asked now, not taken from the mesh at ``fully_shard``: the shard size times the
    replicate group's current ``size()``. For c10d's groups that is the mesh's replicate size; a group that changes
    size (torchft's managed group: the live replicas) is asked at each reduction, as torch's ``fully_shard`` does (it
    asks the group for AVG or divides by its ``size()`` there). A size below 1 (torchft before any quorum) counts as 1.

    fp16 has a small range: the sum over ``world_size`` ranks of in-range values can overflow, so for fp16 every rank
    pre-divides by ``world_size`` (the sum of the quotients is then an average, in range whenever the inputs are) and
    the rest of the factor is applied after. Other dtypes have fp32's range: one post-division is the most accurate.
    """
    replicas = dp.replicate_group
    world_size = dp.shard_size if replicas is None else dp.shard_size * max(1, replicas.size())
    total = float(world_size if divide_factor is None else divide_factor)
    if reduce_dtype != torch.float16 or world_size <= 1:
        return 1.0, total
    pre = float(world_size)
    return pre, total / pre
