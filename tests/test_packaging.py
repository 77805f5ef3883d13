"""The built wheel: license metadata as an SPDX expression, the LICENSE file, py.typed, and no build warnings."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_license_and_type_marker_and_builds_without_warnings(tmp_path: Path) -> None:
    # The build-system requirement (setuptools>=77, see pyproject.toml) must be installed: the build runs offline.
    pytest.importorskip("setuptools", minversion="77")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "fsdp_compose", source / "fsdp_compose", ignore=shutil.ignore_patterns("__pycache__"))
    # An absolute path: a bare name would be looked up on the package index.
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index"]
    command += ["-w", str(tmp_path / "wheels"), str(source)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "deprecat" not in output.lower(), output  # e.g. setuptools' "project.license as a TOML table"
    (wheel,) = (tmp_path / "wheels").glob("fsdp_compose-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        fields = archive.read(metadata).decode().splitlines()
    assert "fsdp_compose/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: BSD-3-Clause" in fields
    assert not any(f.startswith("Requires-Dist: typing-extensions") for f in fields)


def test_license_is_bsd_3_clause() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, fsdp_compose authors" in text
