"""A tour of the fsdp_compose API in one script that runs: the README's "API tour" is the part between the markers.

    torchrun --standalone --nproc_per_node 2 examples/tour.py

CPU and gloo on any even number of ranks; on GPUs use "nccl" and the "cuda" device type. The model is the small GPT
of examples/gpt_model.py; each section builds a fresh one (a module is sharded once).
"""

# fmt: off
# tour:start
import copy

import torch
import torch.distributed as dist
from gpt_model import GPT, GPTConfig, init_weights, loss_fn, synthetic_batch  # examples/gpt_model.py
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_compose as fc

dist.init_process_group("gloo")                          # under torchrun; "nccl" (and "cuda" below) on GPUs
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                                     # the same model on every rank: each keeps its chunk of it
cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=4, n_heads=4)
inputs, targets = (t.chunk(world_size)[rank] for t in synthetic_batch(cfg, 4 * world_size, step=0))  # my slice


def train_step(model: GPT, x: torch.Tensor = inputs, y: torch.Tensor = targets) -> float:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item()


mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))  # mesh=None: the whole world
model = GPT(cfg)
for block in model.blocks:                               # each block is a unit: gathered just before it runs
    fc.fully_shard(block, mesh=mesh)
fc.fully_shard(model, mesh=mesh)                         # the root takes the rest (embeddings, head)
assert type(model) is GPT                                # still your class
fc.print_description(model, params=False)                # units, meshes, bytes, policies (printed on rank 0)

optimizer = torch.optim.AdamW(model.parameters())        # after fully_shard: nn.Parameter(DTensor), Shard(0)
train_step(model)
fc.clip_grad_norm_(model.parameters(), 1.0)              # right on any mix of meshes
optimizer.step()
optimizer.zero_grad()

(mb0, mb1), (t0, t1) = inputs.chunk(2), targets.chunk(2)
with fc.no_sync(model):                                  # gradient accumulation: reduce on the last micro-batch
    train_step(model, mb0, t0)
train_step(model, mb1, t1)
optimizer.step()
optimizer.zero_grad()

fc.set_gradient_accumulation(model, "sharded")           # ZeRO-2 style accumulation (default: "unsharded")
fc.set_gradient_divide_factor(model, 1.0)                # sum instead of mean; works on gloo
fc.set_reshard_after_forward(model, False)               # trade memory for one all-gather less per block
fc.set_modules_to_forward_prefetch(model.blocks[0], [model.blocks[2]])  # default: next unit, both directions
model.blocks[0].requires_grad_(False)                    # freeze/unfreeze at any step: picked up at next forward
train_step(model)
optimizer.step()
optimizer.zero_grad()
fc.register_forward_method(model, "generate")            # gather around a method other than forward
sample = model.generate(inputs[:, :4], new_tokens=4)
teacher = copy.deepcopy(model)                           # an independent sharded EMA teacher
sd = model.state_dict()                                  # DTensors, no communication; load_state_dict takes them
model.load_state_dict(sd)
full = fc.full_state_dict(model)                         # plain tensors on rank 0 (cpu)
engine = dict(fc.full_weights(model, dtype=torch.bfloat16))  # unit by unit, in bf16: an inference engine's
fc.load_full_state_dict(model, full, broadcast_from_rank0=True)

bf16 = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
model = GPT(cfg)
for block in model.blocks:
    fc.fully_shard(block, mesh=mesh, mp_policy=bf16)     # per unit: compute in bf16, reduce/accumulate in fp32
fc.fully_shard(model, mesh=mesh)                         # the root computes in fp32: blocks hand back fp32
opts = fc.set_optimizer_in_backward(model, lambda ps: torch.optim.AdamW(ps))  # each unit steps in backward
train_step(model)                                        # ... so no optimizer.step() here
fc.set_full_precision_in_eval(model)                     # this instance evaluates in fp32
with torch.no_grad():
    logits = model.eval()(inputs)

model = GPT(cfg)
model.blocks[0].requires_grad_(False)
for block in model.blocks:
    fc.fully_shard(block, mesh=mesh, reshard_after_forward=2,  # keep 1/2 after forward: backward gathers in pairs
                   frozen_params="replicate")            # frozen weights whole, never communicated
fc.fully_shard(model, mesh=mesh, extensions=fc.ShardExtensions(all_gather=fc.Int8AllGather()))  # int8 all-gather
train_step(model)

with torch.device("meta"):                               # meta-device init: nothing allocated ...
    model = GPT(cfg)
for block in model.blocks:
    fc.fully_shard(block, mesh=mesh)
fc.fully_shard(model, mesh=mesh)                         # ... until to_empty allocates the shards only
model.to_empty(device="cpu")
init_weights(model)                                      # every reset_parameters() (torch warns: DTensor RNG on cpu)
train_step(model)

hsdp = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
model = GPT(cfg)
for block in model.blocks:
    fc.fully_shard(block, mesh=hsdp)                     # HSDP: (Replicate(), Shard(0)), async all-reduce
fc.fully_shard(model, mesh=hsdp)
train_step(model)

mesh_2d = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
model = GPT(cfg)
for block in model.blocks:
    parallelize_module(block.mlp, mesh_2d["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})  # TP first
    fc.fully_shard(block, mesh=mesh_2d["dp"])            # ... then FSDP on dp: (_StridedShard | Shard, *tp)
fc.fully_shard(model, mesh=mesh_2d["dp"])                # never the whole (dp, tp) mesh
dp_rank, dp_size = mesh_2d["dp"].get_local_rank(), mesh_2d["dp"].size()
x, y = (t.chunk(dp_size)[dp_rank] for t in synthetic_batch(cfg, 4 * world_size, step=0))  # TP peers: one slice
print(f"rank {rank}: FSDP + TP loss {train_step(model, x, y):.4f}")
# tour:end
# fmt: on

print(f"rank {rank}: tour done", flush=True)
from launch import tear_down  # noqa: E402  (destroys the process group; on gloo exits without interpreter teardown)

tear_down()
