"""State dicts and checkpoints: full (gathered) state dicts, loading one held by rank 0, DCP resharding N -> M with
optimizer state, and two differently composed models in one process (pytorch/pytorch#113237)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import full_value, make_optimizer, max_param_diff, mesh_1d, mesh_nd, shard_gpt

MESHES = ["1d", "hsdp", "tp"]


def _build(kind: str, ws: int, seed: int = 0) -> tuple[GPT, Any, GPT]:
    """(sharded model, its data-parallel mesh, an unsharded copy of its initial values)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig())  # vocab 97, seq 13, width 18: uneven rows everywhere
    reference = copy.deepcopy(model)
    if kind == "1d":
        dp_mesh = mesh_1d(ws)
    elif kind == "hsdp":
        dp_mesh = mesh_nd((2, ws // 2), ("replicate", "shard"))
    else:
        mesh = mesh_nd((ws // 2, 2), ("dp", "tp"))
        dp_mesh = mesh["dp"]
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    shard_gpt(model, dp_mesh)
    return model, dp_mesh, reference


def _full_round_trip(rank: int, ws: int, kind: str) -> dict[str, Any]:
    model, _, reference = _build(kind, ws, seed=0)
    full = fc.full_state_dict(model)  # rank 0 only, on CPU
    everywhere = fc.full_state_dict(model, rank0_only=False)
    expected = reference.state_dict()
    matches = rank != 0 or (full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in full))
    plain = all(not isinstance(v, DTensor) and v.device.type == "cpu" for v in full.values())
    # a differently initialized sharded model loads what only rank 0 holds
    other, _, _ = _build(kind, ws, seed=1)
    other.load_full_state_dict = None  # (a module attribute of that name must not matter)
    fc.load_full_state_dict(other, full if rank == 0 else {}, broadcast_from_rank0=True)
    loaded_diff = max_param_diff(other, reference)
    # and one every rank holds
    third, _, _ = _build(kind, ws, seed=2)
    fc.load_full_state_dict(third, everywhere)
    return {
        "matches": matches,
        "others_empty": rank == 0 or full == {},
        "plain": plain,
        "loaded_diff": loaded_diff,
        "third_diff": max_param_diff(third, reference),
        "still_views": all(fc.get_state(m).unit.shards.views_intact() for m in [other, *other.blocks]),
    }


@pytest.mark.parametrize("kind", MESHES)
def test_full_state_dict_round_trip_with_uneven_dims(run_dist, kind: str) -> None:
    for r in run_dist(4, _full_round_trip, kind):
        assert r["matches"] and r["others_empty"] and r["plain"] and r["still_views"]
        assert r["loaded_diff"] == 0.0 and r["third_diff"] == 0.0


def _wrong_shape(rank: int, ws: int) -> str:
    model, _, reference = _build("1d", ws)
    bad = {k: v.clone() for k, v in reference.state_dict().items()}
    bad["head.weight"] = torch.zeros(96, 18)
    before = {k: full_value(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"'head.weight' has shape \(96, 18\), the module's parameter has \(97, 18\)"
    ) as e:
        fc.load_full_state_dict(model, bad if rank == 0 else {}, broadcast_from_rank0=True)
    with pytest.raises(ValueError, match=r"missing keys \['ln_f.bias'\]"):
        fc.load_full_state_dict(model, {k: v for k, v in reference.state_dict().items() if k != "ln_f.bias"})
    assert all(torch.equal(full_value(v), before[k]) for k, v in model.state_dict().items())
    return str(e.value)


def test_loading_a_wrong_shape_fails_everywhere_and_changes_nothing(run_dist) -> None:
    assert len(set(run_dist(2, _wrong_shape))) == 1


# ------------------------------------------------------------------------------------------------ DCP N -> M
def _train(model: nn.Module, opt: torch.optim.Optimizer, dp_rank: int, dp_size: int, steps: range) -> None:
    cfg = GPTConfig()
    for step in steps:
        inputs, targets = synthetic_batch(cfg, 8, step)
        opt.zero_grad()
        loss_fn(model(inputs.chunk(dp_size)[dp_rank]), targets.chunk(dp_size)[dp_rank]).backward()
        opt.step()


def _dcp_save(rank: int, ws: int, path: str) -> None:
    model, _, _ = _build("1d", ws)
    opt = make_optimizer("sgd")(model.parameters())
    _train(model, opt, rank, ws, range(2))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _dcp_load_and_continue(rank: int, ws: int, path: str) -> float:
    model, _, reference = _build("1d", ws, seed=7)  # different values: everything must come from the checkpoint
    opt = make_optimizer("sgd")(model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, opt, rank, ws, range(2, 4))
    # the reference trains the 4 steps without a break
    torch.manual_seed(0)
    reference = GPT(GPTConfig())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    _train(reference, ref_opt, 0, 1, range(4))
    return max_param_diff(model, reference)


@pytest.mark.parametrize(("save_ws", "load_ws"), [(4, 2), (2, 4)])
def test_dcp_reshards_and_training_continues_identically(run_dist, tmp_path, save_ws: int, load_ws: int) -> None:
    run_dist(save_ws, _dcp_save, str(tmp_path / "ckpt"))
    assert max(run_dist(load_ws, _dcp_load_and_continue, str(tmp_path / "ckpt"))) <= 1e-5


# ---------------------------------------------------------------------------------- two models, pytorch/pytorch#113237
class _CountingReduceScatter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, output: torch.Tensor, buffer: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.calls += 1
        dist.reduce_scatter_tensor(output, buffer, group=group)


def _two_models(rank: int, ws: int, path: str) -> dict[str, Any]:
    """A 1-D FSDP model with an extension and a 2-D FSDP+TP model without, side by side in one process."""
    torch.manual_seed(0)
    one_d = GPT(GPTConfig())
    one_d_ref = copy.deepcopy(one_d)
    hook = _CountingReduceScatter()
    shard_gpt(one_d, mesh_1d(ws), extensions=fc.ShardExtensions(reduce_scatter=hook))
    two_d, dp_mesh, two_d_ref = _build("tp", ws, seed=3)
    opts = [make_optimizer("sgd")(m.parameters()) for m in (one_d, two_d, one_d_ref, two_d_ref)]
    cfg = GPTConfig()
    dp_rank_2d = dp_mesh.get_local_rank()
    for step in range(2):
        inputs, targets = synthetic_batch(cfg, 8, step)
        for model, opt, dp_rank, dp_size in [
            (one_d, opts[0], rank, ws),
            (two_d, opts[1], dp_rank_2d, ws // 2),
            (one_d_ref, opts[2], 0, 1),
            (two_d_ref, opts[3], 0, 1),
        ]:
            opt.zero_grad()
            loss_fn(model(inputs.chunk(dp_size)[dp_rank]), targets.chunk(dp_size)[dp_rank]).backward()
            opt.step()
    calls_after_training = hook.calls
    # state dicts of both, interleaved: full and DCP
    full_1d, full_2d = fc.full_state_dict(one_d, rank0_only=False), fc.full_state_dict(two_d, rank0_only=False)
    dcp.save({"a": one_d.state_dict(), "b": two_d.state_dict()}, checkpoint_id=path)
    fresh_1d, _, _ = _build("1d", ws, seed=11)
    fresh_2d, _, _ = _build("tp", ws, seed=12)
    state = {"a": fresh_1d.state_dict(), "b": fresh_2d.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh_1d.load_state_dict(state["a"])
    fresh_2d.load_state_dict(state["b"])
    fc.load_full_state_dict(fresh_1d, full_1d)  # the full ones load too (same values)
    return {
        "diff_1d": max_param_diff(one_d, one_d_ref),
        "diff_2d": max_param_diff(two_d, two_d_ref),
        "calls": calls_after_training,
        "units_1d": len(one_d.blocks) + 1,
        "hook_only_on_1d": all(fc.get_state(m).unit.extensions.reduce_scatter is None for m in [two_d, *two_d.blocks]),
        "restored_1d": max_param_diff(fresh_1d, one_d),
        "restored_2d": max_param_diff(fresh_2d, two_d),
        "full_2d_ok": all(torch.equal(full_2d[k], full_value(v)) for k, v in two_d.state_dict().items()),
    }


def test_1d_model_with_extension_and_2d_model_without_do_not_interfere(run_dist, tmp_path) -> None:
    for r in run_dist(4, _two_models, str(tmp_path / "two")):
        assert r["diff_1d"] <= 1e-5 and r["diff_2d"] <= 1e-5
        assert r["calls"] == 2 * r["units_1d"]  # one reduce-scatter per unit per step, only the 1-D model's
        assert r["hook_only_on_1d"]
        assert r["restored_1d"] == 0.0 and r["restored_2d"] == 0.0 and r["full_2d_ok"]
