"""Composition with meshes: HSDP (replicate x shard), FSDP + tensor parallel (2-D), HSDP + TP (3-D).

Every rank trains the unsharded reference on the global batch; ranks of one TP group see the same data-parallel
slice of it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import (
    dp_coordinates,
    dp_slice,
    full_value,
    max_param_diff,
    mesh_nd,
    reference_and_copy,
    tp_mlps,
    train_on_dp_mesh,
)

TOL = 1e-5


def _shard(model: GPT, dp_mesh: Any, **kwargs: Any) -> None:
    for block in model.blocks:
        fc.fully_shard(block, mesh=dp_mesh, **kwargs)
    fc.fully_shard(model, mesh=dp_mesh, **kwargs)


# ------------------------------------------------------------------------------------------------------------ HSDP
def _hsdp(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    dp_mesh = mesh_nd((2, 2), ("replicate", "shard"))
    _shard(model, dp_mesh)
    placements = {p.placements for p in model.parameters()}
    expected = torch.chunk(reference.head.weight.detach(), 2)[dp_mesh.get_local_rank(1)]
    local_is_chunk = torch.equal(model.head.weight.to_local(), expected)
    return {
        "placements": placements,
        "local_is_chunk": local_is_chunk,
        "diff": train_on_dp_mesh(model, reference, cfg, dp_mesh),
    }


def test_hsdp_2x2_trains_like_the_reference(run_dist) -> None:
    for r in run_dist(4, _hsdp):
        assert r["placements"] == {(Replicate(), Shard(0))}
        assert r["local_is_chunk"]
        assert r["diff"] <= TOL


def _hsdp_sharded_accumulation_skipping_all_reduce(rank: int, ws: int) -> float:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    dp_mesh = mesh_nd((2, 2), ("replicate", "shard"))
    _shard(model, dp_mesh)
    fc.set_gradient_accumulation(model, "sharded")
    dp_rank, dp_size = dp_coordinates(dp_mesh)
    inputs, targets = synthetic_batch(cfg, 16, 0)
    loss_fn(reference(inputs), targets).backward()
    x, y = dp_slice(inputs, dp_rank, dp_size), dp_slice(targets, dp_rank, dp_size)
    micro = list(zip(x.chunk(2), y.chunk(2), strict=True))
    fc.set_requires_all_reduce(model, False)  # reduce-scatter only while accumulating ...
    with fc.no_sync(model):
        (loss_fn(model(micro[0][0]), micro[0][1]) / 2).backward()
    fc.set_requires_all_reduce(model, True)  # ... and all-reduce the sum once on the last micro-batch
    (loss_fn(model(micro[1][0]), micro[1][1]) / 2).backward()
    ref = dict(reference.named_parameters())
    return max((full_value(p.grad) - ref[n].grad).abs().max().item() for n, p in model.named_parameters())


def test_hsdp_accumulation_all_reduces_once_on_the_last_micro_batch(run_dist) -> None:
    assert max(run_dist(4, _hsdp_sharded_accumulation_skipping_all_reduce)) <= TOL


# ----------------------------------------------------------------------------------------------------- FSDP + TP
class UnevenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 13)  # 13 rows: uneven over tp=2, then over dp=2
        self.proj = nn.Linear(13, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


def _fsdp_tp_mlp(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_nd((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    reference = UnevenMLP()
    model = copy.deepcopy(reference)
    # Colwise with replicated outputs: both weights are cut on dim 0 by TP (13 -> 7/6, 3 -> 2/1), then by FSDP.
    # (RowwiseParallel cannot take an uneven hidden dim even without FSDP: it rebuilds its input as even shards.)
    plan = {"fc": ColwiseParallel(output_layouts=Replicate()), "proj": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh["tp"], plan)
    fc.fully_shard(model, mesh=mesh["dp"])
    placements = {n: p.placements for n, p in model.named_parameters()}
    full_ok = all(
        torch.equal(p.full_tensor(), dict(reference.named_parameters())[n]) for n, p in model.named_parameters()
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, target = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        ref_opt.zero_grad()
        (reference(x) - target).pow(2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        (model(dp_slice(x, dp_rank, 2)) - dp_slice(target, dp_rank, 2)).pow(2).mean().backward()
        opt.step()
    return {"placements": placements, "full_ok": full_ok, "diff": max_param_diff(model, reference)}


def test_fsdp_tp_uneven_mlp(run_dist) -> None:
    strided = _StridedShard(0, split_factor=2)
    for r in run_dist(4, _fsdp_tp_mlp):
        assert r["placements"] == {
            name: (strided, Shard(0)) for name in ["fc.weight", "fc.bias", "proj.weight", "proj.bias"]
        }
        assert r["full_ok"]  # full_tensor() reassembles the original rows in order
        assert r["diff"] <= TOL


def _fsdp_tp_gpt(rank: int, ws: int, hsdp: bool) -> float:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    if hsdp:
        mesh = mesh_nd((2, 2, 2), ("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
    else:
        mesh = mesh_nd((2, 2), ("dp", "tp"))
        dp_mesh = mesh["dp"]
    tp_mlps(model, mesh["tp"])
    _shard(model, dp_mesh)
    mlp = model.blocks[0].mlp
    dp_placements = (Replicate(),) if hsdp else ()
    assert mlp.fc.weight.placements == (*dp_placements, _StridedShard(0, split_factor=2), Shard(0))  # colwise
    assert mlp.proj.weight.placements == (*dp_placements, Shard(0), Shard(1))  # rowwise
    assert mlp.proj.bias.placements == (*dp_placements, Shard(0), Replicate())
    assert model.head.weight.placements == (*dp_placements, Shard(0))  # not tensor parallel
    assert isinstance(mlp.fc.weight, DTensor) and mlp.fc.weight.device_mesh.ndim == dp_mesh.ndim + 1
    return train_on_dp_mesh(model, reference, cfg, dp_mesh)


def test_fsdp_tp_gpt_blocks(run_dist) -> None:
    assert max(run_dist(4, _fsdp_tp_gpt, False)) <= TOL


@pytest.mark.slow
def test_hsdp_tp_3d_gpt_blocks(run_dist) -> None:
    assert max(run_dist(8, _fsdp_tp_gpt, True)) <= TOL
