"""FSDP2's tensor-subclass protocol, per parameter: ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.

A parameter whose class defines both hooks (torchao's ``NF4Tensor`` and ``WeightWithDynamicFloat8CastTensor``, or your
own) is not copied into a unit's flat buffer: its shard is cut with the subclass's own ops and stays that subclass,
and every gather sends exactly what its pre-hook returns. The calls follow torch 2.13's ``FSDPParam``:

- **sharding** (at ``fully_shard`` and when the unit re-adopts it): ``torch.chunk(param, world_size, dim=0)`` (the
  subclass's ``split``), a padded shard ``param.new_zeros(chunks[0].shape)`` with this rank's chunk copied into its
  first rows (``narrow(0, 0, rows).copy_``), and the local shard ``padded.narrow(0, 0, rows)``: the sharded parameter
  is ``nn.Parameter(DTensor(local))`` with placement ``Shard(0)``.
- **pre-hook**, before every all-gather, on the local shard: ``fsdp_pre_all_gather(mesh, outer_size, outer_stride,
  module, mp_policy)`` (or ``fsdp_pre_all_gather(mesh)`` when it takes one argument) with the shard mesh, the full
  size and contiguous stride, the module holding the parameter and a ``torch.distributed.fsdp.MixedPrecisionPolicy``;
  it returns ``(all_gather_inputs, metadata)``. When the shard is shorter than the padded size (uneven sharding) the
  inputs must have the padded size.
- **post-hook**, after the all-gather, with the gathered inputs ``(world_size * rows, ...)``, the metadata and the
  compute dtype (``param_dtype`` or the parameter's own): the first gather calls it without ``out`` and keeps what it
  returns, ``(unsharded, inner_tensors)``; the unsharded parameter is ``nn.Parameter(unsharded)``. Later gathers
  refill the kept all-gather outputs and inner tensors (freed to 0 bytes between gathers) and call it with
  ``out=unsharded_param``.

The unit's other parameters and these inputs go in one all-gather (see ``full_params.py``). Nothing here
communicates except what a pre-hook does itself (float8's dynamic scale all-reduces its amax over ``mesh``).

Like torch's ``fully_shard``, which reads the hooks again at its lazy init ("allow monkey patch after init"), a unit
reads them once more just before its first all-gather (``FlatShard.read_hooks``): hooks attached to a local
shard after ``fully_shard`` are used, and a tensor subclass without hooks at ``fully_shard`` (sharded its own way
until then) becomes a protocol parameter if it has them by then, else a plain parameter of the flat buffer.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .sharding import chunk_rows, padded_rows

__all__ = [
    "SubclassShard",
    "carry_instance_hooks",
    "check_hooks_added",
    "check_subclass_param",
    "has_fsdp_hooks",
    "is_tensor_subclass",
    "shard_mesh",
    "shard_subclass",
    "torch_mp_policy",
]

_HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def has_fsdp_hooks(tensor: object) -> bool:
    """Whether ``tensor``'s class implements FSDP2's all-gather protocol (either hook: both are then required)."""
    return hasattr(tensor, "fsdp_pre_all_gather") or hasattr(tensor, "fsdp_post_all_gather")


def is_tensor_subclass(tensor: torch.Tensor) -> bool:
    """A tensor subclass that holds its data in inner tensors (torch's traceable wrapper subclass: NF4, float8), which
    must be sharded its own way. Tensors that only stand for a plain one while tracing or simulating (FakeTensor,
    FunctionalTensor) are not: they do not flatten into inner tensors."""
    return is_traceable_wrapper_subclass(tensor)


def check_subclass_param(
    fqn: str, param: torch.Tensor, owner_name: str, shard_dim: int, *, hooks_required: bool = True
) -> None:
    """Raise (before ``fully_shard`` changes anything) for a protocol parameter this library cannot shard.

    ``hooks_required=False``: a tensor subclass without the hooks yet (they may be attached before the first
    gather): the checks on its shape and placement only."""
    name = type(param._local_tensor if isinstance(param, DTensor) else param).__name__
    where = f"parameter '{fqn}' of {owner_name} ({name})"
    if hooks_required and not (hasattr(param, "fsdp_pre_all_gather") and hasattr(param, "fsdp_post_all_gather")):
        raise TypeError(
            f"{where} defines only one of fsdp_pre_all_gather / fsdp_post_all_gather; FSDP2's tensor-subclass "
            "protocol needs both (the pre-hook's outputs are what the all-gather sends, the post-hook builds the "
            "unsharded parameter from them)"
        )
    if isinstance(param, DTensor):
        raise NotImplementedError(
            f"{where} is a DTensor (tensor parallel) whose local tensor uses FSDP2's all-gather hooks; "
            "fsdp_compose supports the protocol on plain (non-DTensor) parameters only: apply tensor parallelism "
            "without the subclass, or shard this module with torch's fully_shard"
        )
    if param.ndim == 0:
        raise ValueError(f"{where} is 0-dim: the all-gather protocol needs a dim 0 to shard")
    if shard_dim != 0:
        raise NotImplementedError(
            f"{where}: shard_placement_fn chose Shard({shard_dim}); parameters using FSDP2's all-gather hooks are "
            "sharded on dim 0 only (return None or Shard(0) for them)"
        )
    if not param.is_contiguous():
        raise ValueError(f"{where} is not contiguous; FSDP2's protocol shards contiguous parameters")
    if not hooks_required:
        return
    pre = inspect.signature(param.fsdp_pre_all_gather)  # type: ignore[attr-defined]
    if len(pre.parameters) not in (1, 5):
        raise TypeError(
            f"{where}: fsdp_pre_all_gather{pre} has {len(pre.parameters)} parameters; torch 2.13's protocol calls "
            "fsdp_pre_all_gather(mesh) or fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)"
        )
    post = inspect.signature(param.fsdp_post_all_gather)  # type: ignore[attr-defined]
    if "out" not in post.parameters:
        raise TypeError(
            f"{where}: fsdp_post_all_gather{post} takes no out= argument; torch 2.13's protocol refills the "
            "unsharded parameter in place with fsdp_post_all_gather(outputs, metadata, param_dtype, out=param)"
        )


def check_hooks_added(
    owner_name: str,
    added: list[tuple[str, torch.Tensor, int, bool]],
    *,
    mesh: DeviceMesh,
    offloaded: bool,
    all_gather_extension: bool,
    group_reshard: bool,
) -> None:
    """Raise, before the unit changes, for hooks attached to local shards since ``fully_shard`` (``added``: fqn, local
    shard, shard dim, whether the parameter is tensor parallel or placed with ``dp_mesh_dims``) that the unit's
    settings cannot serve: the checks ``fully_shard`` makes on protocol parameters."""
    fqns = ", ".join(repr(fqn) for fqn, _, _, _ in added[:4])
    what = f"FSDP2's all-gather hooks attached after fully_shard to {fqns}"
    if not added:
        return
    for fqn, local, dim, spmd in added:
        if spmd:
            raise NotImplementedError(
                f"parameter '{fqn}' of {owner_name}: {what}; fsdp_compose supports the protocol on plain "
                "parameters only (not tensor parallel, not dp_mesh_dims): attach them before sharding another way, or "
                "shard this module with torch's fully_shard"
            )
        check_subclass_param(fqn, local, owner_name, dim)
    if group_reshard:
        raise NotImplementedError(
            f"{owner_name}: {what}, with reshard_after_forward=<int> (a group size); use True or False"
        )
    if all_gather_extension:
        raise NotImplementedError(
            f"{owner_name}: {what}, with an all_gather extension (it encodes one flat buffer); drop one of them"
        )
    if offloaded:
        raise NotImplementedError(f"{owner_name}: {what}, with CPU offload; use OffloadPolicy()")
    if mesh.ndim > 1 and mesh.mesh_dim_names is None:
        raise ValueError(
            f"{owner_name}: {what}, on a 2-D (HSDP) mesh without mesh_dim_names (their pre-hook receives the shard "
            "dim's mesh); build the mesh with init_device_mesh(..., mesh_dim_names=...)"
        )


def carry_instance_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Hooks attached to the instance ``old`` (not its class), carried to ``new``, a copy of it that replaces it
    as a parameter's local shard: a method bound to ``old`` is bound to ``new`` (its ``self`` is the shard it must
    read); other callables are carried as they are."""
    for name in _HOOKS:
        hook = old.__dict__.get(name)
        if hook is None:
            continue
        if isinstance(hook, types.MethodType) and hook.__self__ is old:
            hook = types.MethodType(hook.__func__, new)
        new.__dict__[name] = hook


def shard_subclass(
    value: torch.Tensor, full_shape: torch.Size, rank: int, world_size: int, *, is_full: bool
) -> tuple[torch.Tensor, int]:
    """This rank's shard of a protocol tensor, cut with its own ops: (padded shard, real rows).

    ``value`` is the full tensor (``is_full``) or this rank's unpadded shard of it.
    """
    padded_size = torch.Size((padded_rows(full_shape[0], world_size), *full_shape[1:]))
    rows = chunk_rows(full_shape[0], world_size)[rank]
    with torch.no_grad():
        if is_full:
            chunks = torch.chunk(value, world_size, dim=0)
            chunk = chunks[rank] if rank < len(chunks) else None
        else:
            chunk = value
        padded = value.new_zeros(padded_size)
        if chunk is not None and rows > 0:
            padded.narrow(0, 0, rows).copy_(chunk)
    return padded, rows


@dataclass
class SubclassShard:
    """One protocol parameter's state across gathers (what ``FSDPParam`` keeps for extensions)."""

    padded: torch.Tensor  # the padded shard (the subclass): the local shard is its first ``rows`` rows
    rows: int
    full_shape: torch.Size  # the TP-local (here: global) shape FSDP shards
    metadata: Any = None  # what the last pre-hook returned next to its inputs
    input_sizes: list[torch.Size] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)  # kept all-gather outputs, freed between gathers
    inner: list[torch.Tensor] = field(default_factory=list)  # the post-hook's inner tensors, freed likewise
    unsharded: nn.Parameter | None = None

    def local(self) -> torch.Tensor:
        return self.padded.narrow(0, 0, self.rows)

    def padded_rows(self, world_size: int) -> int:
        return padded_rows(self.full_shape[0], world_size)

    def all_gather_inputs(
        self, local: torch.Tensor, mesh: DeviceMesh, module: nn.Module, mp_policy: torch_fsdp.MixedPrecisionPolicy
    ) -> list[torch.Tensor]:
        """Call the pre-hook on the local shard; its inputs, flattened (what the all-gather sends)."""
        hook: Any = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        stride = tuple(torch.empty(self.full_shape, device="meta").stride())
        if len(inspect.signature(hook).parameters) == 1:
            inputs, self.metadata = hook(mesh)
        else:
            inputs, self.metadata = hook(mesh, self.full_shape, stride, module, mp_policy)
        world_size = mesh.size()
        padded = torch.Size((self.padded_rows(world_size), *self.full_shape[1:]))
        if local.shape != padded and any(t.shape != padded for t in inputs):
            raise RuntimeError(
                f"fsdp_pre_all_gather of {type(local).__name__} (full size {tuple(self.full_shape)}, "
                f"{world_size} ranks) must return all-gather inputs of the padded shard size {tuple(padded)}, got "
                f"{[tuple(t.shape) for t in inputs]}"
            )
        self.input_sizes = [t.shape for t in inputs]
        return [t.contiguous().view(-1) for t in inputs]

    def output_buffers(
        self, dtypes: list[torch.dtype], numels: list[int], world_size: int, device: torch.device
    ) -> list[torch.Tensor]:
        """The all-gather outputs of this parameter's inputs, kept across gathers (storage reallocated)."""
        if not self.outputs:
            self.outputs = [
                torch.empty(world_size * n, dtype=d, device=device) for d, n in zip(dtypes, numels, strict=True)
            ]
        for t in self.outputs:
            _allocate(t)
        return self.outputs

    def unshard(self, local: torch.Tensor, param_dtype: torch.dtype, requires_grad: bool) -> nn.Parameter:
        """Call the post-hook on the filled outputs: the unsharded parameter (built once, refilled after)."""
        outputs = tuple(t.view(-1, *size[1:]) for t, size in zip(self.outputs, self.input_sizes, strict=True))
        hook: Any = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        if self.unsharded is not None:
            for t in self.inner:
                _allocate(t)
            hook(outputs, self.metadata, param_dtype, out=self.unsharded)
            self.metadata = None
            return self.unsharded
        unsharded, inner = hook(outputs, self.metadata, param_dtype)
        self.metadata = None
        self.inner = list(inner)
        stride = tuple(torch.empty(self.full_shape, device="meta").stride())
        self.unsharded = nn.Parameter(
            torch.as_strided(unsharded, self.full_shape, stride, storage_offset=0), requires_grad=requires_grad
        )
        return self.unsharded

    def free(self) -> None:
        for t in (*self.outputs, *self.inner):
            storage = t.untyped_storage()
            if storage.size() != 0:
                storage.resize_(0)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh a pre-hook receives: the shard dim of the data-parallel mesh (torch's ``shard_mesh_from_root``)."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    assert names is not None, "fully_shard refuses protocol parameters on an unnamed 2-D mesh"
    return mesh[names[-1]]


def _allocate(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    needed = tensor.numel() * tensor.element_size()
    if storage.size() < needed:
        storage.resize_(needed)


def torch_mp_policy(
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None,
    cast_forward_inputs: bool,
) -> torch_fsdp.MixedPrecisionPolicy:
    """The policy object a pre-hook receives (torch's class, as under torch's ``fully_shard``)."""
    return torch_fsdp.MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        output_dtype=output_dtype,
        cast_forward_inputs=cast_forward_inputs,
    )
