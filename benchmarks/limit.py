"""The distance to the limit: fsdp_compose and torch's ``fully_shard`` beside what a step cannot beat.

    python benchmarks/limit.py [--settings one_rank replicate_2 shard_2 shard_4] [--dtypes fp32 bf16]
                               [--dims 256 1024] [--micro 1 4] [--write docs/benchmarks.md]

Settings (each in processes of its own: a fresh gloo group per setting, dtype and size):

- ``one_rank``: one process, a mesh of one rank. Nothing to shard: the limit is the plain model (no wrapper, no
  hooks), under ``torch.autocast(dtype=torch.bfloat16)`` for bf16 (the nearest unsharded equivalent of
  ``param_dtype=bf16``: autocast casts per op and keeps fp32 weights for the optimizer, as FSDP's gathered copies do;
  it also keeps some ops in fp32 where ``param_dtype`` computes the whole module in bf16);
- ``replicate_2``: 2 ranks on a ``(replicate=2, shard=1)`` HSDP mesh, pure replication: the limit is DDP (its default
  25 MiB buckets, overlapped all-reduces; bf16 under autocast);
- ``shard_2``, ``shard_4``: 1-D FSDP over 2 and 4 ranks: no limit measured here (torch's ``fully_shard`` and DDP
  stand beside it in ``run.py``); the copies are the figure.

Per implementation and setting: the step time as the median of per-round ratios to the limit's (or torch's) step,
steps interleaved in rotating rounds as ``run.py`` does; the peak live tensor bytes (``run.py``'s counter, highest of
``--memory-steps`` steps); and the bytes copied per step outside the collectives, counted by a dispatch mode over
copy, cast and concatenation ops (``copy_``, ``_to_copy``, ``cat``, ``_chunk_cat``, ``clone``, ``stack``,
``split_with_sizes_copy``, ``_foreach_copy_``, any overload, ``out=`` ones included, and torch's ``fully_shard``'s
own ``fsdp::all_gather_copy_in`` / ``split_with_sizes_copy`` / ``chunk_cat``; bytes written, local shards for
DTensors), outside a collective's call or wait (gloo copies there). The plain model's own copies (its attention's
``contiguous`` and the like) are measured on the same local batch and subtracted: the remainder is what the
implementation adds, also given per byte of fp32 parameters.

``--micro K``: each step splits the per-rank batch into ``K`` micro-batches, all but the last without gradient
synchronisation (``fc.set_requires_gradient_sync``, torch's ``set_requires_gradient_sync``, DDP's ``no_sync``; the
plain model accumulates into ``.grad``), then one optimizer step: the cost of gradient accumulation beside the limit.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fsdp_compose as fc  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from benchmarks.run import BenchArgs, Impl, Variant, build, local_batch, peak_of, time_interleaved  # noqa: E402
from examples.gpt_model import GPT  # noqa: E402

SETTINGS = {"one_rank": (1, "plain"), "replicate_2": (2, "ddp"), "shard_2": (2, None), "shard_4": (4, None)}
COPY_OPS = {
    "aten.copy_",
    "aten._to_copy",
    "aten.cat",
    "aten._chunk_cat",
    "aten.clone",
    "aten.stack",
    "aten.split_with_sizes_copy",
    "aten._foreach_copy_",
    # torch's fully_shard runs its copies as custom ops of its own, whose inner ATen ops no dispatch mode sees
    "fsdp.all_gather_copy_in",
    "fsdp.split_with_sizes_copy",
    "fsdp.chunk_cat",
}
MIB = 2**20


class CopiedBytes(TorchDispatchMode):
    """Bytes written by copy, cast and concatenation ops while active (outputs; ``copy_``: its destination), except
    inside a collective's call or wait (:meth:`inside_collective`, the recorder's scope: gloo copies there)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.depth = 0

    @contextlib.contextmanager
    def inside_collective(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        if name in COPY_OPS and self.depth == 0:
            if "out" in kwargs:  # an out= overload writes there
                written = kwargs["out"]
            elif name in ("aten.copy_", "aten._foreach_copy_"):
                written = args[0]
            elif name == "fsdp.all_gather_copy_in":  # (all-gather input, output): it fills this rank's input
                written = out[0]
            else:
                written = out
            self.bytes += sum(_local_bytes(t) for t in (written if isinstance(written, (list, tuple)) else [written]))
        return out


def _local_bytes(tensor: Any) -> int:
    if not isinstance(tensor, torch.Tensor):
        return 0
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


@dataclass(frozen=True)
class Case:
    setting: str
    dtype: str
    dim: int
    micro: int = 1  # micro-batches per step (gradient accumulation; all but the last without synchronisation)


@dataclass
class Window(Impl):
    """One step: the per-rank batch in ``micro`` micro-batches, all but the last without gradient synchronisation
    (each implementation's own switch; the plain model simply accumulates into ``.grad``), then the optimizer step."""

    micro: int = 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = torch.zeros(())
        for index, (xs, ys) in enumerate(zip(x.chunk(self.micro), y.chunk(self.micro), strict=True)):
            with _synchronising(self, index == self.micro - 1):
                loss = self.backward(xs, ys)
        self.optimizer_step(loss)


def _synchronising(impl: Impl, last: bool) -> contextlib.AbstractContextManager[Any]:
    if impl.name == "fsdp_compose":
        fc.set_requires_gradient_sync(impl.model, last)
    elif impl.name == "torch_fsdp2":
        impl.model.set_requires_gradient_sync(last)  # type: ignore[operator]
    elif impl.name == "ddp" and not last:
        return impl.model.no_sync()  # type: ignore[operator,no-any-return]
    return contextlib.nullcontext()


def _windowed(impl: Impl, micro: int) -> Impl:
    return impl if micro == 1 else Window(impl.name, impl.model, impl.opt, impl.autocast_dtype, micro=micro)


def _plain(args: BenchArgs, bf16: bool) -> Impl:
    torch.manual_seed(args.seed)
    model = GPT(args.gpt_config())
    return Impl("plain", model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.bfloat16 if bf16 else None)


def _builders(case: Case, args: BenchArgs, mesh: DeviceMesh) -> dict[str, Callable[[], Impl]]:
    variant = Variant(case.dtype, bf16=case.dtype == "bf16")
    limit = SETTINGS[case.setting][1]
    builders: dict[str, Callable[[], Impl]] = {
        "fsdp_compose": lambda: _windowed(build("fsdp_compose", variant, args, mesh), case.micro),
        "torch_fsdp2": lambda: _windowed(build("torch_fsdp2", variant, args, mesh), case.micro),
    }
    if limit == "plain":
        builders["plain"] = lambda: _windowed(_plain(args, variant.bf16), case.micro)
    elif limit == "ddp":
        builders["ddp"] = lambda: _windowed(build("ddp", variant, args, mesh), case.micro)
    return builders


def _warm(make: Callable[[], Impl], args: BenchArgs, steps: int) -> Impl:
    impl = make()
    for step in range(steps):
        impl.step(*local_batch(args, step))
    return impl


def _copied(impl: Impl, args: BenchArgs) -> int:
    counter = CopiedBytes()
    with fc.CollectiveRecorder(scope=counter.inside_collective), counter:
        impl.step(*local_batch(args, args.steps + 2))
    return counter.bytes


def run_case(case: Case, args: BenchArgs, mesh: DeviceMesh) -> dict[str, Any]:
    builders = _builders(case, args, mesh)
    impls = {name: _warm(make, args, 1) for name, make in builders.items()}
    times, _ = time_interleaved(impls, args)
    copied = {name: _copied(impl, args) for name, impl in impls.items()}
    losses = {name: impl.last_loss for name, impl in impls.items()}
    del impls
    plain = functools.partial(_plain, args, case.dtype == "bf16")
    own = _copied(_warm(lambda: _windowed(plain(), case.micro), args, 1), args)  # the model's own copies
    peaks = {name: peak_of(functools.partial(_warm, make, args, 2), args) for name, make in builders.items()}
    params = sum(p.numel() * 4 for p in GPT(args.gpt_config()).parameters())
    return {
        "case": case.__dict__,
        "times": times,
        "copied": copied,
        "model_copies": own,
        "param_bytes": params,
        "loss": losses,
        "peak": {name: entry["peak"] if isinstance(entry, dict) else None for name, entry in peaks.items()},
    }


def worker(rank: int, case: Case, args: BenchArgs, store_path: str, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.nproc), rank=rank, world_size=args.nproc)
    try:
        if case.setting == "replicate_2":
            mesh = init_device_mesh("cpu", (args.nproc, 1), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (args.nproc,))
        result = run_case(case, args, mesh)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(case: Case, args: BenchArgs) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        store, out = str(Path(tmp) / "store"), Path(tmp) / "result.json"
        mp.spawn(worker, args=(case, args, store, str(out)), nprocs=args.nproc, join=True)
        return json.loads(out.read_text())  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- report
def _ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


HEADER = [
    "setting",
    "dtype",
    "dim",
    "limit",
    "step fc / limit",
    "step torch / limit",
    "step fc / torch",
    "peak fc / limit",
    "peak torch / limit",
    "peak fc / torch",
    "copied MiB fc / torch / limit",
    "added copies per param byte fc / torch",
]


def _peak_ratio(peak: dict[str, int | None], a: str, b: str | None) -> str:
    top, bottom = peak.get(a), peak.get(b) if b else None
    return f"{top / bottom:.2f}" if top and bottom else "-"


def _row(res: dict[str, Any]) -> list[str]:
    case, times, peak, copied = res["case"], res["times"], res["peak"], res["copied"]
    limit = SETTINGS[case["setting"]][1]
    fc_t, torch_t = times["fsdp_compose"], times["torch_fsdp2"]
    lim_t = times.get(limit) if limit else None
    added = [(copied[name] - res["model_copies"]) / res["param_bytes"] for name in ("fsdp_compose", "torch_fsdp2")]
    mib = [f"{copied[name] / MIB:.1f}" if name in copied else "-" for name in ("fsdp_compose", "torch_fsdp2", limit)]
    micro = case.get("micro", 1)
    return [
        case["setting"] + (f", {micro} micro-batches" if micro > 1 else ""),
        case["dtype"],
        str(case["dim"]),
        limit or "-",
        f"{_ratio(fc_t, lim_t):.2f}" if lim_t else "-",
        f"{_ratio(torch_t, lim_t):.2f}" if lim_t else "-",
        f"{_ratio(fc_t, torch_t):.2f}",
        _peak_ratio(peak, "fsdp_compose", limit),
        _peak_ratio(peak, "torch_fsdp2", limit),
        _peak_ratio(peak, "fsdp_compose", "torch_fsdp2"),
        " / ".join(mib),
        " / ".join(f"{value:.2f}" for value in added),
    ]


def render(results: list[dict[str, Any]], command: str, elapsed: float) -> str:
    lines = [
        f"`{command}` ({elapsed / 60:.1f} min; torch {torch.__version__}, gloo, one torch thread per rank; "
        "medians of per-round ratios, peaks the highest of the counted steps)",
        "",
        "| " + " | ".join(HEADER) + " |",
        "| " + " | ".join(["---"] * 4 + ["---:"] * (len(HEADER) - 4)) + " |",
    ]
    lines += ["| " + " | ".join(_row(res)) + " |" for res in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--dims", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--steps", type=int, default=12, help="timed rounds (each runs every implementation once)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds dropped from the statistics")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument(
        "--micro", nargs="+", type=int, default=[1], help="micro-batches per step (the batch split; accumulation)"
    )
    parser.add_argument("--write", metavar="PATH", help="replace the --section of this markdown file")
    parser.add_argument("--section", default="limit", help="marker: <!-- NAME:start --> ... <!-- NAME:end -->")
    parser.add_argument("--json", metavar="PATH", help="also dump the raw results as JSON")
    ns = parser.parse_args(argv)
    results = []
    start = time.perf_counter()
    for setting, micro in ((setting, micro) for setting in ns.settings for micro in ns.micro):
        for dim in ns.dims:
            for dtype in ns.dtypes:
                args = BenchArgs(
                    nproc=SETTINGS[setting][0],
                    configs=(),
                    steps=ns.steps,
                    warmup=ns.warmup,
                    dim=dim,
                    layers=ns.layers,
                    heads=4,
                    seq=ns.seq,
                    batch=ns.batch,
                    vocab=512,
                    seed=0,
                    memory=True,
                    memory_steps=ns.memory_steps,
                )
                results.append(run(Case(setting, dtype, dim, micro), args))
                print(f"[limit] {setting} x{micro} {dtype} d={dim} done", flush=True)
    command = "python benchmarks/limit.py " + " ".join(sys.argv[1:] if argv is None else argv)
    table = render(results, command, time.perf_counter() - start)
    print(table)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    if ns.write:
        target = Path(ns.write) if Path(ns.write).is_absolute() else REPO / ns.write
        write_section(target, table + "\n", ns.section)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
