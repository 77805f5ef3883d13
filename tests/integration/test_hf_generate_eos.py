"""``generate`` with EOS where ranks finish at different lengths (hf_generate_eos_run.py, a tiny Llama, 2 CPU gloo
ranks): transformers sees the model as FSDP-managed (the ``_is_fsdp_managed_module`` attribute ``fc.fully_shard`` sets
as torch's does), turns ``synced_gpus`` on, and ``generate`` completes on both ranks with the unsharded model's tokens
and torch's all-gathers."""

from __future__ import annotations

import pytest

from tests.integration.launch import run_script

pytest.importorskip("transformers")


def test_generate_with_eos_at_different_lengths_completes_like_torch() -> None:
    theirs, ours = run_script("hf_generate_eos_run.py", "torch"), run_script("hf_generate_eos_run.py", "fc")
    assert ours["lengths"][0] < ours["lengths"][1]  # rank 0 stops early
    assert ours["same_tokens"] and theirs["same_tokens"]
    assert ours["all_gathers"] == theirs["all_gathers"]
