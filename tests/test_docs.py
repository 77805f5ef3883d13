"""The docs say what the code does: the README tour is a script that runs, quoted errors and figures are real.

Each test pins one statement a user reads; when the code or a benchmark table changes, the statement fails here
instead of going stale silently.
"""

from __future__ import annotations

import ast
import builtins
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, mesh_1d, mesh_nd

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()


# ---------------------------------------------------------------------- the README's API tour
def _tour_region() -> str:
    text = (ROOT / "examples" / "tour.py").read_text()
    return text.split("# tour:start\n", 1)[1].split("# tour:end\n", 1)[0]


def _readme_block_after(heading: str, language: str) -> str:
    section = README.split(heading + "\n", 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("```\n", 1)[0]


def test_readme_api_tour_is_the_runnable_examples_tour() -> None:
    assert _readme_block_after("## API tour", "python") == _tour_region()


def test_the_tour_defines_every_name_it_uses() -> None:
    tree = ast.parse(_tour_region())
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert used <= defined, sorted(used - defined)


def test_readme_setup_installs_numpy_so_torch_does_not_warn() -> None:
    # torch warns "Failed to initialize NumPy" at import when numpy is missing; the first command must not show it.
    first = _readme_block_after("## Try it", "bash")
    assert "numpy" in first and "examples/train_gpt.py" in first


# ---------------------------------------------------------------------- benchmark figures
def _generated(name: str) -> str:
    return BENCHMARKS.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def _rows(markdown: str) -> list[list[str]]:
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _table_after(markdown: str, title: str) -> dict[str, list[str]]:
    """The first table after the paragraph that starts with ``title``, keyed by its first column."""
    return {row[0]: row for row in _rows(markdown.split(title, 1)[1].split("\n\n", 2)[1])}


def test_readme_benchmark_table_matches_the_generated_tables() -> None:
    bench = _generated("bench")
    steps = _table_after(bench, "**Step time**")
    peaks = _table_after(bench, "**Peak live tensor MiB**")
    colls = _table_after(bench, "**Collective MiB per step per rank**")
    readme = {row[0]: row for row in _rows(README.split("<!-- readme-bench:start -->", 1)[1])}
    labels = {
        "fp32": "fp32",
        "bf16 compute": "bf16",
        "frozen backbone (blocks 0-2)": "frozen",
        'frozen backbone, `frozen_params="replicate"`': "frozen_replicate",
        "`reshard_after_forward=False`": "no_reshard",
    }
    assert set(labels) == set(readme) - {"config"}
    for label, config in labels.items():
        row = readme[label]
        assert row[1:3] == steps[config][4:6], label  # step time fc / FSDP2, fc / DDP
        assert row[3:5] == peaks[config][4:6], label  # peak live bytes fc / FSDP2, fc / DDP
        assert row[5].split()[0] == colls[config][4], label  # collective bytes / minimum


def test_readme_says_which_losses_agree_with_ddp() -> None:
    steps = _table_after(_generated("bench"), "**Step time**")
    losses = steps["config"].index("final loss fc/FSDP2/DDP")
    fc_loss, fsdp2_loss, ddp_loss = steps["bf16"][losses].split(" / ")
    assert fc_loss == fsdp2_loss != ddp_loss  # DDP runs bf16 under autocast: not the same numerics
    assert f"{fc_loss} for both FSDPs against {ddp_loss}" in README
    assert "agree with FSDP2 and DDP to all printed digits" not in README
    for config in ("fp32", "frozen", "frozen_replicate", "no_reshard"):
        assert len(set(steps[config][losses].split(" / "))) == 1, config


ACCUM_SECTIONS = ("accum", "accum-4", "accum-512")


def _sync_peaks(section: str) -> tuple[str, str, str]:
    """fsdp_compose "unsharded" and FSDP2 peaks of the synchronising micro-batch, and their ratio."""
    table = _table_after(_generated(section), "**Peak live tensor MiB**")
    ours, theirs = table['fsdp_compose "unsharded"'], table["FSDP2"]
    return ours[4], theirs[4], ours[7]


@pytest.mark.parametrize("doc", ["README.md", "docs/precision.md", "CHANGELOG.md", "docs/benchmarks.md"])
def test_accumulation_figures_agree_with_the_generated_tables(doc: str) -> None:
    text = " ".join((ROOT / doc).read_text().split())  # figures may be split over lines
    quoted = 0
    for section in ACCUM_SECTIONS:
        ours, theirs, _ = _sync_peaks(section)
        for other in re.findall(rf"{re.escape(ours)} (?:MiB )?(?:vs|against) (\d+\.\d+)", text):
            assert other == theirs, f"{doc}: {ours} vs {other}, but the {section} table says FSDP2 {theirs}"
            quoted += 1
    assert quoted, f"{doc} quotes no accumulation figure any more: drop it from this test"


def test_readme_quotes_both_accumulation_sizes_with_their_ratios() -> None:
    for section in ("accum", "accum-512"):
        ours, theirs, ratio = _sync_peaks(section)
        assert f"{ratio}x" in README and f"{ours} vs {theirs} MiB" in README, section


def _prose(markdown: str) -> str:
    """``markdown`` without its generated sections, tables and code blocks."""
    markdown = re.sub(r"<!-- ([\w-]+):start -->.*?<!-- \1:end -->", "", markdown, flags=re.S)
    markdown = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return "\n".join(line for line in markdown.splitlines() if not line.startswith("|"))


def _derived_figures() -> set[float]:
    """Figures the prose derives from the tables (each spelled out where it is used)."""
    bench = _generated("bench")
    peaks = _table_after(bench, "**Peak live tensor MiB**")
    colls = _table_after(bench, "**Collective MiB per step per rank**")
    accum = _table_after(_generated("accum"), "**Peak live tensor MiB**")

    def start(config: str) -> float:  # "34.53 (15.16)": the start-of-step bytes in brackets
        return float(peaks[config][1].split("(")[1].rstrip(")"))

    saved = float(colls["frozen"][1]) - float(colls["frozen_replicate"][1])  # two all-gathers of the frozen blocks
    return {
        round(float(accum['fsdp_compose "unsharded"'][3]) - float(accum['fsdp_compose "unsharded"'][1]), 2),  # held
        round(float(accum['fsdp_compose "sharded"'][3]) - float(accum['fsdp_compose "sharded"'][1]), 2),
        round(start("frozen_replicate") - start("frozen"), 2),  # the frozen blocks kept whole
        round(saved, 2),
        round(saved / 2, 2),  # the frozen blocks' bytes
    }


EARLIER = re.compile(r"\bearlier\b|\bBefore them\b|\bruns of the same code\b")


def test_benchmarks_prose_quotes_only_figures_of_its_tables() -> None:
    """Every MiB figure and ratio written by hand (two decimals) is in a table of the page (maybe rounded), derived
    from the tables as the prose says, or stated as a measurement of an earlier version or of other runs."""
    cells = [n for row in _rows(BENCHMARKS) for cell in row for n in re.findall(r"\d+\.\d+", cell)]
    known = {round(float(n), 2) for n in cells} | _derived_figures()
    stale = []
    for sentence in re.split(r"(?<=[.;])\s", " ".join(_prose(BENCHMARKS).split())):
        if EARLIER.search(sentence):
            continue
        for figure in re.findall(r"(\d+\.\d\d) MiB", sentence) + re.findall(r"\b(\d\.\d\d)x\b", sentence):
            if float(figure) not in known:
                stale.append(f"{figure} in: {sentence[:120]}")
    assert not stale, "\n".join(stale)


# ---------------------------------------------------------------------- benchmark commands
def test_nox_bench_runs_the_readme_benchmark_command() -> None:
    noxfile = ast.parse((ROOT / "noxfile.py").read_text())
    (configs,) = (
        ast.literal_eval(node.value)
        for node in noxfile.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BENCH_CONFIGS" for t in node.targets)
    )
    command = re.search(r"python benchmarks/run.py --nproc 2 --configs ([\w ]+?)\s+# or: nox -s bench", README)
    assert command is not None
    assert command.group(1).split() == configs


def test_benchmarks_readme_lists_every_run_config() -> None:
    from benchmarks.run import VARIANTS

    text = (ROOT / "benchmarks" / "README.md").read_text()
    for name in VARIANTS:
        assert f"- `{name}`:" in text, name
        assert f"`{name}`" in text.split("| `--configs` |", 1)[1].split("\n", 1)[0], name


def test_peak_composition_help_describes_peak_composition() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/peak_composition.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "What is alive at the peak of the synchronising micro-batch" in result.stdout
    assert "--timeline" in result.stdout and "--write" not in result.stdout
    assert "Gradient accumulation: memory and time" not in result.stdout  # accumulation.py's own description


# ---------------------------------------------------------------------- internal references
INTERNAL = re.compile(r"\bseed[ -]?#?\d{3,}\b|\bseed #\d+", re.I)


def test_docs_and_docstrings_carry_no_internal_seed_references() -> None:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md")]
    for folder in ("fsdp_compose", "examples", "benchmarks", "tests"):
        files += (ROOT / folder).rglob("*.py")
    found = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in files for m in INTERNAL.finditer(path.read_text())]
    found = [f for f in found if not f.startswith("tests/test_docs.py")]
    assert not found, found


# ---------------------------------------------------------------------- docs/composition.md's error table
def _error(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _tp_linear(tp_mesh: Any) -> nn.Module:
    module = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(module, tp_mesh, {"0": ColwiseParallel()})
    return module


def _composition_errors(rank: int, ws: int) -> dict[str, list[str]]:
    dp_tp = mesh_nd((1, ws), ("dp", "tp"))
    other_root_tp = nn.Linear(4, 4)
    other_root_tp.weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), dp_tp["tp"], [Shard(0)]))
    sharded_first = nn.Sequential(nn.Linear(4, 4))
    fc.fully_shard(sharded_first, mesh=dp_tp["dp"])
    return {
        "without names": [_error(fc.fully_shard, nn.Linear(4, 4), mesh=mesh_nd((1, ws), None))],
        "swapped": [_error(fc.fully_shard, nn.Linear(4, 4), mesh=mesh_nd((ws, 1), ("shard", "replicate")))],
        "3-D": [_error(fc.fully_shard, nn.Linear(4, 4), mesh=mesh_nd((1, 1, ws), ("replicate", "shard", "tp")))],
        "another root": [_error(fc.fully_shard, other_root_tp, mesh=mesh_nd((ws,), ("dp",)))],
        "whole (dp, tp)": [
            _error(fc.fully_shard, nn.Linear(4, 4), mesh=dp_tp),  # no TP parameters (say the root)
            _error(fc.fully_shard, _tp_linear(dp_tp["tp"]), mesh=dp_tp),  # TP parameters
        ],
        "before parallelize": [_error(parallelize_module, sharded_first, dp_tp["tp"], {"0": ColwiseParallel()})],
    }


ROW_KEYS = {  # a distinctive part of the "you wrote" cell -> the scenario above
    "without names": "without names",
    '`mesh_dim_names=("shard", "replicate")`': "swapped",
    "the whole 3-D mesh": "3-D",
    "TP on one `init_device_mesh`": "another root",
    'the whole `("dp", "tp")` mesh': "whole (dp, tp)",
    "`fully_shard` before `parallelize_module`": "before parallelize",
}


def test_composition_error_table_quotes_the_real_errors(run_dist) -> None:
    doc = (ROOT / "docs" / "composition.md").read_text()
    table = doc.split("## Errors you may meet", 1)[1].split("\n\n", 3)[2]
    rows = _rows(table)[1:]
    errors = run_dist(2, _composition_errors)[0]
    assert len(rows) == len(ROW_KEYS)
    for wrote, get in rows:
        (key,) = (scenario for part, scenario in ROW_KEYS.items() if part in wrote)
        quoted = re.search(r"`(\w+Error: .*?)`", get)
        assert quoted is not None, get
        pattern = ".*".join(re.escape(part) for part in quoted.group(1).split("..."))
        for message in errors[key]:
            assert re.fullmatch(pattern, message, flags=re.S), f"{wrote}:\n  doc:  {quoted.group(1)}\n  real: {message}"


def test_composition_no_longer_claims_a_whole_dp_tp_mesh_is_accepted() -> None:
    doc = " ".join((ROOT / "docs" / "composition.md").read_text().split())
    assert "is not rejected" not in doc
    assert "is always rejected, also for a module without TP parameters" in doc


# ---------------------------------------------------------------------- the debug log (docs/debugging.md)
def _debug_log(rank: int, ws: int) -> dict[str, Any]:
    logger = logging.getLogger("fsdp_compose")
    untouched = logger.level == logging.NOTSET and not logger.handlers and not logger.isEnabledFor(logging.DEBUG)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        for block in model.blocks:
            fc.fully_shard(block, mesh=mesh_1d(ws))
        fc.fully_shard(model, mesh=mesh_1d(ws))
        inputs, targets = synthetic_batch(model.cfg, 4, 0)
        loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    return {"untouched": untouched, "records": [(r.name, r.levelname, r.getMessage()) for r in records]}


def test_debug_log_shows_fully_shard_calls_and_lazy_init(run_dist) -> None:
    for result in run_dist(2, _debug_log):
        assert result["untouched"]  # the library configures no level and no handler of its own
        records = result["records"]
        messages = [m for name, _, m in records if name == "fsdp_compose.init"]
        assert [m.split(":")[0] for m in messages] == ["fully_shard on Block"] * 2 + ["fully_shard on GPT"]
        assert "12 parameters (0 kept whole), mesh (2,) None, no mixed precision" in messages[0]
        assert any(name.startswith("fsdp_compose.") and "lazy init" in m for name, _, m in records)
        assert {level for _, level, _ in records} == {"DEBUG"}
