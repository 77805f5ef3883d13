"""Opt-in check that every rank is about to run the same collectives: ``fc.set_collective_checks(model, True)``.

Ranks that freeze different parameters, disagree on no-sync, on ``reshard_after_forward`` or on the set of units
issue collectives of different shapes or in a different order: a hang, or worse, gradients silently mixed. The check
is the schedule's fingerprint (``StepSchedule.fingerprint``: every unit's settings and the step's program), the same
one each backward's agreement carries: the root's pre-forward all-reduces it over the agreement's group (one tiny
collective per step, before any other). Only on a mismatch are the units' settings gathered, so that every rank
raises the same error naming the unit and what differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .collectives import all_reduce_max

if TYPE_CHECKING:
    from .program import StepSchedule

__all__ = ["check_ranks_agree"]

Settings = list[tuple[str, dict[str, object]]]


def check_ranks_agree(schedule: StepSchedule, group: dist.ProcessGroup | None) -> None:
    """Raise the same ``RuntimeError`` on every rank of ``group`` (the agreement's) when the ranks' schedules
    differ."""
    if group is None:
        return
    # Whether a backward may follow this forward is part of it: ranks that ran different numbers of forwards (a
    # ``generate`` that stopped at different lengths) meet here, one in a training forward, another still decoding.
    training = torch.is_grad_enabled()
    fingerprint = schedule.fingerprint() ^ int(training)
    # max(x) == -max(-x) only where every rank sent the same x: one MAX all-reduce answers on every rank alike.
    values = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=schedule.root.device)
    all_reduce_max(values, group, async_op=False)
    high, low = values.tolist()
    if high == -low:
        return
    everyone: list[tuple[bool, Settings] | None] = [None] * group.size()
    dist.all_gather_object(everyone, (training, schedule.settings()), group=group)
    raise RuntimeError(_difference(everyone, dist.get_process_group_ranks(group)))


def _difference(everyone: list[tuple[bool, Settings] | None], ranks: list[int]) -> str:
    modes = [found[0] if found is not None else None for found in everyone]
    if len(set(modes)) > 1:
        training = [rank for rank, mode in zip(ranks, modes, strict=True) if mode]
        without = [rank for rank, mode in zip(ranks, modes, strict=True) if not mode]
        return (
            f"fsdp_compose collective check: ranks {training} run a forward with gradients enabled while ranks "
            f"{without} run one without: the ranks ran different numbers of forwards of this model (e.g. generate "
            "stopping at a different length on each rank: pass synced_gpus=True, or run the same number of forwards "
            "everywhere), and their collectives no longer match"
        )
    first: Settings = everyone[0][1] if everyone[0] is not None else []
    for rank, found in zip(ranks[1:], everyone[1:], strict=True):
        other: Settings = found[1] if found is not None else []
        if [name for name, _ in other] != [name for name, _ in first]:
            return (
                f"fsdp_compose collective check: ranks {ranks[0]} and {rank} have different sharded units "
                f"({[n for n, _ in first]} vs {[n for n, _ in other]}); every rank must shard the same modules"
            )
        for (name, mine), (_, theirs) in zip(first, other, strict=True):
            for key, value in mine.items():
                if theirs[key] != value:
                    return (
                        f"fsdp_compose collective check: unit {name} differs between ranks {ranks[0]} and {rank} in "
                        f"{key}{_which(mine, theirs, key)}: {value!r} vs {theirs[key]!r}; every rank must make the "
                        "same changes (requires_grad, no_sync, reshard settings) at the same step, or the "
                        "collectives mismatch"
                    )
    return "fsdp_compose collective check: ranks differ across the replicate groups; compare their settings"


def _which(mine: dict[str, object], theirs: dict[str, object], key: str) -> str:
    values, other, names = mine[key], theirs[key], mine["parameters"]
    if isinstance(values, list) and isinstance(other, list) and isinstance(names, list) and len(values) == len(other):
        return f" of {[p for p, a, b in zip(names, values, other, strict=True) if a != b]}"
    return ""
