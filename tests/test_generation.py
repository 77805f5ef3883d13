"""Generation on a sharded model: consecutive forwards that no backward follows, side by side with torch's
``fully_shard``.

A decoding loop runs one forward per token under ``no_grad``. A unit set to keep its parameters after forward
(``reshard_after_forward=False``, a trainer's ``[norm, head]``) is gathered once for the whole loop, as torch keeps
it, and gathered again once its shards changed in place (weights loaded, an optimizer step), where torch keeps
serving the old weights.
``transformers`` tells a sharded model by the ``_is_fsdp_managed_module`` attribute torch's ``fully_shard`` sets (it
turns on ``generate``'s ``synced_gpus``): fsdp_compose sets it on the same modules.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.collective_bytes import CollectiveBytes
from tests.dist_utils import local_batch, max_param_diff, mesh_1d

_CFG = GPTConfig(n_layers=2)


def _shard(model: GPT, shard: Any, mesh: Any) -> GPT:
    """Blocks resharding after forward, ``[ln_f, head]`` and the root keeping their parameters (given explicitly)."""
    for block in model.blocks:
        shard(block, mesh=mesh, reshard_after_forward=True)
    shard([model.ln_f, model.head], mesh=mesh, reshard_after_forward=False)
    shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _decode(model: nn.Module, prompt: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
    """Greedy decoding, one forward per token over the whole sequence so far; returns the tokens and all-gathers."""
    sequence = prompt
    with torch.no_grad(), CollectiveBytes() as recorded:
        for _ in range(tokens):
            logits = model(sequence[:, -_CFG.seq_len :])
            sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return sequence, recorded.summary()["all_gather"]


def _generation(rank: int, ws: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = GPT(_CFG)
    mesh = mesh_1d(ws)
    models = {"ours": _shard(copy.deepcopy(reference), fc.fully_shard, mesh), "torch": copy.deepcopy(reference)}
    _shard(models["torch"], torch_fsdp.fully_shard, mesh)
    # The sharded parameters, as a trainer's optimizer holds them (a unit kept gathered registers its full ones).
    held = {name: list(m.parameters()) for name, m in [("reference", reference), *models.items()]}
    prompt = local_batch(synthetic_batch(_CFG, 2 * ws, 0)[0], rank, ws)[:, :4]
    expected, _ = _decode(reference, prompt, 6)
    found: dict[str, Any] = {}
    for name, model in models.items():
        sequence, gathers = _decode(model, prompt, 6)
        found[name] = {"same_tokens": torch.equal(sequence, expected), "gathers": gathers}
    # Parked, not registered: the module holds its sharded parameters, and a copy is an independent sharded model.
    ours = models["ours"]
    found["ours"]["sharded_params"] = all(isinstance(p, DTensor) for p in ours.parameters())
    found["ours"]["copy_tokens"] = torch.equal(_decode(copy.deepcopy(ours), prompt, 6)[0], expected)
    # The weights change without a backward (new weights loaded in place, an EMA update), then decoding again.
    with torch.no_grad():
        for params in held.values():
            for param in params:
                param.mul_(0.5).add_(0.01)
    for name, model in models.items():
        with torch.no_grad():
            found[name]["logits_diff"] = (model(prompt) - reference(prompt)).abs().max().item()
    found["marked"] = {
        name: sorted(n for n, m in model.named_modules() if getattr(m, "_is_fsdp_managed_module", False))
        for name, model in models.items()
    }
    return found


@pytest.mark.parametrize("ws", [1, 2])
def test_decoding_gathers_what_torch_gathers_and_sees_the_weights_change(run_dist, ws: int) -> None:
    for result in run_dist(ws, _generation):
        ours, theirs = result["ours"], result["torch"]
        assert ours["same_tokens"] and theirs["same_tokens"]
        assert ours["gathers"] == theirs["gathers"], (ours["gathers"], theirs["gathers"])
        assert ours["logits_diff"] <= 1e-5
        assert ours["sharded_params"] and ours["copy_tokens"]
        if ws > 1:
            assert theirs["logits_diff"] > 1e-3  # torch's kept units serve the weights from before the change
        assert result["marked"]["ours"] == result["marked"]["torch"]


def _different_lengths(rank: int, ws: int) -> dict[str, Any]:
    """Rank 0 stops decoding one token early and goes on to a training step while the others still decode."""
    torch.manual_seed(0)
    model = _shard(GPT(_CFG), fc.fully_shard, mesh_1d(ws))
    fc.set_collective_checks(model, True)
    inputs, targets = synthetic_batch(_CFG, 2 * ws, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    message = ""
    try:
        _decode(model, x[:, :4], 3 if rank == 0 else 4)
        loss_fn(model(x), y).backward()
    except RuntimeError as error:
        message = str(error)
    return {"message": message}


@pytest.mark.parametrize("ws", [2, 4])
def test_ranks_that_decode_different_lengths_get_a_clear_error(run_dist, ws: int) -> None:
    """With the collective checks on, the forward where the ranks part (one trains, the others still decode) raises
    the same error on every rank, naming both sides, instead of a hang or a size mismatch deeper in."""
    messages = {r["message"] for r in run_dist(ws, _different_lengths)}
    assert len(messages) == 1
    message = messages.pop()
    assert "ranks [0] run a forward with gradients enabled" in message and "synced_gpus=True" in message


def _eval_inside_a_step(rank: int, ws: int) -> float:
    """A training forward, an evaluation forward (it parks the kept units), then the first forward's backward: the
    backward takes the parked parameters back (no all-gather of its program is missing or extra)."""
    torch.manual_seed(0)
    reference = GPT(_CFG)
    model = _shard(copy.deepcopy(reference), fc.fully_shard, mesh_1d(ws))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        inputs, targets = synthetic_batch(_CFG, 2 * ws, step)
        for name, net, optimizer in (("reference", reference, ref_opt), ("ours", model, opt)):
            full = name == "reference"
            x, y = (inputs, targets) if full else (local_batch(inputs, rank, ws), local_batch(targets, rank, ws))
            loss = loss_fn(net(x), y)
            with torch.no_grad():
                net(x[:, :5])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return max_param_diff(model, reference)


@pytest.mark.parametrize("ws", [1, 2])
def test_an_evaluation_between_a_forward_and_its_backward_trains_like_the_reference(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _eval_inside_a_step)) <= 1e-5
