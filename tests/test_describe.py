"""fc.describe / fc.describe_units / fc.print_description report what the parameters really are, on every rank."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, mesh_1d, mesh_nd, tp_mlps

BF16 = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)


def _real(model: torch.nn.Module, unit: fc.UnitDescription) -> list[tuple[Any, ...]]:
    """What the model's registered (sharded) parameters say, in the unit's order."""
    rows = []
    for p in unit.params:
        param = model.get_parameter(p.name)
        assert isinstance(param, DTensor), p.name
        local = param.to_local()
        placements = tuple(param.placements)
        rows.append((p.name, tuple(param.shape), param.dtype, placements, local.nbytes, param.requires_grad))
    return rows


def _described(unit: fc.UnitDescription) -> list[tuple[Any, ...]]:
    return [(p.name, p.shape, p.dtype, p.placements, p.local_bytes, p.requires_grad) for p in unit.params]


def _describe_1d(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_1d(ws)
    torch.manual_seed(0)
    model = GPT(GPTConfig())  # vocab 97, width 18: uneven shards
    model.blocks[0].requires_grad_(False)
    fc.fully_shard(model.blocks[0], mesh=mesh, frozen_params="replicate")
    fc.fully_shard(model.blocks[1], mesh=mesh, mp_policy=BF16)
    fc.fully_shard(model, mesh=mesh, ignored_params={model.pos_emb})
    before = fc.describe_units(model)

    inputs, targets = synthetic_batch(model.cfg, 4, 0)
    loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
    units = fc.describe_units(model, all_ranks=True)  # after a step: every unit is sharded again
    out = io.StringIO()
    fc.print_description(model, file=out)
    checks = {
        "paths": [u.paths for u in units],
        "same_before_and_after_a_step": [_described(u) for u in before] == [_described(u) for u in units],
        "params_match_the_model": all(_described(u) == _real(model, u) for u in units),
        "total_bytes": sum(u.local_bytes for u in units),
        "real_total_bytes": sum(p.to_local().nbytes for p in model.parameters() if isinstance(p, DTensor)),
        "unit_bytes": [u.local_bytes for u in units],
        "per_rank": [u.bytes_per_shard_rank for u in units],
        "kept_whole": [[p.kept_whole for p in u.params] for u in units],
        "placements_of_block0": {p.placements for p in units[1].params},
        "dtypes": [(u.compute_dtype, u.reduce_dtype) for u in units],
        "reshard_after_forward": [u.reshard_after_forward for u in units],
        "mesh": [(u.mesh_shape, u.mesh_dim_names, u.shard_rank, u.shard_size) for u in units],
        "text": fc.describe(model),
        "compact": fc.describe(model, params=False),
        "printed": out.getvalue(),
    }
    return checks


@pytest.mark.parametrize("ws", [2])
def test_describe_reports_the_real_parameters_bytes_and_settings(run_dist, ws: int) -> None:
    results = run_dist(ws, _describe_1d)
    for rank, r in enumerate(results):
        assert r["paths"] == [("",), ("blocks.0",), ("blocks.1",)]
        assert r["same_before_and_after_a_step"]
        assert r["params_match_the_model"]
        assert r["total_bytes"] == r["real_total_bytes"] > 0
        assert r["mesh"] == [((ws,), None, rank, ws)] * 3
        assert r["kept_whole"][1] == [True] * 12  # frozen under "replicate": whole, Replicate()
        assert r["placements_of_block0"] == {(Replicate(),)}
        assert not any(r["kept_whole"][0]) and not any(r["kept_whole"][2])
        assert r["dtypes"] == [(torch.float32, torch.float32)] * 2 + [(torch.bfloat16, torch.bfloat16)]
        assert r["reshard_after_forward"] == [False, True, True]  # the root keeps its parameters by default
        # every shard rank's bytes, as each rank measured its own
        assert r["per_rank"] == [tuple(res["unit_bytes"][i] for res in results) for i in range(3)]
        text = r["text"]
        assert "unit 1/3: <root> (GPT)" in text and "unit 3/3: blocks.1 (Block)" in text
        assert "not managed by any unit (1): pos_emb" in text
        assert "param_dtype=bfloat16 reduce_dtype=None output_dtype=float32" in text
        assert "gathers and computes in bfloat16, reduces gradients in bfloat16" in text
        assert "blocks.0.mlp.fc.weight" in text and "frozen, kept whole" in text
        assert "tok_emb.weight" in text and "(Shard(0),)" in text
        assert "<root> (GPT)" in r["compact"] and "12 frozen, 12 kept whole" in r["compact"]
        assert "tok_emb.weight" not in r["compact"]
        assert (r["printed"] == text + "\n") if rank == 0 else r["printed"] == ""
    # uneven dim 0 (vocab 97 over 2 ranks): the root's shards differ in size between the ranks
    root_bytes = results[0]["per_rank"][0]
    assert root_bytes is not None and root_bytes[0] != root_bytes[1]


def _describe_fsdp_tp(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_nd((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=16, n_heads=2))
    tp_mlps(model, mesh["tp"])
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh["dp"])
    fc.fully_shard(model, mesh=mesh["dp"])
    units = fc.describe_units(model)
    block = units[1]
    by_name = {p.name: p for p in block.params}
    return {
        "params_match_the_model": all(_described(u) == _real(model, u) for u in units),
        "unit_mesh": (block.mesh_shape, block.mesh_dim_names),
        "fc_weight": (by_name["blocks.0.mlp.fc.weight"].placements, by_name["blocks.0.mlp.fc.weight"].mesh_dim_names),
        "attn_weight": (by_name["blocks.0.attn.qkv.weight"].placements, by_name["blocks.0.attn.qkv.weight"].mesh_shape),
        "text": fc.describe(model),
    }


def test_describe_shows_fsdp_tp_placements_and_meshes(run_dist) -> None:
    for r in run_dist(4, _describe_fsdp_tp):
        assert r["params_match_the_model"]
        assert r["unit_mesh"] == ((2,), ("dp",))
        assert r["fc_weight"] == ((_StridedShard(0, split_factor=2), Shard(0)), ("dp", "tp"))
        assert r["attn_weight"] == ((Shard(0),), (2,))
        assert "(_StridedShard(0, split_factor=2), Shard(0))" in r["text"]
        assert "TP, on mesh (2, 2) ('dp', 'tp')" in r["text"]


def _describe_unsharded(rank: int, ws: int) -> str:
    return fc.describe(torch.nn.Linear(2, 2))


def test_describe_of_an_unsharded_module_says_so(run_dist) -> None:
    (text,) = run_dist(1, _describe_unsharded)
    assert "0 sharded unit(s)" in text and "call fc.fully_shard first" in text
    assert "not managed by any unit (2): weight, bias" in text


def _schedule_text(rank: int, ws: int) -> list[str]:
    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4)
    model = GPT(cfg)
    mesh = mesh_1d(ws)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    before = fc.describe_schedule(model)
    with pytest.raises(ValueError, match="describe the root"):
        model(torch.zeros(1, 4, dtype=torch.long))  # lazy init: blocks.0 is now a unit under the root
        fc.describe_schedule(model.blocks[0])
    return [before, fc.describe_schedule(model)]


def test_describe_schedule_prints_the_declared_order(run_dist) -> None:
    for before, after in run_dist(2, _schedule_text):
        assert before == after  # the same before the first step as after it
        lines = before.splitlines()
        assert "1 blocks.0: all_gather(forward), all_gather(backward), reduce_scatter" in lines[2]
        assert lines[0 + 1].strip().startswith("0 (root): all_gather(forward), reduce_scatter")
        assert "(root) -> blocks.1 -> blocks.0" in before
        assert "blocks.1 -> blocks.0 -> (root)" in before


def _example_gpt_schedule(rank: int, ws: int) -> str:
    model = GPT(GPTConfig(n_layers=2))
    mesh = mesh_1d(ws)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    return fc.describe_schedule(model)


def _without_group_numbers(text: str) -> str:
    """Process groups are numbered in creation order, which depends on what the process created before."""
    return re.sub(r"process group \d+", "process group N", text).strip()


def test_the_printed_schedule_in_the_docs_is_the_example_gpts(run_dist) -> None:
    """docs/schedule.md shows the example GPT's operation list: it is what describe_schedule prints on each rank."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "schedule.md").read_text()
    section = doc.split("## The schedule of the example GPT", 1)[1]
    printed = section.split("```", 2)[1]
    for text in run_dist(2, _example_gpt_schedule):
        assert _without_group_numbers(text) == _without_group_numbers(printed)


def _protocol_only_unit(rank: int, ws: int) -> dict[str, Any]:
    """A unit whose only parameter uses FSDP2's all-gather hooks (no flat segment): the schedule must list the
    all-gathers it issues."""
    import torch.nn as nn

    from tests.int8_weight import int8_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 8))
    int8_linears(model)
    fc.fully_shard(model[0], mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws))
    text = fc.describe_schedule(model)
    loss = model(torch.randn(4, 16)).pow(2).mean()
    with fc.CollectiveRecorder() as recorder:
        loss.backward()
    backward = recorder.counts()["all_gather"]
    with fc.CollectiveRecorder() as recorder:
        model(torch.randn(4, 16))
    return {"text": text, "forward": recorder.counts()["all_gather"], "backward": backward}


def test_describe_schedule_lists_a_protocol_only_units_all_gathers(run_dist) -> None:
    for result in run_dist(2, _protocol_only_unit):
        assert result["text"].count("all_gather(forward)") == result["forward"] == 2, result
        assert result["text"].count("all_gather(backward)") == result["backward"] == 1, result
