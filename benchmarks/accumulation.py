"""Gradient accumulation: memory and time of fsdp_compose "unsharded" and "sharded" accumulation vs torch FSDP2.

    python benchmarks/accumulation.py --nproc 2 [--write docs/benchmarks.md]

The example GPT with bf16 compute and fp32 reduction (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`` for both FSDPs, every block then the root). One *window* is ``--micro`` micro-batches of
``--batch`` sequences per rank, all but the last under no-sync (``fc.no_sync(model)``; torch:
``model.set_requires_gradient_sync(False)``), the loss divided by ``--micro``, then the optimizer step:

- ``fc_unsharded``: fsdp_compose's default, full-size fp32 gradients accumulate in the reduce-scatter layout, one
  reduce-scatter per window;
- ``fc_sharded``: ``fc.set_gradient_accumulation(model, "sharded")``, a reduce-scatter per micro-batch into the
  sharded fp32 ``.grad`` (ZeRO-2 style);
- ``torch_fsdp2``: ``torch.distributed.fsdp.fully_shard`` (accumulates full-size gradients, upcast to fp32).

Correctness: the three are built from the same seed and run one window on the same batches; the sharded gradients
are compared (max absolute difference, max over ranks). Time: interleaved rounds of one window each, as in run.py.
Memory: each implementation alone runs ``--memory-steps`` more windows (3), each under the live-bytes counter
(memory.py), which records the peak of each phase (no-sync micro-batches, the synchronising micro-batch, optimizer
step) and the bytes held after the no-sync micro-batches; every figure is the highest of those windows (as in
run.py: a window's peak on gloo depends on gloo's timing). The collectives of the first are counted too
(``fc.CollectiveRecorder``).
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
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import fsdp_compose as fc  # noqa: E402
from benchmarks.memory import LiveBytesCounter, gloo_reduce_scatter_copies, live_storage_keys, tensors_since  # noqa: E402
from benchmarks.report import MIB, _header, _ms, _ratio, _table, write_section  # noqa: E402
from benchmarks.run import VARIANTS, BenchArgs, Impl, _rank_max, add_model_arguments, build, local_batch  # noqa: E402
from examples.gpt_model import loss_fn  # noqa: E402

ACCUM = ("fc_unsharded", "fc_sharded", "torch_fsdp2")
LABEL = {"fc_unsharded": 'fsdp_compose "unsharded"', "fc_sharded": 'fsdp_compose "sharded"', "torch_fsdp2": "FSDP2"}
Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AccumArgs:
    bench: BenchArgs  # model size, batch per micro-batch, seed, rounds
    micro: int


def build_accum(name: str, args: AccumArgs, mesh: DeviceMesh) -> Impl:
    impl = build("torch_fsdp2" if name == "torch_fsdp2" else "fsdp_compose", VARIANTS["bf16"], args.bench, mesh)
    if name == "fc_sharded":
        fc.set_gradient_accumulation(impl.model, "sharded")
    impl.name = name
    return impl


@contextlib.contextmanager
def no_sync(impl: Impl) -> Iterator[None]:
    if impl.name.startswith("fc_"):
        with fc.no_sync(impl.model):
            yield
        return
    impl.model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        impl.model.set_requires_gradient_sync(True)  # type: ignore[operator]


def window_batches(args: AccumArgs, window: int) -> Batches:
    return [local_batch(args.bench, window * args.micro + i) for i in range(args.micro)]


def warmed_up(name: str, args: AccumArgs, mesh: DeviceMesh) -> tuple[Impl, Batches]:
    """The implementation after two warm-up windows (lazy init, optimizer state) and the batches of the next one."""
    impl = build_accum(name, args, mesh)
    for w in range(2):
        run_window(impl, window_batches(args, w))
    return impl, window_batches(args, 2)


def _micro_batch(impl: Impl, x: torch.Tensor, y: torch.Tensor, micro: int) -> float:
    loss = loss_fn(impl.model(x), y) / micro
    loss.backward()
    return loss.item()


def run_window(
    impl: Impl,
    batches: Batches,
    phase: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
    step: bool = True,
) -> None:
    """``len(batches) - 1`` no-sync micro-batches, one synchronising micro-batch, then (``step``) the optimizer."""
    phase = phase or (lambda name: contextlib.nullcontext())
    loss = 0.0
    with phase("no_sync"), no_sync(impl):
        for x, y in batches[:-1]:
            loss += _micro_batch(impl, x, y, len(batches))
    with phase("sync"):
        loss += _micro_batch(impl, *batches[-1], len(batches))
    impl.last_loss = loss
    if step:
        with phase("optimizer"):
            impl.opt.step()
            impl.opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------- correctness
def _local_grads(impl: Impl) -> dict[str, torch.Tensor]:
    grads = {}
    for fqn, param in impl.model.named_parameters():
        grad = param.grad
        if grad is not None:
            grads[fqn] = (grad.to_local() if isinstance(grad, DTensor) else grad).float()
    return grads


def compare_grads(impls: dict[str, Impl]) -> dict[str, float]:
    """Max |difference| of the sharded gradients after one window (max over ranks), and the max |gradient|."""
    grads = {name: _local_grads(impl) for name, impl in impls.items()}
    reference = grads["torch_fsdp2"]
    result: dict[str, float] = {"max_abs_grad": max(g.abs().max().item() for g in reference.values())}
    for name in ("fc_unsharded", "fc_sharded"):
        if set(grads[name]) != set(reference):
            raise AssertionError(f"{name} has gradients for {sorted(set(grads[name]) ^ set(reference))} differently")
        result[f"{name} vs FSDP2"] = max((grads[name][k] - reference[k]).abs().max().item() for k in reference)
    result["unsharded vs sharded"] = max(
        (grads["fc_unsharded"][k] - grads["fc_sharded"][k]).abs().max().item() for k in reference
    )
    keys = list(result)
    return dict(zip(keys, [float(v) for v in _rank_max_float([result[k] for k in keys])], strict=True))


def _rank_max_float(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


# ---------------------------------------------------------------------- memory
class PhasePeaks:
    """``with phases("sync"): ...`` records the counter's peak inside the block and the bytes alive after it."""

    def __init__(self, counter: LiveBytesCounter) -> None:
        self.counter = counter
        self.peak: dict[str, int] = {}
        self.after: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.counter.peak_bytes = self.counter.current_bytes
        yield
        self.peak[name] = self.counter.peak_bytes
        self.after[name] = self.counter.current_bytes


def measure_memory(name: str, args: AccumArgs, mesh: DeviceMesh) -> dict[str, Any]:
    """``--memory-steps`` windows with only this implementation alive, after two warm-up windows (lazy init,
    optimizer state), each under its own counter: every figure is the highest of them (max over ranks), as in
    run.py (a window's peak on gloo depends on when gloo's thread lets go of finished collectives' buffers)."""
    snapshot = live_storage_keys()
    impl, batches = warmed_up(name, args, mesh)
    keys = ["start", "hidden", "held", "no_sync", "sync", "optimizer"]
    result: dict[str, Any] = {}
    for window in range(args.bench.memory_steps):
        counter = LiveBytesCounter()
        counter.register(tensors_since(snapshot))
        phases = PhasePeaks(counter)
        dist.barrier()
        with (
            fc.CollectiveRecorder(scope=counter.collective_scope) as coll,
            gloo_reduce_scatter_copies(counter),
            counter,
        ):
            run_window(impl, batches, phases)
        counter.close()
        values = [counter.baseline_bytes, counter.hidden_bytes, phases.after["no_sync"]]
        values += [phases.peak[p] for p in ("no_sync", "sync", "optimizer")]
        for key, value in zip(keys, _rank_max(values), strict=True):
            result[key] = value if window == 0 else max(result[key], value)
        if window == 0:
            calls, nbytes = coll.counts(), coll.bytes_per_kind()
            result["collectives"] = {kind: [calls[kind], nbytes[kind]] for kind in sorted(nbytes)}
        del counter, phases
    result["window"] = max(result["start"], result["no_sync"], result["sync"], result["optimizer"])
    del impl, snapshot, batches
    gc.collect()
    return result


# ---------------------------------------------------------------------- one run
def progress(message: str) -> None:
    """A progress line on rank 0 (the run takes a minute or more; the report comes at the end)."""
    if dist.get_rank() == 0:
        print(f"[accumulation] {message}", flush=True)


def worker(rank: int, args: AccumArgs, store_path: str, result_path: str) -> None:
    torch.set_num_threads(1)
    nproc = args.bench.nproc
    dist.init_process_group("gloo", store=dist.FileStore(store_path, nproc), rank=rank, world_size=nproc)
    try:
        mesh = init_device_mesh("cpu", (nproc,))
        impls = {name: build_accum(name, args, mesh) for name in ACCUM}
        batches = window_batches(args, 0)
        for impl in impls.values():
            run_window(impl, batches, step=False)  # also the untimed warm-up
        progress(f"built {', '.join(ACCUM)}; gradients after one window compared")
        result: dict[str, Any] = {"grads": compare_grads(impls)}
        result["first_loss"] = {name: impl.last_loss for name, impl in impls.items()}
        for impl in impls.values():
            impl.opt.zero_grad(set_to_none=True)
        times: dict[str, list[float]] = {name: [] for name in ACCUM}
        for window in range(1, args.bench.steps + 1):
            batches = window_batches(args, window)
            for name, impl in impls.items():
                dist.barrier()
                start = time.perf_counter()
                run_window(impl, batches)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
            if window % max(1, args.bench.steps // 4) == 0 or window == args.bench.steps:
                progress(f"timed window {window}/{args.bench.steps}")
        result["times"] = {name: values[args.bench.warmup :] for name, values in times.items()}
        result["loss"] = {name: impl.last_loss for name, impl in impls.items()}
        del impls
        gc.collect()
        result["memory"] = {}
        for name in ACCUM:
            result["memory"][name] = measure_memory(name, args, mesh)
            progress(f"memory of {name} measured")
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- report
def render(result: dict[str, Any], args: AccumArgs, command: str, elapsed: float) -> str:
    bench = args.bench
    header = _header(bench, command, elapsed).replace(f" Configs: {', '.join(bench.configs)}.", "")
    header = header.replace("interleaved rounds", "interleaved rounds (one window each)")
    header += (
        f"\n\nBoth FSDPs: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32). One window: {args.micro} "
        f"micro-batches ({args.micro - 1} no-sync + 1 synchronising) of {bench.batch} sequences per rank, then "
        "the optimizer step."
    )
    times, mem, grads = result["times"], result["memory"], result["grads"]
    ref = times["torch_fsdp2"]
    time_rows = [
        [LABEL[n], _ms(times[n]), _ratio(times[n], ref), _ratio(times[n], times["fc_unsharded"])] for n in ACCUM
    ]
    time_table = _table(["implementation", "ms per window", "/ FSDP2", '/ fc "unsharded"'], time_rows)

    def mib(value: int) -> str:
        return f"{value / MIB:.2f}"

    mem_rows = []
    for n in ACCUM:
        m = mem[n]
        colls = ", ".join(
            f"{kind} {calls} x / {nbytes / MIB:.2f} MiB" for kind, (calls, nbytes) in m["collectives"].items()
        )
        ratio_sync = f"{m['sync'] / mem['torch_fsdp2']['sync']:.2f}"
        ratio_window = f"{m['window'] / mem['torch_fsdp2']['window']:.2f}"
        cells = [mib(m[k]) for k in ("start", "no_sync", "held", "sync", "optimizer", "window")]
        mem_rows.append([LABEL[n], *cells, ratio_sync, ratio_window, colls])
    mem_header = ["implementation", "start", "no-sync peak", "held before sync", "(a) sync micro-batch peak"]
    mem_header += ["optimizer peak", "(b) window peak", "(a) / FSDP2", "(b) / FSDP2", "collectives per window"]
    hidden = [n for n in ACCUM if mem[n]["hidden"]]
    grad_line = ", ".join(f"{k} {v:.3g}" for k, v in grads.items() if k != "max_abs_grad")
    parts = [
        header,
        "**Window time** — median ms per window; ratios are medians of per-round ratios.",
        time_table,
        f"**Peak live tensor MiB** (max over ranks), the highest of {args.bench.memory_steps} windows, each "
        "implementation alone after two warm-up windows. Start: parameters and optimizer state. Held before sync: "
        "alive after the no-sync micro-batches (the accumulated gradients on top of the start). (a): forward and "
        "backward of the synchronising micro-batch; (b): the whole window, optimizer step included. Collectives: "
        "calls and MiB per rank (all-gather output + reduce-scatter input).",
        _table(mem_header, mem_rows),
        f"**Correctness** — sharded gradients after one window, max |difference| over all parameters and ranks: "
        f"{grad_line} (largest |gradient| {grads['max_abs_grad']:.3g}). Window losses fc unsharded / fc sharded / "
        "FSDP2: " + " / ".join(f"{result['first_loss'][n]:.5f}" for n in ACCUM) + ".",
    ]
    if hidden:
        parts.append(f"Warning: C++-only buffers counted for {', '.join(hidden)} (see memory.py).")
    return "\n\n".join(parts) + "\n"


def parse_args(
    argv: list[str] | None = None,
    *,
    description: str | None = __doc__,
    parents: Sequence[argparse.ArgumentParser] = (),
    write_flags: bool = True,
) -> tuple[AccumArgs, argparse.Namespace]:
    """This script's arguments; another script reusing them passes its own ``description`` and extra options
    (``parents``), and ``write_flags=False`` when it writes no report section, so that its ``--help`` fits it."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per window (the last one synchronises)")
    parser.add_argument("--steps", type=int, default=12, help="timed rounds (each runs every implementation's window)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds dropped from the statistics")
    add_model_arguments(parser, batch_help="sequences per rank per micro-batch")
    parser.add_argument("--memory-steps", type=int, default=3, help="measured windows per implementation (max kept)")
    if write_flags:
        parser.add_argument("--write", metavar="PATH", help="replace the --section of this markdown file")
        parser.add_argument("--section", default="accum", help="marker: <!-- NAME:start --> ... <!-- NAME:end -->")
    ns = parser.parse_args(argv)
    if ns.steps <= ns.warmup:
        parser.error("--steps must be larger than --warmup")
    if ns.memory_steps < 1:
        parser.error("--memory-steps must be at least 1")
    if ns.micro < 2:
        parser.error("--micro must be at least 2 (no-sync micro-batches, then the synchronising one)")
    bench_fields = ("nproc", "steps", "warmup", "dim", "layers", "heads", "seq", "batch", "vocab", "seed")
    bench_fields += ("memory_steps",)
    fields = {k: getattr(ns, k) for k in bench_fields}
    bench = BenchArgs(configs=("bf16",), memory=True, **fields)
    return AccumArgs(bench, ns.micro), ns


def main(argv: list[str] | None = None) -> None:
    args, ns = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store_path, result_path = str(Path(tmp) / "store"), str(Path(tmp) / "result.json")
        start = time.perf_counter()
        mp.spawn(worker, args=(args, store_path, result_path), nprocs=args.bench.nproc, join=True)
        result = json.loads(Path(result_path).read_text())
    command = "python benchmarks/accumulation.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(result, args, command, time.perf_counter() - start)
    print(text)
    if ns.write:
        target = Path(ns.write) if Path(ns.write).is_absolute() else REPO / ns.write
        write_section(target, text, ns.section)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
