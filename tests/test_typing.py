"""The package's type hints reach users: a strict user script type-checks against it as an installed package would.

mypy runs from a temporary directory with only the repository root on PYTHONPATH, so fsdp_compose is found the way
an installed package is (PEP 561): without ``fsdp_compose/py.typed`` every name imported from it would be ``Any``
(and ``--strict`` reports the import). ``nox -s typecheck`` runs the same script against a real (non-editable)
install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "typing" / "user_script.py"


def test_user_script_type_checks_under_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    shutil.copy(SCRIPT, tmp_path / "user_script.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cache = ROOT / ".mypy_cache" / "user_script"  # torch's analysis is reused between runs
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "user_script.py"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    revealed = re.findall(r'Revealed type is "(.*)"', result.stdout)
    assert len(revealed) == 3, result.stdout
    sharded, pair, state = revealed
    assert sharded == "user_script.Net"  # fully_shard returns the module as its own class, not Module or Any
    assert pair == "list[torch.nn.modules.linear.Linear]"
    assert "Any" not in state and state.endswith("| None"), state


def test_the_package_is_marked_typed() -> None:
    assert (ROOT / "fsdp_compose" / "py.typed").is_file()
