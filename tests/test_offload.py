"""CPU offload: shards and sharded gradients live on the offload device, the all-gather runs on device copies.

On a CPU-only build both devices are the CPU, so the tests check the mechanism through the transfer helpers of
``fsdp_compose.offload.UnitDevices`` (what the all-gather received, what the gradients were copied from) as well as
training parity against a single-process reference on the same global batch.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.offload import UnitDevices
from fsdp_compose.unit import UnitParams
from tests.dist_utils import (
    full_value,
    local_batch,
    make_optimizer,
    max_param_diff,
    mesh_1d,
    mesh_nd,
    reference_and_copy,
    shard_gpt,
    tp_mlps,
    train_on_dp_mesh,
    train_pair,
)

SGD_TOL = 1e-5
ADAMW_TOL = 2e-3  # see test_parity.ADAMW_TOL
BF16_TOL = 2e-3  # see test_precision: 3 SGD steps in bf16 against the fp32 reference
OFFLOAD = fc.CPUOffloadPolicy()


def _all_units(model: nn.Module) -> list[UnitParams]:
    seen: dict[int, UnitParams] = {}
    for module in model.modules():
        state = fc.get_state(module)
        if state is not None:
            seen[id(state.params)] = state.params
    return list(seen.values())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _check_placement(model: nn.Module) -> None:
    """Every sharded parameter (and its gradient) of an offloaded unit lives on the unit's shard device."""
    for unit in _all_units(model):
        assert unit.shards.flat.device == unit.shard_device
        for mp in unit.shards.params:
            local = mp.sharded._local_tensor
            assert local.device == unit.shard_device, mp.fqn
            if mp.slot is not None:
                assert _storage(local) == _storage(unit.shards.flat), mp.fqn  # still a view into the flat buffer
            grad = mp.sharded.grad
            if grad is not None:
                assert isinstance(grad, DTensor) and grad._local_tensor.device == unit.shard_device, mp.fqn


@contextlib.contextmanager
def _recording() -> Iterator[dict[str, list[Any]]]:
    """Record every host -> device copy, every all-gather input and every device -> host copy of gradients."""
    record: dict[str, list[Any]] = {"to_compute": [], "all_gather": [], "to_shard": []}
    to_compute, to_shard = UnitDevices.to_compute, UnitDevices.to_shard

    def recording_to_compute(self: UnitDevices, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = to_compute(self, flat, dtype)
        record["to_compute"].append((self, flat, out))
        return out

    def recording_to_shard(self: UnitDevices, reduced: torch.Tensor) -> torch.Tensor:
        out = to_shard(self, reduced)
        record["to_shard"].append((self, reduced, out))
        return out

    def recording_all_gather(call: fc.CollectiveRecord, inputs: tuple[torch.Tensor, ...], _: Any) -> None:
        if call.kind == "all_gather" and not call.functional:
            record["all_gather"].append(inputs[0])

    UnitDevices.to_compute = recording_to_compute  # type: ignore[method-assign]
    UnitDevices.to_shard = recording_to_shard  # type: ignore[method-assign]
    try:
        with fc.CollectiveRecorder(observer=recording_all_gather):
            yield record
    finally:
        UnitDevices.to_compute = to_compute  # type: ignore[method-assign]
        UnitDevices.to_shard = to_shard  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------------- parity
def _train(rank: int, ws: int, optimizer: str, shard_kwargs: dict[str, Any], micro_batches: int) -> float:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), offload_policy=OFFLOAD, **shard_kwargs)
    assert all(unit.devices.offloaded for unit in _all_units(model))
    diff = train_pair(
        rank, ws, model, reference, cfg, steps=3, optimizer=optimizer, micro_batches=micro_batches, batch_size=8
    )
    _check_placement(model)
    return diff


@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_sgd_momentum_parity(run_dist, ws: int, reshard_after_forward: bool) -> None:
    assert max(run_dist(ws, _train, "sgd", {"reshard_after_forward": reshard_after_forward}, 1)) <= SGD_TOL


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_adamw_parity(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _train, "adamw", {}, 1)) <= ADAMW_TOL


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_bf16_mixed_precision_parity(run_dist, ws: int, reduce_dtype: torch.dtype | None) -> None:
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    assert max(run_dist(ws, _train, "sgd", {"mp_policy": policy}, 1)) <= BF16_TOL


def _accumulate(rank: int, ws: int, mode: str) -> float:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), offload_policy=OFFLOAD)
    fc.set_gradient_accumulation(model, mode)  # type: ignore[arg-type]
    diff = train_pair(rank, ws, model, reference, cfg, steps=3, micro_batches=2, batch_size=8)
    _check_placement(model)
    return diff


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("mode", ["unsharded", "sharded"])
def test_no_sync_accumulation_parity(run_dist, ws: int, mode: str) -> None:
    assert max(run_dist(ws, _accumulate, mode)) <= SGD_TOL


# ------------------------------------------------------------------------------------------------ structure
class _Tempered(nn.Module):
    """The GPT with a learnable 0-dim temperature: a parameter kept whole (never all-gathered) in the root."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(cfg)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx) * self.temperature


def _offloaded_tempered(cfg: GPTConfig, ws: int) -> tuple[_Tempered, _Tempered]:
    """The reference and an offloaded copy sharded block by block, then at the root (which owns the 0-dim scale)."""
    torch.manual_seed(0)
    reference = _Tempered(cfg)
    model = copy.deepcopy(reference)
    for block in model.gpt.blocks:
        fc.fully_shard(block, mesh=mesh_1d(ws), offload_policy=OFFLOAD)
    fc.fully_shard(model, mesh=mesh_1d(ws), offload_policy=OFFLOAD)
    return reference, model


def _transfers(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig()
    _, model = _offloaded_tempered(cfg, ws)
    units = _all_units(model)
    root = fc.get_state(model).params
    whole = next(mp for mp in root.shards.params if mp.fqn == "temperature")
    opt = make_optimizer("sgd")(model.parameters())
    inputs, targets = synthetic_batch(cfg, 4, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    with _recording() as record:
        out = model(x)
        # the root keeps its parameters until backward: the kept-whole one is a compute-device copy, not its shard
        whole_full = model.temperature
        whole_separate = _storage(whole_full) != _storage(whole.sharded._local_tensor)
        whole_on_compute = whole_full.device == root.device
        loss_fn(out, y).backward()
    flats = {_storage(u.shards.flat) for u in units}
    copies = record["to_compute"]
    gathered_inputs_are_copies = all(
        isinstance(d, UnitDevices) and _storage(out) not in flats and out.device == d.compute for d, _, out in copies
    )
    copied_from_flat = {_storage(flat) for _, flat, _ in copies} == flats  # every unit's flat, nothing else
    copy_ids = {id(out) for _, _, out in copies}
    collective_got_copies = all(id(shard) in copy_ids for shard in record["all_gather"])
    host_grads = {_storage(out) for _, _, out in record["to_shard"]}
    grads_from_host_copies = all(
        _storage(p.grad._local_tensor) in host_grads for p in model.parameters() if p.grad is not None
    )
    rs_outputs_left_on_device = all(_storage(out) != _storage(red) for _, red, out in record["to_shard"])
    _check_placement(model)
    opt.step()
    _check_placement(model)  # the optimizer stepped the host shards in place
    return {
        "whole_separate": whole_separate,
        "whole_on_compute": whole_on_compute,
        "n_units": len(units),
        "n_copies": len(copies),
        "n_gathers": len(record["all_gather"]),
        "n_to_shard": len(record["to_shard"]),
        "gathered_inputs_are_copies": gathered_inputs_are_copies,
        "copied_from_flat": copied_from_flat,
        "collective_got_copies": collective_got_copies,
        "grads_from_host_copies": grads_from_host_copies,
        "rs_outputs_left_on_device": rs_outputs_left_on_device,
        "pinned": any(u.devices.pin_memory or u.shards.flat.is_pinned() for u in units),
    }


@pytest.mark.parametrize("ws", [1, 2])
def test_all_gather_reads_device_copies_and_gradients_land_on_the_host(run_dist, ws: int) -> None:
    for r in run_dist(ws, _transfers):
        assert r["whole_separate"] and r["whole_on_compute"]
        # blocks gathered for forward and again for backward; the root once (it keeps its parameters)
        assert r["n_copies"] == 2 * (r["n_units"] - 1) + 1
        assert r["gathered_inputs_are_copies"] and r["copied_from_flat"]
        assert r["n_gathers"] == (r["n_copies"] if ws > 1 else 0)
        assert r["collective_got_copies"]
        assert r["n_to_shard"] == r["n_units"]  # one host copy per unit per synced backward
        assert r["grads_from_host_copies"] and r["rs_outputs_left_on_device"]
        assert not r["pinned"]  # pinning needs an accelerator: a CPU-only build keeps ordinary memory, no error


def _tempered_parity(rank: int, ws: int) -> float:
    cfg = GPTConfig()
    reference, model = _offloaded_tempered(cfg, ws)
    diff = train_pair(rank, ws, model, reference, cfg, steps=3)
    _check_placement(model)
    return diff


@pytest.mark.parametrize("ws", [2, 4])
def test_kept_whole_parameter_trains(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _tempered_parity)) <= SGD_TOL


def _mixed(rank: int, ws: int) -> dict[str, Any]:
    """Offloaded blocks, a root that is not: each unit follows its own policy."""
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh_1d(ws), offload_policy=OFFLOAD)
    fc.fully_shard(model, mesh=mesh_1d(ws))
    root = fc.get_state(model).params
    blocks = [fc.get_state(b).params for b in model.blocks]
    with _recording() as record:
        inputs, targets = synthetic_batch(cfg, 4, 0)
        loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    # not offloaded: no copy of the flat buffer, and (where there is an all-gather) its input is the buffer itself
    root_copied = any(flat is root.shards.flat and out is not flat for _, flat, out in record["to_compute"])
    flat_ptr = root.shards.flat.data_ptr()
    root_gathers_its_flat = not root_copied and (ws == 1 or any(t.data_ptr() == flat_ptr for t in record["all_gather"]))
    blocks_copied = all(
        any(flat is b.shards.flat and out is not flat for _, flat, out in record["to_compute"]) for b in blocks
    )
    model.zero_grad()
    return {
        "root_offloaded": root.devices.offloaded,
        "blocks_offloaded": [b.devices.offloaded for b in blocks],
        "root_gathers_its_flat": root_gathers_its_flat,
        "blocks_copied": blocks_copied,
        "diff": train_pair(rank, ws, model, reference, cfg, steps=3, optimizer="sgd"),
    }


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_offloaded_blocks_with_a_root_on_device(run_dist, ws: int) -> None:
    for r in run_dist(ws, _mixed):
        assert not r["root_offloaded"] and all(r["blocks_offloaded"])
        assert r["root_gathers_its_flat"]  # no offload: the all-gather reads the flat buffer itself ...
        assert r["blocks_copied"]  # ... offloaded: a compute-device copy of it
        assert r["diff"] <= SGD_TOL


# ------------------------------------------------------------------------------------------------ composition
def _composed(rank: int, ws: int, kind: str) -> float:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    if kind == "hsdp":
        dp_mesh = mesh_nd((2, ws // 2), ("replicate", "shard"))
    else:
        mesh = mesh_nd((2, ws // 2), ("dp", "tp"))
        tp_mlps(model, mesh["tp"])
        dp_mesh = mesh["dp"]
    for block in model.blocks:
        fc.fully_shard(block, mesh=dp_mesh, offload_policy=OFFLOAD)
    fc.fully_shard(model, mesh=dp_mesh, offload_policy=OFFLOAD)
    diff = train_on_dp_mesh(model, reference, cfg, dp_mesh)
    _check_placement(model)
    return diff


@pytest.mark.parametrize("kind", ["hsdp", "tp"])
def test_hsdp_and_tensor_parallel(run_dist, kind: str) -> None:
    assert max(run_dist(4, _composed, kind)) <= SGD_TOL


def _in_backward(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), offload_policy=OFFLOAD)
    fc.set_optimizer_in_backward(model, make_optimizer("adamw"))
    ref_opt = make_optimizer("adamw")(reference.parameters())
    grads_left = []
    for step in range(3):
        inputs, targets = synthetic_batch(cfg, 4, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
        grads_left.append(any(p.grad is not None for p in model.parameters()))
    _check_placement(model)
    return {"diff": max_param_diff(model, reference), "grads_left": any(grads_left)}


@pytest.mark.parametrize("ws", [2])
def test_optimizer_in_backward(run_dist, ws: int) -> None:
    for r in run_dist(ws, _in_backward):
        assert r["diff"] <= ADAMW_TOL and not r["grads_left"]


def _frozen(rank: int, ws: int, frozen_params: str) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    for m in (reference, model):
        m.blocks[0].requires_grad_(False)
    shard_gpt(model, mesh_1d(ws), offload_policy=OFFLOAD, frozen_params=frozen_params)
    frozen_unit = fc.get_state(model.blocks[0]).params
    diff = train_pair(rank, ws, model, reference, cfg, steps=2)
    model.blocks[0].requires_grad_(True)  # unfreezing re-lays out a replicated unit (an all-gather on the host)
    reference.blocks[0].requires_grad_(True)
    diff = max(diff, train_pair(rank, ws, model, reference, cfg, steps=2))
    _check_placement(model)
    return {"diff": diff, "kept_whole": [mp.slot is None for mp in frozen_unit.shards.params]}


@pytest.mark.parametrize("frozen_params", ["shard", "replicate"])
def test_frozen_parameters(run_dist, frozen_params: str) -> None:
    for r in run_dist(2, _frozen, frozen_params):
        assert r["diff"] <= SGD_TOL
        assert not any(r["kept_whole"])  # unfrozen at the end: sharded again


def _checkpoints(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), offload_policy=OFFLOAD)
    diff = train_pair(rank, ws, model, reference, cfg, steps=2)
    sharded = model.state_dict()
    locals_on_host = all(
        isinstance(v, DTensor) and v._local_tensor.device == torch.device("cpu")
        for k, v in sharded.items()
        if k in dict(model.named_parameters())
    )
    full = fc.full_state_dict(model, rank0_only=False)
    own = {k: full_value(v) for k, v in model.state_dict().items()}
    full_err = max((full[k] - v).abs().max().item() for k, v in own.items())
    # a fresh offloaded model loads the full state dict (broadcast from rank 0) and the sharded one
    _, fresh = reference_and_copy(cfg, seed=1)
    shard_gpt(fresh, mesh_1d(ws), offload_policy=OFFLOAD)
    fc.load_full_state_dict(fresh, full if rank == 0 else {}, broadcast_from_rank0=True)
    load_err = max_param_diff(fresh, model)
    _, other = reference_and_copy(cfg, seed=2)
    shard_gpt(other, mesh_1d(ws), offload_policy=OFFLOAD)
    other.load_state_dict(sharded)
    load_err = max(load_err, max_param_diff(other, model))
    # a deep copy is offloaded too and trains on like the reference
    twin = copy.deepcopy(model)
    ref_twin = copy.deepcopy(reference)
    copy_diff = train_pair(rank, ws, twin, ref_twin, cfg, steps=2)
    _check_placement(twin)
    # gradient clipping over host gradients
    inputs, targets = synthetic_batch(cfg, 4, 7)
    loss_fn(reference(inputs), targets).backward()
    loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    norm = fc.clip_grad_norm_(model.parameters(), 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    clipped = {n: full_value(p.grad) for n, p in model.named_parameters()}
    clip_err = max((clipped[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    return {
        "diff": max(diff, copy_diff),
        "locals_on_host": locals_on_host,
        "full_err": full_err,
        "load_err": load_err,
        "copy_offloaded": all(u.devices.offloaded for u in _all_units(twin)),
        "norm_err": abs(norm.item() - ref_norm.item()),
        "clip_err": clip_err,
    }


@pytest.mark.parametrize("ws", [2])
def test_state_dicts_deepcopy_and_clipping(run_dist, ws: int) -> None:
    for r in run_dist(ws, _checkpoints):
        assert r["diff"] <= SGD_TOL and r["locals_on_host"] and r["copy_offloaded"]
        assert r["full_err"] == 0.0 and r["load_err"] == 0.0
        assert r["norm_err"] <= 1e-5 and r["clip_err"] <= 1e-6


# ----------------------------------------------------------------------------------------------------- errors
class _TorchStylePolicy:
    """Stands in for torch.distributed.fsdp.CPUOffloadPolicy: a policy object of another library."""


_TorchStylePolicy.__name__ = "CPUOffloadPolicy"


def _bad_offload(rank: int, ws: int) -> list[str]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = [(n, id(p)) for n, p in model.named_parameters()]
    messages = []
    for policy, mesh, exc in [
        (_TorchStylePolicy(), mesh_1d(ws), TypeError),
        ("cpu", mesh_1d(ws), TypeError),
        (fc.CPUOffloadPolicy(pin_memory="yes"), mesh_1d(ws), TypeError),  # type: ignore[arg-type]
        (fc.CPUOffloadPolicy(), DeviceMesh("meta", list(range(ws))), ValueError),
    ]:
        with pytest.raises(exc) as info:
            fc.fully_shard(model, mesh=mesh, offload_policy=policy)  # type: ignore[arg-type]
        messages.append(str(info.value))
        assert [(n, id(p)) for n, p in model.named_parameters()] == before
        assert not fc.is_fully_sharded(model)
    return messages


def test_bad_offload_policies_raise_before_touching_the_model(run_dist) -> None:
    # torch's own CPUOffloadPolicy is accepted (tests/test_fsdp2_compat.py); a look-alike of another module is not,
    # and the message names the modules, since the class names are the same.
    look_alike, not_a_policy, pin, meta = run_dist(1, _bad_offload)[0]
    for message in (look_alike, not_a_policy, pin, meta):
        assert "Sequential" in message  # names the module
    assert "fsdp_compose.OffloadPolicy" in look_alike and "torch.distributed.fsdp.CPUOffloadPolicy" in look_alike
    assert "got tests.test_offload." in look_alike
    assert "pin_memory" in pin and "bool" in pin
    assert "'meta' mesh" in meta
