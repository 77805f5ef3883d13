"""All-gathers and reduce-scatters issued in a worker with their bytes, through ``fc.CollectiveRecorder`` (the one
recorder of tests, benchmarks and the planner): both torch's fully_shard and fsdp_compose look the collectives up
at call time. The bytes are the collective's output (all-gather) or input (reduce-scatter) on this rank."""

from __future__ import annotations

import fsdp_compose as fc


class CollectiveBytes(fc.CollectiveRecorder):
    def summary(self) -> dict[str, int]:
        counts, nbytes = self.counts(), self.bytes_per_kind()
        return {
            "all_gather": counts["all_gather"],
            "all_gather_bytes": nbytes["all_gather"],
            "reduce_scatter": counts["reduce_scatter"],
            "reduce_scatter_bytes": nbytes["reduce_scatter"],
        }
