"""The one rule of every state machine in the engine: a transition outside its table is a bug, never carried on.

Each machine (a unit's gather state, its gradient pipeline, its phase in the step, the root's step) is an enum with
a table of allowed transitions; ``checked`` is how each of them moves.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["checked"]

_State = TypeVar("_State", bound=enum.Enum)


def checked(current: _State, new: _State, allowed: Mapping[_State, frozenset[_State]], what: str) -> _State:
    """``new`` if the table allows ``current -> new``; otherwise a ``RuntimeError`` naming ``what`` and both states."""
    if new not in allowed[current]:
        raise RuntimeError(
            f"internal error in fsdp_compose: {what} cannot go from {current.value} to {new.value}; please report "
            "this with the steps that led here"
        )
    return new
