"""The one rule of every state machine in the engine: a transition outside its table is a bug, never carried on.

Each machine (a unit's gather state, its gradient pipeline, its phase in the step, the root's step) is an enum with
a table of allowed transitions; ``checked`` is how each of them moves.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

import torch.distributed as dist

__all__ = ["checked", "internal_error"]

_State = TypeVar("_State", bound=enum.Enum)


def checked(current: _State, new: _State, allowed: Mapping[_State, frozenset[_State]], what: str) -> _State:
    """``new`` if the table allows ``current -> new``; otherwise a ``RuntimeError`` naming ``what`` and both states."""
    if new not in allowed[current]:
        raise RuntimeError(
            f"internal error in fsdp_compose: {what} cannot go from {current.value} to {new.value}; please report "
            "this with the steps that led here"
        )
    return new


def internal_error(where: str, what: str) -> RuntimeError:
    """The error for a broken invariant: the rank, the unit or parameter, and what was missing."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return RuntimeError(
        f"internal error in fsdp_compose on rank {rank}: {where}: {what}; please report this with the steps that led "
        "here"
    )
