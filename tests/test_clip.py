"""``clip_grad_norm_`` over sharded gradients against torch's on the unsharded model trained on the same global batch.

Every case runs the L2, L1 and inf norms with a ``max_norm`` far below the gradient norm, so clipping really scales
the gradients; the returned total norm and the clipped gradients (``full_tensor()``) must match the reference.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.clip import clip_grad_norm_
from tests.dist_utils import full_value, mesh_1d, mesh_nd, reference_and_copy, tp_mlps

TOL = 1e-5
NORMS = (2.0, 1.0, math.inf)
MAX_NORM = 1e-3  # far below every gradient norm here: the clip coefficient is < 1


def _count_all_reduces(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``fn()`` and the all-reduces it issued (``torch.distributed``'s and DTensor's functional ones)."""
    with fc.CollectiveRecorder() as recorder:
        result = fn()
    return result, recorder.counts()["all_reduce"]


def _compare(
    model: nn.Module,
    reference: nn.Module,
    backward: Callable[[nn.Module], None],
    ref_backward: Callable[[nn.Module], None],
    prepare: Callable[[nn.Module], None] | None = None,
) -> dict[str, Any]:
    """For each norm type: fresh backward on both, clip both, compare the totals and the clipped gradients."""
    out: dict[str, Any] = {"total_err": 0.0, "grad_err": 0.0, "totals": {}, "all_reduces": set(), "clipped": True}
    for norm_type in NORMS:
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        ref_backward(reference)
        backward(model)
        if prepare is not None:
            prepare(model)
        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type)
        total, calls = _count_all_reduces(lambda nt=norm_type: clip_grad_norm_(model.parameters(), MAX_NORM, nt))
        assert not isinstance(total, DTensor) and total.dtype == torch.float32 and total.dim() == 0
        out["clipped"] &= bool(ref_total > 5 * MAX_NORM)
        out["all_reduces"].add(calls)
        out["totals"][norm_type] = total.item()
        out["total_err"] = max(out["total_err"], abs(total.item() - ref_total.item()) / ref_total.item())
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        scale = max(g.abs().max().item() for g in ref_grads.values() if g is not None)
        for name, param in model.named_parameters():
            ref_grad = ref_grads[name]
            if param.grad is None or ref_grad is None:
                assert param.grad is None and ref_grad is None, name
                continue
            err = (full_value(param.grad) - ref_grad).abs().max().item() / scale
            out["grad_err"] = max(out["grad_err"], err)
    return out


def _gpt_compare(model: GPT, reference: GPT, dp_rank: int, dp_size: int) -> dict[str, Any]:
    inputs, targets = synthetic_batch(GPTConfig(), 8, 0)

    def backward(m: nn.Module) -> None:
        loss_fn(m(inputs.chunk(dp_size)[dp_rank]), targets.chunk(dp_size)[dp_rank]).backward()

    def ref_backward(m: nn.Module) -> None:
        loss_fn(m(inputs), targets).backward()

    return _compare(model, reference, backward, ref_backward)


def _check(results: list[dict[str, Any]], all_reduces: int | None = None) -> None:
    for r in results:
        assert r["clipped"]
        assert r["total_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r
        if all_reduces is not None:
            assert r["all_reduces"] == {all_reduces}, r["all_reduces"]
    for norm_type in NORMS:  # the same total on every rank
        assert len({r["totals"][norm_type] for r in results}) == 1


# ------------------------------------------------------------------------------------------------------ 1-D FSDP
def _fsdp_1d(rank: int, ws: int) -> dict[str, Any]:
    reference, model = reference_and_copy(GPTConfig())
    mesh = mesh_1d(ws)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    assert {p.placements for p in model.parameters()} == {(Shard(0),)}
    return _gpt_compare(model, reference, rank, ws)


@pytest.mark.parametrize("ws", [2, 4])
def test_fsdp_1d(run_dist, ws: int) -> None:
    _check(run_dist(ws, _fsdp_1d), all_reduces=1)  # every gradient on one shard group: one all-reduce


# ---------------------------------------------------------------------------------------------------------- HSDP
def _hsdp(rank: int, ws: int) -> dict[str, Any]:
    reference, model = reference_and_copy(GPTConfig())
    mesh = mesh_nd((2, 2), ("replicate", "shard"))
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    assert {p.placements for p in model.parameters()} == {(Replicate(), Shard(0))}
    dp_rank = mesh.get_local_rank(0) * 2 + mesh.get_local_rank(1)
    return _gpt_compare(model, reference, dp_rank, 4)


def test_hsdp_2x2(run_dist) -> None:
    _check(run_dist(4, _hsdp), all_reduces=1)  # the shard dim only: the replicate dim holds copies


# ----------------------------------------------------------------------------------------------------- FSDP + TP
def _fsdp_tp(rank: int, ws: int) -> dict[str, Any]:
    reference, model = reference_and_copy(GPTConfig())
    mesh = mesh_nd((2, 2), ("dp", "tp"))
    tp_mlps(model, mesh["tp"])
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh["dp"])
    fc.fully_shard(model, mesh=mesh["dp"])
    mlp = model.blocks[0].mlp
    assert mlp.fc.weight.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert mlp.proj.weight.placements == (Shard(0), Shard(1))
    assert mlp.proj.bias.placements == (Shard(0), Replicate())
    assert model.head.weight.placements == (Shard(0),)
    return _gpt_compare(model, reference, mesh["dp"].get_local_rank(), 2)


def test_fsdp_tp_2x2(run_dist) -> None:
    _check(run_dist(4, _fsdp_tp), all_reduces=2)  # the dp group, then the tp group


# ---------------------------------------------------------------------------------------------- HSDP + TP (3-D)
def _hsdp_tp_3d(rank: int, ws: int) -> dict[str, Any]:
    reference, model = reference_and_copy(GPTConfig())
    # Its TP slice equals the (dp, tp) mesh's that an earlier test used: torch may then give the TP parameters that
    # equal mesh object (another root), which fully_shard must accept (it compares meshes by value).
    mesh = mesh_nd((1, 2, 2), ("replicate", "shard", "tp"))
    tp_mlps(model, mesh["tp"])
    dp_mesh = mesh["replicate", "shard"]
    for block in model.blocks:
        fc.fully_shard(block, mesh=dp_mesh)
    fc.fully_shard(model, mesh=dp_mesh)
    assert model.blocks[1].mlp.fc.weight.placements == (Replicate(), _StridedShard(0, split_factor=2), Shard(0))
    return _gpt_compare(model, reference, mesh["shard"].get_local_rank(), 2)


def test_hsdp_tp_3d(run_dist) -> None:
    _check(run_dist(4, _hsdp_tp_3d), all_reduces=2)


# ------------------------------------------------------------------------------------------- units on three meshes
def _mixed_meshes(rank: int, ws: int) -> dict[str, Any]:
    """Block 0: FSDP + TP on (dp, tp); block 1: 4-way FSDP on a 1-D mesh; the root: HSDP (replicate, shard).

    All three average over the same global batch (a TP pair sees one dp slice twice), so they train like the
    reference; their gradients live on three different meshes, which torch's clip_grad_norm_ cannot combine.
    """
    reference, model = reference_and_copy(GPTConfig())
    tp_mesh = mesh_nd((2, 2), ("dp", "tp"))
    parallelize_module(model.blocks[0].mlp, tp_mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    fc.fully_shard(model.blocks[0], mesh=tp_mesh["dp"])
    fc.fully_shard(model.blocks[1], mesh=mesh_1d(4))
    fc.fully_shard(model, mesh=mesh_nd((2, 2), ("replicate", "shard")))
    meshes = {id(p.device_mesh) for p in model.parameters()}
    assert len(meshes) >= 3, len(meshes)
    out = _gpt_compare(model, reference, tp_mesh["dp"].get_local_rank(), 2)
    # What torch's own clip_grad_norm_ does with these gradients (reported, not asserted: it varies by version).
    model.zero_grad(set_to_none=True)
    inputs, targets = synthetic_batch(GPTConfig(), 8, 0)
    dp = tp_mesh["dp"].get_local_rank()
    loss_fn(model(inputs.chunk(2)[dp]), targets.chunk(2)[dp]).backward()
    try:
        torch_total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        out["torch"] = f"returned {full_value(torch_total).item():.6f} vs {out['totals'][2.0]:.6f}"
    except Exception as exc:
        out["torch"] = f"raised {type(exc).__name__}: {str(exc)[:200]}"
    return out


def test_units_on_different_meshes(run_dist) -> None:
    results = run_dist(4, _mixed_meshes)
    _check(results)
    # dp + tp of the 2-D mesh, the 1-D mesh's group and the HSDP shard group: one all-reduce each at most
    assert all(max(r["all_reduces"]) <= 4 for r in results)


# ------------------------------------------------------------------------------- a rank without gradients
def _rank_without_grads(rank: int, ws: int) -> tuple[float, float]:
    _, model = reference_and_copy(GPTConfig())
    mesh = mesh_1d(ws)
    fc.fully_shard(model, mesh=mesh)
    inputs, targets = synthetic_batch(GPTConfig(), 4, 0)
    loss_fn(model(inputs.chunk(ws)[rank]), targets.chunk(ws)[rank]).backward()
    local_sq = sum(p.grad.to_local().float().pow(2).sum().item() for p in model.parameters())
    if rank == 0:
        model.zero_grad(set_to_none=True)  # no gradients here: the DTensor parameters still join the all-reduce
        local_sq = 0.0
    shares = [torch.zeros(()) for _ in range(ws)]
    dist.all_gather(shares, torch.tensor(local_sq))
    expected = math.sqrt(sum(s.item() for s in shares))
    return clip_grad_norm_(model.parameters(), MAX_NORM).item(), expected


def test_a_rank_without_gradients_does_not_hang(run_dist) -> None:
    for total, expected in run_dist(2, _rank_without_grads):
        assert total == pytest.approx(expected, rel=TOL)


# ------------------------------------------------------------------------------- nan on one rank, Partial refused
def _nan_on_one_rank_and_partial(rank: int, ws: int) -> tuple[list[float], str]:
    mesh = mesh_1d(ws)
    param = nn.Parameter(distribute_tensor(torch.zeros(2 * ws, 3), mesh, [Shard(0)]))
    totals = []
    for nan_rank in range(ws):
        for norm_type in NORMS:
            # one rank holds a nan, the others a huge value: an all-reduce MAX that dropped the nan would give 1e30
            local = torch.full((2, 3), math.nan if rank == nan_rank else 1e30)
            param.grad = DTensor.from_local(local, mesh, [Shard(0)])
            totals.append(clip_grad_norm_([param], MAX_NORM, norm_type).item())
    partial = nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Replicate()]))
    partial.grad = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    with pytest.raises(ValueError, match="Partial") as info:  # local, before any collective: no rank hangs
        clip_grad_norm_([param, partial], MAX_NORM)
    return totals, str(info.value)


def test_nan_on_one_rank_reaches_every_rank_and_partial_is_refused(run_dist) -> None:
    for totals, message in run_dist(2, _nan_on_one_rank_and_partial):
        assert all(math.isnan(t) for t in totals), totals
        assert "redistribute it first" in message


# ------------------------------------------------------------------------------------------- plain parameters
class Tower(nn.Module):
    """A sharded part, a 0-dim parameter (replicated DTensor), an unused one, and an ignored (plain) ``side``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.unused = nn.Linear(3, 3)
        self.side = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.temperature + self.side(x)


def _ignored_params(rank: int, ws: int) -> dict[str, Any]:
    torch.manual_seed(1)
    reference = Tower()
    model = copy.deepcopy(reference)
    mesh = mesh_1d(ws)
    fc.fully_shard(model.a, mesh=mesh)
    fc.fully_shard(model, mesh=mesh, ignored_params={model.side.weight, model.side.bias})
    assert not isinstance(model.side.weight, DTensor)
    assert model.temperature.placements == (Replicate(),)
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(8, 7, generator=gen), torch.randn(8, 3, generator=gen)

    def backward(m: nn.Module) -> None:
        ((m(x.chunk(ws)[rank]) - target.chunk(ws)[rank]) ** 2).mean().backward()

    def ref_backward(m: nn.Module) -> None:
        ((m(x) - target) ** 2).mean().backward()

    def average_side(m: nn.Module) -> None:  # what DDP would do for the ignored parameters: the same on every rank
        for p in m.side.parameters():
            assert p.grad is not None and not isinstance(p.grad, DTensor)
            dist.all_reduce(p.grad)
            p.grad /= ws

    out = _compare(model, reference, backward, ref_backward, prepare=average_side)
    assert model.unused.weight.grad is None
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_plain_and_replicated_gradients_count_once(run_dist, ws: int) -> None:
    _check(run_dist(ws, _ignored_params), all_reduces=1)


# ------------------------------------------------------------------------------------- single process (no collectives)
def _plain_grads(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(4, 3), (0,), (5,), ()]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    params.append(nn.Parameter(torch.randn(2)))  # no gradient
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("foreach", [None, False, True])
def test_plain_gradients_match_torch(norm_type: float, foreach: bool | None) -> None:
    ours, theirs = _plain_grads(0), _plain_grads(0)
    total = clip_grad_norm_(ours, 0.5, norm_type, foreach=foreach)
    # torch's own raises for the inf-norm of an empty gradient (an empty shard is common): leave those out there
    expected = torch.nn.utils.clip_grad_norm_([p for p in theirs if p.numel()], 0.5, norm_type, foreach=foreach)
    torch.testing.assert_close(total, expected, rtol=TOL, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=TOL, atol=1e-7)


def test_single_tensor_and_no_clipping_below_max_norm() -> None:
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([3.0, 0.0, 4.0])
    assert clip_grad_norm_(param, 10.0).item() == pytest.approx(5.0)
    assert torch.equal(param.grad, torch.tensor([3.0, 0.0, 4.0]))  # coefficient clamped to 1


def test_empty_and_gradient_less_parameters() -> None:
    assert clip_grad_norm_([], 1.0).item() == 0.0
    assert clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0).item() == 0.0


def test_bf16_gradients_give_an_fp32_total() -> None:
    # accumulated in fp32: a bf16 running sum of 4096 squares would stall far below 64 * 0.1
    param = nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    param.grad = torch.full((4096,), 0.1, dtype=torch.bfloat16)
    total = clip_grad_norm_([param], 1.0)
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(64 * 0.1, rel=1e-2)
    assert param.grad.dtype == torch.bfloat16


def test_nonfinite() -> None:
    for norm_type in (2.0, math.inf):
        param = nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor([1.0, math.nan, 2.0])
        assert math.isnan(clip_grad_norm_([param], 1.0, norm_type).item())
        param.grad = torch.tensor([1.0, math.nan, 2.0])
        with pytest.raises(RuntimeError, match="non-finite"):
            clip_grad_norm_([param], 1.0, norm_type, error_if_nonfinite=True)
    param.grad = torch.tensor([1.0, math.inf, 0.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([param], 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -math.inf, math.nan])
def test_rejects_norm_types_without_a_total(norm_type: float) -> None:
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0, norm_type)
