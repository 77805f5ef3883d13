"""Property-based tests for the pure sharding math in ``fsdp_compose.sharding`` (no processes, no collectives).

The all-gather and the reduce-scatter are emulated with plain tensor ops on ``(world_size, segment_numel)`` buffers,
so these properties check the layout itself: that every real row is written and read exactly once, in
``torch.chunk`` order, and that padding (pre-filled with NaN) is never read back as data.
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
    padded_rows,
    write_grad_into_segments,
    write_param_into_segments,
)

SETTINGS = settings(max_examples=200, deadline=None)
PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
world_sizes = st.integers(1, 8)


@st.composite
def dim0s(draw: st.DrawFn, ws: int) -> int:
    """Dim 0 sizes that stress chunking: 0, 1, fewer rows than ranks, primes, and anything up to 40."""
    return draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, ws - 1), st.sampled_from(PRIMES), st.integers(0, 40)))


@st.composite
def shapes(draw: st.DrawFn, ws: int) -> tuple[int, ...]:
    """A parameter shape: a chunking-hostile dim 0 plus 0..3 trailing dims of size 0..5."""
    return (draw(dim0s(ws)), *draw(st.lists(st.integers(0, 5), max_size=3)))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, list[tuple[int, ...]]]:
    """A world size and 1..5 parameter shapes."""
    ws = draw(world_sizes)
    return ws, draw(st.lists(shapes(ws), min_size=1, max_size=5))


def randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def nan_buffer(*size: int) -> torch.Tensor:
    return torch.full(size, float("nan"), dtype=torch.float64)


def chunk_or_empty(full: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """``torch.chunk(full, ws)[rank]``, or an empty ``(0, *trailing)`` tensor when chunk returned fewer pieces."""
    chunks = torch.chunk(full, ws)
    return chunks[rank] if rank < len(chunks) else full[:0]


@SETTINGS
@given(ws=world_sizes, data=st.data())
def test_chunk_rows_match_torch_chunk(ws: int, data: st.DataObject) -> None:
    """chunk_rows is torch.chunk's row counts padded with zeros to ws entries; padded_rows is their max."""
    dim0 = data.draw(dim0s(ws))
    expected = [c.shape[0] for c in torch.chunk(torch.empty(dim0), ws)]
    expected += [0] * (ws - len(expected))
    rows = chunk_rows(dim0, ws)
    assert rows == expected
    assert sum(rows) == dim0
    assert padded_rows(dim0, ws) == max(rows)  # 0 when dim0 == 0


@SETTINGS
@given(ws=world_sizes, data=st.data())
def test_local_rows_is_chunk_view(ws: int, data: st.DataObject) -> None:
    """local_rows(full, r, ws) equals torch.chunk(full, ws)[r] (or an empty slice) and shares full's storage."""
    full = randn(data.draw(shapes(ws)), 0)
    for rank in range(ws):
        mine = local_rows(full, rank, ws)
        expected = chunk_or_empty(full, rank, ws)
        assert mine.shape == expected.shape
        assert torch.equal(mine, expected)
        assert mine._base is full
        assert mine.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


@SETTINGS
@given(layouts())
def test_layout_invariants(case: tuple[int, list[tuple[int, ...]]]) -> None:
    """Slots are laid end to end in order, without overlap, and fill exactly segment_numel elements."""
    ws, shape_list = case
    layout = FlatLayout.build([torch.Size(s) for s in shape_list], ws)
    assert layout.world_size == ws
    assert len(layout.slots) == len(shape_list)
    offset = 0
    for slot, shape in zip(layout.slots, shape_list, strict=True):
        assert slot.shape == torch.Size(shape)
        assert slot.offset == offset  # increasing and non-overlapping: each starts where the previous ends
        assert slot.rows == padded_rows(shape[0], ws)
        assert slot.row_numel == torch.Size(shape[1:]).numel()
        offset += slot.numel
    assert layout.segment_numel == offset == sum(s.numel for s in layout.slots)


@pytest.mark.parametrize("shapes_", [[()], [(3, 2), ()]])
def test_build_rejects_zero_dim(shapes_: list[tuple[int, ...]]) -> None:
    """A 0-dim parameter has no dim 0 to shard, so the layout refuses it."""
    with pytest.raises(ValueError, match="0-dim"):
        FlatLayout.build([torch.Size(s) for s in shapes_], 2)


@SETTINGS
@given(layouts(), st.integers(0, 2**31))
def test_all_gather_round_trip(case: tuple[int, list[tuple[int, ...]]], seed: int) -> None:
    """Each rank writes its local_rows into its segment; stacking the segments (an all-gather) rebuilds every tensor.

    Segments start as NaN, so any padding position read back as data, or any row never written, fails torch.equal.
    Covers dim0 == 0 and empty trailing dims (row_numel == 0) too.
    """
    ws, shape_list = case
    fulls = [randn(s, seed + i) for i, s in enumerate(shape_list)]
    layout = FlatLayout.build([t.shape for t in fulls], ws)
    segments = []
    for rank in range(ws):
        segment = nan_buffer(layout.segment_numel)
        for i, full in enumerate(fulls):
            view = layout.shard_view(segment, i, rank)
            assert view.shape == chunk_or_empty(full, rank, ws).shape
            view.copy_(local_rows(full, rank, ws))
        segments.append(segment)
    gathered = torch.stack(segments)
    assert gathered.shape == (ws, layout.segment_numel)
    for i, full in enumerate(fulls):
        out = nan_buffer(*full.shape)
        copy_param_from_segments(out, gathered, layout.slots[i])
        assert torch.equal(out, full), f"param {i} shape {tuple(full.shape)} ws={ws}"


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same shape but non-contiguous strides (a transpose when 2-D or more)."""
    if t.dim() >= 2:
        out = torch.empty(t.transpose(0, -1).shape, dtype=t.dtype).transpose(0, -1)
    else:
        out = torch.empty((*t.shape, 2), dtype=t.dtype)[..., 0]
    out.copy_(t)
    return out


@SETTINGS
@given(layouts(), st.integers(0, 2**31), st.booleans())
def test_reduce_scatter_emulation(case: tuple[int, list[tuple[int, ...]]], seed: int, strided: bool) -> None:
    """Every rank copies its grads into a NaN-filled (ws, segment_numel) buffer; summing the buffers over ranks (a
    reduce-scatter) and taking row r gives rank r exactly torch.chunk(sum of grads, ws)[r] for every parameter.

    NaN padding cannot leak into real rows, and non-contiguous gradients (strided=True) are handled.
    """
    ws, shape_list = case
    layout = FlatLayout.build([torch.Size(s) for s in shape_list], ws)
    grads = [[randn(s, seed + 100 * r + i) for i, s in enumerate(shape_list)] for r in range(ws)]
    buffers = []
    for rank_grads in grads:
        buffer = nan_buffer(ws, layout.segment_numel)
        for i, g in enumerate(rank_grads):
            write_grad_into_segments(non_contiguous(g) if strided else g, buffer, layout.slots[i])
        buffers.append(buffer)
    reduced = torch.stack(buffers).sum(0)
    for i in range(len(shape_list)):
        total = torch.stack([rank_grads[i] for rank_grads in grads]).sum(0)
        for rank in range(ws):
            mine = layout.shard_view(reduced[rank], i, rank)
            expected = chunk_or_empty(total, rank, ws)
            assert mine.shape == expected.shape
            assert not mine.isnan().any(), f"padding leaked into param {i} rank {rank}"
            torch.testing.assert_close(mine, expected, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(layouts(), st.integers(0, 2**31), st.sampled_from([1.0, 2.0, 4.0]))
def test_accumulating_micro_batches_with_pre_divide(
    case: tuple[int, list[tuple[int, ...]]], seed: int, scale: float
) -> None:
    """Writing micro-batch 1 then adding micro-batch 2 (both pre-divided by ``scale``) into one float64 buffer from
    float32 gradients gives (g1 + g2) / scale in every real row: the no-sync accumulation path, cast included."""
    ws, shape_list = case
    layout = FlatLayout.build([torch.Size(s) for s in shape_list], ws)
    first = [randn(s, seed + i).float() for i, s in enumerate(shape_list)]
    second = [randn(s, seed + 1000 + i).float() for i, s in enumerate(shape_list)]
    buffer = nan_buffer(ws, layout.segment_numel)
    for i in range(len(shape_list)):
        write_grad_into_segments(first[i], buffer, layout.slots[i], scale=scale)
        write_grad_into_segments(second[i], buffer, layout.slots[i], accumulate=True, scale=scale)
    for i in range(len(shape_list)):
        total = (first[i].double() + second[i].double()) / scale
        for rank in range(ws):
            torch.testing.assert_close(
                layout.shard_view(buffer[rank], i, rank), chunk_or_empty(total, rank, ws), rtol=1e-6, atol=1e-6
            )


@SETTINGS
@given(layouts(), st.integers(0, 2**31), st.data())
def test_post_forward_blocks_rebuild_the_gathered_buffer(
    case: tuple[int, list[tuple[int, ...]]], seed: int, data: st.DataObject
) -> None:
    """reshard_after_forward=k: member j of a group keeps segments [j*W/k, (j+1)*W/k) cut from the full tensors;
    stacking the k blocks (the group's all-gather) gives every parameter back exactly."""
    ws, shape_list = case
    k = data.draw(st.sampled_from([d for d in range(1, ws + 1) if ws % d == 0]))
    per_member = ws // k
    fulls = [randn(s, seed + i) for i, s in enumerate(shape_list)]
    layout = FlatLayout.build([t.shape for t in fulls], ws)
    blocks = []
    for member in range(k):
        block = torch.zeros(per_member, layout.segment_numel, dtype=torch.float64)
        for i, full in enumerate(fulls):
            write_param_into_segments(full, block, layout.slots[i], member * per_member)
        blocks.append(block)
    gathered = torch.cat(blocks)
    for i, full in enumerate(fulls):
        out = nan_buffer(*full.shape)
        copy_param_from_segments(out, gathered, layout.slots[i])
        assert torch.equal(out, full), f"param {i} shape {tuple(full.shape)} ws={ws} k={k}"
    for rank in range(ws):  # and each segment holds exactly that rank's rows where its shard views point
        for i, full in enumerate(fulls):
            assert torch.equal(layout.shard_view(gathered[rank], i, rank), local_rows(full, rank, ws))
