"""State dicts and checkpoints: full (gathered) state dicts, loading one held by the mesh's first rank, loads that must
fail atomically on every rank, DCP resharding N -> M with optimizer state, and two differently composed models in one
process (pytorch/pytorch#113237)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
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
from fsdp_compose.collectives import reduce_scatter_flat
from tests.dist_utils import (
    full_value,
    make_optimizer,
    max_param_diff,
    mesh_1d,
    mesh_nd,
    shard_gpt,
    train_on_dp_mesh,
    train_steps,
)
from tests.test_bad_input import assert_unchanged, gpt_with_buffers, snapshot, trained_pair

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
    third, dp_mesh, _ = _build(kind, ws, seed=2)
    fc.load_full_state_dict(third, everywhere)
    third_diff = max_param_diff(third, reference)
    # the loaded models train on like the reference
    trained_diff = max(
        train_on_dp_mesh(m, copy.deepcopy(reference), GPTConfig(), dp_mesh, steps=2) for m in (other, third)
    )
    return {
        "matches": matches,
        "others_empty": rank == 0 or full == {},
        "plain": plain,
        "loaded_diff": loaded_diff,
        "third_diff": third_diff,
        "trained_diff": trained_diff,
        "still_views": all(fc.get_state(m).params.shards.views_intact() for m in [other, *other.blocks]),
    }


@pytest.mark.parametrize("kind", MESHES)
def test_full_state_dict_round_trip_with_uneven_dims(run_dist, kind: str) -> None:
    for r in run_dist(4, _full_round_trip, kind):
        assert r["matches"] and r["others_empty"] and r["plain"] and r["still_views"]
        assert r["loaded_diff"] == 0.0 and r["third_diff"] == 0.0 and r["trained_diff"] <= 1e-5


# ------------------------------------------------------------------------------------ loads that must fail atomically
LoadCase = Callable[[dict[str, Any], nn.Module, int, int], tuple[Any, bool, type[Exception], str]]
_PREFIX = r"fc.load_full_state_dict into GPT: "


def _where(rank: int) -> str:
    return rf".*\(found on rank {rank}; nothing was loaded on any rank\)$"


def _with(sd: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**sd, key: value}


# case -> (this rank's state dict, broadcast_from_rank0, error type, message pattern), from the good state dict
LOAD_CASES: dict[str, LoadCase] = {
    "meta_value": lambda sd, m, rank, ws: (
        _with(sd, "head.weight", torch.empty(97, 18, device="meta")),
        False,
        ValueError,
        _PREFIX + r"full state dict entry 'head.weight' is on the meta device and holds no values" + _where(0),
    ),
    "meta_value_broadcast": lambda sd, m, rank, ws: (
        _with(sd, "ln_f.running", torch.empty(18, device="meta")) if rank == 0 else {},
        True,
        ValueError,
        _PREFIX + r"full state dict entry 'ln_f.running' is on the meta device" + _where(0),
    ),
    "wrong_shape_on_the_last_rank": lambda sd, m, rank, ws: (
        _with(sd, "blocks.1.mlp.fc.weight", torch.zeros(71, 18)) if rank == ws - 1 else sd,
        False,
        ValueError,
        _PREFIX + r"full state dict entry 'blocks.1.mlp.fc.weight' has shape \(71, 18\), the module's parameter has "
        r"\(72, 18\); load a checkpoint of the same model configuration" + _where(ws - 1),
    ),
    "wrong_shape_broadcast": lambda sd, m, rank, ws: (
        _with(sd, "head.weight", torch.zeros(96, 18)) if rank == 0 else {},
        True,
        ValueError,
        _PREFIX + r"full state dict entry 'head.weight' has shape \(96, 18\), the module's parameter has \(97, 18\)",
    ),
    "missing_key_on_one_rank": lambda sd, m, rank, ws: (
        {k: v for k, v in sd.items() if k != "ln_f.bias"} if rank == 1 else sd,
        False,
        ValueError,
        _PREFIX + r"the full state dict does not match the module: missing keys \['ln_f.bias'\], unexpected keys "
        r"\[\]" + _where(1),
    ),
    "unexpected_key": lambda sd, m, rank, ws: (
        _with(sd, "extra.weight", torch.zeros(2)),
        False,
        ValueError,
        _PREFIX + r".*missing keys \[\], unexpected keys \['extra.weight'\]" + _where(0),
    ),
    "integer_value_for_a_float_parameter": lambda sd, m, rank, ws: (
        _with(sd, "pos_emb", sd["pos_emb"].long()),
        False,
        ValueError,
        _PREFIX + r"full state dict entry 'pos_emb' has dtype torch.int64, the module's parameter has torch.float32; "
        r"only floating-point to floating-point \(or complex to complex\) values are cast" + _where(0),
    ),
    "float_value_for_an_integer_buffer_broadcast": lambda sd, m, rank, ws: (
        _with(sd, "seen", sd["seen"].float()) if rank == 0 else {},
        True,
        ValueError,
        _PREFIX
        + r"full state dict entry 'seen' has dtype torch.float32, the module's buffer has torch.int64"
        + _where(0),
    ),
    "not_a_tensor": lambda sd, m, rank, ws: (
        _with(sd, "ln_f.running", [0.0] * 18),
        False,
        TypeError,
        _PREFIX + r"full state dict entry 'ln_f.running' is a list, not a tensor" + _where(0),
    ),
    "dtensor_value": lambda sd, m, rank, ws: (
        _with(sd, "head.weight", m.state_dict()["head.weight"]),
        False,
        TypeError,
        _PREFIX
        + r"full state dict entry 'head.weight' is a DTensor; a full state dict holds plain tensors"
        + _where(0),
    ),
    "not_a_mapping_on_the_last_rank": lambda sd, m, rank, ws: (
        list(sd.items()) if rank == ws - 1 else sd,
        False,
        TypeError,
        _PREFIX + r"state_dict must be a mapping of names to tensors, got list" + _where(ws - 1),
    ),
    "broadcast_flag_differs_across_ranks": lambda sd, m, rank, ws: (
        sd,
        rank == 0,
        ValueError,
        _PREFIX + r"the ranks of its mesh disagree on the module's state-dict entries \(keys, shapes, dtypes\) or on "
        r"broadcast_from_rank0; every rank must call it on the same model with the same arguments",
    ),
}


def _load_rejected(rank: int, ws: int, case: str) -> str:
    model, opt, reference, ref_opt = trained_pair(ws)
    # different values everywhere, so a partial load would show
    good = {k: v + 1 for k, v in fc.full_state_dict(model, rank0_only=False).items()}
    state_dict, broadcast, kind, pattern = LOAD_CASES[case](good, model, rank, ws)
    before = snapshot(model, opt)
    with pytest.raises(kind, match=pattern) as info:
        fc.load_full_state_dict(model, state_dict, broadcast_from_rank0=broadcast)
    assert_unchanged(before, snapshot(model, opt))
    assert train_steps(model, opt, reference, ref_opt, mesh_1d(ws), range(1, 3)) <= 1e-5
    return str(info.value)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_a_bad_full_state_dict_fails_on_every_rank_and_changes_nothing(run_dist, ws: int, case: str) -> None:
    assert len(set(run_dist(ws, _load_rejected, case))) == 1


# ------------------------------------------------------------------------------------------------ loads that work
def _buffers_equal(model: nn.Module, reference: nn.Module) -> bool:
    ref = dict(reference.named_buffers())
    return all(torch.equal(b, ref[n]) and b.dtype == ref[n].dtype for n, b in model.named_buffers())


def _load_wider_float_dtype(rank: int, ws: int, broadcast: bool) -> float:
    """A float64 checkpoint (integer buffer unchanged) loads into the float32 model, cast: adversarial repro 06."""
    model, _, reference, _ = trained_pair(ws)
    full = fc.full_state_dict(model, rank0_only=broadcast)
    wide = {k: v.double() if v.is_floating_point() else v for k, v in full.items()}
    fresh = gpt_with_buffers(seed=5)
    shard_gpt(fresh, mesh_1d(ws))
    fc.load_full_state_dict(fresh, wide, broadcast_from_rank0=broadcast)  # off the first rank, wide is {}
    assert max_param_diff(fresh, model) == 0.0 and _buffers_equal(fresh, model)  # exactly the sharded model's values
    assert all(p.dtype == torch.float32 for p in fresh.parameters())
    opt, ref_opt = make_optimizer("sgd")(fresh.parameters()), make_optimizer("sgd")(reference.parameters())
    return train_steps(fresh, opt, reference, ref_opt, mesh_1d(ws), range(1, 3))


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("broadcast", [False, True])
def test_a_float64_checkpoint_loads_into_a_float32_model(run_dist, ws: int, broadcast: bool) -> None:
    assert max(run_dist(ws, _load_wider_float_dtype, broadcast)) <= 1e-5


def _pipeline_stages(rank: int, ws: int) -> float:
    """Two stages, each a model sharded over its half of the ranks: full state dicts stay on, and broadcast from,
    each stage's first rank (not global rank 0), over the stage's own mesh."""
    per_stage = ws // 2
    dp_mesh = mesh_nd((2, per_stage), ("pp", "dp"))["dp"]
    stage, first = rank // per_stage, (rank // per_stage) * per_stage
    model = gpt_with_buffers(seed=stage)
    reference = copy.deepcopy(model)
    shard_gpt(model, dp_mesh)
    full = fc.full_state_dict(model)
    expected = reference.state_dict()
    if rank == first:
        assert full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in full)
    else:
        assert full == {}
    # every flag combination: kept on the stage's first rank only, or on every rank of the stage
    for cpu_offload, rank0_only in itertools.product((True, False), repeat=2):
        got = fc.full_state_dict(model, cpu_offload=cpu_offload, rank0_only=rank0_only)
        if rank0_only and rank != first:
            assert got == {}, (cpu_offload, rank0_only)
        else:
            assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    fresh = gpt_with_buffers(seed=10 + stage)
    shard_gpt(fresh, dp_mesh)
    fc.load_full_state_dict(fresh, full, broadcast_from_rank0=True)
    assert max_param_diff(fresh, reference) == 0.0 and _buffers_equal(fresh, reference)
    opt, ref_opt = make_optimizer("sgd")(fresh.parameters()), make_optimizer("sgd")(reference.parameters())
    return train_steps(fresh, opt, reference, ref_opt, dp_mesh, range(2))


@pytest.mark.parametrize("ws", [2, 4])
def test_full_state_dicts_use_the_module_mesh_first_rank(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _pipeline_stages)) <= 1e-5


def _wrapped_block(rank: int, ws: int) -> float:
    """A block wrapped by torch.compile keeps its "_orig_mod." keys, the module's own, with every flag (torch's
    get_model_state_dict would drop them), and the full state dict loads back into a model wrapped the same way."""

    def build(seed: int) -> GPT:
        model = shard_gpt(gpt_with_buffers(seed=seed), mesh_1d(ws))
        model.blocks[0] = torch.compile(model.blocks[0])
        return model

    model, reference = build(0), gpt_with_buffers(seed=0)
    expected = {k.replace("blocks.0.", "blocks.0._orig_mod."): v for k, v in reference.state_dict().items()}
    assert list(model.state_dict()) == list(expected)
    for cpu_offload, rank0_only in itertools.product((True, False), repeat=2):
        full = fc.full_state_dict(model, cpu_offload=cpu_offload, rank0_only=rank0_only)
        if rank0_only and rank != 0:
            assert full == {}
        else:
            assert list(full) == list(expected) and all(torch.equal(full[k], expected[k]) for k in full)
    fresh = build(1)
    fc.load_full_state_dict(fresh, full if rank == 0 else {}, broadcast_from_rank0=True)
    assert _buffers_equal(fresh, model)
    return max_param_diff(fresh, model)


@pytest.mark.parametrize("ws", [2, 4])
def test_full_state_dicts_keep_the_keys_of_wrapped_submodules(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _wrapped_block)) == 0.0


def _meta_module(rank: int, ws: int) -> str:
    """Loading into a module still on 'meta' raises everywhere; after to_empty the same load works and trains."""
    reference = gpt_with_buffers()
    full = reference.state_dict()
    with torch.device("meta"):
        model = gpt_with_buffers()
    shard_gpt(model, mesh_1d(ws))
    with pytest.raises(
        ValueError,
        match=_PREFIX + r"the module's 'pos_emb' is on the meta device; materialize the module before "
        r"loading values into it: module.to_empty\(device=...\)" + _where(0),
    ) as info:
        fc.load_full_state_dict(model, full if rank == 0 else {}, broadcast_from_rank0=True)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model.to_empty(device="cpu")
    fc.load_full_state_dict(model, full if rank == 0 else {}, broadcast_from_rank0=True)
    assert max_param_diff(model, reference) == 0.0 and _buffers_equal(model, reference)
    opt, ref_opt = make_optimizer("sgd")(model.parameters()), make_optimizer("sgd")(reference.parameters())
    assert train_steps(model, opt, reference, ref_opt, mesh_1d(ws), range(2)) <= 1e-5
    return str(info.value)


@pytest.mark.parametrize("ws", [2, 4])
def test_loading_into_a_meta_module_fails_everywhere_until_materialized(run_dist, ws: int) -> None:
    assert len(set(run_dist(ws, _meta_module))) == 1


def _unsharded_and_bad_flags(rank: int, ws: int) -> None:
    plain = gpt_with_buffers()
    before = snapshot(plain)
    for call in (
        lambda: fc.full_state_dict(plain),
        lambda: fc.load_full_state_dict(plain, plain.state_dict()),
    ):
        with pytest.raises(ValueError, match=r"no entry of this GPT's state_dict is sharded.*call fc.fully_shard"):
            call()
    assert_unchanged(before, snapshot(plain))
    model, opt, reference, ref_opt = trained_pair(ws)
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match=r"fc.full_state_dict: rank0_only must be True or False, got 'yes'"):
        fc.full_state_dict(model, rank0_only="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fc.load_full_state_dict: broadcast_from_rank0 must be True or False"):
        fc.load_full_state_dict(model, {}, broadcast_from_rank0=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fc.load_full_state_dict takes the sharded nn.Module first, got dict"):
        fc.load_full_state_dict({}, model)  # type: ignore[arg-type]
    assert_unchanged(before, snapshot(model, opt))
    assert train_steps(model, opt, reference, ref_opt, mesh_1d(ws), range(1, 3)) <= 1e-5


@pytest.mark.parametrize("ws", [2, 4])
def test_state_dict_functions_reject_unsharded_modules_and_bad_arguments(run_dist, ws: int) -> None:
    run_dist(ws, _unsharded_and_bad_flags)


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
        reduce_scatter_flat(output, buffer, group, async_op=False)  # torch's current name, no FutureWarning


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
        "hook_only_on_1d": all(
            fc.get_state(m).params.extensions.reduce_scatter is None for m in [two_d, *two_d.blocks]
        ),
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
