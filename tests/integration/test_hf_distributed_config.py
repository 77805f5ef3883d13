"""transformers 5's own FSDP2: ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`` shards the
model with ``transformers.distributed.fsdp.apply_fully_sharded_data_parallelism`` (each decoder layer, the
final norm and head kept after forward, the root). Under ``fc.ported("transformers")`` the same call shards with
fsdp_compose (hf_distributed_config_run.py, 2 CPU gloo ranks), a Llama and a Qwen3-MoE with expert parallel over
the 2 ranks (the experts a unit of their own on the expert mesh): the module classes unchanged, the same losses over 3
AdamW steps and the same all-gathers, reduce-scatters and all-to-alls as torch's ``fully_shard``."""

from __future__ import annotations

import pytest

from tests.integration.launch import run_script

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_transformers_distributed_config_matches_torch_fully_shard(tmp_path, kind: str) -> None:
    theirs = run_script("hf_distributed_config_run.py", "torch", str(tmp_path), kind)
    ours = run_script("hf_distributed_config_run.py", "fc", str(tmp_path), kind)
    assert theirs["sharded_by"] == "torch" and ours["sharded_by"] == "fc"
    assert ours["layer_class"] in ("LlamaDecoderLayer", "Qwen3MoeDecoderLayer")  # no class swap
    if kind == "moe":  # the experts, on their own mesh, sharded by fsdp_compose too
        assert ours["experts_sharded_by_fc"] and all(ours["experts_sharded_by_fc"])
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    assert ours["counts"] == theirs["counts"]
