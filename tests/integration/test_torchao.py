"""torchao 0.17 through fsdp_compose, side by side with torch's fully_shard on 2 gloo ranks, using torchao's own
conversion functions: NF4 QLoRA (``to_nf4`` frozen base weights + trainable LoRA, one unit per layer and the root) and
float8 training with float8 all-gather (``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True``,
``emulate=True`` on CPU) and ``precompute_float8_dynamic_scale_for_fsdp``. gloo has no float8 all-gather: torch's side
sends its all-gather as bytes through ``set_custom_all_gather`` (fsdp_compose always sends float8 as bytes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compose as fc
from tests.collective_bytes import CollectiveBytes
from tests.dist_utils import full_value, mesh_1d

pytest.importorskip("torchao")

DIM = 256  # NF4 quantizes blocks of 64 values and 256 scalers: a (256, 256) weight splits evenly over 2 or 4 ranks


class QLoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trainable low-rank adapter (the QLoRA recipe)."""

    def __init__(self, dim: int, rank: int = 8) -> None:
        from torchao.dtypes.nf4tensor import to_nf4

        super().__init__()
        base = nn.Linear(dim, dim, bias=False)
        self.weight = nn.Parameter(to_nf4(base.weight.detach().to(torch.bfloat16)), requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.dtypes.nf4tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = QLoRALinear(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.proj(self.norm(x)))


class QLoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, 8)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ByteAllGather:
    """torch's ``set_custom_all_gather`` hook that sends the all-gather as bytes (gloo has no float8 all-gather)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        return dist.all_gather_into_tensor(
            output_tensor.view(torch.uint8), input_tensor.view(torch.uint8), group=group, async_op=async_op
        )


def _batch(step: int, rank: int, ws: int, dim: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    x, y = torch.randn(8, dim, generator=g), torch.randn(8, out, generator=g)
    return x.chunk(ws)[rank], y.chunk(ws)[rank]


def _train(
    model: nn.Module, rank: int, ws: int, steps: int, dim: int, out: int, after_step: Any = None
) -> dict[str, Any]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, first_grads, counter = [], {}, CollectiveBytes()
    for step in range(steps):
        x, y = _batch(step, rank, ws, dim, out)
        if step == steps - 1:
            with counter:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        if step == 0:
            first_grads = {n: full_value(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
    return {"losses": losses, "grads": first_grads, "counts": counter.summary()}


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = full_value(t.detach())
    for attr in ("_tensor",):  # float8's weight wrapper
        t = getattr(t, attr, t)
    return t.float() if not hasattr(t, "get_original_weight") else t.get_original_weight().float()


def _compare(
    ours: dict[str, Any], theirs: dict[str, Any], our_model: nn.Module, their_model: nn.Module
) -> dict[str, Any]:
    grad_diff = max(
        ((ours["grads"][n] - theirs["grads"][n]).abs().max().item() for n in theirs["grads"]), default=float("nan")
    )
    assert set(ours["grads"]) == set(theirs["grads"]), (sorted(ours["grads"]), sorted(theirs["grads"]))
    theirs_params = dict(their_model.named_parameters())
    param_diff = max(
        (_plain(p) - _plain(theirs_params[n])).abs().max().item()
        for n, p in our_model.named_parameters()
        if p.requires_grad
    )
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)),
        "grad_diff": grad_diff,
        "param_diff": param_diff,
        "ours": ours["counts"],
        "theirs": theirs["counts"],
        "trained": sorted(ours["grads"]),
    }


def _shard_layers(model: nn.Module, layers: Any, shard: Any, mesh: Any, **kwargs: Any) -> None:
    for layer in layers:
        shard(layer, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)


def _qlora(rank: int, ws: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torchao.dtypes.nf4tensor import NF4Tensor

    mesh = mesh_1d(ws)
    ours, theirs = QLoRANet(), QLoRANet()
    _shard_layers(ours, ours.layers, fc.fully_shard, mesh)
    _shard_layers(theirs, theirs.layers, fully_shard, mesh)
    weight = ours.layers[0].proj.weight
    kept = isinstance(weight, DTensor) and isinstance(weight._local_tensor, NF4Tensor)
    result = _compare(_train(ours, rank, ws, 3, DIM, 8), _train(theirs, rank, ws, 3, DIM, 8), ours, theirs)
    result["kept_subclass"] = kept
    return result


def _assert_same_collectives(result: dict[str, Any]) -> None:
    """All-gathers and reduce-scatters per step: the same counts and bytes as torch's fully_shard."""
    for key in ("all_gather", "all_gather_bytes", "reduce_scatter", "reduce_scatter_bytes"):
        assert result["ours"][key] == result["theirs"][key], (key, result)


@pytest.mark.parametrize("ws", [2, 4])
def test_nf4_qlora_matches_torchs_fully_shard(run_dist, ws: int) -> None:
    for result in run_dist(ws, _qlora):
        assert result["kept_subclass"]
        assert all("lora" in n or "norm" in n for n in result["trained"]), result["trained"]
        assert result["loss_diff"] < 1e-5, result
        assert result["grad_diff"] < 1e-5, result
        assert result["param_diff"] < 1e-5, result
        _assert_same_collectives(result)


def _float8_net() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    return convert_to_float8_training(model, config=config)


def _float8_modules(model: nn.Module) -> int:
    """How many modules ``precompute_float8_dynamic_scale_for_fsdp`` finds (its own filter)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return sum(
        isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
        for m in model.modules()
    )


def _float8(rank: int, ws: int, precompute: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    mesh = mesh_1d(ws)
    ours, theirs = _float8_net(), _float8_net()
    layers = [0, 2, 4]
    _shard_layers(ours, [ours[i] for i in layers], fc.fully_shard, mesh)
    _shard_layers(theirs, [theirs[i] for i in layers], fully_shard, mesh)
    for i in layers:
        theirs[i].set_custom_all_gather(ByteAllGather())  # type: ignore[operator]
    found = (_float8_modules(ours), _float8_modules(theirs))
    hook = precompute_float8_dynamic_scale_for_fsdp if precompute else None
    result = _compare(_train(ours, rank, ws, 3, 64, 16, hook), _train(theirs, rank, ws, 3, 64, 16, hook), ours, theirs)
    result["found"] = found
    return result


@pytest.mark.parametrize("precompute", [False, True])
@pytest.mark.parametrize("ws", [2, 4])
def test_float8_all_gather_matches_torchs_fully_shard(run_dist, ws: int, precompute: bool) -> None:
    for result in run_dist(ws, _float8, precompute):
        assert result["found"] == (3, 3), result
        assert result["loss_diff"] < 1e-5, result
        assert result["grad_diff"] < 1e-5, result
        assert result["param_diff"] < 1e-5, result
        _assert_same_collectives(result)
