"""Fine-tune a frozen GPT backbone with small LoRA adapters, unfreezing the final norm part-way.

    torchrun --standalone --nproc_per_node 2 examples/lora_finetune.py
    torchrun --standalone --nproc_per_node 2 examples/lora_finetune.py --frozen-params replicate

The backbone's weights are frozen; only the adapters (and, after --unfreeze-at steps, the final LayerNorm) train.
fsdp_compose notices the requires_grad change at the next forward by itself (no refresh call, no re-wrapping).
With ``--frozen-params replicate`` the frozen weights stay whole on every rank and are never communicated: more
memory, far fewer bytes on the wire. Rank 0 prints a header (world size, mesh and ``fc.describe``'s layout of the
sharded units), then step, loss, trainable parameters and tokens/s per step (step 0 includes initialization), then a
summary.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from examples.launch import run_distributed
from examples.reporting import StepLog, print_header


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with a frozen ``base`` and trainable low-rank ``A`` (r x in), ``B`` (out x r)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # starts as the identity update
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale


def add_adapters(model: GPT, rank: int, alpha: float) -> None:
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv, rank, alpha)
        block.attn.proj = LoRALinear(block.attn.proj, rank, alpha)
        block.mlp.fc = LoRALinear(block.mlp.fc, rank, alpha)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--unfreeze-at", type=int, default=15, help="step at which the final LayerNorm unfreezes")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split over ranks)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--frozen-params", choices=["shard", "replicate"], default="shard")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    run_distributed(lambda device_type: train(args, device_type))


def train(args: argparse.Namespace, device_type: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world_size} ranks")

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)  # stands in for a pretrained backbone
    add_adapters(model, args.lora_rank, alpha=2.0 * args.lora_rank)
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh, frozen_params=args.frozen_params)
    fc.fully_shard(model, mesh=mesh, frozen_params=args.frozen_params)
    # All parameters go to the optimizer: frozen ones get no gradient and are skipped until they unfreeze.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    local_batch = args.batch_size // world_size
    settings = (
        f"GPT dim {cfg.dim}, {cfg.n_layers} layers, LoRA rank {args.lora_rank} on qkv, proj and fc; "
        f"frozen_params={args.frozen_params!r}; final LayerNorm unfreezes at step {args.unfreeze_at}; "
        f"global batch {args.batch_size}; AdamW lr {args.lr}"
    )
    print_header(model, mesh, mesh, settings)
    log = StepLog(tokens_per_step=args.batch_size * args.seq_len)
    for step in range(args.steps):
        if step == args.unfreeze_at:
            model.ln_f.requires_grad_(True)
        inputs, targets = synthetic_batch(cfg, args.batch_size, step)
        inputs = inputs[rank * local_batch : (rank + 1) * local_batch].to(mesh.device_type)
        targets = targets[rank * local_batch : (rank + 1) * local_batch].to(mesh.device_type)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        elapsed = time.perf_counter() - start
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.step(step, loss_sum.item() / world_size, elapsed, extra=f"trainable {trainable:,}")
    log.summary()


if __name__ == "__main__":
    main()
