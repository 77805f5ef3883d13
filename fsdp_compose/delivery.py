"""From a unit's reduced gradient rows to the sharded ``.grad`` of its parameters, and the gradients held between
backwards.

``grads.UnitGradients`` fills the reduce-scatter input and runs the reduction; what comes out is one flat tensor per
rank: this rank's rows of every trainable parameter (the segment), then the tail (``RowsLayout``). Handing it out
is this module's job, because it is where the host may have to wait for the device:

- the "had a gradient" counts (present only when the backward's agreement could not promise every gradient) tell a
  rank that lacked some gradient whether another rank had it: a parameter no rank had one for keeps ``.grad = None``;
- under CPU offload the sharded ``.grad`` lives in host memory.

Both need a device-to-host copy: ``deliver`` starts it and records an event, ``settle`` (the final callback) waits
for it once. Rows also wait for ``settle`` while the step may still turn out abandoned (``hold``: the backward's
agreement is read in the final callback). Otherwise the rows become ``.grad`` at once, as views of the reduce-scatter
output (no copy).

Between no-sync backwards a unit holds gradients that are not in ``.grad`` yet; ``mark_held`` makes a user's
``zero_grad()`` visible (``user_zeroed``), so the held ones are dropped with it, as a single process would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .collectives import current_stream, issued_on, record_event
from .extensions import ShardExtensions
from .flat import ManagedParam
from .meshes import DataParallelMesh
from .offload import UnitDevices
from .transitions import internal_error

__all__ = ["GradientDelivery", "ReduceSpec", "RowsLayout"]


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

    @functools.cached_property
    def input_copied_at_issue(self) -> bool:
        """Does the reduce-scatter copy its input before the call returns (then nothing needs the input while it
        runs)? gloo's does on a CPU device: ``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` clones the input
        and all-reduces the clone. Elsewhere (NCCL reads the input as it runs) the input is kept until the wait."""
        if self.device.type != "cpu":
            return False
        return str(dist.get_backend(self.reduce_group)) == "gloo"


@dataclass(frozen=True)
class RowsLayout:
    """Where each trainable parameter's rows are in one rank's reduced output: the segment (sharded parameters at
    ``rows_at``: size, stride, element offset), then the flag counts (if flagged), then the 0-dim gradients."""

    segment: int
    trainable: list[ManagedParam]
    rows_at: dict[int, tuple[tuple[int, ...], tuple[int, ...], int]]
    scalar: dict[int, int]  # id(mp) -> index among the 0-dim trainable parameters

    def tail(self, flagged: bool) -> int:
        """Columns after the segment: the flag counts (when ``flagged``), then the 0-dim gradients."""
        return (len(self.trainable) if flagged else 0) + len(self.scalar)

    def scalar_column(self, mp: ManagedParam, flagged: bool) -> int:
        return self.segment + self.tail(flagged) - len(self.scalar) + self.scalar[id(mp)]


@dataclass
class _Delivery:
    """Reduced rows on their way to ``.grad``: the output (host memory under offload), the flags a rank that lacked
    a gradient reads (host), and the event after which the host may read both (None: nothing to wait for)."""

    output: torch.Tensor | None  # None: ``rows`` holds each parameter's gradient (``deliver_in_place``)
    flags: torch.Tensor | None
    ready: torch.Event | None
    synchronising: bool
    flagged: bool
    rows: dict[int, torch.Tensor] | None = None


class GradientDelivery:
    """The delivery side of one unit's gradients (see the module docstring)."""

    def __init__(self, spec: ReduceSpec, layout: RowsLayout) -> None:
        self.spec = spec
        self.layout = layout
        self.pending: list[_Delivery] = []  # reduced, waiting for a device-to-host copy
        # FSDP2's set_all_reduce_hook: called on this rank's reduced rows before they become ``.grad`` (and the stream
        # it runs on, None: the current one).
        self.reduced_hook: Callable[[torch.Tensor], None] | None = None
        self.reduced_hook_stream: torch.Stream | None = None
        self.on_finished: Callable[[], None] | None = None  # e.g. the optimizer step in backward
        # Set by the step while no rank is known not to have abandoned it (the backward's agreement is read in the
        # final callback): reduced rows wait in ``pending`` until ``settle``, or are dropped with the step.
        self.hold = False
        # (id of .grad, its version) per parameter when held gradients were last left between steps: a user's
        # zero_grad changes them, which tells that the held gradients must be dropped too. Forgotten (emptied) once
        # nothing is held; ``_placeholders`` stay: a zero placeholder the user zeroed in place is still ``.grad`` and
        # must be replaced, not added into, at the next delivery.
        self.marks: dict[int, tuple[int, int, int]] = {}
        self._placeholders: dict[int, int] = {}  # id(mp) -> id of the zero .grad that mark_held put there

    def deliver(
        self, output: torch.Tensor, *, post: float, missing_locally: bool, flagged: bool, synchronising: bool
    ) -> None:
        """Start handing out the reduced rows: the device-side part now, the rest once the host may read them.

        Within a backward the host waits (``settle``) in the final callback, so nothing in backward waits for the
        device; outside one it settles at once.
        """
        spec, layout = self.spec, self.layout
        if post != 1.0:
            output.div_(post)
        if self.reduced_hook is not None:
            self._run_reduced_hook(output, flagged)
        missing = missing_locally and flagged
        flags = output[layout.segment : layout.segment + len(layout.trainable)] > 0 if missing else None
        grad_dtype = spec.grad_dtype
        if output.dtype != grad_dtype:
            output = output.to(grad_dtype)  # one cast for the unit (an elementwise cast: same values)
        delivery = _Delivery(output, flags, None, synchronising, flagged)
        devices = spec.devices
        if devices.offloaded or flags is not None:
            delivery.output = devices.to_shard(output)  # offloaded: the sharded .grad lives in host memory
            if flags is not None:
                delivery.flags = devices.to_host(flags)
            delivery.ready = record_event(spec.device)
        elif not self.hold:
            self._hand_out(delivery)
            return
        self.pending.append(delivery)
        if not self.hold and torch._C._current_graph_task_id() == -1:  # no final callback will settle it
            self.settle()

    def deliver_in_place(self, rows: dict[int, torch.Tensor], *, post: float, synchronising: bool) -> None:
        """One rank's gradients, each as autograd made it (``id(ManagedParam) -> gradient``; a parameter without
        one is absent), divided by ``post`` and handed out as ``deliver`` would hand out reduced rows."""
        if post != 1.0:
            torch._foreach_div_(list(rows.values()), post)
        delivery = _Delivery(None, None, None, synchronising, False, rows)
        if self.hold:
            self.pending.append(delivery)
        else:
            self._hand_out(delivery)

    def _run_reduced_hook(self, output: torch.Tensor, flagged: bool) -> None:
        """FSDP2's all-reduce hook: ``hook(rows)`` on this rank's reduced, divided gradient rows in the reduce dtype
        (after the HSDP all-reduce), one flat tensor; what it writes in place is what ``.grad`` receives. The
        "had a gradient" flags are not in it; 0-dim gradients (kept in the tail) are appended and copied back."""
        if self.reduced_hook is None:
            raise internal_error(f"unit {self.spec.owner_name}", "self.reduced_hook is missing")
        layout = self.layout
        segment, count = layout.segment, len(layout.scalar)
        start = segment + layout.tail(flagged) - count
        scalars = output[start : start + count]
        rows = torch.cat([output[:segment], scalars]) if count else output[:segment]
        device = self.spec.device
        stream = self.reduced_hook_stream if device.type != "cpu" else None
        with issued_on(stream, device):
            self.reduced_hook(rows)
        if stream is not None:
            current_stream(device).wait_stream(stream)
        if count:
            output[:segment].copy_(rows[:segment])
            scalars.copy_(rows[segment:])

    def settle(self) -> None:
        """Wait for the copies ``deliver`` started and hand their rows out (the end of backward)."""
        pending, self.pending = self.pending, []
        for delivery in pending:
            if delivery.ready is not None:
                delivery.ready.synchronize()
            self._hand_out(delivery)

    def drop_pending(self) -> None:
        """A failed step: rows still waiting for their copy are its partial gradients; wait for the copies, drop."""
        for delivery in self.pending:
            if delivery.ready is not None:
                delivery.ready.synchronize()
        self.pending = []

    def _hand_out(self, delivery: _Delivery) -> None:
        """Every rank's rows become (or are added to) the sharded ``.grad``; hooks and ``on_finished`` run after."""
        output, layout, in_place = delivery.output, self.layout, delivery.rows
        had_grad = None if delivery.flags is None else delivery.flags.tolist()
        if in_place is not None:
            had_grad = [id(mp) in in_place for mp in layout.trainable]
        adds: list[torch.Tensor] = []
        into: list[torch.Tensor] = []
        delivered = []
        for index, mp in enumerate(layout.trainable):
            if had_grad is not None and not had_grad[index]:
                continue
            if in_place is not None:
                rows = in_place[id(mp)]
            elif output is None:
                raise internal_error(f"unit {self.spec.owner_name}", "reduced rows are missing")
            elif id(mp) in layout.scalar:
                rows = output.as_strided((), (), output.storage_offset() + layout.scalar_column(mp, delivery.flagged))
            else:
                size, stride, offset = layout.rows_at[id(mp)]
                rows = output.as_strided(size, stride, output.storage_offset() + offset)
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
            # Hooks users registered on the sharded parameters (``register_post_accumulate_grad_hook``): autograd
            # never accumulates into them, so they run here, once the gradient is final.
            for mp in delivered:
                hooks = getattr(mp.sharded, "_post_accumulate_grad_hooks", None)
                if hooks:
                    for hook in list(hooks.values()):
                        hook(mp.sharded)
        if delivery.synchronising and self._placeholders:
            # A parameter no rank had a gradient for keeps ``.grad = None`` (as in single-process training), also
            # where a held-gradient placeholder stood: otherwise optimizers would step it (weight decay, momentum).
            for index, mp in enumerate(layout.trainable):
                placeholder = self._placeholders.get(id(mp))
                got_one = had_grad is None or had_grad[index]
                if placeholder is not None and not got_one and id(mp.sharded.grad) == placeholder:
                    mp.sharded.grad = None
            self._placeholders = {}
        if self.on_finished is not None:
            self.on_finished()

    # ------------------------------------------------------------------ gradients held between steps
    def mark_held(self) -> None:
        """Gradients stay held past this backward (no-sync): make ``.grad`` tell us if the user drops them.

        Each trainable parameter without a sharded ``.grad`` gets a zero one (no memory: a broadcast zero), and its
        identity and version are noted: ``zero_grad()`` either sets it to None or zeroes it in place, and
        ``user_zeroed`` sees either at the next step.
        """
        self.marks = {}
        for mp in self.layout.trainable:
            grad = mp.sharded.grad
            if grad is None:
                # One zero broadcast to the shard's shape: it costs no memory (a real zero gradient here would add
                # a sharded gradient's worth to the whole accumulation window) and still records zero_grad.
                local = mp.sharded._local_tensor
                zeros = torch.zeros((), dtype=local.dtype, device=local.device).expand(local.shape)
                grad = DTensor(zeros, mp.sharded._spec, requires_grad=False)  # the parameter's own spec (same dtype)
                mp.sharded.grad = grad
                self._placeholders[id(mp)] = id(grad)
            self.marks[id(mp)] = (id(grad), *_versions(grad))

    def user_zeroed(self) -> bool:
        """Whether the user zeroed (or set to None) a sharded ``.grad`` since ``mark_held`` (then the marks go)."""
        for mp in self.layout.trainable:
            mark = self.marks.get(id(mp))
            grad = mp.sharded.grad
            if mark is None:
                continue
            if grad is None or id(grad) != mark[0] or _zeroed_in_place(grad, mark):
                self.marks = {}
                return True
        return False


def _zeroed_in_place(grad: torch.Tensor, mark: tuple[int, int, int]) -> bool:
    return _versions(grad) != mark[1:] and not bool(grad._local_tensor.any())  # type: ignore[attr-defined]


def _versions(grad: torch.Tensor) -> tuple[int, int]:
    """Version counters of a sharded ``.grad`` and of its local tensor: an in-place zero_ bumps at least one."""
    local = getattr(grad, "_local_tensor", grad)
    return grad._version, local._version
