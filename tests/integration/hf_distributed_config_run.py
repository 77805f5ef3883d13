"""Run under ``torchrun --nproc_per_node 2``: transformers' own FSDP2, ``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=2))`` on a tiny Llama saved locally (no downloads), 3 AdamW steps;
prints one JSON line (rank 0). ``argv[1]``: ``torch`` (transformers shards with torch's ``fully_shard``) or ``fc``
(the load inside ``fc.ported("transformers")``); ``argv[2]``: the folder to save the model in; ``argv[3]``: ``dense``
(Llama) or ``moe`` (Qwen3-MoE with 4 experts, expert parallel over the 2 ranks: the experts on their own mesh)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.distributed import DistributedConfig

import fsdp_compose as fc
from tests.integration.launch import finish_rank
from tests.integration.tiny_llama import tiny_llama_config

VARIANT, FOLDER, KIND = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
path = os.path.join(FOLDER, f"tiny-{KIND}")
sizes = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
sizes["num_key_value_heads"] = 2
classes = {"dense": LlamaForCausalLM, "moe": Qwen3MoeForCausalLM}
if rank == 0 and not os.path.exists(path):
    torch.manual_seed(0)
    if KIND == "dense":
        config = tiny_llama_config(vocab_size=64)
    else:
        config = Qwen3MoeConfig(
            **sizes,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    classes[KIND](config).save_pretrained(path)
dist.barrier()
port = fc.ported("transformers") if VARIANT == "fc" else contextlib.nullcontext()
parallel = DistributedConfig(fsdp_size=world, ep_size=world if KIND == "moe" else 1)
with port:
    model = classes[KIND].from_pretrained(path, distributed_config=parallel)
layers = list(model.model.layers)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses, counts = [], []
for step in range(3):
    ids = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(step))
    local = ids.chunk(world)[rank]
    with fc.CollectiveRecorder() as recorded:
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    losses.append(total.item() / world)
    counts.append({k: v for k, v in recorded.counts().items() if k in ("all_gather", "reduce_scatter", "all_to_all")})
finish_rank(
    {
        "sharded_by": "fc" if fc.is_fully_sharded(layers[0]) else "torch",
        "experts_sharded_by_fc": [
            fc.is_fully_sharded(m) for name, m in model.named_modules() if name.endswith("mlp.experts")
        ],
        "layer_class": type(layers[0]).__name__,
        "losses": losses,
        "counts": counts,
    }
)
