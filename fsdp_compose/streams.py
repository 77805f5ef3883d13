"""Device-generic streams and events, and nothing at all on a CPU device.

One rule keeps every buffer's lifetime correct without ``record_stream``: a buffer is allocated on the compute (the
current) stream; work issued on a side stream first waits for the compute stream; the compute stream waits for the
side stream's event (and for a collective, through ``Work.wait``) before it reads or frees anything the side stream
touched. A freed block is then only reused by work ordered after everything that used it. See docs/design.md,
"Streams".

A CPU device runs every op to completion before the next, so there is no side stream and no event: the helpers
return None and the callers run the same code on the current thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["current_stream", "issued_on", "record_event", "side_stream", "wait_for"]


def side_stream(device: torch.device) -> torch.Stream | None:
    """A new stream on ``device`` for work that should overlap compute (None on a CPU device)."""
    if device.type == "cpu":
        return None
    return torch.Stream(device=device)


def current_stream(device: torch.device) -> torch.Stream:
    """The compute stream: the one the caller's ops go to."""
    return torch.accelerator.current_stream(device)


@contextlib.contextmanager
def issued_on(stream: torch.Stream | None, device: torch.device) -> Iterator[None]:
    """Run the block's ops on ``stream`` after everything already queued on the compute stream (or just run it)."""
    if stream is None:
        yield
        return
    stream.wait_stream(current_stream(device))
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
