"""Where a step's time goes, per implementation: torch.profiler over a few steps, self CPU time by category.

    python benchmarks/profile_step.py --nproc 2 [--configs fp32 bf16] [--steps 4]

Same model, batches and implementations as ``benchmarks/run.py``. Rank 0 prints, per implementation, the self CPU
milliseconds per step of: waiting for collectives (gloo runs them on its own threads, so the main thread's time in
``wait``/collective calls is communication not hidden by compute), copies (``copy_``, ``cat``, ``to``,
``split_with_sizes_copy``...), compute (matmuls, attention, elementwise, optimizer) and the rest (Python hooks,
autograd bookkeeping), plus the number of ATen calls. It explains the step-time ratios of run.py; it is not a timing
benchmark itself (the profiler adds overhead to every op).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run import IMPLS, VARIANTS, BenchArgs, build_or_skip, local_batch  # noqa: E402

COMMUNICATION = ("wait", "all_gather", "reduce_scatter", "all_reduce", "allreduce", "gloo", "c10d", "barrier")
COPIES = ("copy_", "aten::cat", "aten::to", "_to_copy", "split_with_sizes_copy", "aten::clone", "contiguous", "resize_")
COMPUTE = (
    "mm",
    "addmm",
    "bmm",
    "linear",
    "softmax",
    "attention",
    "gelu",
    "layer_norm",
    "embedding",
    "cross_entropy",
    "nll_loss",
    "_foreach",
    "add",
    "mul",
    "div",
    "sub",
    "sqrt",
    "lerp",
    "sum",
    "mean",
    "exp",
    "log",
    "neg",
    "tanh",
    "where",
    "masked_fill",
    "fill_",
    "zero_",
)


def category(name: str) -> str:
    lowered = name.lower()
    if any(key in lowered for key in COMMUNICATION):
        return "communication"
    if any(key in lowered for key in COPIES):
        return "copies"
    if any(key in lowered for key in COMPUTE):
        return "compute"
    return "other"


def worker(rank: int, args: BenchArgs, configs: list[str], store_path: str, top: int = 0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.nproc), rank=rank, world_size=args.nproc)
    try:
        mesh = init_device_mesh("cpu", (args.nproc,))
        for config in configs:
            rows = []
            for name in IMPLS:
                impl = build_or_skip(name, VARIANTS[config], args, mesh, warmup=2)
                if isinstance(impl, str):
                    continue
                batches = [local_batch(args, 3 + step) for step in range(args.steps)]
                dist.barrier()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for x, y in batches:
                        impl.step(x, y)
                dist.barrier()
                totals: dict[str, float] = defaultdict(float)
                calls = 0
                ops: list[tuple[float, str, int]] = []
                for event in prof.key_averages():
                    ms = event.self_cpu_time_total / 1e3 / args.steps
                    totals[category(event.key)] += ms
                    if event.key.startswith("aten::"):
                        calls += event.count
                        ops.append((ms, event.key, event.count // args.steps))
                rows.append((name, totals, calls // args.steps))
                if rank == 0 and top:
                    listed = ", ".join(f"{key} {ms:.1f} ms x{n}" for ms, key, n in sorted(ops, reverse=True)[:top])
                    print(f"{config} {name}: top ATen ops by self CPU ms per step: {listed}", flush=True)
                del impl
            if rank == 0:
                print(f"\n{config}: self CPU ms per step (rank 0, under the profiler)")
                print("| implementation | communication wait | copies | compute | other | total | ATen calls |")
                print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
                for name, totals, calls in rows:
                    parts = [totals[c] for c in ("communication", "copies", "compute", "other")]
                    cells = " | ".join(f"{v:.1f}" for v in parts)
                    print(f"| {name} | {cells} | {sum(parts):.1f} | {calls} |", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["fp32"], choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=0, help="also list each implementation's N costliest ATen ops")
    ns = parser.parse_args()
    args = BenchArgs(ns.nproc, tuple(ns.configs), ns.steps, 0, 256, 4, 4, 64, 4, 512, 0, False)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, ns.configs, str(Path(tmp) / "store"), ns.top), nprocs=ns.nproc, join=True)


if __name__ == "__main__":
    main()
