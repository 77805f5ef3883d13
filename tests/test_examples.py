"""The examples run under torchrun on 2 CPU ranks as the README says, and their loss goes down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script: str, *args: str) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]


SMALL = ["--dim", "32", "--layers", "2", "--seq-len", "16", "--vocab", "64"]


def test_train_gpt_example() -> None:
    losses = _torchrun("examples/train_gpt.py", "--steps", "12", "--lr", "1e-2", *SMALL)
    assert len(losses) == 12 and losses[-1] < losses[0]


@pytest.mark.parametrize("frozen_params", ["shard", "replicate"])
def test_lora_finetune_example(frozen_params: str) -> None:
    losses = _torchrun(
        "examples/lora_finetune.py", "--steps", "8", "--unfreeze-at", "4", "--frozen-params", frozen_params, *SMALL
    )
    assert len(losses) == 8 and losses[-1] < losses[0]
