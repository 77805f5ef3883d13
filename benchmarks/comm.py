"""Collective bytes: counted by wrapping ``torch.distributed``'s flat collectives, and the theoretical minimum.

:class:`CollectiveCounter` replaces ``dist.all_gather_single``, ``dist.reduce_scatter_single``, their deprecated
aliases ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` and ``dist.all_reduce`` for the duration of a
``with`` block, in this process only, and also rebinds module-level aliases of those functions in ``fsdp_compose.*``
and ``torch.distributed.*`` (fsdp_compose looks its all-gather up once at import, so patching ``dist`` alone would
miss it). Only the outermost call is counted (the deprecated names forward to the new ones). Bytes counted:

- all-gather: the output tensor's bytes (``world_size`` x shard, what every rank ends up holding);
- reduce-scatter: the input tensor's bytes (``world_size`` x shard);
- all-reduce: the tensor's bytes.

With a ``scope`` the counter also enters it around every counted call and every ``dist.Work.wait()``; the memory
measurement uses this to recognise a collective's own temporaries (see memory.py).

Not seen: DDP's all-reduces (issued by its C++ reducer), functional collectives (``torch.distributed._functional_
collectives``, used by DTensor redistribution; none run in a plain training step) and barriers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["CollectiveCounter", "UnitSpec", "min_collective_bytes"]

# name -> (kind, positional index of the tensor whose bytes count, keyword names it may be passed as)
_COLLECTIVES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "all_gather_single": ("all_gather", 0, ("output_tensor", "output")),
    "all_gather_into_tensor": ("all_gather", 0, ("output_tensor", "output")),
    "reduce_scatter_single": ("reduce_scatter", 1, ("input", "input_tensor")),
    "reduce_scatter_tensor": ("reduce_scatter", 1, ("input", "input_tensor")),
    "all_reduce": ("all_reduce", 0, ("tensor",)),
}
_PATCHED_MODULE_PREFIXES = ("fsdp_compose", "torch.distributed")


def _tensor_arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, names: tuple[str, ...]) -> torch.Tensor:
    if len(args) > index:
        return args[index]  # type: ignore[no-any-return]
    for name in names:
        if name in kwargs:
            return kwargs[name]  # type: ignore[no-any-return]
    raise TypeError(f"no tensor argument {names} in collective call")


@dataclass
class CollectiveCounter:
    """Counts bytes and calls per collective kind while active.

    ``scope``, when given, is entered around every counted collective call and every ``Work.wait()`` (where an
    asynchronous collective finishes): the memory counter uses it to tell a collective's own temporaries apart.
    """

    scope: Callable[[], AbstractContextManager[Any]] | None = None
    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    _depth: int = 0
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def _scoped(self) -> AbstractContextManager[Any]:
        return self.scope() if self.scope is not None else contextlib.nullcontext()

    def _wrap(self, original: Callable[..., Any], kind: str, index: int, names: tuple[str, ...]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counting(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                tensor = _tensor_arg(args, kwargs, index, names)
                self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
                self.calls[kind] = self.calls.get(kind, 0) + 1
            self._depth += 1
            try:
                with self._scoped():
                    return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counting

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            with self._scoped():
                return original(work, *args, **kwargs)

        return wait

    def _patch_sites(self) -> Iterator[tuple[Any, str, Any, Callable[..., Any]]]:
        """(owner, attribute, original, wrapper) for every alias of a counted collective (and ``Work.wait``)."""
        if self.scope is not None:
            yield dist.Work, "wait", dist.Work.wait, self._wrap_wait(dist.Work.wait)
        targets: dict[int, tuple[Any, Callable[..., Any]]] = {}  # id(original) -> (original, wrapper)
        for name, (kind, index, names) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                targets[id(original)] = (original, self._wrap(original, kind, index, names))
        for mod_name, module in list(sys.modules.items()):
            if module is None or not mod_name.startswith(_PATCHED_MODULE_PREFIXES):
                continue
            for attr, value in list(vars(module).items()):
                target = targets.get(id(value))
                if target is not None and target[0] is value:
                    yield module, attr, value, target[1]

    def __enter__(self) -> CollectiveCounter:
        for module, attr, original, wrapper in list(self._patch_sites()):
            self._restore.append((module, attr, original))
            setattr(module, attr, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, attr, original in reversed(self._restore):
            setattr(module, attr, original)
        self._restore.clear()


@dataclass(frozen=True)
class UnitSpec:
    """One ``fully_shard`` unit for the byte model: its parameters and how it behaves in a step."""

    params: tuple[nn.Parameter, ...]
    reshard_after_forward: bool  # gathered again in backward
    trainable: bool  # reduce-scattered in backward
    gathered: bool = True  # False: kept whole on every rank (frozen, frozen_params="replicate"), never all-gathered


def padded_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of a dim-0 sharded parameter once every rank's shard is padded to ``ceil(dim0 / world_size)`` rows."""
    if len(shape) == 0:
        return 0  # 0-dim parameters are replicated, not gathered
    return -(-shape[0] // world_size) * world_size * math.prod(shape[1:])


def min_collective_bytes(
    units: list[UnitSpec], world_size: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> int:
    """All-gather in forward, again in backward for resharded units, and one reduce-scatter per trainable unit.

    Units kept whole (``gathered=False``) cost nothing: they are neither gathered nor, being frozen, reduced.
    """
    param_size = torch.empty((), dtype=param_dtype).element_size()
    reduce_size = torch.empty((), dtype=reduce_dtype).element_size()
    total = 0
    for unit in units:
        numel = sum(padded_numel(p.shape, world_size) for p in unit.params)
        if unit.gathered:
            total += numel * param_size * (2 if unit.reshard_after_forward else 1)
        if unit.trainable:
            total += numel * reduce_size
    return total
