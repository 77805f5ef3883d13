"""A parameter replaced between steps is picked up by the step's identity pass (``ShardState.params_changed``),
also for a unit called on its own, outside its root's forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor

import fsdp_compose as fc
from tests.dist_utils import mesh_1d


def _unit_called_on_its_own(rank: int, ws: int) -> float:
    mesh = mesh_1d(ws)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    reference.load_state_dict(model.state_dict())
    fc.fully_shard(model[0], mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()  # lazy init and one step: the units are sharded again after it
    new = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    model[0].weight = nn.Parameter(distribute_tensor(new, mesh, [Shard(0)]))
    reference[0].weight = nn.Parameter(new.clone())
    with torch.no_grad():
        return float((model[0](x) - reference[0](x)).abs().max())


@pytest.mark.parametrize("ws", [1, 2])
def test_a_unit_called_on_its_own_uses_a_replaced_parameter(run_dist: Any, ws: int) -> None:
    """No root forward runs before the unit's own forward: its pre-forward finds the replacement itself."""
    for diff in run_dist(ws, _unit_called_on_its_own):
        assert diff < 1e-6
