"""tests/cuda_check.py's cases on CPU: the script a lent GPU runs (benchmarks/gpu_session.sh) stays runnable and its
cases stay honest here, where they take the CPU side (each compares with a single-process reference or with torch's
``fully_shard``)."""

from __future__ import annotations

import pytest

from tests.cuda_check import CASES, run_cases


@pytest.mark.parametrize("ws", [1, 2])
def test_cuda_check_cases_pass_on_cpu(run_dist, ws: int) -> None:
    names = [name for name, (_, _, smallest) in CASES.items() if smallest <= ws]
    for rank_rows in run_dist(ws, run_cases, "cpu", names):
        assert [row["case"] for row in rank_rows] == names
        failed = [row for row in rank_rows if not row["ok"]]
        assert not failed, failed


def test_cuda_check_hsdp_case_passes_on_cpu(run_dist) -> None:
    for rank_rows in run_dist(4, run_cases, "cpu", ["hsdp"]):
        assert [(row["case"], row["ok"]) for row in rank_rows] == [("hsdp", True)], rank_rows
