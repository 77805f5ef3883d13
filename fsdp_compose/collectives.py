"""The flat collectives a unit issues, under whichever names this torch release has, looked up at every call.

torch 2.13 names them ``all_gather_single`` / ``reduce_scatter_single`` and warns on the older
``all_gather_into_tensor`` / ``reduce_scatter_tensor``; releases before that only have the older names. Every call
reads the function from ``torch.distributed`` at that moment, as torch's ``fully_shard`` does, so code that replaces
``torch.distributed.all_gather_single`` (torch's own tests, :class:`fsdp_compose.recorder.CollectiveRecorder`) sees
each call. The new name is called where it exists; the older name only where it is the one that was replaced (the
new one being torch's own): a replacement of either name is seen, and fsdp_compose never calls torch's deprecated
functions itself (no ``FutureWarning``). Nothing is patched here.

The streams they overlap compute on are here too: device-generic side streams and events, and nothing at all on a
CPU device. One rule keeps every buffer's lifetime correct without ``record_stream``: a stream reads what another
wrote, or reuses a block another used, only after waiting for that other stream. The compute stream waits for a
side stream's event (and for a collective, through ``Work.wait``) before it reads what the side stream wrote; the
all-gathers' side stream allocates its own buffers, waits for the compute stream once per step before reading the
shards the optimizer wrote (``wait_for_compute``), and waits for each copy-out before the buffers it read go back to
its pool; the stream a user gives ``set_all_reduce_hook`` waits for the compute stream before the hook runs
(``issued_on``). docs/design.md,
"Streams", has the whole rule. A CPU device runs every op to completion before the next, so there is no side
stream and no event: the helpers return None and the callers run the same code on the current thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.profiler import record_function

__all__ = [
    "Work",
    "all_gather_flat",
    "all_reduce",
    "all_reduce_max",
    "current_stream",
    "issued_on",
    "labelled",
    "record_event",
    "reduce_scatter_flat",
    "side_stream",
    "wait_for",
    "wait_for_compute",
]


class Work(Protocol):
    """What an asynchronous collective returns."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


def _resolve(new: str, old: str) -> Any:
    """``torch.distributed``'s function named ``new`` now, or ``old`` where only that one was replaced or exists."""
    current = getattr(dist, new, None)
    if current is None:
        return getattr(dist, old)
    replaced_old = getattr(dist, old, None)
    if (
        replaced_old is not None
        and replaced_old is not getattr(c10d, old, None)
        and current is getattr(c10d, new, None)
    ):
        return replaced_old
    return current


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool
) -> Work | None:
    """Concatenate every rank's equally sized ``shard`` into ``output`` (rank-major)."""
    return cast(
        "Work | None",
        _resolve("all_gather_single", "all_gather_into_tensor")(output, shard, group=group, async_op=async_op),
    )


def reduce_scatter_flat(
    output: torch.Tensor, buffer: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool
) -> Work | None:
    """Sum ``buffer`` over ranks and give rank ``r`` the ``r``-th equal slice in ``output``."""
    reduce_scatter = _resolve("reduce_scatter_single", "reduce_scatter_tensor")
    return cast("Work | None", reduce_scatter(output, buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Work | None:
    """Sum ``tensor`` over ranks in place."""
    return cast("Work | None", dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op))


def labelled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.profiler`` range named ``name`` while a profiler runs; nothing otherwise.

    Every phase of a step is labelled (``fsdp_compose::all_gather``, ...), but a range costs two dispatcher ops even
    with no profiler attached, and a step has dozens: they are only entered when someone is looking.
    """
    enabled = torch.autograd._profiler_enabled()  # type: ignore[attr-defined]
    return record_function(name) if enabled else contextlib.nullcontext()


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False) -> Work | None:
    """Element-wise maximum of ``tensor`` over ranks, in place (a step's agreement: a few integers)."""
    return cast("Work | None", dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=async_op))


def side_stream(device: torch.device) -> torch.Stream | None:
    """A new stream on ``device`` for work that should overlap compute (None on a CPU device)."""
    if device.type == "cpu":
        return None
    return torch.Stream(device=device)


def current_stream(device: torch.device) -> torch.Stream:
    """The compute stream: the one the caller's ops go to."""
    return torch.accelerator.current_stream(device)


def wait_for_compute(stream: torch.Stream, device: torch.device) -> None:
    """Order ``stream`` after everything queued on the compute stream so far (no host wait)."""
    stream.wait_stream(current_stream(device))


@contextlib.contextmanager
def issued_on(stream: torch.Stream | None, device: torch.device) -> Iterator[None]:
    """Run the block's ops on ``stream`` after everything already queued on the compute stream (or just run it)."""
    if stream is None:
        yield
        return
    wait_for_compute(stream, device)
    with stream:
        yield


def record_event(device: torch.device, stream: torch.Stream | None = None) -> torch.Event | None:
    """An event recorded on ``stream`` (default: the current stream of ``device``); None on a CPU device."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record(stream)
    return event


def wait_for(event: torch.Event | None, device: torch.device) -> None:
    """Make the compute stream wait for ``event`` (no host wait; nothing to do without one)."""
    if event is not None:
        current_stream(device).wait_event(event)
