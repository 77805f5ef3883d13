"""Full (unsharded) state dicts: gather to plain tensors, and load plain tensors into a sharded module.

``module.state_dict()`` already returns the sharded DTensors (no communication) and works with
``torch.distributed.checkpoint`` for saving on N ranks and loading on M. These two functions are for the other
direction: a consolidated checkpoint (e.g. for export or for a Hugging Face-style file) and loading one that only
the first rank read from disk.

``full_weights`` is the gather of both: an iterator over the entries, one all-gather per unit (``full_state_dict``
collects it), for an inference engine fed one unit at a time.

Both communicate on the *module's mesh*: the mesh of its sharded parameters that contains the ranks of all the
others (the data-parallel mesh; for FSDP + TP the combined (dp, tp) mesh). Its first rank (coordinate 0 on every
dim) is "rank 0" of ``rank0_only`` and ``broadcast_from_rank0``: global rank 0 for a model sharded over the whole
world, the stage's first rank for a pipeline stage on a sub-mesh. The default process group is never used.
Both are written here, not through torch's distributed state-dict API, for those semantics (the comments in each
function say where it differs).

``load_full_state_dict`` is atomic: every rank validates what it can see (its module everywhere, the checkpoint on
the ranks that read it), one small all-reduce over the mesh agrees on the verdict, and only then does anything get
written. A problem on any rank raises the same error on every rank, naming the key, with nothing loaded anywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .offload import collective_device
from .state import check_between_steps, states_under

if TYPE_CHECKING:
    from .state import ShardState

__all__ = ["full_state_dict", "full_weights", "load_full_state_dict"]

# The agreed error message travels as a fixed-size byte tensor (only when something is wrong).
_MESSAGE_BYTES = 4096
_KEYS_LISTED = 8


def full_state_dict(module: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Plain tensors equal to the unsharded module's ``state_dict()``, gathered unit by unit (``full_weights``).

    Every rank of the module's mesh must call it, between steps. With ``rank0_only`` only the mesh's first rank keeps
    the result (the others get an empty dict), and with ``cpu_offload`` each tensor is moved to CPU as it comes, so
    at most one unit's full parameters per rank are on the device at once.
    """
    _check_module(module, "fc.full_state_dict")
    _check_flag(cpu_offload, "cpu_offload", "fc.full_state_dict")
    # Not torch's get_model_state_dict (DSD): one all-gather per unit instead of one per entry, the copies kept on the
    # mesh's first rank only with rank0_only (a pipeline stage's, never every rank's), and the keys of wrapped
    # submodules (torch.compile's "_orig_mod.", DDP's "module.") kept as state_dict() has them, which
    # load_full_state_dict takes back.
    stream = _full_weights(module, "fc.full_state_dict", dtype=None, rank0_only=rank0_only, bucket_bytes=0)
    gathered = {key: (value.cpu() if cpu_offload else value) for key, value in stream}
    return {key: gathered[key] for key in module.state_dict(keep_vars=True) if key in gathered}  # state_dict()'s order


def full_weights(
    module: nn.Module, *, dtype: torch.dtype | None = None, rank0_only: bool = False, bucket_bytes: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every entry of the unsharded module's ``state_dict()``, gathered unit by unit: one
    all-gather per unit (a TP-sharded parameter's ``full_tensor()`` over its TP dims on top), for an inference
    engine's ``load_weights`` or ``model.load_state_dict``. Each tensor is a fresh copy, valid after the unit
    reshards.

    ``dtype``: floating-point entries come in it, each unit's shards cast before its all-gather (bf16 moves half the
    bytes); None: their own dtype. ``rank0_only``: only the first rank of the module's mesh gets tensors, the others
    iterate to the end all the same (they take part in every all-gather). ``bucket_bytes``: units are all-gathered
    together until their full parameters reach it, then handed out in order (the extra peak is that bucket, which
    its last unit may overfill, and the copy being handed out); 0: one unit at a time. HSDP gathers within each
    replica only. A tied parameter is gathered once and handed out under each of its keys (the same tensor). Every
    rank of the mesh iterates to the end, between steps.
    """
    return _full_weights(module, "fc.full_weights", dtype=dtype, rank0_only=rank0_only, bucket_bytes=bucket_bytes)


def _full_weights(
    module: nn.Module, function: str, *, dtype: torch.dtype | None, rank0_only: bool, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``full_weights``' checks, all before any collective, then its generator."""
    _check_module(module, function)
    _check_flag(rank0_only, "rank0_only", function)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{function}: dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"{function}: bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    states = states_under(module)
    check_between_steps(states, function)
    for state in states:
        if state.host is not None:
            raise RuntimeError(
                f"{function} of {type(module).__name__}: unit {state.params.owner_name} is in host memory "
                "(fc.move_to_host); call fc.move_to_device(model) first"
            )
    entries = module.state_dict(keep_vars=True)  # every unit resharded first (its state-dict pre-hook)
    mesh = _ModuleMesh.of(module, entries, function)
    for key, value in entries.items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise ValueError(
                f"{function} of {type(module).__name__}: '{key}' is on the meta device (no values yet); "
                "materialize the module first: module.to_empty(device=...) and initialize or load it"
            )
    return _stream(states, entries, dtype, not rank0_only or mesh.is_first_rank(), bucket_bytes)


def _stream(
    states: list[ShardState], entries: dict[str, torch.Tensor], dtype: torch.dtype | None, keep: bool, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    keys_of: dict[int, list[str]] = {}  # id(the parameter or buffer) -> its keys (a tied parameter: several)
    for key, value in entries.items():
        keys_of.setdefault(id(value), []).append(key)
    handed: set[str] = set()
    bucket: list[ShardState] = []
    filled = 0
    try:
        for state in states:
            own = state.params.shards.dtype
            state.start_gather(async_op=True, dtype=dtype or own, after_writes=True)
            bucket.append(state)
            filled += sum(mp.sharded.numel() for mp in state.params.shards.params) * (dtype or own).itemsize
            if filled >= bucket_bytes:
                yield from _hand_out(bucket, keys_of, handed, dtype, keep)
                bucket, filled = [], 0
        yield from _hand_out(bucket, keys_of, handed, dtype, keep)
        # What no unit holds: buffers, ignored parameters, those torch's replicate() manages.
        for key, value in entries.items():
            if key not in handed:
                if isinstance(value, DTensor):
                    value = cast(DTensor, value.detach().to(collective_device(value))).full_tensor()
                if keep:
                    yield key, _copy(value.detach(), dtype)
    finally:
        for state in bucket:  # the consumer stopped (or raised) inside a bucket
            state.params.reshard()


def _hand_out(
    bucket: list[ShardState],
    keys_of: dict[int, list[str]],
    handed: set[str],
    dtype: torch.dtype | None,
    keep: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each unit of the bucket in order: its full parameters copied out under their keys, then resharded."""
    for state in bucket:
        params = state.params
        params.finish()
        for mp in params.shards.params:
            keys = keys_of.get(id(mp.sharded), [])
            handed.update(keys)
            if not keys:
                continue  # a parameter of the unit outside ``module`` (a unit over several modules)
            # A protocol parameter's unsharded form is its own (NF4, float8): the DTensor's full_tensor() instead.
            value = mp.sharded.full_tensor() if mp.subclass is not None else mp.full_data
            if isinstance(mp.full, DTensor):
                value = mp.full.detach().full_tensor()  # FSDP + TP: the TP dims on top
            if keep and value is not None:
                tensor = _copy(value.detach(), dtype)
                for key in keys:
                    yield key, tensor
        params.reshard()


def _copy(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    target = dtype if dtype is not None and value.is_floating_point() else value.dtype
    return value.to(dtype=target, copy=True)


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, broadcast_from_rank0: bool = False
) -> None:
    """Load a full (unsharded) state dict into a sharded module: each rank keeps its own rows.

    Every rank of the module's mesh must call it. With ``broadcast_from_rank0`` only the mesh's first rank needs
    ``state_dict`` (the others pass ``{}``; theirs is ignored) and tensors are broadcast one at a time, already in
    the module's dtype.

    Checked before anything is written, on every rank, the verdict agreed over the mesh: the keys match the
    module's; every value is a plain tensor (not a DTensor, not on 'meta') of the entry's shape; dtypes match, or
    both are floating point (or both complex) and the value is cast as ``nn.Module.load_state_dict`` casts it; the
    module itself is materialized; every rank calls with the same model and the same ``broadcast_from_rank0``. On a
    problem every rank raises the same ``ValueError`` / ``TypeError`` naming the key, and no rank changed anything.
    """
    owner = type(module).__name__ if isinstance(module, nn.Module) else ""
    _check_module(module, "fc.load_full_state_dict")
    _check_flag(broadcast_from_rank0, "broadcast_from_rank0", "fc.load_full_state_dict")
    targets = module.state_dict()
    mesh = _ModuleMesh.of(module, targets, "fc.load_full_state_dict")
    source = mesh.is_first_rank()
    param_keys = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    problem = _check_targets(targets, mesh.mesh)
    if problem is None and (source or not broadcast_from_rank0):
        problem = _check_state_dict(state_dict, targets, param_keys)
    mesh.agree(problem, _fingerprint(targets, broadcast_from_rank0), f"fc.load_full_state_dict into {owner}")

    # Everything is validated on every rank: from here on the module changes. Not through torch's set_model_state_dict:
    # its broadcast_from_rank0 broadcasts on the default group from global rank 0 (a pipeline stage's mesh is
    # neither); without it, distribute_tensor scatters each entry from the mesh's first rank although every rank holds
    # it; it takes one device for all entries (CPU-offloaded shards beside device buffers are refused) and it writes
    # the module's tensors into the caller's dict.
    with torch.no_grad():
        for key, target in targets.items():
            if broadcast_from_rank0:
                full = mesh.broadcast_entry(state_dict[key] if source else None, target)
            else:
                full = state_dict[key]
            if isinstance(target, DTensor):
                target.to_local().copy_(_local_piece(full, target))
            else:
                target.copy_(full)


# ---------------------------------------------------------------------- the module's mesh
@dataclass(frozen=True)
class _ModuleMesh:
    """The mesh a module's full state dict is gathered and broadcast on, and its few collectives.

    A multi-dimensional mesh (HSDP, FSDP + TP) has one process group per dim and none spanning it all: an all-reduce
    runs along each dim in turn, and a broadcast from one rank runs along each dim from the last to the first (after
    the step on dim d every rank that agrees with the source on dims < d has the data).
    """

    mesh: DeviceMesh
    device: torch.device

    @classmethod
    def of(cls, module: nn.Module, entries: Mapping[str, object], function: str) -> _ModuleMesh:
        """The mesh of ``module``'s DTensors that contains the ranks of all the others (raises before any
        collective when there is none, or when this rank is not in it)."""
        by_id = {id(v.device_mesh): v.device_mesh for v in entries.values() if isinstance(v, DTensor)}
        meshes = list(by_id.values())
        name = type(module).__name__
        if not meshes:
            raise ValueError(
                f"{function}: no entry of this {name}'s state_dict is sharded (no DTensor); call fc.fully_shard on "
                "it first, or use module.state_dict() / module.load_state_dict() for an unsharded module"
            )
        rank_sets = [frozenset(m.mesh.flatten().tolist()) for m in meshes]
        union = frozenset().union(*rank_sets)
        covering = [m for m, ranks in zip(meshes, rank_sets, strict=True) if ranks == union]
        if not covering:
            listing = ", ".join(str(sorted(ranks)) for ranks in dict.fromkeys(rank_sets))
            raise ValueError(
                f"{function}: the sharded entries of this {name} live on meshes over the ranks {listing}, and none "
                "of them contains all the others; call it on a module sharded on one mesh (e.g. one pipeline stage)"
            )
        mesh = max(covering, key=lambda m: m.ndim)
        if mesh.get_coordinate() is None:
            raise ValueError(
                f"{function}: this rank ({dist.get_rank()}) is not part of the mesh of this {name} (ranks "
                f"{sorted(union)}); call it on those ranks only"
            )
        return cls(mesh, torch.device(mesh.device_type))

    @property
    def first_rank(self) -> int:
        return int(self.mesh.mesh.flatten()[0].item())

    def is_first_rank(self) -> bool:
        return dist.get_rank() == self.first_rank

    def _all_reduce_max(self, tensor: torch.Tensor) -> None:
        for dim in range(self.mesh.ndim):
            if self.mesh.size(dim) > 1:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.mesh.get_group(dim))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        source = [int(i) for i in (self.mesh.mesh == src).nonzero()[0].tolist()]
        mine = self.mesh.get_coordinate()
        if mine is None:  # checked in of(); kept for the type checker
            raise RuntimeError(f"rank {dist.get_rank()} is not part of the mesh {self.mesh}")
        for dim in reversed(range(self.mesh.ndim)):
            if self.mesh.size(dim) == 1:
                continue
            index = list(mine)
            index[dim] = source[dim]
            sender = int(self.mesh.mesh[tuple(index)].item())
            dist.broadcast(tensor, src=sender, group=self.mesh.get_group(dim))

    def agree(self, problem: _Problem | None, fingerprint: int, what: str) -> None:
        """One all-reduce of three integers over the mesh: raise the same error on every rank if any rank found a
        problem (the first such rank's message, broadcast from it) or if the ranks' fingerprints differ."""
        world, rank = dist.get_world_size(), dist.get_rank()
        verdict = torch.tensor(
            [world - rank if problem is not None else 0, fingerprint, -fingerprint],
            dtype=torch.int64,
            device=self.device,
        )
        self._all_reduce_max(verdict)
        failing_code, highest, minus_lowest = (int(v) for v in verdict.tolist())
        if highest != -minus_lowest:
            raise ValueError(
                f"{what}: the ranks of its mesh disagree on the module's state-dict entries (keys, shapes, dtypes) "
                "or on broadcast_from_rank0; every rank must call it on the same model with the same arguments. "
                "Nothing was loaded"
            )
        if failing_code == 0:
            return
        failing = world - failing_code
        message = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        if problem is not None and rank == failing:
            encoded = problem.encode(f"{what}: ", f" (found on rank {failing}; nothing was loaded on any rank)")
            message[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        self._broadcast(message, failing)
        raise _Problem.decode(bytes(message.cpu().tolist())).error()

    def broadcast_entry(self, value: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
        """``value`` (given on the first rank only) on every rank, in ``target``'s dtype and shape."""
        if value is not None:
            full = value.to(device=self.device, dtype=target.dtype).contiguous()
        else:
            full = torch.empty(target.shape, dtype=target.dtype, device=self.device)
        self._broadcast(full, self.first_rank)
        return full


# ---------------------------------------------------------------------- validation
_KINDS: tuple[type[Exception], ...] = (ValueError, TypeError)


@dataclass(frozen=True)
class _Problem:
    kind: type[Exception]
    message: str

    def encode(self, prefix: str, suffix: str) -> bytes:
        tail = suffix.encode()
        body = (prefix + self.message).encode()[: _MESSAGE_BYTES - 1 - len(tail)]
        return bytes([_KINDS.index(self.kind)]) + body + tail

    @staticmethod
    def decode(data: bytes) -> _Problem:
        return _Problem(_KINDS[data[0]], data[1:].rstrip(b"\0").decode(errors="replace"))

    def error(self) -> Exception:
        return self.kind(self.message)


def _check_module(module: object, function: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{function} takes the sharded nn.Module first, got {type(module).__name__}")


def _check_flag(value: object, name: str, function: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{function}: {name} must be True or False, got {value!r}")


def _check_targets(targets: Mapping[str, object], mesh: DeviceMesh) -> _Problem | None:
    """What this rank's module must satisfy (every rank checks its own)."""
    for key, target in targets.items():
        if not isinstance(target, torch.Tensor):
            return _Problem(
                TypeError,
                f"the module's state-dict entry '{key}' is a {type(target).__name__} (extra state), not a tensor; "
                "load it with module.load_state_dict(..., strict=False) and the tensors with this function",
            )
        local = target.to_local() if isinstance(target, DTensor) else target
        if local.is_meta:
            return _Problem(
                ValueError,
                f"the module's '{key}' is on the meta device; materialize the module before loading values into "
                "it: module.to_empty(device=...) after fc.fully_shard, then load",
            )
        if not isinstance(target, DTensor):
            continue
        if target.device_mesh.get_coordinate() is None:
            return _Problem(
                ValueError,
                f"the module's '{key}' is a DTensor on a mesh this rank is not part of ({target.device_mesh}); "
                "every sharded entry must live on the module's mesh",
            )
        for placement in target.placements:
            if not isinstance(placement, (Shard, _StridedShard, Replicate)):
                return _Problem(
                    ValueError,
                    f"the module's '{key}' has placement {placement}; only Shard, Replicate (and FSDP's strided "
                    "shard) DTensors can be loaded from a full tensor",
                )
    return None


def _check_state_dict(state_dict: object, targets: Mapping[str, torch.Tensor], param_keys: set[str]) -> _Problem | None:
    """What the full state dict must satisfy (checked where it is read: every rank, or the broadcast source)."""
    if not isinstance(state_dict, Mapping):
        return _Problem(
            TypeError,
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__} (with "
            "broadcast_from_rank0=True the other ranks pass {})",
        )
    missing = [k for k in targets if k not in state_dict]
    unexpected = [k for k in state_dict if k not in targets]
    if missing or unexpected:
        return _Problem(
            ValueError,
            f"the full state dict does not match the module: missing keys {_listing(missing)}, unexpected keys "
            f"{_listing(unexpected)}; load a checkpoint of the same model (fc.full_state_dict of it)",
        )
    for key, target in targets.items():
        value = state_dict[key]
        what = "parameter" if key in param_keys else "buffer"
        if isinstance(value, DTensor):
            return _Problem(
                TypeError,
                f"full state dict entry '{key}' is a DTensor; a full state dict holds plain tensors (gather it with "
                "fc.full_state_dict, or load a sharded state dict with module.load_state_dict)",
            )
        if not isinstance(value, torch.Tensor):
            return _Problem(TypeError, f"full state dict entry '{key}' is a {type(value).__name__}, not a tensor")
        if value.is_meta:
            return _Problem(
                ValueError,
                f"full state dict entry '{key}' is on the meta device and holds no values (built under "
                "torch.device('meta') and never filled?); load a checkpoint with real tensors",
            )
        if tuple(value.shape) != tuple(target.shape):
            return _Problem(
                ValueError,
                f"full state dict entry '{key}' has shape {tuple(value.shape)}, the module's {what} has "
                f"{tuple(target.shape)}; load a checkpoint of the same model configuration",
            )
        if not _castable(value.dtype, target.dtype):
            return _Problem(
                ValueError,
                f"full state dict entry '{key}' has dtype {value.dtype}, the module's {what} has {target.dtype}; "
                "only floating-point to floating-point (or complex to complex) values are cast on load — convert "
                f"the entry to {target.dtype} first if that is what you mean",
            )
    return None


def _castable(source: torch.dtype, target: torch.dtype) -> bool:
    """The dtype rule: equal, or both floating point, or both complex (a cast ``copy_`` does exactly)."""
    if source == target:
        return True
    if source.is_floating_point and target.is_floating_point:
        return True
    return source.is_complex and target.is_complex


def _listing(keys: list[str]) -> str:
    shown = [repr(k) for k in keys[:_KEYS_LISTED]]
    if len(keys) > _KEYS_LISTED:
        shown.append(f"... {len(keys) - _KEYS_LISTED} more")
    return "[" + ", ".join(shown) + "]"


def _fingerprint(targets: Mapping[str, object], broadcast_from_rank0: bool) -> int:
    """A hash (non-negative, below 2**56) of the module's entries and the call's mode: equal on every rank of an
    SPMD program, so a difference means a broadcast or a local piece would not line up."""
    digest = hashlib.blake2b(digest_size=7)
    digest.update(repr(broadcast_from_rank0).encode())
    for key, target in targets.items():
        if isinstance(target, torch.Tensor):
            placements = tuple(target.placements) if isinstance(target, DTensor) else ()
            digest.update(repr((key, tuple(target.shape), str(target.dtype), placements)).encode())
        else:
            digest.update(repr((key, type(target).__name__)).encode())
    return int.from_bytes(digest.digest(), "big")


# ---------------------------------------------------------------------- pieces
def _local_piece(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` for ``target``'s placements (``torch.chunk`` semantics on every cut).

    Plain shards apply in mesh-dim order; a ``_StridedShard`` (FSDP on a dim TP already cut) applies after them,
    on the piece they left: exactly how fully_shard built the local tensor.
    """
    mesh = target.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # _check_targets rejects this before anything is written
        raise RuntimeError(f"rank {dist.get_rank()} is not part of the mesh {mesh} of a DTensor being loaded")
    placements: list[tuple[int, Placement]] = list(enumerate(target.placements))
    ordered = [p for p in placements if not isinstance(p[1], _StridedShard)]
    ordered += [p for p in placements if isinstance(p[1], _StridedShard)]
    piece = full
    for mesh_dim, placement in ordered:
        if isinstance(placement, (Shard, _StridedShard)):
            chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece
