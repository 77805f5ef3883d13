"""One-GPU benchmark: a ~1B-parameter Llama-shaped model, fsdp_compose vs torch ``fully_shard``, same process.

    python benchmarks/gpu.py                                  # cuda, ~1B params, AC off and on, eager
    python benchmarks/gpu.py --compile                        # each block torch.compile'd (both implementations)
    python benchmarks/gpu.py --offload --layers 6 --ac off    # CPUOffloadPolicy(pin_memory=True) for both
    python benchmarks/gpu.py --device cpu --tiny --steps 2    # smoke run (what tests/test_gpu_benchmark.py runs)
    python benchmarks/gpu.py --fake-ws 8 --replicate 2        # rank 0 of 2 x 4 (HSDP) under torch's fake process group

Self-contained (no repository imports besides fsdp_compose): a world of one rank (NCCL on CUDA, gloo on CPU) through
a ``HashStore``, so no ``torchrun``. Both implementations shard every block and then the root with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` over fp32 parameters, train with AdamW on the same
batches, and run interleaved (A, B, A, B, ...) so drift hits both alike. Per activation-checkpointing setting it prints
the median step time, the median of the per-step ratios, and the peak ``max_memory_allocated`` of each
implementation's steps (both models stay resident, so the peak above the step's starting allocation is shown too).
The device name goes into the output: record it with the figures.

``--fake-ws N`` runs this process as rank 0 of N under torch's fake process group, which completes every collective
at once without moving data: one rank's shards, gather buffers, reduce-scatter inputs and compute, so the peak is
what a rank of N holds and the step is one rank's work without the network (the losses are not meaningful). It is how
one GPU measures the sharded peak and runs the multi-rank accelerator path (several reductions in flight, the
agreement's read, HSDP's all-reduce over replicas).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp_compose as fc


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 18
    heads: int = 16
    kv_heads: int = 8
    ffn: int = 5632
    seq: int = 2048
    batch: int = 2


TINY = LlamaConfig(vocab=128, dim=64, layers=2, heads=4, kv_heads=2, ffn=160, seq=16, batch=2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` (batch, heads, seq, head_dim)."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.w_gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.w_down = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        self.checkpointing = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(h).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


IMPLS = ("fsdp_compose", "torch_fsdp2")


def build(name: str, cfg: LlamaConfig, mesh: DeviceMesh, device: torch.device, args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    if name == "fsdp_compose":
        policy: Any = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload: Any = fc.CPUOffloadPolicy(pin_memory=True) if args.offload else fc.OffloadPolicy()
        shard: Any = fc.fully_shard
    else:
        policy, shard = (
            TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            torch_fully_shard,
        )
        offload = TorchCPUOffloadPolicy(pin_memory=True) if args.offload else TorchOffloadPolicy()
    for block in model.blocks:
        block.checkpointing = args.ac
        if args.compile:
            block.compile()
        shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
    shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt


def batch(cfg: LlamaConfig, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def memory(device: torch.device, what: str) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.max_memory_allocated(device) if what == "peak" else torch.cuda.memory_allocated(device))


def one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def run_setting(cfg: LlamaConfig, mesh: DeviceMesh, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    # The last setting's models go first: a sharded module holds reference cycles (module, state, hooks), which only
    # the garbage collector frees, and both implementations' absolute peaks must start from the same memory.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    built = {name: build(name, cfg, mesh, device, args) for name in IMPLS}
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    peaks: dict[str, list[int]] = {name: [] for name in IMPLS}
    above: dict[str, list[int]] = {name: [] for name in IMPLS}
    losses: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        x, y = batch(cfg, step, device)
        for name, (model, opt) in built.items():
            synchronize(device)
            start_bytes = memory(device, "now")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            losses[name] = one_step(model, opt, x, y)
            synchronize(device)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
                peaks[name].append(memory(device, "peak"))
                above[name].append(memory(device, "peak") - start_bytes)
    ratios = [a / b for a, b in zip(times[IMPLS[0]], times[IMPLS[1]], strict=True)]
    return {
        "ac": args.ac,
        "median_ms": {name: statistics.median(values) * 1e3 for name, values in times.items()},
        "ratio": statistics.median(ratios),
        "peak_gib": {name: max(values) / 2**30 for name, values in peaks.items()},
        "peak_above_start_gib": {name: max(values) / 2**30 for name, values in above.items()},
        "loss": losses,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of ~1B parameters")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each implementation first")
    parser.add_argument("--ac", choices=("off", "on", "both"), default="both", help="activation checkpointing")
    parser.add_argument("--compile", action="store_true", help="torch.compile every block (both implementations)")
    parser.add_argument("--offload", action="store_true", help="CPUOffloadPolicy(pin_memory=True) (both)")
    parser.add_argument("--layers", type=int, help="blocks of the model (default: the config's)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--fake-ws", type=int, default=1, help="rank 0 of this many under the fake process group")
    parser.add_argument("--replicate", type=int, default=1, help="with --fake-ws: replicas (HSDP: replicate x shard)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    cfg = TINY if args.tiny else LlamaConfig()
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    mesh = start_world(device, args.fake_ws, args.replicate)
    try:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        params = sum(p.numel() for p in Llama(cfg).parameters()) if args.tiny else _param_count(cfg)
        print(f"device: {name}; torch {torch.__version__}; {params:,} parameters; {asdict(cfg)}")
        print(
            f"bf16 params, fp32 reduce, AdamW; compile={args.compile}; offload={args.offload}; "
            f"{args.steps} steps after {args.warmup}; mesh {tuple(mesh.shape)}"
            + (" (rank 0 under the fake process group)" if args.fake_ws > 1 else "")
        )
        results = []
        for ac in (False, True) if args.ac == "both" else (args.ac == "on",):
            args.ac = ac
            results.append(run_setting(cfg, mesh, device, args))
            args.ac = "both"
        print("| AC | fsdp_compose ms | torch fully_shard ms | fc / torch | fc peak GiB | torch peak GiB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in results:
            ms, peak, above = r["median_ms"], r["peak_gib"], r["peak_above_start_gib"]
            print(
                f"| {'on' if r['ac'] else 'off'} | {ms['fsdp_compose']:.1f} | {ms['torch_fsdp2']:.1f} | "
                f"{r['ratio']:.2f} | {peak['fsdp_compose']:.2f} (+{above['fsdp_compose']:.2f}) | "
                f"{peak['torch_fsdp2']:.2f} (+{above['torch_fsdp2']:.2f}) |"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"device": name, "config": asdict(cfg), "results": results}))
        return results
    finally:
        dist.destroy_process_group()


def start_world(device: torch.device, fake_ws: int, replicate: int) -> DeviceMesh:
    """This process as a world of one rank (NCCL on CUDA, gloo on CPU), or as rank 0 of ``fake_ws`` under torch's fake
    process group; the mesh is ``replicate x (fake_ws / replicate)`` (HSDP) where ``replicate > 1``. The caller
    destroys the process group."""
    if fake_ws > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_ws)
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        if replicate > 1:
            shape = (replicate, fake_ws // replicate)
            return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device.type, (fake_ws,))
    except BaseException:
        dist.destroy_process_group()
        raise


def _param_count(cfg: LlamaConfig) -> int:
    """Parameters of the full-size model, counted without allocating it."""
    with torch.device("meta"):
        return sum(math.prod(p.shape) for p in Llama(cfg).parameters())


if __name__ == "__main__":
    main()
