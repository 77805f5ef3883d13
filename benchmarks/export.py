"""Full weights for an inference engine: ``fc.full_weights`` against one ``full_tensor()`` per state-dict entry and
torch's ``get_model_state_dict(full_state_dict=True)`` (on a model sharded by torch's ``fully_shard``).

    python benchmarks/export.py --nproc 2 --layers 4 8 16 32 --rounds 5

The benchmark GPT at width 256 (vocab 1024), every block a unit, then the root, one optimizer step first. Each
method hands every entry to a consumer that drops it (an engine copying it into its own buffers); per method: the
median time over interleaved rounds, the collectives it issues (``fc.CollectiveRecorder``) and its extra peak on
rank 0 (live tensor bytes above what was live before, ``LiveBytesCounter``). ``bf16``: the tensors in bf16
(``dtype=torch.bfloat16``; per entry: ``full_tensor().to(bf16)``; torch's: cast after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import fsdp_compose as fc  # noqa: E402
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402
from fsdp_compose.plan.live_bytes import LiveBytesCounter  # noqa: E402

Method = Callable[[torch.nn.Module, "torch.dtype | None"], Iterable[tuple[str, torch.Tensor]]]


def per_entry(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterable[tuple[str, torch.Tensor]]:
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        yield key, full.to(dtype) if dtype is not None and full.is_floating_point() else full


def stream(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterable[tuple[str, torch.Tensor]]:
    return fc.full_weights(model, dtype=dtype)


def stream_bucketed(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterable[tuple[str, torch.Tensor]]:
    return fc.full_weights(model, dtype=dtype, bucket_bytes=16 << 20)


def torch_dsd(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterable[tuple[str, torch.Tensor]]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for key, value in full.items():
        yield key, value.to(dtype) if dtype is not None and value.is_floating_point() else value


METHODS: dict[str, tuple[Method, str]] = {
    "per entry full_tensor()": (per_entry, "fc"),
    "torch get_model_state_dict": (torch_dsd, "torch"),
    "fc.full_weights": (stream, "fc"),
    "fc.full_weights, 16 MiB buckets": (stream_bucketed, "fc"),
}


def _model(layers: int, shard: Any, mesh: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPTConfig(dim=256, n_heads=4, n_layers=layers, vocab_size=1024, seq_len=16)
    model = GPT(cfg)
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = synthetic_batch(cfg, 2 * dist.get_world_size(), 0)
    rank, ws = dist.get_rank(), dist.get_world_size()
    loss_fn(model(inputs.chunk(ws)[rank]), targets.chunk(ws)[rank]).backward()
    opt.step()
    return model


def _drain(method: Method, model: torch.nn.Module, dtype: torch.dtype | None) -> int:
    count = 0
    for _key, tensor in method(model, dtype):
        count += tensor.numel() > 0
        del tensor
    return count


def _run(rank: int, nproc: int, store: str, layers: list[int], rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nproc)
    mesh = dist.device_mesh.init_device_mesh("cpu", (nproc,))
    rows = []
    for count in layers:
        models = {"fc": _model(count, fc.fully_shard, mesh), "torch": _model(count, torch_fsdp.fully_shard, mesh)}
        for dtype in (None, torch.bfloat16):
            times: dict[str, list[float]] = {name: [] for name in METHODS}
            for _ in range(rounds):
                for name, (method, which) in METHODS.items():
                    dist.barrier()
                    start = time.perf_counter()
                    _drain(method, models[which], dtype)
                    dist.barrier()
                    times[name].append(time.perf_counter() - start)
            for name, (method, which) in METHODS.items():
                with fc.CollectiveRecorder() as recorded:
                    _drain(method, models[which], dtype)
                counter = LiveBytesCounter()
                with counter:
                    _drain(method, models[which], dtype)
                rows.append(
                    {
                        "layers": count,
                        "dtype": "bf16" if dtype is not None else "fp32",
                        "method": name,
                        "ms": 1000 * statistics.median(times[name]),
                        "collectives": sum(recorded.counts().values()),
                        "peak_mib": (counter.peak_bytes - counter.baseline_bytes) / 2**20,
                    }
                )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def render(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| layers | dtype | method | ms (median) | speed-up over per entry | collectives | extra peak (MiB, rank 0) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {(r["layers"], r["dtype"]): r["ms"] for r in rows if r["method"] == "per entry full_tensor()"}
    for r in rows:
        ratio = base[(r["layers"], r["dtype"])] / r["ms"]
        lines.append(
            f"| {r['layers']} | {r['dtype']} | {r['method']} | {r['ms']:.1f} | {ratio:.2f}x | "
            f"{r['collectives']} | {r['peak_mib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "rows")
        mp.spawn(_run, args=(args.nproc, store, args.layers, args.rounds, out), nprocs=args.nproc)
        rows = json.loads(Path(out).read_text())
    command = "python benchmarks/export.py " + " ".join(sys.argv[1:])
    sys.stdout.write(render(rows, command) + "\n")


if __name__ == "__main__":
    main()
