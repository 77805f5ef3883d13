"""Lightning Fabric's ``ModelParallelStrategy`` on 2 CPU gloo ranks (lightning_fabric_run.py, under torchrun):
``fc.fully_shard`` in the ``parallelize_fn`` against torch's, with gradient accumulation through
``fabric.no_backward_sync``.

fsdp_compose changes: the ``fully_shard`` of the user's ``parallelize_fn`` (with ``fsdp2_methods=True``), and one line
in Lightning's ``_FSDPNoSync`` guard (``or fc.has_fsdp2_methods(mod)``). Without the guard line Lightning skips
``set_requires_gradient_sync``: the numbers stay right but every micro-batch reduce-scatters (work doubled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


def _run(variant: str) -> dict[str, Any]:
    script = Path(__file__).with_name("lightning_fabric_run.py")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*command, str(script), variant], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[0].removeprefix("RESULT "))
    return result


def test_fabric_model_parallel_strategy_matches_torch_fully_shard() -> None:
    torch_run, fc_run, unpatched = _run("torch"), _run("fc"), _run("fc_unpatched")
    assert fc_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-6)
    for ours, theirs in zip(fc_run["params"], torch_run["params"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert fc_run["reduce_scatters"] == torch_run["reduce_scatters"] == [3, 3, 3]  # one per unit per step
    # Without the guard line: the same numbers, but both micro-batches reduce-scatter.
    assert unpatched["loss"] == pytest.approx(torch_run["loss"], rel=1e-5)
    assert unpatched["reduce_scatters"] == [6, 6, 6]
