"""Per-kind call counts and bytes of an ``fc.CollectiveRecorder`` run, as one flat dict (the integration runners
report them as JSON): ``{"all_gather": n, "all_gather_bytes": b, ...}``."""

from __future__ import annotations

import fsdp_compose as fc


def totals(recorder: fc.CollectiveRecorder) -> dict[str, int]:
    counts = dict(recorder.counts())
    for kind, nbytes in recorder.bytes_per_kind().items():
        counts[f"{kind}_bytes"] = nbytes
    return counts
