"""Cost of fc.set_collective_checks: step time of the example GPT with and without the check, interleaved.

    python benchmarks/collective_checks.py --nproc 2 --steps 20

Prints the median step time of each and the median per-round ratio (checked / unchecked), and the time of the check
alone (one fingerprint all-gather and one verdict all-reduce per step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import fsdp_compose as fc  # noqa: E402
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402
from fsdp_compose.checks import check_ranks_agree  # noqa: E402
from fsdp_compose.state import states_under  # noqa: E402


def _run(rank: int, nproc: int, store: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nproc)
    mesh = dist.device_mesh.init_device_mesh("cpu", (nproc,))
    cfg = GPTConfig()
    models = []
    for checked in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        for block in model.blocks:
            fc.fully_shard(block, mesh=mesh)
        fc.fully_shard(model, mesh=mesh)
        fc.set_collective_checks(model, checked)
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    times: list[list[float]] = [[], []]
    for step in range(steps + 3):
        inputs, targets = synthetic_batch(cfg, 4 * nproc, step)
        x, y = inputs.chunk(nproc)[rank], targets.chunk(nproc)[rank]
        for index, (model, opt) in enumerate(models):
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            if step >= 3:
                times[index].append(time.perf_counter() - start)
    root = fc.get_state(models[1][0])
    assert root is not None
    states = states_under(models[1][0])
    check_times = []
    for _ in range(50):
        start = time.perf_counter()
        check_ranks_agree(root, states)
        check_times.append(time.perf_counter() - start)
    if rank == 0:
        ratios = [b / a for a, b in zip(times[0], times[1], strict=True)]
        print(f"unchecked median step {1e3 * statistics.median(times[0]):.1f} ms")
        print(f"checked   median step {1e3 * statistics.median(times[1]):.1f} ms")
        print(f"checked / unchecked (median of per-round ratios): {statistics.median(ratios):.3f}")
        print(f"the check alone: median {1e3 * statistics.median(check_times):.3f} ms per step")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_run, args=(args.nproc, store, args.steps), nprocs=args.nproc)


if __name__ == "__main__":
    main()
