"""The reduce-scatter input of one unit: the layout of its trainable parameters' gradients and the buffer they are
written into (``grads.UnitGradients`` runs the state machine around it).

The buffer is ``(world_size, segment + tail)``: row ``r`` is what rank ``r`` receives, each trainable parameter's
gradient split with the same ``torch.chunk`` rows as the parameter (padding zeroed), so the reduce-scatter moves
exactly the bytes of the trainable parameters (frozen ones are not in it). The tail holds, where needed, one "had a
gradient" count per trainable parameter (``flagged``), then the gradients of 0-dim parameters.

Flags are needed only when a backward cannot promise that every trainable parameter gets a gradient on some rank.
It can usually promise it before any gradient exists: the full parameters' accumulating autograd nodes are held
(``note_accumulators``, when the unit is gathered for forward), and at the start of a backward autograd says whether
it will run each of them (``expects_gradient``); the step's agreement combines the ranks' answers.
"""

from __future__ import annotations

import torch

from .autograd_hooks import gradient_node
from .delivery import ReduceSpec, RowsLayout
from .flat import ManagedParam, local_grad
from .sharding import FlatLayout, chunk_rows, write_grad_into_segments
from .transitions import internal_error

__all__ = ["ReduceScatterInput"]


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

    def new_layout(self, *, zero_unused: bool) -> bool:
        """Does a new window's buffer get flag columns? Only where the backward could not promise gradients."""
        return self.flags_needed and not zero_unused

    def choose_layout(self, *, zero_unused: bool) -> None:
        self.flagged = self.new_layout(zero_unused=zero_unused)

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

    def stage_all(self, pre: float, *, zero_unused: bool | None) -> bool:
        """The common case in one op: nothing accumulated and every trainable parameter has its gradient here.

        ``torch._chunk_cat`` chunks each gradient on dim 0 into ``world_size`` padded chunks and lays chunk ``r`` of
        every gradient end to end in row ``r``: exactly the reduce-scatter layout, padding zeroed, cast to the reduce
        dtype in the same pass. A block of ones fills the flag columns, 0-dim gradients their columns.
        Returns False (nothing written) when the case does not apply.
        """
        spec = self.spec
        world_size = spec.dp.shard_size
        for slot in self.layout.slots:
            if slot.dim != 0:
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
        if pre != 1.0 and dtype != spec.reduce_dtype:
            return False  # the per-parameter path divides before the cast (bit-identical results either way)
        if zero_unused is not None:  # None: keep the layout of the partial sums held
            self.choose_layout(zero_unused=zero_unused)
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

    def take(self) -> torch.Tensor:
        """The staged buffer, handed to the reduce-scatter (this side forgets it)."""
        buffer = self.buffer
        if buffer is None:
            raise internal_error(f"unit {self.spec.owner_name}", "buffer is missing")
        self.buffer = None
        self.locally_seen = set()
        return buffer
