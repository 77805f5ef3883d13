"""``fc.move_to_host`` / ``fc.move_to_device``: a sharded model and its optimizer off the device between phases.

On the CPU test machine "the device" is CPU memory too, so what is checked is the contract: after the move every
storage of the model and of the optimizer is empty (zero bytes where the model lives), a forward is refused with a
clear error, and after moving back the same tensor objects hold bit-exact values, so training goes on exactly as a
twin that never moved (also between the micro-batches of an accumulation window, and under HSDP).
``tests/cuda_check.py`` measures the device memory when a GPU is lent.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, mesh_1d, mesh_nd, shard_gpt

_CFG = GPTConfig(n_layers=2)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _everything(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = [*model.parameters(), *model.buffers()]
    found += [p.grad for p in model.parameters() if p.grad is not None]
    found += [v for per in opt.state.values() for v in per.values() if isinstance(v, torch.Tensor)]
    return [_local(t) for t in found]


def _moved(rank: int, ws: int, hsdp: bool, inside_window: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = mesh_nd((2, ws // 2), ("replicate", "shard")) if hsdp else mesh_1d(ws)
    models = [shard_gpt(GPT(_CFG), mesh), None]
    models[1] = copy.deepcopy(models[0])  # the twin that never moves
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    result: dict[str, Any] = {}
    for step in range(4):
        inputs, targets = synthetic_batch(_CFG, 4 * ws, step)
        x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
        for index, (model, opt) in enumerate(zip(models, opts, strict=True)):
            moves = index == 0 and step == 1
            with fc.no_sync(model):
                loss_fn(model(x[: len(x) // 2]), y[: len(y) // 2]).backward()
            if moves and inside_window:  # gradients held in the units' accumulation buffers
                _move_and_back(model, opt, x, result)
            loss_fn(model(x[len(x) // 2 :]), y[len(y) // 2 :]).backward()
            opt.step()
            if moves and not inside_window:  # gradients and optimizer state after the step
                _move_and_back(model, opt, x, result)
            opt.zero_grad()
    result["equal"] = all(
        torch.equal(_local(a), _local(b)) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
    )
    return result


def _move_and_back(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, result: dict[str, Any]) -> None:
    before = [t.clone() for t in _everything(model, opt)]
    objects = [id(t) for t in [*model.parameters(), *opt.state]]
    copies = fc.move_to_host(model, opt)
    result["host_bytes"] = copies.nbytes
    result["left_bytes"] = sum(t.untyped_storage().nbytes() for t in _everything(model, opt))
    try:
        model(x)
    except RuntimeError as error:
        result["forward_error"] = str(error)
    fc.move_to_device(model)
    result["bit_exact"] = all(torch.equal(a, b) for a, b in zip(before, _everything(model, opt), strict=True))
    result["same_objects"] = objects == [id(t) for t in [*model.parameters(), *opt.state]]


@pytest.mark.parametrize(("ws", "hsdp"), [(1, False), (2, False), (4, True)])
@pytest.mark.parametrize("inside_window", [False, True], ids=["after_step", "inside_window"])
def test_a_model_moved_to_the_host_and_back_trains_as_if_it_never_moved(
    run_dist, ws: int, hsdp: bool, inside_window: bool
) -> None:
    for result in run_dist(ws, _moved, hsdp, inside_window):
        assert result["host_bytes"] > 0 and result["left_bytes"] == 0
        assert "fc.move_to_device(model)" in result["forward_error"]
        assert result["bit_exact"] and result["same_objects"]
        assert result["equal"]
