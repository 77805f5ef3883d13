"""An optimizer built before fully_shard: a clear error at its first step, never a model that silently trains nothing.

The user's parameter objects cannot take the sharded contents in place (``torch.utils.swap_tensors`` refuses a
plain parameter and a DTensor: different slots), so the module holds new objects and the old ones get a ``.grad``
that raises at the optimizer's step (fsdp_compose/replaced.py). Built after fully_shard, the optimizer trains with
parity against a single-process reference.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, mesh_1d, reference_and_copy, shard_gpt, train_pair


def _one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int, cfg: GPTConfig) -> None:
    inputs, targets = synthetic_batch(cfg, 4, 0)
    opt.zero_grad()
    loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    opt.step()


def _optimizer_before(rank: int, ws: int, kind: str, foreach: bool) -> dict[str, Any]:
    cfg = GPTConfig(n_layers=2)
    _, model = reference_and_copy(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, foreach=foreach)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    )
    shard_gpt(model, mesh_1d(ws))
    with pytest.raises(
        RuntimeError, match=r"parameter '.*' was replaced by fully_shard on .*build the optimizer after"
    ):
        _one_step(model, opt, rank, ws, cfg)
    # nothing was stepped: the sharded parameters still hold the initial values
    unchanged = all(torch.equal(p.full_tensor().detach(), before[n]) for n, p in model.named_parameters())
    # the optimizer built after fully_shard trains the same model on: the old objects' errors do not get in the way
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _one_step(model, opt, rank, ws, cfg)
    return {
        "unchanged": unchanged,
        "trained": not all(torch.equal(p.full_tensor().detach(), before[n]) for n, p in model.named_parameters()),
    }


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize(("kind", "foreach"), [("sgd", False), ("sgd", True), ("adamw", True)])
def test_an_optimizer_built_before_fully_shard_fails_at_its_first_step(
    run_dist, ws: int, kind: str, foreach: bool
) -> None:
    for result in run_dist(ws, _optimizer_before, kind, foreach):
        assert result == {"unchanged": True, "trained": True}


def _optimizer_after(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig(n_layers=2)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    diff = train_pair(rank, ws, model, reference, cfg, steps=3)  # the optimizer is built after fully_shard
    # nobody holds the replaced parameters (the check at the end of the next backward drops their references)
    gc.collect()
    refs = [ref for m in [*model.blocks, model] for _, ref in fc.get_state(m).params.shards.replaced.refs]
    left = sum(ref() is not None for ref in refs)
    return {"diff": diff, "left": left}


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_an_optimizer_built_after_fully_shard_trains(run_dist, ws: int) -> None:
    for result in run_dist(ws, _optimizer_after):
        assert result["diff"] <= 1e-5
        assert result["left"] == 0
