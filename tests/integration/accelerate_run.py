"""Run under ``torchrun --nproc_per_node 2``: accelerate's ``Accelerator.prepare`` with the FSDP2 plugin
(``fsdp_version=2``, transformer-based auto wrap) on a tiny randomly initialized Llama built from a config in code,
3 AdamW steps of 2 micro-batches each (``accelerator.accumulate`` over a prepared ``DataLoader``); prints one JSON
line (rank 0).

``argv[1]``: ``torch`` (accelerate shards with torch's ``fully_shard``), ``fc`` (the same under
``fc.ported("accelerate")``), ``torch_presharded`` / ``fc_presharded`` (the user shards every decoder layer and the
root before ``prepare``: torch's ``fully_shard``, or ``fc.fully_shard(..., fsdp2_methods=True)`` and ``prepare``
under ``fc.ported("accelerate")``), ``fc_presharded_unported`` (that model, ``prepare`` without the port)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaForCausalLM

import fsdp_compose as fc
from tests.integration.counting import totals
from tests.integration.cpu_fsdp import enable_fsdp_plugin_on_cpu
from tests.integration.launch import finish_rank
from tests.integration.tiny_llama import tiny_llama_config

VARIANT = sys.argv[1]


class Tokens(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))


LIBRARY = "torch" if VARIANT.startswith("torch") else "fc"

PRESHARDED = "presharded" in VARIANT
# accelerate looks for the layer class before its "already sharded" guard; torch's fully_shard renames it (FSDP...).
plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2,
    auto_wrap_policy="no_wrap" if PRESHARDED else "transformer_based_wrap",
    transformer_cls_names_to_wrap=None if PRESHARDED else ["LlamaDecoderLayer"],
)
enable_fsdp_plugin_on_cpu()
accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=2)
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
config = tiny_llama_config()
model = LlamaForCausalLM(config)
if PRESHARDED:
    shard: Any = torch_fully_shard if LIBRARY == "torch" else fc.fully_shard
    extra: dict[str, Any] = {} if LIBRARY == "torch" else {"fsdp2_methods": True}
    for layer in model.model.layers:
        shard(layer, **extra)
    shard(model, **extra)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
port = fc.ported("accelerate") if LIBRARY == "fc" and not VARIANT.endswith("unported") else contextlib.nullcontext()
error = None
try:
    with port:
        model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(Tokens(), batch_size=2))
except Exception as exc:  # the unported pre-sharded model: what skipping the port costs
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
if error is not None:
    finish_rank({"error": error})

losses: list[float] = []
counts: list[dict[str, int]] = []
batches = iter(loader)
for _step in range(3):  # 6 batches per rank, 2 micro-batches per optimizer step
    with fc.CollectiveRecorder() as counter:
        for _ in range(2):
            ids = next(batches)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    counts.append(totals(counter))
    losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
params = [p.full_tensor().flatten()[:8].tolist() for p in model.parameters()]
finish_rank(
    {
        "loss": losses,
        "counts": counts,
        "params": params,
        "units": sum(1 for m in model.modules() if fc.is_fully_sharded(m) or type(m).__name__.startswith("FSDP")),
        "model_class": type(model).__name__,
    }
)
