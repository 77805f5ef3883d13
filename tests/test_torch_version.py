"""The torch floor (fsdp_compose.compat.MIN_TORCH): older releases fail at import with a message naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_compose.compat import MIN_TORCH, check_torch_version

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.6.0", "2.12.1+cu128", "1.13.1"])
def test_older_releases_are_refused(version: str) -> None:
    with pytest.raises(ImportError, match=rf"torch>=2\.13, found torch {version.replace('+', '[+]')}: .*upgrade"):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.13.0", "2.14.0.dev20260301+cpu", "2.14.1+cu130", "3.0.0"])
def test_the_floor_and_newer_are_accepted(version: str) -> None:
    check_torch_version(version)


def test_the_floor_matches_pyproject() -> None:
    floor = ".".join(map(str, MIN_TORCH))
    assert f'"torch>={floor}"' in (REPO / "pyproject.toml").read_text()


def test_import_fails_loudly_on_an_older_torch() -> None:
    # A fresh interpreter that reports an older torch: importing the package raises before anything else runs.
    code = "import torch; torch.__version__ = '2.12.0'; import fsdp_compose"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError: fsdp_compose needs torch>=2.13, found torch 2.12.0" in done.stderr
