"""nox sessions: tests, lint, typecheck, docs, plan, bench. Each installs what it needs into its own venv."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".", "mypy")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """The docs are markdown; check that every example they point to still runs."""
    session.install(TORCH)
    session.install("-e", ".")
    session.run("torchrun", "--standalone", "--nproc_per_node", "2", "examples/train_gpt.py", "--steps", "3")


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
    session.install(TORCH)
    session.install("-e", ".", "numpy")
    session.run("python", "benchmarks/run.py", *session.posargs)
