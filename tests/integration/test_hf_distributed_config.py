"""transformers 5's own FSDP2: ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`` shards the
model with ``transformers.distributed.fsdp.apply_fully_sharded_data_parallelism`` (each decoder layer, the
final norm and head kept after forward, the root). Under ``fc.ported("transformers")`` the same call shards with
fsdp_compose (hf_distributed_config_run.py, 2 CPU gloo ranks): the module classes unchanged, the same losses over 3
AdamW steps and the same all-gathers and reduce-scatters as torch's ``fully_shard``."""

from __future__ import annotations

import pytest

from tests.integration.launch import run_script

pytest.importorskip("transformers")


def test_transformers_distributed_config_matches_torch_fully_shard(tmp_path) -> None:
    theirs = run_script("hf_distributed_config_run.py", "torch", str(tmp_path))
    ours = run_script("hf_distributed_config_run.py", "fc", str(tmp_path))
    assert theirs["sharded_by"] == "torch" and ours["sharded_by"] == "fc"
    assert ours["layer_class"] == "LlamaDecoderLayer"  # no class swap
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    assert ours["counts"] == theirs["counts"]
