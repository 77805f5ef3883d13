"""Peak live tensor bytes during a region of code, counted the same way for every implementation.

The counter lives in the library, :mod:`fsdp_compose.plan.live_bytes` (the planner counts a simulated rank's memory
with it); this module re-exports it for the benchmark scripts. See that module's docstring for what is and isn't
counted. The benchmarks use its defaults: every tracked storage's size re-read after every op, storages first seen
as op inputs counted as pre-existing C++ buffers (``hidden_bytes``) or, inside ``collective_scope``, as a
collective's temporaries (``late_bytes``), and a ``DTensor`` op seen once, from outside.
"""

from __future__ import annotations

from fsdp_compose.plan.live_bytes import LiveBytesCounter, live_storage_keys, storages_of, tensors_since

__all__ = ["LiveBytesCounter", "live_storage_keys", "storages_of", "tensors_since"]
