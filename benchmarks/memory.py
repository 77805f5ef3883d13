"""Peak live tensor bytes during a region of code, counted the same way for every implementation.

``LiveBytesCounter`` is a ``TorchDispatchMode``. It keeps one entry per live *untyped storage* (keyed by the
storage's ``_cdata``, the address of its ``StorageImpl``, which is stable for the storage's whole life, unlike
``data_ptr()`` which changes on every resize) with the bytes it held when last looked at, and

- **registers** a storage the first time it is seen: pre-existing ones through :meth:`LiveBytesCounter.register`
  (parameters, gradients, optimizer state, the implementation's internal buffers — see :func:`tensors_since`), new
  ones when an op returns a tensor on them;
- **frees** it through a ``weakref`` callback on the storage object: torch keeps a storage's Python object alive as
  long as its ``StorageImpl`` is (PyObject preservation), so the callback fires exactly when the memory is released,
  also when the last owner is a view, the autograd graph or C++ code;
- **re-reads** ``storage.nbytes()`` of every tracked storage after every op. fsdp_compose and torch's FSDP2 both free
  unsharded parameters with ``tensor.untyped_storage().resize_(0)`` and allocate them again with ``resize_(n)``;
  ``UntypedStorage.resize_`` is not an ATen op, so no dispatch mode sees it. Re-reading sizes after each op sees the
  new size at the latest when the next op runs (the copy into a re-grown storage is such an op), identically for all
  implementations. Cost: O(live storages) per op, fine for a single non-timed step.

The peak is the largest sum of tracked sizes right after an op. Each implementation is measured with only its own
model alive; :func:`tensors_since` finds every Python-visible tensor (and bare storage) that appeared since a snapshot
taken before the model was built, which covers storages parked at 0 bytes between steps (fsdp_compose's and FSDP2's
unsharded parameters) so their regrowth is counted from 0.

What is and isn't counted:

- counted: every storage an op returns (forward activations, autograd-saved tensors, gradients, all-gather output
  buffers allocated with ``torch.empty``, reduce-scatter buffers, optimizer temporaries), resizes of tracked storages,
  and the inner tensors of tensor subclasses (a ``DTensor``'s local tensor, via ``__tensor_flatten__``);
- a storage first seen as an op *input* that was never registered was made where this mode could not see it:
  - inside :meth:`LiveBytesCounter.collective_scope` (``run.py`` enters it around every collective call and every
    ``Work.wait()``), it is a collective's temporary, allocated in gloo's worker thread and touched again on the
    calling thread (a reduce-scatter's copy of its input): counted from then until freed, summed in ``late_bytes``;
  - anywhere else, it is a buffer that existed before the step without a Python object, e.g. DDP's gradient buckets
    (allocated by its C++ reducer, first touched in backward): counted as alive since the start at its current size
    (added to the baseline and to the running peak), summed in ``hidden_bytes``. This needs a steady-state step:
    DDP re-allocates its buckets (visibly) in its second step, so ``run.py`` measures the third;
- not counted: temporaries that live and die inside one op (e.g. inside a gloo collective or inside a DTensor
  op's own dispatch, where this mode is not active), allocator overhead and fragmentation, and non-tensor memory.
  Collectives that return tensors through the dispatcher (``c10d`` ops) are seen like any op, and their outputs
  are buffers already allocated by an earlier op, so nothing is double counted.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytesCounter", "live_storage_keys", "storages_of", "tensors_since"]


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages holding ``tensor``'s data: its own, or its inner tensors' for a wrapper subclass."""
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, attr) for attr in attrs)
        return [st for t in inner if isinstance(t, torch.Tensor) for st in storages_of(t)]
    if tensor.is_meta or tensor.layout != torch.strided:
        return []
    try:
        return [tensor.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # e.g. functional or fake tensors
        return []


def _gc_storages() -> Iterator[torch.UntypedStorage]:
    """Storages of every Python-visible tensor and every bare ``UntypedStorage`` object."""
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some lazy module objects warn about
        if issubclass(kind, torch.Tensor):
            yield from storages_of(obj)
        elif issubclass(kind, torch.UntypedStorage) and obj.device.type != "meta":
            yield obj


def live_storage_keys() -> dict[int, torch.UntypedStorage]:
    """A snapshot of the live Python-visible storages; holding the dict keeps their keys from being reused."""
    gc.collect()
    return {st._cdata: st for st in _gc_storages()}


def tensors_since(snapshot: dict[int, torch.UntypedStorage]) -> list[torch.UntypedStorage]:
    """Storages alive now (Python-visible) that were not in ``snapshot``: what was created after it."""
    gc.collect()
    fresh: dict[int, torch.UntypedStorage] = {}
    for st in _gc_storages():
        if st._cdata not in snapshot:
            fresh[st._cdata] = st
    return list(fresh.values())


class LiveBytesCounter(TorchDispatchMode):
    """Tracks live storage bytes op by op; ``peak_bytes`` is the maximum, ``baseline_bytes`` the start."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.late_bytes = 0
        self.hidden_bytes = 0
        self._in_collective = 0
        self.ops = 0

    # ------------------------------------------------------------------ tracking
    def register(self, storages: Iterable[torch.UntypedStorage | torch.Tensor]) -> None:
        """Count already-alive storages (or tensors) as the starting point."""
        for item in storages:
            for st in storages_of(item) if isinstance(item, torch.Tensor) else [item]:
                self._track(st)
        self.baseline_bytes = self.current_bytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _track(self, st: torch.UntypedStorage) -> int:
        """Start tracking ``st``; returns its bytes when it was new, else 0."""
        key = st._cdata
        if key in self._sizes:
            return 0
        nbytes = st.nbytes()
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(st, self._freed_callback(key))
        self.current_bytes += nbytes
        return nbytes

    def _freed_callback(self, key: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            self.current_bytes -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

        return freed

    def _refresh_sizes(self) -> None:
        for key, ref in list(self._refs.items()):
            st = ref()
            if st is None:
                continue
            nbytes = st.nbytes()
            old = self._sizes.get(key)
            if old is not None and nbytes != old:
                self._sizes[key] = nbytes
                self.current_bytes += nbytes - old

    def _track_unseen(self, st: torch.UntypedStorage) -> None:
        nbytes = self._track(st)
        if not nbytes:
            return
        if self._in_collective:
            self.late_bytes += nbytes  # a collective's temporary: alive from now
        else:
            self.hidden_bytes += nbytes  # a pre-existing C++-only buffer: alive since the start
            self.baseline_bytes += nbytes
            self.peak_bytes += nbytes

    @contextlib.contextmanager
    def collective_scope(self) -> Iterator[None]:
        """Marks code inside a collective: unseen storages met here are its temporaries, not old buffers."""
        self._in_collective += 1
        try:
            yield
        finally:
            self._in_collective -= 1

    def close(self) -> None:
        """Stop following frees (drops the weak references)."""
        self._refs.clear()
        self._sizes.clear()

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                for st in storages_of(leaf):
                    self._track_unseen(st)
        out = func(*args, **kwargs)
        self.ops += 1
        self._refresh_sizes()
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for st in storages_of(leaf):
                    self._track(st)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out
