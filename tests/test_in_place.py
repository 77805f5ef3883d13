"""A shard group of one rank works in place (docs/design.md, "A shard group of one rank: in place"): on one rank the
full parameters are the shards and the gradients become the sharded ``.grad`` as autograd made them, so a step
copies what the plain model copies; on a replicate-only HSDP mesh the one copy added is the gradients' into the
all-reduce bucket, as DDP's. Numbers against a single-process reference trained on the same global batch.

Bytes copied are counted by ``benchmarks/limit.py``'s dispatch mode (copy, cast and concatenation ops, outside the
collectives' calls and waits), for fsdp_compose and the plain model alike.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_compose as fc
from benchmarks.limit import CopiedBytes
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, max_param_diff, mesh_1d, mesh_nd, shard_gpt

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4)


def _copied_per_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    counter = CopiedBytes()
    with fc.CollectiveRecorder(scope=counter.inside_collective), counter:
        loss_fn(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return counter.bytes


def _in_place(rank: int, ws: int, mesh_kind: str, bf16: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = GPT(CFG)
    model, plain = copy.deepcopy(reference), copy.deepcopy(reference)
    mesh = mesh_1d(1) if mesh_kind == "one_rank" else mesh_nd((ws, 1), ("replicate", "shard"))
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    shard_gpt(model, mesh, **({"mp_policy": policy} if policy else {}))
    views: list[bool] = []

    def same_storage(module: nn.Module, args: Any) -> None:  # after fsdp_compose's pre-hook: the full parameter
        full = module.fc.weight
        sharded = fc.get_state(model.blocks[0]).params.shards.flat
        views.append(full.untyped_storage().data_ptr() == sharded.untyped_storage().data_ptr())

    model.blocks[0].mlp.register_forward_pre_hook(same_storage)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    copied, plain_copied = [], []
    for step in range(3):
        inputs, targets = synthetic_batch(CFG, 4 * ws, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        mine, theirs = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
        copied.append(_copied_per_step(model, opt, mine, theirs))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            plain_copied.append(_copied_per_step(plain, plain_opt, mine, theirs))
    params = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {
        "diff": max_param_diff(model, reference),
        "copied": copied,
        "plain": plain_copied,
        "params": params,
        "views": views,
    }


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_rank_copies_what_the_plain_model_copies(run_dist, bf16: bool) -> None:
    """One rank: fp32 copies exactly the plain model's bytes (its full parameters are views of the shards); bf16
    adds only the casts of the parameters (in forward, and again in backward after resharding) against autocast."""
    (result,) = run_dist(1, _in_place, "one_rank", bf16)
    assert result["diff"] <= (3e-2 if bf16 else 1e-5), result["diff"]
    if bf16:
        assert not any(result["views"])  # computing in bf16: the full parameters are bf16 casts
        for mine, plain in zip(result["copied"][1:], result["plain"][1:], strict=True):
            assert mine - plain <= result["params"], (result["copied"], result["plain"], result["params"])
    else:
        assert all(result["views"]) and len(result["views"]) == 3, result["views"]
        assert result["copied"][1:] == result["plain"][1:], (result["copied"], result["plain"])


def test_a_replicate_only_mesh_copies_the_gradients_once(run_dist) -> None:
    """HSDP as pure replication (2 x 1): the full parameters are the shards, and the one copy added per step is the
    gradients' into each unit's all-reduce buffer (DDP's bucket copy), reduced in place."""
    for result in run_dist(2, _in_place, "replicate_only", False):
        assert result["diff"] <= 1e-5, result["diff"]
        assert all(result["views"]), result["views"]
        for mine, plain in zip(result["copied"][1:], result["plain"][1:], strict=True):
            # beside the gradients, the backward's agreement rows over the replicas (a few integers, joined into one
            # read at the end of backward)
            added = mine - plain
            assert result["params"] <= added <= result["params"] + 1024, (result["copied"], result["plain"])


def _accumulated_window(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any], sharded: bool) -> int:
    """No-sync micro-batches, then a synced one, then the optimizer step: the bytes copied."""
    counter = CopiedBytes()
    with fc.CollectiveRecorder(scope=counter.inside_collective), counter:
        for index, (inputs, targets) in enumerate(batches):
            if sharded:
                fc.set_requires_gradient_sync(model, index == len(batches) - 1)
            loss_fn(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return counter.bytes


def _accumulating_in_place(rank: int, ws: int, bf16: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = GPT(CFG)
    model, plain = copy.deepcopy(reference), copy.deepcopy(reference)
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    shard_gpt(model, mesh_1d(1), **({"mp_policy": policy} if policy else {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    copied, plain_copied = [], []
    for step in range(3):
        batches = [synthetic_batch(CFG, 2, 10 * step + micro) for micro in range(4)]
        for inputs, targets in batches:
            loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        copied.append(_accumulated_window(model, opt, batches, sharded=True))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            plain_copied.append(_accumulated_window(plain, plain_opt, batches, sharded=False))
    params = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {"diff": max_param_diff(model, reference), "copied": copied, "plain": plain_copied, "params": params}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_rank_accumulates_where_autograd_made_the_gradients(run_dist, bf16: bool) -> None:
    """One rank, three no-sync micro-batches and a synced one per step: each gradient is summed where autograd made
    the first (no accumulation buffer), so fp32 copies exactly what the plain model accumulating the same
    micro-batches copies; bf16 adds, per micro-batch, the parameters' casts (as a step does) and each gradient's
    cast to the fp32 reduce dtype where the plain model's autocast keeps fp32 gradients. Trained like the reference."""
    (result,) = run_dist(1, _accumulating_in_place, bf16)
    assert result["diff"] <= (3e-2 if bf16 else 1e-5), result["diff"]
    if bf16:
        for mine, plain in zip(result["copied"][1:], result["plain"][1:], strict=True):
            assert mine - plain <= 4 * result["params"], (result["copied"], result["plain"], result["params"])
    else:
        assert result["copied"][1:] == result["plain"][1:], (result["copied"], result["plain"])


def _hook_set_inside_a_window(rank: int, ws: int) -> dict[str, Any]:
    """One rank: two no-sync micro-batches held in place, then FSDP2's all-reduce hook (doubling the reduced rows)
    set on the first block, then the synced micro-batch: the held sums move into the buffer the hook reads."""
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh_1d(1), fsdp2_methods=True)
    fc.fully_shard(model, mesh=mesh_1d(1), fsdp2_methods=True)
    batches = [synthetic_batch(CFG, 2, micro) for micro in range(3)]
    for inputs, targets in batches:
        loss_fn(reference(inputs), targets).backward()
    seen: list[int] = []

    def double(rows: torch.Tensor) -> None:
        seen.append(rows.numel())
        rows.mul_(2.0)

    for index, (inputs, targets) in enumerate(batches):
        fc.set_requires_gradient_sync(model, index == len(batches) - 1)
        if index == len(batches) - 1:
            model.blocks[0].set_all_reduce_hook(double)  # type: ignore[operator]
        loss_fn(model(inputs), targets).backward()
    hooked = {f"blocks.0.{name}" for name, _ in model.blocks[0].named_parameters()}
    worst = 0.0
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        expected = ref.grad * (2.0 if name in hooked else 1.0)  # type: ignore[operator]
        worst = max(worst, (param.grad.full_tensor() - expected).abs().max().item())  # type: ignore[union-attr]
    return {"diff": worst, "seen": seen}


def test_a_hook_set_inside_a_window_reads_what_was_held_in_place(run_dist) -> None:
    """One rank: gradients held in place by no-sync micro-batches move into the flat buffer when an all-reduce hook
    (which reads one) is set before the synced micro-batch; every gradient sums all three micro-batches."""
    (result,) = run_dist(1, _hook_set_inside_a_window)
    assert result["seen"] and result["diff"] <= 1e-5, result
