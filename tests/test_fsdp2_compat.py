"""Code written for torch's ``fully_shard`` on fsdp_compose: torch's policy objects, ``dp_mesh_dims``, FSDP2's methods
bound on the instance (``fc.bind_fsdp2_methods``), ``fc.has_fsdp2_methods`` for guards. Parity against torch's
``fully_shard`` and against a single-process reference."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import full_value, local_batch, max_param_diff, mesh_1d, mesh_nd


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 3))


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def _shard_blocks(model: nn.Sequential, shard: Any, **kwargs: Any) -> nn.Sequential:
    for index in (0, 2):
        shard(model[index], **kwargs)
    shard(model, **kwargs)
    return model


# ---------------------------------------------------------------------- torch's policy objects
def _policies(rank: int, ws: int) -> tuple[float, float, str]:
    mesh = mesh_1d(ws)
    torch_mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours_mp = fc.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    ours = _shard_blocks(_net(), fc.fully_shard, mesh=mesh, mp_policy=ours_mp)
    theirs = _shard_blocks(_net(), fc.fully_shard, mesh=mesh, mp_policy=torch_mp)
    offloaded = _shard_blocks(_net(), fc.fully_shard, mesh=mesh, offload_policy=torch_fsdp.CPUOffloadPolicy())
    plain = _shard_blocks(_net(), fc.fully_shard, mesh=mesh, offload_policy=torch_fsdp.OffloadPolicy())
    state = fc.get_state(theirs)
    assert state is not None and state.mp_policy == fc.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert fc.get_state(offloaded).params.devices.offloaded  # type: ignore[union-attr]
    assert not fc.get_state(plain).params.devices.offloaded  # type: ignore[union-attr]
    for model in (ours, theirs, offloaded, plain):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x, y = _batch(step, 4 * ws)
            opt.zero_grad()
            nn.functional.mse_loss(model(local_batch(x, rank, ws)), local_batch(y, rank, ws)).backward()
            opt.step()
    with pytest.raises(TypeError) as info:
        fc.fully_shard(_net(), mesh=mesh, mp_policy=torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16))
    return max_param_diff(theirs, ours), max_param_diff(offloaded, plain), str(info.value)


def test_torch_policy_objects_are_accepted_and_mean_the_same(run_dist) -> None:
    for bf16_diff, offload_diff, message in run_dist(2, _policies):
        assert bf16_diff == 0.0 and offload_diff == 0.0
        # FSDP1's MixedPrecision is not a policy of either: the message names both modules' classes
        assert "fsdp_compose.MixedPrecisionPolicy" in message
        assert "torch.distributed.fsdp.MixedPrecisionPolicy" in message
        assert "torch.distributed.fsdp._fully_shard" not in message and "MixedPrecision" in message


def test_every_argument_of_torchs_fully_shard_is_accepted() -> None:
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    ours = inspect.signature(fc.fully_shard).parameters
    for name, parameter in theirs.items():
        assert name in ours, name
        assert ours[name].kind == parameter.kind, name


# ---------------------------------------------------------------------- dp_mesh_dims
def _spmd_model(mesh: Any, tp_dim: str | None) -> nn.Sequential:
    """``_net`` with every parameter a DTensor on the full ``mesh``: Replicate() on every dim, except the first
    Linear column-parallel and the second row-parallel over ``tp_dim``."""
    model = _net()
    names = mesh.mesh_dim_names
    for index, module in enumerate(model):
        for pname, param in list(module.named_parameters(recurse=False)):
            placements: list[Any] = [Replicate()] * mesh.ndim
            if tp_dim is not None and (index, pname) in ((0, "weight"), (0, "bias")):
                placements[names.index(tp_dim)] = Shard(0)
            if tp_dim is not None and (index, pname) == (2, "weight"):
                placements[names.index(tp_dim)] = Shard(1)
            setattr(module, pname, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    return model


def _spmd_loss(model: nn.Module, mesh: Any, dp_dims: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> Any:
    """A DTensor-native step: the batch is sharded over the data-parallel dims, the loss the global mean."""
    placements = [Shard(0) if n in dp_dims else Replicate() for n in mesh.mesh_dim_names]
    dx = distribute_tensor(x, mesh, placements)
    dy = distribute_tensor(y, mesh, placements)
    return ((model(dx) - dy) ** 2).mean()


def _dp_mesh_dims(rank: int, ws: int, shape: tuple[int, int], names: tuple[str, str], kw: dict[str, Any]) -> Any:
    mesh = mesh_nd(shape, names)
    dp_dims = tuple(n for value in kw.values() for n in ((value,) if isinstance(value, str) else value))
    tp = [n for n in names if n not in dp_dims]
    tp_dim = tp[0] if tp else None
    models = []
    for shard, dims in (
        (torch_fsdp.fully_shard, torch_fsdp.DataParallelMeshDims(**kw)),
        (fc.fully_shard, torch_fsdp.DataParallelMeshDims(**kw)),  # torch's DataParallelMeshDims object
        (fc.fully_shard, fc.DataParallelMeshDims(**kw)),
    ):
        models.append(_shard_blocks(_spmd_model(mesh, tp_dim), shard, mesh=mesh, dp_mesh_dims=dims))
    # The same DTensor program without FSDP. Its gradient is the global mean's; FSDP divides the reduced gradient by
    # the data-parallel size on top, so plain SGD with the learning rate divided by that size takes the same steps.
    reference = _spmd_model(mesh, tp_dim)
    dp_size = 1
    for name in dp_dims:
        dp_size *= mesh.size(names.index(name))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.2) for m in models]
    optimizers.append(torch.optim.SGD(reference.parameters(), lr=0.2 / dp_size))
    single = _net()  # and single-process training on the global batch
    single_opt = torch.optim.SGD(single.parameters(), lr=0.2 / dp_size)
    losses: list[list[float]] = [[] for _ in optimizers]
    x, y = _batch(0, 8)  # one batch: the loss must go down
    for _ in range(3):
        for model, opt, trace in zip((*models, reference), optimizers, losses, strict=True):
            opt.zero_grad()
            loss = _spmd_loss(model, mesh, dp_dims, x, y)
            loss.backward()
            opt.step()
            trace.append(loss.full_tensor().item())
        single_opt.zero_grad()
        ((single(x) - y) ** 2).mean().backward()
        single_opt.step()
    torch_model = models[0]
    placements = {n: (tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in models[1].named_parameters()} == {
        n: (tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in torch_model.named_parameters()
    }
    return (
        losses,
        max_param_diff(models[1], torch_model),
        max_param_diff(models[2], torch_model),
        max(max_param_diff(models[1], reference), max_param_diff(models[1], single)),
        placements,
    )


@pytest.mark.parametrize(
    ("shape", "names", "kw"),
    [
        ((2, 2), ("dp", "tp"), {"shard": "dp"}),  # FSDP + TP on one SPMD mesh
        ((2, 2), ("tp", "dp"), {"shard": "dp"}),  # data-parallel dim last
        ((2, 2), ("rep", "shard"), {"shard": "shard", "replicate": "rep"}),  # HSDP
        ((2, 2), ("dp", "tp"), {"replicate": "dp"}),  # pure replication (DDP) + TP
        ((4,), ("dp",), {"replicate": "dp"}),  # pure replication
        # several shard dims: sharded over their flattened group (9 rows over 4 ranks: 3, 3, 3, 0, not 3, 2, 2, 2)
        ((2, 2), ("dp0", "dp1"), {"shard": ("dp0", "dp1")}),
        ((1, 2, 2), ("rep", "dp0", "dp1"), {"shard": ("dp0", "dp1"), "replicate": "rep"}),  # and HSDP
        ((2, 1, 2), ("dp0", "dp1", "tp"), {"shard": ("dp0", "dp1")}),  # and TP after them
    ],
)
def test_dp_mesh_dims_matches_torchs_fully_shard(run_dist, shape, names, kw) -> None:
    for losses, vs_torch, vs_torch_with_ours, vs_reference, same_placements in run_dist(
        4, _dp_mesh_dims, shape, names, kw
    ):
        assert vs_torch < 1e-6 and vs_torch_with_ours < 1e-6 and vs_reference < 1e-5
        assert losses[1] == pytest.approx(losses[0], abs=1e-6)
        assert losses[0][-1] < losses[0][0]
        assert same_placements  # the sharded parameters live on the full mesh, placed as torch places them


# ---------------------------------------------------------------------- ignored_params: one model-wide set
def _ignored_model_wide(rank: int, ws: int, frozen: bool) -> dict[str, Any]:
    """The same model-wide ``ignored_params`` set passed to every ``fully_shard`` call, in both libraries: each call
    ignores the parameters of the set that are under its modules. ``frozen``: the ignored parameters do not train
    (left untouched); otherwise they train on each rank's own gradient (ignored: never reduced), in both alike."""
    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=2, n_heads=2))
    models = {"torch": copy.deepcopy(reference), "fc": copy.deepcopy(reference)}
    initial: dict[str, torch.Tensor] = {}
    for impl, model in models.items():
        shard = torch_fsdp.fully_shard if impl == "torch" else fc.fully_shard
        # in a block, in the other block's submodule, and on the root: every call gets the whole set
        ignored = {model.blocks[0].ln1.weight, model.blocks[1].mlp.fc.bias, model.pos_emb}
        names = {n for n, p in model.named_parameters() if p in ignored}
        if frozen:
            for p in ignored:
                p.requires_grad_(False)
        initial = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
        for block in model.blocks:
            shard(block, mesh=mesh_1d(ws), ignored_params=ignored)
        shard(model, mesh=mesh_1d(ws), ignored_params=ignored)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for step in range(3):
            inputs, targets = synthetic_batch(reference.cfg, 2 * ws, step=step)
            opt.zero_grad()
            loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
            opt.step()
    params = {impl: dict(m.named_parameters()) for impl, m in models.items()}
    return {
        "names": sorted(names),
        "plain": {impl: sorted(n for n, p in ps.items() if not isinstance(p, DTensor)) for impl, ps in params.items()},
        "diff": max_param_diff(models["fc"], models["torch"]),
        "untouched": max((params["fc"][n].detach() - initial[n]).abs().max().item() for n in names),
        "moved": max((params["torch"][n].detach() - initial[n]).abs().max().item() for n in names),
    }


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("ws", [2, 4])
def test_one_model_wide_ignored_params_set_is_filtered_per_call_as_torch_does(run_dist, ws: int, frozen: bool) -> None:
    for r in run_dist(ws, _ignored_model_wide, frozen):
        assert r["names"] == ["blocks.0.ln1.weight", "blocks.1.mlp.fc.bias", "pos_emb"]
        assert r["plain"]["fc"] == r["plain"]["torch"] == r["names"]  # unsharded, plain tensors, in both
        assert r["diff"] <= 1e-5  # every parameter, the ignored ones included, equal to torch's
        if frozen:
            assert r["untouched"] == 0.0 and r["moved"] == 0.0
        else:
            assert r["moved"] > 0  # trained on the rank's own (never reduced) gradient, as torch does


def _bad_dims(rank: int, ws: int) -> list[str]:
    mesh = mesh_nd((2, 2), ("dp", "tp"))
    messages = []
    cases: list[tuple[nn.Module, Any, type[Exception]]] = [
        (_net(), fc.DataParallelMeshDims(shard="dp"), ValueError),  # plain parameters
        (_spmd_model(mesh, None), fc.DataParallelMeshDims(shard="nope"), ValueError),
        (_spmd_model(mesh, "dp"), fc.DataParallelMeshDims(shard="dp"), ValueError),  # Shard on the dp dim
        (_spmd_model(mesh, None), "dp", TypeError),
    ]
    apart = mesh_nd((2, 1, 2), ("a", "t", "b"))  # several shard dims that are not neighbours in the mesh
    cases.append((_spmd_model(apart, None), fc.DataParallelMeshDims(shard=("a", "b")), NotImplementedError))
    for model, dims, exc in cases:
        before = [(n, id(p)) for n, p in model.named_parameters()]
        with pytest.raises(exc) as info:
            fc.fully_shard(model, mesh=apart if exc is NotImplementedError else mesh, dp_mesh_dims=dims)
        assert [(n, id(p)) for n, p in model.named_parameters()] == before and not fc.is_fully_sharded(model)
        messages.append(str(info.value))
    return messages


def test_bad_dp_mesh_dims_raise_before_touching_the_model(run_dist) -> None:
    plain, unknown, sharded, wrong_type, apart = run_dist(4, _bad_dims)[0]
    assert "'0.weight' is a plain tensor" in plain
    assert "'nope'" in unknown and "('dp', 'tp')" in unknown
    assert "Shard(dim=0)" in sharded and "'dp'" in sharded and "'0.weight'" in sharded
    assert "torch.distributed.fsdp.DataParallelMeshDims" in wrong_type and "str" in wrong_type
    assert "('a', 'b') must be adjacent dims" in apart


# ---------------------------------------------------------------------- FSDP2's methods, bound per instance
def test_bound_method_names_are_torchs_fsdp_module_methods() -> None:
    public = {n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_") and not hasattr(nn.Module, n)}
    assert set(fc.FSDP2_METHOD_NAMES) == public
    # plus one private method FSDP2's own tests and some trainers call
    for name in (*fc.FSDP2_METHOD_NAMES, "_set_unshard_async_op"):  # same parameters: calls bind the same way
        theirs = list(inspect.signature(getattr(torch_fsdp.FSDPModule, name)).parameters.values())[1:]
        ours = list(inspect.signature(fc.integrations.fsdp2._METHODS[name]).parameters.values())[1:]
        if [p.kind for p in ours] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
            continue  # one of the two that raise NotImplementedError whatever the arguments
        assert [(p.name, p.kind) for p in ours] == [(p.name, p.kind) for p in theirs], name


def _accumulate(model: nn.Module, rank: int, ws: int, divide_by_sum: bool) -> list[torch.Tensor]:
    """Two micro-batches, the first without gradient sync (FSDP2's method names, unguarded)."""
    for m in model.modules():
        if divide_by_sum and fc.has_fsdp2_methods(m):
            m.set_gradient_divide_factor(1.0)
    for micro in range(2):
        x, y = _batch(micro, 4 * ws)
        model.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]
        loss = nn.functional.mse_loss(model(local_batch(x, rank, ws)), local_batch(y, rank, ws), reduction="sum")
        loss.backward()
    return [full_value(p.grad).clone() for p in model.parameters()]


def _methods(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_1d(ws)
    reference = _net()
    for micro in range(2):
        x, y = _batch(micro, 4 * ws)
        nn.functional.mse_loss(reference(x), y, reduction="sum").backward()
    expected = [p.grad.clone() for p in reference.parameters()]
    bound = fc.bind_fsdp2_methods(_shard_blocks(_net(), fc.fully_shard, mesh=mesh))
    per_call = _shard_blocks(_net(), fc.fully_shard, mesh=mesh, fsdp2_methods=True)
    torch_model = _shard_blocks(_net(), torch_fsdp.fully_shard, mesh=mesh)
    results = {"averaged": _accumulate(bound, rank, ws, divide_by_sum=False)}
    results["summed"] = _accumulate(per_call, rank, ws, divide_by_sum=True)
    results["torch_averaged"] = _accumulate(torch_model, rank, ws, divide_by_sum=False)
    results["expected"] = expected
    results["flags"] = (
        fc.has_fsdp2_methods(bound[0]),
        fc.has_fsdp2_methods(torch_model[0]),
        fc.has_fsdp2_methods(_shard_blocks(_net(), fc.fully_shard, mesh=mesh)),
        fc.has_fsdp2_methods("not a module"),  # type: ignore[arg-type]
        isinstance(bound, torch_fsdp.FSDPModule),
        "set_requires_gradient_sync" in vars(type(bound)),
    )
    # Per instance: a deep copy's methods act on the copy; the original's stay on the original.
    twin = copy.deepcopy(bound)
    twin.set_requires_gradient_sync(False)  # type: ignore[operator]
    results["sync"] = (fc.get_state(bound).requires_gradient_sync, fc.get_state(twin).requires_gradient_sync)  # type: ignore[union-attr]
    # unshard / reshard / reset_iter_state through the bound names
    handle = bound[0].unshard(async_op=True)  # type: ignore[operator]
    assert isinstance(handle, fc.UnshardHandle)
    handle.wait()
    results["unsharded"] = not isinstance(bound[0].weight, DTensor)
    bound[0].reshard()  # type: ignore[operator]
    results["resharded"] = isinstance(bound[0].weight, DTensor)
    bound.reset_iter_state()  # type: ignore[operator]
    return results


def test_bound_methods_behave_as_fsdp2s(run_dist) -> None:
    for r in run_dist(2, _methods):
        ws = 2
        for ours, torchs, expected in zip(r["averaged"], r["torch_averaged"], r["expected"], strict=True):
            torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours, expected / ws, rtol=1e-5, atol=1e-6)
        for summed, expected in zip(r["summed"], r["expected"], strict=True):
            # set_gradient_divide_factor(1.0) on every unit (torchtitan's loop): the plain sum over ranks
            torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-5)
        assert r["flags"] == (True, True, False, False, False, False)
        assert r["sync"] == (True, False)
        assert r["unsharded"] and r["resharded"]


def _hsdp_methods(rank: int, ws: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    mesh = mesh_nd((2, 2), ("replicate", "shard"))
    ours = _shard_blocks(_net(), fc.fully_shard, mesh=mesh, fsdp2_methods=True)
    theirs = _shard_blocks(_net(), torch_fsdp.fully_shard, mesh=mesh)
    # FSDP2's set_requires_gradient_sync sets the all-reduce over replicas too: the synced micro-batch's
    # set_requires_gradient_sync(True) turns back on the all-reduce switched off here, in both.
    for model in (ours, theirs):
        model.set_requires_all_reduce(False)  # type: ignore[operator]
    return _accumulate(ours, rank, ws, divide_by_sum=False), _accumulate(theirs, rank, ws, divide_by_sum=False)


def test_bound_gradient_sync_switches_the_hsdp_all_reduce_too(run_dist) -> None:
    for ours, theirs in run_dist(4, _hsdp_methods):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _settings(rank: int, ws: int) -> list[str]:
    mesh = mesh_1d(ws)
    model = _shard_blocks(_net(), fc.fully_shard, mesh=mesh, fsdp2_methods=True)
    m: Any = model
    # Settings fsdp_compose always has, or that only tune buffers/streams: accepted, validated.
    m.set_is_last_backward(False)
    m.set_force_sum_reduction_for_comms(True)
    m.set_reduce_scatter_unused_params(True)
    m.set_reduce_scatter_max_input_buffers(2)
    m.set_separate_reduce_scatter_group(True)
    m.set_allocate_memory_from_process_group_for_comm(True)
    m.set_symm_mem_for_comm()
    # FSDP2's parameter names and kinds, as keywords
    m.set_is_last_backward(is_last_backward=True)
    m.set_separate_reduce_scatter_group(enable=False, recurse=False)
    m._set_unshard_async_op(async_op=False)
    m.set_reshard_after_backward(reshard_after_backward=True, recurse=False)
    m.set_requires_all_reduce(False)
    m.set_reshard_after_forward(False)
    m.set_reshard_after_backward(False)
    m.set_modules_to_forward_prefetch([model[2]])
    m.set_modules_to_backward_prefetch([model[0]])
    fc.share_comm_ctx([model, model[0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.set_unshard_in_backward(False)
        m.set_reduce_scatter_divide_factor(2.0)
    messages = [str(w.message) for w in caught]
    assert fc.get_state(model).grads.divide_factor == 2.0  # type: ignore[union-attr]
    assert fc.get_state(model[0]).grads.divide_factor is None  # type: ignore[union-attr]  # not recursive
    for name in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        with pytest.raises(NotImplementedError) as info:
            getattr(model, name)(object())
        messages.append(str(info.value))
    for call in (
        lambda: m.set_is_last_backward("yes"),
        lambda: m.set_reduce_scatter_max_input_buffers(0),
        lambda: m.set_symm_mem_for_comm("GLOO"),
        lambda: m.set_force_sum_reduction_for_comms(),
        lambda: m.set_separate_reduce_scatter_group(True, recurse="no"),
        lambda: m._set_unshard_async_op(True, True),
        lambda: fc.share_comm_ctx([nn.Linear(2, 2)]),
    ):
        with pytest.raises((TypeError, ValueError)):
            call()
    dist.barrier()
    return messages


def test_settings_without_machinery_are_validated_and_documented(run_dist) -> None:
    deprecated, all_gather, reduce_scatter = run_dist(2, _settings)[0]
    assert "set_gradient_divide_factor" in deprecated
    assert "ShardExtensions(all_gather=" in all_gather
    assert "ShardExtensions(reduce_scatter=" in reduce_scatter


def _register(rank: int, ws: int) -> tuple[bool, bool]:
    class WithGenerate(nn.Sequential):
        def generate(self, x: torch.Tensor) -> torch.Tensor:
            return self[0](x) * 2  # uses the root's own parameter outside forward

    torch.manual_seed(0)
    model = fc.fully_shard(WithGenerate(nn.Linear(4, 4)), mesh=mesh_1d(ws))
    torch_fsdp.register_fsdp_forward_method(model, "generate")  # a no-op on anything but torch's FSDPModule
    registered_by_torch = "generate" in vars(model)
    fc.register_forward_method(model, "generate")
    out = model.generate(torch.ones(1, 4))
    return registered_by_torch, isinstance(out, torch.Tensor) and not isinstance(out, DTensor)


def test_torchs_register_fsdp_forward_method_is_a_no_op_and_ours_works(run_dist) -> None:
    # Documented in docs/integrations.md: call fc.register_forward_method (torch's returns without doing anything).
    for registered_by_torch, works in run_dist(2, _register):
        assert not registered_by_torch and works


class _Embedded(nn.Module):
    """OLMo-core's layout: an embedding unit whose backward reads no weight, blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _unshard_in_backward(rank: int, ws: int, impl: str, needs_params: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _Embedded()
    model = copy.deepcopy(reference)
    mesh = mesh_1d(ws)
    shard = torch_fsdp.fully_shard if impl == "torch" else lambda m, **kw: fc.fully_shard(m, fsdp2_methods=True, **kw)
    for module in (model.embed, *model.blocks):
        shard(module, mesh=mesh)
    shard(model, mesh=mesh)
    # A block's backward does read its weight: the setting is then wrong, and the backward must fail, not read garbage.
    (model.blocks[0] if needs_params else model.embed).set_unshard_in_backward(False)  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gathers = []
    for step in range(3):
        ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
        loss_fn(reference(ids), ids).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(model(local_batch(ids, rank, ws)), local_batch(ids, rank, ws))
        with fc.CollectiveRecorder() as recorder:
            try:
                loss.backward()
            except RuntimeError as error:
                return {"error": str(error)}
        gathers.append(recorder.counts()["all_gather"])
        opt.step()
        opt.zero_grad()
    return {"gathers": gathers, "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [2, 4])
def test_unshard_in_backward_false_skips_the_all_gather_like_torch(run_dist, ws: int) -> None:
    ours, theirs = run_dist(ws, _unshard_in_backward, "fc", False), run_dist(ws, _unshard_in_backward, "torch", False)
    for mine, torch_result in zip(ours, theirs, strict=True):
        assert mine["gathers"] == torch_result["gathers"] == [2] * 3, (mine, torch_result)  # the blocks only
        assert mine["diff"] <= 1e-5 and torch_result["diff"] <= 1e-5, (mine, torch_result)


def test_unshard_in_backward_false_on_a_unit_that_needs_its_parameters_names_it(run_dist) -> None:
    for result in run_dist(2, _unshard_in_backward, "fc", True):
        assert "set_unshard_in_backward(False) on Sequential" in result["error"], result
        assert "'0.weight'" in result["error"] and "AddmmBackward" in result["error"], result
