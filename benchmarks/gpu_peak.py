"""What is alive at one step's peak on a GPU, by owner: fsdp_compose against torch ``fully_shard``.

    python benchmarks/gpu_peak.py --fake-ws 8 --ac on     # rank 0 of 8 under torch's fake process group

Why: ``max_memory_allocated`` says how high a step goes, not whose bytes are there. This records one step after the
warm-up with ``torch.cuda.memory._record_memory_history``, replays its allocations and frees to find the moment of the
peak, and sums the bytes alive then (allocated during the step) by the innermost Python frame that owns them: the
sharding library's files, the model's (this benchmark's model and loss), the optimizer, or the autograd engine
(allocations of backward kernels carry no Python frame). The model, the options and the fake world are
``benchmarks/gpu.py``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import IMPLS, TINY, LlamaConfig, batch, build, one_step, start_world


def owner(frames: list[dict[str, Any]]) -> str:
    """The innermost frame that says whose allocation this is."""
    for frame in frames:
        name = frame.get("filename", "")
        if "fsdp_compose/" in name and "benchmarks/" not in name:
            return f"fsdp_compose {Path(name).name}:{frame.get('name', '')}"
        if "distributed/fsdp/_fully_shard" in name:
            return f"torch fsdp {Path(name).name}:{frame.get('name', '')}"
        if "torch/optim" in name:
            return "optimizer"
        if name.endswith("gpu.py"):
            return f"model {frame.get('name', '')}"
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    return "autograd engine (no Python frame)" if not python else f"other {Path(python[0]['filename']).name}"


def peak_owners(trace: list[dict[str, Any]]) -> tuple[int, Counter[str]]:
    """Replay one step's trace: the highest sum of bytes allocated during it and alive at once, and who holds them."""
    alive: dict[int, int] = {}
    total = best = best_at = 0
    for i, event in enumerate(trace):
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            alive[addr] = size
            total += size
            if total > best:
                best, best_at = total, i
        elif action == "free_requested" and addr in alive:
            total -= alive.pop(addr)
    held: dict[int, list[dict[str, Any]]] = {}
    for event in trace[: best_at + 1]:
        if event["action"] == "alloc":
            held[event["addr"]] = event
        elif event["action"] == "free_requested":
            held.pop(event["addr"], None)
    owners: Counter[str] = Counter()
    for event in held.values():
        owners[owner(event.get("frames", []))] += event["size"]
    return best, owners


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--ac", choices=("off", "on"), default="on")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--fake-ws", type=int, default=8)
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="owners listed per implementation")
    args = parser.parse_args(argv)
    args.ac, args.compile, args.offload = args.ac == "on", False, False
    device = torch.device("cuda", torch.cuda.current_device())
    cfg: LlamaConfig = TINY if args.tiny else LlamaConfig()
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    mesh = start_world(device, args.fake_ws, args.replicate)
    try:
        print(f"{torch.cuda.get_device_name(device)}; mesh {tuple(mesh.shape)} (fake); AC {args.ac}; {cfg}")
        for name in IMPLS:
            gc.collect()
            torch.cuda.empty_cache()
            model, opt = build(name, cfg, mesh, device, args)
            for step in range(args.warmup):
                one_step(model, opt, *batch(cfg, step, device))
            x, y = batch(cfg, args.warmup, device)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            one_step(model, opt, x, y)
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak = torch.cuda.max_memory_allocated() - start
            best, owners = peak_owners(snapshot["device_traces"][0])
            print(f"\n## {name}: peak above the step's start {peak / 2**30:.3f} GiB; replayed {best / 2**30:.3f} GiB")
            for who, size in owners.most_common(args.top):
                print(f"  {size / 2**20:10.1f} MiB  {who}")
            del model, opt
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
