"""The planner's figures next to torch's own tracker on torch's ``fully_shard`` (FSDP2), same model, same ranks.

    python benchmarks/planner_vs_torch.py [--write docs/planner.md]

For each case, in this process on torch's fake process group under ``FakeTensorMode``:

- **fsdp_compose (planner)**: ``fsdp_compose.plan.plan`` — fsdp_compose's step under the live-bytes counter;
- **FSDP2, live-bytes counter**: torch's ``fully_shard`` on the same model (blocks, then the root), the same
  counter, registration and phases as the planner (``benchmarks/memory.py``'s counter, re-read after every op);
- **FSDP2, FSDPMemTracker**: ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` around the same kind of
  step of a fresh FSDP2 model (its peak is sampled at module and optimizer boundaries, not after every op).

All three run one warm-up step first (lazy initialization, optimizer state), fp32, AdamW (per-parameter loop),
``reshard_after_forward`` torch's and fsdp_compose's defaults (blocks resharded, root kept).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from benchmarks.report import write_section  # noqa: E402
from fsdp_compose.plan import PlanConfig, fmt_bytes, load_model_spec, plan  # noqa: E402
from fsdp_compose.plan.live_bytes import LiveBytesCounter, live_storage_keys, tensors_since  # noqa: E402
from fsdp_compose.plan.simulate import fake_process_group, fake_tensors  # noqa: E402


@dataclass(frozen=True)
class Case:
    model: str
    model_args: tuple[tuple[str, Any], ...]
    world_size: int
    batch: int
    seq: int

    def config(self) -> PlanConfig:
        return PlanConfig(
            model=self.model,
            model_args=dict(self.model_args),
            world_size=self.world_size,
            batch_size=self.batch,
            seq_len=self.seq,
        )

    def label(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.model_args)
        return f"{self.model}{f' ({args})' if args else ''}, {self.world_size} ranks, batch {self.batch} x {self.seq}"


CASES = (
    Case("gpt", (("dim", 64), ("n_heads", 4), ("vocab_size", 200), ("n_layers", 3), ("seq_len", 24)), 8, 2, 24),
    Case("gpt", (("dim", 64), ("n_heads", 4), ("vocab_size", 200), ("n_layers", 3), ("seq_len", 24)), 1024, 2, 24),
    Case("gpt-124m", (), 64, 2, 1024),
    Case("llama-1b", (("n_layers", 4),), 256, 1, 2048),
)


def _fsdp2_model(case: Case, mesh: DeviceMesh) -> tuple[Any, torch.optim.Optimizer, torch.Tensor, torch.Tensor, Any]:
    spec = load_model_spec(case.model, dict(case.model_args))
    for unit in spec.units:
        fully_shard(unit, mesh=mesh)
    fully_shard(spec.model, mesh=mesh)
    optimizer = torch.optim.AdamW(spec.model.parameters(), lr=1e-3, foreach=False)
    inputs, targets = spec.make_batch(case.batch, case.seq)
    return spec.model, optimizer, inputs, targets, spec.loss


def _step(model: Any, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any, loss_fn: Any, phase: Any) -> None:
    phase("forward")
    loss = loss_fn(model(inputs), targets)
    phase("backward")
    loss.backward()
    del loss
    phase("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fsdp2_counted(case: Case) -> dict[str, int]:
    """Peak per phase of FSDP2's step under the planner's counter (everything re-read after every op)."""
    with fake_process_group(case.world_size):
        mesh = init_device_mesh("cpu", (case.world_size,))  # outside FakeTensorMode: a mesh needs real ranks
        with fake_tensors():
            snapshot = live_storage_keys(fake=True)
            model, optimizer, inputs, targets, loss_fn = _fsdp2_model(case, mesh)
            _step(model, optimizer, inputs, targets, loss_fn, lambda _: None)
            counter = LiveBytesCounter(unseen="ignore", see_through_subclasses=True)
            counter.register(tensors_since(snapshot, fake=True))
            del snapshot
            with counter:
                _step(model, optimizer, inputs, targets, loss_fn, counter.set_phase)
            counter.close()
            del model, optimizer
            gc.collect()
    return dict(counter.phase_peaks)


def fsdp2_tracker(case: Case) -> tuple[int, dict[str, int]]:
    """FSDPMemTracker's peak (and its categories) for FSDP2's step."""
    with fake_process_group(case.world_size):
        mesh = init_device_mesh("cpu", (case.world_size,))
        with fake_tensors():
            model, optimizer, inputs, targets, loss_fn = _fsdp2_model(case, mesh)
            _step(model, optimizer, inputs, targets, loss_fn, lambda _: None)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((inputs, targets))
            with tracker:
                _step(model, optimizer, inputs, targets, loss_fn, lambda _: None)
            snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
            del model, optimizer, tracker
            gc.collect()
    total = snapshot.pop("Total")
    return total, {str(getattr(k, "value", k)): v for k, v in snapshot.items() if v}


def run(cases: tuple[Case, ...]) -> str:
    rows = [
        "| case | fsdp_compose planner peak | FSDP2, same counter | FSDP2, FSDPMemTracker | planner / FSDP2 counter "
        "| FSDP2 counter / tracker | planner s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    details = []
    for case in cases:
        print(f"[planner_vs_torch] {case.label()} ...", flush=True)
        start = time.perf_counter()
        planned = plan(case.config())
        seconds = time.perf_counter() - start
        ours = planned.record.peak_bytes
        counted = max(fsdp2_counted(case).values())
        tracked, categories = fsdp2_tracker(case)
        rows.append(
            f"| {case.label()} | {fmt_bytes(ours)} | {fmt_bytes(counted)} | {fmt_bytes(tracked)} | "
            f"{ours / counted:.4f} | {counted / tracked:.4f} | {seconds:.1f} |"
        )
        parts = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in categories.items())
        details.append(f"- {case.label()}: FSDPMemTracker's peak {fmt_bytes(tracked)} = {parts}")
    return "\n".join(rows) + "\n\nFSDPMemTracker's categories at its peak:\n\n" + "\n".join(details) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", metavar="PATH", help="replace the tracker section of this markdown file")
    ns = parser.parse_args(argv)
    table = run(CASES)
    header = (
        f"Command: `python benchmarks/planner_vs_torch.py`; torch {torch.__version__}; fake process group, "
        "FakeTensorMode, fp32, AdamW (per-parameter loop), one warm-up step.\n\n"
    )
    print(header + table)
    if ns.write:
        target = Path(ns.write) if Path(ns.write).is_absolute() else REPO / ns.write
        write_section(target, header + table, name="tracker")
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
