"""fsdp_compose vs torch FSDP2 (``torch.distributed.fsdp.fully_shard``) vs DDP on the example GPT, gloo CPU ranks.

    python benchmarks/run.py --nproc 2 --configs fp32 bf16 frozen frozen_replicate no_reshard [--write PATH]

Spawns ``--nproc`` gloo ranks (one torch thread each). Per config, every rank builds the three models from the same
seed and trains them on the same batches, interleaving steps in rounds A B C, B C A, C A B, ... (no implementation
always follows the same one) with a barrier before and after each step; the figures of merit are the medians of the
per-round time ratios (noise hits neighbouring steps alike). The processes' CPU time per step, summed over the ranks,
is reported next to it: with more ranks than cores the machine is saturated and the step time follows it.
Then each implementation alone (the others deleted) runs ``--memory-steps`` non-timed steps under the live-bytes
counter (``benchmarks/memory.py``; the highest step's peak is reported), and one step under
``fc.CollectiveRecorder`` (minimum bytes: ``benchmarks/comm.py``). See benchmarks/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import fsdp_compose as fc  # noqa: E402
from benchmarks.comm import UnitSpec, min_collective_bytes  # noqa: E402
from benchmarks.memory import LiveBytesCounter, gloo_reduce_scatter_copies, live_storage_keys, tensors_since  # noqa: E402
from benchmarks.report import render_tables, write_section  # noqa: E402
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402

IMPLS = ("fsdp_compose", "torch_fsdp2", "ddp")


@dataclass(frozen=True)
class Variant:
    """A benchmark configuration: what changes relative to plain fp32 training."""

    name: str
    bf16: bool = False  # FSDPs: param_dtype=bf16, reduce_dtype=fp32; DDP: bf16 autocast
    frozen: bool = False  # every block but the last has requires_grad=False
    no_reshard: bool = False  # reshard_after_forward=False on every unit (FSDPs)
    frozen_params: str = "shard"  # fsdp_compose only: "replicate" keeps frozen parameters whole on every rank
    reshard_to: int = 0  # FSDPs' blocks: reshard_after_forward=reshard_to (a smaller group; meaningful at 4+ ranks)
    # fsdp_compose only: fc.set_backward_prefetch_point (torch FSDP2 always prefetches "before")
    prefetch_point: str = "midway"
    # both FSDPs: set_reduce_scatter_max_input_buffers(n), FSDP2's meaning (before a unit fills a new reduce-scatter
    # input, fewer than n older ones stay alive; default 1)
    reduce_scatter_buffers: int = 1


VARIANTS = {
    "fp32": Variant("fp32"),
    "bf16": Variant("bf16", bf16=True),
    "frozen": Variant("frozen", frozen=True),
    "frozen_replicate": Variant("frozen_replicate", frozen=True, frozen_params="replicate"),
    "no_reshard": Variant("no_reshard", no_reshard=True),
    "reshard_to_2": Variant("reshard_to_2", reshard_to=2),
    "fp32_before": Variant("fp32_before", prefetch_point="before"),
    "bf16_before": Variant("bf16_before", bf16=True, prefetch_point="before"),
    "frozen_before": Variant("frozen_before", frozen=True, prefetch_point="before"),
    "fp32_post": Variant("fp32_post", prefetch_point="after"),
    "bf16_post": Variant("bf16_post", bf16=True, prefetch_point="after"),
    "frozen_post": Variant("frozen_post", frozen=True, prefetch_point="after"),
    "fp32_rs2": Variant("fp32_rs2", reduce_scatter_buffers=2),
    "bf16_rs2": Variant("bf16_rs2", bf16=True, reduce_scatter_buffers=2),
    "frozen_rs2": Variant("frozen_rs2", frozen=True, reduce_scatter_buffers=2),
}


@dataclass(frozen=True)
class BenchArgs:
    nproc: int
    configs: tuple[str, ...]
    steps: int
    warmup: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    vocab: int
    seed: int
    memory: bool
    memory_steps: int = 5

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab, seq_len=self.seq, dim=self.dim, n_layers=self.layers, n_heads=self.heads
        )


# ---------------------------------------------------------------------- one implementation
@dataclass
class Impl:
    """A model wrapped by one implementation, its optimizer, and how to run one training step."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    autocast_dtype: torch.dtype | None = None
    last_loss: float = float("nan")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Forward, backward, optimizer step; gradients are freed right after the step."""
        self.optimizer_step(self.backward(x, y))

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward (under autocast where the implementation runs it) and backward of one batch; the loss."""
        autocast = torch.autocast("cpu", dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext()
        with autocast:
            loss = loss_fn(self.model(x), y)
        loss.backward()
        return loss

    def optimizer_step(self, loss: torch.Tensor) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_loss = loss.item()


def _shard_kwargs(name: str, variant: Variant) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if variant.no_reshard:
        kwargs["reshard_after_forward"] = False
    if variant.bf16:
        policy = fc.MixedPrecisionPolicy if name == "fsdp_compose" else TorchMixedPrecisionPolicy
        kwargs["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if name == "fsdp_compose" and variant.frozen_params != "shard":
        kwargs["frozen_params"] = variant.frozen_params  # torch FSDP2 has no such option: it shards them
    return kwargs


def _shard(model: GPT, name: str, variant: Variant, mesh: DeviceMesh) -> nn.Module:
    """The torchtitan recipe: every block, then the root."""
    shard_fn: Callable[..., Any] = fc.fully_shard if name == "fsdp_compose" else torch_fully_shard
    kwargs = _shard_kwargs(name, variant)
    block_kwargs = {**kwargs, "reshard_after_forward": variant.reshard_to} if variant.reshard_to else kwargs
    for block in model.blocks:
        shard_fn(block, mesh=mesh, **block_kwargs)
    shard_fn(model, mesh=mesh, **kwargs)
    if name == "fsdp_compose" and variant.prefetch_point != "midway":
        fc.set_backward_prefetch_point(model, variant.prefetch_point)  # type: ignore[arg-type]
    if variant.reduce_scatter_buffers != 1:
        if name == "fsdp_compose":
            fc.bind_fsdp2_methods(model)  # FSDP2's method, bound on this instance
        model.set_reduce_scatter_max_input_buffers(variant.reduce_scatter_buffers)  # type: ignore[operator]
    return model


def build(name: str, variant: Variant, args: BenchArgs, mesh: DeviceMesh) -> Impl:
    torch.manual_seed(args.seed)
    model = GPT(args.gpt_config())
    if variant.frozen:
        for block in model.blocks[:-1]:
            block.requires_grad_(False)
    wrapped = DistributedDataParallel(model) if name == "ddp" else _shard(model, name, variant, mesh)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    autocast = torch.bfloat16 if name == "ddp" and variant.bf16 else None
    return Impl(name, wrapped, opt, autocast)


def local_batch(args: BenchArgs, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``--batch`` rows of a global batch of ``batch * nproc`` rows (the same on every rank)."""
    x, y = synthetic_batch(args.gpt_config(), args.batch * args.nproc, step, seed=args.seed)
    rank = dist.get_rank()
    return x.chunk(args.nproc)[rank], y.chunk(args.nproc)[rank]


def build_or_skip(name: str, variant: Variant, args: BenchArgs, mesh: DeviceMesh, warmup: int = 1) -> Impl | str:
    """The implementation after ``warmup`` steps, or the reason it is not available ('n/a' in the table)."""
    try:
        impl = build(name, variant, args, mesh)
        for step in range(warmup):
            impl.step(*local_batch(args, step))
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    return impl


# ---------------------------------------------------------------------- measurements
def timed_step(impl: Impl, x: torch.Tensor, y: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    impl.step(x, y)
    dist.barrier()
    return time.perf_counter() - start


def time_interleaved(impls: dict[str, Impl], args: BenchArgs) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per step of each implementation, in rotating rounds; warm-up rounds dropped. Also the CPU seconds
    per step summed over the ranks (each process's own threads, gloo's included): with more ranks than cores the
    machine is saturated, and the step time follows the work every rank asks of it."""
    times: dict[str, list[float]] = {name: [] for name in impls}
    cpu = dict.fromkeys(impls, 0.0)
    names = list(impls)
    for step in range(1, args.steps + 1):
        x, y = local_batch(args, step)
        shift = step % len(names)  # A B C, B C A, C A B, ...: no implementation always follows the same one
        for name in names[shift:] + names[:shift]:
            impl = impls[name]
            start = time.process_time()
            times[name].append(timed_step(impl, x, y))
            if step > args.warmup:
                cpu[name] += time.process_time() - start
    rounds = max(args.steps - args.warmup, 1)
    totals = torch.tensor([cpu[name] / rounds for name in impls], dtype=torch.float64)
    dist.all_reduce(totals)
    return {name: values[args.warmup :] for name, values in times.items()}, dict(
        zip(impls, totals.tolist(), strict=True)
    )


def count_collectives(impl: Impl, args: BenchArgs) -> dict[str, Any]:
    with fc.CollectiveRecorder() as recorder:
        impl.step(*local_batch(args, args.steps + 1))
    return {"bytes": recorder.total_bytes, "by_kind": dict(recorder.bytes_per_kind()), "calls": dict(recorder.counts())}


def _rank_max(values: list[int]) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def measure_memory(name: str, variant: Variant, args: BenchArgs, mesh: DeviceMesh) -> dict[str, Any] | str:
    """Peak live bytes of ``--memory-steps`` steady-state steps with only this implementation alive (each step under
    its own counter, max over ranks): ``peak`` is the highest step, ``peak_low`` the lowest.

    Two warm-up steps first: lazy initialization, optimizer state, and DDP's bucket rebuild in its second step.
    Several steps, because a step's peak depends on timing: gloo's worker thread lets go of a finished collective's
    buffers (an all-gather's output, a reduce-scatter's working copy) on its own schedule, so what is still alive at
    a later unit's reduce-scatter varies from step to step (torch FSDP2's bf16 peak moves by up to 2.3 MiB at the
    default size). A training run meets its highest step.
    """
    return peak_of(lambda: build_or_skip(name, variant, args, mesh, warmup=2), args)


def peak_of(make: Callable[[], Impl | str], args: BenchArgs) -> dict[str, Any] | str:
    """:func:`measure_memory` of the implementation ``make()`` builds and warms up (or the reason it cannot)."""
    snapshot = live_storage_keys()
    impl = make()
    if isinstance(impl, str):
        return impl
    peaks: list[int] = []
    for step in range(args.memory_steps):
        x, y = local_batch(args, 2 + step)
        counter = LiveBytesCounter()
        counter.register(tensors_since(snapshot))
        dist.barrier()
        with fc.CollectiveRecorder(scope=counter.collective_scope), gloo_reduce_scatter_copies(counter), counter:
            impl.step(x, y)
        counter.close()
        stats = [counter.peak_bytes, counter.baseline_bytes, counter.late_bytes, counter.hidden_bytes]
        peak, baseline, late, hidden = _rank_max(stats)
        peaks.append(peak)
        if step == 0:
            first = {"baseline": baseline, "late": late, "hidden": hidden, "ops": counter.ops}
        del counter
    del impl, snapshot
    gc.collect()
    return {"peak": max(peaks), "peak_low": min(peaks), "peaks": peaks, **first}


def unit_specs(args: BenchArgs, variant: Variant) -> list[UnitSpec]:
    """The units the recipe creates (each block, then the root's remaining parameters).

    Under ``frozen_params="replicate"`` a frozen unit's parameters are kept whole on every rank: not gathered.
    """
    with torch.device("meta"):
        model = GPT(args.gpt_config())
    block_ids = {id(p) for p in model.blocks.parameters()}
    last = len(model.blocks) - 1
    units = []
    for i, block in enumerate(model.blocks):
        trainable = not variant.frozen or i == last
        gathered = trainable or variant.frozen_params != "replicate"
        units.append(UnitSpec(tuple(block.parameters()), not variant.no_reshard, trainable, gathered))
    root = tuple(p for p in model.parameters() if id(p) not in block_ids)
    units.append(UnitSpec(root, reshard_after_forward=False, trainable=True))  # the root keeps its parameters
    return units


def grad_bytes(args: BenchArgs, variant: Variant) -> int:
    """The fp32 trainable gradient bytes: DDP's all-reduce payload per step (computed)."""
    units = unit_specs(args, variant)
    return sum(p.numel() * 4 for unit in units if unit.trainable for p in unit.params)


# ---------------------------------------------------------------------- one configuration
def build_all(variant: Variant, args: BenchArgs, mesh: DeviceMesh) -> tuple[dict[str, Impl], dict[str, str]]:
    """The available implementations (after one warm-up step) and the reasons for the missing ones."""
    impls: dict[str, Impl] = {}
    missing: dict[str, str] = {}
    for name in IMPLS:
        built = build_or_skip(name, variant, args, mesh)
        if isinstance(built, str):
            missing[name] = built
        else:
            impls[name] = built
    return impls, missing


def collectives_result(impls: dict[str, Impl], variant: Variant, args: BenchArgs) -> dict[str, Any]:
    """Counted bytes of both FSDPs, the theoretical minimum and DDP's computed all-reduce payload."""
    result: dict[str, Any] = {name: count_collectives(impls[name], args) for name in IMPLS[:2] if name in impls}
    param_dtype = torch.bfloat16 if variant.bf16 else torch.float32
    result["min"] = min_collective_bytes(unit_specs(args, variant), args.nproc, param_dtype, torch.float32)
    result["ddp_allreduce"] = grad_bytes(args, variant)
    return result


def run_config(variant: Variant, args: BenchArgs, mesh: DeviceMesh) -> dict[str, Any]:
    impls, missing = build_all(variant, args, mesh)
    result: dict[str, Any] = {"config": variant.name, "na": missing}
    result["times"], result["cpu"] = time_interleaved(impls, args)
    result["loss"] = {name: impl.last_loss for name, impl in impls.items()}
    result["collectives"] = collectives_result(impls, variant, args)
    del impls  # the memory step runs each implementation alone
    gc.collect()
    names = [name for name in IMPLS if name not in missing] if args.memory else []
    result["memory"] = {name: measure_memory(name, variant, args, mesh) for name in names}
    return result


def worker(rank: int, args: BenchArgs, store_path: str, result_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.nproc)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.nproc)
    try:
        mesh = init_device_mesh("cpu", (args.nproc,))
        results = []
        for name in args.configs:
            results.append(run_config(VARIANTS[name], args, mesh))
            if rank == 0:
                print(f"[bench] config {name} done", flush=True)
        if rank == 0:
            Path(result_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- entry point
def add_model_arguments(parser: argparse.ArgumentParser, *, batch_help: str = "sequences per rank per step") -> None:
    """The example GPT's size, batch and seed: the same flags in every benchmark that builds it."""
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help=batch_help)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> tuple[BenchArgs, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn")
    parser.add_argument("--configs", nargs="+", default=["fp32"], choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (each runs every implementation once)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds dropped from the statistics")
    add_model_arguments(parser)
    parser.add_argument("--no-memory", action="store_true", help="skip the live-bytes measurement")
    parser.add_argument(
        "--memory-steps", type=int, default=5, help="steps under the live-bytes counter per implementation (max kept)"
    )
    parser.add_argument("--write", metavar="PATH", help="replace the bench section of this markdown file")
    parser.add_argument("--json", metavar="PATH", help="also dump the raw per-step results as JSON")
    ns = parser.parse_args(argv)
    if ns.steps <= ns.warmup:
        parser.error("--steps must be larger than --warmup")
    if ns.memory_steps < 1:
        parser.error("--memory-steps must be at least 1")
    if ns.dim % ns.heads:
        parser.error("--dim must be divisible by --heads")
    fields = {k: v for k, v in vars(ns).items() if k not in ("write", "json", "no_memory", "configs")}
    bench = BenchArgs(configs=tuple(dict.fromkeys(ns.configs)), memory=not ns.no_memory, **fields)
    return bench, ns


def main(argv: list[str] | None = None) -> None:
    args, ns = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store_path, result_path = str(Path(tmp) / "store"), str(Path(tmp) / "results.json")
        start = time.perf_counter()
        mp.spawn(worker, args=(args, store_path, result_path), nprocs=args.nproc, join=True)
        results = json.loads(Path(result_path).read_text())
    elapsed = time.perf_counter() - start
    command = "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tables = render_tables(results, args, command, elapsed)
    print(tables)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"command": command, "args": asdict(args), "results": results}, indent=1))
    if ns.write:
        target = Path(ns.write) if Path(ns.write).is_absolute() else REPO / ns.write
        write_section(target, tables)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
