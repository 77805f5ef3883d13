"""The all-gather side stream, checked on CPU through the same code with recording stand-ins for streams and events.

On a CPU device ``fsdp_compose.collectives`` hands out no stream, so these tests substitute objects that log what the
engine asks of them, and a dispatch mode that notes on which stream every op was issued. They check the lifetime rule
of collectives.py: the side stream waits for the compute stream once, at the root's forward; the gathered buffers are
allocated on the side stream, and the copy-in and the collective run there; the compute stream waits for the side
stream's event before the copy-out reads the gathered buffer, and the side stream waits for an event recorded after
that copy-out before the buffer goes. Training still matches the single-process reference. (tests/test_stream_sim.py
checks the same rule op by op over every graph shape and the sweep's configurations.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_compose as fc
import fsdp_compose.collectives as streams_module
import fsdp_compose.step as step_module
import fsdp_compose.unit as unit_module
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import full_value, local_batch, mesh_1d, reference_and_copy, shard_gpt

BF16_TOL = 2e-2  # one step's gradients in bf16 compute against the fp32 reference


class _Stream:
    def __init__(self, name: str, log: list[tuple[Any, ...]], where: list[str]) -> None:
        self.name, self.log, self.where = name, log, where

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait_event", self.name, event.number))

    def __enter__(self) -> _Stream:
        self.where.append(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        self.where.pop()


class _Event:
    count = 0

    def __init__(self, stream: _Stream, log: list[tuple[Any, ...]]) -> None:
        _Event.count += 1
        self.number = _Event.count
        log.append(("record", stream.name, self.number))


class _OpsByStream(TorchDispatchMode):
    """(op name, stream it was issued on) for the ops that matter here, in order, interleaved with the log."""

    def __init__(self, log: list[tuple[Any, ...]], where: list[str]) -> None:
        super().__init__()
        self.log, self.where = log, where

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if name.startswith(("copy_", "_to_copy", "split_with_sizes_copy", "empty", "allgather", "_allgather")):
            self.log.append(("op", name, self.where[-1]))
        return func(*args, **(kwargs or {}))


def _gather_on_recording_streams(rank: int, ws: int) -> dict[str, Any]:
    log: list[tuple[Any, ...]] = []
    where = ["compute"]
    compute = _Stream("compute", log, where)
    saved = (step_module.side_stream, streams_module.current_stream, unit_module.record_event)
    step_module.side_stream = lambda device: _Stream("side", log, where)  # type: ignore[assignment,return-value]
    streams_module.current_stream = lambda device: compute  # type: ignore[assignment,return-value]
    unit_module.record_event = lambda device, stream=None: _Event(stream or compute, log)  # type: ignore[assignment,arg-type,return-value]
    try:
        cfg = GPTConfig()
        reference, model = reference_and_copy(cfg)
        policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        shard_gpt(model, mesh_1d(ws), mp_policy=policy)
        inputs, targets = synthetic_batch(cfg, 4, 0)
        loss_fn(reference(inputs), targets).backward()
        x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
        with _OpsByStream(log, where):
            loss_fn(model(x), y).backward()
    finally:
        step_module.side_stream, streams_module.current_stream, unit_module.record_event = saved  # type: ignore[assignment]
    diff = max(
        (full_value(p.grad) - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return {"log": log, "diff": diff, "units": len(model.blocks) + 1}


def _check(log: list[tuple[Any, ...]], units: int) -> None:
    waits = [i for i, e in enumerate(log) if e[0] == "wait_stream"]
    assert [log[i] for i in waits] == [("wait_stream", "side", "compute")]  # once: the root's forward
    side_ops = [i for i, e in enumerate(log) if e[0] == "op" and e[2] == "side"]
    assert side_ops and waits[0] < side_ops[0]
    issued = {e[2]: i for i, e in enumerate(log) if e[0] == "record" and e[1] == "side"}
    # blocks gathered in forward and again in backward, the root once
    assert len(issued) == 2 * (units - 1) + 1
    for number, at in issued.items():
        # the compute stream waits for the side stream's event before the copy-out reads the gathered buffer ...
        waited = log.index(("wait_event", "compute", number))
        copy_out = next(i for i, e in enumerate(log) if i > waited and e[0] == "op" and e[1].startswith("split_with"))
        assert at < waited < copy_out
        # ... and the side stream waits for an event recorded after the copy-out before the buffer goes back
        copied = next(i for i, e in enumerate(log) if i > copy_out and e[0] == "record" and e[1] == "compute")
        assert ("wait_event", "side", log[copied][2]) in log[copied:]
    casts = [log[i] for i in side_ops if log[i][1].startswith("copy_")]
    assert len(casts) == len(issued)  # the bf16 cast into each gathered buffer, on the side stream
    allocations = [log[i] for i in side_ops if log[i][1].startswith("empty")]
    assert len(allocations) == len(issued)  # each gathered buffer belongs to the side stream
    assert all(e[2] == "compute" for e in log if e[0] == "op" and e[1].startswith("split_with"))


@pytest.mark.parametrize("ws", [2])
def test_all_gather_copy_in_runs_on_a_side_stream_with_events(run_dist, ws: int) -> None:
    for result in run_dist(ws, _gather_on_recording_streams):
        _check(result["log"], result["units"])
        assert result["diff"] <= BF16_TOL


def test_cpu_devices_get_no_stream_and_no_event() -> None:
    cpu = torch.device("cpu")
    assert streams_module.side_stream(cpu) is None and streams_module.record_event(cpu) is None
    with streams_module.issued_on(None, cpu):
        ran = True
    assert ran
    streams_module.wait_for(None, cpu)  # nothing to wait for
