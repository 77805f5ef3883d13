"""One unit's collectives in the two layouts: the flat `(world_size, segment)` buffer and its copies, against one
collective per parameter, coalesced, reading and writing each parameter where it lives.

    python benchmarks/coalesced.py [--nproc 2 4] [--dims 256 1024] [--iters 50] [--write docs/benchmarks.md]

The unit is one block of the benchmark GPT (qkv, attention projection, MLP in and out, their biases, two LayerNorms;
width ``dim``). Per layout, the median milliseconds of a gather and of a reduction, each waited for at once (no
compute to overlap):

- all-gather, flat: one ``all_gather_single`` of the rank's whole segment into a ``(world_size, segment)`` buffer,
  then one ``split_with_sizes_copy`` into the full parameters (what fsdp_compose does);
- all-gather, per parameter: one coalesced collective (``torch.distributed``'s coalescing manager) of each
  parameter's rows of the segment straight into its full parameter's storage: no buffer, no copy-out;
- reduce-scatter, flat: one ``_chunk_cat`` of the full gradients into the ``(world_size, segment)`` layout, then
  one ``reduce_scatter_single`` into the sharded gradients (what fsdp_compose does);
- reduce-scatter, per parameter: each full gradient reduce-scattered, coalesced, into its rows of the sharded
  gradients.

It isolates the collectives' cost on this backend; the step-level effect is in docs/design.md ("Why the copies stay
with more ranks"). On gloo both per-parameter collectives copy inside the call (an all-gather flattens its inputs
and splits its output; a reduce-scatter clones each input, then all-reduces it), so what the flat layout copies
outside the collective moves inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import write_section  # noqa: E402


def block_shapes(dim: int) -> list[tuple[int, ...]]:
    """The parameters of one GPT block (examples/gpt_model.py), in registration order."""
    return [(dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,), (dim,), (dim,),
            (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]  # fmt: skip


def _timed(fn: Callable[[], None], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(ws: int, dim: int, iters: int) -> dict[str, float]:
    shapes = block_shapes(dim)
    rows = [-(-shape[0] // ws) * (torch.Size(shape[1:]).numel()) for shape in shapes]  # padded rows per rank
    segment = sum(rows)
    flat = torch.randn(segment)
    fulls = [torch.empty(ws, n) for n in rows]
    pieces = list(flat.split(rows))
    grads = [torch.randn(ws * n) for n in rows]
    sharded_grads = torch.empty(segment)
    grad_pieces = list(sharded_grads.split(rows))

    def gather_flat() -> None:
        output = torch.empty(ws * segment)
        dist.all_gather_single(output, flat)
        torch.split_with_sizes_copy(output.view(ws, segment), rows, dim=1, out=fulls)

    def gather_per_parameter() -> None:
        with c10d._coalescing_manager(async_ops=True) as coalesced:
            for full, piece in zip(fulls, pieces, strict=True):
                dist.all_gather_single(full.view(-1), piece)
        coalesced.wait()

    def reduce_flat() -> None:
        staged = torch._chunk_cat([g.view(ws, -1) for g in grads], dim=1, num_chunks=ws)
        dist.reduce_scatter_single(sharded_grads, staged.view(-1))

    def reduce_per_parameter() -> None:
        with c10d._coalescing_manager(async_ops=True) as coalesced:
            for piece, grad in zip(grad_pieces, grads, strict=True):
                dist.reduce_scatter_single(piece, grad)
        coalesced.wait()

    return {
        "all_gather_flat": _timed(gather_flat, iters),
        "all_gather_per_parameter": _timed(gather_per_parameter, iters),
        "reduce_scatter_flat": _timed(reduce_flat, iters),
        "reduce_scatter_per_parameter": _timed(reduce_per_parameter, iters),
        "unit_mib": segment * ws * 4 / 2**20,
    }


def worker(rank: int, ws: int, dims: list[int], iters: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, ws), rank=rank, world_size=ws)
    try:
        results = {dim: measure(ws, dim, iters) for dim in dims}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def render(ws: int, results: dict[int, dict[str, float]]) -> str:
    lines = [
        "| ranks | dim | unit MiB | all-gather flat + copy-out | all-gather per parameter | reduce-scatter "
        "`_chunk_cat` + flat | reduce-scatter per parameter |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dim, r in results.items():
        lines.append(
            f"| {ws} | {dim} | {r['unit_mib']:.1f} | {r['all_gather_flat']:.2f} | {r['all_gather_per_parameter']:.2f} "
            f"| {r['reduce_scatter_flat']:.2f} | {r['reduce_scatter_per_parameter']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="gloo ranks, one run each")
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--write", metavar="PATH", help="replace the coalesced section of this markdown file")
    args = parser.parse_args(argv)
    tables = []
    for nproc in args.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
            mp.spawn(worker, args=(nproc, args.dims, args.iters, store, out), nprocs=nproc, join=True)
            results = {int(dim): r for dim, r in json.loads(Path(out).read_text()).items()}
        tables.append(render(nproc, results))
    command = "python benchmarks/coalesced.py " + " ".join(
        ["--nproc", *map(str, args.nproc), "--dims", *map(str, args.dims), "--iters", str(args.iters)]
    )
    text = f"`{command}` (torch {torch.__version__}, gloo, one torch thread per rank; median ms, each collective "
    text += "waited for at once)\n\n" + "\n\n".join(tables)
    print(text)
    if args.write:
        write_section(Path(args.write), text + "\n", "coalesced")


if __name__ == "__main__":
    main()
