"""HF ``Trainer`` (transformers 5.23) with gradient accumulation on a tiny randomly initialized Llama built from a
config in code (no downloads), on 2 CPU gloo ranks (hf_trainer_run.py, under torchrun): ``fc.fully_shard`` against
torch's, each decoder layer and the root sharded by the user before the ``Trainer``.

Both libraries' models are marked as sharded at load time (``_is_distributed_loading_by_transformers``), or the
``Trainer`` wraps them in DDP. fsdp_compose changes only the ``fully_shard`` call (with ``fsdp2_methods=True``): the
``Trainer``'s ``is_fsdp_managed_module`` reads the ``_is_fsdp_managed_module`` attribute both libraries set, and
takes its no-sync path for every micro-batch but the last.
"""

from __future__ import annotations

import pytest

from tests.integration.launch import run_script

pytest.importorskip("transformers")


def test_hf_trainer_with_accumulation_matches_torch_fully_shard() -> None:
    torch_run, fc_run = run_script("hf_trainer_run.py", "torch"), run_script("hf_trainer_run.py", "fc")
    assert fc_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-6)
    for ours, theirs in zip(fc_run["params"], torch_run["params"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert fc_run["reduce_scatters"] == torch_run["reduce_scatters"] == 9  # 3 units x 3 optimizer steps
    ported = run_script("hf_trainer_run.py", "fc_ported")  # fc.ported("transformers") changes nothing here
    assert ported["loss"] == fc_run["loss"] and ported["params"] == fc_run["params"]
    assert ported["reduce_scatters"] == 9
