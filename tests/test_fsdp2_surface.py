"""The rest of FSDP2's public surface through fsdp_compose, each side by side with torch's ``fully_shard`` on the same
ranks (and with a single-process reference where numbers are involved): ``set_all_reduce_hook``,
``set_reduce_scatter_unused_params(True)``, ``set_post_optim_event`` with a CPU stream's ``None`` event,
``_set_unshard_async_op``, torch's composable ``replicate()`` beside units, ``torch.func.jvp`` through units, the
output dtype of a non-root mixed-precision unit (a documented difference) and the ``repr`` of a unit's state.
``dp_mesh_dims`` with a replicate dim only is in test_fsdp2_compat.py with the other ``dp_mesh_dims`` cases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed._composable import replicate as ddp_replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_compose as fc
from tests.dist_utils import full_value, local_batch, max_param_diff, mesh_1d, mesh_nd

ShardFn = Callable[..., Any]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 3))


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def _ours(module: Any, **kwargs: Any) -> Any:
    """fsdp_compose's fully_shard as a port of torch code uses it: FSDP2's methods bound."""
    return fc.fully_shard(module, fsdp2_methods=True, **kwargs)


def _shard_blocks(model: nn.Sequential, shard: ShardFn, **kwargs: Any) -> nn.Sequential:
    for index in (0, 2):
        shard(model[index], **kwargs)
    shard(model, **kwargs)
    return model


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


def _reference_grads(step: int, n: int) -> list[torch.Tensor]:
    """Gradients of one step on the global batch, single process (FSDP's averaged gradients equal them)."""
    reference = _net()
    _step(reference, *_batch(step, n))
    return [p.grad.clone() for p in reference.parameters()]  # type: ignore[union-attr]


# ---------------------------------------------------------------------- set_all_reduce_hook
def _hook_fsdp(rank: int, ws: int, param_dtype: torch.dtype | None) -> dict[str, Any]:
    mesh = mesh_1d(ws)
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    x, y = _batch(0, 4 * ws)
    results: dict[str, Any] = {"reference": _reference_grads(0, 4 * ws)}
    for name, shard in (("ours", _ours), ("torch", torch_fsdp.fully_shard)):
        model = _shard_blocks(_net(), shard, mesh=mesh, mp_policy=policy)
        seen: list[tuple[torch.dtype, int]] = []

        def hook(output: torch.Tensor, seen: list[tuple[torch.dtype, int]] = seen) -> None:
            seen.append((output.dtype, output.numel()))
            output.mul_(2.0)  # in place: what .grad receives

        model[0].set_all_reduce_hook(hook)  # type: ignore[operator]
        model.set_all_reduce_hook(hook)  # type: ignore[operator]  # the root's own unit (model[4]); not recursive
        _step(model, local_batch(x, rank, ws), local_batch(y, rank, ws))
        results[name] = ([full_value(p.grad) for p in model.parameters()], sorted(seen, key=str))  # type: ignore[arg-type]
    return results


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_reduce_hook_sees_the_reduced_rows_as_torchs_does(run_dist, param_dtype: torch.dtype | None) -> None:
    for r in run_dist(2, _hook_fsdp, param_dtype):
        (ours, our_seen), (theirs, their_seen) = r["ours"], r["torch"]
        # Called once per unit it was set on, on a flat fp32 (reduce dtype) tensor of the same size as torch's.
        assert our_seen == their_seen and len(our_seen) == 2
        assert all(dtype == torch.float32 for dtype, _ in our_seen)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 if param_dtype is None else 1e-2)
        if param_dtype is None:
            # model[0] and the root's Linear (model[4]) doubled by the hook, model[2] (no hook) untouched
            scale = [2.0, 2.0, 1.0, 1.0, 2.0, 2.0]
            for grad, ref, s in zip(ours, r["reference"], scale, strict=True):
                torch.testing.assert_close(grad, ref * s, rtol=1e-5, atol=1e-6)


def _hook_hsdp(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_nd((2, 2), ("replicate", "shard"))
    replicas = mesh["replicate"].get_group()
    x, y = _batch(0, 4 * ws)
    results: dict[str, Any] = {}
    for name, shard in (("ours", _ours), ("torch", torch_fsdp.fully_shard)):
        # Native HSDP: the hook runs after the all-reduce over replicas; FSDP2 refuses a stream there.
        model = _shard_blocks(_net(), shard, mesh=mesh)
        with pytest.raises(ValueError) as info:  # (torch sets the hook before it raises; fsdp_compose does not)
            model.set_all_reduce_hook(lambda out: None, stream=torch.get_device_module("cpu").Stream())  # type: ignore[operator]
        calls: list[int] = []
        model.set_all_reduce_hook(lambda out, calls=calls: calls.append(out.numel()))  # type: ignore[operator]
        _step(model, local_batch(x, rank, ws), local_batch(y, rank, ws))
        native = [full_value(p.grad) for p in model.parameters()]
        # torchft's pattern: FSDP over the shard dim only, the replica all-reduce done by the hook.
        custom = _shard_blocks(_net(), shard, mesh=mesh["shard"])

        def all_reduce_over_replicas(output: torch.Tensor) -> None:
            dist.all_reduce(output, group=replicas)  # gloo has no AVG: sum, then divide
            output.div_(dist.get_world_size(replicas))

        for module in (custom[0], custom[2], custom):
            module.set_all_reduce_hook(all_reduce_over_replicas)  # type: ignore[operator]
        _step(custom, local_batch(x, rank, ws), local_batch(y, rank, ws))
        results[name] = (native, [p.grad.to_local().clone() for p in custom.parameters()], calls, str(info.value))  # type: ignore[union-attr]
    results["reference"] = _reference_grads(0, 4 * ws)
    results["shard_rank"] = mesh.get_local_rank(1)
    return results


def test_all_reduce_hook_under_hsdp_and_as_a_custom_replica_all_reduce(run_dist) -> None:
    for r in run_dist(4, _hook_hsdp):
        (native, custom, calls, message), (t_native, t_custom, t_calls, t_message) = r["ours"], r["torch"]
        assert message == t_message == "stream cannot be set when using native HSDP"
        assert calls == t_calls and len(calls) == 1
        for ours, theirs, ref in zip(native, t_native, r["reference"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        for ours, theirs, ref in zip(custom, t_custom, r["reference"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            # the hook's all-reduce over replicas makes the 1-D units' gradients the global average: this rank's rows
            rows = ref.chunk(2)[r["shard_rank"]]
            torch.testing.assert_close(ours, rows, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- set_reduce_scatter_unused_params
class _TwoParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Parameter(torch.randn(8, 4))
        self.unused = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.used * x).sum()


def _unused(rank: int, ws: int, flag: bool | None) -> dict[str, Any]:
    mesh = mesh_1d(ws)
    results = {}
    for name, shard in (("ours", _ours), ("torch", torch_fsdp.fully_shard)):
        model = shard(_TwoParams(), mesh=mesh)
        if flag is not None:
            model.set_reduce_scatter_unused_params(flag)
        trace = []
        for step in range(2):  # the second backward accumulates into the existing .grad
            model(torch.full((4,), float(rank + step + 1))).backward()
            g = model.unused.grad
            trace.append(
                (
                    None if g is None else (type(g).__name__, g.to_local().abs().sum().item()),
                    full_value(model.used.grad),
                )
            )
        results[name] = trace
    return results


@pytest.mark.parametrize("flag", [None, False, True], ids=["default", "false", "true"])
def test_reduce_scatter_unused_params_gives_a_zero_grad_as_torch(run_dist, flag: bool | None) -> None:
    for r in run_dist(2, _unused, flag):
        for (ours_unused, ours_used), (their_unused, their_used) in zip(r["ours"], r["torch"], strict=True):
            assert ours_unused == their_unused
            assert ours_unused == (("DTensor", 0.0) if flag else None)
            torch.testing.assert_close(ours_used, their_used, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- set_post_optim_event, _set_unshard_async_op
def _train_with_event(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_1d(ws)
    results: dict[str, Any] = {}
    reference = _net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        ref_opt.zero_grad()
        _step(reference, *_batch(step, 4 * ws))
        ref_opt.step()
    for name, shard in (("ours", _ours), ("torch", torch_fsdp.fully_shard)):
        model = _shard_blocks(_net(), shard, mesh=mesh)
        model._set_unshard_async_op(True)  # type: ignore[operator]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        events: list[object] = []

        def post_step(
            optimizer: Any, args: Any, kwargs: Any, model: Any = model, events: list[object] = events
        ) -> None:
            event = torch.get_device_module(torch.device("cpu")).current_stream().record_event()
            events.append(event)  # None on CPU: FSDP2 then has nothing to wait for
            model.set_post_optim_event(event)

        opt.register_step_post_hook(post_step)
        losses = []
        for step in range(3):
            x, y = _batch(step, 4 * ws)
            opt.zero_grad()
            losses.append(_step(model, local_batch(x, rank, ws), local_batch(y, rank, ws)).item())
            opt.step()
        results[name] = (model, losses, events)
    with pytest.raises(TypeError):
        results["ours"][0]._set_unshard_async_op("yes")
    ours, theirs = results["ours"][0], results["torch"][0]
    return {
        "vs_torch": max_param_diff(ours, theirs),
        "vs_reference": max_param_diff(ours, reference),
        "losses": (results["ours"][1], results["torch"][1]),
        "events": (results["ours"][2], results["torch"][2]),
    }


def test_post_optim_event_none_and_unshard_async_op_train_as_torch(run_dist) -> None:
    for r in run_dist(2, _train_with_event):
        assert r["vs_torch"] < 1e-6 and r["vs_reference"] < 1e-6
        assert r["losses"][0] == pytest.approx(r["losses"][1], abs=1e-6)
        assert r["events"] == ([None] * 3, [None] * 3)


# ---------------------------------------------------------------------- torch's replicate() beside units
def _with_replicate(rank: int, ws: int, flavor: str) -> dict[str, Any]:
    mesh = mesh_1d(ws)

    def replicate(module: nn.Module) -> None:
        if flavor == "ddp":
            ddp_replicate(module)
        else:
            fsdp_replicate(module, mesh=mesh_nd((ws,), ("replicate",)))

    reference = _net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    models = {}
    for name, shard in (("ours", fc.fully_shard), ("torch", torch_fsdp.fully_shard)):
        model = _net()
        replicate(model[2])
        shard(model[0], mesh=mesh)
        shard(model, mesh=mesh)
        models[name] = model
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    for step in range(3):
        x, y = _batch(step, 4 * ws)
        for name, model in models.items():
            opts[name].zero_grad()
            _step(model, local_batch(x, rank, ws), local_batch(y, rank, ws))
            opts[name].step()
        ref_opt.zero_grad()
        _step(reference, x, y)
        ref_opt.step()
    ours = models["ours"]
    replicated = [type(p).__name__ if not isinstance(p, DTensor) else tuple(p.placements) for p in ours[2].parameters()]
    # A module replicate() manages cannot be a unit itself; nothing changes.
    lone = _net()
    replicate(lone[2])
    before = [id(p) for p in lone.parameters()]
    with pytest.raises(ValueError) as info:
        fc.fully_shard(lone[2], mesh=mesh)
    untouched = before == [id(p) for p in lone.parameters()] and not fc.is_fully_sharded(lone[2])
    return {
        "vs_torch": max_param_diff(ours, models["torch"]),
        "vs_reference": max_param_diff(ours, reference),
        "replicated": replicated,
        "sharded": [tuple(p.placements) for p in (*ours[0].parameters(), *ours[4].parameters())],
        "error": (str(info.value), untouched),
    }


@pytest.mark.parametrize("flavor", ["ddp", "fsdp"])
def test_replicate_beside_units_trains_as_with_torchs_fully_shard(run_dist, flavor: str) -> None:
    for r in run_dist(2, _with_replicate, flavor):
        assert r["vs_torch"] < 1e-6 and r["vs_reference"] < 1e-6
        # replicate() keeps its module's parameters (plain for the DDP-based one, Replicate() for torch 2.13's)
        expected = ["Parameter", "Parameter"] if flavor == "ddp" else [(Replicate(),), (Replicate(),)]
        assert r["replicated"] == expected
        assert all(placements == (Shard(0),) for placements in r["sharded"])
        message, untouched = r["error"]
        assert "replicate()" in message and "Linear" in message and untouched


# ---------------------------------------------------------------------- torch.func.jvp
def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [torch.zeros(()) if p.grad is None else full_value(p.grad).clone() for p in model.parameters()]


def _jvp(rank: int, ws: int, loss_on: str, reshard_after_forward: bool) -> dict[str, Any]:
    mesh = mesh_1d(ws)
    models = {
        "reference": _net(),
        "ours": _shard_blocks(_net(), fc.fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward),
        "torch": _shard_blocks(_net(), torch_fsdp.fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward),
    }
    x = _batch(0, 4 * ws)[0]
    tangent = torch.randn(4 * ws, 6, generator=torch.Generator().manual_seed(3))
    results: dict[str, Any] = {}
    for name, model in models.items():
        xs, ts = (x, tangent) if name == "reference" else (local_batch(x, rank, ws), local_batch(tangent, rank, ws))
        with torch.no_grad():
            outputs = [t.detach() for t in torch.func.jvp(model, (xs,), (ts,))]
        # A loss on the jvp's outputs (the tangent's backward reads the full parameters too), twice: accumulated.
        # model[2] and the root get inputs that require grad (the previous layer's output): hooked in forward.
        for _ in range(2):
            primal, tangent_out = torch.func.jvp(model, (xs,), (ts,))
            loss = {"tangent": tangent_out.pow(2).sum(), "both": primal.pow(2).sum() + tangent_out.pow(2).sum()}
            loss[loss_on].backward()
        grads = _grads(model)
        if name == "reference":
            grads = [g / ws for g in grads]  # FSDP averages the ranks' sums over their parts of the batch
            outputs = [local_batch(o, rank, ws) for o in outputs]  # this rank's rows of the primal and tangent
        results[name] = (outputs, grads)
    results["dtensor_params"] = all(isinstance(p, DTensor) for p in models["ours"].parameters())
    return results


@pytest.mark.parametrize("loss_on", ["tangent", "both"])
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_jvp_through_units_matches_torch_and_the_reference(run_dist, loss_on: str, reshard_after_forward: bool) -> None:
    for r in run_dist(2, _jvp, loss_on, reshard_after_forward):
        (outputs, grads), (t_outputs, t_grads), (r_outputs, r_grads) = r["ours"], r["torch"], r["reference"]
        for ours, theirs, ref in zip(outputs, t_outputs, r_outputs, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
        for ours, theirs, ref in zip(grads, t_grads, r_grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert r["dtensor_params"]


def _captured_input_under_transform(rank: int, ws: int, transform: str, mixed: bool) -> dict[str, Any]:
    """enc and dec sharded separately (two roots, torch's test's layout); enc runs outside the transform, dec inside
    it on enc's output, a tensor that requires grad captured from outside (not the transform's wrapped input)."""
    mesh = mesh_1d(ws)
    policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else {}
    results: dict[str, Any] = {}
    for name, shard, mp in (
        ("reference", None, None),
        ("ours", fc.fully_shard, fc.MixedPrecisionPolicy(**policy)),
        ("torch", torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy(**policy)),
    ):
        torch.manual_seed(0)
        enc, dec = nn.Linear(6, 10), nn.Linear(10, 3)
        if shard is not None:
            for m in (enc, dec):
                shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
        seen = []
        for step in range(2):
            x = _batch(step, 4 * ws)[0]
            x = x if shard is None else local_batch(x, rank, ws)
            e = enc(x)
            if transform == "jvp":
                primal = torch.randn(3, generator=torch.Generator().manual_seed(step))
                out, tangent_out = torch.func.jvp(lambda _unused, dec=dec, e=e: dec(e), (primal,), (torch.ones(3),))
                seen.append((out.dtype, bool((tangent_out == 0).all())))
            else:
                scales = torch.arange(1.0, 3.0).view(2, 1, 1)
                out = torch.vmap(lambda s, dec=dec, e=e: dec(e) * s)(scales)
                seen.append((out.dtype, out.shape[0] == 2))
            opt.zero_grad()
            out.float().pow(2).mean().backward()  # means over equal local batches: FSDP's average is the global one
            opt.step()
        results[name] = ([full_value(p.detach()).clone() for p in (*enc.parameters(), *dec.parameters())], seen)
    return results


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("transform", ["jvp", "vmap"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_transform_over_a_unit_called_on_a_captured_input_matches_torch(
    run_dist, ws: int, transform: str, mixed: bool
) -> None:
    """torch.func over a unit whose input requires grad but comes from outside the transform: no autograd Function
    may be applied inside it (before the fix: "must override the setup_context staticmethod")."""
    for r in run_dist(ws, _captured_input_under_transform, transform, mixed):
        (params, seen), (t_params, t_seen), (r_params, _) = r["ours"], r["torch"], r["reference"]
        assert seen == t_seen  # output dtype (bf16 under the policy) and a zero tangent / the batched output
        for ours, theirs, ref in zip(params, t_params, r_params, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
            torch.testing.assert_close(ours, ref, rtol=0, atol=2e-2 if mixed else 1e-6)  # bf16 compute vs fp32


# ---------------------------------------------------------------------- a non-root bf16 unit's output dtype
class _FloatBetween(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())  # b receives an fp32 input


def _output_dtype(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_1d(ws)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, shard, policy in (
        ("torch", torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        ("ours", fc.fully_shard, fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        ("ours_as_torch", fc.fully_shard, fc.MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.bfloat16)),
    ):
        model = _FloatBetween()
        shard(model.b, mesh=mesh, mp_policy=policy)
        shard(model, mesh=mesh)  # the root stays fp32
        out = model(x)
        out.sum().backward()
        results[name] = (out.detach(), full_value(model.b.weight.grad))
    return results


def test_nonroot_bf16_unit_output_dtype_is_the_documented_difference(run_dist) -> None:
    # docs/precision.md: fsdp_compose hands a non-root unit's outputs back in the dtype its inputs came in (torch:
    # param_dtype); output_dtype=param_dtype gives torch's. The values are the same bf16 computation either way.
    for r in run_dist(2, _output_dtype):
        (theirs, t_grad), (ours, grad), (as_torch, a_grad) = r["torch"], r["ours"], r["ours_as_torch"]
        assert theirs.dtype == as_torch.dtype == torch.bfloat16 and ours.dtype == torch.float32
        assert torch.equal(ours, theirs.float()) and torch.equal(as_torch, theirs)
        torch.testing.assert_close(grad, t_grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(a_grad, t_grad, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- repr
def _reprs(rank: int, ws: int) -> tuple[str, str, int]:
    model = _shard_blocks(_net(), fc.fully_shard, mesh=mesh_1d(ws))
    state = fc.get_state(model[0])
    assert state is not None
    return repr(state), repr(state.params), sum(p.to_local().numel() for p in model[0].parameters())  # type: ignore[attr-defined]


def test_repr_of_a_units_state_says_what_it_is(run_dist) -> None:
    for state, unit, local in run_dist(2, _reprs):
        assert state.startswith("ShardState([Linear], root=None, phase=idle, params=UnitParams(")
        assert unit in state
        # 0 (Linear 6->10): 70 elements; this rank's rows: 5 of 10 weight rows and 5 bias elements
        assert "mesh=(2,) cpu" in unit and "params=2" in unit and "numel=70" in unit
        assert f"local_numel={local} (cpu)" in unit and local == 35
        assert "dtype=float32" in unit and "state=sharded" in unit


# ---------------------------------------------------------------------- dp_mesh_dims with replicate= only
def _replicate_only_collectives(rank: int, ws: int) -> list[dict[str, int]]:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = mesh_nd((ws,), ("dp",))
    dims = torch_fsdp.DataParallelMeshDims(replicate="dp")
    counts = []
    for shard in (_ours, torch_fsdp.fully_shard):
        model = _net()
        for module in model:
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()])))
        _shard_blocks(model, shard, mesh=mesh, dp_mesh_dims=dims)
        x = distribute_tensor(_batch(0, 4 * ws)[0], mesh, [Shard(0)])
        model(x).sum().backward()  # lazy init
        with CommDebugMode() as comm:
            model(x).sum().backward()
        counts.append({str(op): n for op, n in comm.get_comm_counts().items()})
    return counts


def test_replicate_only_dp_mesh_dims_issues_torchs_collectives(run_dist) -> None:
    # (numbers and placements against torch: test_fsdp2_compat.py::test_dp_mesh_dims_matches_torchs_fully_shard)
    for ours, theirs in run_dist(2, _replicate_only_collectives):
        # one all-reduce per unit, nothing gathered or scattered; fsdp_compose adds its agreement (which units the
        # backward runs: agreement.start_agreement) and its closing word (did a rank abandon it) per backward
        assert theirs == {"c10d.allreduce_": 3}
        assert ours == {"c10d.allreduce_": 3 + 2}
