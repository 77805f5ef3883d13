"""The HF ``Trainer`` (transformers 5.23) with ``fsdp_version: 2``: accelerate's FSDP2 plugin shards a tiny Llama
inside ``trainer.train()``, gradient accumulation 2, 3 optimizer steps, then ``model.generate``
(hf_trainer_fsdp2_run.py, 2 CPU gloo ranks under torchrun). torch's ``fully_shard`` against fsdp_compose under
``fc.ported("transformers")``.

The same losses, parameters, all-gathers (count and bytes) and reduce-scatters (one per unit per optimizer step, the
same bytes), and the same generated tokens with the same all-gathers in ``generate``. The ``Trainer`` registers
``generate`` with ``torch.distributed.fsdp.register_fsdp_forward_method``, a no-op for a module that is not a torch
``FSDPModule``; the port makes it ``fc.register_forward_method``. Under the accelerate port alone it stays
unregistered (this Llama's ``generate`` runs only ordinary forwards, so its tokens are the same either way)."""

from __future__ import annotations

import pytest

from tests.integration.launch import run_script

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def test_hf_trainer_fsdp_version_2_matches_torch_fully_shard() -> None:
    theirs, ours = run_script("hf_trainer_fsdp2_run.py", "torch"), run_script("hf_trainer_fsdp2_run.py", "fc")
    assert theirs["sharded_by"] == "torch" and ours["sharded_by"] == "fc"
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    for mine, other in zip(ours["params"], theirs["params"], strict=True):
        assert mine == pytest.approx(other, abs=1e-6)
    assert len(ours["counts"]) == len(theirs["counts"]) == 3
    for mine, other in zip(ours["counts"], theirs["counts"], strict=True):
        assert mine["all_gather"] == other["all_gather"] and mine["all_gather_bytes"] == other["all_gather_bytes"]
        assert mine["reduce_scatter"] == other["reduce_scatter"] == 4  # layers, embedding, norm + lm_head
        assert mine["reduce_scatter_bytes"] == other["reduce_scatter_bytes"]
    assert ours["generate_registered"] and theirs["generate_registered"]
    assert ours["generated"] == theirs["generated"]
    # generate runs 4 no_grad forwards: accelerate's norm + lm_head unit (reshard_after_forward=False) stays gathered
    # across them in both (docs/rl.md, "Generation")
    assert ours["generate_all_gathers"] == theirs["generate_all_gathers"]


def test_without_the_transformers_port_generate_is_not_registered() -> None:
    accelerate_only = run_script("hf_trainer_fsdp2_run.py", "fc_accelerate_port")
    assert accelerate_only["sharded_by"] == "fc" and not accelerate_only["generate_registered"]
