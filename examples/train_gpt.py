"""Train a small GPT with fsdp_compose: every block is a unit, then the root.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py
    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --hsdp 2           # 2 replicas x 2 shards
    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --tp 2             # 2 shards x 2-way TP MLPs
    torchrun --standalone --nproc_per_node 8 examples/train_gpt.py --hsdp 2 --tp 2    # 3-D: 2 x 2 x 2

Runs on CPU (gloo) by default and on GPUs (NCCL) when CUDA is available; data is synthetic, so nothing is downloaded.
Rank 0 prints a header (world size, meshes and ``fc.describe``'s layout of the sharded units), then step, loss and
tokens/s per step (step 0 includes initialization), then a summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, init_weights, loss_fn, synthetic_batch
from examples.launch import run_distributed
from examples.reporting import StepLog, print_header


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
    parser.add_argument("--hsdp", type=int, default=1, metavar="R", help="HSDP: R replicas of the sharded model")
    parser.add_argument("--tp", type=int, default=1, metavar="T", help="tensor parallel degree of each block's MLP")
    parser.add_argument("--debug", action="store_true", help="fsdp_compose's debug log on stderr (docs/debugging.md)")
    return parser.parse_args()


def build_meshes(device_type: str, world_size: int, replicas: int, tp: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The whole mesh and its data-parallel part: (dp,), (replicate, shard), (dp, tp) or (replicate, shard, tp)."""
    if replicas < 1 or tp < 1 or world_size % (replicas * tp):
        raise SystemExit(f"--hsdp {replicas} x --tp {tp} = {replicas * tp} does not divide the {world_size} ranks")
    shards = world_size // (replicas * tp)
    dp_dims = {"replicate": replicas, "shard": shards} if replicas > 1 else {"dp": shards}
    dims = {**dp_dims, "tp": tp} if tp > 1 else dp_dims
    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    return mesh, (mesh[tuple(dp_dims)] if tp > 1 else mesh)


def dp_coordinates(dp_mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among all data-parallel ranks (replicate-major) and their number; TP peers share it."""
    dp_rank = 0
    for dim in range(dp_mesh.ndim):
        dp_rank = dp_rank * dp_mesh.size(dim) + dp_mesh.get_local_rank(dim)
    return dp_rank, dp_mesh.size()


def main() -> None:
    args = parse_args()
    run_distributed(lambda device_type: train(args, device_type))


def train(args: argparse.Namespace, device_type: str) -> None:
    world_size = dist.get_world_size()
    if args.debug:  # the library only logs; the application decides where to (here: stderr, every rank)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {dist.get_rank()}] %(name)s: %(message)s"))
        logging.getLogger("fsdp_compose").addHandler(handler)
        logging.getLogger("fsdp_compose").setLevel(logging.DEBUG)
    mesh, dp_mesh = build_meshes(device_type, world_size, args.hsdp, args.tp)
    dp_rank, dp_size = dp_coordinates(dp_mesh)
    if args.batch_size % dp_size:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {dp_size} data-parallel ranks")

    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        activation_checkpointing=args.activation_checkpointing,
    )
    if (cfg.mlp_ratio * cfg.dim) % args.tp:  # RowwiseParallel needs even shards of the hidden dim
        raise SystemExit(f"the MLP hidden size {cfg.mlp_ratio * cfg.dim} must be divisible by --tp {args.tp}")
    torch.manual_seed(0)
    with torch.device("meta" if args.meta_init else "cpu"):
        model = GPT(cfg)
    if args.tp > 1:  # tensor parallel first: the MLP weights become DTensors on mesh["tp"] ...
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    reshard = not args.no_reshard_after_forward
    for block in model.blocks:  # ... then FSDP over the data-parallel dims only
        fc.fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fc.fully_shard(model, mesh=dp_mesh)
    if args.meta_init:
        model.to_empty(device=mesh.device_type)
        torch.manual_seed(0)
        init_weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    local_batch = args.batch_size // dp_size
    settings = (
        f"GPT dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}; "
        f"global batch {args.batch_size} ({local_batch} per data-parallel rank); AdamW lr {args.lr}"
    )
    print_header(model, mesh, dp_mesh, settings)
    log = StepLog(tokens_per_step=args.batch_size * args.seq_len)
    for step in range(args.steps):
        inputs, targets = synthetic_batch(cfg, args.batch_size, step)
        inputs = inputs[dp_rank * local_batch : (dp_rank + 1) * local_batch].to(mesh.device_type)
        targets = targets[dp_rank * local_batch : (dp_rank + 1) * local_batch].to(mesh.device_type)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)  # TP peers hold equal losses: the mean is unchanged
        elapsed = time.perf_counter() - start
        log.step(step, loss_sum.item() / world_size, elapsed)
    log.summary()


if __name__ == "__main__":
    main()
