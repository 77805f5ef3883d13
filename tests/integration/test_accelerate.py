"""accelerate 1.15's ``Accelerator.prepare`` with the FSDP2 plugin on 2 CPU gloo ranks (accelerate_run.py, under
torchrun), torch's ``fully_shard`` against fsdp_compose under ``fc.ported("accelerate")``: accelerate shards the
model itself (transformer-based auto wrap), or the user shards it before ``prepare``. Gradient accumulation through
``accelerator.accumulate`` (accelerate's FSDP2 no-sync: ``model.set_requires_gradient_sync(False)``).

Per step: the same losses, parameters, all-gathers and reduce-scatters (count and bytes; one reduce-scatter per
unit). Without the port a model fsdp_compose sharded is sharded again by torch's
``fully_shard`` inside ``prepare``, which fails."""

from __future__ import annotations

import pytest

from tests.integration.launch import run_script

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@pytest.mark.parametrize("presharded", [False, True])
def test_accelerate_fsdp2_plugin_matches_torch_fully_shard(presharded: bool) -> None:
    suffix = "_presharded" if presharded else ""
    theirs, ours = run_script("accelerate_run.py", "torch" + suffix), run_script("accelerate_run.py", "fc" + suffix)
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    for mine, other in zip(ours["params"], theirs["params"], strict=True):
        assert mine == pytest.approx(other, abs=1e-6)
    for mine, other in zip(ours["counts"], theirs["counts"], strict=True):
        assert mine["all_gather"] == other["all_gather"] and mine["all_gather_bytes"] == other["all_gather_bytes"]
        assert mine["reduce_scatter"] == other["reduce_scatter"] == (3 if presharded else 4)  # one per unit
        assert mine["reduce_scatter_bytes"] == other["reduce_scatter_bytes"]


def test_a_presharded_model_without_the_port_is_sharded_again_by_torch() -> None:
    assert "error" in run_script("accelerate_run.py", "fc_presharded_unported")
