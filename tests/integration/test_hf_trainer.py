"""HF ``Trainer`` (transformers 5.23) with gradient accumulation on a tiny randomly initialized Llama built from a
config in code (no downloads), on 2 CPU gloo ranks (hf_trainer_run.py, under torchrun): ``fc.fully_shard`` against
torch's, each decoder layer and the root sharded by the user before the ``Trainer``.

Both libraries' models are marked as sharded at load time (``_is_distributed_loading_by_transformers``), or the
``Trainer`` wraps them in DDP. fsdp_compose changes: the ``fully_shard`` call (with ``fsdp2_methods=True``) and the
guard ``is_fsdp_managed_module`` (``or fc.is_fully_sharded(m)``). Without the guard the ``Trainer`` skips its
no-sync for the first micro-batch: the same losses, twice the reduce-scatters.
"""

from __future__ import annotations

import pytest

from tests.integration.launch import run_script

pytest.importorskip("transformers")


def test_hf_trainer_with_accumulation_matches_torch_fully_shard() -> None:
    torch_run, fc_run = run_script("hf_trainer_run.py", "torch"), run_script("hf_trainer_run.py", "fc")
    unpatched = run_script("hf_trainer_run.py", "fc_unpatched")
    assert fc_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-6)
    for ours, theirs in zip(fc_run["params"], torch_run["params"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert fc_run["reduce_scatters"] == torch_run["reduce_scatters"] == 9  # 3 units x 3 optimizer steps
    assert unpatched["loss"] == pytest.approx(torch_run["loss"], rel=1e-5)
    assert unpatched["reduce_scatters"] == 18
    ported = run_script("hf_trainer_run.py", "fc_ported")  # the guard line applied by fc.ported("transformers")
    assert ported["loss"] == fc_run["loss"] and ported["params"] == fc_run["params"]
    assert ported["reduce_scatters"] == 9
