"""A step that does not finish: an exception in forward or backward, fc.reset_step, zero_grad during accumulation.

Each test trains a sharded GPT and a single-process reference on the same global batches; the step that fails (or
is dropped) is skipped on the reference side, so the models agree only if nothing of that step leaks into the next.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.unit import UnitState
from tests.dist_utils import (
    local_batch,
    make_optimizer,
    max_param_diff,
    mesh_1d,
    mesh_nd,
    reference_and_copy,
    shard_gpt,
)


class _Boom(RuntimeError):
    pass


class _Failer:
    """A user hook that raises while ``armed``: in forward (pre-hook of a block) or in backward (tensor hook)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.armed = False

    def forward_pre(self, module: nn.Module, args: Any) -> None:
        if self.armed and self.where == "forward":
            raise _Boom("forward failed")

    def forward_post(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self.armed and self.where == "backward" and output.requires_grad:
            output.register_hook(self._raise)

    def _raise(self, grad: torch.Tensor) -> None:
        raise _Boom("backward failed")


def _train_with_a_failed_step(
    rank: int, ws: int, where: str, bf16: bool, micro_batches: int, failing: int
) -> dict[str, Any]:
    """Steps 0..3; step ``failing`` raises (on every rank) in its last micro-batch and is skipped by the user."""
    cfg = GPTConfig(n_layers=3)
    reference, model = reference_and_copy(cfg)
    policy = (
        fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else fc.MixedPrecisionPolicy()
    )
    shard_gpt(model, mesh_1d(ws), mp_policy=policy)
    failer = _Failer(where)
    model.blocks[1].register_forward_pre_hook(failer.forward_pre)
    model.blocks[1].register_forward_hook(failer.forward_post)
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    raised, sharded_after_failure = [], []
    for step in range(4):
        inputs, targets = synthetic_batch(cfg, 4 * micro_batches, step)
        if step != failing:
            ref_opt.zero_grad()
            loss_fn(reference(inputs), targets).backward()
            ref_opt.step()
        opt.zero_grad()
        pairs = list(
            zip(
                local_batch(inputs, rank, ws).chunk(micro_batches),
                local_batch(targets, rank, ws).chunk(micro_batches),
                strict=True,
            )
        )
        try:
            for micro, (x, y) in enumerate(pairs):
                last = micro == len(pairs) - 1
                failer.armed = step == failing and last
                if last:
                    (loss_fn(model(x), y) / micro_batches).backward()
                else:
                    with fc.no_sync(model):
                        (loss_fn(model(x), y) / micro_batches).backward()
        except _Boom:
            raised.append(step)
            failer.armed = False
            opt.zero_grad()  # the user skips the batch
            if where == "forward":
                # the block whose forward raised resharded (its post-forward hook ran); the next block, prefetched
                # before the failure, is freed at the next step
                raised_in = fc.get_state(model.blocks[1])
                sharded_after_failure.append(raised_in.params.state is UnitState.SHARDED)
            continue
        opt.step()
    return {"diff": max_param_diff(model, reference), "raised": raised, "sharded": sharded_after_failure}


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("bf16", [False, True])
def test_exception_in_forward_then_training_goes_on(run_dist, ws: int, bf16: bool) -> None:
    for result in run_dist(ws, _train_with_a_failed_step, "forward", bf16, 1, 1):
        assert result["raised"] == [1]
        assert result["sharded"] == [True]  # post-forward hooks ran although forward raised
        assert result["diff"] <= (3e-2 if bf16 else 1e-5)


@pytest.mark.parametrize("ws", [2, 4])
def test_exception_in_backward_leaks_nothing_into_the_next_step(run_dist, ws: int) -> None:
    for result in run_dist(ws, _train_with_a_failed_step, "backward", False, 1, 1):
        assert result["raised"] == [1]
        assert result["diff"] <= 1e-5


@pytest.mark.parametrize("ws", [2])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_in_the_last_micro_batch_drops_the_window(run_dist, ws: int, where: str) -> None:
    for result in run_dist(ws, _train_with_a_failed_step, where, False, 2, 2):
        assert result["raised"] == [2]
        assert result["diff"] <= 1e-5


def _dropped_micro_batch(rank: int, ws: int, how: str) -> float:
    """Each step: one no-sync micro-batch that the user then drops (``how``), then a synced one. The reference
    trains on the synced micro-batch alone; with ``how="keep"`` (the control) on both."""
    cfg = GPTConfig(n_layers=2)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    for step in range(3):
        dropped_in, dropped_tg = synthetic_batch(cfg, 4, 100 + step)
        inputs, targets = synthetic_batch(cfg, 4, step)
        ref_opt.zero_grad()
        if how == "keep":
            (loss_fn(reference(dropped_in), dropped_tg) + loss_fn(reference(inputs), targets)).backward()
        else:
            loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        opt.zero_grad()
        with fc.no_sync(model):
            loss_fn(model(local_batch(dropped_in, rank, ws)), local_batch(dropped_tg, rank, ws)).backward()
        if how == "reset_step":
            fc.reset_step(model)
        elif how == "zero_grad":
            opt.zero_grad()  # set_to_none=True
        elif how == "zero_grad_in_place":
            opt.zero_grad(set_to_none=False)
        elif how == "model_zero_grad":
            model.zero_grad()
        loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
        opt.step()
    return max_param_diff(model, reference)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("how", ["reset_step", "zero_grad", "zero_grad_in_place", "model_zero_grad"])
def test_a_dropped_no_sync_micro_batch_is_not_reduced(run_dist, ws: int, how: str) -> None:
    assert max(run_dist(ws, _dropped_micro_batch, how)) <= 1e-5


@pytest.mark.parametrize("ws", [2])
def test_an_undropped_no_sync_micro_batch_is_reduced(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _dropped_micro_batch, "keep")) <= 1e-5


def _one_rank_fails(rank: int, ws: int, where: str, checks: bool, hsdp: bool) -> dict[str, Any]:
    """The loop docs/errors.md gives: ``except RuntimeError: fc.reset_step(model); continue`` on every rank. At step 1
    the last rank alone raises (``where``: in a block's forward, in its loss, or in its backward after the root's and
    the last block's gradients). Every rank must skip step 1 (the
    reference skips it), the failing rank with its own error, every other one with ``StepAbandoned`` at the end of
    its backward, and go on in step."""
    cfg = GPTConfig(n_layers=3)
    reference, model = reference_and_copy(cfg)
    mesh = mesh_nd((2, ws // 2), ("replicate", "shard")) if hsdp else mesh_1d(ws)
    shard_gpt(model, mesh)
    if checks:
        fc.set_collective_checks(model)
    failer = _Failer(where)
    model.blocks[1].register_forward_pre_hook(failer.forward_pre)
    model.blocks[1].register_forward_hook(failer.forward_post)  # "backward": after the root's and block 2's
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    failing, outcomes = ws - 1, []
    for step in range(3):
        inputs, targets = synthetic_batch(cfg, 4, step)
        if step != 1:
            ref_opt.zero_grad()
            loss_fn(reference(inputs), targets).backward()
            ref_opt.step()
        fails_here = step == 1 and rank == failing
        failer.armed = fails_here and where != "loss"
        try:
            loss = loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws))
            if fails_here and where == "loss":
                raise _Boom("the loss failed")
            loss.backward()
        except RuntimeError as error:
            failer.armed = False
            outcomes.append(type(error).__name__)
            fc.reset_step(model)  # returns on every rank
            opt.zero_grad()
            continue
        outcomes.append("ok")
        opt.step()
        opt.zero_grad()
    return {"diff": max_param_diff(model, reference), "outcomes": outcomes}


@pytest.mark.parametrize("checks", [False, True])
@pytest.mark.parametrize("where", ["forward", "loss", "backward"])
@pytest.mark.parametrize("ws,hsdp", [(2, False), (4, False), (4, True)])
def test_reset_in_an_except_clause_keeps_every_rank_in_step(
    run_dist, ws: int, hsdp: bool, where: str, checks: bool
) -> None:
    results = run_dist(ws, _one_rank_fails, where, checks, hsdp)
    for rank, result in enumerate(results):
        failed = "_Boom" if rank == ws - 1 else "StepAbandoned"
        assert result["outcomes"] == ["ok", failed, "ok"], (rank, result)
        assert result["diff"] <= 1e-5, (rank, result)
