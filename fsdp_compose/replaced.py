"""The parameters a unit replaced: an optimizer built before ``fully_shard`` must fail loudly, not train nothing.

``fully_shard`` registers new ``nn.Parameter(DTensor)`` objects on the module; the user's parameters cannot take
the sharded contents in place (``torch.utils.swap_tensors`` refuses: a DTensor has slots a plain parameter lacks).
An optimizer built before ``fully_shard`` still holds the old objects, gets no gradient for them, and silently
steps nothing. So after each backward, every old parameter still alive (someone holds it: such an optimizer) gets a
``.grad`` that raises a clear error as soon as anything computes with it: the optimizer's next ``step``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

__all__ = ["ReplacedParams"]


class _ReplacedParameterGrad(torch.Tensor):
    """A gradient without storage whose every use raises the message it carries."""

    message: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, message: str) -> _ReplacedParameterGrad:
        grad = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        grad.message = message
        return grad  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        leaves = tree_leaves((args, kwargs or {}))
        message = next(leaf.message for leaf in leaves if isinstance(leaf, _ReplacedParameterGrad))
        raise RuntimeError(message)


class ReplacedParams:
    """Weak references to the user's parameters one unit replaced (the units' own, ``ManagedParam.original``)."""

    def __init__(self, owner_name: str, refs: Iterable[tuple[str, weakref.ref[nn.Parameter]]]) -> None:
        self.owner_name = owner_name
        self.refs = list(refs)

    def arm(self) -> None:
        """Give each replaced parameter still alive a ``.grad`` that raises; forget the ones that are gone.

        Called at the end of every backward: ``zero_grad()`` (``set_to_none``) removes it, and the next backward
        sets it again before the optimizer step. Once nobody holds them (the usual case) this costs nothing.
        """
        alive = []
        for fqn, ref in self.refs:
            param = ref()
            if param is None:
                continue
            alive.append((fqn, ref))
            if not isinstance(param.grad, _ReplacedParameterGrad):
                param.grad = _ReplacedParameterGrad(param, self._message(fqn))
        self.refs = alive

    def _message(self, fqn: str) -> str:
        return (
            f"parameter '{fqn}' was replaced by fully_shard on {self.owner_name}: this is the parameter object the "
            "module held before, which it no longer uses (the module now holds a sharded DTensor parameter). An "
            "optimizer built before fully_shard holds the old objects and would train nothing: build the optimizer "
            "after fully_shard (model.parameters() then yields the sharded parameters)"
        )
