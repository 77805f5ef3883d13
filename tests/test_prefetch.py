"""Prefetch: all-gathers are issued in the configured order, results are unchanged, nothing is left in flight."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import fsdp_compose as fc
import fsdp_compose.unit as unit_module
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.grads import GradState
from fsdp_compose.unit import UnitState
from tests.dist_utils import (
    local_batch,
    mesh_1d,
    reference_and_copy,
    shard_gpt,
    train_pair,
    watching_reduce_scatters,
)


def _record_gathers(rank: int, ws: int, explicit: bool) -> dict[str, Any]:
    cfg = GPTConfig(n_layers=4)
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    units = {
        id(fc.get_state(m).params): name
        for name, m in [("root", model)] + [(f"b{i}", b) for i, b in enumerate(model.blocks)]
    }
    if explicit:
        fc.set_modules_to_forward_prefetch(model.blocks[0], [model.blocks[2], model.blocks[3]])
        fc.set_modules_to_forward_prefetch(model.blocks[1], [])
        fc.set_modules_to_backward_prefetch(model.blocks[3], [model.blocks[1], model.blocks[0]])
    issued: list[tuple[str, bool]] = []
    original = unit_module.UnitParams.start

    def recording(self: unit_module.UnitParams, dtype: torch.dtype, *, async_op: bool, stream: Any) -> None:
        if self.state is UnitState.SHARDED:
            issued.append((units[id(self)], async_op))
        original(self, dtype, async_op=async_op, stream=stream)

    inputs, targets = synthetic_batch(cfg, 4, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model(x), y).backward()  # the first step records the forward order
    opt.step()  # prefetches after a step must not be taken for stale gathers (each unit is gathered once)
    unit_module.UnitParams.start = recording  # type: ignore[method-assign]
    try:
        loss_fn(model(x), y).backward()
    finally:
        unit_module.UnitParams.start = original  # type: ignore[method-assign]
    states = [fc.get_state(m) for m in [model, *model.blocks]]
    left_in_flight = [s.params.state is UnitState.GATHERING or s.grads.state is not GradState.IDLE for s in states]
    return {"issued": issued, "left_in_flight": any(left_in_flight)}


@pytest.mark.parametrize("ws", [2])
def test_implicit_prefetch_gathers_the_next_unit_ahead(run_dist, ws: int) -> None:
    for r in run_dist(ws, _record_gathers, False):
        # forward: root, then each block prefetched (async) by the unit before it; backward: root first, so the
        # last block is prefetched by the root, and each block prefetches the one before it
        assert r["issued"] == [
            ("root", False),
            ("b0", True),
            ("b1", True),
            ("b2", True),
            ("b3", True),
            ("b3", True),
            ("b2", True),
            ("b1", True),
            ("b0", True),
        ]
        assert not r["left_in_flight"]


@pytest.mark.parametrize("ws", [2])
def test_explicit_prefetch_order(run_dist, ws: int) -> None:
    for r in run_dist(ws, _record_gathers, True):
        assert r["issued"] == [
            ("root", False),
            ("b0", True),  # root prefetches b0 (implicit)
            ("b2", True),
            ("b3", True),  # b0 prefetches b2 and b3 (explicit)
            ("b1", False),  # b1 was not prefetched, and prefetches nothing (explicit empty list)
            ("b3", True),  # backward: the root prefetches the last block (implicit) ...
            ("b1", True),
            ("b0", True),  # ... and b3 prefetches b1 and b0 (explicit)
            ("b2", False),  # nobody prefetched b2 for backward
        ]
        assert not r["left_in_flight"]


def _parity_without_prefetch(rank: int, ws: int) -> tuple[float, float]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    with_prefetch = train_pair(rank, ws, model, reference, cfg, steps=3)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    for m in [model, *model.blocks]:
        fc.set_modules_to_forward_prefetch(m, [])
        fc.set_modules_to_backward_prefetch(m, [])
    return with_prefetch, train_pair(rank, ws, model, reference, cfg, steps=3)


@pytest.mark.parametrize("ws", [2, 4])
def test_results_are_the_same_with_and_without_prefetch(run_dist, ws: int) -> None:
    for with_prefetch, without in run_dist(ws, _parity_without_prefetch):
        assert with_prefetch <= 1e-5 and without <= 1e-5


def _eval_between_steps(rank: int, ws: int) -> float:
    """A no_grad evaluation forward between training steps: prefetched units are consumed or freed."""
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    train_pair(rank, ws, model, reference, cfg, steps=1)
    with torch.no_grad():
        model(local_batch(synthetic_batch(cfg, 4, 9)[0], rank, ws))
    assert all(fc.get_state(m).params.state is not UnitState.UNSHARDED for m in [model, *model.blocks])
    return train_pair(rank, ws, model, reference, cfg, steps=2)


@pytest.mark.parametrize("ws", [2])
def test_evaluation_between_steps_with_prefetch(run_dist, ws: int) -> None:
    assert max(run_dist(ws, _eval_between_steps)) <= 1e-5


def _gathers_while_draining(rank: int, ws: int) -> dict[str, Any]:
    """Per backward of an accumulation window: the all-gathers issued (unit, async) and how many of them started
    while a reduce-scatter was in flight."""
    cfg = GPTConfig(n_layers=4)
    _, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), mp_policy=fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    named = [("root", model)] + [(f"b{i}", b) for i, b in enumerate(model.blocks)]
    units = {id(fc.get_state(m).params): name for name, m in named}
    all_units = [fc.get_state(m) for _, m in named]
    issued: list[tuple[str, bool]] = []
    overlapping: list[str] = []
    original = unit_module.UnitParams.start

    def recording(self: unit_module.UnitParams, dtype: torch.dtype, *, async_op: bool, stream: Any) -> None:
        if self.state is UnitState.SHARDED:
            issued.append((units[id(self)], async_op))
            if any(u.grads.state is GradState.REDUCE_SCATTERING for u in all_units):
                overlapping.append(units[id(self)])
        original(self, dtype, async_op=async_op, stream=stream)

    inputs, targets = synthetic_batch(cfg, 4, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    loss_fn(model(x), y).backward()  # records the forward order
    result: dict[str, Any] = {}
    unit_module.UnitParams.start = recording  # type: ignore[method-assign]
    try:
        for name, sync in [("no_sync", False), ("sync", True), ("plain", True)]:
            out = model(x)  # forward gathers are not recorded: only backward's
            issued.clear()
            overlapping.clear()
            with contextlib.nullcontext() if sync else fc.no_sync(model):
                loss_fn(out, y).backward()
            result[name] = {"issued": list(issued), "overlapping": list(overlapping)}
    finally:
        unit_module.UnitParams.start = original  # type: ignore[method-assign]
    return result


@pytest.mark.parametrize("ws", [2])
def test_backward_ending_an_accumulation_window_gathers_nothing_while_reducing(run_dist, ws: int) -> None:
    """Every unit holds its accumulation buffer then: backward gathers on demand only (no prefetch)."""
    prefetched = [("b3", True), ("b2", True), ("b1", True), ("b0", True)]
    for r in run_dist(ws, _gathers_while_draining):
        assert r["no_sync"]["issued"] == prefetched  # nothing reduces: the usual prefetch
        assert r["sync"]["issued"] == [("b3", False), ("b2", False), ("b1", False), ("b0", False)]
        # A reduce-scatter still in flight is no longer waited for before the next gather (another rank may issue
        # its side only in its final callback: tests/test_randomized.py found the deadlock); it is freed as soon as
        # it has completed, so overlap depends on timing and is not asserted.
        assert r["plain"]["issued"] == prefetched  # a step without accumulation prefetches as before


def _prefetch_point(rank: int, ws: int, point: str | None, micro_batches: int = 1) -> dict[str, Any]:
    """The state of block i-1 at two moments of block i's backward, the collectives, and the parity.

    ``start``: the gradient of block i's MLP output (its backward begins); ``midway``: the gradient of its attention
    output (the MLP's parameters, 2/3 of the block's bytes, have their gradients by then)."""
    cfg = GPTConfig(n_layers=4)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    if point is not None:
        fc.set_backward_prefetch_point(model, point)  # type: ignore[arg-type]
    seen: list[tuple[int, str, str]] = []

    def watch(i: int, moment: str) -> Any:
        def forward_hook(module: Any, args: Any, output: torch.Tensor) -> None:
            previous = fc.get_state(model.blocks[i - 1]).params
            output.register_hook(lambda g: seen.append((i, moment, previous.state.value)))

        return forward_hook

    for i in range(1, 4):
        model.blocks[i].mlp.register_forward_hook(watch(i, "start"))
        model.blocks[i].attn.register_forward_hook(watch(i, "midway"))
    with fc.CollectiveRecorder() as recorder:
        diff = train_pair(rank, ws, model, reference, cfg, steps=2, batch_size=8, micro_batches=micro_batches)
    return {"diff": diff, "seen": seen, "counts": recorder.counts()}


@pytest.mark.parametrize("ws", [2, 4])
def test_backward_prefetch_points(run_dist, ws: int) -> None:
    """fc.set_backward_prefetch_point: block i-1's all-gather is issued when block i's backward starts ("before"),
    once half of block i's parameter bytes have their gradients ("midway", the default: the first block of backward,
    with no reduce-scatter in flight; on gloo a reduce-scatter completes only when waited for, so the others go at
    their block's end), or once block i's backward is done ("after", also set by fc.set_backward_prefetch_post, here
    through no-sync micro-batches). Same results and collectives for every point."""
    results = {
        "before": run_dist(ws, _prefetch_point, "before"),
        "midway": run_dist(ws, _prefetch_point, None),
        "after": run_dist(ws, _prefetch_point, "after", 2),
    }
    gathered = ("gathering", "unsharded")
    for rank in range(ws):
        before, midway, after = (results[p][rank] for p in ("before", "midway", "after"))
        assert max(before["diff"], midway["diff"], after["diff"]) <= 1e-5
        assert before["counts"] == midway["counts"]
        assert all(state in gathered for _, _, state in before["seen"]), before["seen"]
        assert midway["seen"] and all(state == "sharded" for _, moment, state in midway["seen"] if moment == "start")
        assert all(state in gathered for i, moment, state in midway["seen"] if (i, moment) == (3, "midway"))
        assert after["seen"] and all(state == "sharded" for _, _, state in after["seen"]), after["seen"]
        assert after["counts"]["all_gather"] > 0


def test_backward_prefetch_point_rejects_unknown_points() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="point must be one of 'before', 'midway', 'after'"):
        fc.set_backward_prefetch_point(model, "early")  # type: ignore[arg-type]


def _reductions_in_flight(rank: int, ws: int, max_inputs: int) -> dict[str, Any]:
    """The most reduce-scatters issued and not yet waited for at once, over steps that accumulate two micro-batches."""
    from fsdp_compose.integrations.fsdp2 import (
        _set_reduce_scatter_max_input_buffers,  # model.set_... under fsdp2_methods=True
    )

    cfg = GPTConfig(n_layers=4)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    _set_reduce_scatter_max_input_buffers(model, max_inputs)
    in_flight: set[int] = set()
    most = 0

    def issued(work: Any, input: torch.Tensor) -> None:
        nonlocal most
        in_flight.add(id(work))
        most = max(most, len(in_flight))

    with watching_reduce_scatters(issued, lambda work: in_flight.discard(id(work))):
        diff = train_pair(rank, ws, model, reference, cfg, steps=2, batch_size=8, micro_batches=2)
    return {"diff": diff, "most": most}


@pytest.mark.parametrize("ws", [2, 4])
def test_window_bounds_reductions_of_accumulated_gradients(run_dist, ws: int) -> None:
    """The backward that ends a no-sync window reduce-scatters buffers filled in place (no new input is staged):
    on CPU, where each reduction in flight holds gloo's copy of its input, the window still bounds them
    (``set_reduce_scatter_max_input_buffers``: n older ones at most when the next is issued)."""
    for max_inputs in (1, 2):
        for r in run_dist(ws, _reductions_in_flight, max_inputs):
            assert r["diff"] <= 1e-5
            assert r["most"] <= max_inputs, (max_inputs, r["most"])


def _reductions_in_flight_at_staging(rank: int, ws: int) -> dict[str, Any]:
    """Reduce-scatters issued and not yet waited for, once each unit's input is filled and when each is issued, with
    every collective reported as not completed (as if gloo were always slower than the next unit's backward)."""
    import torch.distributed as dist

    from fsdp_compose.grads import ReduceScatterInput

    cfg = GPTConfig(n_layers=4)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    in_flight: set[int] = set()
    at_staging: list[int] = []
    at_issue: list[int] = []
    stage_all = ReduceScatterInput.stage_all

    def staging(self: ReduceScatterInput, *args: Any, **kwargs: Any) -> bool:
        staged = stage_all(self, *args, **kwargs)
        if staged:
            at_staging.append(len(in_flight))
        return staged

    def issued(work: Any, input: torch.Tensor) -> None:
        at_issue.append(len(in_flight))
        in_flight.add(id(work))

    is_completed = dist.Work.is_completed
    ReduceScatterInput.stage_all = staging  # type: ignore[method-assign]
    dist.Work.is_completed = lambda self: False  # type: ignore[method-assign]
    try:
        with watching_reduce_scatters(issued, lambda work: in_flight.discard(id(work))):
            diff = train_pair(rank, ws, model, reference, cfg, steps=2, batch_size=8)
    finally:
        ReduceScatterInput.stage_all = stage_all  # type: ignore[method-assign]
        dist.Work.is_completed = is_completed  # type: ignore[method-assign]
    return {"diff": diff, "at_staging": at_staging, "at_issue": at_issue}


@pytest.mark.parametrize("ws", [2, 4])
def test_cpu_window_waits_before_the_issue_not_the_filling(run_dist, ws: int) -> None:
    """On CPU the window's wait for the previous reduce-scatter comes right before the next one is issued, not before
    its input is filled: the reduction runs on during the filling (docs/schedule.md). Reductions are reported as not
    completed here, so what is in flight shows where the library waited. Per step, in backward order (blocks 3 to 0,
    then the root): blocks 2 and 1 waited midway, before their midway prefetch (which must not live next to an older
    reduction), so they fill with nothing in flight; blocks 0 and the root, which prefetch nothing, fill while the
    previous reduction still runs. At every issue none is in flight (the window's default, 1)."""
    for r in run_dist(ws, _reductions_in_flight_at_staging):
        assert r["diff"] <= 1e-5
        assert r["at_issue"] == [0] * 10, r["at_issue"]  # two steps, five units each
        assert r["at_staging"] == [0, 0, 0, 1, 1] * 2, r["at_staging"]


def _states_at_reduce_scatters(rank: int, ws: int) -> dict[str, Any]:
    """Each block's unit state whenever a reduce-scatter is issued, with every all-gather reported late: as if none
    had arrived by the end of the unit that prefetched it."""
    cfg = GPTConfig(n_layers=4)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    units = [fc.get_state(block).params for block in model.blocks]
    snapshots: list[list[str]] = []
    original = unit_module.UnitParams.arrived
    unit_module.UnitParams.arrived = lambda self: False  # type: ignore[method-assign]
    try:
        issued = lambda work, input: snapshots.append([u.state.value for u in units])  # noqa: E731
        with watching_reduce_scatters(issued, lambda work: None):
            diff = train_pair(rank, ws, model, reference, cfg, steps=2, batch_size=8)
    finally:
        unit_module.UnitParams.arrived = original  # type: ignore[method-assign]
    return {"diff": diff, "snapshots": snapshots}


@pytest.mark.parametrize("ws", [2, 4])
def test_midway_prefetch_lands_before_the_reduce_scatter_even_when_late(run_dist, ws: int) -> None:
    """A unit's midway prefetch is copied out at the unit's end, before its reduce-scatter is issued, also on CPU
    where that means waiting for the all-gather: every reduction before the unit's is issued by then, so no peer can
    be waiting on this rank. Otherwise a late all-gather's output met the reduce-scatter (the peak moved from step
    to step with gloo's timing). Block i's reduce-scatter (the k-th of a step, k = 4 - i) finds block i-1 copied out."""
    for r in run_dist(ws, _states_at_reduce_scatters):
        assert r["diff"] <= 1e-5
        steps = [r["snapshots"][k : k + 5] for k in range(0, len(r["snapshots"]), 5)]  # 4 blocks + the root
        assert len(steps) == 2 and all(len(step) == 5 for step in steps), r["snapshots"]
        for step in steps:
            for k, block in enumerate((2, 1, 0)):
                assert step[k][block] == "unsharded", (k, step)
