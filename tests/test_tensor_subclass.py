"""FSDP2's tensor-subclass protocol (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) side by side with torch's
fully_shard, on a small int8 + scale subclass defined in tests/int8_weight.py: losses, parameters, hook calls and
all-gather bytes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from tests import int8_weight
from tests.collective_bytes import CollectiveBytes
from tests.dist_utils import full_value, mesh_1d, mesh_nd
from tests.int8_weight import Int8Weight, PreHookOnly, Wrapper, attach_int8_hooks, int8_linears


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def _shard(model: nn.Sequential, shard: Any, mesh: Any, **kwargs: Any) -> None:
    for index in (0, 2, 4):
        shard(model[index], mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)


def _train(model: nn.Module, rank: int, ws: int, steps: int) -> tuple[list[float], dict[str, int]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    counter = CollectiveBytes()
    for step in range(steps):
        x, y = _batch(step)
        x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
        with counter if step == steps - 1 else _null():
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
    return losses, counter.summary()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _quantized(w: torch.Tensor) -> torch.Tensor:
    """The weight forward sees under the protocol: dequantized int8, gradient straight to the master weight."""
    scale = w.detach().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
    deq = torch.round(w.detach() / scale).clamp_(-127, 127).to(torch.int8).float() * scale
    return w + (deq - w).detach()


def _reference_losses(steps: int) -> tuple[list[float], nn.Sequential]:
    """Single process, whole batch: the same net using the dequantized weights (no subclass, no sharding)."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        h = x
        for layer in model:
            h = (
                nn.functional.linear(h, _quantized(layer.weight), layer.bias)
                if isinstance(layer, nn.Linear)
                else layer(h)
            )
        loss = nn.functional.mse_loss(h, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def _side_by_side(rank: int, ws: int, hsdp: bool = False) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    mesh = mesh_nd((2, ws // 2), ("replicate", "shard")) if hsdp else mesh_1d(ws)
    ours, theirs, plain = _net(), _net(), _net()
    for model in (ours, theirs):
        int8_linears(model)
    theirs_before = copy.deepcopy(theirs)
    _shard(ours, fc.fully_shard, mesh)
    _shard(theirs, fully_shard, mesh)
    _shard(plain, fully_shard, mesh)
    weight = ours[0].weight
    kept = isinstance(weight, DTensor) and type(weight._local_tensor) is Int8Weight
    int8_weight.calls.clear()
    int8_weight.seen_args.clear()
    our_losses, our_counts = _train(ours, rank, ws, steps=4)
    our_calls, our_args = dict(int8_weight.calls), list(int8_weight.seen_args)
    int8_weight.calls.clear()
    int8_weight.seen_args.clear()
    ref_losses, reference = _reference_losses(steps=4)
    ref_diff = max(abs(a - b) for a, b in zip(our_losses, ref_losses, strict=True))
    for (_, p), (_, q) in zip(ours.named_parameters(), reference.named_parameters(), strict=True):
        a = full_value(p.detach())
        a = a._tensor if isinstance(a, Int8Weight) else a
        ref_diff = max(ref_diff, (a - q.detach()).abs().max().item())
    if ws == 1:  # torch's fully_shard at one rank passes only the first pre-hook output to the post-hook
        return {"kept_subclass": kept, "ref_diff": ref_diff, "our_calls": our_calls, "ours": our_counts}
    their_losses, their_counts = _train(theirs, rank, ws, steps=4)
    their_calls, their_args = dict(int8_weight.calls), list(int8_weight.seen_args)
    plain_losses, _ = _train(plain, rank, ws, steps=4)
    param_diff = 0.0
    for (_, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        a, b = full_value(p.detach()), full_value(q.detach())
        a = a._tensor if isinstance(a, Int8Weight) else a
        b = b._tensor if isinstance(b, Int8Weight) else b
        param_diff = max(param_diff, (a - b).abs().max().item())
    del theirs_before
    return {
        "kept_subclass": kept,
        "ref_diff": ref_diff,
        "loss_diff": max(abs(a - b) for a, b in zip(our_losses, their_losses, strict=True)),
        "quantization_effect": max(abs(a - b) for a, b in zip(their_losses, plain_losses, strict=True)),
        "param_diff": param_diff,
        "ours": our_counts,
        "theirs": their_counts,
        "our_calls": our_calls,
        "their_calls": their_calls,
        # torch swaps the module's class to FSDP<Class>; fsdp_compose keeps it
        "our_args": [(tuple(m.shape), size, stride, mod, str(pol)) for m, size, stride, mod, pol in our_args[:3]],
        "their_args": [
            (tuple(m.shape), size, stride, mod.removeprefix("FSDP"), str(pol))
            for m, size, stride, mod, pol in their_args[:3]
        ],
    }


@pytest.mark.parametrize(("ws", "hsdp"), [(1, False), (2, False), (4, False), (4, True)])
def test_protocol_matches_torchs_fully_shard(run_dist, ws: int, hsdp: bool) -> None:
    for result in run_dist(ws, _side_by_side, hsdp):
        assert result["kept_subclass"], "the sharded parameter's local tensor must stay the subclass"
        assert result["ref_diff"] < 1e-5, result  # against the single-process quantized reference
        # 3 units with one Int8Weight each, 4 steps: gathered in forward and again in backward
        assert result["our_calls"] == {"pre": 24, "post": 3, "post_out": 21}, result
        if ws == 1:
            continue
        # The hooks matter: training on the dequantized int8 weights differs from training on the fp32 weights
        assert result["quantization_effect"] > 1e-4
        assert result["loss_diff"] < 1e-6, result
        assert result["param_diff"] < 1e-5, result
        assert result["our_calls"] == result["their_calls"], result
        assert result["our_args"] == result["their_args"], result
        assert result["ours"]["all_gather_bytes"] > 0
        if ws > 1:
            assert result["ours"]["all_gather_bytes"] == result["theirs"]["all_gather_bytes"], (
                result["ours"],
                result["theirs"],
            )
            assert result["ours"]["all_gather"] == result["theirs"]["all_gather"], result
            assert result["ours"]["reduce_scatter"] == result["theirs"]["reduce_scatter"], result
            assert result["ours"]["reduce_scatter_bytes"] == result["theirs"]["reduce_scatter_bytes"], result


def _refusals(rank: int, ws: int) -> list[str]:
    mesh = mesh_1d(ws)
    messages = []

    def refused(error: type[Exception], make: Any, **kwargs: Any) -> None:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        model[0].weight = nn.Parameter(make(model[0].weight.detach().clone()))
        before = {n: (type(p), p.detach().clone()) for n, p in model.named_parameters()}
        with pytest.raises(error) as info:
            fc.fully_shard(model, mesh=mesh, **kwargs)
        after = {n: (type(p), p.detach()) for n, p in model.named_parameters()}
        assert all(before[n][0] is after[n][0] and torch.equal(before[n][1], after[n][1]) for n in before)
        assert fc.get_state(model) is None
        messages.append(str(info.value))

    # a subclass without the hooks (yet) is sharded its own way: on dim 0 only
    refused(NotImplementedError, Wrapper, shard_placement_fn=lambda p: torch.distributed.tensor.Shard(p.ndim - 1))
    refused(TypeError, PreHookOnly)  # both hooks are needed
    refused(NotImplementedError, Int8Weight, shard_placement_fn=lambda p: torch.distributed.tensor.Shard(p.ndim - 1))
    refused(NotImplementedError, Int8Weight, offload_policy=fc.CPUOffloadPolicy())
    refused(NotImplementedError, Int8Weight, extensions=fc.ShardExtensions(all_gather=fc.Int8AllGather()))
    return messages


def test_subclasses_that_cannot_be_handled_are_refused_before_touching_the_model(run_dist) -> None:
    messages = run_dist(2, _refusals)[0]
    assert "'0.weight' of Sequential (Wrapper)" in messages[0] and "dim 0 only" in messages[0]
    assert "defines only one of fsdp_pre_all_gather / fsdp_post_all_gather" in messages[1]
    assert "Shard(1)" in messages[2] and "dim 0 only" in messages[2]
    assert "CPU offload" in messages[3]
    assert "all_gather extension" in messages[4]


def _lifecycle(rank: int, ws: int) -> dict[str, Any]:
    """deepcopy and a state_dict round trip keep the subclass as the local shard and train identically."""
    mesh = mesh_1d(ws)
    model = _net()
    int8_linears(model)
    _shard(model, fc.fully_shard, mesh)
    twin = copy.deepcopy(model)
    fresh = _net()
    int8_linears(fresh)
    _shard(fresh, fc.fully_shard, mesh)
    fresh.load_state_dict(model.state_dict())
    runs = [_train(m, rank, ws, steps=2)[0] for m in (model, twin, fresh)]
    kinds = {type(m[0].weight._local_tensor).__name__ for m in (model, twin, fresh)}
    return {"losses": runs, "kinds": sorted(kinds)}


def test_deepcopy_and_state_dict_keep_the_protocol(run_dist) -> None:
    for result in run_dist(2, _lifecycle):
        ours, twin, fresh = result["losses"]
        assert ours == twin == fresh, result
        assert result["kinds"] == ["Int8Weight"], result


# ------------------------------------------------------------------ hooks attached after fully_shard
def _wrap_linears(model: nn.Module) -> None:
    """Every Linear weight a ``Wrapper``: a tensor subclass without FSDP2's hooks."""
    for sub in model.modules():
        if isinstance(sub, nn.Linear):
            sub.weight = nn.Parameter(Wrapper(sub.weight.detach().clone()))


def _attach_to_local_shards(model: nn.Module) -> None:
    for sub in model.modules():
        if isinstance(sub, nn.Linear):
            attach_int8_hooks(sub.weight._local_tensor)  # type: ignore[attr-defined]


def _master(t: torch.Tensor) -> torch.Tensor:
    value = full_value(t.detach())
    return value._tensor if isinstance(value, Wrapper) else value


def _hooks_after_fully_shard(rank: int, ws: int, kind: str) -> dict[str, Any]:
    """``kind``: "plain" (plain weights; int8 hooks attached to their local shards after fully_shard), "subclass"
    (Wrapper weights without hooks at fully_shard; the hooks attached afterwards), "never" (Wrapper weights that
    never get hooks: they train as plain parameters). Ours and torch's fully_shard on the same batches."""
    from torch.distributed.fsdp import fully_shard

    mesh = mesh_1d(ws)
    results: dict[str, Any] = {}
    for name, shard in (("ours", fc.fully_shard), ("torch", fully_shard)):
        model = _net()
        if kind != "plain":
            _wrap_linears(model)
        _shard(model, shard, mesh)
        if kind != "never":
            _attach_to_local_shards(model)  # after fully_shard, before the first forward (torch's lazy init)
        int8_weight.calls.clear()
        losses, counts = _train(model, rank, ws, steps=4)
        results[name] = {
            "losses": losses,
            "calls": dict(int8_weight.calls),
            "params": [_master(p) for p in model.parameters()],
            "all_gather_bytes": counts["all_gather_bytes"],
        }
    # the single-process reference: the dequantized int8 weights where the hooks run, else the plain weights
    if kind == "never":
        reference = _net()
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        ref_losses = []
        for step in range(4):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(reference(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
    else:
        ref_losses, reference = _reference_losses(steps=4)
    results["reference"] = {"losses": ref_losses, "params": [p.detach() for p in reference.parameters()]}
    return results


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "subclass", "never"])
def test_hooks_attached_after_fully_shard_are_used_as_by_torch(run_dist, ws: int, kind: str) -> None:
    """torch's fully_shard reads fsdp_pre_all_gather / fsdp_post_all_gather again at its lazy init: hooks attached to
    the local shards after fully_shard are used, and a tensor subclass without hooks at fully_shard is accepted
    (then trains as a plain parameter if it never gets them). Before: the hooks were never called (plain), and the
    subclass was refused with TypeError."""
    for r in run_dist(ws, _hooks_after_fully_shard, kind):
        ours, theirs, ref = r["ours"], r["torch"], r["reference"]
        if kind == "never":
            assert ours["calls"] == theirs["calls"] == {}
        else:
            # 3 units with one hooked weight each, 4 steps: gathered in forward and again in backward
            assert ours["calls"] == theirs["calls"] == {"pre": 24, "post": 3, "post_out": 21}, (ours, theirs)
            assert ours["all_gather_bytes"] == theirs["all_gather_bytes"]  # int8 data + scales, as torch sends
        assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)) < 1e-6
        assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"], strict=True)) < 1e-5
        for a, b, c in zip(ours["params"], theirs["params"], ref["params"], strict=True):
            assert (a - b).abs().max().item() < 1e-5
            assert (a - c).abs().max().item() < 1e-5


def _hooks_added_where_unsupported(rank: int, ws: int) -> tuple[str, bool]:
    model = _net()
    _shard(model, fc.fully_shard, mesh_1d(ws), offload_policy=fc.CPUOffloadPolicy(pin_memory=False))
    _attach_to_local_shards(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NotImplementedError) as info:
        model(_batch(0)[0])
    unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    return str(info.value), unchanged


def test_hooks_attached_after_fully_shard_where_unsupported_raise_before_the_first_gather(run_dist) -> None:
    for message, unchanged in run_dist(2, _hooks_added_where_unsupported):
        assert "attached after fully_shard" in message and "CPU offload" in message, message
        assert unchanged
