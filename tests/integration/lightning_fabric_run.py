"""Run under ``torchrun --nproc_per_node 2``: Lightning Fabric's ``ModelParallelStrategy`` with torch's
``fully_shard`` or ``fc.fully_shard`` in the user's ``parallelize_fn``; prints one JSON line (rank 0).

``argv[1]``: ``torch``, ``fc`` (fsdp_compose with the guard patch of docs/integrations.md), ``fc_ported`` (the training
loop under ``fc.ported("lightning")`` instead) or ``fc_unpatched``."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies import model_parallel as lightning_model_parallel
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_compose as fc
from tests.integration.launch import finish_rank

VARIANT = sys.argv[1]
shard: Any = torch_fully_shard if VARIANT == "torch" else functools.partial(fc.fully_shard, fsdp2_methods=True)


def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    dp_mesh = device_mesh["data_parallel"]
    for block in model[:-1]:
        shard(block, mesh=dp_mesh)
    shard(model, mesh=dp_mesh)
    return model


if VARIANT == "fc":  # the guard patch of Lightning's no_backward_sync (one line in model_parallel.py)

    def _set_requires_grad_sync(self: Any, requires_grad_sync: bool) -> None:
        for mod in self._module.modules():
            if isinstance(mod, FSDPModule) or fc.has_fsdp2_methods(mod):
                mod.set_requires_gradient_sync(requires_grad_sync, recurse=False)

    lightning_model_parallel._FSDPNoSync._set_requires_grad_sync = _set_requires_grad_sync  # type: ignore[method-assign]

strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
torch.manual_seed(0)
model = nn.Sequential(
    nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)
)
model = fabric.setup_module(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
losses, reduce_scatters = [], []
port = fc.ported("lightning") if VARIANT == "fc_ported" else contextlib.nullcontext()
with port:  # fc_ported: Fabric's no_backward_sync with the guard line applied for the block
    for step in range(3):
        counter = fc.CollectiveRecorder()
        with counter:
            for micro in range(2):  # gradient accumulation: the first micro-batch without gradient sync
                gen = torch.Generator().manual_seed(10 * step + micro)
                x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
                x, y = x.chunk(2)[fabric.global_rank], y.chunk(2)[fabric.global_rank]
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    loss = nn.functional.mse_loss(model(x), y)
                    fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        reduce_scatters.append(counter.counts()["reduce_scatter"])
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
params = [p.full_tensor().flatten().tolist() for p in model.parameters()]
finish_rank({"loss": losses, "reduce_scatters": reduce_scatters, "params": params})
