"""Bad input to fully_shard and the fc.set_* functions, one test per case at 2 and 4 ranks.

Each case checks, on every rank: the error type and text, that every rank got the same error (a rank left in a
collective would time the pool out), that every parameter (object, type, values, gradient), buffer and optimizer
state is bit-identical afterwards, and that training then goes on exactly like a single-process reference.
The helpers at the top are shared with test_state_dict.py.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig
from tests.dist_utils import make_optimizer, max_param_diff, mesh_1d, shard_gpt, train_steps

WORLD_SIZES = [2, 4]


# ---------------------------------------------------------------------------------------------- shared helpers
def gpt_with_buffers(seed: int = 0) -> GPT:
    """The test GPT plus a float and an integer buffer (GPT has none), so that buffers are covered too."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    model.ln_f.register_buffer("running", torch.randn(18))
    model.register_buffer("seen", torch.tensor(3, dtype=torch.int64))
    return model


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().reshape(-1).view(torch.uint8).clone()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> list[tuple[Any, ...]]:
    """Everything a failed call must leave alone, as comparable rows (tensors as their raw bytes)."""
    rows: list[tuple[Any, ...]] = []
    for name, p in model.named_parameters():
        grad = None if p.grad is None else _bits(p.grad)
        rows.append(("param", name, id(p), type(p), p.dtype, p.requires_grad, _bits(p), grad))
    for name, b in model.named_buffers():
        rows.append(("buffer", name, b.dtype, _bits(b)))
    rows.extend(("sharded", name, fc.is_fully_sharded(m)) for name, m in model.named_modules())
    if opt is not None:
        for group_index, group in enumerate(opt.param_groups):
            for p in group["params"]:
                for key, value in sorted(opt.state.get(p, {}).items()):
                    stored = _bits(value) if isinstance(value, torch.Tensor) else value
                    rows.append(("optim", group_index, id(p), key, stored))
    return rows


def assert_unchanged(before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]) -> None:
    assert len(before) == len(after), "entries were added or removed"
    for old, new in zip(before, after, strict=True):
        assert len(old) == len(new) and old[:2] == new[:2], (old[:2], new[:2])
        for a, b in zip(old, new, strict=True):
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
            assert same, f"{old[0]} {old[1]} changed"


def trained_pair(ws: int) -> tuple[GPT, torch.optim.Optimizer, GPT, torch.optim.Optimizer]:
    """A sharded GPT and its reference after one SGD-with-momentum step (so the optimizers hold state)."""
    model = gpt_with_buffers()
    reference = copy.deepcopy(model)
    shard_gpt(model, mesh_1d(ws))
    opt, ref_opt = make_optimizer("sgd")(model.parameters()), make_optimizer("sgd")(reference.parameters())
    assert train_steps(model, opt, reference, ref_opt, mesh_1d(ws), range(1)) <= 1e-5
    return model, opt, reference, ref_opt


# ---------------------------------------------------------------------------------------------- fully_shard
# Meshes built once per worker process (a mesh over a subset of ranks creates process groups on every rank).
_FIRST_HALF: dict[int, DeviceMesh] = {}


def _first_half(ws: int) -> DeviceMesh:
    if ws not in _FIRST_HALF:
        _FIRST_HALF[ws] = DeviceMesh("cpu", list(range(ws // 2)))
    return _FIRST_HALF[ws]


def _shard(model: GPT, ws: int, **kwargs: Any) -> None:
    fc.fully_shard(model, mesh=mesh_1d(ws), **kwargs)


# case -> (error type, message pattern, the bad call); ``None`` for a rank on which the call is fine
ShardCase = Callable[[GPT, int, int], "tuple[type[Exception], str, Callable[[], object]] | None"]
SHARD_CASES: dict[str, ShardCase] = {
    "ignored_params_detached": lambda m, rank, ws: (
        TypeError,
        r"ignored_params of fully_shard on GPT: entry 0 is a Tensor of shape \(97, 18\).* not an nn.Parameter "
        r"\(it shares memory with parameter 'head.weight'",
        lambda: _shard(m, ws, ignored_params={m.head.weight.detach()}),
    ),
    "ignored_params_bare_data": lambda m, rank, ws: (
        TypeError,
        r"ignored_params of fully_shard on GPT got a Tensor of shape \(13, 18\).* not an nn.Parameter \(it shares "
        r"memory with parameter 'pos_emb'",
        lambda: _shard(m, ws, ignored_params=m.pos_emb.data),
    ),
    "ignored_params_same_memory_as_a_parameter": lambda m, rank, ws: (
        ValueError,
        r"entry 1 \(Parameter of shape \(97, 18\) and dtype torch.float32\) is not a parameter of GPT but the same "
        r"memory as its parameter 'head.weight' \(an nn.Parameter made from its .data\?\)",
        lambda: _shard(m, ws, ignored_params=[m.pos_emb, nn.Parameter(m.head.weight.data)]),
    ),
    "ignored_params_names": lambda m, rank, ws: (
        TypeError,
        r"ignored_params of fully_shard on GPT must be an nn.Parameter or an iterable of them.*got str",
        lambda: _shard(m, ws, ignored_params="head.weight"),
    ),
    "mesh_without_this_rank": lambda m, rank, ws: _outside_first_half(m, rank, ws),
    "meta_mesh": lambda m, rank, ws: (
        ValueError,
        r"fully_shard on GPT got a 'meta' mesh; .*torch.device\('meta'\)",
        lambda: _shard_on(m, DeviceMesh("meta", list(range(ws)), _init_backend=False)),
    ),
    "mesh_without_process_groups": lambda m, rank, ws: (
        ValueError,
        r"fully_shard on GPT got a mesh without process groups",
        lambda: _shard_on(m, DeviceMesh("cpu", list(range(ws)), _init_backend=False)),
    ),
    "shard_placement_fn_not_callable": lambda m, rank, ws: (
        TypeError,
        r"shard_placement_fn of fully_shard on GPT must be a function",
        lambda: _shard(m, ws, shard_placement_fn=0),
    ),
    "shard_placement_fn_dim_out_of_range": lambda m, rank, ws: (
        ValueError,
        r"shard_placement_fn returned Shard\(dim=-3\) for 'pos_emb' of GPT, a parameter of shape \(13, 18\); return "
        r"Shard\(dim\) with -2 <= dim < 2",
        lambda: _shard(m, ws, shard_placement_fn=lambda p: Shard(-3)),
    ),
    "shard_placement_fn_not_a_shard": lambda m, rank, ws: (
        TypeError,
        r"shard_placement_fn returned Replicate\(\) for 'blocks.0.attn.qkv.weight' of GPT; it must return Shard\(dim\)",
        lambda: _shard(m, ws, shard_placement_fn=lambda p: Replicate() if p.shape == (54, 18) else None),
    ),
    "shard_placement_fn_mesh_info_without_a_mesh": lambda m, rank, ws: (
        TypeError,
        r"shard_placement_fn returned a ShardPlacementResult for 'head.weight' of GPT whose mesh_info has no "
        r"DeviceMesh \(got NoneType\)",
        lambda: _shard(
            m, ws, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), None) if p is m.head.weight else None
        ),
    ),
    "auto_refresh_trainable_not_bool": lambda m, rank, ws: (
        TypeError,
        r"auto_refresh_trainable of fully_shard on GPT must be True or False, got 'yes'",
        lambda: _shard(m, ws, auto_refresh_trainable="yes"),
    ),
}


def _outside_first_half(model: GPT, rank: int, ws: int) -> tuple[type[Exception], str, Callable[[], object]] | None:
    half = _first_half(ws)  # on every rank: creating its process group is collective over the default group
    if rank < ws // 2:
        return None
    return (
        ValueError,
        rf"fully_shard on GPT: this rank \({rank}\) is not part of the mesh \(ranks "
        + re.escape(str(list(range(ws // 2)))),
        lambda: fc.fully_shard(model, mesh=half),
    )


def _shard_on(model: GPT, mesh: DeviceMesh) -> None:
    fc.fully_shard(model, mesh=mesh)


def _rejected_at_shard_time(rank: int, ws: int, case: str) -> str | None:
    model = gpt_with_buffers()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    bad = SHARD_CASES[case](model, rank, ws)
    message = None
    if bad is not None:
        kind, pattern, call = bad
        with pytest.raises(kind, match=pattern) as info:
            call()
        message = str(info.value)
    assert_unchanged(before, snapshot(model))
    shard_gpt(model, mesh_1d(ws))
    opt, ref_opt = make_optimizer("sgd")(model.parameters()), make_optimizer("sgd")(reference.parameters())
    assert train_steps(model, opt, reference, ref_opt, mesh_1d(ws), range(2)) <= 1e-5
    return message


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(SHARD_CASES))
def test_fully_shard_rejects_bad_input_on_every_rank(run_dist, ws: int, case: str) -> None:
    messages = run_dist(ws, _rejected_at_shard_time, case)
    raised = [m for m in messages if m is not None]
    if case == "mesh_without_this_rank":  # only the ranks outside the mesh call with it; each names its rank
        assert len(raised) == ws // 2 and messages[: ws // 2] == [None] * (ws // 2)
    else:
        assert len(raised) == ws and len(set(raised)) == 1


class _Tempered(nn.Module):
    """A linear layer scaled by a 0-dim fp64 temperature (adversarial repro 04)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.t = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.t.to(x.dtype)


def _zero_dim_other_dtype(rank: int, ws: int) -> str:
    torch.manual_seed(0)
    model = _Tempered()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"parameter 't' of _Tempered is a 0-dim torch.float64 parameter in a unit of torch.float32 "
        r"parameters.*Cast it to torch.float32, move it into a submodule.*or pass it in ignored_params",
    ) as info:
        fc.fully_shard(model, mesh=mesh_1d(ws))
    assert_unchanged(before, snapshot(model))
    # the fix the message names: cast it (on the reference too), then it shards and trains like the reference
    for m in (model, reference):
        m.t = nn.Parameter(m.t.detach().float())
    fc.fully_shard(model, mesh=mesh_1d(ws))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for m, o, batch in ((model, opt, x.chunk(ws)[rank]), (reference, ref_opt, x)):
            o.zero_grad()
            m(batch).square().mean().backward()
            o.step()
    assert max_param_diff(model, reference) <= 1e-6
    return str(info.value)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_zero_dim_parameter_of_another_dtype_is_rejected_at_fully_shard(run_dist, ws: int) -> None:
    assert len(set(run_dist(ws, _zero_dim_other_dtype))) == 1


def _ignored_bare_parameter(rank: int, ws: int) -> bool:
    """A bare nn.Parameter (no set around it) is ignored: left a plain parameter, never communicated."""
    model = gpt_with_buffers()
    model.pos_emb.requires_grad_(False)  # ignored parameters are not reduced: keep it out of training
    reference = copy.deepcopy(model)
    pos_emb = model.pos_emb
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws), ignored_params=model.pos_emb)
    assert model.pos_emb is pos_emb and not isinstance(model.pos_emb, DTensor)
    assert isinstance(model.head.weight, DTensor)
    opt, ref_opt = make_optimizer("sgd")(model.parameters()), make_optimizer("sgd")(reference.parameters())
    assert train_steps(model, opt, reference, ref_opt, mesh_1d(ws), range(2)) <= 1e-5
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_ignored_params_takes_a_bare_parameter(run_dist, ws: int) -> None:
    assert all(run_dist(ws, _ignored_bare_parameter))


# ---------------------------------------------------------------------------------------------- fc.set_* etc.
# case -> (error type, message pattern, the bad call on the sharded model)
SetterCase = tuple[type[Exception], str, Callable[[GPT], object]]
SETTER_CASES: dict[str, SetterCase] = {
    "divide_factor_str": (
        TypeError,
        r"fc.set_gradient_divide_factor: factor must be a real number \(e.g. 2.0\), got '2' \(str\)",
        lambda m: fc.set_gradient_divide_factor(m, "2"),  # type: ignore[arg-type]
    ),
    "divide_factor_bool": (
        TypeError,
        r"factor must be a real number.*got True",
        lambda m: fc.set_gradient_divide_factor(m, True),
    ),
    "divide_factor_nan": (
        ValueError,
        r"divide factor must be positive and finite, got nan",
        lambda m: fc.set_gradient_divide_factor(m, float("nan")),
    ),
    "divide_factor_negative": (
        ValueError,
        r"divide factor must be positive and finite, got -2",
        lambda m: fc.set_gradient_divide_factor(m, -2),
    ),
    "requires_gradient_sync_str": (
        TypeError,
        r"fc.set_requires_gradient_sync: requires_sync must be True or False, got 'no'",
        lambda m: fc.set_requires_gradient_sync(m, "no"),  # type: ignore[arg-type]
    ),
    "requires_gradient_sync_recurse_str": (
        TypeError,
        r"fc.set_requires_gradient_sync: recurse must be True or False, got 'no'",
        lambda m: fc.set_requires_gradient_sync(m, False, recurse="no"),  # type: ignore[arg-type]
    ),
    "reshard_after_backward_str": (
        TypeError,
        r"fc.set_reshard_after_backward: value must be True or False, got 'no'",
        lambda m: fc.set_reshard_after_backward(m, "no"),  # type: ignore[arg-type]
    ),
    "reshard_after_forward_str": (
        TypeError,
        r"reshard_after_forward for GPT must be None, a bool or an int, got 'no'",
        lambda m: fc.set_reshard_after_forward(m, "no"),  # type: ignore[arg-type]
    ),
    "requires_all_reduce_int": (
        TypeError,
        r"fc.set_requires_all_reduce: requires_all_reduce must be True or False, got 0",
        lambda m: fc.set_requires_all_reduce(m, 0),  # type: ignore[arg-type]
    ),
    "full_precision_in_eval_str": (
        TypeError,
        r"fc.set_full_precision_in_eval: enabled must be True or False, got 'no'",
        lambda m: fc.set_full_precision_in_eval(m, "no"),  # type: ignore[arg-type]
    ),
    "unshard_async_op_str": (
        TypeError,
        r"fc.unshard: async_op must be True or False, got 'no'",
        lambda m: fc.unshard(m, async_op="no"),  # type: ignore[arg-type]
    ),
    "gradient_accumulation_mode": (
        ValueError,
        r'gradient accumulation mode must be "unsharded" or "sharded", got \'zero2\'',
        lambda m: fc.set_gradient_accumulation(m, "zero2"),  # type: ignore[arg-type]
    ),
    "forward_prefetch_single_module": (
        TypeError,
        r"fc.set_modules_to_forward_prefetch takes a list of sharded modules, got Block; wrap a single module",
        lambda m: fc.set_modules_to_forward_prefetch(m.blocks[0], m.blocks[1]),  # type: ignore[arg-type]
    ),
    "backward_prefetch_not_modules": (
        TypeError,
        r"fc.set_modules_to_backward_prefetch: entry 0 of modules is a int, not an nn.Module",
        lambda m: fc.set_modules_to_backward_prefetch(m.blocks[1], [1]),  # type: ignore[list-item]
    ),
    "optimizer_in_backward_not_callable": (
        TypeError,
        r"fc.set_optimizer_in_backward: optimizer must build an optimizer from a list of parameters.*got str",
        lambda m: fc.set_optimizer_in_backward(m, "adamw"),  # type: ignore[arg-type]
    ),
    "register_forward_method_name": (
        TypeError,
        r"fc.register_forward_method: name must be a method name \(str\), got int",
        lambda m: fc.register_forward_method(m, 3),  # type: ignore[arg-type]
    ),
    "not_a_module": (
        TypeError,
        r"fc.set_requires_gradient_sync takes a sharded nn.Module, got str",
        lambda m: fc.set_requires_gradient_sync("model", False),  # type: ignore[arg-type]
    ),
}


def _rejected_setter(rank: int, ws: int, case: str) -> str:
    model, opt, reference, ref_opt = trained_pair(ws)
    kind, pattern, call = SETTER_CASES[case]
    before = snapshot(model, opt)
    with pytest.raises(kind, match=pattern) as info:
        call(model)
    assert_unchanged(before, snapshot(model, opt))
    # nothing changed: the next steps still match the reference (a divide factor or no-sync would not)
    assert train_steps(model, opt, reference, ref_opt, mesh_1d(ws), range(1, 3)) <= 1e-5
    return str(info.value)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(SETTER_CASES))
def test_functions_on_a_sharded_module_reject_bad_arguments(run_dist, ws: int, case: str) -> None:
    assert len(set(run_dist(ws, _rejected_setter, case))) == 1
