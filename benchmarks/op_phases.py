"""ATen calls per step by labelled phase: where an implementation's per-op host overhead goes.

    python benchmarks/op_phases.py --nproc 2 [--configs fp32 bf16] [--impls fsdp_compose torch_fsdp2] [--detail]

Same model, batches and implementations as ``benchmarks/run.py``. One step of each implementation (after two warm-up
steps) runs under torch.profiler; every top-level ATen call (one not made inside another ATen call) is attributed to
the nearest enclosing profiler range of the implementation (``fsdp_compose::*`` or ``FSDP::*``), or "(model,
optimizer, autograd)" when there is none. Rank 0 prints the calls per phase, and with ``--detail`` the most frequent
ops of each. Counts are deterministic; the profiler adds time to every op, so no timings are printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run import IMPLS, VARIANTS, BenchArgs, build_or_skip, local_batch  # noqa: E402

OUTSIDE = "(model, optimizer, autograd)"


def phase_of(event: Any) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("fsdp_compose::", "FSDP::")):
            return str(parent.name)
        parent = parent.cpu_parent
    return OUTSIDE


def worker(rank: int, args: BenchArgs, impls: list[str], detail: bool, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.nproc), rank=rank, world_size=args.nproc)
    try:
        mesh = init_device_mesh("cpu", (args.nproc,))
        for config in args.configs:
            for name in impls:
                impl = build_or_skip(name, VARIANTS[config], args, mesh, warmup=2)
                if isinstance(impl, str):
                    continue
                x, y = local_batch(args, 3)
                dist.barrier()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    impl.step(x, y)
                dist.barrier()
                calls: Counter[str] = Counter()
                ops: dict[str, Counter[str]] = defaultdict(Counter)
                for event in prof.events():
                    parent = event.cpu_parent
                    if not event.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
                        continue
                    phase = phase_of(event)
                    calls[phase] += 1
                    ops[phase][event.name] += 1
                if rank == 0:
                    print(f"\n{config} / {name}: {sum(calls.values())} top-level ATen calls in one step (rank 0)")
                    for phase, count in calls.most_common():
                        print(f"  {count:6d}  {phase}")
                        if detail:
                            for op, n in ops[phase].most_common(6):
                                print(f"            {n:6d} {op}")
                del impl
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["fp32"], choices=sorted(VARIANTS))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS[:2]), choices=IMPLS)
    parser.add_argument("--detail", action="store_true", help="also the most frequent ops of each phase")
    ns = parser.parse_args()
    args = BenchArgs(ns.nproc, tuple(ns.configs), 4, 0, 256, 4, 4, 64, 4, 512, 0, False)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, ns.impls, ns.detail, str(Path(tmp) / "store")), nprocs=ns.nproc, join=True)


if __name__ == "__main__":
    main()
