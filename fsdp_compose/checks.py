"""Opt-in check that every rank is about to run the same collectives: ``fc.set_collective_checks(model, True)``.

Ranks that freeze different parameters, disagree on no-sync, on ``reshard_after_forward`` or on the set of units
issue collectives of different shapes or in a different order: a hang, or worse, gradients silently mixed. What
decides a step's collectives is, per unit: which parameters are reduced and which are kept whole, the sync and
accumulation settings, the reshard setting and the compute dtype. With checks on, the root's pre-forward turns that
description into one 64-bit fingerprint and all-gathers it over the root's data-parallel groups (one tiny
collective per step, before any other; a replicate group managed by torchft is left out); only on a mismatch are
the full descriptions gathered, so that every rank raises the same error naming the unit and what differs.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .collectives import all_gather_flat

if TYPE_CHECKING:
    from .state import ShardState

__all__ = ["check_ranks_agree", "describe_step"]


def describe_step(states: list[ShardState]) -> list[tuple[str, dict[str, Any]]]:
    """Per unit (in registration order), the settings that decide its collectives in the next step."""
    described = []
    for state in states:
        params = state.params
        described.append(
            (
                params.owner_name,
                {
                    "parameters": [mp.fqn for mp in params.shards.params],
                    "trainable": [params.current_requires_grad(mp) for mp in params.shards.params],
                    "kept whole": [mp.slot is None for mp in params.shards.params],
                    "requires_gradient_sync": state.requires_gradient_sync,
                    "gradient_accumulation": state.gradient_accumulation,
                    "requires_all_reduce": state.requires_all_reduce,
                    "reshard_after_forward": state.reshard_after_forward_setting,
                    "reshard_after_backward": state.reshard_after_backward,
                    "compute dtype": str(params.param_dtype),
                },
            )
        )
    return described


def _fingerprint(described: list[tuple[str, dict[str, Any]]]) -> int:
    digest = hashlib.sha256(repr(described).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def check_ranks_agree(root: ShardState, states: list[ShardState]) -> None:
    """Raise the same ``RuntimeError`` on every rank of the root's data-parallel mesh when ranks disagree."""
    # Not over a managed replicate group (torchft's): its all-reduce zeroes a healing replica's verdict, and its
    # size() counts the participating replicas, not the members its all-gather runs over (meshes.is_c10d_group).
    groups = root.params.dp.agreement_groups
    if not groups:
        return
    described = describe_step(states)
    mine = torch.tensor([_fingerprint(described)], dtype=torch.int64, device=root.device)
    agree = True
    for group in groups:
        gathered = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=root.device)
        all_gather_flat(gathered, mine, group, async_op=False)
        agree = agree and bool((gathered == mine).all())
    # Every rank must take the same branch: agree on the verdict (a rank that sees a difference tells the others).
    verdict = torch.tensor([0 if agree else 1], dtype=torch.int64, device=root.device)
    for group in groups:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    if not int(verdict.item()):
        return
    everyone: list[Any] = [None] * dist.get_world_size(groups[0])
    dist.all_gather_object(everyone, described, group=groups[0])
    raise RuntimeError(_difference(everyone, dist.get_process_group_ranks(groups[0])))


def _difference(everyone: list[list[tuple[str, dict[str, Any]]]], ranks: list[int]) -> str:
    first = everyone[0]
    for rank, other in zip(ranks[1:], everyone[1:], strict=True):
        if [name for name, _ in other] != [name for name, _ in first]:
            return (
                f"fsdp_compose collective check: ranks {ranks[0]} and {rank} have different sharded units "
                f"({[n for n, _ in first]} vs {[n for n, _ in other]}); every rank must shard the same modules"
            )
        for (name, mine), (_, theirs) in zip(first, other, strict=True):
            for key, value in mine.items():
                if theirs[key] != value:
                    detail = _which(mine, theirs, key)
                    return (
                        f"fsdp_compose collective check: unit {name} differs between ranks {ranks[0]} and {rank} in "
                        f"{key}{detail}: {value!r} vs {theirs[key]!r}; every rank must make the same changes "
                        "(requires_grad, no_sync, reshard settings) at the same step, or the collectives mismatch"
                    )
    return "fsdp_compose collective check: ranks differ across the replicate groups; compare their settings"


def _which(mine: dict[str, Any], theirs: dict[str, Any], key: str) -> str:
    if isinstance(mine[key], list) and len(mine[key]) == len(theirs[key]):
        names = [p for p, a, b in zip(mine["parameters"], mine[key], theirs[key], strict=True) if a != b]
        return f" of {names}"
    return ""
