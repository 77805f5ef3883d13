"""torch.compile: eager vs compiled step time and peak memory, fsdp_compose beside torch FSDP2, gloo CPU ranks.

    python benchmarks/compile.py --nproc 2 [--configs fp32 bf16] [--backend inductor] [--write docs/benchmarks.md]

Four implementations of the example GPT per config, built from the same seed in the same processes:
``fc_eager`` / ``fsdp2_eager`` shard every block, then the root (fsdp_compose's ``fc.fully_shard``, torch's
``torch.distributed.fsdp.fully_shard``); ``fc_compiled`` / ``fsdp2_compiled`` first compile each block in place
(``block.compile(backend=...)``, torchtitan's order), then shard the same way. AdamW(lr=1e-3) on both.

Time: two warm-up steps each (compilation happens there, and is reported), then interleaved rounds A, B, C, D, ...
with a barrier around each step (benchmarks/run.py's ``timed_step``); figures are medians of per-round ratios.

Memory: the live-bytes counter of run.py (a ``TorchDispatchMode``) cannot see compiled code: dynamo runs a frame
eagerly while a dispatch mode is active. So this script counts what the CPU allocator reports to the profiler
(``torch.profiler.profile(profile_memory=True)``, allocation events in time order): the peak of bytes allocated on the
calling thread above the start of one non-timed step (forward, backward, optimizer step), max over ranks. The same
count for all four; allocations made inside gloo's own threads are not seen (for any of them).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fsdp_compose as fc  # noqa: E402
from benchmarks.report import MIB, _header, _ms, _ratio, _table, write_section  # noqa: E402
from benchmarks.run import (  # noqa: E402
    VARIANTS,
    BenchArgs,
    Impl,
    Variant,
    _rank_max,
    _shard_kwargs,
    add_model_arguments,
    local_batch,
    timed_step,
)
from examples.gpt_model import GPT  # noqa: E402

IMPLS = ("fc_eager", "fc_compiled", "fsdp2_eager", "fsdp2_compiled")
LIBRARY = {"fc": ("fsdp_compose", "fsdp_compose"), "fsdp2": ("torch_fsdp2", "torch FSDP2")}


def build(name: str, variant: Variant, args: BenchArgs, mesh: DeviceMesh, backend: str) -> Impl:
    library, mode = name.split("_")
    run_name = LIBRARY[library][0]
    torch.manual_seed(args.seed)
    model = GPT(args.gpt_config())
    shard_fn: Callable[..., Any] = fc.fully_shard if library == "fc" else torch_fully_shard
    kwargs = _shard_kwargs(run_name, variant)
    for block in model.blocks:
        if mode == "compiled":
            block.compile(backend=backend)
        shard_fn(block, mesh=mesh, **kwargs)
    shard_fn(model, mesh=mesh, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Impl(name, model, opt)


def step_allocation_peak(impl: Impl, args: BenchArgs, step: int) -> int:
    """Peak bytes allocated above the start of one step, from the profiler's allocation events (see the docstring)."""
    x, y = local_batch(args, step)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        impl.step(x, y)
    events: list[tuple[int, int]] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        pending.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def run_config(variant: Variant, args: BenchArgs, mesh: DeviceMesh, backend: str) -> dict[str, Any]:
    torch._dynamo.reset()
    impls: dict[str, Impl] = {}
    compile_s: dict[str, float] = {}
    graphs: dict[str, int] = {}
    for name in IMPLS:
        counters.clear()
        impls[name] = impl = build(name, variant, args, mesh, backend)
        dist.barrier()
        start = time.perf_counter()
        for step in range(2):  # compiles (and recompiles, if the second step needs it) in here
            impl.step(*local_batch(args, step))
        dist.barrier()
        compile_s[name] = time.perf_counter() - start
        graphs[name] = int(counters["stats"]["unique_graphs"])
        progress(f"{variant.name}: {name} built and warmed up in {compile_s[name]:.1f} s")
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    for step in range(2, args.steps + 2):
        x, y = local_batch(args, step)
        for name, impl in impls.items():
            times[name].append(timed_step(impl, x, y))
    peaks = _rank_max([step_allocation_peak(impls[name], args, args.steps + 2) for name in IMPLS])
    return {
        "config": variant.name,
        "times": {name: values[args.warmup :] for name, values in times.items()},
        "loss": {name: impl.last_loss for name, impl in impls.items()},
        "warmup_s": compile_s,
        "graphs": graphs,
        "peak": dict(zip(IMPLS, peaks, strict=True)),
    }


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[compile] {message}", flush=True)


def worker(rank: int, args: BenchArgs, backend: str, store_path: str, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.nproc), rank=rank, world_size=args.nproc)
    try:
        mesh = init_device_mesh("cpu", (args.nproc,))
        results = [run_config(VARIANTS[name], args, mesh, backend) for name in args.configs]
        if rank == 0:
            Path(result_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- report
def render(results: list[dict[str, Any]], args: BenchArgs, backend: str, command: str, elapsed: float) -> str:
    header = _header(args, command, elapsed)
    header += (
        f'\n\nCompiled: `block.compile(backend="{backend}")` on every block before sharding (torchtitan\'s order); '
        "eager: the same model uncompiled. bf16: `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`."
    )
    time_rows, mem_rows, notes = [], [], []
    for res in results:
        t, peak, config = res["times"], res["peak"], res["config"]
        for library in ("fc", "fsdp2"):
            eager, compiled = t[f"{library}_eager"], t[f"{library}_compiled"]
            label = LIBRARY[library][1]
            time_rows.append([config, label, _ms(eager), _ms(compiled), _ratio(compiled, eager)])
            pe, pc = peak[f"{library}_eager"], peak[f"{library}_compiled"]
            mem_rows.append([config, label, f"{pe / MIB:.2f}", f"{pc / MIB:.2f}", f"{pc / pe:.2f}"])
        fc_vs_fsdp2 = [_ratio(t["fc_eager"], t["fsdp2_eager"]), _ratio(t["fc_compiled"], t["fsdp2_compiled"])]
        time_rows.append([config, "fsdp_compose / FSDP2", *fc_vs_fsdp2, ""])
        peak_ratios = [f"{peak[f'fc_{m}'] / peak[f'fsdp2_{m}']:.2f}" for m in ("eager", "compiled")]
        mem_rows.append([config, "fsdp_compose / FSDP2", *peak_ratios, ""])
        losses = " / ".join(f"{res['loss'][n]:.5f}" for n in IMPLS)
        warm = ", ".join(f"{n} {res['warmup_s'][n]:.1f} s (graphs: {res['graphs'][n]})" for n in IMPLS)
        notes.append(f"- {config}: final losses {' / '.join(IMPLS)}: {losses}. Two warm-up steps: {warm}.")
    warm_note = (
        "Warm-up includes compilation; fc_compiled compiles first in each config, and fsdp2_compiled then reuses the "
        "compiler's caches for the same block graph (inductor's kernels), so the two warm-up times do not compare "
        "the libraries."
    )
    parts = [
        header,
        "**Step time** — median ms per step; ratios are medians of per-round ratios (compiled / eager < 1: "
        "compiling pays; fsdp_compose / FSDP2 < 1: fsdp_compose faster).",
        _table(["config", "implementation", "eager ms", "compiled ms", "compiled / eager"], time_rows),
        "**Peak MiB allocated above the start of a step** (forward, backward, optimizer step; CPU allocator events "
        "from the profiler, calling thread, max over ranks): activations, gathered parameters, gradients and "
        "temporaries, not the parameters and optimizer state already there.",
        _table(["config", "implementation", "eager", "compiled", "compiled / eager"], mem_rows),
        "\n".join(notes),
        warm_note,
    ]
    return "\n\n".join(parts) + "\n"


def parse_args(argv: list[str] | None = None) -> tuple[BenchArgs, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn")
    parser.add_argument("--configs", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor needs a C++ compiler)")
    parser.add_argument("--steps", type=int, default=12, help="timed rounds (each runs every implementation once)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds dropped from the statistics")
    add_model_arguments(parser)
    parser.add_argument("--write", metavar="PATH", help="replace the --section of this markdown file")
    parser.add_argument("--section", default="compile", help="marker: <!-- NAME:start --> ... <!-- NAME:end -->")
    ns = parser.parse_args(argv)
    if ns.steps <= ns.warmup:
        parser.error("--steps must be larger than --warmup")
    if ns.dim % ns.heads:
        parser.error("--dim must be divisible by --heads")
    fields = ("nproc", "steps", "warmup", "dim", "layers", "heads", "seq", "batch", "vocab", "seed")
    bench = BenchArgs(configs=tuple(dict.fromkeys(ns.configs)), memory=True, **{k: getattr(ns, k) for k in fields})
    return bench, ns


def main(argv: list[str] | None = None) -> None:
    args, ns = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store_path, result_path = str(Path(tmp) / "store"), str(Path(tmp) / "results.json")
        start = time.perf_counter()
        mp.spawn(worker, args=(args, ns.backend, store_path, result_path), nprocs=args.nproc, join=True)
        results = json.loads(Path(result_path).read_text())
    command = "python benchmarks/compile.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(results, args, ns.backend, command, time.perf_counter() - start)
    print(text)
    if ns.write:
        target = Path(ns.write) if Path(ns.write).is_absolute() else REPO / ns.write
        write_section(target, text, ns.section)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
