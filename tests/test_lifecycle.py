"""The functions on a sharded module and the unit's life across a step: unshard/reshard, reshard settings,
no_sync, forward methods, checkpointing a whole unit, forwards without backward."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.unit import UnitState
from tests.dist_utils import (
    full_value,
    local_batch,
    make_optimizer,
    max_param_diff,
    mesh_1d,
    reference_and_copy,
    shard_gpt,
    train_pair,
)


def _unshard_and_reshard(rank: int, ws: int) -> None:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    block = model.blocks[0]
    fc.unshard(block)
    for name, param in block.named_parameters():
        assert not isinstance(param, DTensor)
        assert torch.equal(param, dict(reference.blocks[0].named_parameters())[name]), name
    fc.reshard(block)
    assert all(isinstance(p, DTensor) for p in block.parameters())
    handle = fc.unshard(model, async_op=True)
    assert handle is not None
    handle.wait()
    assert torch.equal(model.head.weight, reference.head.weight)
    fc.reshard(model)
    assert isinstance(model.head.weight, DTensor)


@pytest.mark.parametrize("ws", [1, 2])
def test_unshard_and_reshard_functions(run_dist, ws: int) -> None:
    run_dist(ws, _unshard_and_reshard)


def _reshard_settings(rank: int, ws: int) -> tuple[float, list[bool], list[bool], list[bool]]:
    """reshard_after_forward/backward=False, two micro-batches per step: full parameters stay from forward into
    backward and across the no-sync micro-batch, and the synchronising backward reshards (an optimizer step follows)."""
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    fc.set_reshard_after_forward(model, False)
    fc.set_reshard_after_backward(model, False)
    units = [fc.get_state(m).params for m in [model, *model.blocks]]
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    after_forward, after_no_sync, after_sync = [], [], []
    for step in range(3):
        inputs, targets = synthetic_batch(cfg, 8, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        opt.zero_grad()
        pairs = list(zip(local_batch(inputs, rank, ws).chunk(2), local_batch(targets, rank, ws).chunk(2), strict=True))
        with fc.no_sync(model):
            loss = loss_fn(model(pairs[0][0]), pairs[0][1]) / 2
            after_forward.append(all(u.state is UnitState.UNSHARDED for u in units))
            loss.backward()
        after_no_sync.append(all(u.state is UnitState.UNSHARDED for u in units))
        (loss_fn(model(pairs[1][0]), pairs[1][1]) / 2).backward()
        after_sync.append(any(u.state is UnitState.UNSHARDED for u in units))
        opt.step()
    return max_param_diff(model, reference), after_forward, after_no_sync, after_sync


@pytest.mark.parametrize("ws", [2, 4])
def test_kept_unsharded_through_no_sync_and_resharded_by_the_synchronising_backward(run_dist, ws: int) -> None:
    for diff, after_forward, after_no_sync, after_sync in run_dist(ws, _reshard_settings):
        assert all(after_forward) and all(after_no_sync) and not any(after_sync)
        assert diff <= 1e-5


def _full_grads_left(unit: object) -> bool:
    """Full-size ``.grad`` left on a unit's full parameters (none between steps: they move into its buffer)."""
    return any(mp.full is not None and mp.full.grad is not None for mp in unit.params.shards.params)  # type: ignore[attr-defined]


def _no_sync_keeps_full_grads(rank: int, ws: int) -> None:
    cfg = GPTConfig()
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    inputs, targets = synthetic_batch(cfg, 4, 0)
    with fc.no_sync(model):
        assert not fc.get_state(model.blocks[0]).requires_gradient_sync
        loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    assert fc.get_state(model.blocks[0]).requires_gradient_sync
    units = [fc.get_state(m) for m in [model, *model.blocks]]
    # .grad holds zeros while the unit holds the micro-batch's gradients (a user's zero_grad then drops them)
    assert all(isinstance(p.grad, DTensor) and not p.grad.to_local().any() for p in model.parameters())
    # the micro-batch's gradients moved into each unit's reduce-scatter buffer; no full-size .grad is left
    assert all(u.grads.has_pending() and not _full_grads_left(u) for u in units)
    loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    assert not any(u.grads.has_pending() or _full_grads_left(u) for u in units)


@pytest.mark.parametrize("ws", [2])
def test_no_sync_accumulates_in_the_reduce_scatter_buffer_until_the_synced_backward(run_dist, ws: int) -> None:
    run_dist(ws, _no_sync_keeps_full_grads)


class Generator(GPT):
    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy decoding that reads the head weight directly (outside forward)."""
        for _ in range(new_tokens):
            x = self.tok_emb(idx[:, -self.cfg.seq_len :]) + self.pos_emb[: min(idx.shape[1], self.cfg.seq_len)]
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x[:, -1]) @ self.head.weight.T
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        return idx


def _forward_method(rank: int, ws: int) -> tuple[bool, bool]:
    torch.manual_seed(0)
    reference = Generator(GPTConfig())
    model = copy.deepcopy(reference)
    shard_gpt(model, mesh_1d(ws))
    fc.register_forward_method(model, "generate")
    prompt = torch.randint(0, 97, (2, 3), generator=torch.Generator().manual_seed(5))
    out = model.generate(prompt, 4)
    resharded = all(isinstance(p, DTensor) for p in model.parameters())
    return torch.equal(out, reference.generate(prompt, 4)), resharded


@pytest.mark.parametrize("ws", [2])
def test_register_forward_method(run_dist, ws: int) -> None:
    for same_tokens, resharded in run_dist(ws, _forward_method):
        assert same_tokens and resharded


class CheckpointedUnits(GPT):
    """Checkpoints whole sharded blocks from the parent's forward: their hooks run again during recompute."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def _checkpointed_units(rank: int, ws: int) -> float:
    cfg = GPTConfig()
    torch.manual_seed(0)
    reference = CheckpointedUnits(cfg)
    model = copy.deepcopy(reference)
    shard_gpt(model, mesh_1d(ws))
    return train_pair(rank, ws, model, reference, cfg, steps=3)


@pytest.mark.parametrize("ws", [2, 4])
def test_checkpoint_around_a_whole_unit(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _checkpointed_units)) <= 1e-5


def _forward_without_backward(rank: int, ws: int) -> float:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    inputs, _ = synthetic_batch(cfg, 4, 99)
    model(local_batch(inputs, rank, ws))  # grad enabled, output dropped: no backward ever runs for it
    model.eval()
    with torch.no_grad():
        logits = model(local_batch(inputs, rank, ws))
    assert torch.allclose(logits, reference(local_batch(inputs, rank, ws)), atol=1e-6)
    model.train()
    return train_pair(rank, ws, model, reference, cfg, steps=2)


@pytest.mark.parametrize("ws", [2])
def test_forward_without_backward_then_training(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _forward_without_backward)) <= 1e-5


def _unused_unit(rank: int, ws: int) -> tuple[bool, bool]:
    """A sharded submodule that the loss never reaches: its parameters get no gradient, like the reference's."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "aux": nn.Linear(4, 4)})
    fc.fully_shard(model["used"], mesh=mesh_1d(ws))
    fc.fully_shard(model["aux"], mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws))
    x = torch.randn(2, 4)
    model["aux"](x)  # runs forward, output unused
    model["used"](x).sum().backward()
    aux_none = all(p.grad is None for p in model["aux"].parameters())
    used_set = all(isinstance(p.grad, DTensor) for p in model["used"].parameters())
    return aux_none, used_set and all(isinstance(full_value(p), torch.Tensor) for p in model.parameters())


@pytest.mark.parametrize("ws", [2])
def test_unit_outside_the_loss_gets_no_gradient(run_dist, ws: int) -> None:
    for aux_none, used_set in run_dist(ws, _unused_unit):
        assert aux_none and used_set


def _deleted_model_is_freed(rank: int, ws: int) -> tuple[bool, bool]:
    cfg = GPTConfig()
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    opt = make_optimizer("adamw")(model.parameters())
    inputs, targets = synthetic_batch(cfg, 4, 0)
    loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    opt.step()
    units = [weakref.ref(fc.get_state(m).params) for m in [*model.blocks, model]]  # type: ignore[union-attr]
    flat = weakref.ref(fc.get_state(model.blocks[0]).params.shards.flat)  # type: ignore[union-attr]
    del model, opt
    gc.collect()
    return all(u() is None for u in units), flat() is None


@pytest.mark.parametrize("ws", [2])
def test_a_deleted_model_is_freed(run_dist, ws: int) -> None:
    """Nothing (hooks included) keeps a trained, deleted sharded model alive: its buffers and groups are freed."""
    assert run_dist(ws, _deleted_model_is_freed) == [(True, True)] * ws
