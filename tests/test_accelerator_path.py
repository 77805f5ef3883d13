"""The accelerator side of the backward walk's waits, run on gloo (``StepContext.accelerated``).

On an accelerator a wait on a collective only orders streams; on a CPU device gloo completes a collective only when
it is waited for, so the walk takes another side where it waits (backward.py). Without a GPU the accelerator side
would never run. Here the tests set ``accelerated`` on a CPU root: each of its waits then blocks the host, which is
stricter than a stream wait (a host that waits issues nothing more), so a wait cycle between two ranks' streams
shows as a hang (gloo's collective timeout), and everything else must train exactly as the reference does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import fsdp_compose.step as step_module
from tests import test_collective_order as order
from tests.random_models import config_from_seed
from tests.test_program import SHAPES
from tests.test_randomized import FOUND_BY_THE_SWEEP, GRAPH_SHAPES, check_case


@contextlib.contextmanager
def accelerator_side() -> Iterator[None]:
    """Every root made in the block takes the accelerator side of the walk's waits."""
    original = step_module.StepContext.__init__

    def init(self: step_module.StepContext, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.accelerated = True

    step_module.StepContext.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        step_module.StepContext.__init__ = original  # type: ignore[method-assign]


def _on_accelerator_side(rank: int, ws: int, fn: Callable[..., Any], *args: Any) -> Any:
    with accelerator_side():
        return fn(rank, ws, *args)


@pytest.mark.parametrize(
    ("fn", "args", "ws"),
    [
        pytest.param(fn, args, ws, id=f"{fn.__name__.strip('_')}{'-' + '-'.join(map(str, args)) if args else ''}-{ws}")
        for fn, args, sizes in SHAPES
        for ws in sizes
        if ws > 1
    ],
)
def test_graph_shapes_on_the_accelerator_side(run_dist, fn: Callable[..., Any], args: tuple[Any, ...], ws: int) -> None:
    """Every graph shape of test_graph_shapes.py on the accelerator side: no hang, and bit for bit the numbers of the
    CPU side (the same ops; only when the walk waits differs), the same collectives on every rank where the shape
    records them."""
    accelerator = run_dist(ws, _on_accelerator_side, fn, *args)
    cpu = run_dist(ws, fn, *args)
    for ours, theirs in zip(accelerator, cpu, strict=True):
        diff = ours if isinstance(ours, float) else ours["diff"]
        assert diff == (theirs if isinstance(theirs, float) else theirs["diff"]), (ours, theirs)
        if isinstance(ours, dict) and "record" in ours:
            assert ours["record"] == accelerator[0]["record"]


@pytest.mark.parametrize("pattern", ["even", "odd", "all"])
@pytest.mark.parametrize("ws", [2, 4])
def test_units_some_ranks_skip_on_the_accelerator_side(run_dist, ws: int, pattern: str) -> None:
    """A unit whose output reaches the loss on some ranks only reduces at its turn there and in the final callback
    elsewhere: the accelerator side must not wait on a reduction a peer issues only after an all-gather it needs."""
    results = run_dist(ws, _on_accelerator_side, order._order, pattern, True, False, False, False, "")
    for result in results:
        assert result["record"] == results[0]["record"]
        assert result["diff"] <= 1e-5


def _run(run_dist: Any) -> Callable[..., list[Any]]:
    def run(ws: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return run_dist(ws, _on_accelerator_side, fn, *args)  # type: ignore[no-any-return]

    return run


CASES = {
    **{f"shape_{name}": cfg for name, cfg in GRAPH_SHAPES.items()},
    **{f"found_{name}": cfg for name, cfg in FOUND_BY_THE_SWEEP.items() if cfg.ws > 1},
    **{f"seed_{seed}_ws{ws}": config_from_seed(seed, ws) for seed, ws in ((3, 2), (11, 2), (105, 2), (7, 4))},
    # the accelerator side waited (a stream wait; here a host wait) on a reduce-scatter its peer issues only after an
    # all-gather it needs from this rank: a hang, before the wait_after and landing guards applied on every device
    "wait_cycle_seed_350": config_from_seed(350, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sweep_configurations_on_the_accelerator_side(run_dist, name: str) -> None:
    """Configurations of the random sweep (its graph shapes, the failures it found, drawn seeds): the same
    collectives on every rank and the reference's numbers, on the accelerator side."""
    cfg = CASES[name]
    check_case(_run(run_dist), dataclasses.replace(cfg, ws=max(cfg.ws, 2)))
