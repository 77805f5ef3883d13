"""Peak live tensor bytes during a region of code, counted the same way for every implementation.

The counter lives in the library, :mod:`fsdp_compose.plan.live_bytes` (the planner counts a simulated rank's memory
with it); this module re-exports it for the benchmark scripts. See that module's docstring for what is and isn't
counted. The benchmarks use its defaults: every tracked storage's size re-read after every op, storages first seen
as op inputs counted as pre-existing C++ buffers (``hidden_bytes``) or, inside ``collective_scope``, as a
collective's temporaries (``late_bytes``), and a ``DTensor`` op seen once, from outside.

:func:`gloo_reduce_scatter_copies` adds what no op shows: gloo's reduce-scatter clones its input inside the call
(``ProcessGroupGloo::reduce_scatter_tensor_coalesced``: clone, all-reduce the clone, copy this rank's chunk out at
the wait), so an asynchronous one holds a copy of its input from the call to the wait. A synchronous one (torch
FSDP2 on CPU) waits inside the call, where the counter meets the copy anyway.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compose.plan.live_bytes import LiveBytesCounter, live_storage_keys, storages_of, tensors_since

__all__ = ["LiveBytesCounter", "gloo_reduce_scatter_copies", "live_storage_keys", "storages_of", "tensors_since"]

GLOO_COPY = "gloo copy"


@contextlib.contextmanager
def gloo_reduce_scatter_copies(counter: LiveBytesCounter) -> Iterator[None]:
    """Count the copy gloo makes of an asynchronous reduce-scatter's input, from the call until ``Work.wait``."""
    restore: list[tuple[Any, str, Any]] = []

    def issuing(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = original(output, input, *args, **kwargs)
            group = kwargs.get("group")
            if work is not None and input.device.type == "cpu" and str(dist.get_backend(group)) == "gloo":
                counter.hold(work, input.numel() * input.element_size(), GLOO_COPY)
            return work

        return call

    original_wait = dist.Work.wait

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        counter.release(work)  # from here on the copy is met by the ops of the wait itself
        return original_wait(work, *args, **kwargs)

    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is not None:
            restore.append((dist, name, original))
            setattr(dist, name, issuing(original))
    restore.append((dist.Work, "wait", original_wait))
    dist.Work.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)
