"""fc.set_collective_checks: ranks that disagree get the same clear error on every rank, before any collective of
the step, with the model unchanged; ranks that agree train as before."""

from __future__ import annotations

import pytest
import torch

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, make_optimizer, max_param_diff, mesh_1d, reference_and_copy, shard_gpt


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to_local().clone() for name, p in model.named_parameters()}  # type: ignore[attr-defined]


def _disagreement(rank: int, ws: int, how: str) -> dict[str, object]:
    cfg = GPTConfig(n_layers=2)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    fc.set_collective_checks(model, True)
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())

    def step(index: int) -> None:
        inputs, targets = synthetic_batch(cfg, 4, index)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        opt.zero_grad()
        loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
        opt.step()

    step(0)
    before = _snapshot(model)
    # the disagreement: rank 0 freezes one block's MLP input projection (same size as the other ranks' choice)
    if how == "freeze":
        model.blocks[0 if rank == 0 else 1].mlp.fc.weight.requires_grad_(False)
    inputs, targets = synthetic_batch(cfg, 4, 1)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    message = ""
    with pytest.raises(RuntimeError, match="fsdp_compose collective check: unit ") as info:
        if how == "no_sync" and rank == 0:
            with fc.no_sync(model):
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()
    message = str(info.value)
    unchanged = all(torch.equal(before[n], p.detach().to_local()) for n, p in model.named_parameters())  # type: ignore[attr-defined]
    # every rank makes the same change again: training goes on and matches the reference
    if how == "freeze":
        for block in model.blocks:
            block.mlp.fc.weight.requires_grad_(True)
    step(1)
    step(2)
    return {"message": message, "unchanged": unchanged, "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("how", ["freeze", "no_sync"])
def test_ranks_that_disagree_get_the_same_error(run_dist, ws: int, how: str) -> None:
    results = run_dist(ws, _disagreement, how)
    messages = {r["message"] for r in results}
    assert len(messages) == 1  # the same error on every rank
    message = messages.pop()
    if how == "freeze":
        assert "Block" in message and "trainable" in message and "mlp.fc.weight" in message
    else:
        assert "requires_gradient_sync" in message
    for result in results:
        assert result["unchanged"]
        assert result["diff"] <= 1e-5
