"""Finding and replacing the tensors in a module's inputs and outputs, whatever holds them.

``torch.utils._pytree`` knows tuples, lists, dicts and namedtuples; module outputs are also dataclasses (torch's own
FSDP tests return them, as do many model libraries). A unit must see every tensor of its outputs to hook its
backward, so both are walked here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["map_tensors", "tensors_in"]


def tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, value)
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with every tensor ``t`` in it replaced by ``fn(t)`` (containers rebuilt only where needed)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            old = getattr(value, f.name)
            new = map_tensors(fn, old)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    leaves, spec = tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return value  # a leaf that is no tensor
    new_leaves = [map_tensors(fn, leaf) for leaf in leaves]
    if all(a is b for a, b in zip(new_leaves, leaves, strict=True)):
        return value
    return tree_unflatten(new_leaves, spec)
