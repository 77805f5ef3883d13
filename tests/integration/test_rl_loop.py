"""examples/rl_loop.py (a GRPO-style loop on a tiny transformers Llama: rollout by ``generate``, a reference by
``deepcopy``, a policy step, bf16 weights streamed into an unsharded engine copy, the policy moved off the device and
back) on 2 CPU gloo ranks, fsdp_compose against torch's ``fully_shard``: the same losses and rewards at every
iteration, and the engine's weights equal to the policy's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.launch import ROOT

pytest.importorskip("transformers")


def _run(impl: str) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, str(ROOT / "examples" / "rl_loop.py"), "--impl", impl, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


def test_the_rl_loop_example_matches_torch_fully_shard() -> None:
    ours, theirs = _run("fc"), _run("torch")
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6, abs=1e-7)
    assert ours["reward"] == theirs["reward"]
    assert all(ours["engine_equal"]) and all(theirs["engine_equal"])
