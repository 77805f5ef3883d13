"""The oldest torch release fsdp_compose runs on, checked once at import (no silent fallback on older ones).

The floor is set by two private DeviceMesh methods the data-parallel mesh handling needs: ``DeviceMesh._unflatten``
(torch 2.9; ``reshard_after_forward=k`` on a named mesh splits the shard dim with it) and ``DeviceMesh._get_root_mesh``
(a method since torch 2.10; FSDP with tensor parallelism finds the root mesh of both meshes with it). CI runs torch
2.13.
"""

from __future__ import annotations

import re

import torch

__all__ = ["MIN_TORCH", "check_torch_version"]

MIN_TORCH = (2, 10)


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError naming the installed release and the fix when torch is older than ``MIN_TORCH``."""
    version = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        return  # a local build with no release number: nothing to compare (its own APIs decide)
    found = (int(match.group(1)), int(match.group(2)))
    if found < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"fsdp_compose needs torch>={floor}, found torch {version}: it uses DeviceMesh._unflatten (torch 2.9) "
            f"and DeviceMesh._get_root_mesh (torch 2.10); upgrade torch (pip install 'torch>={floor}')"
        )
