"""Bad input: a clear error that names the module/parameter and the fix, before any collective, model untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig
from tests.dist_utils import mesh_1d, mesh_nd


def _snapshot(model: nn.Module) -> list[tuple[str, int, type]]:
    return [(n, id(p), type(p)) for n, p in model.named_parameters()]


def _assert_untouched(model: nn.Module, before: list[tuple[str, int, type]]) -> None:
    assert _snapshot(model) == before
    assert not any(fc.is_fully_sharded(m) for m in model.modules())


def _expect(exc: type[Exception], match: str, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _errors_at_shard_time(rank: int, ws: int) -> None:
    mesh = mesh_1d(ws)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = _snapshot(model)

    _expect(TypeError, "DeviceMesh", fc.fully_shard, model, mesh="not a mesh")
    _assert_untouched(model, before)
    unnamed_2d = mesh_nd((1, ws), None)
    _expect(ValueError, "needs mesh_dim_names, \\(replicate, shard\\)", fc.fully_shard, model, mesh=unnamed_2d)
    swapped = mesh_nd((ws, 1), ("shard", "replicate"))
    _expect(ValueError, "look swapped: an HSDP mesh is \\(replicate, shard\\)", fc.fully_shard, model, mesh=swapped)
    mesh_3d = mesh_nd((1, 1, ws), ("a", "b", "c"))
    whole_dp_tp = mesh_nd((ws, 1), ("dp", "tp"))
    _expect(
        ValueError,
        "look like a data-parallel x model-parallel mesh.*mesh\\['dp'\\]",
        fc.fully_shard,
        model,
        mesh=whole_dp_tp,
    )
    _expect(ValueError, "1-D \\(shard\\) or 2-D \\(replicate, shard\\)", fc.fully_shard, model, mesh=mesh_3d)
    _assert_untouched(model, before)
    _expect(TypeError, "nn.Module", fc.fully_shard, [model, "x"], mesh=mesh)
    _expect(TypeError, "MixedPrecisionPolicy", fc.fully_shard, model, mesh=mesh, mp_policy=torch.bfloat16)
    _expect(ValueError, "frozen_params", fc.fully_shard, model, mesh=mesh, frozen_params="freeze")
    # an int reshard_after_forward must divide the shard group's size
    _expect(
        ValueError,
        rf"reshard_after_forward={ws + 1} for Sequential.*divide.*size {ws}",
        fc.fully_shard,
        model,
        mesh=mesh,
        reshard_after_forward=ws + 1,
    )
    _expect(
        TypeError, "reshard_after_forward for Sequential", fc.fully_shard, model, mesh=mesh, reshard_after_forward="yes"
    )
    _expect(TypeError, "floating-point torch.dtype", fc.MixedPrecisionPolicy, param_dtype=torch.int8)
    _assert_untouched(model, before)

    # parameters on different devices (one left on meta)
    with torch.device("meta"):
        model[1].weight = nn.Parameter(torch.empty(2, 4))
    before = _snapshot(model)
    _expect(ValueError, r"different devices.*'1.weight' on meta", fc.fully_shard, model, mesh=mesh)
    _assert_untouched(model, before)

    # different dtypes inside one unit are sharded (one flat buffer per dtype), but not with an all-gather extension
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).double())
    before = _snapshot(mixed)
    int8 = fc.ShardExtensions(all_gather=fc.Int8AllGather())
    _expect(
        NotImplementedError,
        r"all_gather extension with parameters of several dtypes \(torch.float32, torch.float64\)",
        fc.fully_shard,
        mixed,
        mesh=mesh,
        extensions=int8,
    )
    _assert_untouched(mixed, before)

    # an integer parameter cannot be sharded; ignoring it works
    counted = nn.Linear(4, 4)
    counted.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    before = _snapshot(counted)
    _expect(TypeError, "'steps'.*ignored_params", fc.fully_shard, counted, mesh=mesh)
    _assert_untouched(counted, before)
    fc.fully_shard(counted, mesh=mesh, ignored_params={counted.steps})
    assert not isinstance(counted.steps, DTensor)

    # a tensor-parallel parameter on a mesh over the data-parallel mesh's own ranks (another init_device_mesh): the
    # ranks do not compose; at one rank they do (both meshes are that rank)
    other_root = mesh_nd((1, ws), ("dp_other", "tp_other"))
    named = mesh_nd((ws,), ("dp",))
    tp_like = nn.Linear(4, 4)
    tp_like.weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), other_root["tp_other"], [Shard(0)]))
    before = _snapshot(tp_like)
    if ws > 1:
        _expect(
            ValueError,
            "'weight' of Linear is a DTensor on a mesh .* whose ranks do not compose",
            fc.fully_shard,
            tp_like,
            mesh=named,
        )
        _assert_untouched(tp_like, before)
    else:
        fc.fully_shard(tp_like, mesh=named)
        assert tp_like.weight.device_mesh.mesh_dim_names == ("dp", "tp_other")


def _errors_from_nesting(rank: int, ws: int) -> None:
    mesh = mesh_1d(ws)
    model = GPT(GPTConfig())
    fc.fully_shard(model.blocks[0], mesh=mesh)
    _expect(ValueError, "already called on this Block", fc.fully_shard, model.blocks[0], mesh=mesh)
    _expect(ValueError, "same module twice", fc.fully_shard, [model.blocks[1], model.blocks[1]], mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    # a child sharded after its parent: a clear error, the child keeps the parent's parameters
    params_before = [id(p) for p in model.blocks[1].parameters()]
    _expect(
        ValueError,
        r"'ln1.weight' is already sharded by the fully_shard call on GPT.*bottom-up",
        fc.fully_shard,
        model.blocks[1],
        mesh=mesh,
    )
    assert not fc.is_fully_sharded(model.blocks[1])
    assert [id(p) for p in model.blocks[1].parameters()] == params_before


def _errors_from_ties(rank: int, ws: int) -> None:
    mesh = mesh_1d(ws)
    model = GPT(GPTConfig())
    model.head.weight = model.tok_emb.weight  # tied in one unit: fine
    fc.fully_shard(model, mesh=mesh)
    assert model.head.weight is model.tok_emb.weight

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    tied = Tied()
    fc.fully_shard(tied.emb, mesh=mesh)
    # a sibling tie: head is not inside emb, so head cannot take the shared parameter
    before = [(n, id(p)) for n, p in tied.head.named_parameters()]
    _expect(
        ValueError,
        r"'weight' of Linear is tied to a parameter that fully_shard on Embedding already sharded, and Embedding "
        r"is not inside Linear",
        fc.fully_shard,
        tied.head,
        mesh=mesh,
    )
    assert [(n, id(p)) for n, p in tied.head.named_parameters()] == before and not fc.is_fully_sharded(tied.head)
    # the common parent lifts it out of the embedding's unit into its own
    fc.fully_shard(tied, mesh=mesh)
    assert tied.head.weight is tied.emb.weight and isinstance(tied.emb.weight, DTensor)
    assert [mp.fqn for mp in fc.get_state(tied).params.shards.params] == ["head.weight"]
    assert fc.get_state(tied.emb).params.shards.params == []


def _meta_params_at_first_forward(rank: int, ws: int) -> str:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fc.fully_shard(model[0], mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws))
    with pytest.raises(
        RuntimeError, match=r"'1.weight' of the unit rooted at Sequential is still on the meta device.*to_empty"
    ) as info:
        model(torch.randn(2, 4))
    assert all(p.is_meta for p in model.parameters())
    return str(info.value)


def _functions_need_a_sharded_module(rank: int, ws: int) -> None:
    plain = nn.Linear(2, 2)
    _expect(ValueError, "not sharded; call fc.fully_shard", fc.unshard, plain)
    _expect(ValueError, "no module under this Linear is sharded", fc.set_requires_gradient_sync, plain, False)
    sharded = fc.fully_shard(nn.Linear(2, 2), mesh=mesh_1d(ws))
    _expect(ValueError, "no method 'generate'", fc.register_forward_method, sharded, "generate")
    _expect(ValueError, "positive", fc.set_gradient_divide_factor, sharded, 0.0)


@pytest.mark.parametrize("ws", [1, 2])
def test_errors_at_shard_time(run_dist, ws: int) -> None:
    run_dist(ws, _errors_at_shard_time)


@pytest.mark.parametrize("ws", [1, 2])
def test_errors_from_nesting_and_ties(run_dist, ws: int) -> None:
    run_dist(ws, _errors_from_nesting)
    run_dist(ws, _errors_from_ties)


@pytest.mark.parametrize("ws", [2, 4])
def test_meta_parameters_at_first_forward_fail_on_every_rank_before_a_collective(run_dist, ws: int) -> None:
    """Every rank raises the same error (none is left waiting in a collective: the pool would time out)."""
    messages = run_dist(ws, _meta_params_at_first_forward)
    assert len(set(messages)) == 1


@pytest.mark.parametrize("ws", [1])
def test_functions_need_a_sharded_module(run_dist, ws: int) -> None:
    run_dist(ws, _functions_need_a_sharded_module)


class _WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head, self.spare = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


def _forward_inside_backward(rank: int, ws: int) -> dict[str, object]:
    """A unit whose forward first runs inside the backward (from a tensor hook): the backward's agreed program has
    no place for its gather, so every rank raises the same error naming it; fc.reset_step recovers and the next
    steps train like the unsharded model."""
    mesh = mesh_1d(ws)
    torch.manual_seed(0)
    model = _WithSpare()
    reference = copy.deepcopy(model)
    for unit in (model.a, model.b, model.spare, model):
        fc.fully_shard(unit, mesh=mesh)
    x = torch.randn(2 * ws, 4, generator=torch.Generator().manual_seed(1))
    local = x.chunk(ws)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        (model(local).sum() * ws).backward()
        opt.step()
        ref_opt.zero_grad()
        reference(x).sum().backward()
        ref_opt.step()

    step()

    # b's output gets its gradient once the backward's walk has begun: spare's forward runs inside it
    def run_spare(grad: torch.Tensor) -> torch.Tensor:
        model.spare(torch.ones(1, 4))
        return grad

    def hook_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(run_spare)

    late = model.b.register_forward_hook(hook_output)
    message = ""
    try:
        model(local).sum().backward()
    except RuntimeError as error:
        message = str(error)
    late.remove()
    fc.reset_step(model)
    step()
    step()
    diff = max(
        float((p.full_tensor() - r).abs().max())  # type: ignore[attr-defined]
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return {"message": message, "diff": diff}


@pytest.mark.parametrize("ws", [1, 2])
def test_a_unit_first_run_inside_a_backward_is_an_error_naming_it(run_dist, ws: int) -> None:
    for result in run_dist(ws, _forward_inside_backward):
        assert "unit Linear needs its parameters by a backward no forward entry of it announced" in result["message"]
        assert result["diff"] < 1e-5
