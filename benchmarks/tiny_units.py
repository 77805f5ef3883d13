"""Host overhead: a model of 100 tiny units (Linear(8, 8) each), where hooks and copies dominate the step.

    torchrun --standalone --nproc_per_node 2 benchmarks/tiny_units.py [--units 100] [--steps 30]

Alternates fsdp_compose and torch's fully_shard step by step on the same model and batch and prints the median step
time of each and the median of the per-step ratios (and a progress line every 10 steps: a run takes a minute).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp_compose as fc


class Tiny(nn.Module):
    def __init__(self, units: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=100, help="Linear layers, each its own unit")
    parser.add_argument("--width", type=int, default=8, help="features of each Linear")
    parser.add_argument("--steps", type=int, default=30, help="steps of each implementation (the first 3 not timed)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ours = Tiny(args.units, args.width)
    theirs = copy.deepcopy(ours)
    for layer in ours.layers:
        fc.fully_shard(layer, mesh=mesh)
    fc.fully_shard(ours, mesh=mesh)
    from torch.distributed.fsdp import fully_shard

    for layer in theirs.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    models = {"fsdp_compose": ours, "torch_fsdp2": theirs}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x = torch.randn(4, args.width)
    times: dict[str, list[float]] = {k: [] for k in models}
    for step in range(args.steps):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            opts[name].zero_grad()
            model(x).sum().backward()
            opts[name].step()
            dist.barrier()
            if step >= 3:
                times[name].append(time.perf_counter() - start)
        if dist.get_rank() == 0 and ((step + 1) % 10 == 0 or step + 1 == args.steps):
            print(f"[tiny_units] step {step + 1}/{args.steps} of both (first 3 not timed)", flush=True)
    if dist.get_rank() == 0:
        ratios = [a / b for a, b in zip(times["fsdp_compose"], times["torch_fsdp2"], strict=True)]
        for name, values in times.items():
            print(f"{name:14s} median {statistics.median(values) * 1e3:7.2f} ms/step")
        print(f"fsdp_compose / torch_fsdp2 median ratio {statistics.median(ratios):.2f} ({args.units} units)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
