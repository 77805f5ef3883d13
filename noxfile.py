"""nox sessions: tests, lint, typecheck, docs, plan, bench, integration, tests_torch. Each installs what it needs in
its venv. ``tests_torch`` runs the suite on the oldest torch release fsdp_compose supports and on the newest one the
package index offers (``nox -s "tests_torch(floor)"`` / ``"tests_torch(newest)"``)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
TORCH = "torch==2.13.0"
# The floor release (tests_torch): fsdp_compose/compat.py's MIN_TORCH, read as text (importing it needs torch).
_COMPAT = (Path(__file__).parent / "fsdp_compose" / "compat.py").read_text()
_MIN_TORCH = re.search(r"^MIN_TORCH = \((\d+), (\d+)\)$", _COMPAT, re.M)
assert _MIN_TORCH is not None, "fsdp_compose/compat.py: no line MIN_TORCH = (major, minor)"
TORCH_FLOOR = ".".join(_MIN_TORCH.groups())
# The five configurations of the README's benchmark table (docs/benchmarks.md, section "bench").
BENCH_CONFIGS = ["fp32", "bf16", "frozen", "frozen_replicate", "no_reshard"]


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
@nox.parametrize("torch", [nox.param(f"torch=={TORCH_FLOOR}.*", id="floor"), nox.param("torch", id="newest")])
def tests_torch(session: nox.Session, torch: str) -> None:
    """The suite on the floor release (compat.MIN_TORCH, its newest patch) and on the newest torch the package index
    offers (PyPI's linux wheels are CUDA builds; they run on CPU). Not in the default sessions: a torch each."""
    session.install("--upgrade", torch)
    session.install("-e", ".[test]")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", *session.posargs)


# The trainers docs/integrations.md covers, at the versions its figures were measured with.
INTEGRATION_PACKAGES = [
    "torchtitan==0.3.0",
    "lightning==2.6.6",
    "transformers==5.23.0",
    "accelerate>=1,<2",
    "peft",
    "ai2-olmo-core==3.0.0",
    "torchft==0.2.0",  # ships torchft_lighthouse (runs on CPU)
]


@nox.session
def integration(session: nox.Session) -> None:
    """Existing trainers on fsdp_compose against torch's ``fully_shard`` (tests/integration, docs/integrations.md).
    Not in the default sessions: extra packages and minutes of CPU."""
    session.install(TORCH)
    session.install("-e", ".[test]", *INTEGRATION_PACKAGES)
    session.run("pytest", "tests/integration", *session.posargs, env={"FSDP_COMPOSE_INTEGRATION": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the package; then a user's strict script against the package as installed (PEP 561: py.typed)."""
    session.install(TORCH)
    session.install(".", "mypy")  # a regular install, not editable: what users get
    session.run("mypy")
    script = Path("tests/typing/user_script.py").resolve()
    tmp = Path(session.create_tmp())
    shutil.copy(script, tmp / script.name)
    with session.chdir(tmp):  # outside the repository: fsdp_compose comes from site-packages
        session.run("mypy", "--strict", script.name)


@nox.session
def docs(session: nox.Session) -> None:
    """The docs are markdown; check that every example they point to still runs."""
    session.install(TORCH)
    session.install("-e", ".", "numpy")
    torchrun = ["torchrun", "--standalone", "--nproc_per_node", "2"]
    session.run(*torchrun, "examples/train_gpt.py", "--steps", "3")
    session.run(*torchrun, "examples/lora_finetune.py", "--steps", "3", "--unfreeze-at", "2")
    session.run(*torchrun, "examples/tour.py")


@nox.session
def plan(session: nox.Session) -> None:
    """The planner: its tests, then a plan of the README's 70B command (posargs replace the CLI arguments)."""
    session.install(TORCH)
    session.install("-e", ".[test,plot]")
    session.run("pytest", "tests/test_plan.py")
    args = session.posargs or ["--model", "llama-70b", "--world-size", "1024", "--param-dtype", "bf16"]
    session.run("python", "-m", "fsdp_compose.plan", *args)


@nox.session
def bench(session: nox.Session) -> None:
    """``nox -s bench``: the README's benchmark command (2 ranks, the five configurations); arguments after ``--``
    replace it, e.g. ``nox -s bench -- --nproc 2 --configs fp32``."""
    session.install(TORCH)
    session.install("-e", ".", "numpy")
    args = session.posargs or ["--nproc", "2", "--configs", *BENCH_CONFIGS]
    session.run("python", "benchmarks/run.py", *args)


@nox.session
def limit(session: nox.Session) -> None:
    """``nox -s limit``: ``benchmarks/limit.py`` (every setting, fp32 and bf16, d=256 and d=1024); arguments after
    ``--`` replace its defaults, e.g. ``nox -s limit -- --settings one_rank --dims 256``."""
    session.install(TORCH)
    session.install("-e", ".", "numpy")
    session.run("python", "benchmarks/limit.py", *session.posargs)
