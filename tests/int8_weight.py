"""A small tensor subclass implementing FSDP2's all-gather protocol, for tests: an fp32 master weight that is
all-gathered as int8 values plus one fp32 scale per row, and used dequantized (so training differs measurably from
training on the fp32 weights: a library that ignored the hooks would not match torch's fully_shard).

It follows the pattern of torchao's ``WeightWithDynamicFloat8CastTensor``: a wrapper subclass whose
``__torch_dispatch__`` unwraps to the master tensor and keeps the subclass on the ops FSDP uses to shard and pad it.
``calls`` counts the hook calls per instance kind (pre/post/post with out=) for the tests.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import torch
import torch.utils._pytree as pytree

calls: Counter[str] = Counter()
seen_args: list[tuple[Any, ...]] = []

_KEEP = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
}


class Wrapper(torch.Tensor):
    """A wrapper subclass over a master tensor, kept on the ops FSDP shards and pads with (no FSDP hooks)."""

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[no-any-return]
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._tensor})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = pytree.tree_map_only(Wrapper, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_tensor"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> Wrapper:
        return cls(inner["_tensor"])


class PreHookOnly(Wrapper):
    """Defines only the pre-hook: refused."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        return (self._tensor,), None


def int8_pre_all_gather(
    self: torch.Tensor, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """The int8 pre-hook on any shard ``self`` (an ``Int8Weight``, or a plain tensor it was attached to)."""
    calls["pre"] += 1
    seen_args.append((mesh, tuple(outer_size), tuple(outer_stride), type(module).__name__, mp_policy))
    w = self._tensor.detach() if isinstance(self, Wrapper) else self.detach()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
    data = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return (data, scale), None


def int8_post_all_gather(
    self: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    data, scale = outputs
    if out is not None:
        calls["post_out"] += 1
        out.data.copy_(data.to(param_dtype) * scale.to(param_dtype))
        return None
    calls["post"] += 1
    value = data.to(param_dtype) * scale.to(param_dtype)
    return value, (value,)


class Int8Weight(Wrapper):
    """fp32 master weight; all-gathered as int8 + per-row fp32 scale."""

    fsdp_pre_all_gather = int8_pre_all_gather
    fsdp_post_all_gather = int8_post_all_gather


def attach_int8_hooks(local: torch.Tensor) -> None:
    """The int8 hooks attached to one tensor (a parameter's local shard), as torch's monkey-patch test does."""
    local.fsdp_pre_all_gather = types.MethodType(int8_pre_all_gather, local)  # type: ignore[attr-defined]
    local.fsdp_post_all_gather = types.MethodType(int8_post_all_gather, local)  # type: ignore[attr-defined]


def int8_linears(module: torch.nn.Module) -> None:
    """Swap every Linear weight for an ``Int8Weight`` parameter (in place, before sharding)."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            sub.weight = torch.nn.Parameter(Int8Weight(sub.weight.detach().clone()), requires_grad=True)
