"""Run under ``torchrun --nproc_per_node 2``: ``generate`` with EOS on a tiny Llama sharded per decoder layer, where
rank 0 meets its EOS token after 3 new tokens and rank 1 never does; prints one JSON line (rank 0). ``argv[1]``:
``torch`` or ``fc``. transformers turns ``synced_gpus`` on where ``is_fsdp_managed_module(model)``: rank 0 keeps
running forwards until rank 1 is done, so both issue the same all-gathers."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method
from transformers import LlamaForCausalLM

import fsdp_compose as fc
from tests.integration.launch import finish_rank
from tests.integration.tiny_llama import tiny_llama_config

VARIANT = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
config = tiny_llama_config(vocab_size=64, pad_token_id=0)
model = LlamaForCausalLM(config)
plain = LlamaForCausalLM(config)
plain.load_state_dict(model.state_dict())
prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(rank))
free_run = plain.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 5:].tolist()
# rank 0's third new token is the EOS of both ranks (it ends rank 0's generation early; rank 1 must not produce it)
eos = torch.tensor([free_run[2] if rank == 0 else -1])
dist.broadcast(eos, src=0)
expected = plain.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=int(eos))[0].tolist()
shard = torch_fully_shard if VARIANT == "torch" else fc.fully_shard
for layer in model.model.layers:
    shard(layer, mesh=mesh)
shard(model, mesh=mesh)
if VARIANT == "torch":
    register_fsdp_forward_method(model, "generate")
else:
    fc.register_forward_method(model, "generate")
with fc.CollectiveRecorder() as recorded:
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=int(eos))[0].tolist()
lengths = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(lengths, torch.tensor([float(len(expected))]))
finish_rank(
    {
        "same_tokens": generated[: len(expected)] == expected,
        "lengths": [int(t.item()) for t in lengths],
        "all_gathers": recorded.counts()["all_gather"],
    }
)
