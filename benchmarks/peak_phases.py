"""Where the bytes are at the peak of each phase of a step: fsdp_compose beside torch FSDP2 (diagnostic).

    python benchmarks/peak_phases.py --nproc 2 --configs fp32 bf16 frozen [--write docs/benchmarks.md]

The model, configs and recipe are run.py's (``--dim --layers --heads --seq --vocab --batch`` as there). Each
implementation is built alone, runs two warm-up steps, then ``--memory-steps`` steps (5), each under the live-bytes
counter of run.py's memory column (``benchmarks/memory.py``, same defaults), and shows the step whose peak is the
highest over ranks: its peak is the figure run.py reports (a step's peak depends on when gloo's thread lets go of a
finished collective's buffers, so it varies from step to step). A step has three phases:
``forward`` (model and loss), ``backward`` and ``optimizer`` (``step`` then ``zero_grad(set_to_none=True)``). At each
phase's peak the live storages are named:

- **sharded params**, **optimizer state**: the parameters and the optimizer's state before the step;
- **full params**: the storages of the plain (not sharded) parameters a unit's module holds when its forward starts
  (a forward pre-hook registered after the library's own); **all-gather bufs**: what an all-gather fills or reads
  that is not one of those (its output before the copy-out, a cast input);
- **full grads**: the ``.grad`` of those full parameters; **RS input**: what a reduce-scatter reads; **RS out /
  sharded grads**: what it fills (both libraries' sharded ``.grad`` are views of it) and any other sharded ``.grad``;
  **gloo copy**: storages first met inside a collective call or wait (gloo's working copy of a reduce-scatter
  input, counted as run.py counts it);
- **activations**: anything else made in forward and still alive; **bwd temps**: anything else made in backward
  (activation gradients, casts, the loss's gradient); **other**: the rest (the batch, the optimizer's temporaries,
  tiny collective buffers).

One table per config: per implementation and phase, the peak and the MiB per category at it (rank ``--rank``, 0 by
default; with even shapes the ranks hold the same bytes), then the difference fsdp_compose minus FSDP2.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import weakref  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import fsdp_compose as fc  # noqa: E402
from benchmarks.memory import LiveBytesCounter, gloo_reduce_scatter_copies, live_storage_keys, tensors_since  # noqa: E402
from benchmarks.report import MIB, write_section  # noqa: E402
from benchmarks.run import VARIANTS, BenchArgs, Impl, add_model_arguments, build, local_batch  # noqa: E402
from examples.gpt_model import loss_fn  # noqa: E402
from fsdp_compose.recorder import CollectiveRecord  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
IMPLS = ("fsdp_compose", "torch_fsdp2")
SHARDED, OPTIM, FULL, AG = "sharded params", "optimizer state", "full params", "all-gather bufs"
FULL_GRAD, RS_IN, RS_OUT, GLOO = "full grads", "RS input", "RS out / sharded grads", "gloo copy"
ACT, BWD, OTHER = "activations", "bwd temps", "other"
CATEGORIES = (SHARDED, OPTIM, FULL, AG, FULL_GRAD, RS_IN, RS_OUT, GLOO, ACT, BWD, OTHER)
_BORN = {"forward": ACT, "backward": BWD}


class PhaseCounter(LiveBytesCounter):
    """run.py's counter, plus the phase in which each storage appeared (its category when nothing else names it)."""

    def __init__(self) -> None:
        super().__init__()
        self.born: dict[tuple[int, int], str] = {}

    def _track(self, st: torch.UntypedStorage) -> int:
        key = st._cdata
        new = key not in self._sizes
        nbytes = super()._track(st)
        if new:
            self.born[(key, self._gen[key])] = GLOO if self._in_collective else self.phase
        return nbytes

    def categories(self, phase: str) -> dict[str, int]:
        """Bytes per category at ``phase``'s peak."""
        sizes, gens = self._peak_live.get(phase, ({}, {}))
        totals = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes in sizes.items():
            ident = (key, gens[key])
            label = self._labels.get(ident)
            if label is None:
                born = self.born.get(ident, "")
                label = born if born == GLOO else _BORN.get(born, OTHER)
            totals[label] += nbytes
        return totals


class Labeller:
    """Names the storages of one implementation's step (see the module docstring)."""

    def __init__(self, counter: PhaseCounter, impl: Impl) -> None:
        self.counter = counter
        self.full: dict[int, weakref.ref[torch.Tensor]] = {}
        model = impl.model
        params = list(model.parameters())
        counter.label(params, SHARDED)  # first: a parameter kept whole (frozen_params="replicate") stays here
        counter.label([v for s in impl.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)], OPTIM)
        units = [m for m in model.modules() if fc.get_state(m) is not None or hasattr(m, "_get_fsdp_state")]
        self.handles = [m.register_forward_pre_hook(self._pre_forward) for m in units]
        counter.on_new_peak = self._label_full_grads

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        for param in module.parameters():
            if not isinstance(param, DTensor) and self.counter.label_of(param.untyped_storage()) != SHARDED:
                self.full.setdefault(id(param), weakref.ref(param))
                self.counter.label([param], FULL, replace=True)

    def _label_full_grads(self) -> None:
        for ref in self.full.values():
            param = ref()
            if param is not None and param.grad is not None:
                self.counter.label([param.grad], FULL_GRAD)

    def on_collective(
        self, record: CollectiveRecord, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]
    ) -> None:
        if record.kind == "all_gather":
            self.counter.label(outputs + inputs, AG)
        elif record.kind == "reduce_scatter":
            self.counter.label(inputs, RS_IN, replace=True)
            self.counter.label(outputs, RS_OUT)
        else:
            self.counter.label(outputs + inputs, OTHER)

    def after_backward(self, model: nn.Module) -> None:
        self.counter.label([p.grad for p in model.parameters() if p.grad is not None], RS_OUT)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.counter.on_new_peak = None


def measure(name: str, config: str, args: BenchArgs, mesh: DeviceMesh) -> dict[str, Any]:
    """``--memory-steps`` steps of ``name`` alone after two warm-up steps; the one with the highest peak (max over
    ranks: every rank reports the same step), with each phase's peak and its categories (this rank)."""
    snapshot = live_storage_keys()
    impl = build(name, VARIANTS[config], args, mesh)
    for step in range(2):
        impl.step(*local_batch(args, step))
    chosen: dict[str, Any] = {}
    step_peaks: list[int] = []
    for step in range(args.memory_steps):
        result = _measure_step(impl, snapshot, *local_batch(args, 2 + step))
        peak = torch.tensor([result["peak"]], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["peak_max_over_ranks"] = int(peak.item())
        step_peaks.append(result["peak_max_over_ranks"])
        if not chosen or result["peak_max_over_ranks"] > chosen["peak_max_over_ranks"]:
            chosen = result
    chosen["step_peaks"] = step_peaks
    del impl, snapshot
    gc.collect()
    return chosen


def _measure_step(impl: Impl, snapshot: dict[int, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One step under the phase counter: each phase's peak and the categories alive at it."""
    counter = PhaseCounter()
    counter.register(tensors_since(snapshot))
    counter.label([x, y], OTHER)
    labeller = Labeller(counter, impl)
    recorder = fc.CollectiveRecorder(scope=counter.collective_scope, observer=labeller.on_collective)
    dist.barrier()
    with recorder, gloo_reduce_scatter_copies(counter), counter:
        counter.set_phase("forward")
        loss = loss_fn(impl.model(x), y)
        counter.set_phase("backward")
        loss.backward()
        del loss
        labeller.after_backward(impl.model)
        counter.set_phase("optimizer")
        impl.opt.step()
        impl.opt.zero_grad(set_to_none=True)
    labeller.remove()
    result = {
        "baseline": counter.baseline_bytes,
        "peak": counter.peak_bytes,
        "phases": {phase: counter.phase_peaks.get(phase, 0) for phase in PHASES},
        "ops": {phase: counter.phase_peak_op.get(phase, "") for phase in PHASES},
        "categories": {phase: counter.categories(phase) for phase in PHASES},
    }
    counter.close()
    return result


def worker(rank: int, args: BenchArgs, report_rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.nproc), rank=rank, world_size=args.nproc)
    try:
        mesh = init_device_mesh("cpu", (args.nproc,))
        results = {c: {n: measure(n, c, args, mesh) for n in IMPLS} for c in args.configs}
        if rank == report_rank:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def render(results: dict[str, dict[str, Any]], args: BenchArgs, command: str, rank: int) -> str:
    short = {"fsdp_compose": "fc", "torch_fsdp2": "FSDP2"}
    lines = [
        f"Command: `{command}`",
        "",
        f"Model: examples/gpt_model.py GPT, dim={args.dim} layers={args.layers} heads={args.heads} seq={args.seq} "
        f"vocab={args.vocab}; batch {args.batch} sequences per rank; AdamW(lr=1e-3); {args.nproc} gloo ranks; "
        f"torch {torch.__version__}. {args.memory_steps} steps per implementation; shown: the step with the highest "
        f"peak. Live MiB on rank {rank} at each phase's peak (benchmarks/peak_phases.py's docstring defines the "
        "categories); the step's peak is the largest phase peak.",
    ]
    header = ["impl / phase", "peak", *CATEGORIES]
    for config, by_impl in results.items():
        fc_r, t_r = by_impl["fsdp_compose"], by_impl["torch_fsdp2"]
        ratio = fc_r["peak_max_over_ranks"] / t_r["peak_max_over_ranks"]
        lines += [
            "",
            f"**{config}**: step peak fc {_mib(fc_r['peak_max_over_ranks'])} MiB vs FSDP2 "
            f"{_mib(t_r['peak_max_over_ranks'])} MiB (max over ranks; fc / FSDP2 = {ratio:.3f}); start of step "
            f"{_mib(fc_r['baseline'])} / {_mib(t_r['baseline'])} MiB; step peaks fc "
            f"{', '.join(_mib(p) for p in fc_r['step_peaks'])}, FSDP2 {', '.join(_mib(p) for p in t_r['step_peaks'])}.",
            "",
            "| " + " | ".join(header) + " |",
            "| --- | " + " | ".join("---:" for _ in header[1:]) + " |",
        ]
        for phase in PHASES:
            cats = {n: by_impl[n]["categories"][phase] for n in IMPLS}
            for n in IMPLS:
                row = [f"{short[n]} {phase}", _mib(by_impl[n]["phases"][phase])]
                row += [_mib(cats[n][c]) if cats[n][c] else "·" for c in CATEGORIES]
                lines.append("| " + " | ".join(row) + " |")
            diff = [by_impl["fsdp_compose"]["phases"][phase] - by_impl["torch_fsdp2"]["phases"][phase]]
            diff += [cats["fsdp_compose"][c] - cats["torch_fsdp2"][c] for c in CATEGORIES]
            lines.append("| " + " | ".join([f"fc − FSDP2 {phase}", *(f"{d / MIB:+.2f}" if d else "·" for d in diff)]))
            lines[-1] += " |"
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BenchArgs, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["fp32", "bf16", "frozen"], choices=sorted(VARIANTS))
    add_model_arguments(parser)
    parser.add_argument("--rank", type=int, default=0, help="the rank whose live set is shown")
    parser.add_argument("--memory-steps", type=int, default=5, help="measured steps; the highest peak is shown")
    parser.add_argument("--write", metavar="PATH", help="replace the peak-phases section of this markdown file")
    parser.add_argument("--section", default="peak-phases", help="the marked section --write replaces")
    parser.add_argument("--json", metavar="PATH", help="also dump the raw results")
    ns = parser.parse_args(argv)
    if ns.memory_steps < 1:
        parser.error("--memory-steps must be at least 1")
    fields = {k: v for k, v in vars(ns).items() if k not in ("write", "json", "configs", "rank", "section")}
    bench = BenchArgs(configs=tuple(dict.fromkeys(ns.configs)), steps=1, warmup=0, memory=True, **fields)
    return bench, ns


def main(argv: list[str] | None = None) -> None:
    args, ns = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store, out = str(Path(tmp) / "store"), str(Path(tmp) / "out.json")
        mp.spawn(worker, args=(args, ns.rank, store, out), nprocs=args.nproc, join=True)
        results = json.loads(Path(out).read_text())
    command = "python benchmarks/peak_phases.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(results, args, command, ns.rank)
    print(text)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    if ns.write:
        target = Path(ns.write) if Path(ns.write).is_absolute() else REPO / ns.write
        write_section(target, text + "\n", name=ns.section)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
