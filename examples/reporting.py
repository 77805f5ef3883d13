"""What the examples print: a header (world, meshes, the sharded layout), one line per step, a final summary."""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp_compose as fc


def mesh_text(mesh: DeviceMesh) -> str:
    return f"{tuple(mesh.shape)} {mesh.mesh_dim_names or '(unnamed)'} on {mesh.device_type}"


def print_header(model: nn.Module, mesh: DeviceMesh, dp_mesh: DeviceMesh, settings: str) -> None:
    """World size, meshes and ``fc.describe``'s per-unit layout (every rank must call it: the layout gathers
    each rank's shard bytes); printed on rank 0."""
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        dp = f"; data-parallel part {mesh_text(dp_mesh)}" if dp_mesh is not mesh else ""
        print(f"world size {world}; mesh {mesh_text(mesh)}{dp}", flush=True)
        print(settings, flush=True)
    fc.print_description(model, all_ranks=True, params=False)


class StepLog:
    """Prints one line per step on rank 0 and a summary at the end; step 0 is marked as including initialization
    (the first forward runs fully_shard's lazy initialization, and the optimizer allocates its state)."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.started = time.perf_counter()

    def step(self, step: int, loss: float, elapsed: float, extra: str = "") -> None:
        self.losses.append(loss)
        self.seconds.append(elapsed)
        if dist.get_rank() == 0:
            note = "  (includes initialization)" if step == 0 else ""
            extra = f"  {extra}" if extra else ""
            print(
                f"step {step:3d}  loss {loss:.4f}{extra}  tokens/s {self.tokens_per_step / elapsed:,.0f}{note}",
                flush=True,
            )

    def summary(self) -> None:
        if dist.get_rank() != 0 or not self.losses:
            return
        steady = self.seconds[1:] or self.seconds
        rate = self.tokens_per_step / statistics.median(steady)
        last = len(self.seconds) - 1
        which = "step 0" if last == 0 else "step 1" if last == 1 else f"steps 1-{last}"
        print(
            f"done: {len(self.losses)} steps in {time.perf_counter() - self.started:.1f} s; losses: first "
            f"{self.losses[0]:.4f}, last {self.losses[-1]:.4f}; median tokens/s {rate:,.0f} ({which})",
            flush=True,
        )
