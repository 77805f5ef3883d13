"""``torch.distributed.pipelining`` over stages sharded by fsdp_compose
(``fsdp_compose.integrations.pipelining.PipelineStage``), side by side with torch's ``fully_shard`` under torch's
``PipelineStage``: 2 pipeline x 2 data-parallel gloo ranks, 4 micro-batches, torch's own GPipe, 1F1B and
Interleaved1F1B schedules.

Per step after the first (the first also runs pipelining's metadata inference, a real forward and backward per
stage): the same parameters, the same all-gathers (count and bytes) and the same number of reduce-scatters, one per
unit per step, with the same bytes (every trainable parameter gets a gradient, so no "had a gradient" flag rides
along: grads.py). Under torch's own ``PipelineStage``
every micro-batch reduce-scatters (its no-sync branch is guarded by ``isinstance(submod, FSDPModule)``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import fsdp_compose as fc
from fsdp_compose.integrations.pipelining import PipelineStage as FcPipelineStage
from tests.dist_utils import full_value, mesh_nd
from tests.integration.counting import totals

DIM = 8
MICRO_BATCHES = 4
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class StageNet(nn.Module):
    """One pipeline stage: two blocks (a unit each) and an output layer (the stage's root unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _train(rank: int, ws: int, variant: str, schedule: str, reshard_after_forward: bool | None) -> dict[str, Any]:
    """``variant``: ``torch`` (torch's fully_shard and PipelineStage), ``fc`` (fc.fully_shard and fsdp_compose's
    PipelineStage), ``fc_torch_stage`` (fc.fully_shard under torch's PipelineStage)."""
    mesh = mesh_nd((2, ws // 2), ("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    pp_rank, pp_size, dp_rank, dp_size = pp.get_local_rank(), pp.size(), dp.get_local_rank(), dp.size()
    per_rank = 2 if schedule == "interleaved" else 1
    n_stages = pp_size * per_rank
    torch.manual_seed(0)
    nets = [StageNet() for _ in range(n_stages)]
    shard: Any = torch_fully_shard if variant == "torch" else fc.fully_shard
    stage_class: Any = FcPipelineStage if variant == "fc" else PipelineStage
    stages = []
    for index in range(pp_rank, n_stages, pp_size):  # looped placement: rank r holds stages r, r + pp_size, ...
        net = nets[index]
        for block in net.blocks:
            shard(block, mesh=dp, reshard_after_forward=reshard_after_forward)
        shard(net, mesh=dp, reshard_after_forward=reshard_after_forward)
        stages.append(stage_class(net, index, n_stages, torch.device("cpu"), group=pp.get_group()))

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    pipe = SCHEDULES[schedule](stages if per_rank > 1 else stages[0], MICRO_BATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-2)
    counts: list[dict[str, int]] = []
    losses: list[float] = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4 * MICRO_BATCHES, DIM, generator=gen).chunk(dp_size)[dp_rank]
        y = torch.randn(4 * MICRO_BATCHES, DIM, generator=gen).chunk(dp_size)[dp_rank]
        step_losses: list[torch.Tensor] = []
        with fc.CollectiveRecorder() as counter:
            if pp_rank == 0:
                pipe.step(x)
            else:
                pipe.step(target=y, losses=step_losses)
        optimizer.step()
        optimizer.zero_grad()
        counts.append(totals(counter))
        losses.extend(loss.item() for loss in step_losses)
    params = {f"{s.stage_index}.{n}": full_value(p.detach()) for s in stages for n, p in s.submod.named_parameters()}
    return {"params": params, "counts": counts, "losses": losses}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("reshard_after_forward", [None, False])
def test_pipeline_schedules_match_torch_fully_shard(
    run_dist, schedule: str, reshard_after_forward: bool | None
) -> None:
    theirs = run_dist(4, _train, "torch", schedule, reshard_after_forward)
    ours = run_dist(4, _train, "fc", schedule, reshard_after_forward)
    units_per_rank = 3 * (2 if schedule == "interleaved" else 1)
    for rank, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        assert o["losses"] == pytest.approx(t["losses"], abs=1e-6), rank
        for name, value in t["params"].items():
            assert (o["params"][name] - value).abs().max().item() <= 1e-5, (rank, name)
        for step in (1, 2):  # step 0 also runs pipelining's metadata inference (see the module docstring)
            tc, oc = t["counts"][step], o["counts"][step]
            assert oc["all_gather"] == tc["all_gather"] and oc["all_gather_bytes"] == tc["all_gather_bytes"], rank
            assert oc["reduce_scatter"] == tc["reduce_scatter"] == units_per_rank, rank
            assert oc["reduce_scatter_bytes"] == tc["reduce_scatter_bytes"], rank


def test_torchs_pipeline_stage_reduce_scatters_every_micro_batch(run_dist) -> None:
    """What the one changed import line saves: under torch's PipelineStage the same numbers, but each of the 4
    micro-batches reduce-scatters every unit (and the stage's root is gathered again for every micro-batch)."""
    theirs = run_dist(4, _train, "torch", "1f1b", None)
    unported = run_dist(4, _train, "fc_torch_stage", "1f1b", None)
    for t, u in zip(theirs, unported, strict=True):
        for name, value in t["params"].items():
            assert (u["params"][name] - value).abs().max().item() <= 1e-5, name
        assert u["counts"][1]["reduce_scatter"] == MICRO_BATCHES * t["counts"][1]["reduce_scatter"] == 12
        assert u["counts"][1]["all_gather"] > t["counts"][1]["all_gather"]


def _split_backward_refused(rank: int, ws: int) -> str:
    mesh = mesh_nd((2, ws // 2), ("pp", "dp"))
    net = StageNet()
    fc.fully_shard(net, mesh=mesh["dp"])
    stage = FcPipelineStage(net, mesh["pp"].get_local_rank(), 2, torch.device("cpu"), group=mesh["pp"].get_group())
    with pytest.raises(NotImplementedError) as info:
        stage.backward_one_chunk(0, full_backward=False)  # what a zero-bubble schedule calls
    return str(info.value)


def test_split_backward_is_refused(run_dist) -> None:
    for message in run_dist(4, _split_backward_refused):
        assert "splits backward" in message and "ScheduleGPipe" in message
