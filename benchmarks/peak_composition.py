"""What is alive at the peak of the synchronising micro-batch (diagnostic; see accumulation.py for the figures).

    python benchmarks/peak_composition.py --nproc 2 --dim 512 --layers 4 --heads 4 --vocab 512 --batch 1 --seq 16

Runs accumulation.py's window (``--micro`` micro-batches, the last one synchronising) for fsdp_compose "unsharded" and
torch FSDP2, each alone after two warm-up windows, under :class:`LabelledCounter`: the live-bytes counter of
memory.py that also labels every storage it tracks and snapshots the live set whenever the sync micro-batch reaches a
new peak. Labels:

- storages alive before the window are named by what they are (sharded parameters, optimizer state, a unit's full
  parameters or accumulated gradients), found through the implementation's own objects;
- new storages by the op that made them and the innermost call site in fsdp_compose / torch FSDP2 / the model, or
  "autograd" for ops the autograd engine runs (gradients of activations and parameters).

Printed per implementation (rank 0; ``--rank`` picks another): the peak, the op and the call site that reached it, the
live MiB per label and per coarse category.
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
import traceback  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

import fsdp_compose as fc  # noqa: E402
from benchmarks import memory  # noqa: E402
from benchmarks.accumulation import AccumArgs, parse_args, run_window, warmed_up  # noqa: E402
from benchmarks.memory import LiveBytesCounter, live_storage_keys, storages_of, tensors_since  # noqa: E402
from benchmarks.report import MIB  # noqa: E402

_SITES = ("fsdp_compose/", "torch/distributed/fsdp/", "fsdp_compose/plan/gpt.py", "torch/autograd/")


_GENERIC = ("allocate", "__call__", "_fn", "wrapper")


def _call_site() -> str:
    """The innermost frame in fsdp_compose, torch FSDP2, the model or autograd (and its caller's name when that
    frame is a generic helper such as FSDP2's ``allocate``)."""
    found: list[str] = []
    for frame in reversed(traceback.extract_stack()[:-3]):
        if any(site in frame.filename for site in _SITES):
            if found:
                return f"{found[0]} < {frame.name}"
            short = frame.filename.split("site-packages/")[-1].split("wt-mem/")[-1]
            found.append(f"{short}:{frame.lineno} {frame.name}")
            if frame.name not in _GENERIC:
                return found[0]
    return found[0] if found else "?"


class LabelledCounter(LiveBytesCounter):
    """The live-bytes counter, plus a label per storage and a snapshot of the live set at each new peak."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[int, str] = {}
        self.names: dict[int, str] = {}  # storage key -> name, for storages known before the window
        self.op = "?"
        self.snapshot: dict[int, tuple[int, str]] = {}
        self.snapshot_op = ""
        self.snapshot_site = ""
        self.recording = False
        self.held = 0
        self.timeline: list[tuple[int, str, str]] = []

    def name(self, tensors: Any, label: str) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st in storages_of(t):
                    self.names.setdefault(st._cdata, label)
            elif isinstance(t, torch.UntypedStorage):
                self.names.setdefault(t._cdata, label)

    def _track(self, st: torch.UntypedStorage) -> int:
        key = st._cdata
        if key not in self._sizes:
            if key in self.names:
                self.labels[key] = self.names[key]
            else:
                self.labels[key] = f"new: {self.op} @ {_call_site()}"
        return super()._track(st)

    def _freed_callback(self, key: int) -> Callable[[Any], None]:
        inner = super()._freed_callback(key)

        def freed(ref: Any) -> None:
            inner(ref)
            self.labels.pop(key, None)
            self.names.pop(key, None)  # the key (a StorageImpl address) may be reused by a new storage

        return freed

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.op = str(func.overloadpacket.__name__)
        before = self.peak_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.recording:
            self.timeline.append((self.current_bytes, self.op, _call_site()))
            if self.peak_bytes > before:
                self.snapshot = {k: (n, self.labels.get(k, "?")) for k, n in self._sizes.items() if n}
                self.snapshot_op = self.op
                self.snapshot_site = _call_site()
        return out


def _name_fc(counter: LabelledCounter, model: nn.Module) -> None:
    from fsdp_compose.state import states_under

    for state in states_under(model):
        unit = state.params
        name = unit.owner_name or "root"
        counter.name([unit.shards.flat], "sharded params (flat)")
        if state.grads.input.buffer is not None:
            counter.name([state.grads.input.buffer], f"held: accumulated grads [{name}]")
        for mp_ in unit.shards.params:
            if mp_.full_data is not None and mp_.slot is not None:
                counter.name([mp_.full_data], f"full params [{name}]")


def _name_fsdp2(counter: LabelledCounter, model: nn.Module) -> None:
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = get_state()._fsdp_param_group
        if group is None:
            continue
        name = type(module).__name__ if module is not model else "root"
        for fp in group.fsdp_params:
            counter.name([fp._sharded_param_data], "sharded params (flat)")
            acc = fp.unsharded_accumulated_grad
            if acc is not None:
                counter.name([acc], f"held: accumulated grads [{name}]")
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                if unsharded.grad is not None:
                    counter.name([unsharded.grad], f"held: unsharded .grad [{name}]")
                counter.name([unsharded], f"full params [{name}]")
            for t in getattr(fp, "all_gather_outputs", []) or []:
                counter.name([t], f"full params [{name}]")


_CATEGORIES = (  # (substring of the label, category), first match wins
    ("held: ", "accumulated grads held from the no-sync micro-batches (incl. one in flight)"),
    ("full params", "full (unsharded) parameters"),
    ("sharded params", "sharded parameters"),
    ("optimizer state", "optimizer state"),
    ("_wait_reduce_scatter", "reduce-scatter: backend working copy of the input (gloo)"),
    ("split @ torch/distributed/fsdp", "reduce-scatter: backend working copy of the input (gloo)"),
    ("grads.py:", "reduce-scatter output (becomes the sharded .grad)"),
    ("< foreach_reduce", "reduce-scatter input / output (FSDP2)"),
    ("unit.py:", "all-gather output / input"),
    ("< foreach_all_gather", "all-gather output / input"),
    ("_get_param_all_gather_inputs", "all-gather output / input"),
    ("fsdp_compose/plan/gpt.py", "activations (forward)"),
    ("torch/autograd/", "autograd backward (activation and parameter gradients)"),
)


def _category(label: str) -> str:
    for key, category in _CATEGORIES:
        if key in label:
            return category
    return "other: " + label


class _SyncPhase:
    """accumulation.run_window's ``phase``: names what the no-sync micro-batches left, then records the sync one."""

    def __init__(self, counter: LabelledCounter, name: str, model: nn.Module) -> None:
        self.counter, self.name, self.model = counter, name, model

    def name_known(self) -> None:
        counter = self.counter
        (_name_fc if self.name.startswith("fc_") else _name_fsdp2)(counter, self.model)
        for key in list(counter.labels):
            if key in counter.names:
                counter.labels[key] = counter.names[key]

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        counter = self.counter
        if phase == "sync":
            self.name_known()  # the held buffers, the full parameters
            counter.peak_bytes = counter.current_bytes
            counter.recording = True
            counter.held = counter.current_bytes
        yield
        counter.recording = False


def measure(name: str, args: AccumArgs, mesh: DeviceMesh) -> dict[str, Any]:
    snapshot = live_storage_keys()
    impl, batches = warmed_up(name, args, mesh)
    counter = LabelledCounter()
    counter.name(list(impl.model.parameters()), "sharded params")
    for st in impl.opt.state.values():
        counter.name([v for v in st.values() if isinstance(v, torch.Tensor)], "optimizer state")
    counter.register(tensors_since(snapshot))
    phase = _SyncPhase(counter, name, impl.model)
    dist.barrier()
    with fc.CollectiveRecorder(scope=counter.collective_scope), memory.gloo_reduce_scatter_copies(counter), counter:
        phase.name_known()  # e.g. full parameter storages parked at 0 bytes
        run_window(impl, batches, phase, step=False)
    by_label: dict[str, int] = defaultdict(int)
    by_cat: dict[str, int] = defaultdict(int)
    big = sorted(((n, label) for n, label in counter.snapshot.values() if n >= MIB), reverse=True)
    for nbytes, label in counter.snapshot.values():
        by_label[label] += nbytes
        by_cat[_category(label)] += nbytes
    result = {
        "peak": counter.peak_bytes,
        "held": counter.held,
        "op": counter.snapshot_op,
        "site": counter.snapshot_site,
        "by_label": dict(by_label),
        "by_cat": dict(by_cat),
        "timeline": counter.timeline,
        "big": big,
    }
    counter.close()
    del impl, snapshot, batches, counter, phase
    gc.collect()
    return result


def worker(rank: int, args: AccumArgs, store_path: str, out: str, names: list[str], report_rank: int) -> None:
    torch.set_num_threads(1)
    nproc = args.bench.nproc
    dist.init_process_group("gloo", store=dist.FileStore(store_path, nproc), rank=rank, world_size=nproc)
    try:
        mesh = init_device_mesh("cpu", (nproc,))
        results = {n: measure(n, args, mesh) for n in names}
        if rank == report_rank:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--rank", type=int, default=0, help="the rank whose live set is printed")
    extra.add_argument("--impls", nargs="+", default=["fc_unsharded", "torch_fsdp2"], help="implementations to run")
    extra.add_argument("--timeline", action="store_true", help="print the live MiB after every op of the sync phase")
    extra.add_argument("--json", help="dump the raw results here")
    args, ns = parse_args(description=__doc__, parents=[extra], write_flags=False)
    with tempfile.TemporaryDirectory() as tmp:
        store, out = str(Path(tmp) / "store"), str(Path(tmp) / "out.json")
        mp.spawn(worker, args=(args, store, out, ns.impls, ns.rank), nprocs=args.bench.nproc, join=True)
        results = json.loads(Path(out).read_text())
    if ns.json:
        Path(ns.json).write_text(json.dumps(results))
    for name, r in results.items():
        print(
            f"\n=== {name} (rank {ns.rank}): sync peak {r['peak'] / MIB:.2f} MiB, held at sync start "
            f"{r['held'] / MIB:.2f} MiB; reached by {r['op']} @ {r['site']}"
        )
        print("  by category:")
        for cat, n in sorted(r["by_cat"].items(), key=lambda kv: -kv[1]):
            print(f"    {n / MIB:9.2f}  {cat}")
        print("  by label:")
        for label, n in sorted(r["by_label"].items(), key=lambda kv: -kv[1]):
            if n >= 0.01 * MIB:
                print(f"    {n / MIB:9.2f}  {label}")
        print("  storages >= 1 MiB:")
        for n, label in r["big"]:
            print(f"    {n / MIB:9.2f}  {label}")
        if ns.timeline:
            print("  timeline (MiB after op):")
            last = None
            for cur, op, site in r["timeline"]:
                if last is None or abs(cur - last) >= 0.05 * MIB:
                    print(f"    {cur / MIB:9.2f}  {op} @ {site}")
                    last = cur


if __name__ == "__main__":
    main()
