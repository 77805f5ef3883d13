"""The engine on a real accelerator: training cases against a single-process reference, and the host waits of a step.

    python -m tests.cuda_check                      # cuda: 1 rank over NCCL, then 2 and 4 ranks on one GPU over gloo
    python -m tests.cuda_check --device cpu --ws 2  # the same cases on CPU (tests/test_cuda_check.py runs them in CI)
    python -m tests.cuda_check --host-syncs         # also: where a step makes the host wait for the device

Why: on CPU the backward walk takes the gloo side of its waits and the stream and event layer is bypassed; only an
accelerator runs the side streams, events and non-blocking copies. Several ranks can share one GPU only over gloo
(NCCL refuses two ranks on one device), which still sends every collective through the accelerator side: side
streams, events, the current stream waiting on each collective's work.

Each case trains a sharded GPT on this rank's slice of a global batch and a plain copy on the whole batch (or torch's
``fully_shard`` on the same slice), on the same device, and returns the largest parameter difference; the runner
compares it with the case's tolerance. A case that raises on one rank leaves the others' collectives out of step, so
the runner stops that world at the first error.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch

CFG = GPTConfig(vocab_size=97, seq_len=13, dim=48, n_layers=3, n_heads=3)
GLOBAL_BATCH = 12  # every world size (1, 2, 4) and 3 micro-batches divide it evenly
STEPS = 3
FP32_TOL = 2e-5  # fp32: the sharded run sums per-rank gradients, the reference one batch (rounding only)
BF16_TOL = 2e-2  # bf16 compute against an fp32 reference (the random sweep's tolerance)
SAME_TOL = 1e-5  # fsdp_compose against torch's fully_shard, same dtypes and data


_MESHES: dict[tuple[Any, ...], DeviceMesh] = {}  # one per shape per process: new meshes would leak process groups


def _mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    key = (device_type, shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]


def _device(mesh: DeviceMesh) -> torch.device:
    """The mesh's device, with this process's GPU index on CUDA."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _gpt(device: torch.device, **cfg: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CFG.__dict__, **cfg})).to(device)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _max_diff(model: nn.Module, other: nn.Module) -> float:
    theirs = dict(other.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        a, b = _full(p.detach()).float().cpu(), _full(theirs[name].detach()).float().cpu()
        worst = max(worst, (a - b).abs().max().item())
    return worst


def _shard(model: GPT, mesh: DeviceMesh, shard: Callable[..., Any] = fc.fully_shard, **kwargs: Any) -> GPT:
    for block in model.blocks:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _batch(step: int, rank: int, ws: int, device: torch.device, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = synthetic_batch(CFG, GLOBAL_BATCH, step)
    if local:
        x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
    return x.to(device), y.to(device)


def _train(
    model: nn.Module,
    rank: int,
    ws: int,
    device: torch.device,
    *,
    local: bool,
    micro: int = 1,
    sync_every_micro: bool = False,
    before_step: Callable[[nn.Module, int], None] | None = None,
) -> None:
    # SGD with momentum: AdamW's normalisation turns rounding in near-zero gradients into visible differences
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        if before_step is not None:
            before_step(model, step)
        x, y = _batch(step, rank, ws, device, local)
        for i, (mx, my) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            quiet = local and not sync_every_micro and i < micro - 1
            if quiet and hasattr(model, "set_requires_gradient_sync"):  # torch's fully_shard
                model.set_requires_gradient_sync(False)
                (loss_fn(model(mx), my) / micro).backward()
                model.set_requires_gradient_sync(True)
            elif quiet:
                with fc.no_sync(model):
                    (loss_fn(model(mx), my) / micro).backward()
            else:
                (loss_fn(model(mx), my) / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _against_reference(
    mesh: DeviceMesh, rank: int, ws: int, cfg: dict[str, Any] | None = None, **train: Any
) -> Callable[..., float]:
    def run(**shard_kwargs: Any) -> float:
        dev = _device(mesh)
        model = _gpt(dev, **(cfg or {}))
        reference = copy.deepcopy(model)
        _shard(model, mesh, **shard_kwargs)
        _train(model, rank, ws, dev, local=True, **train)
        _train(reference, rank, ws, dev, local=False, **{k: v for k, v in train.items() if k != "sync_every_micro"})
        return _max_diff(model, reference)

    return run


# ------------------------------------------------------------------------------------------------------------- cases
def plain(mesh: DeviceMesh, rank: int, ws: int) -> float:
    return _against_reference(mesh, rank, ws)()


def no_reshard_after_forward(mesh: DeviceMesh, rank: int, ws: int) -> float:
    return _against_reference(mesh, rank, ws)(reshard_after_forward=False)


def accumulate_without_sync(mesh: DeviceMesh, rank: int, ws: int) -> float:
    return _against_reference(mesh, rank, ws, micro=3)()


def accumulate_with_sync(mesh: DeviceMesh, rank: int, ws: int) -> float:
    return _against_reference(mesh, rank, ws, micro=3, sync_every_micro=True)()


def activation_checkpointing(mesh: DeviceMesh, rank: int, ws: int) -> float:
    return _against_reference(mesh, rank, ws, {"activation_checkpointing": True})()


def trainable_changes(mesh: DeviceMesh, rank: int, ws: int) -> float:
    """Block 0 frozen for the first two steps (its parameters resharded in backward), trained from the third."""

    def before_step(model: nn.Module, step: int) -> None:
        for p in model.blocks[0].parameters():  # type: ignore[union-attr,index]
            p.requires_grad_(step >= 2)

    return _against_reference(mesh, rank, ws, before_step=before_step)()


def cpu_offload(mesh: DeviceMesh, rank: int, ws: int) -> float:
    return _against_reference(mesh, rank, ws)(offload_policy=fc.CPUOffloadPolicy(pin_memory=True))


def cpu_offload_pageable(mesh: DeviceMesh, rank: int, ws: int) -> float:
    """Offload without page-locked memory: every host <-> device copy is a blocking one."""
    return _against_reference(mesh, rank, ws, micro=3)(offload_policy=fc.CPUOffloadPolicy(pin_memory=False))


def cpu_offload_bf16(mesh: DeviceMesh, rank: int, ws: int) -> float:
    """Offloaded fp32 shards gathered in bf16: the cast runs on the device after a copy in the stored dtype."""
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = fc.CPUOffloadPolicy(pin_memory=True)
    return _against_reference(mesh, rank, ws, micro=3)(mp_policy=policy, offload_policy=offload)


def state_dict_round_trip(mesh: DeviceMesh, rank: int, ws: int) -> float:
    """Offloaded, then trained: the full state dict equals the reference's; loaded into a fresh offloaded model (from
    rank 0, broadcast) and trained on, it still equals the reference (the loaded shards stay in host memory)."""
    dev = _device(mesh)
    offload = fc.CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    model = _gpt(dev)
    reference = copy.deepcopy(model)
    _shard(model, mesh, offload_policy=offload)
    _train(model, rank, ws, dev, local=True)
    _train(reference, rank, ws, dev, local=False)
    full = fc.full_state_dict(model, rank0_only=False)
    worst = max(
        (full[k].float() - v.detach().float().cpu()).abs().max().item() for k, v in reference.state_dict().items()
    )
    fresh = _shard(_gpt(dev), mesh, offload_policy=offload)
    fc.load_full_state_dict(fresh, full if rank == 0 else {}, broadcast_from_rank0=True)
    if any(p._local_tensor.device.type != "cpu" for p in fresh.parameters()):  # type: ignore[attr-defined]
        return float("inf")
    _train(fresh, rank, ws, dev, local=True)
    _train(reference, rank, ws, dev, local=False)
    return max(worst, _max_diff(fresh, reference))


def bf16_compute(mesh: DeviceMesh, rank: int, ws: int) -> float:
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _against_reference(mesh, rank, ws)(mp_policy=policy)


def bf16_like_torch(mesh: DeviceMesh, rank: int, ws: int) -> float:
    """bf16 all-gathers and compute, fp32 reductions: fsdp_compose and torch's ``fully_shard`` on the same slices."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = _device(mesh)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours, theirs = _gpt(dev), _gpt(dev)
    _shard(ours, mesh, mp_policy=policy)
    _shard(theirs, mesh, fully_shard, mp_policy=policy)
    _train(ours, rank, ws, dev, local=True, micro=3)
    _train(theirs, rank, ws, dev, local=True, micro=3)
    return _max_diff(ours, theirs)


def hsdp(mesh: DeviceMesh, rank: int, ws: int) -> float:
    """Replicate x shard (2 x ws/2): the replica all-reduces on the accelerator side."""
    device = mesh.device_type
    hsdp_mesh = _mesh(device, (2, ws // 2), ("replicate", "shard"))
    return _against_reference(hsdp_mesh, rank, ws, micro=3)()


def move_to_host(mesh: DeviceMesh, rank: int, ws: int) -> float:
    """Trained, moved to the host with its optimizer between two steps and back, trained on: equal to the reference.
    On a GPU the device then holds none of the model's and the optimizer's bytes (``memory_allocated`` drops by at
    least what ``fc.move_to_host`` moved, and comes back to where it was)."""
    dev = _device(mesh)
    model = _gpt(dev)
    reference = copy.deepcopy(model)
    _shard(model, mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for step in range(STEPS):
        for index, (net, opt) in enumerate(zip((model, reference), opts, strict=True)):
            x, y = _batch(step, rank, ws, dev, local=index == 0)
            loss_fn(net(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 0:
            allocated = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            moved = fc.move_to_host(model, opts[0]).nbytes
            during = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            fc.move_to_device(model)
            after = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            if dev.type == "cuda" and (allocated - during < moved or after != allocated):
                return float("inf")
    return _max_diff(model, reference)


CASES: dict[str, tuple[Callable[[DeviceMesh, int, int], float], float, int]] = {
    # name: (case, tolerance, smallest world size)
    "plain": (plain, FP32_TOL, 1),
    "no_reshard_after_forward": (no_reshard_after_forward, FP32_TOL, 1),
    "accumulate_without_sync": (accumulate_without_sync, FP32_TOL, 1),
    "accumulate_with_sync": (accumulate_with_sync, FP32_TOL, 1),
    "activation_checkpointing": (activation_checkpointing, FP32_TOL, 1),
    "trainable_changes": (trainable_changes, FP32_TOL, 1),
    "cpu_offload": (cpu_offload, FP32_TOL, 1),
    "cpu_offload_bf16": (cpu_offload_bf16, BF16_TOL, 1),
    "cpu_offload_pageable": (cpu_offload_pageable, FP32_TOL, 1),
    "state_dict_round_trip": (state_dict_round_trip, FP32_TOL, 1),
    "bf16_compute": (bf16_compute, BF16_TOL, 1),
    "bf16_like_torch": (bf16_like_torch, SAME_TOL, 1),
    "hsdp": (hsdp, FP32_TOL, 4),
    "move_to_host": (move_to_host, FP32_TOL, 1),
}


def run_cases(rank: int, ws: int, device_type: str, names: list[str]) -> list[dict[str, Any]]:
    """Every named case on this rank, in order; stops at the first error (the world's collectives are then out of
    step)."""
    mesh = _mesh(device_type, (ws,))
    results = []
    for name in names:
        case, tol, smallest = CASES[name]
        if ws < smallest or (ws % 2 and smallest > 1):
            continue
        start = time.perf_counter()
        try:
            diff = case(mesh, rank, ws)
            results.append({"case": name, "diff": diff, "tol": tol, "ok": diff <= tol})
        except Exception:
            results.append({"case": name, "error": traceback.format_exc()[-4000:], "ok": False})
            break
        finally:
            results[-1]["seconds"] = round(time.perf_counter() - start, 2)
    return results


# ------------------------------------------------------------------------------------------------------ host waits
def host_syncs(device: torch.device, offload: str = "none", shape: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """Where one training step (after two warm-up steps) makes the host wait for the device, per phase, for
    fsdp_compose and torch's ``fully_shard`` on rank 0 of a mesh of ``shape`` (2D: replicate x shard); ``offload``:
    "none", "pinned" or "pageable" (CPU offload with or without page-locked host memory).

    ``torch.cuda.set_sync_debug_mode("warn")`` reports every synchronizing call (``.item()``, ``.tolist()``, blocking
    copies to the host, stream synchronization) as a warning, counted per phase with the Python line it names. Then
    one more step in ``"error"`` mode stops at the first one, for its whole traceback (the warnings of backward hooks
    are replayed by the autograd engine and name no library line).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = _mesh(device.type, shape, ("replicate", "shard") if len(shape) == 2 else None)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = OffloadPolicy() if offload == "none" else CPUOffloadPolicy(pin_memory=offload == "pinned")
    out: dict[str, Any] = {}
    for name, shard in (("fsdp_compose", fc.fully_shard), ("torch_fully_shard", fully_shard)):
        model = _shard(_gpt(device), mesh, shard, mp_policy=policy, offload_policy=offload_policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        holder: dict[str, torch.Tensor] = {}
        phases: dict[str, Callable[[], None]] = {
            "forward": lambda m=model, h=holder: h.__setitem__("loss", loss_fn(m(h["x"]), h["y"])),
            "backward": lambda h=holder: h["loss"].backward(),
            "optimizer": lambda o=opt: (o.step(), o.zero_grad(set_to_none=True)) and None,
        }
        counts: dict[str, dict[str, int]] = {}
        for step in range(4):
            holder["x"], holder["y"] = _batch(step, 0, 1, device, local=True)
            torch.cuda.synchronize()
            for phase, run in phases.items():
                if step < 2:
                    run()
                    continue
                mode = "warn" if step == 2 else "error"
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode(mode)
                    try:
                        run()
                    except RuntimeError as e:
                        if "synchroniz" not in str(e):
                            raise
                        out.setdefault(f"{name} first sync", traceback.format_exc()[-3000:])
                        break
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                if mode == "warn":
                    # (the mode's own one-time notice, "a prototype feature ... synchronizing operations", is not one)
                    syncs = [w for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
                    sites = Counter(f"{w.filename}:{w.lineno}" for w in syncs)
                    counts[phase] = dict(sites)
            else:
                continue
            break
        torch.cuda.synchronize()
        out[name] = counts
    return out


# ----------------------------------------------------------------------------------------------------------- runner
def _worker(rank: int, ws: int, device_type: str, backend: str, init_file: str, names: list[str], queue: Any) -> None:
    try:
        if device_type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=ws, timeout=timedelta(seconds=60)
        )
        try:
            queue.put((rank, run_cases(rank, ws, device_type, names)))
        finally:
            dist.destroy_process_group()
    except Exception:
        queue.put((rank, [{"case": "world", "ok": False, "error": traceback.format_exc()}]))


def run_world(ws: int, device_type: str, names: list[str], timeout: float) -> list[dict[str, Any]]:
    """``names`` on ``ws`` fresh processes; rank 0's results, with any rank's error or a hang reported."""
    backend = "nccl" if device_type == "cuda" and ws == 1 else "gloo"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, ws, device_type, backend, init_file, names, queue)) for r in range(ws)
        ]
        for p in procs:
            p.start()
        got: dict[int, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < ws and time.monotonic() < deadline:
            try:
                rank, res = queue.get(timeout=1.0)
                got[rank] = res
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if len(got) < ws:
        missing = sorted(set(range(ws)) - set(got))
        codes = [p.exitcode for p in procs]
        return [{"case": "world", "ok": False, "error": f"ranks {missing} gave no result (exit codes {codes})"}]
    merged = []
    for i, r0 in enumerate(got[0]):
        row = dict(r0, backend=backend, ws=ws)
        for rank in range(1, ws):
            other = got[rank][i] if i < len(got[rank]) else {"ok": False, "error": "missing"}
            row["ok"] = row["ok"] and other["ok"]
            if "diff" in other:
                row["diff"] = max(row.get("diff", 0.0), other["diff"])
            if "error" in other and "error" not in row:
                row["error"] = f"rank {rank}: {other['error']}"
        merged.append(row)
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ws", type=int, action="append", help="world sizes (default 1, 2, 4)")
    parser.add_argument("--case", action="append", help="case names (default all)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per world")
    parser.add_argument("--host-syncs", action="store_true")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument(
        "--fake-mesh",
        action="append",
        default=[],
        help="with --host-syncs: also rank 0 of this mesh (4, 2x2, ...) under torch's fake process group, which "
        "completes collectives at once without data: the multi-rank path's host waits (the agreement) on one GPU",
    )
    args = parser.parse_args(argv)
    names = args.case or list(CASES)
    rows: list[dict[str, Any]] = []
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)  # noqa: T201
    for ws in args.ws or [1, 2, 4]:
        start = time.monotonic()
        world = run_world(ws, args.device, names, args.timeout)
        for row in world:
            row.setdefault("ws", ws)
            what = f"diff {row['diff']:.2e} (tol {row['tol']:.0e})" if "diff" in row else row.get("error", "")
            print(f"ws {ws} {row.get('backend', '')} {row['case']:26s} {'PASS' if row['ok'] else 'FAIL'} {what}")  # noqa: T201
        print(f"ws {ws}: {time.monotonic() - start:.1f}s", flush=True)  # noqa: T201
        rows += world
    report: dict[str, Any] = {"rows": rows}
    if args.host_syncs:
        for shape in [(1,)] + [tuple(int(n) for n in spec.split("x")) for spec in args.fake_mesh]:
            if shape == (1,):
                dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            else:
                from torch.testing._internal.distributed.fake_pg import FakeStore

                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
            _MESHES.clear()  # a mesh belongs to the process group it was made in
            try:
                torch.cuda.set_device(0)
                where = "" if shape == (1,) else f" mesh={'x'.join(map(str, shape))} (fake)"
                for offload in ("none", "pinned", "pageable") if shape == (1,) else ("none",):
                    report[f"host_syncs{where} offload={offload}"] = host_syncs(torch.device("cuda", 0), offload, shape)
            finally:
                dist.destroy_process_group()
        for key, impls in report.items():
            if not key.startswith("host_syncs"):
                continue
            for impl, value in impls.items():
                if isinstance(value, str):
                    print(f"{key}, {impl}:\n{value}")  # noqa: T201
                    continue
                total = sum(n for sites in value.values() for n in sites.values())
                print(f"{key}: {impl} {total} per step")  # noqa: T201
                for phase, sites in value.items():
                    for site, n in sorted(sites.items()):
                        print(f"  {phase:9s} {n:3d}  {site}")  # noqa: T201
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
