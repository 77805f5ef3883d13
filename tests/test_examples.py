"""The examples run under torchrun on 2 CPU ranks as the README says: a header, a line per step, a summary; the
loss goes down. The README's API tour (examples/tour.py) runs to the end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step +(\d+)  loss (\d+\.\d+)", re.M)


def _torchrun(script: str, *args: str) -> str:
    # PYTHONPATH: the scripts import fsdp_compose from this checkout, whatever is installed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _losses(stdout: str) -> list[float]:
    return [float(loss) for _, loss in STEP.findall(stdout)]


def _check_report(stdout: str, steps: int) -> None:
    """The header (world, mesh, fc.describe's layout), step 0 marked as including initialization, the summary."""
    assert "world size 2; mesh (2,) ('dp',) on cpu" in stdout
    assert "fsdp_compose: GPT with 3 sharded unit(s)" in stdout and "<root> (GPT)" in stdout
    lines = stdout.splitlines()
    first = next(line for line in lines if line.startswith("step   0"))
    assert first.endswith("(includes initialization)")
    assert sum("includes initialization" in line for line in lines) == 1
    losses = _losses(stdout)
    assert f"done: {steps} steps" in lines[-1] and f"first {losses[0]:.4f}, last {losses[-1]:.4f}" in lines[-1]


SMALL = ["--dim", "32", "--layers", "2", "--seq-len", "16", "--vocab", "64"]


def test_train_gpt_example() -> None:
    stdout = _torchrun("examples/train_gpt.py", "--steps", "12", "--lr", "1e-2", *SMALL)
    losses = _losses(stdout)
    assert len(losses) == 12 and losses[-1] < losses[0]
    _check_report(stdout, 12)


@pytest.mark.parametrize("frozen_params", ["shard", "replicate"])
def test_lora_finetune_example(frozen_params: str) -> None:
    stdout = _torchrun(
        "examples/lora_finetune.py", "--steps", "8", "--unfreeze-at", "4", "--frozen-params", frozen_params, *SMALL
    )
    losses = _losses(stdout)
    assert len(losses) == 8 and losses[-1] < losses[0]
    _check_report(stdout, 8)
    assert "12 frozen" in stdout  # the header's layout: every block's base weights are frozen


# Depends on the engine change that hands a unit's floating outputs back in the dtype its inputs came in when it
# cast them to a lower param_dtype (output_dtype=None): the tour shards the blocks with a bf16 policy and leaves the
# root at the default, and until then the root's fp32 head raises "expected m1 and m2 to have the same dtype".
def test_readme_tour_runs() -> None:
    stdout = _torchrun("examples/tour.py")
    assert "fsdp_compose: GPT with 5 sharded unit(s)" in stdout
    losses = re.findall(r"rank (\d): FSDP \+ TP loss (\d+\.\d+)", stdout)
    assert sorted(rank for rank, _ in losses) == ["0", "1"]
    assert len({loss for _, loss in losses}) == 1  # the two ranks are one TP group: one loss
    assert stdout.count("tour done") == 2
