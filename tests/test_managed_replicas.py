"""HSDP whose replicate group is not one of c10d's: torchft's ``ManagedProcessGroup`` in miniature (``LiveReplicas``).

torchft registers its replica group as a 1-rank c10d group, so the mesh (``DeviceMesh.from_group``) has a replicate
dim of size 1, while the group's ``size()`` is the number of replicas in this step's quorum; a replica that is
healing takes part in every all-reduce with zeros. torch's ``fully_shard`` averages the replicas over the live group
(it asks the group for AVG, and the group divides by its ``size()``); fsdp_compose must do the same: divide by the
replicate group's size at the reduction, not by the mesh's size at ``fully_shard``. Both are compared with one
process training on the batches of the participating ranks.

The backward's agreement (program.py) must not cross such a group: its all-reduce zeroes a healing replica's values
and turns failures into no-ops (torchft), so ranks of one shard group could leave it with different schedules. It runs
over ``DataParallelMesh.agreement_groups``, as the collective checks do (docs/integrations.md, "torchft").
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import AllreduceOptions, ReduceOp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from fsdp_compose.grads import divide_factors
from fsdp_compose.meshes import DataParallelMesh, is_c10d_group
from tests.dist_utils import mesh_nd

LR = 0.1
REPLICAS, SHARDS = 2, 2


class _Done(dist.Work):
    """A collective that completed when it was issued."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LiveReplicas(dist.ProcessGroup):
    """The replicas' gloo group behind torchft's semantics: c10d sees one rank (as after torchft's ``register``),
    ``size()`` is the number of participating replicas, a replica that does not participate (healing) enters its
    all-reduces with zeros, AVG is a sum divided by ``size()``. Records each all-reduce's (op, dtype)."""

    def __init__(self, replicas: dist.ProcessGroup) -> None:
        super().__init__(0, 1)
        self.replicas = replicas
        self.live = replicas.size()
        self.participating = True
        self.calls: list[tuple[str, torch.dtype]] = []
        self._name = ""

    # c10d names the group when it registers it (new_group); DeviceMesh looks groups up by name.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def register(self) -> None:
        """As torchft's ``register``: a backend whose process group is this object, in a 1-rank ``new_group``."""
        backend = f"live_replicas_{dist.get_rank()}"
        dist.Backend.register_backend(backend, lambda store, rank, size, timeout: self, devices=["cpu"])
        assert dist.new_group(ranks=[dist.get_rank()], backend=backend) is self

    def size(self) -> int:
        return self.live

    def getBackendName(self) -> str:  # c10d's name
        return "live_replicas"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        (tensor,) = tensors
        op = opts.reduceOp if isinstance(opts, AllreduceOptions) else opts
        average = op == ReduceOp.AVG
        self.calls.append((op.op.name, tensor.dtype))
        if not self.participating:
            tensor.zero_()
        dist.all_reduce(tensor, op=ReduceOp.SUM if average else op, group=self.replicas)
        if average:
            tensor.div_(self.live)
        return _Done()


_LIVE: list[LiveReplicas] = []  # one per worker process (of one world size): c10d keeps every registered group


def _replica_mesh(replicas: int = 2, shards: int = 2) -> tuple[DeviceMesh, LiveReplicas, int, int]:
    """This replica's (replicate, shard) mesh over ``LiveReplicas``, as torchft users build it; the group (every
    replica taking part); the replica and shard index of this rank."""
    full = mesh_nd((replicas, shards), ("replicate", "shard"))
    replica, shard = full.get_local_rank(0), full.get_local_rank(1)
    if not _LIVE:
        _LIVE.append(LiveReplicas(full.get_group(0)))
        _LIVE[0].register()
    live = _LIVE[0]
    live.live, live.participating, live.calls = replicas, True, []
    mesh = DeviceMesh.from_group(
        [live, full.get_group(1)],
        "cpu",
        mesh=full.mesh[replica].unsqueeze(0),
        mesh_dim_names=("replicate", "shard"),
    )
    return mesh, live, replica, shard


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _shard(model: nn.Module, impl: str, mesh: DeviceMesh, reduce_dtype: torch.dtype | None) -> None:
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        fc_policy = fc.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for layer in (model[0], model[2]):
            fc.fully_shard(layer, mesh=mesh, mp_policy=fc_policy)
        fc.fully_shard(model, mesh=mesh, mp_policy=fc_policy)


def _batch(step: int, replica: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + 10 * replica + shard)
    x = torch.randn(4, 8, generator=generator)
    return x, x[:, :4].sin()


def _train_live(rank: int, world_size: int, impl: str, reduce_dtype: torch.dtype | None) -> float:
    """Step 0: both replicas take part (the mesh says 1 replica, the group 2). Step 1: replica 1 heals (its inputs
    are zeroed; the group says 1). Returns the largest difference of this rank's shards from the reference."""
    mesh, live, replica, shard = _replica_mesh()
    reference = _model()
    model = copy.deepcopy(reference)
    _shard(model, impl, mesh, reduce_dtype)
    assert mesh.size(0) == 1 and live.size() == REPLICAS
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step, participating in enumerate([range(REPLICAS), range(1)]):
        live.live, live.participating = len(participating), replica in participating
        opt.zero_grad()
        x, y = _batch(step, replica, shard)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        # The reference: the mean of the participating ranks' losses, on one process.
        ref_opt.zero_grad()
        losses = [
            nn.functional.mse_loss(reference(bx), by)
            for bx, by in (_batch(step, r, s) for r in participating for s in range(SHARDS))
        ]
        torch.stack(losses).mean().backward()
        ref_opt.step()
    worst = 0.0
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert isinstance(ours, DTensor)
        expected = theirs.detach().chunk(SHARDS)[shard]
        worst = max(worst, (ours.to_local().detach() - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("reduce_dtype", [None, torch.float16])
@pytest.mark.parametrize("impl", ["fc", "torch"])
def test_replicas_averaged_over_the_live_group(run_dist: Any, impl: str, reduce_dtype: torch.dtype | None) -> None:
    """Without the live size, fsdp_compose divides by the mesh's 1 replica: the step-0 gradients are the sum over
    both replicas (twice the mean), the step-1 ones right by chance; the parameters end 1e-2 off. fp16 reductions
    divide before the reduce-scatter (by the data-parallel size) and after it: both by the live size."""
    tolerance = 1e-6 if reduce_dtype is None else 1e-4
    assert max(run_dist(REPLICAS * SHARDS, _train_live, impl, reduce_dtype)) < tolerance


def _groups(rank: int, world_size: int) -> dict[str, Any]:
    mesh, live, _, _ = _replica_mesh()
    dp = DataParallelMesh.of(mesh)
    ordinary = DataParallelMesh.of(mesh_nd((REPLICAS, SHARDS), ("replicate", "shard")))
    return {
        "c10d": [is_c10d_group(g) for g in (dp.shard_group, live, ordinary.replicate_group)],
        "agreement": [g is dp.shard_group for g in dp.agreement_groups],
        "ordinary agreement": len(ordinary.agreement_groups),
        "averaged_over": (
            dp.size,
            divide_factors(dp, None, torch.float32)[1],
            ordinary.size,
            divide_factors(ordinary, None, torch.float32)[1],
        ),
    }


def test_a_managed_replicate_group_is_told_apart(run_dist: Any) -> None:
    for result in run_dist(REPLICAS * SHARDS, _groups):
        assert result["c10d"] == [True, False, True]
        assert result["agreement"] == [True]  # the shard group only
        assert result["ordinary agreement"] == 2
        assert result["averaged_over"] == (SHARDS, SHARDS * REPLICAS, SHARDS * REPLICAS, SHARDS * REPLICAS)


def _agreement(rank: int, world_size: int, replicas: int, checks: bool) -> list[tuple[str, str]]:
    """Two steps of fsdp_compose over ``LiveReplicas``, the second with the last replica healing (it takes part
    with zeros; the group's size counts the others); the all-reduces of the group that carried no gradients, or
    the error the backward raised."""
    mesh, live, replica, shard = _replica_mesh(replicas, world_size // replicas)
    model = _model()
    _shard(model, "fc", mesh, None)
    fc.set_collective_checks(model, checks)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, participating in enumerate([range(replicas), range(replicas - 1)]):
        live.live, live.participating = len(participating), replica in participating
        opt.zero_grad()
        x, y = _batch(step, replica, shard)
        try:
            nn.functional.mse_loss(model(x), y).backward()
        except RuntimeError as error:  # every rank raises the same (the agreement's result is the same on all)
            return [("raised", str(error).split(";")[0])]
        opt.step()
    return [(op, str(dtype)) for op, dtype in live.calls if not dtype.is_floating_point]


def test_the_agreement_stays_off_a_managed_replicate_group(run_dist: Any) -> None:
    assert run_dist(4, _agreement, 2, False) == [[]] * 4


def test_collective_checks_pass_while_a_replica_heals(run_dist: Any) -> None:
    """Three replicas (of one rank each), the third healing: two take part, so the group's size is 2 and the
    agreement crosses it (with two replicas, one healing, its size is 1 and the agreement leaves it out)."""
    assert run_dist(3, _agreement, 3, True) == [[]] * 3
