"""Optimizer step in backward: each unit steps as soon as its gradients are reduced; results equal the reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import make_optimizer, max_param_diff, mesh_1d, mesh_nd, reference_and_copy, shard_gpt


def _in_backward(rank: int, ws: int, kind: str, optimizer: str) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    dp_mesh = mesh_1d(ws) if kind == "1d" else mesh_nd((2, ws // 2), ("replicate", "shard"))
    shard_gpt(model, dp_mesh)
    optimizers = fc.set_optimizer_in_backward(model, make_optimizer(optimizer))
    ref_opt = make_optimizer(optimizer)(reference.parameters())
    grads_left = []
    stepped_inside_backward: list[bool] = []
    for opt in optimizers:  # -1 outside a backward pass
        opt.register_step_post_hook(
            lambda *unused: stepped_inside_backward.append(torch._C._current_graph_task_id() != -1)
        )
    for step in range(3):
        inputs, targets = synthetic_batch(cfg, 4, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        loss_fn(model(inputs.chunk(ws)[rank]), targets.chunk(ws)[rank]).backward()  # steps inside backward
        grads_left.append(any(p.grad is not None for p in model.parameters()))
    return {
        "diff": max_param_diff(model, reference),
        "n_optimizers": len(optimizers),
        "grads_left": grads_left,
        "steps": stepped_inside_backward,
    }


@pytest.mark.parametrize(("kind", "optimizer"), [("1d", "sgd"), ("1d", "adamw"), ("hsdp", "sgd")])
def test_optimizer_in_backward_matches_the_reference(run_dist, kind: str, optimizer: str) -> None:
    for r in run_dist(4, _in_backward, kind, optimizer):
        assert r["diff"] <= (1e-5 if optimizer == "sgd" else 2e-3)  # AdamW: see test_parity.ADAMW_TOL
        assert r["n_optimizers"] == 3  # root + 2 blocks
        assert not any(r["grads_left"])  # no gradient outlives its unit
        assert len(r["steps"]) == 3 * 3 and all(r["steps"])  # every unit, every step, inside backward
