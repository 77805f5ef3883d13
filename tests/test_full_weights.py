"""``fc.full_weights``: the unsharded model's state dict streamed one unit at a time, for an inference engine.

Each case trains a sharded GPT one step, then compares the stream with what the unsharded model's ``state_dict()``
holds, entry by entry gathered on its own (``DTensor.full_tensor()``): the same keys, bitwise the same values (in
the requested dtype), one all-gather per unit, and a model that loads it with ``load_state_dict``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.unit import UnitState
from tests.collective_bytes import CollectiveBytes
from tests.dist_utils import local_batch, mesh_1d, mesh_nd, tp_mlps

_CFG = GPTConfig(n_layers=2)


def _build(rank: int, ws: int, layout: str) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    reference = GPT(_CFG)
    if layout == "tied":
        reference.head.weight = reference.tok_emb.weight
    model = copy.deepcopy(reference)
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if layout == "bf16" else fc.MixedPrecisionPolicy()
    if layout == "hsdp":
        mesh = mesh_nd((2, ws // 2), ("replicate", "shard"))
    elif layout == "tp":
        mesh2d = mesh_nd((2, ws // 2), ("dp", "tp"))
        tp_mlps(model, mesh2d["tp"])
        mesh = mesh2d["dp"]
    else:
        mesh = mesh_1d(ws)
    if layout == "frozen":
        model.blocks[0].requires_grad_(False)
    ignored = {"ignored_params": {model.pos_emb}} if layout == "ignored" else {}  # no unit holds it
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh, mp_policy=policy)
    fc.fully_shard(model, mesh=mesh, mp_policy=policy, **ignored)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    inputs, targets = synthetic_batch(_CFG, 4, 0)
    dp_rank, dp_size = (rank // (ws // 2), 2) if layout == "tp" else (rank, ws)
    loss_fn(model(local_batch(inputs, dp_rank, dp_size)), local_batch(targets, dp_rank, dp_size)).backward()
    opt.step()
    return reference, model


def _per_entry(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def _stream(rank: int, ws: int, layout: str, dtype: torch.dtype | None, bucket_bytes: int) -> dict[str, Any]:
    reference, model = _build(rank, ws, layout)
    expected = _per_entry(model)
    with CollectiveBytes() as recorded:
        pairs = list(fc.full_weights(model, dtype=dtype, bucket_bytes=bucket_bytes))
    streamed = dict(pairs)
    different = [
        key
        for key, value in expected.items()
        if not torch.equal(streamed[key], value.to(dtype) if dtype is not None and value.is_floating_point() else value)
    ]
    loaded = copy.deepcopy(reference)
    loaded.load_state_dict(streamed)  # strict: every key of the unsharded model, no other
    units = len(fc.get_state(model).step.states) if fc.get_state(model).step is not None else 0
    states = [fc.get_state(m) for m in [model, *model.blocks]]
    return {
        "keys": [k for k, _ in pairs] == list(dict.fromkeys(k for k, _ in pairs)) and set(streamed) == set(expected),
        "reference_keys": set(streamed) == set(reference.state_dict()),
        "different": different,
        "dtypes": {str(v.dtype) for v in streamed.values() if v.is_floating_point()},
        "all_gathers": recorded.summary()["all_gather"],
        "units": units,
        "sharded": all(s.params.state is UnitState.SHARDED for s in states),
        "tied_once": layout != "tied" or streamed["head.weight"] is streamed["tok_emb.weight"],
    }


@pytest.mark.parametrize(
    ("ws", "layout"),
    [(2, "plain"), (4, "plain"), (4, "hsdp"), (4, "tp"), (2, "bf16"), (2, "frozen"), (2, "tied"), (2, "ignored")],
)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["own", "bf16"])
def test_the_stream_equals_the_unsharded_state_dict(run_dist, ws: int, layout: str, dtype: torch.dtype | None) -> None:
    for result in run_dist(ws, _stream, layout, dtype, 0):
        assert result["keys"] and result["reference_keys"]
        assert result["different"] == []
        assert result["dtypes"] == {"torch.bfloat16" if dtype is not None else "torch.float32"}
        if layout != "tp":  # FSDP + TP: each TP parameter's full_tensor() over the TP dim on top
            assert result["all_gathers"] == result["units"]
        assert result["sharded"] and result["tied_once"]


def test_buckets_of_units_stream_the_same(run_dist) -> None:
    for result in run_dist(2, _stream, "plain", None, 1 << 30):
        assert result["different"] == [] and result["all_gathers"] == result["units"] and result["sharded"]


def _rank0_only_and_early_stop(rank: int, ws: int) -> dict[str, Any]:
    _, model = _build(rank, ws, "plain")
    got = list(fc.full_weights(model, rank0_only=True))
    stream = fc.full_weights(model, bucket_bytes=1 << 30)
    next(stream)
    stream.close()  # the consumer stops inside the bucket, on every rank
    states = [fc.get_state(m) for m in [model, *model.blocks]]
    sharded = all(s.params.state is UnitState.SHARDED for s in states)
    inputs, targets = synthetic_batch(_CFG, 4, 1)
    loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()  # training goes on
    full = fc.full_state_dict(model, rank0_only=False, cpu_offload=False)
    return {"count": len(got), "sharded": sharded, "same": all(torch.equal(v, full[k]) for k, v in got)}


def test_rank0_only_and_a_consumer_that_stops_early(run_dist) -> None:
    results = run_dist(2, _rank0_only_and_early_stop)
    assert results[0]["count"] > 0 and results[1]["count"] == 0
    assert all(r["sharded"] and r["same"] for r in results)


def _bad_arguments(rank: int, ws: int) -> list[str]:
    _, model = _build(rank, ws, "plain")
    messages = []
    for kwargs in ({"dtype": torch.int8}, {"bucket_bytes": -1}, {"rank0_only": 1}):
        try:
            fc.full_weights(model, **kwargs)
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    return messages


def test_bad_arguments_raise_before_any_collective(run_dist) -> None:
    for messages in run_dist(2, _bad_arguments):
        assert len(messages) == 3 and all(m.startswith("fc.full_weights") for m in messages)
