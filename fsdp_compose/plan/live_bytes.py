"""Peak live tensor bytes during a region of code, counted the same way for every implementation and every backend.

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

The peak is the largest sum of tracked sizes right after an op. :func:`tensors_since` finds every Python-visible
tensor (and bare storage) that appeared since a snapshot taken before the model was built, which covers storages
parked at 0 bytes between steps (unsharded parameters) so their regrowth is counted from 0.

The same counting works on real tensors (gloo, NCCL) and on ``FakeTensorMode`` tensors, whose storages are
meta-device storages with real sizes and no data: the planner (:mod:`fsdp_compose.plan`) runs the library's own
step under ``FakeTensorMode`` and this counter.

What is and isn't counted:

- counted: every storage an op returns (forward activations, autograd-saved tensors, gradients, all-gather output
  buffers allocated with ``torch.empty``, reduce-scatter buffers, optimizer temporaries), resizes of tracked storages,
  and the inner tensors of tensor subclasses (a ``DTensor``'s local tensor, via ``__tensor_flatten__``);
- a storage first seen as an op *input* that was never registered was made where this mode could not see it:
  - inside :meth:`LiveBytesCounter.collective_scope` (a caller may enter it around collective calls and every
    ``Work.wait()``), it is a collective's temporary, allocated in the backend's worker thread and touched again on
    the calling thread (gloo's copy of a reduce-scatter's input): counted from then until freed, summed in
    ``late_bytes``;
    the copy exists from the call on, so a caller that knows it (gloo's asynchronous reduce-scatter) counts it
    from the call to the wait with :meth:`LiveBytesCounter.hold` / :meth:`LiveBytesCounter.release`;
  - anywhere else, with ``unseen="hidden"`` (the default), it is a buffer that existed before the step without a
    Python object, e.g. DDP's gradient buckets (allocated by its C++ reducer, first touched in backward): counted as
    alive since the start at its current size (added to the baseline and to the running peak), summed in
    ``hidden_bytes``. With ``unseen="ignore"`` such storages are not counted at all; the most of them alive at once
    is kept in ``ignored_peak_bytes`` (backend temporaries the planner cannot simulate land here on gloo);
- not counted: temporaries that live and die inside one op (e.g. inside a gloo collective or inside a DTensor
  op's own dispatch, where this mode is not active), allocator overhead and fragmentation, and non-tensor memory.

Labels: :meth:`LiveBytesCounter.label` names storages (``"sharded parameters"``, ``"optimizer state"``, ...); every
unlabelled storage counts as :data:`DEFAULT_LABEL`. Each phase's peak keeps the identities and sizes of the storages
alive at it (a dict copy), so :meth:`LiveBytesCounter.breakdown` can name them with labels given later.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["DEFAULT_LABEL", "LiveBytesCounter", "live_storage_keys", "storages_of", "tensors_since"]

DEFAULT_LABEL = "activations and temporaries"


def _tensors(obj: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (nested tuples, lists and dicts); faster than pytree."""
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _tensors(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, found)
    return found


def _metadata_ops() -> frozenset[Any]:
    """Ops that only read metadata (a fake tensor's ``.device`` is dispatched as ``prim.device``)."""
    found: list[Any] = []
    for namespace, name in (("prim", "device"), ("prim", "layout"), ("aten", "sym_size"), ("aten", "sym_stride")):
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            found.extend(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


_METADATA_OPS = _metadata_ops()


def _result_is_input_ops() -> frozenset[Any]:
    """Ops whose result is their input tensor (a real kernel returns it; a fake kernel may return a fresh one)."""
    packet = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
    return frozenset() if packet is None else frozenset(getattr(packet, o) for o in packet.overloads())


_RESULT_IS_INPUT_OPS = _result_is_input_ops()


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages holding ``tensor``'s data: its own, or its inner tensors' for a wrapper subclass."""
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, attr) for attr in attrs)
        return [st for t in inner if isinstance(t, torch.Tensor) for st in storages_of(t)]
    if tensor.is_meta or tensor.layout != torch.strided:
        return []
    try:
        return [torch.Tensor.untyped_storage(tensor)]  # the method itself, whatever a subclass puts in front
    except (NotImplementedError, RuntimeError):  # e.g. functional tensors
        return []


def _gc_storages(fake: bool) -> Iterator[torch.UntypedStorage]:
    """Storages of every Python-visible tensor and every bare ``UntypedStorage`` object.

    ``fake``: the storages of a ``FakeTensorMode`` run, i.e. meta storages only (a fake tensor made from a real
    constant, such as an optimizer's ``step``, keeps that small real tensor alive: it is not the simulated memory).
    Otherwise: real storages, and the storages of fake tensors, but not bare meta storages (a meta-device model).
    """
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some lazy module objects warn about
        if issubclass(kind, torch.Tensor):
            for st in storages_of(obj):
                if not fake or st.device.type == "meta":
                    yield st
        elif issubclass(kind, torch.UntypedStorage) and (obj.device.type == "meta") == fake:
            yield obj


def live_storage_keys(*, fake: bool = False) -> dict[int, torch.UntypedStorage]:
    """A snapshot of the live Python-visible storages; holding the dict keeps their keys from being reused.

    ``fake``: of a ``FakeTensorMode`` run (meta storages only).
    """
    gc.collect()
    return {st._cdata: st for st in _gc_storages(fake)}


def tensors_since(snapshot: dict[int, torch.UntypedStorage], *, fake: bool = False) -> list[torch.UntypedStorage]:
    """Storages alive now (Python-visible) that were not in ``snapshot``: what was created after it."""
    gc.collect()
    fresh: dict[int, torch.UntypedStorage] = {}
    for st in _gc_storages(fake):
        if st._cdata not in snapshot:
            fresh[st._cdata] = st
    return list(fresh.values())


class LiveBytesCounter(TorchDispatchMode):
    """Tracks live storage bytes op by op; ``peak_bytes`` is the maximum, ``baseline_bytes`` the start.

    ``phase`` (settable at any time) names the part of the step running now; ``phase_peaks`` holds each phase's
    peak and :meth:`breakdown` the bytes per label at that peak. Labels may be given after the peak (a buffer is
    recognised as a reduce-scatter's input only when the collective runs): a peak keeps the identities of the
    storages alive then, and a storage's label is looked up when the breakdown is asked for.

    ``see_through_subclasses``: for ops on ``DTensor`` arguments, let DTensor run first and count the ops it issues
    on its local tensors (its temporaries and the collectives of its redistributions); by default the op is seen
    once, from outside, as in the benchmarks.

    ``refresh="watched"``: after each op, re-read the sizes of the op's own storages and of the storages passed to
    :meth:`watch` (those resized outside ops, e.g. unsharded parameters), instead of every tracked storage; a storage
    whose size is found changed is watched from then on, and one found at 0 bytes is not (until an op uses it
    again). O(watched and non-empty) instead of O(live) per op; the caller must watch every storage that
    ``UntypedStorage.resize_`` may shrink.
    """

    def __init__(
        self,
        *,
        unseen: Literal["hidden", "ignore"] = "hidden",
        see_through_subclasses: bool = False,
        refresh: Literal["all", "watched"] = "all",
    ) -> None:
        super().__init__()
        self.unseen = unseen
        self.see_through_subclasses = see_through_subclasses
        self.refresh = refresh
        self._watched: set[int] = set()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._gen: dict[int, int] = {}  # key -> generation of the storage tracked under it now
        self._next_gen = 0
        self._labels: dict[tuple[int, int], str] = {}  # (key, generation) -> label; kept after the storage dies
        self._ignored: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._ignored_sizes: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.late_bytes = 0
        self.hidden_bytes = 0
        self.ignored_bytes = 0
        self.ignored_peak_bytes = 0
        self._in_collective = 0
        self.ops = 0
        self.phase = "step"
        self.phase_peaks: dict[str, int] = {}
        self.phase_peak_op: dict[str, str] = {}
        self._peak_live: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
        self.on_new_peak: Callable[[], None] | None = None

    # ------------------------------------------------------------------ labels
    def label(self, items: Iterable[torch.UntypedStorage | torch.Tensor], name: str, *, replace: bool = False) -> None:
        """Name the storages of ``items`` (tracking new ones); without ``replace`` a named storage keeps its name."""
        for item in items:
            for st in storages_of(item) if isinstance(item, torch.Tensor) else [item]:
                key = st._cdata
                if key not in self._sizes:
                    self._track(st)
                ident = (key, self._gen[key])
                if replace or ident not in self._labels:
                    self._labels[ident] = name

    def label_of(self, st: torch.UntypedStorage) -> str | None:
        """The name given to a tracked storage (:data:`DEFAULT_LABEL` when none), ``None`` when untracked."""
        key = st._cdata
        if key not in self._sizes:
            return None
        return self._labels.get((key, self._gen[key]), DEFAULT_LABEL)

    def breakdown(self, phase: str) -> dict[str, int]:
        """Bytes per label at ``phase``'s peak (labels as they are now), largest first."""
        sizes, gens = self._peak_live.get(phase, ({}, {}))
        totals: dict[str, int] = {}
        for key, nbytes in sizes.items():
            if nbytes:
                name = self._labels.get((key, gens[key]), DEFAULT_LABEL)
                totals[name] = totals.get(name, 0) + nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def set_phase(self, name: str) -> None:
        """Start phase ``name``; its peak is at least what is live now."""
        self.phase = name
        self._note_peak(None)

    # ------------------------------------------------------------------ tracking
    def watch(self, items: Iterable[torch.UntypedStorage | torch.Tensor]) -> None:
        """Re-read these storages' sizes after every op (``refresh="watched"``); tracks them when new."""
        for item in items:
            for st in storages_of(item) if isinstance(item, torch.Tensor) else [item]:
                self._track(st)
                self._watched.add(st._cdata)

    def register(self, storages: Iterable[torch.UntypedStorage | torch.Tensor]) -> None:
        """Count already-alive storages (or tensors) as the starting point."""
        for item in storages:
            for st in storages_of(item) if isinstance(item, torch.Tensor) else [item]:
                self._track(st)
        self.baseline_bytes = self.current_bytes
        self._note_peak(None)

    def hold(self, owner: object, nbytes: int, name: str = DEFAULT_LABEL) -> None:
        """Count ``nbytes`` a backend holds for ``owner`` (a collective's ``Work``) where no op of this thread shows
        them, until :meth:`release`: gloo's copy of an asynchronous reduce-scatter's input, made inside the call."""
        key = -id(owner)  # never a storage's key (those are addresses)
        self.release(owner)
        self._sizes[key] = nbytes
        self._gen[key] = self._next_gen
        self._next_gen += 1
        self._labels[(key, self._gen[key])] = name
        self.current_bytes += nbytes
        self._note_peak(None)

    def release(self, owner: object) -> None:
        """Stop counting what :meth:`hold` counted for ``owner`` (nothing if it counts nothing)."""
        key = -id(owner)
        if key in self._sizes:
            self.current_bytes -= self._sizes.pop(key)
            self._gen.pop(key, None)

    def _track(self, st: torch.UntypedStorage) -> int:
        """Start tracking ``st``; returns its bytes when it was new, else 0."""
        key = st._cdata
        if key in self._sizes:
            return 0
        nbytes = st.nbytes()
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(st, self._freed_callback(key))
        self._gen[key] = self._next_gen
        self._next_gen += 1
        self.current_bytes += nbytes
        return nbytes

    def _freed_callback(self, key: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            if key not in self._refs:
                return
            self.current_bytes -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)
            self._gen.pop(key, None)
            self._watched.discard(key)

        return freed

    def _refresh_sizes(self, seen: list[torch.UntypedStorage]) -> None:
        if self.refresh == "watched":
            for st in seen:
                key = st._cdata
                old = self._sizes.get(key)
                if old is not None and st.nbytes() != old:
                    self._watched.add(key)
            keys: Iterable[int] = list(self._watched)
        else:
            keys = list(self._refs)
        for key in keys:
            ref = self._refs.get(key)
            storage = ref() if ref is not None else None
            if storage is None:
                continue
            nbytes = storage.nbytes()
            old = self._sizes[key]
            if nbytes != old:
                self._sizes[key] = nbytes
                self.current_bytes += nbytes - old
            if not nbytes:
                # Freed (resized to 0): only growth can follow, and a re-grown storage is written by the next op
                # that uses it, where the check above sees it and watches it again.
                self._watched.discard(key)

    def _track_unseen(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self._sizes or key in self._ignored:
            return
        if self.unseen == "ignore" and not self._in_collective:
            self._ignore(st)
            return
        nbytes = self._track(st)
        if not nbytes:
            return
        if self._in_collective:
            self.late_bytes += nbytes  # a collective's temporary: alive from now
        else:
            self.hidden_bytes += nbytes  # a pre-existing C++-only buffer: alive since the start
            self.baseline_bytes += nbytes
            self.peak_bytes += nbytes

    def _hand_over(self, st: torch.UntypedStorage) -> None:
        """``st``'s data is now another storage's (a fake ``wait_tensor`` result): stop counting it."""
        key = st._cdata
        if key not in self._sizes:
            return
        self.current_bytes -= self._sizes.pop(key)
        self._refs.pop(key, None)
        self._gen.pop(key, None)
        self._watched.discard(key)
        self._ignored[key] = weakref.ref(st, lambda _: self._ignored.pop(key, None))

    def _ignore(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        nbytes = st.nbytes()

        def freed(_: Any) -> None:
            self.ignored_bytes -= self._ignored_sizes.pop(key, 0)
            self._ignored.pop(key, None)

        self._ignored[key] = weakref.ref(st, freed)
        self._ignored_sizes[key] = nbytes
        self.ignored_bytes += nbytes
        self.ignored_peak_bytes = max(self.ignored_peak_bytes, self.ignored_bytes)

    @contextlib.contextmanager
    def collective_scope(self) -> Iterator[None]:
        """Marks code inside a collective: unseen storages met here are its temporaries, not old buffers."""
        self._in_collective += 1
        try:
            yield
        finally:
            self._in_collective -= 1

    def close(self) -> None:
        """Stop following frees (drops the weak references); peaks and their breakdowns stay readable."""
        self._refs.clear()
        self._sizes.clear()
        self._ignored.clear()
        self._ignored_sizes.clear()

    def _note_peak(self, func: Any) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self.current_bytes > self.phase_peaks.get(self.phase, -1):
            if self.on_new_peak is not None:
                self.on_new_peak()
            self.phase_peaks[self.phase] = self.current_bytes
            self._peak_live[self.phase] = (dict(self._sizes), dict(self._gen))
            self.phase_peak_op[self.phase] = "" if func is None else str(func)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return func(*args, **kwargs)  # reads metadata (a fake tensor's device): allocates nothing
        if self.see_through_subclasses and any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs and issues its ops on local tensors, which come back here
        seen: list[torch.UntypedStorage] = []
        for leaf in _tensors(kwargs, _tensors(args, [])):
            for st in storages_of(leaf):
                self._track_unseen(st)
                seen.append(st)
        out = func(*args, **kwargs)
        self.ops += 1
        outputs = [st for leaf in _tensors(out, []) for st in storages_of(leaf)]
        self._refresh_sizes(seen + outputs)
        if func in _RESULT_IS_INPUT_OPS and seen and outputs and seen[0]._cdata != outputs[0]._cdata:
            self._hand_over(seen[0])
        for st in outputs:
            self._track(st)
        self._note_peak(func)
        return out
