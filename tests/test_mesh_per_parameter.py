"""A mesh per parameter: ``shard_placement_fn`` returning FSDP2's ``ShardPlacementResult`` (a mixture of experts'
expert weights over their own data-parallel mesh beside the dense ones).

Each block of the test GPT keeps its attention on the call's mesh and puts its MLP on another: an HSDP mesh with a
shard group of one rank (2 ranks: the MLP replicated), an HSDP mesh with ``Shard(1)`` (4 ranks), and, as torchtitan
builds them, meshes split from one 1-D world mesh (4 ranks). Trained against a single-process reference on the same
global batch, side by side with torch's ``fully_shard`` given the same placements (losses and collective counts);
then trainability, accumulation, bf16, ``copy.deepcopy`` and state dicts on the same model.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import dp_slice, max_param_diff, mesh_nd, tp_mlps, train_on_dp_mesh

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4)
_SPLIT: dict[tuple[Any, ...], tuple[DeviceMesh, DeviceMesh]] = {}  # meshes for the life of a worker process


def _meshes(ws: int, kind: str) -> tuple[DeviceMesh, DeviceMesh, Any]:
    """(the call's mesh, the MLP's mesh, the MLP's FSDP2 mesh info) for ``kind``."""
    if kind == "hsdp":  # ws // 2 == 1: a shard group of one rank
        dense, mlp = mesh_nd((ws,), ("fsdp",)), mesh_nd((2, ws // 2), ("replicate", "shard"))
        return dense, mlp, HSDPMeshInfo(mesh=mlp, shard_mesh_dim=1, replicate_mesh_dim=0)
    key = (ws, kind)
    if key not in _SPLIT:  # torchtitan's ParallelDims: every mesh a split of one 1-D world mesh
        world = mesh_nd((ws,), ("world",))
        dense = world._unflatten(0, (ws,), ("fsdp",))
        sparse = world._unflatten(0, (2, ws // 2), ("dp_replicate", "efsdp"))
        _SPLIT[key] = (dense["fsdp"], sparse["dp_replicate", "efsdp"])
    dense, mlp = _SPLIT[key]
    return dense, mlp, HSDPMeshInfo(mesh=mlp, shard_mesh_dim=1, replicate_mesh_dim=0)


def _placement_fn(model: GPT, info: Any, dim: int) -> Any:
    mlp_params = {id(p) for block in model.blocks for p in block.mlp.parameters()}

    def placement(param: nn.Parameter) -> Any:
        if id(param) in mlp_params:
            return ShardPlacementResult(placement=Shard(dim if param.ndim > 1 else 0), mesh_info=info)
        return None

    return placement


def _shard(model: GPT, shard: Any, mesh: DeviceMesh, info: Any, dim: int, **kwargs: Any) -> GPT:
    placement = _placement_fn(model, info, dim)
    for block in model.blocks:
        shard(block, mesh=mesh, shard_placement_fn=placement, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _counted_steps(model: GPT, rank: int, ws: int, steps: int) -> tuple[list[float], list[dict[str, int]], Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, counts = [], []
    for step in range(steps):
        inputs, targets = synthetic_batch(CFG, 8, step)
        with fc.CollectiveRecorder(functional=False) as recorder:
            loss = loss_fn(model(dp_slice(inputs, rank, ws)), dp_slice(targets, rank, ws))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        counts.append({k: v for k, v in recorder.counts().items() if k in ("all_gather", "reduce_scatter")})
    return losses, counts, opt


def _trains_like_the_reference(rank: int, ws: int, kind: str) -> dict[str, Any]:
    mesh, mlp_mesh, info = _meshes(ws, kind)
    dim = 1 if ws > 2 else 0
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = _shard(copy.deepcopy(reference), fc.fully_shard, mesh, info, dim)
    theirs = _shard(copy.deepcopy(reference), torch_fully_shard, mesh, info, dim)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        inputs, targets = synthetic_batch(CFG, 8, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
    losses, counts, _ = _counted_steps(model, rank, ws, 3)
    torch_losses, torch_counts, _ = _counted_steps(theirs, rank, ws, 3)
    fc1 = model.blocks[0].mlp.fc.weight
    state = fc.get_state(model.blocks[0])
    assert state is not None
    return {
        "diff": max_param_diff(model, reference),
        "losses": losses,
        "torch_losses": torch_losses,
        "counts": counts,
        "torch_counts": torch_counts,
        "mlp_mesh": isinstance(fc1, DTensor) and fc1.device_mesh == mlp_mesh,
        "mlp_placement": str(fc1.placements) if isinstance(fc1, DTensor) else "",
        "siblings": [s.params.owner_name for s in state.siblings],
        "schedule": fc.describe_schedule(model),
        "description": fc.describe(model),
    }


@pytest.mark.parametrize(("ws", "kind"), [(2, "hsdp"), (4, "hsdp"), (4, "split")])
def test_a_mesh_per_parameter_trains_like_the_reference_and_torch(run_dist, ws: int, kind: str) -> None:
    mlp_names = {"hsdp": ("'replicate', 'shard'",), "split": ("'dp_replicate', 'efsdp'",)}
    for rank, result in enumerate(run_dist(ws, _trains_like_the_reference, kind)):
        assert result["diff"] < 1e-5, (rank, result["diff"])
        assert result["losses"] == pytest.approx(result["torch_losses"], abs=1e-6), (rank, result)
        for ours, torchs in zip(result["counts"], result["torch_counts"], strict=True):
            for what in ("all_gather", "reduce_scatter"):
                assert ours.get(what, 0) <= torchs.get(what, 0), (rank, result["counts"], result["torch_counts"])
        assert result["mlp_mesh"], (rank, result)
        if ws > 2:
            assert "Shard(dim=1)" in result["mlp_placement"], result["mlp_placement"]
        assert len(result["siblings"]) == 1 and "on (" in result["siblings"][0], result["siblings"]
        assert "blocks.0 on (" in result["schedule"], result["schedule"]
        for name in mlp_names[kind]:  # each unit with its own mesh, and the MLP's parameters on the MLP's
            assert name in result["description"], (name, result["description"])


def _features(rank: int, ws: int) -> dict[str, Any]:
    """Freezing the MLPs' first layer, a no-sync micro-batch, bf16 compute, a full state dict round trip."""
    mesh, _, info = _meshes(ws, "hsdp")
    torch.manual_seed(1)
    reference = GPT(CFG)
    policy = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard(copy.deepcopy(reference), fc.fully_shard, mesh, info, 1, mp_policy=policy)
    bf16_reference = copy.deepcopy(reference)
    for block in (*model.blocks, *bf16_reference.blocks):
        block.mlp.fc.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in bf16_reference.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        inputs, targets = synthetic_batch(CFG, 8, step)
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(bf16_reference(inputs), targets).backward()
        ref_opt.step()
        for micro, sync in ((0, False), (1, True)):  # two micro-batches of the global batch, one no-sync
            fc.set_requires_gradient_sync(model, sync)
            part = dp_slice(dp_slice(inputs, rank, ws), micro, 2), dp_slice(dp_slice(targets, rank, ws), micro, 2)
            (loss_fn(model(part[0]), part[1]) / 2).backward()
        opt.step()
        opt.zero_grad()
    frozen = max(
        (b.mlp.fc.weight.full_tensor() - r.mlp.fc.weight).abs().max().item()
        for b, r in zip(model.blocks, reference.blocks, strict=True)
    )
    twin = copy.deepcopy(model)  # its own units, siblings included, on the copied modules
    original, copied = fc.get_state(model.blocks[0]), fc.get_state(twin.blocks[0])
    assert original is not None and copied is not None
    sibling = copied.siblings[0]
    twin_ok = sibling is not original.siblings[0] and copied.members[1] is sibling
    twin_ok = twin_ok and sibling.modules == (twin.blocks[0],)
    x = dp_slice(synthetic_batch(CFG, 8, 5)[0], rank, ws)
    same_output = torch.equal(twin(x), model(x))
    full = fc.full_state_dict(model, rank0_only=False)
    again = _shard(GPT(CFG), fc.fully_shard, mesh, info, 1, mp_policy=policy)
    fc.load_full_state_dict(again, full)
    return {
        "diff": max_param_diff(model, bf16_reference),
        "frozen": frozen,
        "reloaded": max_param_diff(again, model),
        "keys": sorted(full) == sorted(reference.state_dict()),
        "twin": twin_ok and same_output,
    }


def test_a_mesh_per_parameter_with_frozen_accumulated_bf16_and_state_dicts(run_dist) -> None:
    for rank, result in enumerate(run_dist(4, _features)):
        assert result["frozen"] == 0.0, (rank, result)
        assert result["diff"] < 3e-2, (rank, result)
        assert result["reloaded"] == 0.0 and result["keys"], (rank, result)
        assert result["twin"], (rank, result)


def _beside_tensor_parallel(rank: int, ws: int) -> dict[str, Any]:
    """FSDP + TP: every mesh split from one world mesh; the MLPs tensor parallel on ``tp`` and sharded over an HSDP
    mesh of their own over the data-parallel ranks (one shard rank: replicated), the rest over ``dp``."""
    key = (ws, "tp")
    if key not in _SPLIT:
        world = mesh_nd((ws,), ("world",))
        dense = world._unflatten(0, (ws // 2, 2), ("dp", "tp"))
        mlp = world._unflatten(0, (ws // 2, 1, 2), ("mlp_replicate", "mlp_shard", "mlp_tp"))
        _SPLIT[key] = (dense, mlp["mlp_replicate", "mlp_shard"])
    dense, mlp_mesh = _SPLIT[key]
    info = HSDPMeshInfo(mesh=mlp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    torch.manual_seed(2)
    reference = GPT(CFG)
    model = copy.deepcopy(reference)
    tp_mlps(model, dense["tp"])
    _shard(model, fc.fully_shard, dense["dp"], info, 0)
    diff = train_on_dp_mesh(model, reference, CFG, dense["dp"], steps=3)
    weight = model.blocks[0].mlp.fc.weight
    return {"diff": diff, "mesh": weight.device_mesh.mesh_dim_names, "placements": str(weight.placements)}


def test_a_mesh_per_parameter_beside_tensor_parallel(run_dist) -> None:
    for rank, result in enumerate(run_dist(4, _beside_tensor_parallel)):
        assert result["diff"] < 1e-5, (rank, result)
        assert result["mesh"] == ("mlp_replicate", "mlp_shard", "tp"), (rank, result)


def _mixed_modes(rank: int, ws: int) -> str:
    """A ``ShardPlacementResult`` made under ``dp_mesh_dims`` (FSDP2's ``_get_mesh_info`` of a full SPMD mesh) given to
    a call without them: raised before anything changes."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    spmd = mesh_nd((2, ws // 2), ("replicate", "shard"))
    info = _get_mesh_info(spmd, DataParallelMeshDims(shard="shard", replicate="replicate"))
    torch.manual_seed(0)
    model = GPT(CFG)
    before = [(n, id(p)) for n, p in model.named_parameters()]
    try:
        _shard(model, fc.fully_shard, mesh_nd((ws,), ("fsdp",)), info, 0)
    except ValueError as error:
        untouched = [(n, id(p)) for n, p in model.named_parameters()] == before and not fc.is_fully_sharded(model)
        return f"{error} untouched={untouched}"
    return "no error"


def test_a_mesh_per_parameter_made_under_dp_mesh_dims_needs_them_in_the_call(run_dist) -> None:
    for message in run_dist(4, _mixed_modes):
        assert "has a ShardPlacementResult with dp_mesh_dims, the call without" in message, message
        assert "blocks.0.mlp" in message or "'mlp." in message or "fc.weight" in message, message
        assert message.endswith("untouched=True"), message


# ---------------------------------------------------------------------- experts behind all-to-alls
MOE_ARGS = {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 61, "n_layers": 2, "expert_ffn_dim": 16}


def _experts_train_like_the_reference(rank: int, ws: int, experts: int) -> dict[str, Any]:
    """The planner's MoE model (``fsdp_compose.plan``'s ``moe`` preset: experts over ``ep`` ranks, tokens moved by
    all-to-alls), its experts on their own data-parallel mesh (``efsdp``), against a single-process model that
    computes every rank's micro-batch; torch's ``fully_shard`` given the same placements beside it (collective counts;
    losses where torch can take the same divide factor on gloo)."""
    from fsdp_compose.plan.models import load_model_spec
    from fsdp_compose.plan.step import PlanConfig, build_mesh, expert_placement

    config = PlanConfig(model="moe", world_size=ws, ep=2)
    args = {**MOE_ARGS, "num_experts": experts}
    results: dict[str, Any] = {}
    reference = None
    for name, shard in (("ours", fc.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        spec = load_model_spec("moe", args)
        if reference is None:
            reference = copy.deepcopy(spec.model)
        meshes = build_mesh(config, mesh=mesh_nd((ws,), ("shard",)))
        assert meshes.ep_mesh is not None
        placement = expert_placement(meshes, set(spec.ep_plan(spec.model, meshes.ep_mesh)), spec.model)
        for layer in spec.units:
            shard(layer, mesh=meshes.dp_mesh, shard_placement_fn=placement)
            # an expert's gradient sums every rank's tokens; reduced over efsdp only, it would be divided by
            # efsdp's size: divided by the data-parallel size instead, as the dense ones (torchtitan does the same)
            if name == "ours":
                fc.set_gradient_divide_factor(layer, float(ws))
            elif ws == 2:  # torch's reduce-scatter with a factor is a PREMUL_SUM, which gloo lacks (efsdp 1: none)
                layer.set_gradient_divide_factor(float(ws))
        shard(spec.model, mesh=meshes.dp_mesh)
        opt = torch.optim.SGD(spec.model.parameters(), lr=0.1, momentum=0.9)
        losses, counts = [], []
        torch.manual_seed(1)
        for _ in range(3):
            inputs, targets = spec.make_batch(2 * ws, 8)
            with fc.CollectiveRecorder(functional=False) as recorder:
                loss = spec.loss(spec.model(inputs.chunk(ws)[rank]), targets.chunk(ws)[rank])
                loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            losses.append(total.item() / ws)
            counts.append(recorder.counts())
        w1 = spec.model.model.layers[0].mlp.experts.w1
        results[name] = {"losses": losses, "counts": counts, "placements": str(w1.placements), "model": spec.model}
    assert reference is not None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    spec = load_model_spec("moe", args)
    ref_losses = []
    torch.manual_seed(1)
    for _ in range(3):
        inputs, targets = spec.make_batch(2 * ws, 8)
        # each rank's micro-batch on its own: a rank's expert capacity is counted from its tokens
        per_rank = [spec.loss(reference(x), y) for x, y in zip(inputs.chunk(ws), targets.chunk(ws), strict=True)]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    ours = results["ours"]
    return {
        "diff": max_param_diff(ours.pop("model"), reference),
        "torch_diff": max_param_diff(results["torch"]["model"], reference),
        "ref_losses": ref_losses,
        "ours": ours,
        "torch": {k: v for k, v in results["torch"].items() if k != "model"},
    }


@pytest.mark.parametrize(("ws", "experts"), [(2, 4), (4, 4), (4, 2)], ids=["ws2-efsdp1", "ws4-shard0", "ws4-shard1"])
def test_experts_behind_all_to_alls_train_like_the_reference_and_torch(run_dist, ws: int, experts: int) -> None:
    for rank, result in enumerate(run_dist(ws, _experts_train_like_the_reference, experts)):
        ours, theirs = result["ours"], result["torch"]
        assert result["diff"] < 1e-5, (rank, result["diff"], result["torch_diff"], result)
        assert ours["losses"] == pytest.approx(result["ref_losses"], abs=1e-5), (rank, result)
        if ws == 2:  # the same divide factor on both (see above)
            assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6), (rank, result)
        assert ours["placements"] == theirs["placements"], (rank, result)
        if experts // 2 < ws // 2:  # fewer experts per ep rank than efsdp ranks: sharded on the hidden dim
            assert "Shard(dim=1)" in ours["placements"], ours["placements"]
        for mine, torchs in zip(ours["counts"], theirs["counts"], strict=True):
            assert mine["all_to_all"] == torchs["all_to_all"] == 8, (mine, torchs)
            for what in ("all_gather", "reduce_scatter"):
                assert mine.get(what, 0) <= torchs.get(what, 0), (rank, ours["counts"], theirs["counts"])
