"""A user's script, type-checked against fsdp_compose under ``mypy --strict`` (tests/test_typing.py, nox -s typecheck).

It is never run; it only has to type-check, and its ``reveal_type`` lines show what a user's editor sees.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose as fc


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def train() -> float:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = Net()
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh, mp_policy=fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    sharded = fc.fully_shard(model, mesh=mesh, offload_policy=fc.CPUOffloadPolicy(pin_memory=False))
    reveal_type(sharded)  # noqa: F821  (mypy's, reported as a note)
    pair = fc.fully_shard([nn.Linear(2, 2), nn.Linear(2, 2)], mesh=mesh)
    reveal_type(pair)  # noqa: F821  (mypy's, reported as a note)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    with fc.no_sync(sharded):
        sharded(torch.randn(4, 8)).sum().backward()
    loss = sharded(torch.randn(4, 8)).sum()
    loss.backward()
    norm: torch.Tensor = fc.clip_grad_norm_(sharded.parameters(), 1.0)
    optimizer.step()
    fc.set_reshard_after_forward(sharded, 2)
    handle = fc.unshard(sharded, async_op=True)
    if handle is not None:
        handle.wait()
    full: dict[str, torch.Tensor] = fc.full_state_dict(sharded)
    fc.load_full_state_dict(sharded, full, broadcast_from_rank0=True)
    units: list[fc.UnitDescription] = fc.describe_units(sharded)
    text: str = fc.describe(sharded, params=False)
    reveal_type(fc.get_state(sharded))  # noqa: F821  (mypy's, reported as a note)
    return float(norm) + len(units) + len(text)
