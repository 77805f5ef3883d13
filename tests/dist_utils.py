"""Helpers for test bodies that run inside pool workers: meshes, the reference GPT and comparisons."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch

# One mesh per shape for the life of a worker process: building a new mesh per test leaks process groups.
_MESHES: dict[tuple[Any, ...], DeviceMesh] = {}


def mesh_1d(world_size: int) -> DeviceMesh:
    key = (world_size,)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", (world_size,))
    return _MESHES[key]


def mesh_nd(shape: tuple[int, ...], names: tuple[str, ...] | None) -> DeviceMesh:
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def shard_gpt(model: GPT, mesh: DeviceMesh, **kwargs: Any) -> GPT:
    """The torchtitan recipe: every block, then the root."""
    for block in model.blocks:
        fc.fully_shard(block, mesh=mesh, **kwargs)
    fc.fully_shard(model, mesh=mesh, **kwargs)
    return model


def full_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_param_diff(model: nn.Module, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        worst = max(worst, (full_value(param.detach()) - full_value(ref[name].detach())).abs().max().item())
    return worst


def local_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return batch.chunk(world_size)[rank]


OptFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def make_optimizer(kind: str) -> OptFactory:
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(kind)


def train_pair(
    rank: int,
    world_size: int,
    model: nn.Module,
    reference: nn.Module,
    cfg: GPTConfig,
    *,
    steps: int = 3,
    optimizer: str = "sgd",
    batch_size: int = 4,
    micro_batches: int = 1,
) -> float:
    """Train the sharded ``model`` on this rank's slice and ``reference`` on the whole global batch; max |diff|.

    With ``micro_batches > 1`` the sharded model accumulates under ``fc.no_sync`` and syncs on the last one; the
    reference sees the same global batch in one step (the losses are scaled so the gradients agree).
    """
    opt = make_optimizer(optimizer)(model.parameters())
    ref_opt = make_optimizer(optimizer)(reference.parameters())
    for step in range(steps):
        inputs, targets = synthetic_batch(cfg, batch_size, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()

        opt.zero_grad()
        local_in = local_batch(inputs, rank, world_size)
        local_tg = local_batch(targets, rank, world_size)
        for micro, (mi, mt) in enumerate(
            zip(local_in.chunk(micro_batches), local_tg.chunk(micro_batches), strict=True)
        ):
            last = micro == micro_batches - 1
            ctx = fc.no_sync(model) if not last else _nullcontext()
            with ctx:
                (loss_fn(model(mi), mt) / micro_batches).backward()
        opt.step()
    return max_param_diff(model, reference)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def reference_and_copy(cfg: GPTConfig, seed: int = 0) -> tuple[GPT, GPT]:
    torch.manual_seed(seed)
    reference = GPT(cfg)
    return reference, copy.deepcopy(reference)


def tp_mlps(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Tensor parallel MLPs in every block: fc column-wise, proj row-wise."""
    for block in model.blocks:
        parallelize_module(block.mlp, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


def dp_slice(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    return batch.chunk(dp_size)[dp_rank]


def dp_coordinates(dp_mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this rank among all data-parallel ranks (replicate-major)."""
    if dp_mesh.ndim == 1:
        return dp_mesh.get_local_rank(0), dp_mesh.size(0)
    return dp_mesh.get_local_rank(0) * dp_mesh.size(1) + dp_mesh.get_local_rank(1), dp_mesh.size()


def train_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    dp_mesh: DeviceMesh,
    steps: Iterable[int],
    cfg: GPTConfig | None = None,
) -> float:
    """``model`` on this rank's data-parallel slice (TP peers share it), ``reference`` on the global batch of 8, for
    the given step numbers (each selects its batch); max |diff| of the parameters."""
    cfg = cfg or GPTConfig()
    dp_rank, dp_size = dp_coordinates(dp_mesh)
    for step in steps:
        inputs, targets = synthetic_batch(cfg, 8, step)
        ref_opt.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        ref_opt.step()
        opt.zero_grad()
        loss_fn(model(dp_slice(inputs, dp_rank, dp_size)), dp_slice(targets, dp_rank, dp_size)).backward()
        opt.step()
    return max_param_diff(model, reference)


def train_on_dp_mesh(
    model: nn.Module, reference: nn.Module, cfg: GPTConfig, dp_mesh: DeviceMesh, steps: int = 3
) -> float:
    """SGD with momentum, ``steps`` steps of ``train_steps``."""
    opt = make_optimizer("sgd")(model.parameters())
    ref_opt = make_optimizer("sgd")(reference.parameters())
    return train_steps(model, opt, reference, ref_opt, dp_mesh, range(steps), cfg)


@contextlib.contextmanager
def watching_reduce_scatters(
    on_issue: Callable[[Any, torch.Tensor], None], on_wait: Callable[[Any], None]
) -> Iterator[None]:
    """Inside: ``on_issue(work, input)`` after each asynchronous reduce-scatter call, ``on_wait(work)`` before each
    ``Work.wait()``. The library looks its collectives up in ``torch.distributed`` at call time, so it meets these."""
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    issue, wait = getattr(dist, name), dist.Work.wait

    def issuing(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = issue(output, input, *args, **kwargs)
        if work is not None:
            on_issue(work, input)
        return work

    def waiting(work: Any, *args: Any, **kwargs: Any) -> Any:
        on_wait(work)
        return wait(work, *args, **kwargs)

    setattr(dist, name, issuing)
    dist.Work.wait = waiting  # type: ignore[method-assign]
    try:
        yield
    finally:
        setattr(dist, name, issue)
        dist.Work.wait = wait  # type: ignore[method-assign]
