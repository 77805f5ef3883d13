"""``shard_placement_fn`` returning ``Shard(dim)`` for any dim: the layout math, and training against a reference.

The math tests emulate the all-gather and the reduce-scatter with plain tensor ops, as tests/test_sharding_math.py
does for dim 0, over any shape, shard dim and world size. The distributed tests train a model whose parameters are
sharded on dim 1 (uneven sizes: trailing ranks hold fewer or no columns) against a single-process reference, on 1-D
FSDP, HSDP and FSDP + TP meshes, and round-trip its state dicts.
"""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_compose as fc
from examples.gpt_model import GPTConfig
from fsdp_compose.sharding import (
    FlatLayout,
    chunk_rows,
    copy_param_from_segments,
    local_rows,
    write_grad_into_segments,
    write_param_into_segments,
)
from tests.dist_utils import (
    dp_slice,
    max_param_diff,
    mesh_1d,
    mesh_nd,
    reference_and_copy,
    shard_gpt,
    tp_mlps,
    train_on_dp_mesh,
)

SETTINGS = settings(max_examples=150, deadline=None)
TOL = 1e-5
world_sizes = st.integers(1, 6)


@st.composite
def sharded_shapes(draw: st.DrawFn, ws: int) -> tuple[tuple[int, ...], int]:
    """A shape of 1..4 dims (sizes 0..9, often fewer than ``ws`` on the shard dim) and its shard dim in range."""
    ndim = draw(st.integers(1, 4))
    shape = list(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(0, ndim - 1))
    shape[dim] = draw(st.one_of(st.integers(0, ws + 1), st.integers(0, 9)))
    return tuple(shape), dim


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
    ws = draw(world_sizes)
    return ws, draw(st.lists(sharded_shapes(ws), min_size=1, max_size=4))


def randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def nan_buffer(*size: int) -> torch.Tensor:
    return torch.full(size, float("nan"), dtype=torch.float64)


def chunk_or_empty(full: torch.Tensor, rank: int, ws: int, dim: int) -> torch.Tensor:
    chunks = torch.chunk(full, ws, dim=dim)
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)


def build(ws: int, cases: list[tuple[tuple[int, ...], int]]) -> FlatLayout:
    return FlatLayout.build([torch.Size(s) for s, _ in cases], ws, [d for _, d in cases])


@SETTINGS
@given(layouts())
def test_slots_on_any_dim(case: tuple[int, list[tuple[tuple[int, ...], int]]]) -> None:
    """A slot holds ceil(size / ws) rows of the product of the other dims; slots are laid end to end."""
    ws, cases = case
    layout = build(ws, cases)
    offset = 0
    for slot, (shape, dim) in zip(layout.slots, cases, strict=True):
        assert slot.dim == dim and slot.offset == offset
        assert slot.rows == max(chunk_rows(shape[dim], ws))
        assert slot.row_numel * shape[dim] == torch.Size(shape).numel()
        offset += slot.numel
    assert layout.segment_numel == offset


@SETTINGS
@given(layouts(), st.integers(0, 2**31))
def test_all_gather_round_trip_on_any_dim(case: tuple[int, list[tuple[tuple[int, ...], int]]], seed: int) -> None:
    """Each rank's shard view has torch.chunk's shape, is contiguous, and takes local_rows; stacking the segments
    (an all-gather) rebuilds every tensor, through NaN padding that must never be read back."""
    ws, cases = case
    fulls = [randn(shape, seed + i) for i, (shape, _) in enumerate(cases)]
    layout = build(ws, cases)
    segments = []
    for rank in range(ws):
        segment = nan_buffer(layout.segment_numel)
        for i, (full, (_, dim)) in enumerate(zip(fulls, cases, strict=True)):
            view = layout.shard_view(segment, i, rank)
            mine = local_rows(full, rank, ws, dim)
            assert view.shape == chunk_or_empty(full, rank, ws, dim).shape == mine.shape
            assert view.is_contiguous()
            view.copy_(mine)
        segments.append(segment)
    gathered = torch.stack(segments)
    for i, full in enumerate(fulls):
        out = nan_buffer(*full.shape)
        copy_param_from_segments(out, gathered, layout.slots[i])
        assert torch.equal(out, full), f"param {i} shape {tuple(full.shape)} dim {cases[i][1]} ws={ws}"


@SETTINGS
@given(layouts(), st.integers(0, 2**31), st.booleans(), st.sampled_from([1.0, 4.0]))
def test_reduce_scatter_on_any_dim(
    case: tuple[int, list[tuple[tuple[int, ...], int]]], seed: int, transposed: bool, scale: float
) -> None:
    """Two micro-batches of every rank's gradients written and accumulated (divided by ``scale``) into NaN buffers,
    summed over ranks: row r holds exactly torch.chunk(sum / scale, ws, dim)[r], also from non-contiguous grads."""
    ws, cases = case
    layout = build(ws, cases)
    grads = [
        [[randn(s, seed + 1000 * m + 10 * r + i) for i, (s, _) in enumerate(cases)] for r in range(ws)] for m in (0, 1)
    ]
    buffers = []
    for rank in range(ws):
        buffer = nan_buffer(ws, layout.segment_numel)
        for micro in (0, 1):
            for i, g in enumerate(grads[micro][rank]):
                if transposed and g.dim() >= 2:
                    g = g.transpose(0, -1).contiguous().transpose(0, -1)
                write_grad_into_segments(g, buffer, layout.slots[i], accumulate=micro == 1, scale=scale)
        buffers.append(buffer)
    reduced = torch.stack(buffers).sum(0)
    for i, (_, dim) in enumerate(cases):
        total = sum(grads[m][r][i] for m in (0, 1) for r in range(ws)) / scale
        for rank in range(ws):
            mine = layout.shard_view(reduced[rank], i, rank)
            torch.testing.assert_close(mine, chunk_or_empty(total, rank, ws, dim), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(layouts(), st.integers(0, 2**31), st.data())
def test_post_forward_blocks_on_any_dim(
    case: tuple[int, list[tuple[tuple[int, ...], int]]], seed: int, data: st.DataObject
) -> None:
    """reshard_after_forward=k: blocks of W/k segments cut from the full tensors stack back into every tensor."""
    ws, cases = case
    k = data.draw(st.sampled_from([d for d in range(1, ws + 1) if ws % d == 0]))
    fulls = [randn(shape, seed + i) for i, (shape, _) in enumerate(cases)]
    layout = build(ws, cases)
    blocks = []
    for member in range(k):
        block = torch.zeros(ws // k, layout.segment_numel, dtype=torch.float64)
        for i, full in enumerate(fulls):
            write_param_into_segments(full, block, layout.slots[i], member * (ws // k))
        blocks.append(block)
    gathered = torch.cat(blocks)
    for i, (full, (_, dim)) in enumerate(zip(fulls, cases, strict=True)):
        out = nan_buffer(*full.shape)
        copy_param_from_segments(out, gathered, layout.slots[i])
        assert torch.equal(out, full)
        for rank in range(ws):
            assert torch.equal(layout.shard_view(gathered[rank], i, rank), local_rows(full, rank, ws, dim))


@pytest.mark.parametrize(("shape", "dim"), [((3, 2), 2), ((3,), 1), ((3, 2), -1)])
def test_build_rejects_dims_out_of_range(shape: tuple[int, ...], dim: int) -> None:
    """The layout takes normalized dims in range (fully_shard normalizes negative ones before)."""
    with pytest.raises(ValueError, match="out of range"):
        FlatLayout.build([torch.Size(shape)], 2, [dim])


# ------------------------------------------------------------------------------------------ training on meshes
class Experts(nn.Module):
    """A dense mixture of 3 experts, as torchtitan lays them out: stacked (num_experts, ...) weights.

    Sharded on dim 1 (5 and 7 over 2 or 4 ranks: 3/2, 2/2/1/0, 4/3, 2/2/2/1) as torchtitan does when there are fewer
    experts than ranks.
    """

    def __init__(self, experts: int = 3, dim: int = 5, hidden: int = 7) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        hidden = torch.einsum("bd,edh->beh", x, self.w1).relu()
        out = torch.einsum("beh,ehd->bed", hidden, self.w2)
        return self.scale * (gates.unsqueeze(-1) * out).sum(1)


def _experts_placement(param: nn.Parameter) -> Shard | None:
    """Mixed in one unit: w1 on dim 1, w2 on dim -1 (2), the router's weight on Shard(0), the rest the default."""
    if param.ndim == 3:
        return Shard(1) if param.shape[1] == 5 else Shard(-1)
    return Shard(0) if param.ndim == 2 else None


def _experts_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, dp_rank: int, dp_size: int, micro: int
) -> None:
    """One AdamW step on this rank's slice of step ``step``'s global batch of 8 (in ``micro`` micro-batches)."""
    gen = torch.Generator().manual_seed(step)
    x, target = torch.randn(8, 5, generator=gen), torch.randn(8, 5, generator=gen)
    opt.zero_grad()
    xs, ts = dp_slice(x, dp_rank, dp_size).chunk(micro), dp_slice(target, dp_rank, dp_size).chunk(micro)
    for i, (mx, mt) in enumerate(zip(xs, ts, strict=True)):
        with fc.no_sync(model) if i < micro - 1 else contextlib.nullcontext():
            ((model(mx) - mt).pow(2).mean() / micro).backward()
    opt.step()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_experts(model: nn.Module, reference: nn.Module, dp_rank: int, dp_size: int, micro: int) -> float:
    opt, ref_opt = _adamw(model), _adamw(reference)
    for step in range(3):
        _experts_step(reference, ref_opt, step, 0, 1, 1)
        _experts_step(model, opt, step, dp_rank, dp_size, micro)
    return max_param_diff(model, reference)


def _experts_1d(rank: int, ws: int, reshard: bool | int, micro: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = Experts()
    model = copy.deepcopy(reference)
    fc.fully_shard(model, mesh=mesh_1d(ws), shard_placement_fn=_experts_placement, reshard_after_forward=reshard)
    ref = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    dims = {"router.weight": 0, "router.bias": 0, "w1": 1, "w2": 2}
    locals_ok = all(
        params[n].placements == (Shard(d),)
        and torch.equal(params[n].to_local(), chunk_or_empty(ref[n].detach(), rank, ws, d))
        and params[n].to_local().is_contiguous()
        for n, d in dims.items()
    )
    locals_ok = locals_ok and params["scale"].placements == (Replicate(),)
    text, compact = fc.describe(model), fc.describe(model, params=False)
    rows = [r"w1 +\(3, 5, 7\) +float32 +\(Shard\(1\),\)", r"w2 +\(3, 7, 5\) +float32 +\(Shard\(2\),\)"]
    described = all(re.search(row, text) for row in rows) and "1 sharded on dim 1, 1 sharded on dim 2" in compact
    return {"locals_ok": locals_ok, "described": described, "diff": _train_experts(model, reference, rank, ws, micro)}


@pytest.mark.parametrize(("ws", "reshard", "micro"), [(1, True, 1), (2, True, 2), (4, True, 1), (4, 2, 2)])
def test_mixed_dims_train_like_the_reference(run_dist, ws: int, reshard: bool | int, micro: int) -> None:
    """Shard(1), Shard(-1), Shard(0) and the default in one unit, uneven and empty chunks, AdamW: every local shard
    is torch.chunk's piece on its dim, and training (with no-sync accumulation, with resharding to a group of 2)
    matches the reference."""
    for r in run_dist(ws, _experts_1d, reshard, micro):
        assert r["locals_ok"] and r["described"]
        assert r["diff"] <= TOL


def _dim1(param: nn.Parameter) -> Shard | None:
    """torchtitan-like: every matrix on its dim 1. With width 15, 15 columns over 2 shard ranks are 8/7; under TP
    the colwise fc.weight keeps its 15 columns (8/7), the rowwise proj.weight's 60 become 30 per TP rank (15/15)."""
    return Shard(1) if param.ndim == 2 else None


def _gpt_on_mesh(rank: int, ws: int, kind: str) -> dict[str, Any]:
    cfg = GPTConfig(dim=15)
    reference, model = reference_and_copy(cfg)
    if kind == "hsdp":
        dp_mesh = mesh_nd((2, 2), ("replicate", "shard"))
    elif kind == "hsdp_tp":
        mesh = mesh_nd((2, 2, 2), ("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
        tp_mlps(model, mesh["tp"])
    else:
        mesh = mesh_nd((2, 2), ("dp", "tp"))
        dp_mesh = mesh["dp"]
        tp_mlps(model, mesh["tp"])
    shard_gpt(model, dp_mesh, shard_placement_fn=_dim1)
    placements = {n: p.placements for n, p in model.named_parameters()}
    full_ok = all(
        torch.equal(p.full_tensor(), dict(reference.named_parameters())[n]) for n, p in model.named_parameters()
    )
    columns = model.blocks[0].mlp.fc.weight.to_local().shape[1]  # 15 over the shard group: 8 or 7
    diff = train_on_dp_mesh(model, reference, cfg, dp_mesh)
    return {"placements": placements, "full_ok": full_ok, "columns": columns, "diff": diff}


def test_dim1_hsdp_2x2_trains_like_the_reference(run_dist) -> None:
    results = run_dist(4, _gpt_on_mesh, "hsdp")
    assert sorted(r["columns"] for r in results) == [7, 7, 8, 8]
    for r in results:
        assert r["placements"]["head.weight"] == (Replicate(), Shard(1))
        assert r["placements"]["blocks.0.ln1.weight"] == (Replicate(), Shard(0))
        assert r["full_ok"]
        assert r["diff"] <= TOL


def test_dim1_with_tensor_parallel_trains_like_the_reference(run_dist) -> None:
    """FSDP's Shard(1) over TP's colwise Shard(0) (different dims) and over rowwise Shard(1) (the same dim: a
    strided shard, as FSDP2 makes it)."""
    results = run_dist(4, _gpt_on_mesh, "tp")
    assert sorted(r["columns"] for r in results) == [7, 7, 8, 8]
    for r in results:
        mlp = "blocks.0.mlp"
        assert r["placements"][f"{mlp}.fc.weight"] == (Shard(1), Shard(0))
        assert r["placements"][f"{mlp}.proj.weight"] == (_StridedShard(1, split_factor=2), Shard(1))
        assert r["placements"]["head.weight"] == (Shard(1),)
        assert r["full_ok"]
        assert r["diff"] <= TOL


@pytest.mark.slow
def test_dim1_with_hsdp_and_tensor_parallel_3d(run_dist) -> None:
    results = run_dist(8, _gpt_on_mesh, "hsdp_tp")
    assert sorted(r["columns"] for r in results) == [7] * 4 + [8] * 4
    for r in results:
        assert r["placements"]["blocks.0.mlp.proj.weight"] == (Replicate(), _StridedShard(1, split_factor=2), Shard(1))
        assert r["full_ok"]
        assert r["diff"] <= TOL


def _unfrozen_and_offloaded(rank: int, ws: int) -> dict[str, Any]:
    """w1 frozen and kept whole under frozen_params="replicate", then unfrozen: the unit lays it out again on dim 1.
    With CPU offload, so the shards and their gradients live in host memory."""
    torch.manual_seed(0)
    reference = Experts()
    model = copy.deepcopy(reference)
    reference.w1.requires_grad_(False)
    model.w1.requires_grad_(False)
    fc.fully_shard(
        model,
        mesh=mesh_1d(ws),
        shard_placement_fn=_experts_placement,
        frozen_params="replicate",
        offload_policy=fc.CPUOffloadPolicy(),
    )
    whole_first = model.w1.placements == (Replicate(),)
    opt, ref_opt = _adamw(model), _adamw(reference)
    _experts_step(reference, ref_opt, 0, 0, 1, 1)
    _experts_step(model, opt, 0, rank, ws, 1)
    reference.w1.requires_grad_(True)
    model.w1.requires_grad_(True)
    for step in (1, 2):
        _experts_step(reference, ref_opt, step, 0, 1, 1)
        _experts_step(model, opt, step, rank, ws, 1)
    w1 = model.w1
    sharded_after = w1.placements == (Shard(1),) and torch.equal(
        w1.to_local(), chunk_or_empty(w1.full_tensor(), rank, ws, 1)
    )
    return {"whole_first": whole_first, "sharded_after": sharded_after, "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [2, 4])
def test_unfreezing_lays_out_on_the_chosen_dim(run_dist, ws: int) -> None:
    for r in run_dist(ws, _unfrozen_and_offloaded):
        assert r["whole_first"] and r["sharded_after"]
        assert r["diff"] <= TOL


class _ColumnsTP(nn.Module):
    """A (3, 13) weight that TP cuts on dim 1 (7/6 columns), gathered in forward (the same batch on both TP ranks
    gives each its own columns' gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
        return torch.tanh(x @ weight.T)


def _same_dim_uneven(rank: int, ws: int) -> dict[str, Any]:
    mesh = mesh_nd((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    reference = _ColumnsTP()
    model = copy.deepcopy(reference)
    model.weight = nn.Parameter(distribute_tensor(reference.weight.detach(), mesh["tp"], [Shard(1)]))
    fc.fully_shard(model, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    expected = chunk_or_empty(torch.chunk(reference.weight.detach(), 2, dim=1)[tp], dp, 2, 1)  # 7 -> 4/3, 6 -> 3/3
    weight = model.weight
    layout_ok = (
        weight.placements == (_StridedShard(1, split_factor=2), Shard(1))
        and torch.equal(weight.to_local(), expected)
        and torch.equal(weight.full_tensor(), reference.weight.detach())
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, target = torch.randn(8, 13, generator=gen), torch.randn(8, 3, generator=gen)
        ref_opt.zero_grad()
        (reference(x) - target).pow(2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        (model(dp_slice(x, dp, 2)) - dp_slice(target, dp, 2)).pow(2).mean().backward()
        opt.step()
    return {"layout_ok": layout_ok, "diff": max_param_diff(model, reference)}


def test_same_dim_as_tensor_parallel_with_uneven_sizes(run_dist) -> None:
    """FSDP's Shard(1) on a dim TP already cut unevenly: a strided shard whose full_tensor() is the original weight,
    and training matches the reference."""
    for r in run_dist(4, _same_dim_uneven):
        assert r["layout_ok"]
        assert r["diff"] <= TOL


# ------------------------------------------------------------------------------------------------ state dicts
def _full_round_trip(rank: int, ws: int) -> dict[str, Any]:
    """fc.full_state_dict of a trained Shard(1)/Shard(-1) model equals the reference's; loading it (broadcast from
    rank 0) into a differently initialized sharded model gives the same shards, and training continues alike."""
    torch.manual_seed(0)
    reference = Experts()
    model = copy.deepcopy(reference)
    fc.fully_shard(model, mesh=mesh_1d(ws), shard_placement_fn=_experts_placement)
    diff = _train_experts(model, reference, rank, ws, 1)
    full = fc.full_state_dict(model, rank0_only=False)
    expected = reference.state_dict()
    gathered = max((full[k] - expected[k]).abs().max().item() for k in expected)
    torch.manual_seed(1)
    other = Experts()
    fc.fully_shard(other, mesh=mesh_1d(ws), shard_placement_fn=_experts_placement)
    fc.load_full_state_dict(other, full if rank == 0 else {}, broadcast_from_rank0=True)
    same_shards = all(
        torch.equal(a.to_local(), b.to_local()) and a.placements == b.placements
        for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    opt, other_opt = _adamw(model), _adamw(other)
    _experts_step(model, opt, 5, rank, ws, 1)
    _experts_step(other, other_opt, 5, rank, ws, 1)
    return {"diff": diff, "gathered": gathered, "same_shards": same_shards, "after": max_param_diff(other, model)}


@pytest.mark.parametrize("ws", [2, 4])
def test_full_state_dict_round_trip(run_dist, ws: int) -> None:
    for r in run_dist(ws, _full_round_trip):
        assert r["diff"] <= TOL and r["gathered"] <= TOL
        assert r["same_shards"]
        assert r["after"] == 0.0


def _dcp_save(rank: int, ws: int, path: str) -> None:
    torch.manual_seed(0)
    model = Experts()
    fc.fully_shard(model, mesh=mesh_1d(ws), shard_placement_fn=_experts_placement)
    opt = _adamw(model)
    for step in range(2):
        _experts_step(model, opt, step, rank, ws, 1)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _dcp_load_and_continue(rank: int, ws: int, path: str, placed: bool) -> float:
    torch.manual_seed(7)  # other values: everything must come from the checkpoint
    model = Experts()
    fc.fully_shard(model, mesh=mesh_1d(ws), shard_placement_fn=_experts_placement if placed else None)
    opt = _adamw(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.manual_seed(0)
    reference = Experts()  # trains the 4 steps without a break
    ref_opt = _adamw(reference)
    for step in range(4):
        _experts_step(reference, ref_opt, step, 0, 1, 1)
        if step >= 2:
            _experts_step(model, opt, step, rank, ws, 1)
    return max_param_diff(model, reference)


@pytest.mark.parametrize(("save_ws", "load_ws", "placed"), [(2, 4, True), (4, 2, True), (2, 2, False)])
def test_dcp_round_trip_reshards(run_dist, tmp_path, save_ws: int, load_ws: int, placed: bool) -> None:
    """A DCP checkpoint of Shard(1)/Shard(-1) parameters (with AdamW state) loads on another world size, or into a
    model sharded on dim 0 everywhere, and training continues as if never interrupted."""
    run_dist(save_ws, _dcp_save, str(tmp_path / "ckpt"))
    assert max(run_dist(load_ws, _dcp_load_and_continue, str(tmp_path / "ckpt"), placed)) <= TOL


def _assigned_other_placements(rank: int, ws: int) -> str:
    """A Shard(0) DTensor assigned over a Shard(1) parameter holds other elements locally: the next step refuses
    it, naming the parameter, before any collective."""
    torch.manual_seed(0)
    model = Experts()
    fc.fully_shard(model, mesh=mesh_1d(ws), shard_placement_fn=_experts_placement)
    state = model.state_dict()
    state["w1"] = distribute_tensor(state["w1"].full_tensor(), mesh_1d(ws), [Shard(0)])
    model.load_state_dict(state, assign=True)
    with pytest.raises(
        ValueError, match=r"parameter 'w1' .* replaced by a DTensor with placements \(Shard\(dim=0\),\)"
    ):
        model(torch.randn(2, 5))
    return "raised"


def test_assigning_a_dtensor_of_other_placements_raises(run_dist) -> None:
    assert run_dist(2, _assigned_other_placements) == ["raised", "raised"]
