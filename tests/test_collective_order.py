"""Every rank issues the same collectives in the same order on every process group, whatever its data did.

A rank's sequence is recorded by ``fc.CollectiveRecorder`` (every collective of the process); the test then compares
the sequences per process group across ranks, and trains against a single-process reference. The patterns: a unit
whose output reaches the loss on every rank, on some ranks only, or on none; kept or resharded after forward;
backward prefetch on or off; used twice in one forward; a backward that raises on every rank or on one rank only
(the user skips the step: the rank that raised calls ``fc.reset_step`` first, which completes its side of the step).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fsdp_compose as fc
from fsdp_compose.agreement import StepAbandoned
from tests.dist_utils import local_batch, max_param_diff, mesh_1d

Record = dict[str, list[tuple[str, int]]]


@contextlib.contextmanager
def _recording_collectives() -> Iterator[Record]:
    """(kind, numel) per process group name for every collective this process issues (``fc.CollectiveRecorder``)."""
    record: Record = {}
    with fc.CollectiveRecorder() as recorder:
        try:
            yield record
        finally:
            record.update({group: [(r.kind, r.numel) for r in rs] for group, rs in recorder.by_group().items()})


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class _Net(nn.Module):
    """input -> b0 -> (aux branch) -> b1 -> head; ``aux`` reaches the loss where ``use_aux`` says so."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.b0 = _Block(dim)
        self.aux = nn.Linear(dim, 3)
        self.b1 = _Block(dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor, twice: bool, aux_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # aux_first: the branch runs before every other unit, so it is the last unit in backward order and no
        # later unit's pre-backward passes the gather cursor over it
        aux = self.aux(x) if aux_first else None
        h = self.b0(self.inp(x))
        if aux is None:
            aux = self.aux(h)
        h = self.b1(h)
        if twice:
            h = self.b1(h)
        return self.head(h), aux


def _losses(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, twice: bool, use_aux: bool, aux_first: bool = False
) -> torch.Tensor:
    out, aux = model(x, twice, aux_first)
    loss = (out - y).pow(2).mean()
    return loss + aux.pow(2).mean() if use_aux else loss


def _uses_aux(rank: int, pattern: str) -> bool:
    return pattern == "all" or (pattern == "even" and rank % 2 == 0)


def _order(
    rank: int,
    ws: int,
    pattern: str,
    aux_keeps: bool,
    prefetch: bool,
    twice: bool,
    aux_first: bool = False,
    fail: str = "",
) -> dict[str, Any]:
    """``fail``: "" | "all" | "rank0": step 1's backward raises in b0 on those ranks, and every rank skips step 1."""
    torch.manual_seed(0)
    reference = _Net()
    model = _Net()
    model.load_state_dict(reference.state_dict())
    mesh = mesh_1d(ws)
    for name in ("b0", "aux", "b1"):
        keeps = name == "aux" and aux_keeps
        fc.fully_shard(getattr(model, name), mesh=mesh, reshard_after_forward=not keeps)
    fc.fully_shard(model, mesh=mesh)
    if not prefetch:
        for m in (model, model.b0, model.aux, model.b1):
            fc.set_modules_to_backward_prefetch(m, [])
            fc.set_modules_to_forward_prefetch(m, [])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with _recording_collectives() as record:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            inputs, targets = torch.randn(2 * ws, 6, generator=g), torch.randn(2 * ws, 2, generator=g)
            skipped = bool(fail) and step == 1
            if not skipped:
                _reference_step(reference, ref_opt, inputs, targets, ws, twice, pattern, aux_first)
            opt.zero_grad()
            x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
            raises = skipped and (fail == "all" or rank == 0)
            hook = model.b0.register_forward_hook(_raise_in_backward) if raises else None
            try:
                _losses(model, x, y, twice, _uses_aux(rank, pattern), aux_first).backward()
            except RuntimeError as error:  # _Boom here; StepAbandoned on the other ranks (the closing word)
                if not isinstance(error, _Boom | StepAbandoned) or not skipped:
                    raise
                fc.reset_step(model)  # before any other collective: this rank completes its side of the step
            finally:
                if hook is not None:
                    hook.remove()
            if not skipped:
                opt.step()
    return {"record": record, "diff": max_param_diff(model, reference)}


class _Boom(RuntimeError):
    pass


def _raise_in_backward(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    def boom(grad: torch.Tensor) -> None:
        raise _Boom("backward failed")

    output.register_hook(boom)


def _reference_step(
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    ws: int,
    twice: bool,
    pattern: str,
    aux_first: bool,
) -> None:
    ref_opt.zero_grad()
    # the average over ranks of each rank's loss on its slice: what data parallelism computes
    total = sum(
        _losses(
            reference,
            local_batch(inputs, r, ws),
            local_batch(targets, r, ws),
            twice,
            _uses_aux(r, pattern),
            aux_first,
        )
        for r in range(ws)
    )
    (total / ws).backward()
    ref_opt.step()


PATTERNS = [
    (pattern, aux_keeps, prefetch)
    for pattern in ("all", "even", "none")
    for aux_keeps in (False, True)
    for prefetch in (True, False)
]


@pytest.mark.parametrize(("pattern", "aux_keeps", "prefetch"), PATTERNS)
def test_same_collectives_in_the_same_order_on_every_rank(
    run_dist, pattern: str, aux_keeps: bool, prefetch: bool
) -> None:
    results = run_dist(2, _order, pattern, aux_keeps, prefetch, False)
    first = results[0]["record"]
    assert first, "nothing was recorded"
    for result in results:
        assert result["record"] == first
        assert result["diff"] <= 1e-5


@pytest.mark.parametrize("prefetch", [True, False])
def test_order_holds_at_four_ranks_with_a_unit_used_twice(run_dist, prefetch: bool) -> None:
    results = run_dist(4, _order, "even", True, prefetch, True)
    for result in results:
        assert result["record"] == results[0]["record"]
        assert result["diff"] <= 1e-5


@pytest.mark.parametrize("prefetch", [True, False])
def test_order_holds_for_a_unit_last_in_backward_used_on_some_ranks(run_dist, prefetch: bool) -> None:
    """The branch runs first in forward, so it is last in backward: no later pre-backward passes the gather cursor
    over it on the ranks whose loss misses it; the final callback must issue its all-gather there."""
    results = run_dist(2, _order, "even", False, prefetch, False, True)
    for result in results:
        assert result["record"] == results[0]["record"]
        assert result["diff"] <= 1e-5


@pytest.mark.parametrize("fail", ["all", "rank0"])
@pytest.mark.parametrize("ws", [2, 4])
def test_order_holds_through_a_backward_that_raises(run_dist, ws: int, fail: str) -> None:
    """Step 1's backward raises in b0 after the ranks whose loss used the kept branch issued its reduce-scatter
    (the others issue it only in the final callback, which never comes): every rank still issues the same
    collectives, and the step leaves nothing behind (`python -m tests.random_sweep --seeds 109 --ws 4` hung here)."""
    results = run_dist(ws, _order, "even", True, False, False, False, fail)
    for result in results:
        assert result["record"] == results[0]["record"]
        assert result["diff"] <= 1e-5


class _Outer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.inner = _Block(dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inner(h)
        return h + torch.tanh(self.lin(h))  # computed after inner: inner's output is not outer's


class _CheckpointedNet(nn.Module):
    """inp -> checkpoint(outer(inner)) -> b1 -> head, plus a kept branch reaching the loss on even ranks only."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.outer = _Outer(dim)
        self.b1 = _Block(dim)
        self.aux = nn.Linear(dim, 3)
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b1(checkpoint(self.outer, self.inp(x), use_reentrant=False))
        return self.head(h), self.aux(h)


def _checkpoint_around_order(rank: int, ws: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _CheckpointedNet()
    model = copy.deepcopy(reference)
    mesh = mesh_1d(ws)
    fc.fully_shard(model.outer.inner, mesh=mesh)
    fc.fully_shard(model.outer, mesh=mesh)
    # b1's reduce-scatter comes after aux's: a rank whose loss used aux blocks on aux's in b1's post-backward, until
    # the other ranks' final callback issues theirs
    fc.fully_shard(model.b1, mesh=mesh, reshard_after_forward=False)
    fc.fully_shard(model.aux, mesh=mesh, reshard_after_forward=False)
    # inp and head as one unit: first in forward, so its pre-backward (head's output) moves the gather cursor to the
    # end of the backward order before the recompute runs
    fc.fully_shard([model.inp, model.head], mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor, r: int) -> torch.Tensor:
        out, aux = net(x)
        value = (out - y).pow(2).mean()
        return value + aux.pow(2).mean() if r % 2 == 0 else value

    with _recording_collectives() as record:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            inputs, targets = torch.randn(2 * ws, 6, generator=g), torch.randn(2 * ws, 2, generator=g)
            ref_opt.zero_grad()
            total = sum(loss(reference, local_batch(inputs, r, ws), local_batch(targets, r, ws), r) for r in range(ws))
            (total / ws).backward()
            ref_opt.step()
            opt.zero_grad()
            loss(model, local_batch(inputs, rank, ws), local_batch(targets, rank, ws), rank).backward()
            opt.step()
    return {"record": record, "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [2, 4])
def test_order_holds_for_a_unit_recomputed_before_its_pre_backward(run_dist, ws: int) -> None:
    """A checkpoint around a unit that contains another: the inner unit's recompute runs before its own pre-backward
    hook. It starts its backward there (no second all-gather), so a rank that already blocks on a reduce-scatter its
    peers issue only in their final callback is not waited for (`python -m tests.random_sweep --seeds 407` hung
    here)."""
    results = run_dist(ws, _checkpoint_around_order)
    for result in results:
        assert result["record"] == results[0]["record"]
        assert result["diff"] <= 1e-5


def test_reduce_scatters_run_on_their_own_group(run_dist) -> None:
    """All-gathers and reduce-scatters of one shard group never share a process group."""
    results = run_dist(2, _order, "all", False, True, False)
    # (the step's agreement all-reduce, a few integers, may share a group with either)
    flat = ("all_gather", "reduce_scatter")
    kinds_per_group = {
        name: {kind for kind, _ in calls if kind in flat} for name, calls in results[0]["record"].items()
    }
    assert sorted(map(sorted, filter(None, kinds_per_group.values()))) == [["all_gather"], ["reduce_scatter"]]


class _LateFirst:
    """A reduce-scatter's work that reports itself still running until it is waited for, while the ones issued
    after it report what gloo says: the completion order an accelerator may show, where the oldest finishes last."""

    def __init__(self, work: Any, late: bool) -> None:
        self.work, self.late = work, late

    def wait(self) -> Any:
        self.late = False
        return self.work.wait()

    def is_completed(self) -> bool:
        return not self.late and self.work.wait()  # gloo completes a collective only once it is waited for


def _replica_all_reduce_order(rank: int, ws: int) -> dict[str, Any]:
    """HSDP 2x2 with three reduce-scatters in flight, the oldest always reported unfinished: the order in which this
    rank issues the replicas' all-reduces, as indices of the reduce-scatters whose rows they carry."""
    import fsdp_compose.grads as grads_module
    from tests.dist_utils import mesh_nd

    torch.manual_seed(0)
    blocks = nn.Sequential(*(_Block(6) for _ in range(4)), nn.Linear(6, 2))
    reference = copy.deepcopy(blocks)
    mesh = mesh_nd((2, 2), ("replicate", "shard"))
    for block in blocks[:4]:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(blocks, mesh=mesh, fsdp2_methods=True)
    blocks.set_reduce_scatter_max_input_buffers(3)  # type: ignore[operator]
    issued: list[int] = []  # data pointers of reduce-scatter outputs, in issue order
    reduced: list[int] = []
    original_rs, original_ar = grads_module.reduce_scatter_flat, grads_module.all_reduce

    def reduce_scatter(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        issued.append(output.data_ptr())
        return _LateFirst(original_rs(output, *args, **kwargs), late=len(issued) % 3 == 1)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced.append(len(issued) - 1 - issued[::-1].index(tensor.data_ptr()))  # memory is reused across steps
        return original_ar(tensor, *args, **kwargs)

    grads_module.reduce_scatter_flat, grads_module.all_reduce = reduce_scatter, all_reduce  # type: ignore[assignment]
    try:
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
            reference(x).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            blocks(local_batch(x, rank, ws)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        grads_module.reduce_scatter_flat, grads_module.all_reduce = original_rs, original_ar  # type: ignore[assignment]
    return {"reduced": reduced, "issued": len(issued), "diff": max_param_diff(blocks, reference)}


def test_replica_all_reduces_follow_the_reduce_scatter_order_whatever_completes_first(run_dist) -> None:
    for result in run_dist(4, _replica_all_reduce_order):
        assert result["reduced"] == list(range(result["issued"])), result
        assert result["diff"] <= 1e-5, result
