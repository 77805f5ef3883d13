from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.pool import WorkerPool

RunDist = Callable[..., list[Any]]


@pytest.fixture(scope="session")
def _pools() -> Iterator[dict[int, WorkerPool]]:
    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def run_dist(_pools: dict[int, WorkerPool]) -> RunDist:
    """``run_dist(world_size, fn, *args)`` runs ``fn(rank, world_size, *args)`` on a persistent gloo pool."""

    def run(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if world_size not in _pools:
            _pools[world_size] = WorkerPool(world_size)
        return _pools[world_size].run(fn, *args)

    return run
