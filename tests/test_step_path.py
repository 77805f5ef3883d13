"""What one training step walks through: the engine's files only, unless the user changed something.

A step that changes nothing enters hooks, step, backward, program, state, the unit's two sides (gathering and
full_params; grads and delivery) and collectives; the code that handles a change (unit.py: dtype, trainability,
replaced parameters; flat.py: the shards' layout) runs only when the step's identity pass finds one
(``ShardState.params_changed``), including for a unit called on its own, outside its root's forward.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, mesh_1d, reference_and_copy, shard_gpt

ENGINE = {
    "hooks.py",
    "step.py",
    "backward.py",
    "program.py",
    "state.py",
    "gathering.py",
    "full_params.py",
    "grads.py",
    "delivery.py",
    "collectives.py",
}
CHANGE_ONLY = {"unit.py", "flat.py", "meshes.py", "offload.py", "replaced.py"}


def _files_of_one_step(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig()
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = synthetic_batch(cfg, 4, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    marker = os.sep + "fsdp_compose" + os.sep
    entered: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if marker in path and not path.split(marker, 1)[1].startswith("plan"):  # plan/gpt.py: the model
                entered.add(path.split(marker, 1)[1])

    steps = []
    for step in range(4):
        if step == 1:
            # The parameters fully_shard replaced are gone: the end of this step forgets them (replaced.py arms
            # those still alive at the end of every backward).
            gc.collect()
        if step == 2:  # the third step changes nothing; the fourth follows a change of trainability
            sys.setprofile(profile)
        if step == 3:
            model.blocks[0].mlp.fc.weight.requires_grad_(False)
            sys.setprofile(profile)
        loss_fn(model(x), y).backward()
        sys.setprofile(None)
        opt.step()
        opt.zero_grad()
        steps.append(sorted(entered))
        entered = set()
    return {"unchanged": steps[2], "after_a_change": steps[3]}


@pytest.mark.parametrize("ws", [1, 2])
def test_a_step_that_changes_nothing_enters_only_the_engine(run_dist: Any, ws: int) -> None:
    for result in run_dist(ws, _files_of_one_step):
        assert set(result["unchanged"]) <= ENGINE, result["unchanged"]
        assert "unit.py" in result["after_a_change"]  # the check can fail: a change is handled there


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
