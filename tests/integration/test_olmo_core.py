"""AI2's OLMo-core 3.0 through its own entry points (olmo_core_run.py, under torchrun): ``olmo2_14M`` with 2 layers,
``TransformerTrainModuleConfig`` with its data-parallel config, its numpy dataset and data loader on synthetic token
files, the real ``Trainer`` for 3 steps of 2 micro-batches, its checkpoint, and a resume in a new process for steps
4 and 5; inside ``fc.ported("olmo_core")`` against the same run on torch's ``fully_shard``.

FSDP on 2 gloo ranks; HSDP on 4 (a 2x2 mesh: 2 replicas of 2 shards, with OLMo-core's forward prefetch). Each
step's loss and grad norm are the trainer's own logged metrics; collectives are counted per step (the train
module's ``train_batch`` and ``optim_step``) on every rank.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launch import run_script

pytest.importorskip("olmo_core")

MICRO_BATCHES = 2
NPROC = {"fsdp": 2, "hsdp": 4}
CONTROL = 2  # fsdp_compose's int64 all-reduces per backward: the agreement and the closing word (one group)
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_reduce_integer")


def _steps(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's steps (logged loss and grad norm, collectives of train_batch + optim_step), after checking every rank
    logged and counted the same."""
    assert all(records == ranks[0] for records in ranks), ranks
    logged = [r for r in ranks[0] if "step" in r]
    batches = [r["train_batch"] for r in ranks[0] if "train_batch" in r]
    optims = [r["optim_step"] for r in ranks[0] if "optim_step" in r]
    assert len(logged) == len(batches) == len(optims), ranks[0]
    steps = []
    for log, batch, optim in zip(logged, batches, optims, strict=True):
        steps.append({**log, **{kind: batch.get(kind, 0) + optim.get(kind, 0) for kind in KINDS}})
    (prefetched,) = [r["lm_head_prefetched"] for r in ranks[0] if "lm_head_prefetched" in r]
    return [{**step, "lm_head_prefetched": prefetched} for step in steps]


@functools.cache
def _run(variant: str, dp: str, root: Path, resume: bool = True) -> dict[str, Any]:
    workdir = root / f"{variant}-{dp}"
    trained = run_script("olmo_core_run.py", variant, dp, "train", str(workdir), nproc=NPROC[dp])
    out = {"steps": _steps(trained["ranks"]), "checkpoint": trained["checkpoint"]}
    if resume:
        resumed = run_script("olmo_core_run.py", variant, dp, "resume", str(workdir), nproc=NPROC[dp])
        out["resumed"] = _steps(resumed["ranks"])
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("olmo_core")
    return lambda variant, dp, resume=True: _run(variant, dp, root, resume)


def _column(steps: list[dict[str, Any]], key: str) -> list[Any]:
    return [step[key] for step in steps]


def _floating_all_reduces(steps: list[dict[str, Any]]) -> list[int]:
    """All-reduces of floating-point tensors per step: HSDP's gradients, the grad norm's, the trainer's metrics."""
    return [step["all_reduce"] - step["all_reduce_integer"] for step in steps]


@pytest.mark.parametrize("dp", ["fsdp", "hsdp"])
def test_trainer_matches_torch_fully_shard(run: Any, dp: str) -> None:
    torch_run, fc_run = run("torch", dp), run("fc", dp)
    for phase, steps in (("steps", [1, 2, 3]), ("resumed", [4, 5])):  # resumed: the trainer loaded step 3
        ours, theirs = fc_run[phase], torch_run[phase]
        assert _column(ours, "step") == _column(theirs, "step") == steps
        for key in ("loss", "grad_norm"):
            assert _column(ours, key) == pytest.approx(_column(theirs, key), rel=1e-5, abs=1e-5), (phase, key)
        assert _column(ours, "reduce_scatter") == _column(theirs, "reduce_scatter"), phase
        # Gradient all-reduces (HSDP), grad norm and metrics: floating point, equal. fsdp_compose adds its agreement
        # and closing word per backward (two small int64 all-reduces over the data-parallel ranks).
        assert _floating_all_reduces(ours) == _column(theirs, "all_reduce"), phase
        assert _column(theirs, "all_reduce_integer") == [0] * len(steps)
        assert all(n == MICRO_BATCHES * CONTROL for n in _column(ours, "all_reduce_integer")), phase
    if dp == "hsdp":  # 4 units (embeddings, 2 blocks, LM head) all-reduce once per step: on the last micro-batch
        assert all(n - 1 == 4 for n in _column(torch_run["steps"], "all_reduce"))  # + 1: the grad norm's
        # The LM-head guard in apply_fsdp: the last block prefetches the head in both libraries.
        assert fc_run["steps"][0]["lm_head_prefetched"] and torch_run["steps"][0]["lm_head_prefetched"]


@pytest.mark.parametrize("dp", ["fsdp", "hsdp"])
def test_all_gathers_no_more_than_torch(run: Any, dp: str) -> None:
    """``Transformer.apply_fsdp`` sets ``set_unshard_in_backward(False)`` on the embeddings: neither library gathers
    them for backward (fsdp_compose 12 per step, torch 13: it gathers the LM head once more after the last
    micro-batch)."""
    torch_run, fc_run = run("torch", dp), run("fc", dp)
    for phase in ("steps", "resumed"):
        ours, theirs = _column(fc_run[phase], "all_gather"), _column(torch_run[phase], "all_gather")
        assert all(a <= b for a, b in zip(ours, theirs, strict=True)), (phase, ours, theirs)


@pytest.mark.parametrize("dp", ["fsdp", "hsdp"])
def test_checkpoints_equal(run: Any, dp: str, tmp_path: Path) -> None:
    """The step-3 checkpoints (model and AdamW state), unsharded by OLMo-core's ``unshard_checkpoint``."""
    import torch
    from olmo_core.distributed.checkpoint import unshard_checkpoint

    def load(variant: str) -> dict[str, Any]:
        source = Path(run(variant, dp)["checkpoint"]) / "model_and_optim"
        model, optim = unshard_checkpoint(source, tmp_path / variant, optim=True, quiet=True)
        assert optim is not None
        return {"model": torch.load(model, weights_only=False), "optim": torch.load(optim, weights_only=False)}

    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
        if isinstance(value, (list, tuple)):
            return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}{i}.").items()}
        return {prefix: value}

    ours, theirs = flat(load("fc")), flat(load("torch"))
    assert ours.keys() == theirs.keys()
    tensors = [key for key, value in theirs.items() if isinstance(value, torch.Tensor)]
    assert len([key for key in tensors if key.startswith("model.")]) == 25  # every parameter
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)
        else:
            assert ours[key] == value, key


def test_without_the_train_module_guard_hsdp_all_reduces_every_micro_batch(run: Any) -> None:
    """``_train_microbatch_context`` sees no FSDP module: it does not defer HSDP's all-reduce to the last
    micro-batch. The same numbers; 8 gradient all-reduces per step instead of 4."""
    torch_steps, unguarded = run("torch", "hsdp")["steps"], run("fc_skip_train_module_guard", "hsdp", False)["steps"]
    for key in ("loss", "grad_norm"):
        assert _column(unguarded, key) == pytest.approx(_column(torch_steps, key), rel=1e-5, abs=1e-5), key
    assert [n - 1 for n in _floating_all_reduces(unguarded)] == [8] * len(unguarded)  # - 1: the grad norm's
    assert _column(unguarded, "reduce_scatter") == _column(torch_steps, "reduce_scatter")
