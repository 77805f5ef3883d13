"""Parameters of several dtypes in one unit: one all-gather per unit (bytes, as torch's fully_shard sends them),
parity with a single-process reference at 1, 2 and 4 ranks and with torch's fully_shard side by side, and several
trainable dtypes (torch's fully_shard refuses those: gradients are reduced in the widest dtype)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

import fsdp_compose as fc
from tests.collective_bytes import CollectiveBytes
from tests.dist_utils import full_value, mesh_1d, mesh_nd


class Block(nn.Module):
    """A frozen bf16 projection, then a trainable fp32 LayerNorm and Linear (LoRA-style adapter on top)."""

    def __init__(self, dim: int, frozen_dtype: torch.dtype = torch.bfloat16, train_frozen: bool = False) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim).to(frozen_dtype)
        self.base.requires_grad_(train_frozen)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x.to(self.base.weight.dtype)).to(self.norm.weight.dtype)
        return x + self.head(torch.relu(self.norm(h)))


class Net(nn.Module):
    def __init__(self, dim: int = 12, layers: int = 2, **kwargs: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(dim, **kwargs) for _ in range(layers))
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)


def _shard(model: Net, shard: Any, mesh: Any, **kwargs: Any) -> Net:
    for block in model.blocks:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _train_sharded(model: nn.Module, rank: int, ws: int, steps: int) -> tuple[list[float], dict[str, int]]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses, counter = [], CollectiveBytes()
    for step in range(steps):
        x, y = (t.chunk(ws)[rank] for t in _batch(step))
        if step == steps - 1:
            with counter:
                loss = _step(model, opt, x, y)
        else:
            loss = _step(model, opt, x, y)
        dist.all_reduce(loss)
        losses.append(loss.item() / ws)
    return losses, counter.summary()


def _train_reference(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return [_step(model, opt, *_batch(step)).item() for step in range(steps)]


def _param_diff(model: nn.Module, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        value = full_value(p.detach())
        assert value.dtype == ref[name].dtype, (name, value.dtype, ref[name].dtype)
        worst = max(worst, (value.float() - full_value(ref[name].detach()).float()).abs().max().item())
    return worst


def _vs_reference(rank: int, ws: int, train_frozen: bool, layout: str = "1d") -> dict[str, Any]:
    model = Net(train_frozen=train_frozen)
    reference = copy.deepcopy(model)
    if layout == "hsdp":
        _shard(model, fc.fully_shard, mesh_nd((2, ws // 2), ("replicate", "shard")))
    elif layout == "dim1":  # every 2-D parameter sharded on its columns (Shard(1)): the relaid copy-out path
        _shard(model, fc.fully_shard, mesh_1d(ws), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    else:
        _shard(model, fc.fully_shard, mesh_1d(ws))
    grads_dtypes = {}
    losses, counts = _train_sharded(model, rank, ws, steps=4)
    ref_losses = _train_reference(reference, steps=4)
    for name, p in model.named_parameters():
        grads_dtypes[name] = str(p.dtype)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_diff": _param_diff(model, reference),
        "counts": counts,
        "dtypes": grads_dtypes,
    }


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_frozen_bf16_and_trainable_fp32_in_one_unit_match_single_process(run_dist, ws: int) -> None:
    for result in run_dist(ws, _vs_reference, False):
        assert result["dtypes"]["blocks.0.base.weight"] == "torch.bfloat16"
        assert result["dtypes"]["blocks.0.head.weight"] == "torch.float32"
        assert result["loss_diff"] < 1e-5, result
        assert result["param_diff"] < 1e-5, result
        if ws > 1:  # one all-gather per unit and pass: 2 blocks twice, the root (kept after forward) once
            assert result["counts"]["all_gather"] == 5, result


@pytest.mark.parametrize(("ws", "layout"), [(4, "hsdp"), (2, "dim1")])
def test_mixed_dtypes_on_hsdp_and_other_shard_dims_match_single_process(run_dist, ws: int, layout: str) -> None:
    for result in run_dist(ws, _vs_reference, False, layout):
        assert result["loss_diff"] < 1e-5, result
        assert result["param_diff"] < 1e-5, result


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_several_trainable_dtypes_reduce_in_the_widest(run_dist, ws: int) -> None:
    # torch's fully_shard asserts "uniform gradient dtype"; here bf16 and fp32 gradients are reduced together in
    # fp32 and each .grad is handed out in its parameter's dtype. The bf16 parameters round differently from a
    # single process (their gradient is summed in fp32 over ranks, then rounded once), so the bound is bf16's.
    for result in run_dist(ws, _vs_reference, True):
        assert result["loss_diff"] < 1e-3, result  # measured 2e-4
        assert result["param_diff"] < 1e-2, result  # measured 2e-3: one bf16 rounding step of a weight near 0.5


def _vs_torch(rank: int, ws: int, policy: str | None) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {}
    if policy == "bf16":
        kwargs["mp_policy"] = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours, theirs = Net(), Net()
    _shard(ours, fc.fully_shard, mesh_1d(ws), **kwargs)
    _shard(theirs, fully_shard, mesh_1d(ws), **kwargs)
    our_losses, our_counts = _train_sharded(ours, rank, ws, steps=4)
    their_losses, their_counts = _train_sharded(theirs, rank, ws, steps=4)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(our_losses, their_losses, strict=True)),
        "param_diff": _param_diff(ours, theirs),
        "ours": our_counts,
        "theirs": their_counts,
    }


@pytest.mark.parametrize("policy", [None, "bf16"])
@pytest.mark.parametrize("ws", [2, 4])
def test_mixed_dtypes_match_torchs_fully_shard(run_dist, ws: int, policy: str | None) -> None:
    for result in run_dist(ws, _vs_torch, policy):
        assert result["loss_diff"] < 1e-6, result
        assert result["param_diff"] < 1e-6, result
        assert result["ours"]["all_gather"] == result["theirs"]["all_gather"], result
        assert result["ours"]["all_gather_bytes"] == result["theirs"]["all_gather_bytes"], result
        assert result["ours"]["reduce_scatter"] == result["theirs"]["reduce_scatter"], result
        assert result["ours"]["reduce_scatter_bytes"] == result["theirs"]["reduce_scatter_bytes"], result


def _lifecycle(rank: int, ws: int) -> dict[str, Any]:
    """deepcopy, state_dict round trip and fc.full_state_dict of a unit of several dtypes."""
    model = _shard(Net(), fc.fully_shard, mesh_1d(ws))
    twin = copy.deepcopy(model)
    reference = Net()
    losses, _ = _train_sharded(model, rank, ws, steps=2)
    twin_losses, _ = _train_sharded(twin, rank, ws, steps=2)
    _train_reference(reference, steps=2)
    fresh = _shard(Net(), fc.fully_shard, mesh_1d(ws))
    fresh.load_state_dict(model.state_dict())
    full = fc.full_state_dict(model)
    expected = reference.state_dict()
    return {
        "twin_diff": max(abs(a - b) for a, b in zip(losses, twin_losses, strict=True)) + _param_diff(twin, model),
        "loaded_diff": _param_diff(fresh, model),
        "full_diff": max((full[k].float() - v.float()).abs().max().item() for k, v in expected.items())
        if full
        else 0.0,
        "full_dtypes": sorted({f"{k}:{v.dtype}" for k, v in full.items() if k.startswith("blocks.0.")}),
        "rank": rank,
    }


def test_deepcopy_state_dict_and_full_state_dict_of_a_unit_of_several_dtypes(run_dist) -> None:
    for result in run_dist(2, _lifecycle):
        assert result["twin_diff"] == 0.0, result
        assert result["loaded_diff"] == 0.0, result
        if result["rank"] == 0:
            assert result["full_diff"] < 1e-5, result
            assert "blocks.0.base.weight:torch.bfloat16" in result["full_dtypes"], result
            assert "blocks.0.head.weight:torch.float32" in result["full_dtypes"], result
