"""The one rule of every state machine in the engine: a transition outside its table is a bug, never carried on.

Each machine (a unit's gather state, its gradient pipeline, its phase in the step, the root's step) is an enum with
a table of allowed transitions; a move outside it raises ``transition_error``.
"""

from __future__ import annotations

import enum

import torch.distributed as dist

__all__ = ["internal_error", "transition_error"]


def transition_error(current: enum.Enum, new: enum.Enum, what: str) -> RuntimeError:
    """The error for a move its machine's table does not allow, naming ``what`` and both states."""
    return RuntimeError(
        f"internal error in fsdp_compose: {what} cannot go from {current.value} to {new.value}; please report this "
        "with the steps that led here"
    )


def internal_error(where: str, what: str) -> RuntimeError:
    """The error for a broken invariant: the rank, the unit or parameter, and what was missing."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return RuntimeError(
        f"internal error in fsdp_compose on rank {rank}: {where}: {what}; please report this with the steps that led "
        "here"
    )
