"""Where the host waits for the device: only at the end of backward, and only through an event.

On a CPU device nothing is pending, so ``fsdp_compose.collectives.record_event`` returns None; these tests substitute a
recording event to check, through the same code as on an accelerator, that every device-to-host read of a backward
(the "had a gradient" flags of a rank that lacked a gradient the backward's agreement could not promise, the offloaded
gradients) is covered by an event that is
waited for once, in the final callback. Casts under offload plus mixed precision happen on the compute device, and
inputs move to the device with a blocking copy, as DDP moves them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_compose as fc
import fsdp_compose.delivery as delivery_module
import fsdp_compose.grads as grads_module
import fsdp_compose.step as step_module
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.step import StepContext
from tests.dist_utils import full_value, local_batch, mesh_1d, reference_and_copy, shard_gpt

SGD_TOL = 1e-5


class _Branchy(nn.Module):
    """Every rank runs ``extra`` (its all-gather must match), only rank 0's loss uses it. The backward's agreement
    tells the other ranks that rank 0 will have its gradients; ``extra.unused`` (``with_unused``) gets one on no rank,
    which no rank can promise: its unit's reduce-scatter carries flags, and every rank reads them."""

    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)
        if with_unused:
            self.extra.unused = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.body(x)
        extra = self.extra(x)
        return y + extra if use_extra else y


class _RecordingEvent:
    def __init__(self, log: list[tuple[str, bool]], where: dict[str, bool]) -> None:
        self.log, self.where = log, where
        log.append(("record", where["final"]))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.where["final"]))


def _with_recording_events(run: Any) -> list[tuple[str, bool]]:
    """Run ``run()`` with recording events; returns (what, inside the final callback) per event call."""
    log: list[tuple[str, bool]] = []
    where = {"final": False}
    real_record, real_final = delivery_module.record_event, StepContext._final_callback

    def final(self: StepContext) -> None:
        where["final"] = True
        try:
            real_final(self)
        finally:
            where["final"] = False

    delivery_module.record_event = lambda device: _RecordingEvent(log, where)  # type: ignore[assignment,return-value]
    StepContext._final_callback = final  # type: ignore[method-assign]
    try:
        run()
    finally:
        delivery_module.record_event = real_record
        StepContext._final_callback = real_final  # type: ignore[method-assign]
    return log


def _missing_flags(rank: int, ws: int, with_unused: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Branchy(with_unused)
    reference = copy.deepcopy(model)
    fc.fully_shard(model.extra, mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws))
    x = torch.randn(2 * ws, 6)
    # the reference: rank 0's rows through body + extra, the others' through body only (summed losses / ws)
    parts = x.chunk(ws)
    ref_loss = sum(reference(p, use_extra=r == 0).square().sum() for r, p in enumerate(parts)) / ws
    ref_loss.backward()

    def step() -> None:
        model(parts[rank], use_extra=rank == 0).square().sum().backward()

    log = _with_recording_events(step)
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    diffs = [(full_value(p.grad) - q.grad).abs().max().item() for p, q in pairs if q.grad is not None]
    nones = [(p.grad is None, q.grad is None) for p, q in pairs]
    return {"log": log, "diff": max(diffs), "nones": nones}


@pytest.mark.parametrize("ws", [2, 4])
def test_gradients_promised_by_the_agreement_need_no_host_read(run_dist, ws: int) -> None:
    for result in run_dist(ws, _missing_flags, False):
        assert result["log"] == []  # ranks without extra's gradients know rank 0 has them: nothing to read
        assert result["diff"] <= SGD_TOL
        assert all(ours == theirs for ours, theirs in result["nones"])


@pytest.mark.parametrize("ws", [2, 4])
def test_flag_reads_wait_for_an_event_in_the_final_callback(run_dist, ws: int) -> None:
    for result in run_dist(ws, _missing_flags, True):
        log = result["log"]
        # every rank lacks extra.unused: one delivery (extra's unit) reads flags, one event, waited for once, at the
        # end of backward
        assert [what for what, _ in log] == ["record", "synchronize"] and log[1][1], log
        assert result["diff"] <= SGD_TOL
        assert (True, True) in result["nones"]  # extra.unused keeps .grad None, as in the reference
        assert all(ours == theirs for ours, theirs in result["nones"])


def _offloaded(rank: int, ws: int) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), offload_policy=fc.CPUOffloadPolicy())
    inputs, targets = synthetic_batch(cfg, 4, 0)
    loss_fn(reference(inputs), targets).backward()
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    log = _with_recording_events(lambda: loss_fn(model(x), y).backward())
    diffs = [
        (full_value(p.grad) - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    return {"log": log, "units": len(model.blocks) + 1, "diff": max(diffs)}


@pytest.mark.parametrize("ws", [1, 2])
def test_offloaded_gradient_copies_wait_for_events_in_the_final_callback(run_dist, ws: int) -> None:
    for result in run_dist(ws, _offloaded):
        records = [inside for what, inside in result["log"] if what == "record"]
        waits = [inside for what, inside in result["log"] if what == "synchronize"]
        assert len(records) == len(waits) == result["units"]  # one device-to-host copy per unit, each waited for
        assert not all(records)  # the blocks' copies start during backward, before the final callback
        assert all(waits)  # and the host waits for none of them before it
        assert result["diff"] <= SGD_TOL


class _CopiesFrom(TorchDispatchMode):
    """Every copy or conversion whose source is one of ``sources`` (storages): (source dtype, result dtype)."""

    def __init__(self, sources: set[int]) -> None:
        super().__init__()
        self.sources = sources
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if src.untyped_storage().data_ptr() in self.sources:
                self.seen.append((src.dtype, out.dtype))
        return out


class _Tempered(nn.Module):
    """A GPT block stack with a 0-dim temperature: a parameter kept whole (copied, not all-gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.temperature


def _offload_casts(rank: int, ws: int) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    model = _Tempered()
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fc.fully_shard(model, mesh=mesh_1d(ws), mp_policy=policy, offload_policy=fc.CPUOffloadPolicy())
    unit = fc.get_state(model).params
    sources = {unit.shards.flat.untyped_storage().data_ptr()}
    sources |= {mp.sharded._local_tensor.untyped_storage().data_ptr() for mp in unit.shards.params if mp.slot is None}
    mode = _CopiesFrom(sources)
    with mode:
        model(torch.randn(2, 8)).sum().backward()
    return [(str(a), str(b)) for a, b in mode.seen]


@pytest.mark.parametrize("ws", [1, 2])
def test_offload_with_mixed_precision_casts_on_the_compute_device(run_dist, ws: int) -> None:
    for seen in run_dist(ws, _offload_casts):
        # the flat shard and the kept-whole temperature each leave host memory once, in their own dtype
        assert seen == [("torch.float32", "torch.float32")] * 2, seen


class _Copies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.non_blocking: list[bool] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default:
            self.non_blocking.append(bool((kwargs or {}).get("non_blocking", False)))
        return func(*args, **(kwargs or {}))


def _input_copies(rank: int, ws: int) -> list[bool]:
    model = nn.Linear(4, 4)
    fc.fully_shard(model, mesh=mesh_1d(ws))
    ctx = fc.get_state(model).step
    assert ctx is None
    model(torch.randn(2, 4))  # lazy init builds the step context
    ctx = fc.get_state(model).step
    assert ctx is not None
    # The CPU root copies nothing; moving to another device (meta stands in for an accelerator) must block.
    ctx.root.device = torch.device("meta")
    mode = _Copies()
    with mode:
        moved = step_module._to_device(ctx.root.device, torch.randn(2, 4))
    assert moved.device.type == "meta"
    return mode.non_blocking


def test_inputs_move_with_a_blocking_copy(run_dist) -> None:
    assert run_dist(1, _input_copies) == [[False]]


def _order_of_backward(rank: int, ws: int, case: str) -> dict[str, Any]:
    """The backward's collectives and the host's wait for the agreement, in the order they happen; and the
    parameters after two SGD steps against the reference."""
    import fsdp_compose.agreement as schedule_module

    cfg = GPTConfig(n_layers=3)
    reference, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws))
    if case == "checks":
        fc.set_collective_checks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    events: list[str] = []
    original = schedule_module.PendingAgreement.result
    wait_reduce_scatter = grads_module.UnitGradients._wait_reduce_scatter

    def result(self: Any, also: Any = None) -> Any:
        if not self.known:
            events.append("agreement waited")
        return original(self, also)

    def waited(self: Any, flight: Any) -> None:
        events.append("reduce_scatter waited")
        wait_reduce_scatter(self, flight)

    orders = []
    schedule_module.PendingAgreement.result = result  # type: ignore[method-assign]
    grads_module.UnitGradients._wait_reduce_scatter = waited  # type: ignore[method-assign]
    try:
        for step in range(2):
            x, y = synthetic_batch(cfg, 4, step)
            loss_fn(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = loss_fn(model(local_batch(x, rank, ws)), local_batch(y, rank, ws))
            events.clear()
            with fc.CollectiveRecorder(observer=lambda record, *_: events.append(record.kind)):
                loss.backward()
            orders.append(list(events))
            opt.step()
            opt.zero_grad()
    finally:
        schedule_module.PendingAgreement.result = original  # type: ignore[method-assign]
        grads_module.UnitGradients._wait_reduce_scatter = wait_reduce_scatter  # type: ignore[method-assign]
    from tests.dist_utils import max_param_diff

    return {"orders": orders, "diff": max_param_diff(model, reference)}


@pytest.mark.parametrize("ws", [2, 4])
def test_backward_issues_every_collective_before_it_waits_for_the_agreement(run_dist, ws: int) -> None:
    """The common path (every unit reached, every trainable parameter expects a gradient): the host reads the
    backward's agreement only in the final callback, after every all-gather and reduce-scatter of the backward. The
    closing word (the backward's second all-reduce) goes out right after the last reduce-scatter, before the wait
    for it, so the two complete side by side; the host reads both in one transfer (on an accelerator, one wait)."""
    for result in run_dist(ws, _order_of_backward, "plain"):
        for order in result["orders"]:
            assert order.count("agreement waited") == 1, order
            waited = order.index("agreement waited")
            issued = [i for i, kind in enumerate(order) if kind in ("all_gather", "reduce_scatter")]
            assert order.count("reduce_scatter") == 4 and issued and max(issued) < waited, order
            closing_word = len(order) - 1 - order[::-1].index("all_reduce")
            assert order.count("all_reduce") == 2 and closing_word == max(issued) + 1, order
            last_wait = len(order) - 1 - order[::-1].index("reduce_scatter waited")
            assert closing_word < last_wait, order
        assert result["diff"] <= SGD_TOL


def test_collective_checks_wait_for_the_agreement_first(run_dist) -> None:
    """With collective checks on the fingerprints are compared before anything of the backward is issued."""
    for result in run_dist(2, _order_of_backward, "checks"):
        for order in result["orders"]:
            first = next(i for i, kind in enumerate(order) if kind in ("all_gather", "reduce_scatter"))
            assert order.index("agreement waited") < first, order
        assert result["diff"] <= SGD_TOL
