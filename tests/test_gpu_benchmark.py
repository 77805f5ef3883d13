"""benchmarks/gpu.py runs end to end on a tiny config on CPU (the GPU run uses the same code with --device cuda)."""

from __future__ import annotations

import math

from benchmarks.gpu import main


def test_tiny_cpu_run_trains_both_implementations_alike() -> None:
    results = main(["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--ac", "both"])
    assert [r["ac"] for r in results] == [False, True]
    for r in results:
        assert set(r["median_ms"]) == {"fsdp_compose", "torch_fsdp2"} and r["ratio"] > 0
        ours, theirs = r["loss"]["fsdp_compose"], r["loss"]["torch_fsdp2"]
        assert math.isfinite(ours) and math.isclose(ours, theirs, rel_tol=1e-3), (ours, theirs)
