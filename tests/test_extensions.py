"""Per-instance extensions: compressed all-gathers and communication hooks, bound to one fully_shard call."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_compose as fc
from examples.gpt_model import GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import local_batch, mesh_1d, mesh_nd, reference_and_copy, shard_gpt, train_pair


def _compressed_all_gather(rank: int, ws: int, kind: str) -> dict[str, Any]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    plain = copy.deepcopy(reference)
    transform = fc.Int8AllGather() if kind == "int8" else fc.CastAllGather(torch.bfloat16)
    shard_gpt(model, mesh_1d(ws), extensions=fc.ShardExtensions(all_gather=transform))
    shard_gpt(plain, mesh_1d(ws))
    inputs, _ = synthetic_batch(cfg, 4, 0)
    x = local_batch(inputs, rank, ws)
    with fc.CollectiveRecorder() as recorder, torch.no_grad():
        out = model(x)
    # each rank's payload: the all-gather's output over the group size
    gathered = [(r.dtype, r.numel // r.group_size) for r in recorder.records if r.kind == "all_gather"]
    with torch.no_grad():
        exact = plain(x)
    segments = [fc.get_state(m).params.shards.layout.segment_numel for m in [model, *model.blocks]]
    losses = []
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(6):
        batch, target = synthetic_batch(cfg, 4, step % 2)
        opt.zero_grad()
        loss = loss_fn(model(local_batch(batch, rank, ws)), local_batch(target, rank, ws))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "rel_err": ((out - exact).abs().max() / exact.abs().max()).item(),
        "gathered": gathered,
        "segments": segments,
        "losses": losses,
        "plain_untouched": fc.get_state(plain).params.extensions.all_gather is None,
    }


@pytest.mark.parametrize("ws", [2, 4])
def test_int8_all_gather_sends_under_a_third_of_the_bytes_and_trains(run_dist, ws: int) -> None:
    for r in run_dist(ws, _compressed_all_gather, "int8"):
        # every payload is uint8: one byte per value (padded to blocks of 64) plus a 4-byte fp32 scale per block
        expected = sorted((torch.uint8, -(-n // 64) * (64 + 4)) for n in r["segments"])
        assert sorted(r["gathered"]) == expected
        assert sum(n for _, n in r["gathered"]) < 0.3 * 4 * sum(r["segments"])  # < 30% of the fp32 bytes
        assert r["rel_err"] < 0.05  # 8-bit weights, per-block scales: measured 2-3% of the largest logit
        assert r["losses"][-1] < r["losses"][0]
        assert r["plain_untouched"]


@pytest.mark.parametrize("ws", [2])
def test_bf16_all_gather_of_fp32_parameters(run_dist, ws: int) -> None:
    for r in run_dist(ws, _compressed_all_gather, "bf16"):
        assert sorted(r["gathered"]) == sorted((torch.bfloat16, n) for n in r["segments"])
        assert r["rel_err"] < 0.02
        assert r["losses"][-1] < r["losses"][0]


class _CountingAllReduce:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Any:
        self.calls += 1
        return dist.all_reduce(tensor, group=group, async_op=True)


def _hsdp_all_reduce_hook(rank: int, ws: int) -> tuple[float, int, int]:
    cfg = GPTConfig()
    reference, model = reference_and_copy(cfg)
    hook = _CountingAllReduce()
    dp_mesh = mesh_nd((2, 2), ("replicate", "shard"))
    shard_gpt(model, dp_mesh, extensions=fc.ShardExtensions(all_reduce=hook))
    diff = train_pair(rank, ws, model, reference, cfg, steps=2)  # ranks 0..3 = replicate-major dp order
    return diff, hook.calls, len(model.blocks) + 1


def test_hsdp_all_reduce_hook_wraps_the_replica_all_reduce(run_dist) -> None:
    for diff, calls, units in run_dist(4, _hsdp_all_reduce_hook):
        assert diff <= 1e-5
        assert calls == 2 * units
