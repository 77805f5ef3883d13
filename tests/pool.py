"""A persistent pool of gloo worker processes per world size.

Spawning processes for every test costs 2-5 s on a 2-core machine; a session-wide pool costs that once. Test bodies
are module-level functions ``fn(rank, world_size, *args)``; they are sent by reference (module and name) and run on
every rank. If any rank fails or time runs out, the whole pool is killed (its collectives may be out of step) and the
test fails with every rank's traceback; the next test gets a fresh pool. Collectives time out after 30 s, so a rank
stuck in a collective whose peer died raises instead of hanging.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

COLLECTIVE_TIMEOUT_S = int(os.environ.get("FSDP_COMPOSE_COLLECTIVE_TIMEOUT_S", "30"))  # e.g. lower for shrinking hangs
TASK_TIMEOUT_S = 300


def _worker(rank: int, world_size: int, init_file: str, conn: Any, path: list[str]) -> None:
    sys.path[:] = path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while True:
        message = conn.recv()
        if message is None:
            break
        module_name, qualname, args = message
        try:
            fn: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            result = fn(rank, world_size, *args)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="fsdp_compose_pool_")
        os.close(fd)
        os.unlink(self._init_file)
        self._conns = []
        self._procs = []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, self.world_size, self._init_file, child, list(sys.path)), daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = TASK_TIMEOUT_S) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn.__module__, fn.__qualname__, args))
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll(0.01):
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):  # the process died (e.g. gloo aborted on a collective mismatch)
                        self._procs[rank].join(timeout=1)
                        status, value = "error", f"died (exit code {self._procs[rank].exitcode})"
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors.append(f"--- rank {rank} ---\n{value}")
                elif not self._procs[rank].is_alive():
                    pending.discard(rank)
                    errors.append(f"--- rank {rank} --- died (exit code {self._procs[rank].exitcode})")
            if errors and pending:
                # Give peers a moment to report their own failure, then stop waiting on a broken collective.
                grace = time.monotonic() + 2.0
                while pending and time.monotonic() < grace:
                    for rank in sorted(pending):
                        if self._conns[rank].poll(0.05):
                            try:
                                status, value = self._conns[rank].recv()
                            except (EOFError, OSError):
                                status, value = "error", "died"
                            pending.discard(rank)
                            if status != "ok":
                                errors.append(f"--- rank {rank} ---\n{value}")
                break
        if pending and not errors:
            errors.append(f"timed out after {timeout:.0f} s waiting for ranks {sorted(pending)}")
        if errors:
            self.kill()
            raise AssertionError(
                f"distributed test {fn.__qualname__} failed on {self.world_size} ranks:\n" + "\n".join(errors)
            )
        return results

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        self._procs = []
        self._conns = []

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
        self.kill()
