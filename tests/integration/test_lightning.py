"""Lightning's ``ModelParallelStrategy`` on 2 CPU gloo ranks, with Fabric (lightning_fabric_run.py) and with the
``Trainer`` (lightning_trainer_run.py), under torchrun: ``fc.fully_shard`` where the user's code called torch's, with
gradient accumulation (``fabric.no_backward_sync``; ``accumulate_grad_batches=2``).

fsdp_compose changes: the ``fully_shard`` of the user's ``parallelize_fn`` (with ``fsdp2_methods=True``), and one line
in Lightning's ``_FSDPNoSync`` guard (``or fc.has_fsdp2_methods(mod)``). Without the guard line Lightning skips
``set_requires_gradient_sync``: the numbers stay right but every micro-batch reduce-scatters (work doubled).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.launch import run_script

pytest.importorskip("lightning")


def _run(variant: str) -> dict[str, Any]:
    return run_script("lightning_fabric_run.py", variant)


def test_fabric_model_parallel_strategy_matches_torch_fully_shard() -> None:
    torch_run, fc_run, unpatched, ported = _run("torch"), _run("fc"), _run("fc_unpatched"), _run("fc_ported")
    assert fc_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-6)
    for ours, theirs in zip(fc_run["params"], torch_run["params"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert fc_run["reduce_scatters"] == torch_run["reduce_scatters"] == [3, 3, 3]  # one per unit per step
    # fc.ported("lightning") applies the guard line for the block: the same as the edited source
    assert ported["loss"] == fc_run["loss"] and ported["params"] == fc_run["params"]
    assert ported["reduce_scatters"] == [3, 3, 3]
    # Without the guard line: the same numbers, but both micro-batches reduce-scatter.
    assert unpatched["loss"] == pytest.approx(torch_run["loss"], rel=1e-5)
    assert unpatched["reduce_scatters"] == [6, 6, 6]


def test_trainer_model_parallel_strategy_matches_torch_fully_shard() -> None:
    torch_run = run_script("lightning_trainer_run.py", "torch")
    fc_run = run_script("lightning_trainer_run.py", "fc")
    assert fc_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-6)
    for ours, theirs in zip(fc_run["params"], torch_run["params"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    # The Trainer's accumulation blocks gradient sync for DDP only, so with either library every micro-batch
    # reduce-scatters: 3 units x 2 micro-batches x 3 steps. No guard to patch.
    assert fc_run["reduce_scatters"] == torch_run["reduce_scatters"] == 18
