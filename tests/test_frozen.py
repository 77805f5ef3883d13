"""Frozen parameters and trainability changes, frozen_params="replicate", ties across units, unused branches."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, make_optimizer, max_param_diff, mesh_1d, reference_and_copy, shard_gpt

Schedule = Callable[[int, nn.Module], None]


def _freeze_blocks(model: GPT, indices: list[int], frozen: bool = True) -> None:
    for i in indices:
        model.blocks[i].requires_grad_(not frozen)


class _CollectiveLog:
    """Element counts of the process's all-gathers (output) and reduce-scatters (input) through ``torch.distributed``
    (``fc.CollectiveRecorder``; DTensor's functional collectives, e.g. ``full_tensor()`` in the checks, left out)."""

    def __enter__(self) -> _CollectiveLog:
        self._recorder = fc.CollectiveRecorder().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._recorder.__exit__(*exc)

    def _numels(self, kind: str) -> list[int]:
        return [r.numel for r in self._recorder.records if r.kind == kind and not r.functional]

    @property
    def gathered(self) -> list[int]:
        return self._numels("all_gather")

    @property
    def reduced(self) -> list[int]:
        return self._numels("reduce_scatter")


def _train_with_schedule(
    rank: int,
    ws: int,
    model: nn.Module,
    reference: nn.Module,
    cfg: GPTConfig,
    schedule: Schedule,
    *,
    steps: int = 4,
    refresh_by_hand: bool = False,
) -> float:
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    for step in range(steps):
        schedule(step, model)
        schedule(step, reference)
        if refresh_by_hand:
            fc.refresh_trainable(model)
        inputs, targets = synthetic_batch(cfg, 4, step)
        ref_opt.zero_grad(set_to_none=True)
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
        opt.step()
    return max_param_diff(model, reference)


# ---------------------------------------------------------------------------------------------------- reshard in bw
def _frozen_blocks_reshard_layer_by_layer(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig(n_layers=3)
    reference, model = reference_and_copy(cfg)
    _freeze_blocks(reference, [0, 1, 2])
    _freeze_blocks(model, [0, 1, 2])
    shard_gpt(model, mesh_1d(ws))
    units = [fc.get_state(b).params for b in model.blocks]
    observed: list[tuple[int, list[str]]] = []

    def watch(i: int) -> Callable[..., None]:
        def forward_hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            # the moment the gradient reaches block i's output, blocks after i must already be sharded again
            output.register_hook(lambda g: observed.append((i, [u.state.value for u in units[i + 1 :]])))

        return forward_hook

    for i, block in enumerate(model.blocks):
        block.register_forward_hook(watch(i))
    with _CollectiveLog() as log:
        diff = _train_with_schedule(rank, ws, model, reference, cfg, lambda step, m: None, steps=3)
    root = fc.get_state(model)
    return {
        "diff": diff,
        "observed": observed,
        "frozen_grads": [p.grad for b in model.blocks for p in b.parameters()],
        "reduced": log.reduced,
        "root_rs_numel": ws * (root.grads.input.layout.segment_numel + root.grads.input.rows.tail(flagged=False)),
    }


@pytest.mark.parametrize("ws", [2, 4])
def test_frozen_blocks_reshard_as_soon_as_their_input_grads_exist(run_dist, ws: int) -> None:
    """A frozen unit is gathered for backward (dL/dx needs W) and freed right after, layer by layer."""
    for r in run_dist(ws, _frozen_blocks_reshard_layer_by_layer):
        assert r["diff"] <= 1e-5
        assert all(g is None for g in r["frozen_grads"])
        assert sorted(i for i, _ in r["observed"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every block, 3 steps
        assert all(len(states) == 2 - i and all(s == "sharded" for s in states) for i, states in r["observed"])
        assert r["reduced"] == [r["root_rs_numel"]] * 3  # only the trainable root is ever reduced


# ---------------------------------------------------------------------------------------------- trainability changes
def _freeze_unfreeze_schedule(step: int, model: nn.Module) -> None:
    if step == 0:
        _freeze_blocks(model, [1])  # entirely frozen at its first forward
    if step == 2:
        _freeze_blocks(model, [0])
    if step == 3:
        _freeze_blocks(model, [1], frozen=False)


def _schedule_parity(rank: int, ws: int, param_dtype: str | None, refresh_by_hand: bool) -> float:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if param_dtype else fc.MixedPrecisionPolicy()
    shard_gpt(model, mesh_1d(ws), mp_policy=policy, auto_refresh_trainable=not refresh_by_hand)
    return _train_with_schedule(
        rank, ws, model, reference, cfg, _freeze_unfreeze_schedule, steps=5, refresh_by_hand=refresh_by_hand
    )


@pytest.mark.parametrize("ws", [2, 4])
def test_freeze_and_unfreeze_between_steps_fp32_exact(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _schedule_parity, None, False)) <= 1e-5


@pytest.mark.parametrize("ws", [2, 4])
def test_unfreezing_a_unit_frozen_at_its_first_forward_under_bf16(run_dist, ws: int) -> None:
    """torch FSDP2 raises here ("assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float")."""
    assert max(run_dist(ws, _schedule_parity, "bf16", False)) <= 2e-2


@pytest.mark.parametrize("ws", [2])
def test_manual_refresh_gives_the_same_results(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _schedule_parity, None, True)) <= 1e-5


def _without_refresh(rank: int, ws: int) -> tuple[bool, bool]:
    """Documented behaviour with auto_refresh_trainable=False and no fc.refresh_trainable: the unit keeps its old
    view of which parameters train until refreshed."""
    cfg = GPTConfig()
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), auto_refresh_trainable=False)
    inputs, targets = synthetic_batch(cfg, 4, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    model.blocks[0].requires_grad_(False)
    loss_fn(model(x), y).backward()
    still_reduced = all(p.grad is not None for p in model.blocks[0].parameters())
    model.zero_grad(set_to_none=True)
    fc.refresh_trainable(model)
    loss_fn(model(x), y).backward()
    frozen_now = all(p.grad is None for p in model.blocks[0].parameters())
    return still_reduced, frozen_now


@pytest.mark.parametrize("ws", [2])
def test_without_refresh_the_old_trainability_applies(run_dist, ws: int) -> None:
    for still_reduced, frozen_now in run_dist(ws, _without_refresh):
        assert still_reduced and frozen_now


def _change_during_no_sync(rank: int, ws: int) -> str:
    cfg = GPTConfig()
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    inputs, targets = synthetic_batch(cfg, 4, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    with fc.no_sync(model):
        loss_fn(model(x), y).backward()
    model.blocks[0].requires_grad_(False)
    with pytest.raises(RuntimeError, match="changed while gradients from no-sync micro-batches are pending") as info:
        model(x)
    assert fc.get_state(model.blocks[0]).grads.has_pending()  # nothing was lost
    return str(info.value)


@pytest.mark.parametrize("ws", [2])
def test_changing_trainability_with_pending_no_sync_gradients_raises(run_dist, ws: int) -> None:
    assert len(set(run_dist(ws, _change_during_no_sync))) == 1


def _ranks_train_different_parameters(rank: int, ws: int, read_early: bool) -> dict[str, Any]:
    """Even ranks freeze the first layer's weight, odd ranks the last one's: equal sizes, so the one reduce-scatter has
    the same size everywhere and would add one parameter's gradient into the other's. Then every rank freezes the
    first layer's weight and trains on, next to a reference on the global batch. ``read_early``: a post-accumulate-grad
    hook acts on each gradient as it is delivered, so the agreement is read at the first hook (the rows are held all
    the same)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model = copy.deepcopy(reference)
    fc.fully_shard(model, mesh=mesh_1d(ws))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model[0 if rank % 2 == 0 else 2].weight.requires_grad_(False)
    if read_early:
        model[2].bias.register_post_accumulate_grad_hook(lambda param: None)
    inputs = torch.randn(2 * ws, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="the ranks train different parameters") as info:
        model(local_batch(inputs, rank, ws)).pow(2).mean().backward()
    no_grads = all(p.grad is None for p in model.parameters())
    unchanged = max_param_diff(model, reference)
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(True)
    reference[0].weight.requires_grad_(False)
    for step in range(3):
        batch = torch.randn(2 * ws, 4, generator=torch.Generator().manual_seed(10 + step))
        for net, optimizer, x in ((model, opt, local_batch(batch, rank, ws)), (reference, ref_opt, batch)):
            optimizer.zero_grad(set_to_none=True)
            net(x).pow(2).mean().backward()
            optimizer.step()
    return {
        "message": str(info.value),
        "no_grads": no_grads,
        "unchanged": unchanged,
        "diff": max_param_diff(model, reference),
    }


@pytest.mark.parametrize("read_early", [False, True], ids=["common_path", "read_early"])
@pytest.mark.parametrize("ws", [2, 4])
def test_ranks_training_different_parameters_raise_on_every_rank(run_dist, ws: int, read_early: bool) -> None:
    """torch's fully_shard trains on with the mixed gradients; fsdp_compose raises on every rank at the end of that
    backward, keeps no gradient of it, and trains as the reference does once the ranks agree again."""
    results = run_dist(ws, _ranks_train_different_parameters, read_early)
    assert len({r["message"] for r in results}) == 1
    for r in results:
        assert r["no_grads"] and r["unchanged"] == 0.0
        assert r["diff"] < 1e-6


# ---------------------------------------------------------------------------------------------- frozen_params=replicate
def _replicate_frozen(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    _freeze_blocks(reference, [0, 1])
    _freeze_blocks(model, [0, 1])
    shard_gpt(model, mesh_1d(ws), frozen_params="replicate")
    block_param = model.blocks[0].mlp.fc.weight
    placements_frozen = block_param.placements
    local_is_whole = block_param.to_local().shape == block_param.shape
    with _CollectiveLog() as log:
        diff_frozen = _train_with_schedule(rank, ws, model, reference, cfg, lambda step, m: None, steps=2)
    root = fc.get_state(model)
    only_root = log.gathered == [ws * root.params.shards.layout.segment_numel] * 2  # the root gathers once per step
    # unfreeze block 0: it moves from whole to sharded, trains, and matches the reference
    diff_after = _train_with_schedule(
        rank, ws, model, reference, cfg, lambda step, m: _freeze_blocks(m, [0], frozen=False), steps=2
    )
    return {
        "frozen_replicated": placements_frozen == (Replicate(),) and local_is_whole,
        "only_root_communicated": only_root and all(n == log.reduced[0] for n in log.reduced),
        "unfrozen_sharded": block_param.placements == (Shard(0),),
        "diff_frozen": diff_frozen,
        "diff_after": diff_after,
    }


@pytest.mark.parametrize("ws", [2, 4])
def test_replicated_frozen_params_are_never_communicated(run_dist, ws: int) -> None:
    for r in run_dist(ws, _replicate_frozen):
        assert r["frozen_replicated"] and r["only_root_communicated"] and r["unfrozen_sharded"]
        assert r["diff_frozen"] <= 1e-5 and r["diff_after"] <= 1e-5


# ---------------------------------------------------------------------------------------------------------- ties
def _tied_across_units(rank: int, ws: int) -> tuple[float, bool]:
    cfg = GPTConfig()  # vocab 97: uneven rows on 2 and 4 ranks
    torch.manual_seed(0)
    reference = GPT(cfg)
    reference.head.weight = reference.tok_emb.weight
    model = copy.deepcopy(reference)
    mesh = mesh_1d(ws)
    fc.fully_shard(model.tok_emb, mesh=mesh)  # takes the shared weight first ...
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)  # ... and the root, which also uses it (head), lifts it into its unit
    still_tied = model.head.weight is model.tok_emb.weight and isinstance(model.head.weight, DTensor)
    diff = _train_with_schedule(rank, ws, model, reference, cfg, lambda step, m: None, steps=3)
    return diff, still_tied and model.head.weight is model.tok_emb.weight


@pytest.mark.parametrize("ws", [2, 4])
def test_tied_embedding_and_head_in_different_units(run_dist, ws: int) -> None:
    for diff, tied in run_dist(ws, _tied_across_units):
        assert tied and diff <= 1e-5


# ----------------------------------------------------------------------------------------------- unused branches
class Experts(nn.Module):
    """Two experts picked per sample by the sign of the input's mean (MoE-like): a rank may skip one entirely."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor, route_a: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        if route_a.any():
            out = out.index_put((route_a.nonzero().squeeze(-1),), self.a(h[route_a]))
        if (~route_a).any():
            out = out.index_put(((~route_a).nonzero().squeeze(-1),), self.b(h[~route_a]))
        return out


class Routed(nn.Module):
    """Units: stem, experts (one unit: it always runs), head, and the root, which holds aux (feeds the loss only
    for routed-a samples)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 6)
        self.experts = Experts()
        self.aux = nn.Linear(6, 3)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route_a = x.mean(-1) > 0
        h = torch.tanh(self.stem(x))
        y = self.head(self.experts(h, route_a))
        aux = self.aux(h)  # computed on every rank ...
        if route_a.any():  # ... but only used where some sample routes to a
            y = y + torch.where(route_a[:, None], aux, torch.zeros_like(aux))
        return y


def _unused_branch(rank: int, ws: int) -> tuple[float, list[bool]]:
    torch.manual_seed(0)
    reference = Routed()
    model = copy.deepcopy(reference)
    mesh = mesh_1d(ws)
    # The experts are one unit, which runs on every rank even when a rank routes nothing to one expert. aux, whose
    # output reaches the loss on some ranks only, stays in the root's unit: a unit of its own would all-gather for
    # backward on those ranks only (a collective the others never join), as in torch FSDP2.
    for name in ["stem", "experts", "head"]:
        fc.fully_shard(getattr(model, name), mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4 * ws, 6, generator=gen).abs()
        x[: 2 * ws] *= -1  # first half of the global batch routes to expert b, second half to expert a
        if ws > 1:
            assert (local_batch(x, 0, ws).mean(-1) < 0).all() and (local_batch(x, ws - 1, ws).mean(-1) > 0).all()
        target = torch.randn(4 * ws, 3, generator=gen)
        ref_opt.zero_grad()
        (reference(x) - target).pow(2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        (model(local_batch(x, rank, ws)) - local_batch(target, rank, ws)).pow(2).mean().backward()
        opt.step()
    grads_set = [p.grad is not None for p in model.parameters()]
    return max_param_diff(model, reference), grads_set


@pytest.mark.parametrize("ws", [2, 4])
def test_branch_unused_on_some_ranks_completes_with_parity(run_dist, ws: int) -> None:
    """Rank 0 never runs expert a nor uses aux; the last rank never runs expert b. The experts' unit contributes
    zeros for the expert a rank skipped and the root's unit for aux; the "had a gradient" flags keep every .grad
    right: no hang, the reference's result."""
    for diff, grads_set in run_dist(ws, _unused_branch):
        assert diff <= 1e-5
        assert all(grads_set)  # every parameter was used on some rank, so every rank holds its gradient shard


# ----------------------------------------------------------------------------------------------- unused outputs
class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin1(x).relu(), self.lin2(x).relu()


def _backward_step(step: int, o1: torch.Tensor, o2: torch.Tensor) -> None:
    """Which outputs the loss uses: both; the first only (lin2 gets no gradient anywhere); each in its own
    backward (accumulated); the first only again."""
    if step == 0:
        (o1 * o2).mean().backward()
    elif step == 2:
        o1.mean().backward()
        o2.mean().backward()
    else:
        o1.mean().backward()


def _unused_output(rank: int, ws: int, lin2_unit: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    reference = _TwoOutputs()
    models: dict[str, nn.Module] = {"reference": reference}
    mesh = mesh_1d(ws)
    for name, shard in (("ours", fc.fully_shard), ("torch", torch_fully_shard)):
        model = models[name] = copy.deepcopy(reference)
        shard(model.lin1, mesh=mesh)
        if lin2_unit:
            shard(model.lin2, mesh=mesh)  # a non-root unit whose forward ran with grad, its output then unused
        shard(model, mesh=mesh)
    opts = {name: torch.optim.Adam(m.parameters(), lr=1e-2) for name, m in models.items()}
    grads_none: dict[str, list[list[bool]]] = {name: [] for name in models}
    for step in range(4):
        x = torch.rand(2 * ws, 8, generator=torch.Generator().manual_seed(step))
        for name, model in models.items():
            o1, o2 = model(x if name == "reference" else local_batch(x, rank, ws))
            _backward_step(step, o1, o2)
            grads_none[name].append([p.grad is None for p in model.parameters()])
            opts[name].step()  # Adam moves a parameter with a zero .grad (momentum), skips one whose .grad is None
            opts[name].zero_grad(set_to_none=True)
    return {
        "grads_none": grads_none,
        "ours": max_param_diff(models["ours"], reference),
        "torch": max_param_diff(models["torch"], reference),
    }


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("lin2_unit", [False, True], ids=["lin2_in_root", "lin2_own_unit"])
def test_unit_output_the_loss_ignores_keeps_grad_none(run_dist, ws: int, lin2_unit: bool) -> None:
    """A unit ran forward with grad, the loss ignored its output: its parameters keep ``.grad = None`` on every rank
    (docs/frozen.md), as in single-process training and torch's fully_shard, so Adam skips them. Before the fix one
    autograd node over all of a unit's outputs handed the unused one a zero gradient: a zero ``.grad``, and Adam
    moved lin2 by its momentum (6.7e-3 off the reference)."""
    for r in run_dist(ws, _unused_output, lin2_unit):
        expected = [[False] * 4, [False, False, True, True], [False] * 4, [False, False, True, True]]
        assert r["grads_none"]["reference"] == expected
        assert r["grads_none"]["ours"] == expected and r["grads_none"]["torch"] == expected
        assert r["ours"] <= 1e-6 and r["torch"] <= 1e-6, r


class _IgnoresInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.lin(a + b if use_b else a)


class _TwoProducers(nn.Module):
    """``u`` takes what ``a`` and ``b`` made; on some steps it ignores ``b``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.u = nn.Linear(8, 8), nn.Linear(8, 8), _IgnoresInput()

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.u(self.a(x), self.b(x), use_b)


def _unused_input(rank: int, ws: int, b_unit: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _TwoProducers()
    model = copy.deepcopy(reference)
    mesh = mesh_1d(ws)
    fc.fully_shard(model.u, mesh=mesh)
    if b_unit:
        fc.fully_shard(model.b, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    models = {"ours": model, "reference": reference}
    opts = {name: torch.optim.Adam(m.parameters(), lr=1e-2) for name, m in models.items()}
    grads_none: dict[str, list[list[bool]]] = {name: [] for name in models}
    for step in range(3):
        x = torch.rand(2 * ws, 8, generator=torch.Generator().manual_seed(step))
        for name, m in models.items():
            m(x if name == "reference" else local_batch(x, rank, ws), step != 1).pow(2).mean().backward()
            grads_none[name].append([p.grad is None for p in m.parameters()])
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
    return {"grads_none": grads_none, "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("b_unit", [False, True], ids=["b_in_root", "b_own_unit"])
def test_unit_input_the_unit_ignores_keeps_its_producers_grad_none(run_dist, ws: int, b_unit: bool) -> None:
    """A unit ignores one of its inputs that needs grad: what made it keeps ``.grad = None``, as in single-process
    training (torch's fully_shard hands it a zero gradient: one autograd node over all of a unit's inputs)."""
    for r in run_dist(ws, _unused_input, b_unit):
        expected = [[False] * 6, [False, False, True, True, False, False], [False] * 6]
        assert r["grads_none"]["reference"] == expected
        assert r["grads_none"]["ours"] == expected
        assert r["diff"] <= 1e-6, r
