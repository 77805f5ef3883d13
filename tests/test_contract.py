"""The API contract: class kept, DTensor placements, torch.chunk shards, views into one flat buffer, deepcopy,
state dicts, no_grad forwards, list form, ignored / 0-dim / unused parameters, parameter-less modules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_compose as fc
from examples.gpt_model import GPT, Block, GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.unit import UnitState
from tests.dist_utils import full_value, local_batch, max_param_diff, mesh_1d, reference_and_copy, shard_gpt, train_pair


def _placements_and_shards(rank: int, ws: int) -> None:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    mesh = mesh_1d(ws)
    shard_gpt(model, mesh)
    assert type(model) is GPT and model.__class__ is GPT and isinstance(model, nn.Module)
    assert all(type(b) is Block for b in model.blocks)
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, nn.Parameter) and isinstance(param, DTensor), name
        assert param.placements == (Shard(0),), name
        assert param.device_mesh is mesh
        expected_chunks = torch.chunk(ref[name].detach(), ws)
        expected = expected_chunks[rank] if rank < len(expected_chunks) else ref[name].detach()[:0]
        assert torch.equal(param.to_local(), expected), name
    # one flat buffer per unit: every local shard of a block is a view into that block's buffer
    for block in model.blocks:
        unit = fc.get_state(block).params
        base = unit.shards.flat.untyped_storage().data_ptr()
        for param in block.parameters():
            assert param.to_local().untyped_storage().data_ptr() == base
    # the root's unit excludes the blocks' parameters
    root_names = {mp.fqn for mp in fc.get_state(model).params.shards.params}
    assert root_names == {"tok_emb.weight", "pos_emb", "ln_f.weight", "ln_f.bias", "head.weight"}


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_placements_shards_and_class(run_dist, ws: int) -> None:
    run_dist(ws, _placements_and_shards)


def _sharded_between_steps(rank: int, ws: int) -> None:
    cfg = GPTConfig()
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    inputs, targets = synthetic_batch(cfg, 4, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    loss_fn(model(x), y).backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert all(isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),) for p in model.parameters())
    with torch.no_grad():
        model(x)
    # torch FSDP2 leaves the root unsharded after a no_grad forward; here every unit is resharded
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert all(fc.get_state(m).params.state is not UnitState.UNSHARDED for m in [model, *model.blocks])


@pytest.mark.parametrize("ws", [1, 2])
def test_sharded_between_steps_and_after_no_grad_forward(run_dist, ws: int) -> None:
    run_dist(ws, _sharded_between_steps)


def _deepcopy_independent(rank: int, ws: int) -> tuple[float, float, float]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    teacher = copy.deepcopy(model)
    assert type(teacher) is GPT and fc.is_fully_sharded(teacher) and fc.is_fully_sharded(teacher.blocks[0])
    assert fc.get_state(teacher) is not fc.get_state(model)
    assert fc.get_state(teacher.blocks[0]).modules[0] is teacher.blocks[0]
    for p, q in zip(model.parameters(), teacher.parameters(), strict=True):
        assert p is not q and torch.equal(p.to_local(), q.to_local())
    frozen_reference = copy.deepcopy(reference)
    teacher_reference = copy.deepcopy(reference)
    # train only the copy: the original must not move, the copy must match its own reference
    copy_diff = train_pair(rank, ws, teacher, teacher_reference, cfg, steps=2)
    original_untouched = max_param_diff(model, frozen_reference)
    # and then the original trains on its own, unaffected by the copy's hooks
    original_diff = train_pair(rank, ws, model, reference, cfg, steps=2)
    return copy_diff, original_untouched, original_diff


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_deepcopy_gives_independent_sharded_module(run_dist, ws: int) -> None:
    """An EMA-teacher style copy: independent state, trains on its own (torch FSDP2 raises on deepcopy)."""
    for copy_diff, original_untouched, original_diff in run_dist(ws, _deepcopy_independent):
        assert copy_diff <= 1e-5
        assert original_untouched == 0.0
        assert original_diff <= 1e-5


def _state_dict_round_trip(rank: int, ws: int) -> None:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    sd = model.state_dict()
    assert sd.keys() == reference.state_dict().keys()
    assert all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in sd.values())
    saved = {k: v.detach().clone() for k, v in sd.items()}
    train_pair(rank, ws, model, reference, cfg, steps=1)
    assert any(not torch.equal(full_value(saved[k]), full_value(v)) for k, v in model.state_dict().items())
    model.load_state_dict(saved)
    for k, v in model.state_dict().items():
        assert torch.equal(v.to_local(), saved[k].to_local()), k
    # loading writes into the flat buffers (the parameters stay views), so the next forward uses the loaded values
    unit = fc.get_state(model.blocks[0]).params
    assert unit.shards.views_intact()


@pytest.mark.parametrize("ws", [1, 2])
def test_state_dict_gives_dtensors_and_loads_them(run_dist, ws: int) -> None:
    run_dist(ws, _state_dict_round_trip)


class TwoTower(nn.Module):
    """Blocks sharing one unit (list form), a parameter-less unit, a 0-dim parameter, an ignored and an unused one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.act = nn.Tanh()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.unused = nn.Linear(3, 3)
        self.side = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x))) * self.temperature + self.side(x)


def _special_params(rank: int, ws: int) -> tuple[float, bool]:
    torch.manual_seed(1)
    reference = TwoTower()
    model = copy.deepcopy(reference)
    mesh = mesh_1d(ws)
    fc.fully_shard([model.a, model.b], mesh=mesh)
    fc.fully_shard(model.act, mesh=mesh)
    fc.fully_shard(model, mesh=mesh, ignored_params={model.side.weight, model.side.bias})
    assert fc.get_state(model.a) is fc.get_state(model.b)
    assert isinstance(model.temperature, DTensor) and model.temperature.placements == (Replicate(),)
    assert not isinstance(model.side.weight, DTensor)
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("side")], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(
        [p for n, p in reference.named_parameters() if not n.startswith("side")], lr=0.1, momentum=0.9
    )
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 7, generator=gen)
        target = torch.randn(8, 3, generator=gen)
        ref_opt.zero_grad()
        ((reference(x) - target) ** 2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        xs, ts = local_batch(x, rank, ws), local_batch(target, rank, ws)
        ((model(xs) - ts) ** 2).mean().backward()
        opt.step()
    # the ignored parameter got only this rank's local gradient (never reduced)
    local_grad = model.side.weight.grad
    ok_ignored = local_grad is not None and not isinstance(local_grad, DTensor)
    assert model.unused.weight.grad is None and reference.unused.weight.grad is None
    diff = max(
        (full_value(p.detach()) - dict(reference.named_parameters())[n].detach()).abs().max().item()
        for n, p in model.named_parameters()
        if not n.startswith("side")
    )
    return diff, ok_ignored


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_list_form_param_less_scalar_ignored_and_unused_params(run_dist, ws: int) -> None:
    for diff, ok_ignored in run_dist(ws, _special_params):
        assert diff <= 1e-5
        assert ok_ignored
