"""Running the library's own training step for one rank of a large world, in this process, without the memory.

Two substitutions and nothing else:

- **the fake process group** (``dist.init_process_group("fake", ...)``, torch's): any world size and rank, every
  collective returns at once without moving data; meshes, sub-groups and DTensor work as on a real backend;
- **FakeTensorMode**: every tensor is a fake tensor whose storage is a meta storage with a real size and no data;
  ops compute shapes, dtypes, strides and aliasing exactly as the real kernels would (the CPU kernels: the
  simulated device is ``cpu``).

The fsdp_compose code that runs is the code a real job runs, with no branch of its own for the simulation. Two
adaptations, both here:

- a fake tensor's ``data_ptr()`` is 0 for every storage, so code asking "do these tensors share memory?" by comparing
  data pointers would always hear yes (fsdp_compose's reshard compares the full parameter's storage with the shard's,
  to avoid freeing a parameter kept whole; it would then never free the first parameter of each unit).
  :class:`StorageIdentity` gives fake tensors data pointers that tell storages apart;
- a fake tensor has no data to read back, and a step reads back one tensor: the backward's agreement, a row made from
  Python numbers and all-reduced with MAX (``agreement.start_agreement``). Every simulated rank is the rank simulated,
  so MAX returns the row this rank made. :class:`SimulatedTensorMode` keeps what such a tensor was made from, and
  :class:`StorageIdentity` answers ``tolist()`` with it.

Real tensors are untouched.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["SimulatedTensorMode", "StorageIdentity", "clear_dtensor_caches", "fake_process_group", "fake_tensors"]

_OVERRIDES = ("data_ptr", "untyped_storage")
_FAKE_TOLIST = FakeTensor.tolist  # reads each element with item(): raises for data a simulation does not have


class SimulatedTensorMode(FakeTensorMode):
    """``FakeTensorMode`` that remembers the real tensor each fake tensor made from Python data (``torch.tensor``,
    which hands its real result to ``lift_fresh``) stands for, so ``tolist()`` can give the simulated rank's values."""

    def __init__(self) -> None:
        super().__init__()
        self.made_from: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().dispatch(func, types, args, kwargs)
        if func in self.lift_fns and type(args[0]) is torch.Tensor:
            self.made_from[out] = args[0]
        elif func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and args[0] in self.made_from:
            # The engine moves the row to the mesh's device and joins two rows into one read: the values stay known.
            source: torch.Tensor = self.made_from[args[0]]
            self.made_from[out] = source.to(dtype=out.dtype)
        elif func is torch.ops.aten.cat.default and all(t in self.made_from for t in args[0]):
            self.made_from[out] = torch.cat([self.made_from[t] for t in args[0]], *args[1:])
        return out


class StorageIdentity:
    """While active: ``data_ptr()`` of a fake tensor is distinct per storage (and offset), and 0 for the storage
    most recently returned by ``untyped_storage()``.

    A meta storage's own ``UntypedStorage.data_ptr()`` is always 0 and cannot be changed. Comparisons of the form
    ``a.untyped_storage().data_ptr() != b.data_ptr()`` come out right when ``b.data_ptr()`` is 0 exactly when ``b``
    lives (at offset 0) on the storage just obtained from ``a``; comparisons of two tensors' ``data_ptr()`` come out
    right because both are translated. Real tensors are untouched.

    ``tolist()`` of a fake tensor made from Python data under a :class:`SimulatedTensorMode` gives that data (any
    other fake tensor's is torch's).

    Mechanism: the three methods are set on ``FakeTensor`` (torch's class) for the duration and removed on exit. A
    ``TorchFunctionMode`` would be the scoped tool, but torch does not carry function modes into autograd's
    backward hooks, where fsdp_compose reshards after backward. This is the planner's only process-wide change,
    undone on exit; entering it twice at once raises.
    """

    def __init__(self) -> None:
        self._last: weakref.ref[torch.UntypedStorage] | None = None

    def _untyped_storage(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        storage = torch.Tensor.untyped_storage(tensor)
        self._last = weakref.ref(storage)
        return storage

    def _data_ptr(self, tensor: torch.Tensor) -> int:
        storage = torch.Tensor.untyped_storage(tensor)
        offset = int(tensor.storage_offset()) * tensor.element_size()
        last = self._last() if self._last is not None else None
        return offset if storage is last else int(storage._cdata) + offset

    def __enter__(self) -> StorageIdentity:
        if any(name in vars(FakeTensor) for name in _OVERRIDES) or FakeTensor.tolist is not _FAKE_TOLIST:
            raise RuntimeError("FakeTensor already has data_ptr/untyped_storage/tolist overrides (nested planner run?)")
        identity = self

        def data_ptr(tensor: torch.Tensor) -> int:
            return identity._data_ptr(tensor)

        def untyped_storage(tensor: torch.Tensor) -> torch.UntypedStorage:
            return identity._untyped_storage(tensor)

        FakeTensor.data_ptr = data_ptr  # type: ignore[method-assign,assignment]
        FakeTensor.untyped_storage = untyped_storage  # type: ignore[method-assign,assignment]
        FakeTensor.tolist = _made_from_tolist  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for name in _OVERRIDES:
            if name in vars(FakeTensor):
                delattr(FakeTensor, name)
        FakeTensor.tolist = _FAKE_TOLIST  # type: ignore[method-assign]
        self._last = None


def _made_from_tolist(tensor: FakeTensor) -> Any:
    made_from = getattr(tensor.fake_mode, "made_from", None)
    source = made_from.get(tensor) if made_from is not None else None
    return _FAKE_TOLIST(tensor) if source is None else source.tolist()


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions.

    DTensor caches them per (op, argument specs), and a spec's mesh compares equal to a mesh of an earlier process
    group with the same shape and names: a plan after another one would get decisions that carry the earlier mesh
    (and redistribute over its destroyed groups). Cleared when a fake world starts and when it ends, so neither the
    next plan nor the host process's own DTensors meet the planner's meshes.
    """
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(type(propagator), "_propagate_tensor_meta_cached", None),
    ):
        cache_clear = getattr(cache, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """The default process group is torch's fake one for the duration (this process must not have one)."""
    if dist.is_initialized():
        raise RuntimeError(
            "fsdp_compose.plan simulates ranks with torch's fake process group and needs a process without a "
            "default process group; plan before dist.init_process_group, or in a separate process "
            "(python -m fsdp_compose.plan ...)"
        )
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend's constructor)

    store = dist.HashStore()  # type: ignore[attr-defined]
    clear_dtensor_caches()
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


@contextlib.contextmanager
def fake_tensors() -> Iterator[SimulatedTensorMode]:
    """Fake tensors with storage identities (enter after the mesh exists: a mesh needs its real rank table)."""
    with warnings.catch_warnings(), SimulatedTensorMode() as mode, StorageIdentity():
        # a meta storage's data_ptr() warns (torch deprecates it for fake tensors); StorageIdentity's note says why
        # reading it is harmless here
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield mode
