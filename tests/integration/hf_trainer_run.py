"""Run under ``torchrun --nproc_per_node 2``: HF ``Trainer`` (gradient accumulation 2) on a tiny randomly initialized
Llama built from a config in code, sharded per decoder layer by torch's ``fully_shard`` or ``fc.fully_shard``;
prints one JSON line (rank 0). ``argv[1]``: ``torch``, ``fc`` or ``fc_ported`` (``trainer.train()`` under
``fc.ported("transformers")``)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.data import Dataset
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

import fsdp_compose as fc
from tests.integration.launch import finish_rank
from tests.integration.tiny_llama import tiny_llama_config

VARIANT = sys.argv[1]


class Tokens(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
config = tiny_llama_config()
model = LlamaForCausalLM(config)
shard: Any = torch_fully_shard if VARIANT == "torch" else fc.fully_shard
extra: dict[str, Any] = {} if VARIANT == "torch" else {"fsdp2_methods": True}
for layer in model.model.layers:
    shard(layer, mesh=mesh, **extra)
shard(model, mesh=mesh, **extra)
# The Trainer would wrap a model it did not shard itself in DDP (both libraries): mark it as sharded at load time,
# as transformers' own DistributedConfig loading does.
model._is_distributed_loading_by_transformers = True
model.config.distributed_config = DistributedConfig(fsdp_size=dist.get_world_size(), dp_replicate_size=1)
args = TrainingArguments(
    output_dir="/tmp/fc-hf-trainer",
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=3,
    learning_rate=1e-2,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    logging_steps=1,
    seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
counter = fc.CollectiveRecorder()
port = fc.ported("transformers") if VARIANT == "fc_ported" else contextlib.nullcontext()
with counter, port:
    result = trainer.train()
losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
params = [p.full_tensor().flatten()[:8].tolist() for p in model.parameters()]
finish_rank(
    {
        "loss": losses,
        "reduce_scatters": counter.counts()["reduce_scatter"],
        "params": params,
        "wrapped": type(trainer.model_wrapped).__name__,
    }
)
