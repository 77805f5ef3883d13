"""The step as a program (fsdp_compose/program.py): what a backward issues is what its program lists.

The walk runs the program's two paths (and checks each unit's all-gather against its step). These tests check it
from outside: every collective torch.distributed sees during each backward (``fc.CollectiveRecorder``), per
process group and in order, equals the program compiled for that backward (kind, group size, dtype, elements), on
every rank, for every graph shape of tests/test_graph_shapes.py. And the program ``fc.describe_schedule`` prints
before any step runs is what a plain step issues.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import fsdp_compose as fc
import fsdp_compose.step as step_module
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from fsdp_compose.program import Operation, Program
from tests import test_graph_shapes as shapes
from tests.dist_utils import local_batch, mesh_1d, mesh_nd

_KINDS = {"agreement": "all_reduce", "closing_word": "all_reduce"}


def _as_issued(op: Operation) -> tuple[Any, ...]:
    return (_KINDS.get(op.kind, op.kind), op.group, op.group_size, op.dtype, op.numel)


@contextlib.contextmanager
def _backwards_recorded() -> Iterator[tuple[list[Program], fc.CollectiveRecorder]]:
    """Record every collective, labelled with the backward it belongs to (from its program's compilation to its
    closing word), and each backward's program."""
    programs: list[Program] = []
    recorder = fc.CollectiveRecorder(functional=False)
    compile_, close = step_module.backward_program, step_module.StepContext._closing_word

    def compiled(*args: Any, **kwargs: Any) -> Program:  # a backward's first hook compiles its program
        program = compile_(*args, **kwargs)
        programs.append(program)
        recorder.label = f"backward {len(programs) - 1}"
        return program

    def closed(step: Any, *, abandoning: bool) -> list[int]:
        try:
            return close(step, abandoning=abandoning)  # type: ignore[return-value]
        finally:
            recorder.label = ""

    step_module.backward_program, step_module.StepContext._closing_word = compiled, closed  # type: ignore[assignment,method-assign]
    try:
        with recorder:
            yield programs, recorder
    finally:
        step_module.backward_program, step_module.StepContext._closing_word = compile_, close  # type: ignore[method-assign]


def _mismatches(programs: list[Program], recorder: fc.CollectiveRecorder) -> list[str]:
    """Per backward and process group: the issued collectives against the program (its agreement, issued before
    the program could be compiled, left out)."""
    found = []
    for index, program in enumerate(programs):
        issued: dict[str, list[tuple[Any, ...]]] = {}
        for record in recorder.records:
            if record.label == f"backward {index}":
                issued.setdefault(record.group, []).append(
                    (record.kind, record.group, record.group_size, record.dtype, record.numel)
                )
        planned = {
            group: [_as_issued(op) for op in ops if op.kind != "agreement"] for group, ops in program.channels.items()
        }
        planned = {group: ops for group, ops in planned.items() if ops}
        for group in sorted(set(planned) | set(issued)):
            want, got = planned.get(group, []), issued.get(group, [])
            # an extension or a gather plan sizes its collective: the program says None
            same = len(want) == len(got) and all(
                w[:4] == g[:4] and (w[4] is None or w[4] == g[4]) for w, g in zip(want, got, strict=True)
            )
            if not same:
                found.append(f"backward {index}, group {group}: program {want}, issued {got}")
    return found


def _checked(rank: int, ws: int, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    with _backwards_recorded() as (programs, recorder):
        fn(rank, ws, *args)
    return {"backwards": len(programs), "mismatches": _mismatches(programs, recorder)}


SHAPES = [
    (shapes._chunked, (4,), (1, 2, 4)),
    (shapes._twice, (), (2, 4)),
    (shapes._dataclass, (), (1, 2)),
    (shapes._partial_group, (), (1, 2)),
    (shapes._eval_between, (), (1, 2)),
    (shapes._forward_method, (), (1, 2)),
    (shapes._fails_on_rank0, ("loss",), (2, 4)),
    (shapes._fails_on_rank0, ("forward",), (2, 4)),
    (shapes._kept_branch_accumulation, (), (2, 4)),
    (shapes._reentrant, ("fc", False, False), (1, 2, 4)),
    (shapes._reentrant, ("fc", True, False), (2, 4)),
    (shapes._reentrant, ("fc", True, True), (2, 4)),
    (shapes._reentrant_modes, ("no_sync",), (2,)),
    (shapes._reentrant_modes, ("bf16",), (2,)),
    (shapes._reentrant_modes, ("hsdp",), (4,)),
    (shapes._unit_inside_a_region, (), (1, 2)),
]
CASES = [
    pytest.param(fn, args, ws, id=f"{fn.__name__.strip('_')}{'-' + '-'.join(map(str, args)) if args else ''}-{ws}")
    for fn, args, sizes in SHAPES
    for ws in sizes
]


@pytest.mark.parametrize(("fn", "args", "ws"), CASES)
def test_every_backward_issues_its_program(run_dist, fn: Callable[..., Any], args: tuple[Any, ...], ws: int) -> None:
    for rank, result in enumerate(run_dist(ws, _checked, fn, *args)):
        assert result["backwards"] > 0, (rank, result)
        assert result["mismatches"] == [], (rank, result)


def _per_kind(program: Program) -> dict[str, list[tuple[Any, ...]]]:
    found: dict[str, list[tuple[Any, ...]]] = {}
    for op in program.operations():
        found.setdefault(op.kind, []).append((op.unit, op.group_size, op.dtype, op.numel))
    return found


def _printed_then_run(rank: int, ws: int, hsdp: bool) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = mesh_nd((2, ws // 2), ("replicate", "shard")) if hsdp else mesh_1d(ws)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    printed = fc.describe_schedule(model)
    root = fc.get_state(model)
    assert root is not None
    inputs, targets = synthetic_batch(cfg, 2 * ws, 0)
    x, y = local_batch(inputs, rank, ws), local_batch(targets, rank, ws)
    with _backwards_recorded() as (programs, recorder):
        loss = loss_fn(model(x), y)
        loss.backward()
    assert root.step is not None
    full = root.step.schedule.full_backward()
    ran = programs[0]
    # the program printed (every unit taking part, from the settings) is the one this backward compiled and issued;
    # per kind, since the printer cannot know which groups share a communicator before the first step
    same = _per_kind(full) == _per_kind(ran)
    return {
        "printed": printed,
        "same": same,
        "lines": [str(op) for op in ran.operations()],
        "full": [str(op) for op in full.operations()],
        "mismatches": _mismatches(programs, recorder),
    }


@pytest.mark.parametrize(("ws", "hsdp"), [(2, False), (4, False), (4, True)])
def test_the_printed_program_is_what_a_step_issues(run_dist, ws: int, hsdp: bool) -> None:
    for rank, result in enumerate(run_dist(ws, _printed_then_run, hsdp)):
        assert result["mismatches"] == [], (rank, result)
        assert result["same"], (rank, "\n".join(result["full"]), "\n".join(result["lines"]))
        for line in result["lines"]:
            assert line in result["printed"], (rank, line, result["printed"])


def _step_against_a_wrong_program(rank: int, ws: int, which: str) -> str:
    """One step whose compiled program is wrong about one unit: ``block`` (blocks.0 listed with no backward
    all-gather, though it reshards after forward) or ``root`` (the root listed with one, though it keeps its
    parameters)."""
    import fsdp_compose.program as program_module

    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = mesh_1d(ws)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    wrong_about = model.blocks[0] if which == "block" else model
    honest = program_module.gathers_in_backward

    def misled(state: Any, *, live: bool, is_root: bool = False) -> bool:
        if live and state.modules[0] is wrong_about:
            return which == "root"
        return honest(state, live=live, is_root=is_root)

    inputs, targets = synthetic_batch(cfg, 2 * ws, 0)
    loss = loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws))
    program_module.gathers_in_backward = misled  # type: ignore[assignment]
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)
    finally:
        program_module.gathers_in_backward = honest
    return "no error"


@pytest.mark.parametrize("which", ["block", "root"])
def test_a_unit_against_its_program_step_is_an_internal_error(run_dist, which: str) -> None:
    """The walk runs the program: where a unit's live state needs an all-gather its step does not list (or lists one
    the unit does not need), every rank raises the same internal error naming the unit, before the collective could
    mismatch the other ranks'."""
    unit = "unit Block (position 1)" if which == "block" else "unit GPT (position 0)"
    listed = "lists none" if which == "block" else "lists all_gather"
    for rank, message in enumerate(run_dist(2, _step_against_a_wrong_program, which)):
        assert "internal error" in message and unit in message and listed in message, (rank, message)
