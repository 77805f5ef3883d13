"""Train a small GPT with fsdp_compose: every block is a unit, then the root.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py

Runs on CPU (gloo) by default and on GPUs (NCCL) when CUDA is available; data is synthetic, so nothing is downloaded.
Rank 0 prints step, loss and tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, init_weights, loss_fn, synthetic_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split over ranks)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--no-reshard-after-forward", action="store_true", help="keep blocks gathered until backward")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--meta-init", action="store_true", help="build on the meta device, shard, then materialize")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh("cuda" if use_cuda else "cpu", (world_size,), mesh_dim_names=("dp",))
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world_size} ranks")

    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        activation_checkpointing=args.activation_checkpointing,
    )
    torch.manual_seed(0)
    with torch.device("meta" if args.meta_init else "cpu"):
        model = GPT(cfg)
    reshard = not args.no_reshard_after_forward
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fc.fully_shard(model, mesh=mesh)
    if args.meta_init:
        model.to_empty(device=mesh.device_type)
        torch.manual_seed(0)
        init_weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    local_batch = args.batch_size // world_size
    tokens_per_step = args.batch_size * args.seq_len
    for step in range(args.steps):
        inputs, targets = synthetic_batch(cfg, args.batch_size, step)
        inputs = inputs[rank * local_batch : (rank + 1) * local_batch].to(mesh.device_type)
        targets = targets[rank * local_batch : (rank + 1) * local_batch].to(mesh.device_type)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.SUM)
        elapsed = time.perf_counter() - start
        if rank == 0:
            mean_loss = loss.item() / world_size
            print(f"step {step:3d}  loss {mean_loss:.4f}  tokens/s {tokens_per_step / elapsed:,.0f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
