"""Several backwards through one graph: ``retain_graph=True`` then another backward, ``torch.autograd.grad`` over the
model's output and then a backward, two losses sharing the graph.

Each case trains the example GPT sharded by fsdp_compose and by torch's ``fully_shard`` side by side with a
single-process reference on the same global batch: gradients accumulate over the backwards as in one process, and the
model stays sharded (DTensor parameters and gradients) after every one of them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import full_value, local_batch, max_param_diff, mesh_1d, reference_and_copy

CASES = ("retain_graph", "autograd_grad_then_backward", "two_losses")


def _backwards(model: GPT, x: torch.Tensor, y: torch.Tensor, case: str, scale: float) -> None:
    """The backwards of one step; ``scale`` makes the reference's mean over the global batch equal the sum of the
    ranks' local means divided by the world size (the sharded models average over ranks)."""
    hidden: list[torch.Tensor] = []
    handle = model.blocks[0].register_forward_hook(lambda module, args, out: hidden.append(out))
    logits = model(x)
    handle.remove()
    loss = loss_fn(logits, y) * scale
    if case == "retain_graph":
        loss.backward(retain_graph=True)
        (loss * 0.5).backward()
    elif case == "autograd_grad_then_backward":
        # A gradient with respect to a hidden state (the units after it run their backward, no parameter gets a
        # gradient), then the training backward.
        (grad_hidden,) = torch.autograd.grad(loss, hidden[0], retain_graph=True)
        assert grad_hidden.shape == hidden[0].shape
        loss.backward()
    else:
        other = logits.float().pow(2).mean() * scale * 0.1
        loss.backward(retain_graph=True)
        other.backward()


def _train(rank: int, ws: int, impl: str, case: str) -> dict[str, Any]:
    cfg = GPTConfig(n_layers=2)
    reference, model = reference_and_copy(cfg)
    mesh = mesh_1d(ws)
    if impl == "fc":
        for block in model.blocks:
            fc.fully_shard(block, mesh=mesh)
        fc.fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    grad_diff = 0.0
    for step in range(3):
        x, y = synthetic_batch(cfg, 4, step)
        _backwards(reference, x, y, case, 1.0)
        _backwards(model, local_batch(x, rank, ws), local_batch(y, rank, ws), case, 1.0)
        sharded = all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in model.parameters())
        assert sharded, [(n, type(p).__name__, type(p.grad).__name__) for n, p in model.named_parameters()]
        ref_grads = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            ref_grad = ref_grads[name].grad
            assert ref_grad is not None, name
            assert param.grad is not None, name
            grad_diff = max(grad_diff, (full_value(param.grad) - ref_grad).abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {"grad_diff": grad_diff, "param_diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_several_backwards_train_like_one_process(run_dist, ws: int, case: str) -> None:
    # The reference's loss is the mean over the global batch; the ranks' losses are means over their shards,
    # averaged by the reduction: equal for equal shard sizes (4 samples over 1, 2 or 4 ranks).
    for result in run_dist(ws, _train, "fc", case):
        assert result["grad_diff"] < 1e-5 and result["param_diff"] < 1e-5, result


@pytest.mark.parametrize("case", CASES)
def test_several_backwards_match_torch_fully_shard(run_dist, case: str) -> None:
    ours = run_dist(2, _train, "fc", case)
    theirs = run_dist(2, _train, "torch", case)
    for mine, torch_result in zip(ours, theirs, strict=True):
        assert mine["param_diff"] <= max(2 * torch_result["param_diff"], 1e-6), (mine, torch_result)
