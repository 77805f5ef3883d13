"""``reshard_after_forward=k``: after forward each rank keeps 1/k of a unit, and backward re-gathers within k ranks."""

from __future__ import annotations

from typing import Any

import pytest

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.unit import UnitState
from tests.dist_utils import mesh_1d, mesh_nd, reference_and_copy, shard_gpt, tp_mlps, train_on_dp_mesh, train_pair

TOL = 1e-5
# Uneven rows on purpose: 4 ranks, dims not divisible by 4 (padding inside the kept blocks).
UNEVEN = {"dim": 36, "n_heads": 4, "vocab_size": 61, "seq_len": 10}


def _parity(rank: int, ws: int, k: int, cfg_kwargs: dict[str, Any], hsdp: bool) -> float:
    cfg = GPTConfig(**cfg_kwargs)
    reference, model = reference_and_copy(cfg)
    mesh = mesh_nd((2, ws // 2), ("replicate", "shard")) if hsdp else mesh_1d(ws)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh, reshard_after_forward=k)
    fc.fully_shard(model, mesh=mesh)
    return train_pair(rank, ws, model, reference, cfg, steps=3, batch_size=8)


@pytest.mark.parametrize("cfg_kwargs", [{}, UNEVEN], ids=["even", "uneven"])
def test_reshard_to_pairs_trains_like_the_reference(run_dist, cfg_kwargs: dict[str, Any]) -> None:
    assert max(run_dist(4, _parity, 2, cfg_kwargs, False)) <= TOL


@pytest.mark.slow
def test_hsdp_reshard_to_pairs_trains_like_the_reference(run_dist) -> None:
    """HSDP 2 x 4: the post-forward groups split each replica's shard group of 4 into pairs."""
    assert max(run_dist(8, _parity, 2, UNEVEN, True)) <= TOL


def _what_backward_gathers(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig(**UNEVEN)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    fc.set_reshard_after_forward(model.blocks, 2)  # on every block (recurse), after fully_shard
    fc.set_reshard_after_forward(model, False, recurse=False)
    with fc.CollectiveRecorder() as recorder:
        inputs, targets = synthetic_batch(cfg, 8, 0)
        loss = loss_fn(model(inputs.chunk(ws)[rank]), targets.chunk(ws)[rank])
        units = [fc.get_state(block).params for block in model.blocks]  # type: ignore[union-attr]
        after_forward = [u.state for u in units]
        blocks = [u._group_block for u in units]
        freed = all(
            mp.full_data is None or mp.full_data.untyped_storage().size() == 0 for u in units for mp in u.shards.params
        )
        kept = [
            (b.shape[0], b.shape[1] == u.shards.layout.segment_numel) if b is not None else None
            for b, u in zip(blocks, units, strict=True)
        ]
        with recorder.labelled("backward"):
            loss.backward()
        after_backward = [u.state for u in units]
    # the group size of each all-gather, in forward and in backward
    gathers = [r for r in recorder.records if r.kind == "all_gather" and not r.functional]
    forward_gathers = [r.group_size for r in gathers if r.label == ""]
    backward_gathers = [r.group_size for r in gathers if r.label == "backward"]
    # one more step with the reference: the values used in backward were right
    return {
        "after_forward": after_forward,
        "kept": kept,
        "freed": freed,
        "forward_gathers": forward_gathers,
        "backward_gathers": backward_gathers,
        "after_backward": after_backward,
        "diff": _grads_match(model, reference, cfg),
    }


def _grads_match(model: Any, reference: Any, cfg: GPTConfig) -> float:
    inputs, targets = synthetic_batch(cfg, 8, 0)
    loss_fn(reference(inputs), targets).backward()
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        worst = max(worst, (param.grad.full_tensor() - ref[name].grad).abs().max().item())
    return worst


def test_backward_gathers_within_the_pair_only(run_dist) -> None:
    for r in run_dist(4, _what_backward_gathers):
        assert r["after_forward"] == [UnitState.GROUP_SHARDED] * 2
        assert r["kept"] == [(2, True)] * 2  # each rank keeps 4 / 2 = 2 of the 4 segments
        assert r["freed"]
        assert r["forward_gathers"] == [4, 4, 4]  # root and both blocks over all 4 shard ranks
        assert sorted(r["backward_gathers"]) == [2, 2]  # both blocks again, within pairs only
        assert r["after_backward"] == [UnitState.SHARDED] * 2
        assert r["diff"] <= TOL


def _fsdp_tp(rank: int, ws: int) -> float:
    """dp 4 x tp 2: the post-forward groups are cut from a data-parallel submesh of a 2-D mesh."""
    cfg = GPTConfig(**UNEVEN)
    reference, model = reference_and_copy(cfg)
    mesh = mesh_nd((4, 2), ("dp", "tp"))
    tp_mlps(model, mesh["tp"])
    shard_gpt(model, mesh["dp"], reshard_after_forward=2)
    return train_on_dp_mesh(model, reference, cfg, mesh["dp"])


@pytest.mark.slow
def test_fsdp_tp_reshard_to_pairs(run_dist) -> None:
    assert max(run_dist(8, _fsdp_tp)) <= TOL


def _trivial_values(rank: int, ws: int) -> list[Any]:
    cfg = GPTConfig()
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    states = [fc.get_state(b) for b in model.blocks]
    results = []
    for value in (ws, 1):  # the whole shard group is True; one rank keeps everything: False
        fc.set_reshard_after_forward(model.blocks[0], value)
        results.append((states[0].reshard_after_forward_setting, states[0].params.post_forward))  # type: ignore[union-attr]
    return results


def test_int_values_that_mean_a_bool(run_dist) -> None:
    for r in run_dist(4, _trivial_values):
        assert r == [(True, None), (False, None)]
