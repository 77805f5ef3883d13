"""Forwards under ``torch.inference_mode()`` (the first one included) and exceptions inside a unit's gather.

A rollout or evaluation under ``inference_mode`` may come at any point, before the first training step too; an
exception raised while a unit gathers, copies out or reshards (an allocation failure, a storage that a reader made
non-resizable) must leave the unit sharded and usable. Each test trains a sharded GPT next to a single-process
reference on the same global batches: the models agree only if nothing of the inference forward or of the failed
step leaks into training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.full_params import FullParams
from fsdp_compose.offload import UnitDevices
from fsdp_compose.unit import UnitState
from tests.dist_utils import local_batch, make_optimizer, max_param_diff, mesh_1d, reference_and_copy, shard_gpt

_CFG = GPTConfig(n_layers=2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    opt.zero_grad()
    loss_fn(model(inputs), targets).backward()
    opt.step()


def _inference_first(rank: int, ws: int, bf16: bool) -> dict[str, Any]:
    reference, model = reference_and_copy(_CFG)
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else fc.MixedPrecisionPolicy()
    shard_gpt(model, mesh_1d(ws), mp_policy=policy)
    opt, ref_opt = make_optimizer("sgd")(model.parameters()), make_optimizer("sgd")(reference.parameters())
    ref_dtype = torch.bfloat16 if bf16 else torch.float32
    outputs = []
    for step in range(3):
        inputs, targets = synthetic_batch(_CFG, 4, step)
        with torch.inference_mode():  # before any training forward at step 0: a rollout first
            ours = model(local_batch(inputs, rank, ws))
            with torch.autocast("cpu", dtype=ref_dtype, enabled=bf16):
                theirs = reference(local_batch(inputs, rank, ws))
            outputs.append((ours.float() - theirs.float()).abs().max().item())
        states = [fc.get_state(m) for m in [*model.blocks, model]]
        sharded = all(s.params.state is UnitState.SHARDED for s in states)
        _step(model, opt, local_batch(inputs, rank, ws), local_batch(targets, rank, ws))
        _step(reference, ref_opt, inputs, targets)
        outputs.append(float(not sharded))
    return {"outputs": outputs, "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize("bf16", [False, True])
def test_inference_mode_first_then_training_equals_the_reference(run_dist, ws: int, bf16: bool) -> None:
    """The first forward under ``inference_mode`` (it makes the full parameters), then training with an inference
    forward before each step: the same outputs and parameters as the unsharded model."""
    for result in run_dist(ws, _inference_first, bf16):
        assert max(result["outputs"]) <= (5e-2 if bf16 else 1e-5), result["outputs"]
        assert result["diff"] <= (3e-2 if bf16 else 1e-5)


# ------------------------------------------------------------------------------------- a failure inside a gather
class _Injected(RuntimeError):
    pass


@contextlib.contextmanager
def _failing(where: str, armed: Callable[[], bool], ws: int) -> Iterator[None]:
    """The step at ``where`` raises while ``armed()`` (the pool's process is reused: restored after): the copy-in
    (``UnitDevices.to_compute``, before the collective), or ``FullParams``' copy-out (on one rank: making the full
    parameters views of the shards), registration or free."""
    owner: Any = UnitDevices if where == "copy_in" else FullParams
    copy_out = "alias_shards" if ws == 1 else "copy_out"
    name = {"copy_in": "to_compute", "copy_out": copy_out, "register": "register", "reshard": "free"}[where]
    original = getattr(owner, name)

    def sabotaged(self: Any, *args: Any) -> Any:
        if armed():
            raise _Injected(f"{where} failed")
        return original(self, *args)

    setattr(owner, name, sabotaged)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _failure_in_a_gather(rank: int, ws: int, where: str, reset: bool) -> dict[str, Any]:
    """Steps 0..3; in step 1 block 1's gather (or reshard) raises on every rank, the user skips the batch."""
    reference, model = reference_and_copy(_CFG)
    shard_gpt(model, mesh_1d(ws))
    opt, ref_opt = make_optimizer("sgd")(model.parameters()), make_optimizer("sgd")(reference.parameters())
    target = fc.get_state(model.blocks[1])
    armed = {"on": False}

    def fires() -> bool:
        # only block 1's own unit
        if where == "copy_in":
            return armed["on"] and _current[0] is target.params.devices
        return armed["on"] and _current[0] is target.params.fulls

    _current: list[Any] = [None]
    raised, sharded = [], []
    with _failing(where, fires, ws), _tracking(_current):
        for step in range(4):
            inputs, targets = synthetic_batch(_CFG, 4, step)
            if step != 1:
                _step(reference, ref_opt, inputs, targets)
            armed["on"] = step == 1
            try:
                _step(model, opt, local_batch(inputs, rank, ws), local_batch(targets, rank, ws))
            except _Injected:
                raised.append(step)
                sharded.append(target.params.state is UnitState.SHARDED)
                armed["on"] = False
                if reset:
                    fc.reset_step(model)
                opt.zero_grad()
    return {"raised": raised, "sharded": sharded, "diff": max_param_diff(model, reference)}


@contextlib.contextmanager
def _tracking(current: list[Any]) -> Iterator[None]:
    """Keep the ``FullParams`` whose method runs now in ``current[0]`` (what ``_failing`` fires on)."""
    targets = [(FullParams, "copy_out"), (FullParams, "alias_shards"), (FullParams, "register"), (FullParams, "free")]
    targets.append((UnitDevices, "to_compute"))
    originals = {(owner, name): getattr(owner, name) for owner, name in targets}

    def tracked(owner: Any, name: str) -> Callable[..., Any]:
        def run(self: Any, *args: Any) -> Any:
            current[0] = self
            return originals[(owner, name)](self, *args)

        return run

    for owner, name in targets:
        setattr(owner, name, tracked(owner, name))
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


# one rank has no copy-in: its full parameters are its shards (``FullParams.alias_shards``, the "copy-out" there)
_GATHER_FAILURES = [
    (ws, where)
    for ws in (1, 2)
    for where in ("copy_in", "copy_out", "register", "reshard")
    if (ws, where) != (1, "copy_in")
]


@pytest.mark.parametrize(("ws", "where"), _GATHER_FAILURES)
@pytest.mark.parametrize("reset", [False, True])
def test_a_failure_inside_a_gather_leaves_the_unit_sharded_and_usable(
    run_dist, ws: int, where: str, reset: bool
) -> None:
    """The copy-in, the copy-out, the registration of the full parameters or the reshard raises on every rank: the
    unit is sharded again, and training goes on equal to a reference that skipped the step (with or without
    ``fc.reset_step``)."""
    for result in run_dist(ws, _failure_in_a_gather, where, reset):
        assert result["raised"] == [1]
        assert result["sharded"] == [True]
        assert result["diff"] <= 1e-5


def _numpy_reader(rank: int, ws: int) -> dict[str, Any]:
    """``.numpy()`` of a full parameter while gathered makes its storage non-resizable: the reshard cannot free it
    and the next gather cannot refill it in place."""
    reference, model = reference_and_copy(_CFG)
    shard_gpt(model, mesh_1d(ws))
    opt, ref_opt = make_optimizer("sgd")(model.parameters()), make_optimizer("sgd")(reference.parameters())
    inputs, targets = synthetic_batch(_CFG, 4, 0)
    with torch.no_grad():
        model(local_batch(inputs, rank, ws))  # lazy init
    fc.unshard(model.blocks[0])
    read = model.blocks[0].attn.qkv.weight.detach().numpy().copy()
    errors = []
    try:
        fc.reshard(model.blocks[0])
    except RuntimeError as error:
        errors.append(str(error).splitlines()[0])
    for step in range(3):
        inputs, targets = synthetic_batch(_CFG, 4, step)
        _step(reference, ref_opt, inputs, targets)
        _step(model, opt, local_batch(inputs, rank, ws), local_batch(targets, rank, ws))
    ref_weight = reference_and_copy(_CFG)[0].blocks[0].attn.qkv.weight.detach().numpy()
    return {"errors": errors, "read": float(abs(read - ref_weight).max()), "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [1, 2])
def test_a_numpy_reader_of_a_full_parameter_does_not_lose_the_unit(run_dist, ws: int) -> None:
    for result in run_dist(ws, _numpy_reader):
        assert result["read"] == 0.0
        assert result["diff"] <= 1e-5
