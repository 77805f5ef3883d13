"""torchtitan 0.3's real trainer (``torchtitan.train.main``: its llama3 debug model, parallelize function, default
chunked cross-entropy, AdamW with warmup, grad clipping and loop) on 2 CPU gloo ranks for 3 steps, through the
documented port (docs/integrations.md, "torchtitan"), against the same run on torch's ``fully_shard``.

torchtitan_trainer_run.py applies the port as source edits and the CPU patches any FSDP implementation needs there
(the ``torchtitan-assets`` README); nothing else is changed. Each step's loss and grad norm are the trainer's own
logged metrics; collectives are counted per ``train_step`` on every rank.

The tokenizer and ``c4_test`` dataset are copied into ``tests/assets/`` of a temporary working directory; they are
looked up in ``$FSDP_COMPOSE_TORCHTITAN_ASSETS`` or a ``shared/data/torchtitan-assets`` folder above the repository.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launch import ROOT, run_script

pytest.importorskip("torchtitan")

ARGS = (
    "--module llama3 --config llama3_debugmodel --training.steps 3 --training.seq_len 128 "
    "--training.local_batch_size 2 --checkpoint.no-enable --parallelism.spmd_backend partial_dtensor --debug.seed 42"
).split()
STEPS = 3


def _assets() -> Path:
    named = os.environ.get("FSDP_COMPOSE_TORCHTITAN_ASSETS")
    candidates = [Path(named)] if named else [p / "shared/data/torchtitan-assets" for p in ROOT.parents]
    for path in candidates:
        if (path / "tokenizer").is_dir() and (path / "c4_test").is_dir():
            return path
    pytest.skip("torchtitan's test tokenizer and c4_test not found (set FSDP_COMPOSE_TORCHTITAN_ASSETS)")


@functools.cache
def _run(variant: str, workdir: Path, param_dtype: str) -> tuple[list[dict[str, Any]], int]:
    """One trainer run: rank 0's steps (logged loss and grad norm, collectives) and the loss's chunk count, after
    checking every rank logged and counted the same."""
    args = [*ARGS, "--training.mixed_precision_param", param_dtype]
    ranks = run_script("torchtitan_trainer_run.py", variant, *args, cwd=workdir)
    assert all(records == ranks[0] for records in ranks), ranks
    logged = [r for r in ranks[0] if "step" in r]
    counted = [r["collectives"] for r in ranks[0] if "collectives" in r]
    (chunks,) = [r["loss_chunks"] for r in ranks[0] if "loss_chunks" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)) and len(counted) == STEPS, ranks[0]
    return [{**log, **counts} for log, counts in zip(logged, counted, strict=True)], chunks


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("torchtitan")
    assets = _assets()
    for name in ("tokenizer", "c4_test"):
        shutil.copytree(assets / name, workdir / "tests" / "assets" / name)
    return lambda variant, param_dtype="float32": _run(variant, workdir, param_dtype)


def _column(steps: list[dict[str, Any]], key: str) -> list[Any]:
    return [step.get(key, 0) for step in steps]


def test_trainer_matches_torch_fully_shard(run: Any) -> None:
    (torch_steps, chunks), (fc_steps, _) = run("torch"), run("fc")
    assert chunks > 1  # the default loss is the chunked cross-entropy
    for key in ("loss", "grad_norm"):
        assert _column(fc_steps, key) == pytest.approx(_column(torch_steps, key), rel=1e-5, abs=1e-5), key
    for key in ("all_gather", "reduce_scatter"):
        assert _column(fc_steps, key) == _column(torch_steps, key), key
    # fsdp_compose agrees on each backward's participants across ranks and ends it with a closing word: two small
    # all-reduces per backward call, one call per loss chunk and one for the decoder (torch's all-reduces are the
    # trainer's own).
    ours, theirs = _column(fc_steps, "all_reduce"), _column(torch_steps, "all_reduce")
    extra = [a - b for a, b in zip(ours, theirs, strict=True)]
    assert all(n == 2 * (chunks + 1) for n in extra), extra


def test_trainer_matches_torch_fully_shard_bf16(run: Any) -> None:
    """torchtitan's default ``mixed_precision_param``: bf16 parameters in compute, fp32 reductions."""
    torch_steps, fc_steps = run("torch", "bfloat16")[0], run("fc", "bfloat16")[0]
    fp32_steps = run("torch")[0]
    assert _column(torch_steps, "loss")[1:] != pytest.approx(_column(fp32_steps, "loss")[1:], rel=1e-5)  # bf16 ran
    for key in ("loss", "grad_norm"):
        assert _column(fc_steps, key) == pytest.approx(_column(torch_steps, key), rel=1e-3), key
    for key in ("all_gather", "reduce_scatter"):
        assert _column(fc_steps, key) == _column(torch_steps, key), key


def test_without_the_division_guard_gradients_are_averaged(run: Any) -> None:
    """``disable_fsdp_gradient_division`` skips fsdp_compose's units: gradients averaged over the 2 ranks instead of
    summed (torchtitan divides by the global token count itself), so every step's grad norm is halved, clipping at
    1.0 no longer applies, and the losses drift (AdamW is nearly scale-invariant, so only slowly)."""
    (torch_steps, _), (unguarded, _) = run("torch"), run("fc_skip_division_guard")
    assert unguarded[0]["loss"] == pytest.approx(torch_steps[0]["loss"], rel=1e-6)
    assert unguarded[0]["grad_norm"] == pytest.approx(torch_steps[0]["grad_norm"] / 2, rel=1e-5)
    for ours, theirs in zip(unguarded[1:], torch_steps[1:], strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"] / 2, rel=1e-3)
    assert abs(unguarded[-1]["loss"] - torch_steps[-1]["loss"]) > 1e-5  # outside the parity tolerance


def test_without_the_chunked_loss_guard_the_head_is_reduced_per_chunk(run: Any) -> None:
    """``ChunkedLossWrapper`` sees no FSDP module in the head: it neither keeps the head unsharded across its loss
    chunks nor defers their gradient sync to the last chunk. Same numbers; the head unit reduce-scatters once per
    chunk instead of once, and is gathered again for chunks."""
    (torch_steps, chunks), (unguarded, _) = run("torch"), run("fc_skip_chunked_loss_guard")
    for key in ("loss", "grad_norm"):
        assert _column(unguarded, key) == pytest.approx(_column(torch_steps, key), rel=1e-5, abs=1e-5), key
    assert _column(unguarded, "reduce_scatter") == [n + chunks - 1 for n in _column(torch_steps, "reduce_scatter")]
    assert all(a > b for a, b in zip(_column(unguarded, "all_gather"), _column(torch_steps, "all_gather"), strict=True))


def test_docs_show_the_port_the_run_applies() -> None:
    """Every line the docs' torchtitan diff removes or adds is one the run's port removes or adds."""
    from tests.integration.torchtitan_trainer_run import PORT

    doc = (ROOT / "docs" / "integrations.md").read_text().split("## torchtitan", 1)[1].split("```diff\n", 1)[1]
    diff = doc.split("```", 1)[0].splitlines()
    edits = [edit for lines in PORT.values() for name_edits in lines.values() for edit in name_edits]
    old = "".join(o for o, _ in edits).splitlines()
    new = "".join(n for _, n in edits).splitlines()
    removed = [line[1:] for line in diff if line.startswith("-")]
    added = [line[1:] for line in diff if line.startswith("+")]
    assert removed and all(line in old and line not in new for line in removed), removed
    assert added and all(line in new and line not in old for line in added), added
