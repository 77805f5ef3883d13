"""The engine's two internal errors: a state-machine move outside its table, and a broken invariant.

Two machines have a table of allowed transitions (``_ALLOWED``): a unit's gather state (``unit.UnitState``) and its
gradient pipeline (``grads.GradState``); a move outside it raises ``transition_error`` instead of carrying on. The
root's step phase (``step.StepPhase``) has no table: only step.py assigns it. ``internal_error`` is for any other
broken invariant (something missing that must be there).
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
