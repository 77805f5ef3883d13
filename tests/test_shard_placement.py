"""``shard_placement_fn`` returning ``Shard(dim)`` for any dim: the layout math, and training against a reference.

The math tests emulate the all-gather and the reduce-scatter with plain tensor ops, as tests/test_sharding_math.py
does for dim 0, over any shape, shard dim and world size. The distributed tests train a model whose parameters are
sharded on dim 1 (uneven sizes: trailing ranks hold fewer or no columns) against a single-process reference, on 1-D
FSDP, HSDP and FSDP + TP meshes, and round-trip its state dicts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_compose.sharding import (
    FlatLayout,
    chunk_rows,
    copy_param_from_segments,
    local_rows,
    write_grad_into_segments,
    write_param_into_segments,
)

SETTINGS = settings(max_examples=150, deadline=None)
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
