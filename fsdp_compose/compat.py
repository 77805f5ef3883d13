"""The oldest torch release fsdp_compose runs on, checked once at import (no silent fallback on older ones).

The floor is torch 2.13: the oldest release on which the whole test suite passes (it is raised to it rather than
bending the engine to older releases). What the older ones lack, as observed on them:

- torch 2.12 and older keep the Python object of an autograd graph node (``grad_fn``, ``next_functions``) only
  while Python holds a reference to it, so a dropped node's ``id()`` is soon reused by another one; 2.13 keeps one
  object per node for the node's life. The engine walks the graph below a unit's outputs keyed by ``id(node)``
  (``step._recomputes_inside``, ``hooks.check_backward_reads_none_of``); on 2.12 those walks skip nodes: a
  reentrant activation checkpoint goes unseen, a parameter it recomputes with is freed early, and the recompute
  fails with "setStorage ... out of bounds for storage of size 0" (also where ``set_unshard_in_backward(False)``
  should name the parameter a unit's backward reads). 27 tests fail on 2.12.0.
- torch 2.12 and older also lack ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (the library
  falls back to the older names), the ``FSDPModule`` methods ``set_reduce_scatter_unused_params``,
  ``set_reduce_scatter_max_input_buffers`` and ``set_separate_reduce_scatter_group``, and support for
  ``torch.func.jvp`` / ``torch.vmap`` in their own ``fully_shard``, which the suite compares against.
- torch 2.11 and older lack ``ShardPlacementResult`` (the suite cannot be collected); on 2.10 the planner's
  fake flat all-gather on meta tensors, ``torch.func.jvp`` over a unit (autograd Functions without
  ``setup_context``) and mixed-dtype units fail too.

Two private DeviceMesh methods the mesh handling uses set an earlier bound: ``DeviceMesh._unflatten`` (torch 2.9;
``reshard_after_forward=k`` on a named mesh splits the shard dim with it) and ``DeviceMesh._get_root_mesh`` (a
method since torch 2.10; FSDP with tensor parallelism finds the root mesh of both meshes with it).

CI runs torch 2.13; ``nox -s tests_torch`` runs the suite on the floor release and on the newest torch the package
index offers.
"""

from __future__ import annotations

import re

import torch

__all__ = ["MIN_TORCH", "check_torch_version"]

MIN_TORCH = (2, 13)


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
            f"fsdp_compose needs torch>={floor}, found torch {version}: before torch 2.13 an autograd graph node's "
            "Python object (and so its id()) does not live as long as the node, and the engine's walks of the graph "
            "rely on it (on torch 2.12 a reentrant activation checkpoint goes unseen and its recompute reads a freed "
            f"parameter); upgrade torch (pip install 'torch>={floor}')"
        )
