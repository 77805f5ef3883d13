"""Step semantics around user code: checkpoint around a unit, hooks on sharded parameters, updates between steps,
explicit unshard, trainability changes after forwards without backward. Every case compares with a single-process
reference trained on the same global batch. (Regressions for findings on 7b5ccd8: review-repros r3, r4, r6, r7 and
trainability_change_after_grad_forward_lost.py; each test here fails there.)"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.sharding import FlatLayout
from tests.dist_utils import full_value, local_batch, max_param_diff, mesh_1d, reference_and_copy, shard_gpt

FP32_TOL = 1e-5
BF16_TOL = 3e-2  # bf16 compute against an fp32 reference, 3 SGD steps


def _regression_batch(step: int, ws: int, dim_in: int, dim_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(2 * ws, dim_in, generator=gen), torch.randn(2 * ws, dim_out, generator=gen)


# ---------------------------------------------------------------------- 1. checkpoint around a bf16 unit
class _CheckpointedNet(nn.Module):
    """fp32 root; ``block`` becomes a bf16 unit; ``checkpointed`` wraps the whole unit in checkpoint."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.inp = nn.Linear(6, 10)
        self.block = nn.Sequential(nn.Linear(10, 14), nn.GELU(), nn.Linear(14, 10))
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        inner = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        return self.out(h + inner)


def _checkpoint_around_bf16_unit(rank: int, ws: int) -> tuple[float, float]:
    torch.manual_seed(0)
    reference = _CheckpointedNet(checkpointed=False)
    models = []
    for checkpointed in (False, True):
        model = copy.deepcopy(reference)
        model.checkpointed = checkpointed
        policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        fc.fully_shard(model.block, mesh=mesh_1d(ws), mp_policy=policy)
        fc.fully_shard(model, mesh=mesh_1d(ws))
        models.append(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, *models)]
    for step in range(3):
        x, y = _regression_batch(step, ws, 6, 3)
        for opt in optimizers:
            opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        for model in models:
            F.mse_loss(model(local_batch(x, rank, ws)), local_batch(y, rank, ws)).backward()
        for opt in optimizers:
            opt.step()
    plain, checkpointed = models
    return max_param_diff(checkpointed, plain), max_param_diff(checkpointed, reference)


@pytest.mark.parametrize("ws", [2, 4])
def test_checkpoint_around_a_bf16_unit_in_an_fp32_model(run_dist, ws: int) -> None:
    for vs_plain, vs_reference in run_dist(ws, _checkpoint_around_bf16_unit):
        assert vs_plain == 0.0  # the recompute runs in bf16 exactly like the first forward
        assert vs_reference <= BF16_TOL


# ---------------------------------------------------------------------- 2. hooks on sharded parameters
def _optimizer_in_post_accumulate_hooks(rank: int, ws: int) -> dict[str, Any]:
    """The torchtune / PyTorch-tutorial recipe: one optimizer per parameter, stepped in its post-accumulate hook."""
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    params = dict(model.named_parameters())
    names = {id(p): name for name, p in params.items()}
    optimizers = {name: torch.optim.SGD([p], lr=0.1, momentum=0.9) for name, p in params.items()}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    fired: Counter[str] = Counter()
    seen: dict[str, torch.Tensor] = {}

    def step_in_hook(param: torch.Tensor) -> None:
        name = names[id(param)]
        fired[name] += 1
        assert isinstance(param.grad, DTensor)
        seen[name] = param.grad.to_local().clone()  # what the hook sees must be the final reduced gradient
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    for p in params.values():
        p.register_post_accumulate_grad_hook(step_in_hook)
    fired_in_no_sync, counts, grad_diffs, grads_left = [], [], [], []
    for step in range(3):
        micro_batches = 2 if step == 1 else 1
        inputs, targets = synthetic_batch(cfg, 8, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
        ref_opt.step()
        fired.clear()
        seen.clear()
        local_in, local_tg = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
        micro = zip(local_in.chunk(micro_batches), local_tg.chunk(micro_batches), strict=True)
        for index, (mi, mt) in enumerate(micro):
            if index < micro_batches - 1:
                with fc.no_sync(model):
                    (loss_fn(model(mi), mt) / micro_batches).backward()
                fired_in_no_sync.append(sum(fired.values()))
            else:
                (loss_fn(model(mi), mt) / micro_batches).backward()
        counts.append(dict(fired))
        grads_left.append(sum(p.grad is not None for p in params.values()))
        worst = 0.0
        for name in sorted(seen):  # same order on every rank: full_tensor is a collective
            p = params[name]
            grad = DTensor.from_local(seen[name], p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            worst = max(worst, (grad.full_tensor() - ref_grads[name]).abs().max().item())
        grad_diffs.append(worst)
    return {
        "names": sorted(params),
        "counts": counts,
        "fired_in_no_sync": fired_in_no_sync,
        "grad_diffs": grad_diffs,
        "grads_left": grads_left,
        "diff": max_param_diff(model, reference),
    }


@pytest.mark.parametrize("ws", [2, 4])
def test_optimizer_stepped_in_post_accumulate_grad_hooks_of_sharded_params(run_dist, ws: int) -> None:
    for r in run_dist(ws, _optimizer_in_post_accumulate_hooks):
        assert r["fired_in_no_sync"] == [0]  # a no-sync micro-batch reduces nothing: no hook fires
        assert r["counts"] == [dict.fromkeys(r["names"], 1)] * 3  # once per parameter per synchronising backward
        assert max(r["grad_diffs"]) <= FP32_TOL  # the hook sees the reduced gradient of the whole global batch
        assert r["grads_left"] == [0, 0, 0]
        assert r["diff"] <= FP32_TOL


# ---------------------------------------------------------------------- 3. updates between steps
def _outputs_after_updates(rank: int, ws: int) -> tuple[list[float], float]:
    """reshard_after_backward=False, no-sync micro-batches, then updates that bypass the version counter."""
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    fc.set_reshard_after_backward(model, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    updates: list[Callable[[torch.Tensor], Any]] = [
        lambda p: p.data.mul_(0.5),
        lambda p: p.copy_(p * 0.9 + 0.01),
        lambda p: p.data.copy_(p.data - 0.02),
    ]
    out_diffs = []
    for step in range(4):
        inputs, targets = synthetic_batch(cfg, 8, step)
        local_in, local_tg = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
        with torch.no_grad():
            expected = reference(local_in.chunk(2)[0])
        with fc.no_sync(model):
            out = model(local_in.chunk(2)[0])
            out_diffs.append((out - expected).abs().max().item())  # the forward sees the last update
            (loss_fn(out, local_tg.chunk(2)[0]) / 2).backward()
        (loss_fn(model(local_in.chunk(2)[1]), local_tg.chunk(2)[1]) / 2).backward()
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        if step < len(updates):
            with torch.no_grad():
                for p in (*model.parameters(), *reference.parameters()):
                    updates[step](p)
    return out_diffs, max_param_diff(model, reference)


@pytest.mark.parametrize("ws", [2, 4])
def test_updates_through_data_or_no_grad_copy_are_seen_with_reshard_after_backward_false(run_dist, ws: int) -> None:
    for out_diffs, diff in run_dist(ws, _outputs_after_updates):
        assert max(out_diffs) <= FP32_TOL, out_diffs
        assert diff <= FP32_TOL


# ---------------------------------------------------------------------- 4. explicit asynchronous unshard
def _explicit_async_unshard(rank: int, ws: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 1))
    model = copy.deepcopy(reference)
    blocks = {"block0": model[0], "block1": model[2]}
    for block in blocks.values():
        fc.fully_shard(block, mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws))
    # Tell the units apart by their all-gather sizes (the layout is the pure torch.chunk math of sharding.py).
    unit_params = {"block0": blocks["block0"], "block1": blocks["block1"], "root": model[4]}
    sizes = {
        ws * FlatLayout.build([p.shape for p in m.parameters()], ws).segment_numel: name
        for name, m in unit_params.items()
    }
    assert len(sizes) == 3
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    per_step: list[list[tuple[str, str]]] = []
    handles: list[str] = []
    for step in range(4):
        x, y = _regression_batch(step, ws, 8, 1)
        with fc.CollectiveRecorder() as recorder:
            with recorder.labelled("unshard"):
                if step == 2:
                    handle = fc.unshard(blocks["block0"], async_op=True)  # consumed by this step's forward
                    handles.append(type(handle).__name__)
                if step == 3:
                    handle = fc.unshard(blocks["block1"], async_op=True)
                    handles.append(type(handle).__name__)
                    handle.wait()  # type: ignore[union-attr]
            with recorder.labelled("forward"):
                loss = F.mse_loss(model(local_batch(x, rank, ws)), local_batch(y, rank, ws))
            with recorder.labelled("backward"):
                loss.backward()
            with recorder.labelled("optimizer"):
                opt.step()
                opt.zero_grad()
        gathers = [r for r in recorder.records if r.kind == "all_gather" and not r.functional]
        per_step.append([(r.label, sizes.get(r.numel, "?")) for r in gathers])
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    return {
        "per_step": per_step,
        "handles": handles,
        "exported": getattr(fc, "UnshardHandle", None).__name__ if hasattr(fc, "UnshardHandle") else None,
        "diff": max_param_diff(model, reference),
    }


@pytest.mark.parametrize("ws", [2, 4])
def test_explicit_async_unshard_is_consumed_by_the_next_forward(run_dist, ws: int) -> None:
    for r in run_dist(ws, _explicit_async_unshard):
        plain, with_async, with_wait = r["per_step"][1:]
        assert Counter(u for _, u in plain) == {"block0": 2, "block1": 2, "root": 1}
        for gathers, block in ((with_async, "block0"), (with_wait, "block1")):
            assert Counter(u for _, u in gathers) == Counter(u for _, u in plain)  # nothing gathered twice
            assert gathers.count(("unshard", block)) == 1
            assert ("forward", block) not in gathers  # the forward used the explicit gather
        assert r["exported"] == "UnshardHandle" and r["handles"] == ["UnshardHandle"] * 2
        assert r["diff"] <= FP32_TOL


# ---------------------------------------------------------------------- 5. trainability changes
def _set_trainable(models: tuple[GPT, GPT], modules: list[str], trainable: bool) -> None:
    for model in models:
        for name in modules:
            model.get_submodule(name).requires_grad_(trainable)


def _trainability_after_extra_forwards(rank: int, ws: int, how: str) -> list[dict[str, Any]]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    pair = (model, reference)
    _set_trainable(pair, ["blocks.0"], False)  # frozen from the start
    if how == "fully_shard":
        shard_gpt(model, mesh_1d(ws), reshard_after_forward=False)
    else:
        shard_gpt(model, mesh_1d(ws))
        fc.set_reshard_after_forward(model, False)
        fc.set_reshard_after_backward(model, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    log = []
    for step in range(6):
        inputs, targets = synthetic_batch(cfg, 4, step)
        local_in, local_tg = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
        extra_diff = 0.0
        if step in (1, 2, 3):  # an evaluation forward without backward: grad-enabled at steps 1-2, no_grad at 3
            with torch.set_grad_enabled(step != 3):
                extra_diff = (model(local_in) - reference(local_in)).abs().max().item()
        if step == 1:  # (a) unfreeze after a grad-enabled forward
            _set_trainable(pair, ["blocks.0"], True)
        if step == 2:  # (b) freeze after a grad-enabled forward (a block and part of the root unit)
            _set_trainable(pair, ["blocks.1", "ln_f"], False)
        if step == 3:  # unfreeze after a no-grad forward
            _set_trainable(pair, ["blocks.1", "ln_f"], True)
        if step in (4, 5):  # (c) plain changes between steps, no extra forward
            _set_trainable(pair, ["blocks.0", "head"], step == 5)
        loss_fn(model(local_in), local_tg).backward()
        loss_fn(reference(inputs), targets).backward()
        ref_params = dict(reference.named_parameters())
        grad_mismatch, grad_diff = [], 0.0
        for name, p in model.named_parameters():
            ref = ref_params[name]
            if (p.grad is None) != (ref.grad is None) or p.requires_grad != ref.requires_grad:
                grad_mismatch.append(name)
            elif p.grad is not None and ref.grad is not None:
                grad_diff = max(grad_diff, (full_value(p.grad) - ref.grad).abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        log.append(
            {
                "trainable": sum(p.requires_grad for p in reference.parameters()),
                "grad_mismatch": grad_mismatch,
                "grad_diff": grad_diff,
                "extra_forward_diff": extra_diff,
                "param_diff": max_param_diff(model, reference),
            }
        )
    return log


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("how", ["fully_shard", "set_reshard_after_forward"])
def test_trainability_changes_after_forwards_without_backward_keep_parity(run_dist, ws: int, how: str) -> None:
    for log in run_dist(ws, _trainability_after_extra_forwards, how):
        assert len({entry["trainable"] for entry in log}) > 2  # the schedule does change what trains
        for step, entry in enumerate(log):
            assert entry["grad_mismatch"] == [], (step, entry)  # every trainable parameter got its gradient
            assert entry["grad_diff"] <= FP32_TOL, (step, entry)
            assert entry["extra_forward_diff"] <= FP32_TOL, (step, entry)
            assert entry["param_diff"] <= FP32_TOL, (step, entry)
