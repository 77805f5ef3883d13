"""Closed-form figures the planner's measurements are checked against (docs/planner.md derives them).

Sharding (fsdp_compose's flat layout, docs/design.md): a unit's parameters are split on dim 0 over the ``S`` ranks
of the shard group with ``torch.chunk`` semantics, ``c = ceil(dim0 / S)`` rows per rank, and every rank's rows are
padded to ``c`` and laid end to end in one flat **segment** of ``seg_u = sum(c_p * row_numel_p)`` elements; rank
``r`` owns ``min(c, max(0, dim0 - r * c))`` real rows of each parameter. Then, per rank:

- sharded parameters: ``sum_u seg_u`` elements in the parameters' dtype (the flat buffers; padding included);
- gradients: the reduce-scatter's output, which the sharded ``.grad`` views: ``seg_u + Z_u`` elements per unit in
  the gradient dtype, where ``Z_u`` is the unit's number of trainable 0-dim parameters (their gradients ride in
  the tail; "had a gradient" flags are added only where a backward cannot promise every gradient, see grads.py);
- optimizer state: per parameter, of the rank's real rows (not padded): AdamW two tensors (``exp_avg``,
  ``exp_avg_sq``) and a 4-byte ``step``; SGD with momentum one; plain SGD none.

Collectives, per rank and step (the minimum: one gather per pass):

- all-gather: ``S * seg_u`` elements in ``param_dtype`` per unit, twice for a unit resharded after forward (the
  blocks) and once for one kept (the root);
- reduce-scatter: ``S * seg_u`` elements in ``reduce_dtype`` per trainable unit (counted: ``S * (seg_u + Z_u)``);
- HSDP all-reduce over the replicate group: ``seg_u`` elements per trainable unit (counted: ``seg_u + Z_u``).

Experts on their own mesh (``ep > 1``) are a unit of their own beside their block's (a sibling): the same formulas
with ``S`` the experts' shard group (``shard / ep`` ranks) and rows counted on the dim they are sharded on
(``Shard(1)`` where an ep rank holds fewer experts than that group has ranks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .step import DTYPES, ParamInfo, PlanConfig

__all__ = [
    "StateBytes",
    "gather_passes",
    "ideal_collective_bytes",
    "mesh_groups",
    "min_collective_bytes",
    "owned_rows",
    "padded_rows",
    "segment_numel",
    "sharded_state",
    "zero3_floor",
]


def padded_rows(dim0: int, shards: int) -> int:
    """Rows every rank's shard is padded to: ``ceil(dim0 / shards)``."""
    return -(-dim0 // shards)


def owned_rows(dim0: int, shards: int, rank: int) -> int:
    """Real rows of ``torch.chunk(dim0 rows, shards)[rank]`` (0 for trailing ranks past the end)."""
    rows = padded_rows(dim0, shards)
    return max(0, min(rows, dim0 - rank * rows))


def _row_numel(p: ParamInfo) -> int:
    """Elements of one row on the dim ``p`` is sharded on."""
    return math.prod(p.shape) // p.shape[p.shard_dim] if p.shape[p.shard_dim] else 0


def segment_numel(params: Sequence[ParamInfo], shards: int) -> int:
    """Elements of one rank's flat segment of a unit (0-dim parameters are kept whole, outside it)."""
    return sum(padded_rows(p.shape[p.shard_dim], shards) * _row_numel(p) for p in params if p.shape)


def mesh_groups(infos: Sequence[ParamInfo], config: PlanConfig) -> list[tuple[list[ParamInfo], int, int]]:
    """A unit's parameters by data-parallel mesh, each with its shard group's size and this rank's index in it:
    the dense ones on the shard dim, the experts (if any) on ``efsdp``."""
    shard_rank = config.rank % config.shard if config.tp == 1 else (config.rank // config.tp) % config.shard
    dense = [p for p in infos if not p.expert]
    experts = [p for p in infos if p.expert]
    groups = [(dense, config.shard, shard_rank)] if dense or not experts else []
    if experts:
        groups.append((experts, config.expert_shard, shard_rank // config.ep))
    return groups


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds between steps (gradients: while they exist, from backward to ``zero_grad``)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _dtypes(config: PlanConfig, params: Sequence[ParamInfo]) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(stored, gathered, reduced) dtypes of a unit's parameters under ``config``'s precision policy."""
    stored = params[0].dtype if params else torch.float32
    gathered = DTYPES[config.param_dtype] if config.param_dtype else stored
    reduced = DTYPES[config.reduce_dtype] if config.reduce_dtype else gathered
    return stored, gathered, reduced


def sharded_state(units: Mapping[str, Sequence[ParamInfo]], config: PlanConfig) -> StateBytes:
    """Exact per-rank bytes of the sharded parameters, gradients and optimizer state (see the module docstring)."""
    params = grads = optimizer = 0
    per_param_state = {"adamw": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}[config.optimizer]
    for unit in units.values():
        for infos, shards, rank in mesh_groups(unit, config):
            stored, _, reduced = _dtypes(config, infos)
            seg = segment_numel(infos, shards)
            scalars = [p for p in infos if not p.shape]
            params += seg * _size(stored) + sum(_size(p.dtype) for p in scalars)
            trainable = [p for p in infos if p.trainable]
            if trainable:
                grads += (seg + sum(1 for p in trainable if not p.shape)) * _size(reduced)
            for p in trainable:
                local = owned_rows(p.shape[p.shard_dim], shards, rank) * _row_numel(p) if p.shape else 1
                optimizer += per_param_state * local * _size(p.dtype)
                optimizer += 4 if config.optimizer == "adamw" else 0
    return StateBytes(params, grads, optimizer)


def zero3_floor(units: Mapping[str, Sequence[ParamInfo]], config: PlanConfig) -> int:
    """The ideal ZeRO-3 state per rank: parameters, gradients and optimizer state divided exactly by the number of
    data-parallel shards, no padding, no flags (what padding and layout add is the measured state minus this)."""
    per_param_state = {"adamw": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}[config.optimizer]
    total = 0.0
    for unit in units.values():
        for infos, shards, _ in mesh_groups(unit, config):
            stored, _, reduced = _dtypes(config, infos)
            for p in infos:
                numel = math.prod(p.shape)
                total += numel * _size(stored) / shards
                if p.trainable:
                    total += numel * (_size(reduced) + per_param_state * _size(p.dtype)) / shards
    return round(total)


def gather_passes(config: PlanConfig, unit: str, root: str = "root") -> int:
    """All-gathers of a unit per step: 2 when resharded after forward (blocks by default), 1 when kept (the root)."""
    setting = config.reshard_after_forward
    if unit == root or setting is False or (not isinstance(setting, bool) and setting == 1):
        return 1
    return 2


def min_collective_bytes(
    units: Mapping[str, Sequence[ParamInfo]], config: PlanConfig, *, root: str = "root"
) -> dict[str, int]:
    """The least bytes per kind one rank's FSDP collectives can move in a step (see the module docstring)."""
    gather = reduce = all_reduce = 0
    for name, unit in units.items():
        for infos, shards, _ in mesh_groups(unit, config):
            _, gathered, reduced = _dtypes(config, infos)
            seg = segment_numel(infos, shards)
            if shards > 1 and seg:
                gather += gather_passes(config, name, root) * shards * seg * _size(gathered)
            if any(p.trainable for p in infos) and seg:
                if shards > 1:
                    reduce += shards * seg * _size(reduced)
                if config.replicate > 1:
                    all_reduce += seg * _size(reduced)
    result = {"all_gather": gather, "reduce_scatter": reduce}
    if config.replicate > 1:
        result["all_reduce"] = all_reduce
    return result


def ideal_collective_bytes(units: Mapping[str, Sequence[ParamInfo]], config: PlanConfig, *, root: str = "root") -> int:
    """:func:`min_collective_bytes` without padding: every parameter moved exactly once per pass (what padding to
    ``ceil(dim0 / S)`` rows adds is the minimum minus this)."""
    total = 0
    for name, unit in units.items():
        for infos, shards, _ in mesh_groups(unit, config):
            _, gathered, reduced = _dtypes(config, infos)
            numel = sum(math.prod(p.shape) for p in infos if p.shape)
            trainable = sum(math.prod(p.shape) for p in infos if p.shape and p.trainable)
            if shards > 1:
                total += gather_passes(config, name, root) * numel * _size(gathered) + trainable * _size(reduced)
            if config.replicate > 1:
                total += -(-trainable // shards) * _size(reduced)
    return total
