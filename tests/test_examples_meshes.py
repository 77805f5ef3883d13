"""examples/train_gpt.py on 4 CPU ranks with HSDP (--hsdp 2), FSDP + TP (--tp 2) and both (3-D, 2 x 1 x 2)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples.train_gpt import build_meshes

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--dim", "32", "--layers", "2", "--seq-len", "16", "--vocab", "64", "--steps", "6", "--lr", "1e-2"]


@functools.cache
def _losses(*mesh_args: str) -> tuple[float, ...]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    command += ["examples/train_gpt.py", *SMALL, *mesh_args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tuple(float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout))


def test_hsdp_example_trains() -> None:
    losses = _losses("--hsdp", "2")
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_tp_example_trains_like_hsdp() -> None:
    losses = _losses("--tp", "2")
    assert len(losses) == 6 and losses[-1] < losses[0]
    # Both see the same global batch, split over 4 resp. 2 data-parallel ranks: the same losses up to rounding.
    assert losses == pytest.approx(_losses("--hsdp", "2"), abs=2e-3)


@pytest.mark.slow
def test_hsdp_tp_3d_example_trains() -> None:
    losses = _losses("--hsdp", "2", "--tp", "2")  # 4 ranks: 2 replicas x 1 shard x 2-way TP
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.parametrize("replicas, tp", [(3, 1), (1, 3), (2, 4), (0, 1)])
def test_degrees_that_do_not_divide_the_world_exit_with_a_message(replicas: int, tp: int) -> None:
    with pytest.raises(SystemExit, match="does not divide the 4 ranks"):
        build_meshes("cpu", 4, replicas, tp)
