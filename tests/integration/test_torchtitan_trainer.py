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
    "--training.local_batch_size 2 --checkpoint.no-enable --parallelism.spmd_backend partial_dtensor "
    "--debug.seed 42 --training.mixed_precision_param float32"
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
def _run(variant: str, workdir: Path) -> list[dict[str, Any]]:
    """One trainer run; returns rank 0's steps after checking every rank logged and counted the same."""
    ranks = run_script("torchtitan_trainer_run.py", variant, *ARGS, cwd=workdir)
    assert all(records == ranks[0] for records in ranks), ranks
    logged = [r for r in ranks[0] if "step" in r]
    counted = [r["collectives"] for r in ranks[0] if "collectives" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)) and len(counted) == STEPS, ranks[0]
    return [{**log, **counts} for log, counts in zip(logged, counted, strict=True)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("torchtitan")
    assets = _assets()
    for name in ("tokenizer", "c4_test"):
        shutil.copytree(assets / name, workdir / "tests" / "assets" / name)
    return lambda variant: _run(variant, workdir)


def _column(steps: list[dict[str, Any]], key: str) -> list[Any]:
    return [step.get(key, 0) for step in steps]


def test_trainer_matches_torch_fully_shard(run: Any) -> None:
    torch_steps, fc_steps = run("torch"), run("fc")
    for key in ("loss", "grad_norm"):
        assert _column(fc_steps, key) == pytest.approx(_column(torch_steps, key), rel=1e-5, abs=1e-5), key
    for key in ("all_gather", "reduce_scatter", "all_reduce"):
        assert _column(fc_steps, key) == _column(torch_steps, key), key


def test_without_the_division_guard_gradients_are_averaged(run: Any) -> None:
    """``disable_fsdp_gradient_division`` skips fsdp_compose's units: gradients averaged over the 2 ranks instead of
    summed (torchtitan divides by the global token count itself), so step 1's grad norm is halved and training
    differs from there on (clipping and the optimizer see other gradients)."""
    torch_steps, unguarded = run("torch"), run("fc_skip_division_guard")
    assert unguarded[0]["loss"] == pytest.approx(torch_steps[0]["loss"], rel=1e-5)
    assert unguarded[0]["grad_norm"] == pytest.approx(torch_steps[0]["grad_norm"] / 2, rel=1e-5)
    assert unguarded[1]["loss"] != pytest.approx(torch_steps[1]["loss"], rel=1e-5)


def test_without_the_chunked_loss_guard_the_head_is_gathered_per_chunk(run: Any) -> None:
    """``ChunkedLossWrapper`` sees no FSDP module in the head: it does not keep the head unsharded across its loss
    chunks nor defer their reductions, so the numbers stay the same but the head unit's collectives repeat."""
    torch_steps, unguarded = run("torch"), run("fc_skip_chunked_loss_guard")
    for key in ("loss", "grad_norm"):
        assert _column(unguarded, key) == pytest.approx(_column(torch_steps, key), rel=1e-5, abs=1e-5), key
    for key in ("all_gather", "reduce_scatter"):
        assert all(a > b for a, b in zip(_column(unguarded, key), _column(torch_steps, key), strict=True)), key


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
