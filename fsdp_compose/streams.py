"""Device-generic events: where the host must wait for the device, and nothing on a CPU device.

A CPU device runs every op to completion before the next, so there is nothing to wait for and no event to record;
on an accelerator an event is recorded on the current stream. Code using these helpers runs the same path on both.
"""

from __future__ import annotations

import torch

__all__ = ["record_event"]


def record_event(device: torch.device) -> torch.Event | None:
    """An event recorded on ``device``'s current stream, or None on a CPU device (nothing is pending there)."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event
