"""torch.compile with sharded models: every way users compile (the OptimizedModule wrapper, ``block.compile()`` in
place before sharding as torchtitan does, ``fullgraph=True``, ``torch.compile(model)`` after sharding) and the
features that meet compiled blocks (activation checkpointing inside and around a unit, bf16 mixed precision, no_sync
accumulation, a trainability change, HSDP, FSDP + TP). Each trains 3 steps on 2 or 4 gloo ranks against a
single-process eager reference. ``aot_eager`` runs the same dynamo + AOTAutograd path as inductor without a C++
toolchain. The graph-break test counts against torch's own ``fully_shard`` on the same model.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any, cast

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import dp_coordinates, dp_slice, full_value, make_optimizer, mesh_1d, mesh_nd, tp_mlps

BACKEND = "aot_eager"
FP32_TOL = 1e-5
BF16_TOL = 3e-2  # bf16 compute against the fp32 reference, 3 SGD steps
# Wrappers torch.compile and checkpoint_wrapper put into parameter names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _diff(model: nn.Module, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    return max(
        (full_value(p.detach()).float() - full_value(ref[_plain_name(n)].detach()).float()).abs().max().item()
        for n, p in model.named_parameters()
    )


def _compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _build(
    mode: str,
    *,
    impl: str = "fc",
    mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
    bf16: bool = False,
    checkpointing: bool = False,
) -> tuple[nn.Module, GPT]:
    """The model compiled and sharded the way ``mode`` says (every block, then the root), and its eager reference."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    reference = GPT(GPTConfig())
    model = GPT(GPTConfig(activation_checkpointing=checkpointing))
    model.load_state_dict(reference.state_dict())
    if tp_mesh is not None:
        tp_mlps(model, tp_mesh)
    assert mesh is not None
    kwargs: dict[str, Any] = {}
    if bf16:
        policy = fc.MixedPrecisionPolicy if impl == "fc" else TorchMixedPrecisionPolicy
        kwargs["mp_policy"] = policy(param_dtype=torch.bfloat16)
    shard = fc.fully_shard if impl == "fc" else torch_fully_shard
    blocks: Any = model.blocks
    for i, block in enumerate(model.blocks):
        if mode == "wrapper":  # torch.compile(block): shard the OptimizedModule that replaces it
            blocks[i] = torch.compile(block, backend=BACKEND)
        elif mode == "in_place":  # torchtitan's order: compile in place, then shard
            block.compile(backend=BACKEND)
        elif mode == "fullgraph":
            block.compile(backend=BACKEND, fullgraph=True)
        elif mode == "after_sharding":  # the other order: shard, then compile in place
            shard(block, mesh=mesh, **kwargs)
            block.compile(backend=BACKEND)
            continue
        elif mode == "checkpoint_around":  # the unit (hooks included) runs again in backward's recompute
            block.compile(backend=BACKEND)
            shard(block, mesh=mesh, **kwargs)
            blocks[i] = checkpoint_wrapper(block)
            continue
        else:
            assert mode in ("model", "eager"), mode
        shard(blocks[i], mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    if mode == "model":  # after sharding: the hooks run eagerly, each block's forward is compiled
        return cast(nn.Module, torch.compile(model, backend=BACKEND)), reference
    return model, reference


def _train(
    model: nn.Module,
    reference: GPT,
    dp_mesh: DeviceMesh,
    *,
    micro_batches: int = 1,
    freeze_after_first_step: bool = False,
) -> float:
    """3 SGD steps: ``model`` on this rank's data-parallel slice, ``reference`` eagerly on the global batch of 8."""
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    dp_rank, dp_size = dp_coordinates(dp_mesh)
    for step in range(3):
        if freeze_after_first_step and step == 1:
            for net in (model, reference):
                for name, param in net.named_parameters():
                    if _plain_name(name).startswith("blocks.0.attn."):
                        param.requires_grad_(False)
        inputs, targets = synthetic_batch(GPTConfig(), 8, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        opt.zero_grad()
        x, y = dp_slice(inputs, dp_rank, dp_size), dp_slice(targets, dp_rank, dp_size)
        for micro, (mx, my) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            if micro < micro_batches - 1:
                with fc.no_sync(model):
                    (loss_fn(model(mx), my) / micro_batches).backward()
            else:
                (loss_fn(model(mx), my) / micro_batches).backward()
        opt.step()
    return _diff(model, reference)


# ------------------------------------------------------------------------------------------ the ways to compile
def _compile_mode(rank: int, ws: int, mode: str) -> tuple[float, int]:
    model, reference = _build(mode, mesh=mesh_1d(ws))
    return _train(model, reference, mesh_1d(ws)), _compiled_graphs()


@pytest.mark.parametrize("mode", ["wrapper", "in_place", "fullgraph", "after_sharding", "model"])
def test_each_way_to_compile_trains_like_the_eager_reference(run_dist, mode: str) -> None:
    for diff, graphs in run_dist(2, _compile_mode, mode):
        assert graphs >= 1  # the blocks really ran compiled
        assert diff <= FP32_TOL


# ------------------------------------------------------------------------- features meeting compiled blocks
def _compiled_with(rank: int, ws: int, feature: str) -> tuple[float, int]:
    mesh = mesh_1d(ws)
    if feature == "checkpoint_inside":
        model, reference = _build("in_place", mesh=mesh, checkpointing=True)
        return _train(model, reference, mesh), _compiled_graphs()
    if feature == "checkpoint_around":
        model, reference = _build("checkpoint_around", mesh=mesh)
        return _train(model, reference, mesh), _compiled_graphs()
    if feature == "no_sync":
        model, reference = _build("in_place", mesh=mesh)
        return _train(model, reference, mesh, micro_batches=2), _compiled_graphs()
    assert feature == "trainability", feature
    model, reference = _build("in_place", mesh=mesh)
    return _train(model, reference, mesh, freeze_after_first_step=True), _compiled_graphs()


@pytest.mark.parametrize("feature", ["checkpoint_inside", "checkpoint_around", "no_sync", "trainability"])
def test_compiled_blocks_with(run_dist, feature: str) -> None:
    for diff, graphs in run_dist(2, _compiled_with, feature):
        assert graphs >= 1
        assert diff <= FP32_TOL


def _compiled_bf16(rank: int, ws: int) -> dict[str, float]:
    """The same bf16 policy: compiled and eager fsdp_compose, and compiled torch fully_shard, after 3 steps."""
    results = {}
    trained = {}
    for name, mode, impl in [("compiled", "in_place", "fc"), ("eager", "eager", "fc"), ("torch", "in_place", "torch")]:
        model, reference = _build(mode, impl=impl, mesh=mesh_1d(ws), bf16=True)
        results[f"{name}_vs_reference"] = _train(model, reference, mesh_1d(ws))
        trained[name] = model
    results["compiled_vs_eager"] = _diff(trained["compiled"], trained["eager"])
    results["compiled_vs_torch"] = _diff(trained["compiled"], trained["torch"])
    return results


def test_compiled_blocks_with_bf16_mixed_precision(run_dist) -> None:
    for r in run_dist(2, _compiled_bf16):
        assert r["compiled_vs_reference"] <= BF16_TOL
        # Compiling changes nothing fsdp_compose does in bf16 (aot_eager runs the same ops: equal to eager), and
        # torch's fully_shard compiled the same way gets the same numbers.
        assert r["compiled_vs_eager"] <= FP32_TOL
        assert r["compiled_vs_torch"] <= FP32_TOL


# ----------------------------------------------------------------------------------------- 2x2 meshes (4 ranks)
def _compiled_on_2x2(rank: int, ws: int, layout: str) -> tuple[float, int]:
    if layout == "hsdp":
        dp_mesh = mesh_nd((2, 2), ("replicate", "shard"))
        model, reference = _build("in_place", mesh=dp_mesh)
    else:
        mesh = mesh_nd((2, 2), ("dp", "tp"))
        dp_mesh = mesh["dp"]
        model, reference = _build("in_place", mesh=dp_mesh, tp_mesh=mesh["tp"])
        # compile guards on DTensor parameters deep-copy their mesh: the groups fully_shard caches on it must copy
        # (and pickle) with it
        copy.deepcopy(mesh)
        pickle.loads(pickle.dumps(mesh))
    return _train(model, reference, dp_mesh), _compiled_graphs()


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_compiled_blocks_on_2x2_meshes(run_dist, layout: str) -> None:
    for diff, graphs in run_dist(4, _compiled_on_2x2, layout):
        assert graphs >= 1
        assert diff <= FP32_TOL


# ------------------------------------------------------------------------------------------- compiled autograd
def _under_compiled_autograd(rank: int, ws: int) -> tuple[str, float]:
    """Compiled autograd replays the backward hooks wrongly (wrong gradients, also with torch's fully_shard): the
    first backward hook refuses it before any collective, and the model trains normally afterwards."""
    model, reference = _build("in_place", mesh=mesh_1d(ws))
    inputs, targets = synthetic_batch(GPTConfig(), 8, 100)
    loss = loss_fn(model(inputs.chunk(ws)[rank]), targets.chunk(ws)[rank])
    message = ""
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=BACKEND)):
        try:
            loss.backward()
        except RuntimeError as exc:
            message = str(exc)
    fc.reset_step(model)  # reshards the root, so that the optimizer below gets the sharded parameters
    return message, _train(model, reference, mesh_1d(ws))


def test_compiled_autograd_is_refused_with_a_clear_error(run_dist) -> None:
    for message, diff in run_dist(2, _under_compiled_autograd):
        assert "compiled autograd" in message and "Turn compiled autograd off" in message
        assert diff <= FP32_TOL


# ------------------------------------------------------------------------------------------------ graph breaks
def _graph_breaks(rank: int, ws: int) -> dict[str, dict[str, int]]:
    """Per library and way of compiling: graph breaks and skipped frames in one training step, and the graphs."""
    found: dict[str, dict[str, int]] = {}
    inputs, targets = synthetic_batch(GPTConfig(), 2 * ws, 0)
    x, y = inputs.chunk(ws)[rank], targets.chunk(ws)[rank]
    for impl in ("fc", "torch"):
        for mode in ("in_place", "model"):
            model, _ = _build(mode, impl=impl, mesh=mesh_1d(ws))
            loss_fn(model(x), y).backward()
            found[f"{impl}/{mode}"] = {
                "breaks": sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values()),
                "graphs": _compiled_graphs(),
            }
        # One block on its own (sharded, not compiled): what dynamo makes of the unit's hooks around it.
        model, _ = _build("eager", impl=impl, mesh=mesh_1d(ws))
        loss_fn(model(x), y).backward()  # lazy init
        block = cast(nn.Module, model.blocks[0])
        explained = torch._dynamo.explain(block)(torch.randn(2, 13, 18, requires_grad=True))
        found[f"{impl}/explain"] = {"breaks": explained.graph_break_count, "graphs": explained.graph_count}
    return found


def test_no_more_graph_breaks_than_torch_fully_shard(run_dist) -> None:
    for found in run_dist(2, _graph_breaks):
        for key in ("in_place", "model", "explain"):
            ours, torch_own = found[f"fc/{key}"], found[f"torch/{key}"]
            assert ours["breaks"] <= torch_own["breaks"], (key, found)
            assert ours["graphs"] <= torch_own["graphs"], (key, found)
        # The block's forward is one graph, reused by every block (same code, parameters as graph inputs).
        assert found["fc/in_place"] == {"breaks": 0, "graphs": 1}
