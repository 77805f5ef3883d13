"""Run under ``torchrun --nproc_per_node 2``: the Lightning ``Trainer`` with ``ModelParallelStrategy`` and
``accumulate_grad_batches=2``; ``configure_model`` shards with torch's ``fully_shard`` or ``fc.fully_shard``
(``argv[1]``: ``torch`` or ``fc``). Prints one JSON line (rank 0)."""

from __future__ import annotations

import functools
import sys
from typing import Any

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.data import DataLoader, TensorDataset

import fsdp_compose as fc
from tests.integration.launch import finish_rank

VARIANT = sys.argv[1]
shard: Any = torch_fully_shard if VARIANT == "torch" else functools.partial(fc.fully_shard, fsdp2_methods=True)


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)
        )
        self.losses: list[float] = []

    def configure_model(self) -> None:
        dp_mesh = self.device_mesh["data_parallel"]
        for block in self.net[:-1]:
            shard(block, mesh=dp_mesh)
        shard(self.net, mesh=dp_mesh)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


gen = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(24, 8, generator=gen), torch.randn(24, 4, generator=gen))
model = Net()
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    accumulate_grad_batches=2,
    max_steps=3,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
counter = fc.CollectiveRecorder()
with counter:
    trainer.fit(model, DataLoader(data, batch_size=2, shuffle=False))
params = [p.full_tensor().flatten().tolist() for p in model.net.parameters()]
finish_rank({"loss": model.losses, "reduce_scatters": counter.counts()["reduce_scatter"], "params": params})
