"""A unit's gradient side is rebuilt when its parameters change under it: a cast (``model.to(dtype)``), a
trainability change that changes the reduce dtype (a unit of several dtypes), a ``copy.deepcopy``. The user's
per-unit settings survive each rebuild (divide factor, FSDP2's all-reduce hook, the unused-parameter mode), and the
gradients equal a single-process reference's on the same global batch.

Integer-valued weights and inputs keep every gradient an exact small integer, so the sharded sums (divide factor 1)
equal the reference's exactly in every dtype used here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_compose as fc
from tests.dist_utils import full_value, mesh_1d


class TwoDtypes(nn.Module):
    """An fp32 layer into a bf16 layer, plus a bf16 layer the forward never uses: one unit of several dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4, bias=False)
        self.second = nn.Linear(4, 5, bias=False).to(torch.bfloat16)
        self.unused = nn.Linear(2, 2, bias=False).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x.to(self.first.weight.dtype))
        return self.second(hidden.to(self.second.weight.dtype)).float()


def _integer_model() -> TwoDtypes:
    torch.manual_seed(0)
    model = TwoDtypes()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) % 3 + rank


def _summed_reference(model: nn.Module, ws: int) -> dict[str, torch.Tensor | None]:
    """Gradients of the sum over ranks of each rank's loss: what divide factor 1 hands every rank."""
    for r in range(ws):
        model(_batch(r)).sum().backward()
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def _sharded(model: nn.Module, ws: int, hook_calls: list[int]) -> nn.Module:
    fc.fully_shard(model, mesh=mesh_1d(ws), fsdp2_methods=True)
    fc.set_gradient_divide_factor(model, 1.0)
    model.set_all_reduce_hook(lambda output: hook_calls.append(output.numel()))  # type: ignore[operator]
    model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    return model


def _grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor | None]:
    model(_batch(rank)).sum().backward()
    return {name: None if p.grad is None else full_value(p.grad) for name, p in model.named_parameters()}


def _rebuilds(rank: int, ws: int, change: str) -> dict[str, Any]:
    reference = _integer_model()
    calls: list[int] = []
    model = _sharded(_integer_model(), ws, calls)
    _grads(model, rank)  # one step before the change: the gradient side exists and has been used
    model.zero_grad(set_to_none=True)
    calls.clear()
    state = fc.get_state(model)
    assert state is not None
    before = state.grads  # type: ignore[attr-defined]
    if change == "cast":
        model.to(torch.float64)
        reference.to(torch.float64)
    elif change == "trainability":  # the fp32 layer frozen: bf16 is the only trainable dtype, so reduces in bf16
        model.first.requires_grad_(False)  # type: ignore[union-attr]
        reference.first.requires_grad_(False)
    else:
        model = copy.deepcopy(model)
        state = fc.get_state(model)
        assert state is not None
    grads = _grads(model, rank)
    rebuilt = state.grads is not before  # type: ignore[attr-defined]
    return {
        "grads": grads,
        "expected": _summed_reference(reference, ws),
        "hook_calls": len(calls),
        "rebuilt": rebuilt,
        "reduce_dtype": state.grads.spec.reduce_dtype,  # type: ignore[attr-defined]
    }


@pytest.mark.parametrize("change", ["cast", "trainability", "deepcopy"])
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_settings_survive_a_rebuild_of_the_gradient_side(run_dist, ws: int, change: str) -> None:
    for r in run_dist(ws, _rebuilds, change):
        assert r["hook_calls"] == 1, "FSDP2's all-reduce hook was lost with the old gradient side"
        expected_dtype = {"cast": torch.float64, "trainability": torch.bfloat16, "deepcopy": torch.float32}[change]
        assert r["reduce_dtype"] == expected_dtype
        assert r["rebuilt"]
        for name, expected in r["expected"].items():
            got = r["grads"][name]
            if name == "unused.weight":  # set_reduce_scatter_unused_params(True): zeros, not None
                assert got is not None and torch.count_nonzero(got) == 0, name
            elif expected is None:
                assert got is None, name
            else:
                assert got is not None and got.dtype == expected.dtype, name
                torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)  # divide factor 1: the sum
